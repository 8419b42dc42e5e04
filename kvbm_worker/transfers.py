"""Executes verified transfer plans: engine <-> G2, engine <-> G3 (through a bounce
buffer), G2 -> G3.

Runs in the worker daemon; ``run`` is synchronous and is called on one of two lane threads
(stores and demotions on one, loads on the other) so both directions overlap and the
event loop never blocks. Within a plan, demotions run before the entries: a STORE may
reuse the host slot of a block it first demotes to disk.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvbm_client.ids import PlanKind, Tier

from .handlers import cpu
from .handlers.disk import DiskIO
from .pools import DiskPool, HostPool
from .regions import EngineRegion


@dataclass(frozen=True, slots=True)
class Batch:
    """A verified plan, in the worker's terms."""

    kind: PlanKind
    tiers: Sequence[Tier]
    slots: Sequence[int]
    engine_blocks: Sequence[int]
    demote_host: Sequence[int]
    demote_disk: Sequence[int]
    promote_host: Sequence[int] = ()
    promote_disk: Sequence[int] = ()


class BounceBuffer:
    """Page-aligned staging slots for disk I/O of engine pages (one per lane)."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        self._mmap = mmap.mmap(-1, slot_bytes * num_slots)
        self.slots = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_slots, slot_bytes)
        self.num_slots = num_slots

    def address(self, row: int) -> int:
        return self.slots.ctypes.data + row * self.slots.shape[1]

    def close(self) -> None:
        self.slots = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass


class TransferEngine:
    """Moves bytes for one worker's pools; owns the bounce buffers."""

    def __init__(self, host: HostPool | None, disk: DiskPool | None, disk_io: DiskIO | None,
                 bounce_slots: int = 64) -> None:
        self.host, self.disk, self.disk_io = host, disk, disk_io
        self.bounce: dict[str, BounceBuffer] = {}
        # Fault injection for tests only: zero every page a CPU load writes, to prove that an
        # engine's output depends on the bytes kvbm delivers (tests/vllm negative control).
        self.corrupt_loads = os.environ.get("KVBM_FAULT_CORRUPT_LOADS", "") == "1"
        # ... and fail every CPU load after zeroing its pages: the engine must recompute them
        # (tests/vllm: a failed synchronous load must not leak into the outputs).
        self.fail_loads = os.environ.get("KVBM_FAULT_FAIL_LOADS", "") == "1"
        if disk is not None and disk_io is not None:
            n = max(1, min(bounce_slots, disk.geometry.num_slots))
            for lane in ("store", "load"):
                buf = self.bounce[lane] = BounceBuffer(disk.geometry.slot_bytes, n)
                disk_io.register(buf.slots.ctypes.data, buf.slots.nbytes)
            if host is not None:
                disk_io.register(host.address, host.buffer.nbytes)

    def warm_lane(self, lane: str) -> None:
        """Called once on each lane thread ("store", "load") before the first job: pay
        per-thread first-use costs there, not in a user's request. Nothing to do on the CPU."""

    def run(self, batch: Batch, region: EngineRegion | None) -> int:
        """Execute ``batch``; returns bytes moved. Raises on I/O failure."""
        moved = self._demote(batch.demote_host, batch.demote_disk)
        moved += self._promote(batch.promote_host, batch.promote_disk)
        if batch.kind in (PlanKind.DEMOTE, PlanKind.PROMOTE):
            return moved
        assert region is not None
        for tier in (Tier.HOST, Tier.DISK):
            picks = np.flatnonzero(np.asarray(batch.tiers, np.int64) == tier)
            if not picks.size:
                continue
            slots = np.asarray(batch.slots, np.int64)[picks].tolist()
            blocks = np.asarray(batch.engine_blocks, np.int64)[picks].tolist()
            if tier is Tier.HOST:
                if batch.kind is PlanKind.STORE:
                    cpu.gather(region, blocks, self.host.slots, slots)
                else:
                    cpu.scatter(self.host.slots, slots, region, blocks)
                    if self.corrupt_loads or self.fail_loads:
                        for view in region.layer_views:
                            view[np.asarray(blocks, np.int64)] = 0
                    if self.fail_loads:
                        raise OSError("KVBM_FAULT_FAIL_LOADS: load failed after writing zeros")
            else:
                self._disk_engine(batch.kind, region, blocks, slots)
            moved += len(picks) * region.block_bytes
        return moved

    def _demote(self, host_slots: Sequence[int], disk_slots: Sequence[int]) -> int:
        if not host_slots:
            return 0
        length = self.disk.geometry.slot_bytes
        addrs = [self.host.address + s * self.host.geometry.slot_bytes for s in host_slots]
        self.disk_io.write(addrs, [self.disk.offset(s) for s in disk_slots], length)
        return len(host_slots) * self.host.geometry.block_bytes

    def _promote(self, host_slots: Sequence[int], disk_slots: Sequence[int]) -> int:
        if not host_slots:
            return 0
        addrs = [self.host.address + s * self.host.geometry.slot_bytes for s in host_slots]
        self.disk_io.read(addrs, [self.disk.offset(s) for s in disk_slots], self.disk.geometry.slot_bytes)
        return len(host_slots) * self.host.geometry.block_bytes

    def _disk_engine(self, kind: PlanKind, region: EngineRegion, blocks: list[int], slots: list[int]) -> None:
        lane = "store" if kind is PlanKind.STORE else "load"
        bounce = self.bounce[lane]
        length = self.disk.geometry.slot_bytes
        for start in range(0, len(blocks), bounce.num_slots):
            chunk_blocks = blocks[start:start + bounce.num_slots]
            rows = list(range(len(chunk_blocks)))
            addrs = [bounce.address(r) for r in rows]
            offsets = [self.disk.offset(s) for s in slots[start:start + bounce.num_slots]]
            if kind is PlanKind.STORE:
                cpu.gather(region, chunk_blocks, bounce.slots, rows)
                self.disk_io.write(addrs, offsets, length)
            else:
                self.disk_io.read(addrs, offsets, length)
                cpu.scatter(bounce.slots, rows, region, chunk_blocks)

    def close(self) -> None:
        for buf in self.bounce.values():
            buf.close()
        self.bounce.clear()
