"""Loads staged before the engine allocated their blocks (``TransferRequest.stage``): the layout
of a staged load in the worker's staging area, and the one staged load the area holds.

Pure and synchronous (the caller passes the clock); the area's memory and its copies are the
mover's (:meth:`~.mover.BlockMover.stage`), the calls the runner's (:mod:`.transfer_calls`).

Why: a hit's copy can start only once the engine allocated the blocks it lands in, some ms after
the lookup that found it (vLLM 0.26, 20K tokens: 4-5 ms of allocation, then the early load's
call and the leader's go). A stage sent at the lookup (by the leader, before it answers, when
the lookup asks for it: ``PrepareLoadRequest.stage``; or by the client after it) copies the
first layer group of every block (that one only: :data:`MAX_STAGED_GROUPS`) into the worker's
own memory meanwhile; once the blocks are known, one scatter per staged group (device to device
on a GPU) puts them in place while the other groups are copied as before
(``benchmarks/staging_scatter.py``: one staged group of a 20K load covers 8 ms).

Invariants:

* one staged load at a time: a stage claims the area only when it is free. A staged load holds
  it until its own copies were issued (its ``task`` is done: a slow go cannot land them after a
  newer stage's), and then until it is taken and released, or, not taken, until its hold passed
  (``hold_s`` after the claim, or the plan's deadline, whichever comes first);
* the staged bytes are used (taken into an engine's blocks) only once the leader's go for the
  plan's job (``StartTransfer``) was granted; the copy into the area starts before it, the go
  asked beside it. They are then the plan's blocks: a go granted at time T says the job was
  live at T, and a load job is live from its plan's signing until it is released, settled,
  failed or expired, never again after (job ids are not reused; a failed job is refused), all
  that time holding its pins, so no slot of the plan was given to another block between the
  signing (before the stage arrived) and T; after T the leader keeps the started job's slots
  until this worker reported it or the job expired (``kvbm_leader.jobs``). A stage whose go
  is refused frees the area once its copies were issued, and its bytes are never read;
* a staged load is taken at most once, by the first ``Transfer`` of its plan (same job key and
  region) that comes within its hold, and used only if that call's layer groups have the staged
  bounds; any other call takes nothing and runs unstaged;
* the taking job releases the area once its copies from it are done (:meth:`StageArea.release`),
  so the area is written again only by copies issued after them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .jobs import JobKey

Ids = npt.NDArray[np.int64]
#: NOTE: how long a staged load waits for its blocks: vLLM allocates them in the step of the
#: lookup (ms), but a request that does not fit the step keeps its plan for a later one.
STAGE_HOLD_S = 1.0
#: NOTE: a stage takes the load's first layer group only, whatever the area holds. The binding
#: call uploads the group's block indices for its scatter on another stream, and on an H100 such
#: an upload waited behind the staging copies queued before it (twenty-sixth session: with all
#: six groups of a 20K hit staged the first group reached the engine 21.0 ms after the worker
#: role's call against 18.0 unstaged, and TTFT gained 1.1 ms; on an H200 an upload issued 5 ms
#: into 2.9 GB of queued copies landed with their last one, ``benchmarks/upload_behind_copies.py``).
#: The first group alone covers the head start (a 20K hit's is ~16 ms of copy against a job that
#: starts 3-5 ms after its stage), and the job's own copies of the later groups keep the link busy:
#: measured on an H100 (twenty-seventh session), from a stage's arrival to the job's last group
#: 56.4 ms for 2.97 GB (median of 30 loads; 52.8 GB/s against one memcpy's 54.8), so staging more
#: groups could not land the last one sooner, even with a scatter that waits for no upload.
MAX_STAGED_GROUPS = 1


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Where a staged load lies in the area: group ``g`` of block ``i`` (its pages
    ``[first(g), end(g))``, one run in the slot) at ``group_offset(g) + i * group_bytes(g)``.
    Groups ``0 .. staged-1`` are staged; ``bounds`` are the load's group end pages."""

    blocks: int
    bounds: tuple[int, ...]
    staged: int
    page_bytes: int

    @staticmethod
    def fit(blocks: int, bounds: list[int], page_bytes: int, capacity: int,
            max_groups: int = MAX_STAGED_GROUPS) -> "StageLayout | None":
        """The most leading groups (at most ``max_groups``) of a ``blocks``-block load that fit
        ``capacity`` bytes (None: not even the first fits)."""
        staged = 0
        while staged < min(len(bounds), max_groups) and blocks * bounds[staged] * page_bytes <= capacity:
            staged += 1
        return StageLayout(blocks, tuple(bounds), staged, page_bytes) if staged else None

    def pages(self, g: int) -> tuple[int, int]:
        return (self.bounds[g - 1] if g else 0), self.bounds[g]

    def group_bytes(self, g: int) -> int:
        first, end = self.pages(g)
        return (end - first) * self.page_bytes

    def group_offset(self, g: int) -> int:
        return self.blocks * self.pages(g)[0] * self.page_bytes

    def block_offsets(self, g: int) -> Ids:
        """Offset of group ``g`` of every block, in block order."""
        return self.group_offset(g) + np.arange(self.blocks, dtype=np.int64) * self.group_bytes(g)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.bounds[self.staged - 1] * self.page_bytes

    def group_of(self, pages: tuple[int, int]) -> int | None:
        """The staged group whose pages are ``pages``, or None."""
        for g in range(self.staged):
            if self.pages(g) == pages:
                return g
        return None


@dataclass(slots=True)
class StagedLoad:
    """One staged load: its plan's job, the region it was staged for, its layout, and the
    staging itself (``task``: the go's deadline once its copies were issued, on the copy
    stream the job's own copies follow; it raises when the go was refused or the copies failed)."""

    job: JobKey
    region_id: str
    layout: StageLayout
    hold_until: float  # monotonic
    task: "asyncio.Future[float] | None" = None
    taken: bool = False  # by the call that named its blocks; holds the area until it is released


class StageArea:
    """The worker's one staged load (see the module docstring). On the event loop."""

    def __init__(self, hold_s: float = STAGE_HOLD_S) -> None:
        self.hold_s = hold_s
        self.current: StagedLoad | None = None
        self.refused_no_area = False  # a stage was refused for want of an area (told once, at info level)

    def busy(self, now: float) -> bool:
        """Whether a staged load holds the area."""
        load = self.current
        if load is None:
            return False
        issuing = load.task is not None and not load.task.done()
        return issuing or load.taken or now < load.hold_until

    def claim(self, job: JobKey, region_id: str, layout: StageLayout, now: float, deadline: float) -> StagedLoad | None:
        """The area for ``job`` (its plan's ``deadline`` bounds the hold), or None while another holds it."""
        if self.busy(now):
            return None
        self.current = StagedLoad(job, region_id, layout, min(now + self.hold_s, deadline))
        return self.current

    def take(self, job: JobKey, region_id: str, now: float) -> StagedLoad | None:
        """The staged load of ``job`` for ``region_id`` within its hold, once; the caller then
        holds the area until :meth:`release`. None otherwise (a staged load of another plan, or
        one past its hold, stays until it is free by the rules above)."""
        load = self.current
        if load is None or load.job != job or load.taken or load.region_id != region_id or now >= load.hold_until:
            return None
        load.taken = True
        return load

    def release(self, load: StagedLoad) -> None:
        """The area is free again: ``load``'s copies from it are done, or its stage failed."""
        if self.current is load:
            self.current = None
