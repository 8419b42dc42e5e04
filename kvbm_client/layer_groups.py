"""The front-loaded shape of a layer-pipelined load's groups, shared by the worker daemon, which
copies a load group by group in it (``kvbm_worker.grouping``), and the engine's connector, which
decides from it which layers' waits go on the GPU (``connectors.core.settings``). Pure
arithmetic; one definition, so the two sides never disagree about where a group ends."""
from __future__ import annotations


def group_bounds(pages_per_block: int, groups: int) -> list[int]:
    """The end page of each of ``groups`` layer groups, front-loaded: after group ``g``, about
    ``P * ((groups - 1 - g) / groups) ** 2`` of the ``P`` pages are left, so the groups shrink
    and the last is about ``P / groups**2`` pages (36 pages in 6 groups: 11, 9, 7, 5, 3, 1).
    None is empty; more groups than pages: a page each."""
    groups = max(1, min(groups, pages_per_block))
    ends: list[int] = []
    for g in range(groups):
        later = groups - 1 - g
        end = pages_per_block - pages_per_block * later * later // (groups * groups)
        ends.append(min(max(end, (ends[-1] if ends else 0) + 1), pages_per_block - later))
    return ends
