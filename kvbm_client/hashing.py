"""Block identities: which full token blocks are "the same KV".

Two schemes live here.

:class:`BlockIdentity` is kvbm's own identity of a request's blocks, the one the engine
connectors use. It is the same in every process (no per-process seed), so a restarted engine
and a sibling engine on the node hit the blocks another one stored. One streaming BLAKE2b-128
state per request, fed once per block as the request grows::

    header  = VERSION | namespace | block_size | cache_salt | lora_name | lora_path | has_mm
    key(i)  = blake2b_128(header | block(0) | ... | block(i))   (16 bytes)
    block(j) = token ids of block j (uint32 little-endian)
               [| multimodal inputs overlapping block j, when has_mm]

So the key of block ``i`` is a chained identity of the whole prefix up to it: equal keys
mean equal namespace (model, dtype, block size), equal tenant (``cache_salt``), equal LoRA
adapter (name and path) and equal tokens and multimodal inputs from the start of the
request. Every field is length-prefixed or fixed-size, so two different requests never
encode to the same bytes. This folds exactly what vLLM's own block hashes fold (its
``generate_block_hash_extra_keys``: LoRA, multimodal hashes with their offset in the block,
cache salt), so kvbm separates tenants and adapters as strongly as the engine does.

NOTE: BLAKE2b, not xxh3: keys must be collision-resistant against a tenant who chooses its
own prompts (vLLM's default block hash is sha256 for the same reason; xxh3 is fast but not
built to resist crafted collisions). It costs about twice as much as xxh3-128 here (about a
millisecond for a 20K-token prompt, ``benchmarks/block_identity.py``).

:class:`IdentityCache` (one per scheduler role) spares most of that for the next turn of a
conversation: a new request whose tokens start with the whole hashed prefix of a recent one
(same header) starts from a copy of its keys and streaming state and hashes only the rest.

:func:`sequence_hashes` is Dynamo KVBM's xxh3-64 chain over token blocks, kept for clients
of :class:`~kvbm_client.client.KvbmClient` (``block_hash(i) = xxh3_64(tokens of block i,
seed=salt)``; block i's sequence hash is ``xxh3_64(seq(i-1) || block_hash(i), seed=salt)``).
Engines that already hash their blocks pass those bytes through :func:`engine_hashes`.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence, cast

import xxhash

from .ids import MAX_HASH_BYTES, BlockHash

_U64 = (1 << 64) - 1

#: Version tag of :class:`BlockIdentity`'s encoding; bump it when the encoding changes (keys
#: of the old encoding then simply never match again).
IDENTITY_VERSION = b"kvbm-block-identity/1"
#: Bytes of a :class:`BlockIdentity` key.
IDENTITY_BYTES = 16

assert array("I").itemsize == 4, "token ids are encoded as 32-bit unsigned integers"


@dataclass(frozen=True, slots=True)
class MultimodalSpan:
    """A multimodal input of a request: its content hash (vLLM's ``mm_feature.identifier``,
    older ``mm_hashes``) and the token positions its placeholder occupies."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestExtras:
    """What decides a request's KV besides its token ids (read once, when the request is new).

    An empty ``cache_salt`` is no salt (as in vLLM). ``multimodal`` is sorted by offset.
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    multimodal: tuple[MultimodalSpan, ...] = ()


def _field(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def _optional(text: str | None) -> bytes:
    return b"\x01" + _field(text) if text else b"\x00"


class BlockIdentity:
    """kvbm's keys of one request's full blocks, computed once per block as the request grows.

    Runs wherever blocks are keyed (a connector's scheduler role). Owns one BLAKE2b-128 streaming
    state; invariant: the state has absorbed the header and exactly ``len(keys)`` blocks.

    With a ``cache`` (:class:`IdentityCache`) and no multimodal inputs, the identity also keeps
    the token bytes it absorbed (invariant: exactly ``len(keys)`` blocks of them, nothing else),
    may start from a recent request's keys and state at its first full block (see
    :class:`IdentityCache`), and is recorded in the cache after each update that adds blocks.
    The keys are byte for byte those of an identity without a cache.
    """

    __slots__ = ("block_size", "keys", "reused", "_state", "_multimodal", "_mm_next", "_cache", "_header", "_data")

    def __init__(self, namespace: str, block_size: int, extras: RequestExtras = RequestExtras(),
                 cache: IdentityCache | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        #: keys of the blocks hashed so far; block i's key is ``keys[i]``
        self.keys: list[BlockHash] = []
        #: leading blocks whose keys (and state) came from another request's identity, not hashed here
        self.reused = 0
        self._multimodal = extras.multimodal
        self._mm_next = 0  # first multimodal input that does not end before the next block
        self._header = (IDENTITY_VERSION + _field(namespace) + struct.pack("<I", block_size)
                        + _optional(extras.cache_salt) + _optional(extras.lora_name) + _optional(extras.lora_path)
                        + (b"\x01" if extras.multimodal else b"\x00"))
        self._state = hashlib.blake2b(self._header, digest_size=IDENTITY_BYTES)
        #: a request with multimodal inputs is never cached nor reused (its blocks are not just tokens)
        self._cache = None if extras.multimodal else cache
        self._data = bytearray()  # with a cache: the token bytes of the ``len(keys)`` blocks absorbed

    def update(self, tokens: Sequence[int]) -> list[BlockHash]:
        """Hash the full blocks of ``tokens`` (the request's token ids from its start) not
        hashed yet; returns :attr:`keys`. A partial last block is left for a later call.

        Raises:
            OverflowError: a token id is negative or does not fit 32 bits (nothing is absorbed).
        """
        start = len(self.keys) * self.block_size
        end = len(tokens) // self.block_size * self.block_size
        if end <= start:
            return self.keys
        ids = array("I", tokens[start:end])
        if sys.byteorder == "big":
            ids.byteswap()
        data = memoryview(ids).cast("B")
        step = self.block_size * 4
        cache = self._cache
        if cache is not None:
            if not self.keys and cache._adopt(self, data):
                data = data[len(self._data):]  # the donor's blocks: absorbed already (a copy of its state)
            if not data:
                cache._record(self)
                return self.keys
        update, digest = self._state.update, self._state.digest
        if not self._multimodal:
            # NOTE: the hot path (a 20K-token prompt is ~1250 blocks): two C calls per block.
            self.keys += cast(list[BlockHash], [update(data[o:o + step]) or digest()
                                                 for o in range(0, len(data), step)])
            if cache is not None:
                self._data += data
                cache._record(self)
            return self.keys
        for i, o in enumerate(range(0, len(data), step)):
            update(data[o:o + step])
            update(self._multimodal_record(start + i * self.block_size))
            self.keys.append(BlockHash(digest()))
        return self.keys

    def probe(self, tokens: Sequence[int], index: int) -> BlockHash | None:
        """The key of block ``index`` of ``tokens`` (the request's tokens from its start), hashing
        as little as :meth:`update` would: from a recent request that holds it (the cache, when
        its token bytes up to that block match: nothing is hashed or absorbed, so a later
        :meth:`update` still adopts the best one), else by absorbing the blocks up to it (which a
        later :meth:`update` then does not hash again). None when ``tokens`` has no such full
        block.

        Raises:
            OverflowError: a token id is negative or does not fit 32 bits.
        """
        if index < len(self.keys):
            return self.keys[index]
        end = (index + 1) * self.block_size
        if len(tokens) < end:
            return None
        if self._cache is not None and not self.keys:
            ids = array("I", tokens[:end])
            if sys.byteorder == "big":
                ids.byteswap()
            held = self._cache._peek(self, memoryview(ids).cast("B"), index)
            if held is not None:
                return held
        self.update(tokens[:end])
        return self.keys[index] if index < len(self.keys) else None

    def _multimodal_record(self, first: int) -> bytes:
        """The multimodal inputs overlapping tokens ``[first, first + block_size)``: count,
        then per input its hash, its offset relative to ``first`` and its length."""
        last = first + self.block_size
        spans = self._multimodal
        while self._mm_next < len(spans) and spans[self._mm_next].offset + spans[self._mm_next].length <= first:
            self._mm_next += 1
        inside = []
        for span in spans[self._mm_next:]:
            if span.offset >= last:  # sorted by offset: no later input reaches this block
                break
            if span.offset + span.length > first:
                inside.append(span)
        record = struct.pack("<I", len(inside))
        for span in inside:
            record += _field(span.identifier) + struct.pack("<qI", span.offset - first, span.length)
        return record


#: What an :class:`IdentityCache` counts per key it holds, beside the token bytes: a 16-byte
#: ``bytes`` object (49 bytes, 56 as allocated) and its list slot.
KEY_COST = 64
#: What it counts per identity besides its blocks: the object, its BLAKE2b state, its header and
#: the cache's entry (tracemalloc: about 1.2 KiB each, so many short requests are bounded too).
IDENTITY_COST = 1280

_CacheKey = tuple[bytes, bytes]  # (header, first block's token bytes)


class IdentityCache:
    """Recent requests' :class:`BlockIdentity`, so that a new request whose tokens extend one of
    them (the next turn of a conversation: its prompt is the last turn's prompt, output and new
    text) hashes only what comes after, not its whole prompt again. Keys via the cache are byte
    for byte those of a fresh identity, always.

    Owned by one scheduler role (no global instance); it and its identities are used under one
    lock of their owner (the connector core's hashing lock: the engine's scheduler thread and its
    store planner's thread take it), so no identity is updated while another is adopting from it.

    Key: ``(header, first block's token bytes)``, exact bytes compared by the dict (no digest
    stands for them). The header holds everything but the tokens (version, namespace, block
    size, salt, LoRA), so a candidate has the new request's block size and extras. Each key
    keeps its ``per_key`` most recently used candidates (conversations that share a system
    prompt share a first block); a lookup is O(per_key) bytes comparisons.

    Reuse rule (at a new identity's first update that has a full block): a candidate of the key
    whose whole hashed prefix, its ``n = len(keys)`` blocks' token bytes, equals the new tokens'
    leading ``n`` blocks (one ``bytes`` comparison, memcmp); the longest such. The new identity
    starts with a copy of its ``n`` keys and of its state (which has absorbed exactly those ``n``
    blocks) and hashes only the rest. The snapshot is taken at once on the one thread, so a
    candidate that grows later (its request decodes) leaves the adopted copy alone. A request
    shorter than every candidate's prefix, or differing from it inside (by a single token of its
    last block, too), is hashed from scratch: simple and correct, no per-block states are kept to
    resume from a divergence.

    Bound: the candidates' token bytes, plus :data:`KEY_COST` per key and :data:`IDENTITY_COST`
    per identity (their memory, measured), at most ``max_bytes`` after each record; the least
    recently recorded (or adopted from) goes first, and an identity bigger than the bound alone
    is not kept. An evicted identity still serves its own request; its next update that adds
    blocks records it again. Requests with multimodal inputs never enter: the header says only
    that a request has images, not which.
    """

    __slots__ = ("max_bytes", "per_key", "_lru", "_buckets", "_bytes", "_clock")

    def __init__(self, max_bytes: int = 64 << 20, per_key: int = 8) -> None:
        if max_bytes < 0 or per_key <= 0:
            raise ValueError("max_bytes must be >= 0 and per_key > 0")
        self.max_bytes = max_bytes
        self.per_key = per_key
        #: identity -> (its key, bytes counted for it, its last use), least recently used first
        self._lru: OrderedDict[BlockIdentity, tuple[_CacheKey, int, int]] = OrderedDict()
        #: key -> its candidates (at most ``per_key``, in no order)
        self._buckets: dict[_CacheKey, list[BlockIdentity]] = {}
        self._bytes = 0
        self._clock = 0  # counts uses: the last use of the most recently used is the highest

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """Bytes counted for the identities held (at most ``max_bytes``)."""
        return self._bytes

    def __contains__(self, identity: object) -> bool:
        return identity in self._lru

    def _adopt(self, identity: BlockIdentity, data: memoryview) -> bool:
        """Start ``identity`` (no keys yet; ``data``: its full blocks' token bytes from block 0)
        from the best candidate (the reuse rule above); False when there is none."""
        step = identity.block_size * 4
        bucket = self._buckets.get((identity._header, bytes(data[:step])))
        if not bucket:
            return False
        best: BlockIdentity | None = None
        for cand in bucket:
            size = len(cand.keys) * step
            # NOTE: bytearray == memoryview is one memcmp (after a length check: a candidate whose
            # bytes are not its len(keys) blocks never matches); memoryview == bytearray would
            # compare byte by byte, a hundred times slower.
            if size <= len(data) and (best is None or size > len(best._data)) and cand._data == data[:size]:
                best = cand
        if best is None:
            return False
        identity.keys = best.keys[:]
        identity._state = best._state.copy()
        identity._data = bytearray(best._data)
        identity.reused = len(identity.keys)
        key, cost, _ = self._lru.pop(best)  # adopted from: the most recently used
        self._clock += 1
        self._lru[best] = (key, cost, self._clock)
        return True

    def _peek(self, identity: BlockIdentity, data: memoryview, index: int) -> BlockHash | None:
        """Block ``index``'s key from a candidate that holds it and whose token bytes start with
        ``data`` (``identity``'s first ``index + 1`` blocks); None when there is none. Changes
        nothing (the candidate is not counted as used)."""
        step = identity.block_size * 4
        for cand in self._buckets.get((identity._header, bytes(data[:step])), ()):
            if len(cand.keys) > index and cand._data[:len(data)] == data:
                return cand.keys[index]
        return None

    def _record(self, identity: BlockIdentity) -> None:
        """``identity`` (at least one block) was updated: hold it as the most recent candidate."""
        # NOTE: runs at every update that adds blocks (each block a request decodes): kept to a
        # few dict operations when the identity is held already.
        cost = len(identity._data) + len(identity.keys) * KEY_COST + IDENTITY_COST
        entry = self._lru.pop(identity, None)  # popped and set again: the most recently used
        self._clock += 1
        if entry is not None:
            self._lru[identity] = (entry[0], cost, self._clock)
            self._bytes += cost - entry[1]
        else:
            key = (identity._header, bytes(identity._data[:identity.block_size * 4]))
            self._lru[identity] = (key, cost, self._clock)
            self._bytes += cost
            bucket = self._buckets.setdefault(key, [])
            bucket.append(identity)
            if len(bucket) > self.per_key:
                self._drop(min(bucket, key=self._last_use))
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._lru)))

    def _last_use(self, identity: BlockIdentity) -> int:
        return self._lru[identity][2]

    def _drop(self, identity: BlockIdentity) -> None:
        key, cost, _ = self._lru.pop(identity)
        self._bytes -= cost
        bucket = self._buckets[key]
        bucket.remove(identity)
        if not bucket:
            del self._buckets[key]


def salt_hash(*, model: str | None = None, cache_salt: str | None = None, lora_name: str | None = None) -> int:
    """Seed for :func:`sequence_hashes`; ``0`` when nothing is salted."""
    if model is None and cache_salt is None and lora_name is None:
        return 0
    text = "\x1f".join(x or "" for x in (model, cache_salt, lora_name))
    return xxhash.xxh3_64_intdigest(text.encode())


_PAIR, _ONE = struct.Struct(">QQ"), struct.Struct(">Q")  # (a sequence hash is < 2**64: masked)


def _to_bytes(value: int) -> bytes:
    return (value & _U64).to_bytes(8, "big")


def sequence_hashes(tokens: Sequence[int], block_size: int, salt: int = 0,
                    parent: BlockHash | None = None) -> list[BlockHash]:
    """Sequence hashes of every *full* block of ``tokens``.

    Args:
        tokens: token ids of the request, from its start (or from ``parent``'s end).
        block_size: tokens per block.
        salt: seed from :func:`salt_hash`.
        parent: sequence hash of the block before ``tokens[0]``, to extend a known prefix.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[BlockHash] = []
    prev = int.from_bytes(parent, "big") & _U64 if parent is not None else None
    seed = salt & _U64
    full = len(tokens) // block_size * block_size
    # every full block's tokens as uint32 in one conversion, hashed through views (as
    # BlockIdentity.update does), not one conversion per block's slice
    data, step = memoryview(array("I", tokens[:full]).tobytes()), 4 * block_size
    digest, pair, one = xxhash.xxh3_64_intdigest, _PAIR.pack, _ONE.pack
    for off in range(0, 4 * full, step):
        bh = digest(data[off:off + step], seed=seed)
        seq = bh if prev is None else digest(pair(prev, bh), seed=seed)
        out.append(BlockHash(one(seq)))
        prev = seq
    return out


def engine_hashes(hashes: Iterable[bytes | int]) -> list[BlockHash]:
    """Take an engine's own block hashes as given (bytes, or ints as 8 big-endian bytes)."""
    out: list[BlockHash] = []
    for h in hashes:
        b = _to_bytes(h) if isinstance(h, int) else bytes(h)
        if not 0 < len(b) <= MAX_HASH_BYTES:
            raise ValueError(f"block hash of {len(b)} bytes (1..{MAX_HASH_BYTES} allowed)")
        out.append(BlockHash(b))
    return out
