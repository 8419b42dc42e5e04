"""IdentityCache: a new request that extends a recent one's hashed prefix starts from its keys and
state; keys via the cache are always those of a fresh BlockIdentity; reuse really happens."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvbm_client.hashing import IDENTITY_COST, KEY_COST, BlockIdentity, IdentityCache, MultimodalSpan, RequestExtras

BS = 4
NS = "model-a|float16|4"


def fresh(tokens: list[int], namespace: str = NS, block_size: int = BS,
          extras: RequestExtras = RequestExtras()) -> list[bytes]:
    return list(BlockIdentity(namespace, block_size, extras).update(tokens))


def cached(cache: IdentityCache, tokens: list[int], namespace: str = NS, block_size: int = BS,
           extras: RequestExtras = RequestExtras()) -> BlockIdentity:
    identity = BlockIdentity(namespace, block_size, extras, cache)
    identity.update(tokens)
    return identity


# --------------------------------------------------------------------------- randomized
@dataclass
class Seen:
    """The reference model of one identity the cache holds: its header's inputs and the tokens
    of the blocks it has hashed."""

    header: tuple
    tokens: list[int]


HEADERS = [
    (NS, 4, RequestExtras()),
    (NS, 4, RequestExtras(cache_salt="tenant-a")),
    (NS, 4, RequestExtras(cache_salt="tenant-b")),
    (NS, 4, RequestExtras(lora_name="adapter", lora_path="/a")),
    ("model-b|bfloat16|4", 4, RequestExtras()),
    ("model-a|float16|1", 1, RequestExtras()),
    ("model-a|float16|16", 16, RequestExtras()),
]


def variant(rnd: random.Random, base: list[int], bs: int) -> tuple[str, list[int]]:
    """A new request's tokens derived from ``base`` (what an earlier request had)."""
    vocab = lambda n: [rnd.randrange(0, 1 << 32) if rnd.random() < 0.05 else rnd.randrange(50) for _ in range(n)]
    kind = rnd.choice(["extend", "extend", "extend", "block_diverge", "mid_block_diverge", "one_changed",
                       "shorter", "same", "empty", "one_block", "unrelated"])
    if kind == "extend":  # the next turn: everything before, then more
        return kind, base + vocab(rnd.randrange(0, 5 * bs))
    if kind == "block_diverge" and len(base) >= bs:
        cut = rnd.randrange(0, len(base) // bs + 1) * bs
        return kind, base[:cut] + vocab(rnd.randrange(1, 4 * bs))
    if kind == "mid_block_diverge" and len(base) > bs > 1:
        cut = rnd.randrange(0, len(base) // bs) * bs + rnd.randrange(1, bs)
        return kind, base[:cut] + [base[cut] + 1 if cut < len(base) else 7] + vocab(rnd.randrange(0, 3 * bs))
    if kind == "one_changed" and base:
        out = base + vocab(rnd.randrange(0, 2 * bs))
        i = rnd.randrange(len(base))
        out[i] = (out[i] + 1) % (1 << 32)
        return kind, out
    if kind == "shorter" and base:
        return kind, base[:rnd.randrange(len(base))]
    if kind == "same":
        return kind, list(base)
    if kind == "empty":
        return kind, []
    if kind == "one_block":
        return kind, base[:bs] if len(base) >= bs else vocab(bs)
    return "unrelated", vocab(rnd.randrange(0, 8 * bs))


def expected_reuse(seen: list[Seen], header: tuple, tokens: list[int], bs: int) -> int:
    """Blocks the reuse rule must take: the longest held prefix (same header, at least one block)
    that the new request's full blocks start with as a whole."""
    full = len(tokens) // bs * bs
    best = 0
    for s in seen:
        n = len(s.tokens)
        if s.header == header and bs <= n <= full and tokens[:n] == s.tokens:
            best = max(best, n // bs)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_keys_via_the_cache_are_always_those_of_a_fresh_identity(seed: int) -> None:
    """Random requests derived from earlier ones (next turns, divergences at and inside blocks,
    one token changed, shorter, empty, one block, other namespaces, salts, adapters and block
    sizes), some growing while others adopt from them: every key list equals a fresh identity's,
    and each request reuses exactly the blocks the rule says (so a cache that never hits fails)."""
    rnd = random.Random(seed)
    cache = IdentityCache(max_bytes=1 << 30, per_key=1000)  # nothing evicted: the model is exact
    live: list[tuple[BlockIdentity, tuple, list[int], Seen]] = []
    seen: list[Seen] = []
    kinds: dict[str, int] = {}
    reused_total = 0
    for _ in range(120):
        if live and rnd.random() < 0.3:  # a live request decodes: it grows after being cached
            identity, header, tokens, model = rnd.choice(live)
            tokens += [rnd.randrange(50) for _ in range(rnd.randrange(1, 3 * header[1]))]
            identity.update(tokens)
            model.tokens = tokens[:len(tokens) // header[1] * header[1]]
            assert identity.keys == fresh(tokens, *header)
            continue
        if live and rnd.random() < 0.8:
            _, header, base, _ = rnd.choice(live)
            if rnd.random() < 0.15:
                header = rnd.choice(HEADERS)  # same tokens under another header: never shared
            kind, tokens = variant(rnd, base, header[1])
        else:
            header = rnd.choice(HEADERS)
            kind, tokens = "new", [rnd.randrange(50) for _ in range(rnd.randrange(0, 40))]
        kinds[kind] = kinds.get(kind, 0) + 1
        bs = header[1]
        want = expected_reuse(seen, header, tokens, bs)
        identity = BlockIdentity(*header, cache)
        try:
            identity.update(tokens)
        except OverflowError:
            pytest.fail("no token is beyond 32 bits here")
        assert identity.keys == fresh(tokens, *header), kind
        assert identity.reused == want, kind
        reused_total += identity.reused
        model = Seen(header, tokens[:len(tokens) // bs * bs])
        seen.append(model)  # a candidate once it has a block (expected_reuse skips it until then)
        live.append((identity, header, list(tokens), model))
    assert reused_total > 0 and kinds.get("extend", 0) > 0


# --------------------------------------------------------------------------- the rule, case by case
def test_the_next_turn_hashes_only_what_comes_after_the_last_turn() -> None:
    cache = IdentityCache()
    rnd = random.Random(1)
    turn1 = [rnd.randrange(128_000) for _ in range(50 * BS + 3)]
    first = cached(cache, turn1)
    output = [rnd.randrange(128_000) for _ in range(9)]
    first.update(turn1 + output)  # the first turn decodes: its identity grows in the cache
    turn2 = turn1 + output + [rnd.randrange(128_000) for _ in range(30)]
    second = cached(cache, turn2)
    assert second.reused == len(first.keys) == (len(turn1) + len(output)) // BS
    assert second.keys == fresh(turn2)
    turn3 = turn2 + [5] * 17
    third = cached(cache, turn3)
    assert third.reused == len(turn2) // BS and third.keys == fresh(turn3)


@pytest.mark.parametrize("case", ["shorter", "mid_block", "last_token_of_prefix", "first_token", "other_salt",
                                  "other_block_size"])
def test_a_request_that_does_not_extend_a_whole_prefix_is_hashed_from_scratch(case: str) -> None:
    cache = IdentityCache()
    base = list(range(100, 100 + 10 * BS))
    cached(cache, base)
    ns, bs, extras = NS, BS, RequestExtras()
    if case == "shorter":
        tokens = base[:9 * BS + 2]
    elif case == "mid_block":
        tokens = base[:5 * BS + 1] + [0] + base[5 * BS + 2:] + [1, 2, 3]
    elif case == "last_token_of_prefix":
        tokens = base[:-1] + [0] + [1] * BS
    elif case == "first_token":
        tokens = [0] + base[1:]
    elif case == "other_salt":
        tokens, extras = base + [1] * BS, RequestExtras(cache_salt="x")
    else:
        tokens, ns, bs = base + [1] * BS, "model-a|float16|2", 2
    identity = cached(cache, tokens, ns, bs, extras)
    assert identity.reused == 0
    assert identity.keys == fresh(tokens, ns, bs, extras)


def test_the_same_prompt_again_and_a_single_block_reuse_everything() -> None:
    cache = IdentityCache()
    one = cached(cache, [1, 2, 3, 4])
    assert one.reused == 0 and len(cache) == 1
    again = cached(cache, [1, 2, 3, 4, 5])
    assert again.reused == 1 and again.keys == fresh([1, 2, 3, 4])
    assert cached(cache, [1, 2, 3, 4, 5, 6, 7, 8]).reused == 1


def test_an_empty_or_partial_block_request_is_neither_cached_nor_looked_up() -> None:
    cache = IdentityCache()
    for tokens in ([], [1], [1, 2, 3]):
        identity = cached(cache, tokens)
        assert identity.keys == [] and identity.reused == 0
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_longest_matching_candidate_of_a_shared_first_block_wins() -> None:
    """Conversations that share a system prompt share a first block: each key holds several."""
    cache = IdentityCache()
    system = list(range(3 * BS))
    a = cached(cache, system + [1] * (4 * BS))
    b = cached(cache, system + [2] * (6 * BS))
    cached(cache, system + [2] * BS)  # shorter, more recent: a prefix of b's continuation too
    assert cached(cache, system + [1] * (4 * BS) + [9] * BS).reused == len(a.keys)
    tokens = system + [2] * (6 * BS) + [9] * BS
    assert cached(cache, tokens).reused == len(b.keys)
    assert cached(cache, tokens).keys == fresh(tokens)


def test_a_candidate_that_grows_after_an_adoption_leaves_the_adopted_copy_alone() -> None:
    cache = IdentityCache()
    base = list(range(5 * BS))
    donor = cached(cache, base)
    taker = cached(cache, base + [7] * (2 * BS))
    assert taker.reused == 5
    keys_then = list(taker.keys)
    donor_tokens = base + [8] * (3 * BS)  # the donor's request decodes otherwise
    donor.update(donor_tokens)
    assert taker.keys == keys_then == fresh(base + [7] * (2 * BS))
    taker.update(base + [7] * (4 * BS))  # and the taker grows from its own state
    assert taker.keys == fresh(base + [7] * (4 * BS))
    assert donor.keys == fresh(donor_tokens)
    later = cached(cache, donor_tokens + [1] * BS)  # the grown donor serves its whole new prefix
    assert later.reused == 8 and later.keys == fresh(donor_tokens + [1] * BS)


def test_multimodal_requests_never_enter_nor_reuse() -> None:
    cache = IdentityCache()
    tokens = list(range(6 * BS))
    extras = RequestExtras(multimodal=(MultimodalSpan("img", 2, 3),))
    first = cached(cache, tokens, extras=extras)
    assert len(cache) == 0 and first.reused == 0
    second = cached(cache, tokens + [1] * BS, extras=extras)
    assert second.reused == 0 and second.keys == fresh(tokens + [1] * BS, extras=extras)
    cached(cache, tokens)  # a plain request with the same tokens: cached, but not for the image's
    third = cached(cache, tokens + [1] * BS, extras=extras)
    assert third.reused == 0 and third.keys == fresh(tokens + [1] * BS, extras=extras)
    # the header only says "has images", not which: same tokens with another image must not share
    other = RequestExtras(multimodal=(MultimodalSpan("another-img", 2, 3),))
    fourth = cached(cache, tokens + [1] * BS, extras=other)
    assert fourth.reused == 0 and fourth.keys == fresh(tokens + [1] * BS, extras=other)
    assert len(cache) == 1


def test_the_byte_bound_evicts_the_least_recently_used() -> None:
    blocks = 10
    cost = blocks * (BS * 4 + KEY_COST) + IDENTITY_COST  # token bytes and a key per block, and the identity
    cache = IdentityCache(max_bytes=2 * cost)
    a = cached(cache, [1] * (blocks * BS))
    b = cached(cache, [2] * (blocks * BS))
    assert len(cache) == 2 and cache.nbytes == 2 * cost
    assert cached(cache, [1] * (blocks * BS)).reused == blocks  # adopting from a touches it (and holds the taker)
    assert b not in cache and a in cache and cache.nbytes == 2 * cost
    cached(cache, [3] * (blocks * BS))
    assert a not in cache and len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert cached(cache, [2] * (blocks * BS)).reused == 0, "an evicted identity is not a candidate"


def test_a_growing_identity_is_counted_again_and_may_push_others_out() -> None:
    per_block = BS * 4 + KEY_COST
    cache = IdentityCache(max_bytes=10 * per_block + 2 * IDENTITY_COST)
    a = cached(cache, [1] * (4 * BS))
    b = cached(cache, [2] * (4 * BS))
    assert cache.nbytes == 8 * per_block + 2 * IDENTITY_COST
    b.update([2] * (7 * BS))  # b decodes: counted at its new size, most recent: a goes
    assert a not in cache and b in cache and cache.nbytes == 7 * per_block + IDENTITY_COST
    b.update([2] * (30 * BS))  # bigger than the bound alone: not kept, still correct
    assert len(cache) == 0 and cache.nbytes == 0 and b.keys == fresh([2] * (30 * BS))
    assert cached(cache, [2] * (31 * BS)).reused == 0


def test_each_first_block_keeps_at_most_per_key_candidates() -> None:
    cache = IdentityCache(per_key=2)
    first = [0] * BS
    x, y, z = (cached(cache, first + [i] * BS) for i in (1, 2, 3))
    assert x not in cache and y in cache and z in cache and len(cache) == 2
    assert cached(cache, first + [2] * BS + [0]).reused == 2  # y touched; the taker pushes z out
    assert z not in cache and y in cache
    assert cached(cache, first + [1] * BS + [0]).reused == 0


@pytest.mark.parametrize("bad", [-1, 1 << 32, 1 << 40])
def test_token_ids_beyond_32_bits_still_raise_and_leave_the_cache_alone(bad: int) -> None:
    cache = IdentityCache()
    base = list(range(4 * BS))
    donor = cached(cache, base)
    held = cache.nbytes
    for tokens in ([bad] + base, base + [1, 2, bad, 3], base + [bad] * BS):
        identity = BlockIdentity(NS, BS, RequestExtras(), cache)
        with pytest.raises(OverflowError):
            identity.update(tokens)
        assert identity.keys == [] and identity.reused == 0 and identity not in cache
    grown = cached(cache, base + [5] * BS)
    with pytest.raises(OverflowError):
        grown.update(base + [5] * BS + [bad] * BS)
    assert grown.keys == fresh(base + [5] * BS) and cache.nbytes == held + (BS * 4 + KEY_COST) * 5 + IDENTITY_COST
    assert donor.keys == fresh(base)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        IdentityCache(max_bytes=-1)
    with pytest.raises(ValueError):
        IdentityCache(per_key=0)
