"""Where a layer-grouped load's copy lane spends its time, read from the worker's debug log.

    python3 benchmarks/lane_issue.py WORKER_LOG [WORKER_LOG ...] [--pages 36] [--piece-mb 256]
        [--shape front] [--min-blocks 1] [--max-blocks N] [--fit [--page-kib 64]] [--json out.json]

Each ``job N load: ... pieces (issue began, issued, landed) ...`` line (``kvbm-worker`` at
``DYN_LOG=debug``, a load the connector's ``layerwise`` mode ran in layer groups) gives, per
piece, when the lane began and ended issuing it, when it landed by the GPU's clock, and the
lane's CPU time issuing it (since the nineteenth session, 2026-11-27, also its kernel time, minor page faults and
involuntary switches). The pieces' bytes are not in the line: they follow from the load's block
count, the region's pages per block (``--pages``, 36 for Qwen3-4B) and the worker's cutting
(``--piece-mb``, ``--shape``: :func:`kvbm_worker.grouping.group_pieces`, as the worker ran).

Per load it reports:
* ``issue_gbps``: each piece's bytes over the lane's CPU time issuing it (median over pieces).
  A cost per copy gives a rate that grows with the copies' size; a rate near the DMA's own says
  the issue costs per byte, or waits for the copy engine;
* ``dma_idle_ms``: time the copy engine had nothing of this load to do after the lane began the
  first piece: before piece k's issue ended, after piece k-1 landed. This assumes a piece's bytes
  start to move only when the call that issues them returns, as the batched calls' did (a 256 MiB
  piece landed a full DMA time after its call returned, 2026-11-27k). With ``--cuda-copy runs``
  (a call per copy) copies move during the piece's issue: there it overstates the idle time, and
  ``dma_gbps`` means nothing;
* ``issued_after_prev_landed_ms``: median of (piece k issued) - (piece k-1 landed, GPU clock);
  near 0 when each issue ends as the previous piece lands;
* the kernel's share of the issue CPU, minor faults per MiB issued, involuntary switches.

Summary (per file): medians over the loads with ``--min-blocks`` to ``--max-blocks`` blocks, and
(``idle_before_piece_ms``) the median idle time before each piece, over the loads cut into the most
common number of pieces. ``--fit``: one least-squares line through every piece of every file, the
lane's issue CPU against the piece's bytes: a fixed cost per piece plus bytes at a rate, and that
rate as a cost per page (``--page-kib``, 64 for Qwen3-4B). Where no two pages of a block merge (a KV
cache allocated per layer, as vLLM 0.26's V2 model runner gives Qwen3: one copy per page; found in
the twentieth session, 2026-11-27) the bytes count the copies, and ``us_per_page`` is the driver's
cost per copy; with a cross-layer buffer a piece is one copy per block.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
from pathlib import Path

from provenance import provenance

from kvbm_worker.grouping import PIECE_BYTES, GroupPacing, GroupShape, group_pieces

JOB_LINE = re.compile(r"job (\d+) load: (\d+) blocks, (\d+) bytes in ([0-9.]+) ms; groups landed on the lane at "
                      r"(\[[^]]*\]) ms, on the loop at (\[[^]]*\]) ms after the job started; pieces \(issue began, "
                      r"issued, landed\) at (\[.*?\]) ms(?:; by the GPU's clock landed at (\[[^]]*\]) ms)?"
                      r"(?:; the lane's CPU time issuing each piece (\[[^]]*\]) ms)?"
                      r"(?:, ([0-9.]+) ms of it in the kernel; minor page faults per piece (\[[^]]*\]); "
                      r"preempted (\d+) times)?")


def med(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def job_rows(text: str) -> list[dict]:
    """Every layer-grouped load's debug line in ``text``, parsed (lists in ms, as logged)."""
    rows = []
    for line in text.splitlines():
        m = JOB_LINE.search(line)
        if not m:
            continue
        pieces = ast.literal_eval(m.group(7))
        rows.append({"job": int(m.group(1)), "blocks": int(m.group(2)), "bytes": int(m.group(3)),
                     "lane_ms": float(m.group(4)), "groups_lane": ast.literal_eval(m.group(5)), "pieces": pieces,
                     "gpu_landed": ast.literal_eval(m.group(8)) if m.group(8) else [],
                     "issue_ms": [round(p[1] - p[0], 2) for p in pieces],
                     "issue_cpu_ms": ast.literal_eval(m.group(9)) if m.group(9) else [],
                     "issue_sys_ms": float(m.group(10)) if m.group(10) else None,
                     "faults": ast.literal_eval(m.group(11)) if m.group(11) else [],
                     "preempted": int(m.group(12)) if m.group(12) else None,
                     "first_issue_began": pieces[0][0] if pieces else None})
    return rows


def piece_bytes(row: dict, pages: int, pacing: GroupPacing) -> list[int] | None:
    """Each piece's bytes as the worker cut the load (None where the cut does not match the line)."""
    page = row["bytes"] // row["blocks"] // pages
    cut = group_pieces(row["blocks"], pacing.bounds(pages, len(row["groups_lane"])), page, pacing.piece_bytes)
    if len(cut) != len(row["pieces"]):
        return None
    return [(hi - lo) * (p1 - p0) * page for lo, hi, (p0, p1), _ in cut]


def analyse(row: dict, pages: int, pacing: GroupPacing) -> dict:
    """One load's figures (see the module docstring); None where the line lacks what they need."""
    out: dict = {"job": row["job"], "blocks": row["blocks"], "lane_ms": row["lane_ms"], "pieces": len(row["pieces"])}
    sizes = piece_bytes(row, pages, pacing)
    cpu, gpu, pcs = row["issue_cpu_ms"], row["gpu_landed"], row["pieces"]
    out["issue_cpu_ms"] = round(sum(cpu), 2) if cpu else None
    out["issue_gbps"] = med([b / (c * 1e6) for b, c in zip(sizes, cpu) if c > 0]) if sizes and cpu else None
    if sizes and cpu:
        out["pieces_bytes_cpu_ms"] = list(zip(sizes, cpu))
    if gpu:
        # before the first piece: its issue (nothing of it moved yet); before piece k: piece k's
        # issue ending after piece k-1 landed
        before = [max(0.0, pcs[0][1] - pcs[0][0])] + [max(0.0, pcs[k][1] - gpu[k - 1]) for k in range(1, len(pcs))]
        idle = sum(before)
        out["idle_before_ms"] = [round(t, 2) for t in before]
        out["dma_idle_ms"] = round(idle, 2)
        out["issued_after_prev_landed_ms"] = med([pcs[k][1] - gpu[k - 1] for k in range(1, len(pcs))])
        out["dma_gbps"] = round(row["bytes"] / ((gpu[-1] - pcs[0][0] - idle) * 1e6), 1) if gpu[-1] > idle else None
    if row["issue_sys_ms"] is not None and cpu:
        out["issue_sys_share"] = round(row["issue_sys_ms"] / max(sum(cpu), 1e-9), 3)
        out["faults_per_mib"] = round(sum(row["faults"]) / (row["bytes"] / (1 << 20)), 3)
        out["preempted"] = row["preempted"]
    return out


def summarize(loads: list[dict]) -> dict:
    keys = ("lane_ms", "issue_cpu_ms", "issue_gbps", "dma_idle_ms", "issued_after_prev_landed_ms", "dma_gbps",
            "issue_sys_share", "faults_per_mib", "preempted")
    out = {"loads": len(loads), **{k: med([x[k] for x in loads if x.get(k) is not None]) for k in keys}}
    cuts = [len(x["idle_before_ms"]) for x in loads if "idle_before_ms" in x]
    if cuts:
        n = statistics.mode(cuts)
        same = [x["idle_before_ms"] for x in loads if len(x.get("idle_before_ms", ())) == n]
        out["idle_before_piece_ms"] = [med([b[i] for b in same]) for i in range(n)]
    return out


def fit(pairs: list[tuple[int, float]], page_bytes: int = 64 << 10) -> dict:
    """Least squares of the issue CPU (ms) against a piece's bytes: fixed ms a piece + bytes at GB/s
    (and that rate as microseconds per ``page_bytes``)."""
    import numpy as np
    x = np.array([b for b, _ in pairs], dtype=float) / 1e6  # MB
    y = np.array([c for _, c in pairs], dtype=float)
    (fixed, ms_per_mb), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)
    return {"pieces": len(pairs), "fixed_ms": round(float(fixed), 3),
            "gbps": round(1.0 / float(ms_per_mb), 1) if ms_per_mb > 0 else None,
            "us_per_page": round(float(ms_per_mb) * page_bytes / 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--pages", type=int, default=36, help="the region's pages per block [36]")
    ap.add_argument("--piece-mb", type=float, default=PIECE_BYTES / (1 << 20), help="the worker's --load-piece-mb")
    ap.add_argument("--shape", default=GroupShape.FRONT.value, choices=[s.value for s in GroupShape])
    ap.add_argument("--min-blocks", type=int, default=1, help="only loads of at least this many blocks")
    ap.add_argument("--max-blocks", type=int, default=None, help="only loads of at most this many blocks")
    ap.add_argument("--fit", action="store_true", help="fit the issue CPU against the bytes over every piece")
    ap.add_argument("--page-kib", type=int, default=64, help="a page's size, for --fit's cost per page [64]")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    pacing = GroupPacing(int(args.piece_mb * (1 << 20)), shape=GroupShape(args.shape))
    report: dict = {}
    pairs = []
    for path in args.logs:
        loads = [analyse(r, args.pages, pacing) for r in job_rows(path.read_text(errors="replace"))
                 if args.min_blocks <= r["blocks"] <= (args.max_blocks or r["blocks"])]
        report[str(path)] = {"summary": summarize(loads), "loads": loads}
        pairs += [p for x in loads for p in x.pop("pieces_bytes_cpu_ms", ())]  # (for --fit; not kept)
        print(path, json.dumps(report[str(path)]["summary"]))
    out: dict = {"provenance": provenance(), "args": {k: str(v) for k, v in vars(args).items()}, "files": report}
    if args.fit and pairs:
        out["issue_fit"] = fit(pairs, args.page_kib << 10)
        print("issue_fit", json.dumps(out["issue_fit"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
