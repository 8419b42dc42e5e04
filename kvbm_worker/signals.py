"""An engine region's signal page, and the words a layer-grouped load writes there.

Runs in the worker daemon: the page is mapped at registration (event loop), the targets are
added by ``TransferLayers`` calls (event loop) and written by the load lane.

The engine hands over a sealed memfd of exactly :data:`~kvbm_client.contract.SIGNAL_PAGE_BYTES`
(``RegisterRegionRequest.signals``): :data:`~kvbm_client.contract.SIGNAL_SLOTS` uint32 words it
owns. A load that names a word (``TransferRequest.signal_slot``, ``signal_base``) has the lane
write ``base + end`` there once every block's pages ``[0, end)`` landed, ordered after those
copies (a GPU worker writes it with 4-byte DMAs on a stream beside the copy stream, made to
wait for the group's copies, see ``handlers/signal_words.py``; the CPU medium's copies are
synchronous, so it stores the word after them). The engine's GPU waits for the word instead of its CPU.

Invariants:
* the worker writes only into a region's own page, only words ``0 <= slot < SIGNAL_SLOTS``,
  only values ``base + end`` with ``end`` a group's end page, in increasing ``end`` per
  target, and each only after the pages it counts landed;
* the words vouch for nothing: the load's outcome does (a failed load's engine recomputes).
  A word the worker never writes (a failed load) is the engine's to release.
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from kvbm_client.contract import SIGNAL_PAGE_BYTES, SIGNAL_SLOTS, pb
from kvbm_client.ids import PlanKind

from .errors import PlanRejected
from .pending import Pending
from .regions import EngineRegion, RegionError, check_sealed_memfd

if TYPE_CHECKING:
    from .plan_check import Batch

Code = grpc.StatusCode

#: a (slot, base) a load writes ``base + end`` to
Target = tuple[int, int]
#: words one load writes at most (calls that join it: the engine's, a retry; a bound on what
#: a client can make the lane do)
MAX_TARGETS = 4


class SignalPage:
    """The mapping of one region's signal page (``close()`` unmaps it). ``device_ptr``: set by a
    GPU worker that registered the mapping with CUDA (the address its stream writes use)."""

    def __init__(self, fd: int) -> None:
        size = check_sealed_memfd(-1, fd)
        if size != SIGNAL_PAGE_BYTES:
            raise RegionError(f"signal page: the memfd has {size} bytes; it must have exactly {SIGNAL_PAGE_BYTES}")
        try:
            self._map = mmap.mmap(fd, SIGNAL_PAGE_BYTES, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise RegionError(f"signal page: cannot map the memfd read-write: {exc.strerror}") from None
        self.words: npt.NDArray[np.uint32] = np.frombuffer(self._map, dtype="<u4")
        self.device_ptr: int | None = None
        self.unregister: Callable[[], None] | None = None  # undoes the GPU worker's registration

    @property
    def address(self) -> int:
        """The mapping's host address."""
        return int(self.words.ctypes.data)

    def store(self, slot: int, value: int) -> None:
        """A CPU store of ``value`` into word ``slot`` (after the pages it counts landed)."""
        self.words[slot] = value

    def close(self) -> None:
        if self.unregister is not None:
            self.unregister()
            self.unregister = None
        self.words = np.zeros(0, np.uint32)
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still referenced; unmapped when collected


def map_signal_page(request: "pb.RegisterRegionRequest", fds: Sequence[int]) -> SignalPage | None:
    """The page ``request.signals`` names (None without one). Raises :class:`RegionError`."""
    if not request.HasField("signals"):
        return None
    buf = request.signals
    if buf.WhichOneof("handle") != "fd_index":
        raise RegionError("signal page: only a sealed memfd (fd_index) is accepted")
    if not fds or buf.fd_index != len(fds) - 1:
        raise RegionError(f"signal page names fd {buf.fd_index}; it must be the last of the {len(fds)} fds that "
                          "came with the request")
    if buf.size_bytes not in (0, SIGNAL_PAGE_BYTES) or buf.offset_bytes:
        raise RegionError(f"signal page: {buf.size_bytes} bytes at offset {buf.offset_bytes}; it is the whole "
                          f"memfd of {SIGNAL_PAGE_BYTES} bytes")
    return SignalPage(fds[buf.fd_index])


def request_target(request: "pb.TransferRequest", region: EngineRegion, batch: Batch) -> Target | None:
    """The (slot, base) of ``request``'s ``signal_slot``/``signal_base`` (None: no slot named).
    Raises :class:`PlanRejected`: FAILED_PRECONDITION on a region without a signal page,
    INVALID_ARGUMENT for a word outside the page, a sum over 32 bits, or a plan that is no load."""
    if not request.signal_slot:
        return None
    job = f"job {batch.job_id}"
    if region.signals is None:
        raise PlanRejected(Code.FAILED_PRECONDITION, f"{job}: signal_slot names a word of a region registered "
                                                     "without a signal page", batch.job_id)
    slot, base = int(request.signal_slot) - 1, int(request.signal_base)
    if batch.kind is not PlanKind.LOAD:
        raise PlanRejected(Code.INVALID_ARGUMENT, f"{job}: signal_slot applies to loads only", batch.job_id)
    if not 0 <= slot < SIGNAL_SLOTS:
        raise PlanRejected(Code.INVALID_ARGUMENT, f"{job}: signal_slot={slot + 1}, 1 to {SIGNAL_SLOTS}", batch.job_id)
    if base + region.num_layers > 0xFFFFFFFF:
        raise PlanRejected(Code.INVALID_ARGUMENT, f"{job}: signal_base={base} + {region.num_layers} pages does "
                                                  "not fit 32 bits", batch.job_id)
    return slot, base


@dataclass
class JobSignals:
    """The words one layer-grouped load writes: targets are added by calls on the event loop
    (:meth:`add`) and taken by the lane (:meth:`take_new`), which writes each new one at once
    with the pages landed so far, then every later group."""

    page: SignalPage
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _targets: list[Target] = field(default_factory=list)
    _taken: int = 0

    def add(self, target: Target) -> None:
        """The lane writes ``target`` from now on (at most :data:`MAX_TARGETS` per load: a word
        beyond is left to the engine, which releases it at the load's outcome)."""
        with self._lock:
            if target not in self._targets and len(self._targets) < MAX_TARGETS:
                self._targets.append(target)

    def take_new(self) -> list[Target]:
        """The targets added since the last call (lane thread)."""
        with self._lock:
            new, self._taken = self._targets[self._taken:], len(self._targets)
        return new

    def taken(self) -> list[Target]:
        """Every target the lane took so far (lane thread)."""
        with self._lock:
            return self._targets[:self._taken]


class SignalWriter:
    """The load lane's side of one load's :class:`JobSignals`: ``write(slot, value)`` issues a
    word's write on the medium (ordered after every copy issued before it) and returns what
    the lane waits for before it answers the job (no write may still be pending then)."""

    def __init__(self, signals: JobSignals | None, write: Callable[[int, int], Pending]) -> None:
        self.signals = signals
        self.write = write
        self.end = 0  # every block's pages [0, end) are issued, and each group's word with them

    def catch_up(self) -> list[Pending]:
        """Write the targets added since the last call with the pages issued so far."""
        if self.signals is None:
            return []
        new = self.signals.take_new()
        return [self.write(slot, base + self.end) for slot, base in new] if self.end else []

    def group_issued(self, end: int) -> list[Pending]:
        """Every copy of the pages ``[0, end)`` is issued: write ``base + end`` to every target."""
        if self.signals is None:
            return []
        writes = self.catch_up()
        self.end = end
        return writes + [self.write(slot, base + end) for slot, base in self.signals.taken()]
