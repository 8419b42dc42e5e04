"""Running the checks: in a fixed order, each timed and guarded, into a :class:`Report`.

Runs in ``kvbm doctor``. A check that raises is reported as a failure of that check (the
other checks still run); a check that needs the configuration is skipped when it did not
parse. While checks run, anything written to stdout (native libraries' logs included) goes
to stderr, so ``--json`` output stays parseable.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from . import cuda, disk, g3, nixl, node, services, sizes
from .base import Check, CheckResult, DoctorContext, Status, fail, skip

#: Every check, in report order: configuration first, the running node last.
ALL_CHECKS: tuple[Check, ...] = (*sizes.CHECKS, *disk.CHECKS, *g3.CHECKS, *cuda.CHECKS, *nixl.CHECKS,
                                 *services.CHECKS, *node.CHECKS)


@dataclass(frozen=True)
class Finding:
    """One check's result in a report."""

    check: Check
    result: CheckResult
    seconds: float

    def to_dict(self) -> dict:
        r = self.result
        return {"check": self.check.id, "group": self.check.group, "status": r.status.value,
                "message": r.message, "remedy": r.remedy, "seconds": round(self.seconds, 3), "data": r.data}


@dataclass(frozen=True)
class Report:
    """All findings of one run; exit code 1 when any check failed (warnings do not fail)."""

    findings: tuple[Finding, ...]
    seconds: float

    @property
    def failed(self) -> bool:
        return any(f.result.status is Status.FAIL for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def counts(self) -> dict[str, int]:
        return {s.value: sum(f.result.status is s for f in self.findings) for s in Status}

    def get(self, check_id: str) -> CheckResult:
        """The result of ``group.name`` (KeyError when it did not run)."""
        for f in self.findings:
            if f.check.id == check_id:
                return f.result
        raise KeyError(check_id)

    def to_dict(self) -> dict:
        return {"ok": not self.failed, "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
                "counts": self.counts(), "checks": [f.to_dict() for f in self.findings]}


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send fd 1 (and ``sys.stdout``) to stderr for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_check(check: Check, ctx: DoctorContext) -> CheckResult:
    if check.needs_config and ctx.config is None:
        return skip("configuration does not parse (see config.parse)")
    try:
        return check.fn(ctx)
    except Exception as exc:  # a check must never take the others down
        return fail(f"the check itself failed: {type(exc).__name__}: {exc}",
                    "report it with the output of `kvbm doctor --json`")


def run_checks(ctx: DoctorContext, checks: Sequence[Check] = ALL_CHECKS) -> Report:
    """Run ``checks`` in order (those behind an option only when it is on)."""
    start = time.perf_counter()
    findings = []
    with stdout_to_stderr():
        for check in checks:
            if check.option is not None and not getattr(ctx.options, check.option):
                continue
            t0 = time.perf_counter()
            result = run_check(check, ctx)
            findings.append(Finding(check, result, time.perf_counter() - t0))
    return Report(tuple(findings), time.perf_counter() - start)
