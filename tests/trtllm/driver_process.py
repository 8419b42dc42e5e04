"""Run one driver with kvbm's TensorRT-LLM connector in a process of its own: a fresh engine.

    python tests/trtllm/driver_process.py --out result.json [--device cpu] [--rounds 3]

The connector finds the node through the environment (``DYN_KVBM_*``,
``KVBM_TRTLLM_CONNECTOR_CONFIG``), as TensorRT-LLM's would. Writes, per request, the output
tokens and where its prefix came from, and the run's counters. Every pass is byte-checked; a
mismatch exits non-zero.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "standins"), str(HERE.parent)]  # the stand-ins first, then the trtllm package

import torch  # noqa: E402

from trtllm.driver import Driver  # noqa: E402
from trtllm.kvbm_node import kvbm_factories  # noqa: E402
from trtllm.scenarios import CONFIG, chats  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import tensorrt_llm
    assert getattr(tensorrt_llm, "__standin__", False), "the stand-in must be imported, not a real TensorRT-LLM"
    config = dataclasses.replace(CONFIG, device=args.device)
    with Driver(config, kvbm_factories()) as driver:
        report = driver.run(chats(rounds=args.rounds))
    args.out.write_text(json.dumps({
        "results": {name: dataclasses.asdict(r) for name, r in report.results.items()},
        "stats": dataclasses.asdict(report.stats)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
