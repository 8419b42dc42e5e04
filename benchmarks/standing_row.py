"""One row of the README's "Where kvbm stands" table, from one harness result file.

    python3 benchmarks/standing_row.py RESULTS [--label TEXT] [--kvbm SLOT]

Prints ``| LABEL (`FILE`) | native | LMCache 0.5.3 | Dynamo KVBM 1.6.1 | kvbm | kvbm / LMCache |``:
each cell is the median over the passes of each pass's warm p50 / p90 in ms (``peer_passes.summarize``,
as ``ttft_breakdown.py`` prints them), "DNR" after a figure whose passes differ by more than 10 %,
the lowest p50 of the row in bold, "(N of M passes)" after a system that ran fewer passes to the end
than the row's most (a run cut short), and "–" for a system that did not run. The kvbm column is the
first ``ours*`` slot of the file (``--kvbm`` picks another); the last column is its p50 over
LMCache's. So the table is regenerated from the files, with the command that made each row.
"""
from __future__ import annotations

import argparse
import os

from peer_passes import TOLERANCE, summarize
from ttft_breakdown import load_runs

#: the table's peer columns: (header, the harness systems that fill it, first found wins)
COLUMNS = (("native", ("native",)), ("LMCache 0.5.3", ("lmcache", "lmcache_timed")),
           ("Dynamo KVBM 1.6.1", ("dynamo",)))


def good_passes(s: dict) -> int:
    """How many of a summary's passes ran to the end (a failed or missing pass does not count)."""
    return len(s["passes"]) - len(s["failed_passes"])


def cell(s: dict | None, bold: bool, most: int = 1) -> str:
    """``p50 / p90`` of a summary, with DNR marks (or "–": not run, "failed": no pass ran), and
    "(N of M passes)" where the system ran fewer passes to the end than the row's most (a run cut
    short: its figures are not medians over as many passes as its neighbours')."""
    if s is None:
        return "–"
    p50, p90 = s["warm_ttft_p50_median"], s["warm_ttft_p90_median"]
    if p50 is None or p90 is None:
        return "failed"

    def dnr(k: str) -> bool:
        return s[f"{k}_spread"] is not None and s[f"{k}_spread"] > TOLERANCE

    a = f"{p50 * 1e3:.1f}" + (" DNR" if dnr("warm_ttft_p50") else "")
    b = f"{p90 * 1e3:.1f}" + (", p90 DNR" if dnr("warm_ttft_p90") and not dnr("warm_ttft_p50") else "")
    if dnr("warm_ttft_p90") and dnr("warm_ttft_p50"):
        b += " DNR"
    text = f"**{a} / {b}**" if bold else f"{a} / {b}"
    n = good_passes(s)
    return text + (f" ({n} of {most} passes)" if n < most else "")


def row(path: str, label: str, kvbm: str | None = None) -> str:
    sums = {s["summary"]: s for s in summarize(load_runs(path))}
    picked: list[dict | None] = [next((sums[n] for n in names if n in sums), None) for _, names in COLUMNS]
    ours = sums.get(kvbm) if kvbm else next((s for n, s in sums.items() if n.startswith("ours")), None)
    if kvbm and ours is None:
        raise SystemExit(f"{path}: no slot {kvbm!r} (slots: {', '.join(sums)})")
    every = picked + [ours]
    p50s = [s["warm_ttft_p50_median"] for s in every if s is not None and s["warm_ttft_p50_median"] is not None]
    best = min(p50s) if p50s else None
    most = max(good_passes(s) for s in sums.values())
    cells = [cell(s, s is not None and s["warm_ttft_p50_median"] == best, most) for s in every]
    lmcache, mine = picked[1], ours
    ratio = (f"{mine['warm_ttft_p50_median'] / lmcache['warm_ttft_p50_median']:.2f}×"
             if mine and lmcache and mine["warm_ttft_p50_median"] and lmcache["warm_ttft_p50_median"] else "–")
    name = f"`{os.path.basename(path)}`"
    first = f"{label[:-1]}: {name})" if label.endswith(")") else f"{label} ({name})"
    return f"| {first} | " + " | ".join(cells) + f" | {ratio} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--label", default="", help="the row's first cell, before the file name; one that ends in "
                    "\"(machine, session)\" gets the name inside: \"20K, CUDA graphs (j, 17th: `FILE`)\"")
    ap.add_argument("--kvbm", default=None, help="the kvbm slot to show [default: the file's first ours* slot]")
    args = ap.parse_args()
    print(row(args.results, args.label or "workload, mode (machine, session)", args.kvbm))


if __name__ == "__main__":
    main()
