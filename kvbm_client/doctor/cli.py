"""``kvbm doctor``: the subcommand's flags and its entry point.

Runs in the operator's shell. Flags are those of ``kvbm serve`` (every ``DYN_KVBM_*``
option, ``--workers``, ``--gpus``) plus the doctor's own; the exit code is 0 when no check
failed and 1 otherwise (2 for bad flags, as argparse does).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import replace

from ..config import add_config_arguments, config_from_args
from ..errors import KvbmConfigError
from ..sizing import stage_bytes
from .base import DoctorContext, DoctorOptions, LayoutArg

DESCRIPTION = ("Check this node before (or while) it serves: configuration and sizes, the G3 disk "
               "directory, CUDA, NIXL, etcd/NATS, the socket directory and metrics port, and the running "
               "node. Prints one line per check with what to do; exit 0 when nothing failed, 1 otherwise "
               "(warnings do not fail).")


def _gpus(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated device ordinals wanted, got {text!r}") from None


def _layout(text: str) -> LayoutArg:
    try:
        return LayoutArg.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_doctor_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kvbm doctor`` on the ``kvbm`` command's subparsers."""
    doctor = sub.add_parser("doctor", help="check this node (config, disk, CUDA, NIXL, services, running node)",
                            description=DESCRIPTION)
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--layout", type=_layout, default=None, metavar="LAYERS:PAGE_BYTES[:WORKERS]",
                        help="engine layout to size the pools in blocks [default: the running node's]")
    doctor.add_argument("--workers", type=int, default=1, help="CPU workers, as for kvbm serve [default 1]")
    doctor.add_argument("--gpus", type=_gpus, default=(), metavar="0,1,...",
                        help="CUDA devices, one worker each, as for kvbm serve; turns on the GPU checks' failures")
    doctor.add_argument("--bench-disk", action="store_true",
                        help="also measure write and read throughput of the G3 directory (a few seconds)")
    doctor.add_argument("--bench-h2d", action="store_true", help="also measure pinned H2D bandwidth (a second)")
    doctor.add_argument("--stage-mib", type=float, default=0.0, metavar="MIB",
                        help="each worker's staging area, as for kvbm serve: with --gpus, check that it fits each "
                             "GPU's free memory beside vLLM [default 0: none]")
    doctor.add_argument("--timeout", type=float, default=1.5, help="seconds per network probe [default 1.5]")
    add_config_arguments(doctor)
    doctor.set_defaults(func=cmd_doctor)
    return doctor


def context_from_args(args: argparse.Namespace) -> DoctorContext:
    """The run's context; a configuration that does not parse is recorded, not raised."""
    options = DoctorOptions(workers=args.workers, gpus=tuple(args.gpus), layout=args.layout,
                            bench_disk=args.bench_disk, bench_h2d=args.bench_h2d, timeout_s=args.timeout)
    try:
        options = replace(options, stage_bytes=stage_bytes(args.stage_mib))
        return DoctorContext(config_from_args(args), options=options)
    except KvbmConfigError as exc:
        return DoctorContext(None, str(exc), options=options)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .report import render_json, render_table  # the checks load only when doctor runs
    from .runner import run_checks

    report = run_checks(context_from_args(args))
    if args.json:
        print(render_json(report))
    else:
        print(render_table(report, shutil.get_terminal_size((140, 40)).columns))
    sys.stdout.flush()
    return report.exit_code
