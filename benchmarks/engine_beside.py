"""A vLLM engine held beside another benchmark on the same GPU, idle or busy.

    python3 benchmarks/engine_beside.py --ready FILE --stop FILE [--busy] [--model DIR]
        [--max-len 24576] [--g1-gb 4] [--ctx-len 20000]

Why (2026-11-27, nineteenth session): beside vLLM the kvbm worker's copy lane spends CPU time in
proportion to a piece's bytes (0.25-0.37 ms + bytes at 61-70 GB/s a piece, H100 and H200), where
the same daemon without vLLM issues a 256 MiB piece in ~0.7 ms (``benchmarks/lane_issue.py``,
README). An engine process that only exists beside ``daemon_layer_loads.py`` (``idle``), or one
that computes (``--busy``: cold prefills of ``--ctx-len`` tokens back to back, vLLM alone without a
connector), says whether the engine's presence or its work costs the worker (runbook step
``beside20``). Answered in the twentieth session (H100 "o", README): neither does; the cost is one
copy per page of vLLM 0.26's per-layer KV tensors (``daemon_layer_loads.py --layout per-layer``).

The engine is vLLM's ``LLM`` with the harness's shared settings (``vllm_peers.base_engine_kwargs``:
eager, dummy weights, ``--g1-gb`` of KV cache). Once it answered one prompt it creates ``--ready``;
it stops when ``--stop`` exists (checked every 50 ms, or between two prompts when busy) and
prints one JSON line: how long it ran and how many prompts it served.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vllm_peers import base_engine_kwargs, write_model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ready", type=Path, required=True)
    ap.add_argument("--stop", type=Path, required=True)
    ap.add_argument("--busy", action="store_true", help="cold prefills back to back (else the engine idles)")
    ap.add_argument("--model", default="/tmp/qwen3-4b-shape", help="a model directory (its config.json is "
                    "written if missing: Qwen3-4B's shape, weights made up by vLLM)")
    ap.add_argument("--max-len", type=int, default=24576)
    ap.add_argument("--g1-gb", type=float, default=4.0)
    ap.add_argument("--ctx-len", type=int, default=20000)
    ap.add_argument("--tiny", action="store_true", help="a two-layer model (a smoke test on vLLM's CPU build)")
    args = ap.parse_args()
    if args.tiny or not (Path(args.model) / "config.json").exists():
        write_model_config(args.model, args.tiny)
    from vllm import LLM, SamplingParams
    engine_args = argparse.Namespace(model=args.model, max_len=args.max_len, cuda_graphs=False, system="baseline",
                                     g1_gb=args.g1_gb, hit_sources=False)
    llm = LLM(**base_engine_kwargs(engine_args))
    sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1000, 1600))}], sp, use_tqdm=False)
    args.ready.touch()
    t0, served = time.monotonic(), 0
    while not args.stop.exists():
        if args.busy:  # a new prompt each time: nothing comes from the engine's own prefix cache
            prompt = [(served * 7919 + i) % 30000 + 1000 for i in range(args.ctx_len)]
            llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            served += 1
        else:
            time.sleep(0.05)
    print(json.dumps({"engine_beside": "busy" if args.busy else "idle", "ran_s": round(time.monotonic() - t0, 1),
                      "prompts": served}), flush=True)


if __name__ == "__main__":
    main()
