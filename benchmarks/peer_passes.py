"""Passes of the vLLM peers harness (``vllm_peers.py --passes N``): the order the systems run in,
and the summary over the passes. Pure logic: nothing here starts an engine.

The systems run N times, in order in even passes and in reverse in odd ones (A B C C B A A B C ...;
before 2026-11-26's eleventh session always in order), each in an engine started afresh per pass,
so a slow phase of the machine falls on every system rather than on one, and no system is always
the first engine on the machine or always the one after a given other. Per system (per *slot*: a
name listed twice, as in ``baseline,ours,ours``, is two slots ``ours`` and ``ours#2``) the summary
is the median over the passes of each pass's warm p50 and p90; a slot whose passes differ by more
than :data:`TOLERANCE` ((max - min) / min of either figure) did not reproduce, and so does a slot
with a failed pass.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Iterable

#: passes of one slot that differ by more than this, relative to the lowest, did not reproduce
TOLERANCE = 0.10
FIGURES = ("warm_ttft_p50", "warm_ttft_p90")

#: the seam to the engines: ``run_one(system, pass_index) -> result`` (``vllm_peers.run_engine``
#: starts an engine process; a result without ``"rows"`` is a failed run, with ``"error"``)
Runner = Callable[[str, int], dict]


def slots(systems: list[str]) -> list[str]:
    """A label per entry of ``systems``: the name, or ``name#k`` for its k-th entry (k >= 2)."""
    seen: dict[str, int] = {}
    out = []
    for name in systems:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def schedule(systems: list[str], passes: int) -> list[tuple[int, str, str]]:
    """``(pass, slot, system)`` in the order they run: every system of pass 0 in order, then of
    pass 1 in reverse, and so on."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, not {passes}")
    pairs = list(zip(slots(systems), systems))
    return [(p, slot, name) for p in range(passes) for slot, name in (pairs if p % 2 == 0 else pairs[::-1])]


def run_passes(systems: list[str], passes: int, run_one: Runner,
               emit: Callable[[dict], None] = lambda res: None) -> list[dict]:
    """Run :func:`schedule` through ``run_one``; each result gets ``pass`` and ``slot`` and is
    handed to ``emit`` as soon as it is in (a harness killed mid-way keeps what it had)."""
    results = []
    for p, slot, name in schedule(systems, passes):
        res = dict(run_one(name, p))
        res.setdefault("system", name)
        res.update({"pass": p, "slot": slot})
        emit(res)
        results.append(res)
    return results


def quantile(values: list[float], p: float) -> float:
    """The ``p`` quantile of ``values`` as the harness reports it: the value at index
    ``int(p * n)`` of the sorted values (the largest for p near 1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def spread(values: list[float]) -> float:
    """(max - min) / min: 0.1 = the slowest pass took 10 % longer than the fastest."""
    low = min(values)
    return (max(values) - low) / low if low > 0 else float("inf")


def summarize(results: Iterable[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """One summary per slot, in the order the slots first ran: each pass's warm p50 / p90 (None for
    a failed pass), their medians over the passes that ran, their spreads, and ``reproduced``
    (None with a single pass: nothing to compare)."""
    per_slot: dict[str, list[dict]] = {}
    for res in results:
        per_slot.setdefault(res.get("slot", res["system"]), []).append(res)
    out = []
    for slot, runs in per_slot.items():
        runs = sorted(runs, key=lambda r: r.get("pass", 0))
        ok = [r for r in runs if "rows" in r and all(r.get(k) is not None for k in FIGURES)]
        good = {id(r) for r in ok}
        s: dict[str, Any] = {"summary": slot, "system": runs[0]["system"], "passes": [r.get("pass", 0) for r in runs],
                             "failed_passes": [r.get("pass", 0) for r in runs if id(r) not in good]}
        for k in FIGURES:
            s[f"{k}_passes"] = [r.get(k) if id(r) in good else None for r in runs]
            vals = [r[k] for r in ok]
            s[f"{k}_median"] = round(statistics.median(vals), 4) if vals else None
            s[f"{k}_spread"] = round(spread(vals), 4) if len(vals) > 1 else None
        for k in ("warm_cached_frac", "mode", "cudagraph_mode"):
            vals = sorted({str(r[k]) for r in ok if r.get(k) is not None})
            if vals:
                s[k] = vals[0] if len(vals) == 1 else vals
        differ = [k for k in FIGURES if s[f"{k}_spread"] is not None and s[f"{k}_spread"] > tolerance]
        if len(runs) < 2:
            s["reproduced"] = None if ok else False
        else:
            s["reproduced"] = not differ and not s["failed_passes"]
        s["why_not"] = ([f"{k[10:]} passes differ by {s[f'{k}_spread'] * 100:.1f} % > {tolerance * 100:.0f} %"
                         for k in differ] + [f"pass {p} failed" for p in s["failed_passes"]])
        out.append(s)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def summary_line(s: dict) -> str:
    """One printed line: medians, each pass's value, and the verdict."""
    verdict = {None: "one pass", True: "reproduced"}.get(s["reproduced"],
                                                         "DID NOT REPRODUCE: " + "; ".join(s["why_not"]))
    per = " ".join(f"{_ms(a)}/{_ms(b)}" for a, b in zip(s["warm_ttft_p50_passes"], s["warm_ttft_p90_passes"]))
    return (f"{s['summary']:<12} p50 {_ms(s['warm_ttft_p50_median']):>7}  p90 {_ms(s['warm_ttft_p90_median']):>7} ms"
            f"  (median of passes; p50/p90 per pass: {per})  {verdict}")
