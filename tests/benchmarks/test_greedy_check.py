"""benchmarks/greedy_check.py: each system's greedy outputs against the reference's, per request."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import greedy_check  # noqa: E402


def run(system: str, outs: list[list[int]], pass_index: int = 0) -> dict:
    return {"system": system, "pass": pass_index,
            "rows": [{"user": i % 3, "round": i // 3, "output": out} for i, out in enumerate(outs)]}


REF = [[1, 2], [3, 4], [5, 6], [7, 8]]


def test_identical_outputs_in_every_pass_count_and_a_changed_token_does_not(tmp_path):
    records = [{"provenance": {}}, run("baseline", REF), run("ours", REF), run("ours", REF, 1),
               run("other", [[1, 2], [3, 9], [5, 6], [7, 8]])]
    assert greedy_check.check(records, "baseline") == {"ours": (8, 8), "other": (3, 4)}
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "greedy_check.py"), str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "ours: 8/8 identical" in out.stdout and "other: 3/4" in out.stdout


def test_a_missing_request_differs_and_no_reference_is_an_error():
    assert greedy_check.check([run("baseline", REF), run("ours", REF[:3])], "baseline") == {"ours": (3, 4)}
    with pytest.raises(ValueError):
        greedy_check.check([run("ours", REF)], "baseline")
