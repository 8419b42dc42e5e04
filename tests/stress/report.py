"""Print the passes of stress result files as one Markdown table (the README's).

    python -m tests.stress.report tests/stress/results/*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("pass", "code", "differing", "preemptions", "tokens from kvbm", "G1→G2", "G2→G3", "G2→G1",
           "G3→G1", "G3→G2", "failed loads", "worker restarts", "TTFT p99", "longest request")


def code_of(result: dict) -> str:
    """The code a result ran: a label, "fixes" (another checkout), or the commit, short.
    (Older files hold ``git describe --dirty``; newer ones provenance's full hash and ``dirty``.)"""
    if result.get("label") or result.get("kvbm_src"):
        return result.get("label") or "fixes"
    commit = result["commit"]
    return "main " + (commit if "-" in commit else commit[:7] + ("-dirty" if result.get("dirty") else ""))


def row(result: dict, p: dict) -> list[str]:
    if p.get("error"):
        return [p["name"], code_of(result), "error", *[""] * (len(COLUMNS) - 3)]
    kv = p["kvbm"]
    return [p["name"], code_of(result), f"**{p['differing_count']}**/{p['requests']}", f"{p['preemptions']:.0f}",
            f"{p['external_hit_tokens']:.0f}", f"{kv['kvbm_offload_blocks_d2h']:.0f}",
            f"{kv['kvbm_offload_blocks_h2d']:.0f}", f"{kv['kvbm_onboard_blocks_h2d']:.0f}",
            f"{kv['kvbm_onboard_blocks_d2d']:.0f}", f"{kv['kvbm_promoted_blocks']:.0f}",
            f"{p['engine_log'].get('vllm_recovered_load_failures', 0)}", str(p.get("restarts", {}).get("worker", 0)),
            f"{p['ttft_p99_s']:.1f} s",
            f"{p['longest_request_s']:.1f} s"]


def main(argv: list[str]) -> int:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for path in argv:
        result = json.loads(Path(path).read_text())
        for p in result["passes"]:
            print("| " + " | ".join(row(result, p)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
