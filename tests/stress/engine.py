"""Serve a stress workload with the real vLLM engine and write what it did as JSON.

Runs in the vLLM venv as a script (started by ``tests/stress/harness.py``), with kvbm's
connector (``--kvbm``) or without it (the baseline). Every wave's requests go to one
``LLM.generate`` call, so up to ``--max-num-seqs`` of them run concurrently and the small
G1 makes vLLM preempt (recompute mode). A marker file ``wave-K.start`` / ``wave-K.end``
in ``--marker-dir`` lets the harness time its faults against the workload.

    python tests/stress/engine.py --model DIR --workload W.json --out R.json [--kvbm] ...

Options for the GPU build (vLLM 0.26) are here too: ``--async-scheduling on``,
``--cuda-graphs`` (else eager), ``--block-size 16``; the CPU build forces async scheduling off.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True, help="JSON written by tests/stress/workload.py")
    p.add_argument("--out", required=True)
    p.add_argument("--marker-dir", default="")
    p.add_argument("--kvbm", action="store_true", help="serve through kvbm's connector")
    p.add_argument("--kvbm-extra", default="{}", help="kv_connector_extra_config (JSON)")
    p.add_argument("--g1-bytes", type=int, default=3 << 20, help="kv_cache_memory_bytes (G1)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--cuda-graphs", action="store_true", help="compiled mode with CUDA graphs (GPU)")
    return p.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = dict(model=args.model, enforce_eager=not args.cuda_graphs, block_size=args.block_size,
              max_model_len=args.max_model_len, seed=0, dtype=args.dtype, kv_cache_memory_bytes=args.g1_bytes,
              enable_prefix_caching=True, max_num_seqs=args.max_num_seqs, disable_log_stats=False)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.async_scheduling != "auto":
        kw["async_scheduling"] = args.async_scheduling == "on"
    if args.kvbm:
        kw["kv_transfer_config"] = {"kv_connector": "KvbmConnector",
                                    "kv_connector_module_path": "kvbm_client.connectors.vllm",
                                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": json.loads(args.kvbm_extra)}
    return kw


def record(out) -> dict:
    """One finished request: its tokens and what vLLM measured of it."""
    m = out.metrics
    rec = {"output": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}
    if m is not None:
        rec.update(ttft=m.first_token_latency, preemptions=getattr(m, "num_preemptions", None),  # not in 0.26
                   e2e=(m.last_token_ts - m.queued_ts) if m.queued_ts else None)
    return rec


def metric_values(llm) -> dict:
    """vLLM's counters, one entry per label set (``name{k=v}``)."""
    values = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None or m.name.endswith("_info"):
            continue
        labels = {k: v for k, v in (getattr(m, "labels", None) or {}).items() if k not in ("engine", "model_name")}
        name = m.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        values[name] = values.get(name, 0) + value
    return values


def mark(marker_dir: str, name: str) -> None:
    if marker_dir:
        Path(marker_dir, name).write_text(str(time.time()))


def main(argv=None) -> None:
    args = parse_args(argv)
    # NOTE: vLLM reserves a CPU for a connector, which changes the OMP thread count; one thread
    # bound to core 0 in every run (with and without kvbm) keeps the numerics identical.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    # NOTE: the CPU attention may split a long context's KV into chunks chosen from the whole
    # batch's shape (so a request's sums could depend on its batch mates). Off in every run: a
    # baseline must not depend on batch composition (tests/stress/README.md shows it does not).
    os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
    from vllm import LLM, SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    requests = {r["id"]: r for r in workload["requests"]}
    t_start = time.time()
    llm = LLM(**engine_kwargs(args))
    t_ready = time.time()
    records, waves = {}, []
    for k, wave in enumerate(workload["waves"]):
        time.sleep(wave.get("pause_before_s", 0.0))
        prompts = [{"prompt_token_ids": requests[i]["prompt"]} for i in wave["ids"]]
        params = [SamplingParams(max_tokens=requests[i]["max_tokens"], temperature=0.0, ignore_eos=True)
                  for i in wave["ids"]]
        mark(args.marker_dir, f"wave-{k}.start")
        t0 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        waves.append({"start": t0, "seconds": time.time() - t0, "requests": len(prompts)})
        mark(args.marker_dir, f"wave-{k}.end")
        for req_id, out in zip(wave["ids"], outs):
            records[req_id] = record(out)
    result = {"records": records, "metrics": metric_values(llm), "waves": waves,
              "startup_s": t_ready - t_start, "engine_kwargs": {k: v for k, v in engine_kwargs(args).items()},
              "vllm_version": __import__("vllm").__version__}
    Path(args.out).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()  # EngineCore and workers stop (the connector's shutdown runs)


if __name__ == "__main__":
    main()
