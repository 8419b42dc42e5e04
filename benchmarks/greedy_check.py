"""Are a harness run's greedy outputs identical to the reference system's?

    python3 benchmarks/greedy_check.py RESULT.jsonl [--reference baseline]

``RESULT.jsonl``: a ``vllm_peers.py`` result with ``--max-tokens`` > 1 (runbook steps ``greedy``,
``greedyg``, ...: ``baseline`` is vLLM without a connector). For every other system, each request's
output token ids (matched by user and round, in every pass) are compared with the reference's.
Prints ``SYSTEM: N/M identical`` per system and exits 1 if a request differs or is missing, 2 if
the file has no reference rows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def outputs(rows: list[dict]) -> dict[tuple[int, int], list[int]]:
    return {(int(r["user"]), int(r["round"])): list(r["output"]) for r in rows}


def check(records: list[dict], reference: str) -> dict[str, tuple[int, int]]:
    """``{system: (identical, compared)}`` over every pass of every non-reference system."""
    runs = [r for r in records if "system" in r and "rows" in r]
    refs = [outputs(r["rows"]) for r in runs if r["system"] == reference]
    if not refs:
        raise ValueError(f"no rows of the reference system {reference!r}")
    ref = refs[0]
    result: dict[str, tuple[int, int]] = {}
    for run in runs:
        if run["system"] == reference:
            continue
        mine = outputs(run["rows"])
        same = sum(1 for key, out in ref.items() if mine.get(key) == out)
        done, total = result.get(run["system"], (0, 0))
        result[run["system"]] = (done + same, total + len(ref))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path)
    ap.add_argument("--reference", default="baseline")
    args = ap.parse_args()
    records = [json.loads(line) for line in args.result.read_text().splitlines() if line.strip()]
    try:
        result = check(records, args.reference)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    for system, (same, total) in result.items():
        print(f"{system}: {same}/{total} identical to {args.reference}")
    return 0 if result and all(same == total for same, total in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
