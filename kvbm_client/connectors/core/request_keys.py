"""The scheduler core's requests and the keys of their blocks.

:class:`RequestState` is what the core remembers of one request; :class:`KeyHasher` computes
the kvbm keys of requests' blocks (:class:`~kvbm_client.hashing.BlockIdentity`, one per request,
and the :class:`~kvbm_client.hashing.IdentityCache` they share) on the engine's scheduler thread
and, for a big step's new blocks, on the store planner's thread (:mod:`.store_planner`): every
identity and the cache are used under its one lock. A lookup hashes no further than the first
block it asks about until the leader's presence filter says that block may be stored
(:meth:`KeyHasher.probe`); a step's blocks are keyed from a snapshot of their tokens taken on the
scheduler's thread when they are hashed on another (:class:`Span`), so a request that grows
meanwhile changes nothing.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

from ...handles import TransferHandle
from ...hashing import BlockIdentity, IdentityCache, RequestExtras
from ...ids import BlockHash, EngineBlockId

log = logging.getLogger("kvbm.connector")


class EngineRequest(Protocol):
    """What the core reads from an engine's request (vLLM's ``Request`` has both; other
    adapters wrap theirs). ``all_token_ids`` is live: it grows as the request decodes (only
    ``len`` and slicing are used)."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...


#: An adapter's reading of a request's extra keys; None: the request's token ids do not
#: identify its KV (e.g. prompt embeddings), so kvbm neither loads nor stores it.
ExtrasOf = Callable[[EngineRequest], "RequestExtras | None"]


@dataclass
class RequestState:
    """What the scheduler core remembers of one request (from its first lookup to its end)."""

    request: EngineRequest
    identity: BlockIdentity | None
    block_ids: list[EngineBlockId] = field(default_factory=list)
    num_stored: int = 0  # leading blocks already offloaded (or known to be in kvbm)
    load: TransferHandle | None = None
    load_first_block: int = 0
    load_sent: bool = False
    #: a store of its blocks was planned (or asked for): its frees wait for the worker side,
    #: its preemption fences
    has_stores: bool = False
    miss_at: tuple[int, int] | None = None  # (computed, tokens) of the last lookup that missed

    def keys(self, tokens: Sequence[int] | None = None) -> list[BlockHash]:
        """kvbm keys of the full blocks of ``tokens`` (default: the request's tokens so far),
        hashed once per block. Called under the :class:`KeyHasher`'s lock."""
        if self.identity is None:
            return []
        try:
            return self.identity.update(self.request.all_token_ids if tokens is None else tokens)
        except OverflowError:  # a token id beyond 32 bits: not an identity we can vouch for
            self._unhashable()
            return []

    def probe(self, index: int) -> BlockHash | None:
        """The key of block ``index``, hashing no further than it (:meth:`BlockIdentity.probe`;
        None: not a full block). Called under the :class:`KeyHasher`'s lock."""
        if self.identity is None:
            return None
        try:
            return self.identity.probe(self.request.all_token_ids, index)
        except OverflowError:
            self._unhashable()
            return None

    def hashable_blocks(self) -> int:
        """Full blocks :meth:`keys` would key now (0 for a request kvbm does not key)."""
        return len(self.request.all_token_ids) // self.identity.block_size if self.identity is not None else 0

    def _unhashable(self) -> None:
        log.warning("kvbm: request %s has token ids beyond 32 bits; not cached", self.request.request_id)
        self.identity = None


class Span(NamedTuple):
    """A step's new full blocks of one request: its blocks ``start`` to ``end``, keyed from
    ``tokens`` (its tokens from the start, at least ``end`` blocks of them: the request's own
    list on the scheduler's thread, a snapshot of them on another)."""

    state: RequestState
    tokens: Sequence[int]
    start: int
    end: int


class KeyHasher:
    """The requests' identities and the cache they share, behind one lock (see the module
    docstring). Owned by one scheduler core."""

    def __init__(self) -> None:
        #: recent requests' identities: a request that extends one (a conversation's next turn)
        #: hashes only its new blocks
        self.identities = IdentityCache()
        self._lock = threading.Lock()

    def identity(self, namespace: str, block_size: int, extras: RequestExtras) -> BlockIdentity:
        return BlockIdentity(namespace, block_size, extras, self.identities)

    def probe(self, state: RequestState, index: int) -> BlockHash | None:
        with self._lock:
            return state.probe(index)

    def keys(self, state: RequestState) -> list[BlockHash]:
        with self._lock:
            return state.keys()

    def span_keys(self, spans: list[Span]) -> list[BlockHash] | None:
        """The keys of the spans' blocks, in order (any thread); None when a request turned out
        not to be keyable (a token id beyond 32 bits): then none of them is stored."""
        out: list[BlockHash] = []
        with self._lock:
            for span in spans:
                keys = span.state.keys(span.tokens)
                if len(keys) < span.end:
                    return None
                out += keys[span.start:span.end]
        return out
