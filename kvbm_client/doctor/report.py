"""Rendering a :class:`~kvbm_client.doctor.runner.Report`: a table for people, JSON for tools.

Runs in ``kvbm doctor``; pure formatting, no I/O beyond returning strings.
"""
from __future__ import annotations

import json
import textwrap

from .base import Status
from .runner import Report

_LABEL = {Status.OK: "ok", Status.INFO: "info", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "skip"}


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False) or [""]


def render_table(report: Report, width: int = 140) -> str:
    """Columns CHECK | RESULT | WHAT TO DO, long cells wrapped; a summary line last."""
    name_w = max([len("CHECK")] + [len(f.check.id) for f in report.findings])
    room = max(60, width - name_w - 8)
    msg_w, fix_w = room * 3 // 5, room - room * 3 // 5
    lines = [f"{'CHECK':{name_w}}  {'RESULT':{msg_w + 6}}  WHAT TO DO", "-" * min(width, name_w + room + 8)]
    for f in report.findings:
        r = f.result
        msg, fix = _wrap(r.message, msg_w), _wrap(r.remedy, fix_w) if r.remedy else [""]
        for i in range(max(len(msg), len(fix))):
            name = f.check.id if i == 0 else ""
            label = _LABEL[r.status] if i == 0 else ""
            m = msg[i] if i < len(msg) else ""
            x = fix[i] if i < len(fix) else ""
            lines.append(f"{name:{name_w}}  {label:4}  {m:{msg_w}}  {x}".rstrip())
    counts = report.counts()
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    verdict = "FAILED" if report.failed else "no failures"
    lines.append(f"{len(report.findings)} checks in {report.seconds:.2f} s: {summary} -> {verdict} "
                 f"(exit {report.exit_code})")
    return "\n".join(lines)


def render_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str)
