"""benchmarks/standing_row.py: one README row from a result file — medians over the passes, DNR on
each figure whose passes differ by more than 10 %, bold on the row's lowest p50, "–" for a peer
that did not run, and kvbm's p50 over LMCache's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import standing_row  # noqa: E402


def line(system: str, p: int, p50: float, p90: float) -> dict:
    return {"system": system, "pass": p, "warm_ttft_p50": p50, "warm_ttft_p90": p90, "warm_cached_frac": 0.99,
            "rows": [{"round": 0, "user": 0, "ttft_s": 0.5, "t0": 0.0, "cached": 0, "output": [1]}]}


def test_a_row_from_two_passes(tmp_path: Path) -> None:
    f = tmp_path / "vllm026_ttft_20k_x.jsonl"
    runs = [line("native", 0, 0.120, 0.150), line("lmcache", 0, 0.090, 0.100), line("ours_layerwise", 0, 0.080, 0.090),
            line("ours_layerwise", 1, 0.082, 0.091), line("lmcache", 1, 0.070, 0.101), line("native", 1, 0.121, 0.200)]
    f.write_text("\n".join(json.dumps(r) for r in runs) + "\n")
    text = standing_row.row(str(f), "20K, CUDA graphs (x, 27th)")
    assert text == ("| 20K, CUDA graphs (x, 27th: `vllm026_ttft_20k_x.jsonl`) | 120.5 / 175.0, p90 DNR "
                    "| **80.0 DNR / 100.5** | – | 81.0 / 90.5 | 1.01× |")


def test_a_named_kvbm_slot_must_exist(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(line("ours", 0, 0.08, 0.09)) + "\n")
    assert "| **80.0 / 90.0** | – |" in standing_row.row(str(f), "8K")
    with pytest.raises(SystemExit, match="no slot 'ours_layerwise'"):
        standing_row.row(str(f), "8K", kvbm="ours_layerwise")


def test_a_system_with_fewer_passes_says_so(tmp_path: Path) -> None:
    """A run cut short (the machine's time ran out) leaves one system a pass short: its cell says so,
    and a system that ran every pass gets no mark."""
    f = tmp_path / "r.jsonl"
    runs = [line("native", 0, 0.120, 0.150), line("lmcache", 0, 0.090, 0.100), line("ours_layerwise", 0, 0.080, 0.090),
            line("ours_layerwise", 1, 0.082, 0.091), line("lmcache", 1, 0.092, 0.101)]
    f.write_text("\n".join(json.dumps(r) for r in runs) + "\n")
    text = standing_row.row(str(f), "8K")
    assert "| 120.0 / 150.0 (1 of 2 passes) | 91.0 / 100.5 | – | **81.0 / 90.5** | 0.89× |" in text


def test_the_readme_rows_are_the_result_files_rows() -> None:
    """Every row of the README's "Where kvbm stands" table is what ``standing_row.py`` prints from
    the result file the row names, with the row's label: the table cannot drift from the files."""
    readme = (BENCH.parent / "README.md").read_text()
    section = readme.split("### Where kvbm stands")[1].split("\n### ")[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and ": `vllm026_" in r]
    assert len(rows) >= 8
    for r in rows:
        first = r.split(" | ")[0][2:]
        label, rest = first.split(": `", 1)
        name = rest.split("`")[0]
        assert standing_row.row(str(BENCH / "results" / name), label + ")") == r, name
