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
    """

    __slots__ = ("block_size", "keys", "_state", "_multimodal", "_mm_next")

    def __init__(self, namespace: str, block_size: int, extras: RequestExtras = RequestExtras()) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        #: keys of the blocks hashed so far; block i's key is ``keys[i]``
        self.keys: list[BlockHash] = []
        self._multimodal = extras.multimodal
        self._mm_next = 0  # first multimodal input that does not end before the next block
        header = (IDENTITY_VERSION + _field(namespace) + struct.pack("<I", block_size)
                  + _optional(extras.cache_salt) + _optional(extras.lora_name) + _optional(extras.lora_path)
                  + (b"\x01" if extras.multimodal else b"\x00"))
        self._state = hashlib.blake2b(header, digest_size=IDENTITY_BYTES)

    def update(self, tokens: Sequence[int]) -> list[BlockHash]:
        """Hash the full blocks of ``tokens`` (the request's token ids from its start) not
        hashed yet; returns :attr:`keys`. A partial last block is left for a later call.

        Raises:
            OverflowError: a token id is negative or does not fit 32 bits.
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
        update, digest = self._state.update, self._state.digest
        if not self._multimodal:
            # NOTE: the hot path (a 20K-token prompt is ~1250 blocks): two C calls per block.
            self.keys += cast(list[BlockHash], [update(data[o:o + step]) or digest()
                                                 for o in range(0, len(data), step)])
            return self.keys
        for i, o in enumerate(range(0, len(data), step)):
            update(data[o:o + step])
            update(self._multimodal_record(start + i * self.block_size))
            self.keys.append(BlockHash(digest()))
        return self.keys

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
