"""Check of NIXL: the library loads, its POSIX backend starts, and it moves bytes to and from
a file in the G3 directory.

Runs in ``kvbm doctor``. It uses NIXL the way the worker's disk handler does
(``kvbm_worker/handlers/disk.py``): an agent with the POSIX backend, the file registered as
FILE memory, host buffers as DRAM, one WRITE then one READ transfer, polled to DONE/ERR.
kvbm_client never imports the worker, so those few calls are made here directly.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time

import numpy as np

from .base import Check, CheckResult, DoctorContext, fail, ok, skip, warn
from .disk import o_direct_works, prepared_dir, probe_file

PROBE_BYTES = 1 << 20
TRANSFER_TIMEOUT_S = 10.0


def load_nixl():
    """``(nixl_agent, nixl_agent_config)`` from the nixl-cu13 wheel or the nixl meta package."""
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    # NOTE: NIXL logs INFO lines to stdout, which would corrupt `kvbm doctor --json`.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def _transfer(agent, name: str, op: str, addr: int, fd: int) -> None:
    local = agent.get_xfer_descs([(addr, PROBE_BYTES, 0)], "DRAM")
    remote = agent.get_xfer_descs([(0, PROBE_BYTES, fd)], "FILE")
    handle = agent.initialize_xfer(op, local, remote, name)
    try:
        state, end = agent.transfer(handle), time.monotonic() + TRANSFER_TIMEOUT_S
        while state not in ("DONE", "ERR"):
            if time.monotonic() > end:
                raise TimeoutError(f"{op} still {state} after {TRANSFER_TIMEOUT_S:g} s")
            time.sleep(1e-4)
            state = agent.check_xfer_state(handle)
        if state == "ERR":
            raise OSError(f"NIXL {op} ended in ERR")
    finally:
        agent.release_xfer_handle(handle)


def round_trip(agent, name: str, fd: int) -> bool:
    """Write 1 MiB of random bytes to the file through NIXL, read it back; True when equal."""
    src, dst = mmap.mmap(-1, PROBE_BYTES), mmap.mmap(-1, PROBE_BYTES)
    src.write(os.urandom(PROBE_BYTES))
    addrs = [np.frombuffer(m, dtype=np.uint8).ctypes.data for m in (src, dst)]
    regs = [agent.register_memory([(0, PROBE_BYTES, fd, "")], "FILE")]
    try:
        regs += [agent.register_memory([(a, PROBE_BYTES, 0, "")], "DRAM") for a in addrs]
        _transfer(agent, name, "WRITE", addrs[0], fd)
        _transfer(agent, name, "READ", addrs[1], fd)
        return src[:] == dst[:]
    finally:
        for reg in reversed(regs):
            with contextlib.suppress(Exception):
                agent.deregister_memory(reg)


def check_posix(ctx: DoctorContext) -> CheckResult:
    """NIXL loads and its POSIX backend writes and reads back 1 MiB in DYN_KVBM_DISK_CACHE_DIR."""
    cfg = ctx.cfg
    if not cfg.disk_enabled:
        return skip("no G3 configured (NIXL moves G3 bytes only)")
    fallback = "the worker falls back to preadv/pwritev (works, no NIXL)"
    try:
        nixl_agent, nixl_agent_config = load_nixl()
    except Exception as exc:  # ImportError, or a wheel whose native library does not load
        return warn(f"NIXL does not load ({type(exc).__name__}: {exc}); {fallback}",
                    "pip install 'kvbm[nixl]' (nixl-cu13) to use NIXL's POSIX backend")
    name = f"kvbm-doctor-{os.getpid()}"
    try:
        agent = nixl_agent(name, nixl_agent_config(backends=["POSIX"]))
    except Exception as exc:
        return warn(f"NIXL loads but its POSIX backend does not start ({exc}); {fallback}",
                    "check NIXL_PLUGIN_DIR and that the wheel matches this CUDA/glibc")
    directory = cfg.disk_cache_dir
    try:
        with prepared_dir(directory):
            o_direct = not cfg.disk_disable_o_direct and o_direct_works(directory)[0]
            with probe_file(directory, os.O_DIRECT if o_direct else 0) as fd:
                same = round_trip(agent, name, fd)
    except Exception as exc:  # nixlBackendError, OSError, TimeoutError
        return fail(f"NIXL POSIX write + read of 1 MiB in {directory} failed: {type(exc).__name__}: {exc}",
                    "the worker would fail every G3 copy: see the disk.* results (space, O_DIRECT, "
                    "permissions) for this directory")
    if not same:
        return fail("NIXL POSIX read back other bytes than it wrote", "do not use G3 on this disk; report it")
    return ok(f"POSIX backend wrote and read back 1 MiB ({'O_DIRECT' if o_direct else 'buffered'})")


CHECKS = (Check("nixl", "posix", check_posix),)
