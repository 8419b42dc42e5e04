"""G2's memory: 4 KiB shared pages by default, transparent huge pages with ``--g2-huge-pages``."""
from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from kvbm_worker.pools import HostPool, SlotGeometry

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    try:
        text = THP.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.parametrize("huge", [False, True])
def test_slots_hold_their_bytes_and_the_kernel_reports_its_pages(huge):
    pool = HostPool(SlotGeometry.of(2 << 20, 32), huge_pages=huge)
    try:
        pool.commit()
        data = np.random.default_rng(3).integers(0, 255, pool.slots.shape, dtype=np.uint8)
        pool.slots[:] = data
        assert np.array_equal(pool.slots, data)
        got = pool.huge_bytes()
        assert got is not None, "the pool's mapping was not found in /proc/self/smaps"
        if huge and thp_mode() in ("always", "madvise"):
            assert got >= pool.geometry.total_bytes // 2, f"only {got} bytes in huge pages"
        if not huge:
            assert got == 0 or thp_mode() == "always"
    finally:
        pool.close()


def test_a_huge_page_pool_is_not_inherited_by_a_forked_child():
    """MADV_DONTFORK: a child has no mapping there (reading it faults), so pinned pages are never
    shared copy-on-write; the parent keeps its bytes."""
    pool = HostPool(SlotGeometry.of(2 << 20, 4), huge_pages=True)
    try:
        pool.commit()
        pool.slots[1, :8] = 7
        pid = os.fork()
        if pid == 0:  # child: this read must fault
            faulthandler.disable()  # (no traceback print)
            try:
                os.write(1, bytes(pool.slots[1, :8]))
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS)
        assert (pool.slots[1, :8] == 7).all()
    finally:
        pool.close()
