"""benchmarks/lane_issue.py reads the worker's own debug line (made here by the worker's
``Landed.describe``, prefixed as ``runner.py`` logs it) and derives the pieces' bytes, the
issue rate and the copy engine's idle time from it."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import lane_issue  # noqa: E402

from kvbm_worker.grouping import GroupPacing, group_pieces  # noqa: E402
from kvbm_worker.jobs import Landed, PieceTimes, ThreadUsage  # noqa: E402

BLOCKS, PAGES, PAGE = 120, 36, 64 << 10


def worker_line(issue_ms: float, dma_gbps: float, with_usage: bool = True) -> tuple[str, list[int]]:
    """A load whose every piece takes ``issue_ms`` to issue and moves at ``dma_gbps`` once issued."""
    pacing = GroupPacing(piece_bytes=8 << 20)
    bounds = pacing.bounds(PAGES, 6)
    pieces = group_pieces(BLOCKS, bounds, PAGE, pacing.piece_bytes)
    sizes = [(hi - lo) * (p1 - p0) * PAGE for lo, hi, (p0, p1), _ in pieces]
    landed = Landed(PAGES, 6)
    t, gpu_free = 1.0, 1.0  # ms after the job started; the copy engine's next free moment
    for n in sizes:
        issued = t + issue_ms
        gpu_free = max(gpu_free, issued) + n / (dma_gbps * 1e6)
        usage = ThreadUsage(issue_ms / 1e3, issue_ms / 4e3, n >> 20, 0) if with_usage else None
        landed.pieces.append(PieceTimes(landed.t0 + t / 1e3, landed.t0 + issued / 1e3, landed.t0 + gpu_free / 1e3,
                                        gpu_ms=gpu_free - 1.0, usage=usage))
        t = issued
    for end in bounds:
        landed.advance(end, landed.t0 + gpu_free / 1e3)
    total = BLOCKS * PAGES * PAGE  # (the prefix as runner.py logs it)
    line = f"DEBUG kvbm.worker: job 7 load: {BLOCKS} blocks, {total} bytes in {gpu_free:.2f} ms{landed.describe()}"
    return line, sizes


@pytest.mark.parametrize("issue_ms,idle", [(0.05, False), (4.0, True)])
def test_a_load_line_gives_bytes_rates_and_the_idle_copy_engine(issue_ms: float, idle: bool) -> None:
    line, sizes = worker_line(issue_ms, dma_gbps=5.0)
    rows = lane_issue.job_rows("noise\n" + line + "\n")
    assert len(rows) == 1 and rows[0]["blocks"] == BLOCKS
    pacing = GroupPacing(piece_bytes=8 << 20)
    assert lane_issue.piece_bytes(rows[0], PAGES, pacing) == sizes
    out = lane_issue.analyse(rows[0], PAGES, pacing)
    assert out["issue_gbps"] == pytest.approx(statistics.median([n / (issue_ms * 1e6) for n in sizes]), rel=0.05)
    assert out["issue_sys_share"] == pytest.approx(0.25, abs=0.02)
    assert out["faults_per_mib"] == pytest.approx(sum(n >> 20 for n in sizes) / (BLOCKS * PAGES * PAGE / (1 << 20)),
                                                  rel=0.01)
    assert out["dma_gbps"] == pytest.approx(5.0, rel=0.1)  # (times are logged to 0.1 ms)
    if idle:  # the lane is slower than the DMA: the copy engine waits for every piece after the first
        assert out["dma_idle_ms"] > 0.5 * issue_ms * len(sizes)
    else:
        assert out["dma_idle_ms"] < 0.5


def test_lines_without_usage_still_parse() -> None:
    line, _ = worker_line(1.0, 50.0, with_usage=False)
    out = lane_issue.analyse(lane_issue.job_rows(line)[0], PAGES, GroupPacing(piece_bytes=8 << 20))
    assert out["issue_gbps"] is None and "issue_sys_share" not in out and out["dma_idle_ms"] > 0


def test_the_idle_time_before_each_piece_and_the_fit_of_the_issue_cost() -> None:
    line, sizes = worker_line(4.0, dma_gbps=5.0)
    pacing = GroupPacing(piece_bytes=8 << 20)
    out = lane_issue.analyse(lane_issue.job_rows(line)[0], PAGES, pacing)
    summary = lane_issue.summarize([out, out])
    assert len(summary["idle_before_piece_ms"]) == len(sizes)
    assert sum(summary["idle_before_piece_ms"]) == pytest.approx(out["dma_idle_ms"], abs=0.05)
    assert summary["idle_before_piece_ms"][0] == pytest.approx(4.0, abs=0.1), "the first piece's whole issue"
    pairs = [(n, 0.3 + n / 65e6) for n in (4 << 20, 32 << 20, 128 << 20, 256 << 20)]  # 0.3 ms + bytes at 65 GB/s
    assert lane_issue.fit(pairs) == {"pieces": 4, "fixed_ms": pytest.approx(0.3, abs=1e-3),
                                     "gbps": pytest.approx(65.0, abs=0.1),
                                     "us_per_page": pytest.approx(65536 / 65e3, abs=1e-3)}  # 64 KiB at 65 GB/s
    assert lane_issue.fit(pairs, 32 << 10)["us_per_page"] == pytest.approx(32768 / 65e3, abs=1e-3)
