"""``kvbm doctor``: checks a node before it serves and says what to do about each problem.

One module per group of checks (:mod:`.sizes`, :mod:`.disk`, :mod:`.cuda`, :mod:`.nixl`,
:mod:`.services`, :mod:`.node`); :mod:`.runner` runs them into a report, :mod:`.report`
renders it, :mod:`.cli` is the subcommand. Every check is ``check(ctx) -> CheckResult``.
"""
from .base import CheckResult, DoctorContext, DoctorOptions, LayoutArg, Status
from .runner import ALL_CHECKS, Report, run_checks

__all__ = ["ALL_CHECKS", "CheckResult", "DoctorContext", "DoctorOptions", "LayoutArg", "Report", "Status",
           "run_checks"]
