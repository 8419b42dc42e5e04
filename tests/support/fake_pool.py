"""A stand-in for an engine's block pool as block holds use it (pin / unpin), for unit tests."""
from __future__ import annotations

from collections import Counter


class FakePool:
    """References per block, as vLLM's pool counts them (a request's own reference is not
    modelled: these are the holds' only)."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def pin(self, blocks):
        self.refs.update(blocks)

    def unpin(self, blocks):
        for b in blocks:
            assert self.refs[b] > 0, f"block {b} unpinned more often than pinned"
            self.refs[b] -= 1
        self.refs = +self.refs

    @property
    def pinned(self) -> set[int]:
        return set(self.refs)
