"""Block identities: kvbm's own (BLAKE2b-128 streamed per request); Dynamo's sequence hashes
(xxh3-64, chained, salted); engine hashes passed through."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

import pytest
import xxhash

from kvbm_client.hashing import (IDENTITY_BYTES, BlockIdentity, MultimodalSpan, RequestExtras, engine_hashes,
                                 salt_hash, sequence_hashes)
from kvbm_client.ids import MAX_HASH_BYTES

BS = 4  # tokens per block


def make_tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def reference_hashes(tokens: list[int], block_size: int, salt: int = 0) -> list[bytes]:
    """The module docstring's formula, written out independently."""
    out: list[bytes] = []
    prev: int | None = None
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        bh = xxhash.xxh3_64_intdigest(array("I", tokens[start:start + block_size]).tobytes(), seed=salt)
        seq = bh if prev is None else xxhash.xxh3_64_intdigest(
            prev.to_bytes(8, "big") + bh.to_bytes(8, "big"), seed=salt)
        out.append(seq.to_bytes(8, "big"))
        prev = seq
    return out


def test_matches_the_documented_formula() -> None:
    tokens = make_tokens(3 * BS, start=1000)
    salt = salt_hash(model="m")
    assert sequence_hashes(tokens, BS) == reference_hashes(tokens, BS)
    assert sequence_hashes(tokens, BS, salt=salt) == reference_hashes(tokens, BS, salt)


def test_deterministic_and_eight_bytes() -> None:
    tokens = make_tokens(5 * BS)
    first = sequence_hashes(tokens, BS)
    assert first == sequence_hashes(list(tokens), BS)
    assert all(isinstance(h, bytes) and len(h) == 8 for h in first)
    assert len(set(first)) == 5


@pytest.mark.parametrize("num_tokens, expected_blocks", [(0, 0), (BS - 1, 0), (BS, 1), (2 * BS + BS - 1, 2), (3 * BS, 3)])
def test_only_full_blocks_are_hashed(num_tokens: int, expected_blocks: int) -> None:
    tokens = make_tokens(num_tokens)
    hashes = sequence_hashes(tokens, BS)
    assert len(hashes) == expected_blocks
    # The partial tail never changes the full blocks' hashes.
    assert hashes == sequence_hashes(tokens[:expected_blocks * BS], BS)


def test_common_prefix_gives_common_hashes() -> None:
    a = make_tokens(2 * BS) + [7] * BS
    b = make_tokens(2 * BS) + [8] * BS
    ha, hb = sequence_hashes(a, BS), sequence_hashes(b, BS)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]


def test_same_block_at_another_position_or_after_another_prefix_differs() -> None:
    block = [42] * BS
    alone = sequence_hashes(block, BS)[0]
    after_x = sequence_hashes([1] * BS + block, BS)[1]
    after_y = sequence_hashes([2] * BS + block, BS)[1]
    twice = sequence_hashes(block + block, BS)
    assert len({alone, after_x, after_y, twice[1]}) == 4
    assert twice[0] == alone


def test_divergence_propagates_to_every_later_block() -> None:
    a = make_tokens(4 * BS)
    b = list(a)
    b[0] += 1  # differ only in the first token
    assert all(x != y for x, y in zip(sequence_hashes(a, BS), sequence_hashes(b, BS)))


def test_token_order_inside_a_block_matters() -> None:
    assert sequence_hashes([1, 2, 3, 4], BS) != sequence_hashes([2, 1, 3, 4], BS)


def test_block_size_changes_the_hashes() -> None:
    tokens = make_tokens(8)
    assert sequence_hashes(tokens, 4)[0] != sequence_hashes(tokens, 8)[0]


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError):
        sequence_hashes(make_tokens(8), block_size)


def test_parent_extends_a_prefix_consistently() -> None:
    tokens = make_tokens(5 * BS, start=7)
    whole = sequence_hashes(tokens, BS)
    head = sequence_hashes(tokens[:2 * BS], BS)

    tail = sequence_hashes(tokens[2 * BS:], BS, parent=head[-1])

    assert head + tail == whole


def test_parent_with_salt_extends_consistently() -> None:
    tokens = make_tokens(3 * BS)
    salt = salt_hash(cache_salt="tenant-a")
    whole = sequence_hashes(tokens, BS, salt=salt)
    assert sequence_hashes(tokens[BS:], BS, salt=salt, parent=whole[0]) == whole[1:]


def test_parent_changes_the_hashes() -> None:
    tokens = make_tokens(BS)
    assert sequence_hashes(tokens, BS, parent=b"\x00" * 8) != sequence_hashes(tokens, BS)
    assert sequence_hashes(tokens, BS, parent=b"\x00" * 8) != sequence_hashes(tokens, BS, parent=b"\x00" * 7 + b"\x01")


# --------------------------------------------------------------------------- salt
def test_salt_hash_is_zero_when_nothing_is_salted() -> None:
    assert salt_hash() == 0
    assert sequence_hashes(make_tokens(BS), BS, salt=salt_hash()) == sequence_hashes(make_tokens(BS), BS)


def test_salt_separates_tenants() -> None:
    tokens = make_tokens(3 * BS)
    a, b = salt_hash(cache_salt="tenant-a"), salt_hash(cache_salt="tenant-b")
    assert a != b and a != 0
    ha, hb, hn = (sequence_hashes(tokens, BS, salt=s) for s in (a, b, 0))
    assert not set(ha) & set(hb)
    assert not set(ha) & set(hn)
    assert salt_hash(cache_salt="tenant-a") == a  # stable


@pytest.mark.parametrize("left, right", [
    (dict(model="m"), dict(cache_salt="m")),
    (dict(model="m"), dict(lora_name="m")),
    (dict(cache_salt="x"), dict(lora_name="x")),
    (dict(model="m", lora_name="a"), dict(model="m", lora_name="b")),
    (dict(model="m1"), dict(model="m2")),
])
def test_salt_fields_are_not_interchangeable(left: dict, right: dict) -> None:
    assert salt_hash(**left) != salt_hash(**right)


# --------------------------------------------------------------------------- engine hashes
def test_engine_hashes_pass_bytes_through() -> None:
    given = [b"\x01" * 32, bytearray(b"\x02" * 8), b"\x03"]
    out = engine_hashes(given)
    assert out == [b"\x01" * 32, b"\x02" * 8, b"\x03"]
    assert all(type(h) is bytes for h in out)


@pytest.mark.parametrize("value, expected", [
    (1, b"\x00" * 7 + b"\x01"),
    ((1 << 64) - 1, b"\xff" * 8),
    (-1, b"\xff" * 8),  # Python hash() values may be negative: two's complement
])
def test_engine_hashes_turn_ints_into_8_big_endian_bytes(value: int, expected: bytes) -> None:
    assert engine_hashes([value]) == [expected]


@pytest.mark.parametrize("bad", [b"", b"\x00" * (MAX_HASH_BYTES + 1)])
def test_engine_hashes_validate_length(bad: bytes) -> None:
    with pytest.raises(ValueError, match="bytes"):
        engine_hashes([b"\x01" * 8, bad])


def test_engine_hashes_accept_the_maximum_length() -> None:
    assert engine_hashes([b"\x07" * MAX_HASH_BYTES]) == [b"\x07" * MAX_HASH_BYTES]


def test_engine_hashes_of_nothing() -> None:
    assert engine_hashes(iter([])) == []


# --------------------------------------------------------------------------- block identity
NS = "model-a|float16|4"


def identity_keys(tokens, namespace=NS, block_size=BS, **extras):
    return BlockIdentity(namespace, block_size, RequestExtras(**extras)).update(tokens)


def test_identity_is_sixteen_bytes_per_full_block_and_deterministic() -> None:
    tokens = make_tokens(5 * BS + 2)
    keys = identity_keys(tokens)
    assert len(keys) == 5 and all(type(k) is bytes and len(k) == IDENTITY_BYTES for k in keys)
    assert len(set(keys)) == 5
    assert keys == identity_keys(list(tokens))


def test_identity_matches_the_documented_encoding() -> None:
    """The module docstring's scheme, written out independently: key(i) = blake2b-128 of the
    header and every block up to i."""
    tokens = make_tokens(3 * BS, start=70_000)

    def field(text: str) -> bytes:
        return len(text.encode()).to_bytes(4, "little") + text.encode()

    header = b"kvbm-block-identity/1" + field(NS) + BS.to_bytes(4, "little") + b"\x01" + field("salt") + b"\x00" * 3
    stream = header
    expected = []
    for i in range(3):
        stream += b"".join(t.to_bytes(4, "little") for t in tokens[i * BS:(i + 1) * BS])
        expected.append(hashlib.blake2b(stream, digest_size=16).digest())
    assert identity_keys(tokens, cache_salt="salt") == expected


def test_identity_is_the_same_in_another_process_with_another_hash_seed() -> None:
    """No per-process seed: a restarted (or sibling) engine computes the same keys."""
    tokens = make_tokens(4 * BS, start=11)
    code = ("import sys; from kvbm_client.hashing import BlockIdentity, RequestExtras; "
            f"print(b''.join(BlockIdentity({NS!r}, {BS}, RequestExtras(cache_salt='t', lora_name='l'))"
            f".update(list(range(11, 11 + {4 * BS})))).hex())")
    env = dict(os.environ, PYTHONHASHSEED="random")
    outs = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert outs == {b"".join(identity_keys(tokens, cache_salt="t", lora_name="l")).hex()}


@pytest.mark.parametrize("step", [1, 3, BS, 2 * BS + 1])
def test_identity_grows_incrementally_as_one_pass_would(step: int) -> None:
    tokens = make_tokens(6 * BS + 3)
    grown = BlockIdentity(NS, BS)
    for end in range(0, len(tokens) + 1, step):
        keys = grown.update(tokens[:end])
        assert len(keys) == end // BS
    grown.update(tokens)
    assert grown.keys == identity_keys(tokens)


def test_identity_is_a_chain_over_the_whole_prefix() -> None:
    a = make_tokens(4 * BS)
    b = list(a)
    b[1] += 1  # differ in the first block only
    ka, kb = identity_keys(a), identity_keys(b)
    assert all(x != y for x, y in zip(ka, kb))
    c = a[:2 * BS] + [5] * (2 * BS)
    assert identity_keys(c)[:2] == ka[:2] and identity_keys(c)[2] != ka[2]


@pytest.mark.parametrize("left, right", [
    (dict(cache_salt="tenant-a"), dict(cache_salt="tenant-b")),
    (dict(cache_salt="tenant-a"), dict()),
    (dict(lora_name="a"), dict(lora_name="b")),
    (dict(lora_name="a"), dict()),
    (dict(lora_name="a", lora_path="/x"), dict(lora_name="a", lora_path="/y")),
    (dict(cache_salt="x"), dict(lora_name="x")),
    (dict(lora_name="x"), dict(lora_path="x")),
    (dict(multimodal=(MultimodalSpan("img-1", 2, 3),)), dict(multimodal=(MultimodalSpan("img-2", 2, 3),))),
    (dict(multimodal=(MultimodalSpan("img-1", 2, 3),)), dict(multimodal=(MultimodalSpan("img-1", 1, 3),))),
    (dict(multimodal=(MultimodalSpan("img-1", 2, 3),)), dict()),
])
def test_tenants_adapters_and_images_never_share_a_block(left: dict, right: dict) -> None:
    tokens = make_tokens(3 * BS)
    kl, kr = identity_keys(tokens, **left), identity_keys(tokens, **right)
    assert not set(kl) & set(kr), "a block is shared from the first one on"
    assert identity_keys(tokens, **left) == kl  # same extras: same keys


@pytest.mark.parametrize("left, right", [
    (dict(namespace="model-a|float16|4"), dict(namespace="model-b|float16|4")),
    (dict(namespace="model-a|float16|4"), dict(namespace="model-a|bfloat16|4")),
])
def test_models_never_share_a_block(left: dict, right: dict) -> None:
    tokens = make_tokens(3 * BS)
    assert not set(identity_keys(tokens, **left)) & set(identity_keys(tokens, **right))


def test_block_size_is_part_of_the_identity() -> None:
    tokens = make_tokens(8)
    # Without it, block 1 at 4 tokens per block would be hashed over the very same bytes as
    # block 0 at 8 tokens per block.
    assert identity_keys(tokens, block_size=4)[1] != identity_keys(tokens, block_size=8)[0]


def test_an_empty_salt_is_no_salt_as_in_vllm() -> None:
    tokens = make_tokens(2 * BS)
    assert identity_keys(tokens, cache_salt="") == identity_keys(tokens)


def test_a_multimodal_input_changes_the_blocks_it_overlaps_and_everything_after() -> None:
    tokens = make_tokens(4 * BS)
    img = dict(multimodal=(MultimodalSpan("img", BS + 1, BS),))  # tokens 5..8: blocks 1 and 2
    other = dict(multimodal=(MultimodalSpan("img", BS + 1, BS + 1),))  # one token longer
    a, b = identity_keys(tokens, **img), identity_keys(tokens, **other)
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_multimodal_identity_grows_incrementally_as_one_pass_would() -> None:
    tokens = make_tokens(6 * BS)
    spans = (MultimodalSpan("a", 1, 2), MultimodalSpan("b", 3, 6), MultimodalSpan("c", 20, 1))
    grown = BlockIdentity(NS, BS, RequestExtras(multimodal=spans))
    for end in range(0, len(tokens) + 1, 5):
        grown.update(tokens[:end])
    assert grown.update(tokens) == identity_keys(tokens, multimodal=spans)


@pytest.mark.parametrize("bad", [-1, 1 << 32])
def test_token_ids_beyond_32_bits_are_refused(bad: int) -> None:
    with pytest.raises(OverflowError):
        identity_keys([1, 2, 3, bad])
    with pytest.raises(ValueError):
        BlockIdentity(NS, 0)


def test_a_parent_or_salt_wider_than_64_bits_chains_on_its_low_64_bits() -> None:
    """An engine's own hash may be longer than 8 bytes (``engine_hashes``); extending it chains
    on its low 64 bits, as the formula's 8-byte ``prev`` does, and the salt is taken mod 2**64."""
    tokens = make_tokens(2 * BS, start=7)
    wide = bytes(range(1, 17))  # 16 bytes
    narrow = wide[-8:]
    assert sequence_hashes(tokens, BS, parent=wide) == sequence_hashes(tokens, BS, parent=narrow)
    assert sequence_hashes(tokens, BS, salt=(1 << 64) + 5) == sequence_hashes(tokens, BS, salt=5)
    first = xxhash.xxh3_64_intdigest(array("I", tokens[:BS]).tobytes(), seed=0)
    expected = xxhash.xxh3_64_intdigest(narrow + first.to_bytes(8, "big"), seed=0)
    assert sequence_hashes(tokens, BS, parent=wide)[0] == expected.to_bytes(8, "big")


def test_a_probe_hashes_no_further_than_its_block_and_the_update_goes_on_from_there() -> None:
    tokens = list(range(16 * 12 + 3))
    fresh = BlockIdentity("ns", 16).update(tokens)
    ident = BlockIdentity("ns", 16)
    assert ident.probe(tokens, 4) == fresh[4] and len(ident.keys) == 5, "blocks 0..4 absorbed, no more"
    assert ident.probe(tokens, 2) == fresh[2], "a block hashed already is read back"
    assert ident.probe(tokens, 12) is None, "no 13th full block"
    assert ident.update(tokens) == fresh


def test_a_probe_reads_a_recent_requests_key_and_leaves_the_adoption_to_the_update() -> None:
    from kvbm_client.hashing import IdentityCache
    cache = IdentityCache()
    turn1 = list(range(16 * 40))
    BlockIdentity("ns", 16, cache=cache).update(turn1)
    turn2 = turn1 + list(range(5000, 5000 + 16 * 8))
    fresh = BlockIdentity("ns", 16).update(turn2)
    ident = BlockIdentity("ns", 16, cache=cache)
    assert ident.probe(turn2, 30) == fresh[30] and ident.keys == [], "from turn 1's keys: nothing hashed"
    assert ident.update(turn2) == fresh and ident.reused == 40, "turn 1 adopted whole, as without the probe"
    short = BlockIdentity("ns", 16, cache=cache)
    other = turn1[:16 * 3] + [9] * (16 * 20)  # shares 3 blocks with turn 1, then differs
    assert short.probe(other, 10) == BlockIdentity("ns", 16).update(other)[10]
    assert short.reused == 0 and len(short.keys) == 11, "no candidate holds block 10 of these tokens: hashed"
