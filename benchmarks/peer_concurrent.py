"""Overlapping requests for the vLLM peers harness (``vllm_peers.py --concurrent``).

The sequential harness sends one request at a time. There a connector's store of one prompt has
ended before the next request's load begins, so nothing shows what a store costs a load that runs
beside it (2026-11-27: kvbm's loads-first gate never fired there). Here the requests overlap, as
they do behind an OpenAI server:

- every user is its own asyncio task on vLLM's ``AsyncLLM`` (the engine the server runs); user
  ``u`` starts ``u * stagger_ms`` after the first and, between its turns, thinks for an
  exponentially drawn time of mean ``think_ms`` (seeded per user, so every system gets the same
  draws);
- meanwhile ``strangers`` new prompts arrive, one every ``stranger_gap_ms`` from the start: cold
  prefills whose stores run while the users' warm turns load.

Per request: TTFT (submit to the first output token), and with ``max_tokens > 1`` the gaps between
its later tokens. Per run: the output tokens per second from the first submit to the last finish.

Invariants: every request is submitted exactly once and awaited to its end; a user's turn ``r + 1``
is submitted only after its turn ``r`` finished; a request that fails fails the run (no row is made
up). :func:`drive` is the pure driver (its engine is any async ``generate``); :func:`run` builds
vLLM's engine around it.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from peer_passes import quantile

#: ``generate(prompt_token_ids, request_id) -> async iterator of (cumulative token ids, cached tokens)``
Generate = Callable[[list[int], str], AsyncIterator[tuple[list[int], int]]]


@dataclass(frozen=True)
class Plan:
    """When requests are sent: see the module docstring."""
    stagger_ms: float = 50.0
    think_ms: float = 100.0
    strangers: int = 0
    stranger_gap_ms: float = 300.0
    seed: int = 5

    def __post_init__(self) -> None:
        for name in ("stagger_ms", "think_ms", "stranger_gap_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.strangers < 0:
            raise ValueError(f"strangers must be >= 0, not {self.strangers}")


async def one_request(generate: Generate, prompt: list[int], rid: str, origin: float) -> dict[str, Any]:
    """Send one request and wait for its end: its row (``t0`` from ``origin``, TTFT, token gaps)."""
    t = time.perf_counter()
    first, last, gaps, tokens, cached, seen = None, t, [], [], 0, 0
    async for tokens, cached in generate(prompt, rid):
        now = time.perf_counter()
        if first is None:
            first = now
        elif len(tokens) > seen:  # a gap per output that brought tokens
            gaps.append(now - last)
        else:
            continue  # (a final output without new tokens: no gap, and the request's end stays)
        last, seen = now, len(tokens)
    if first is None:
        raise RuntimeError(f"request {rid} ended without an output")
    return {"tokens": len(prompt), "t0_s": round(t - origin, 4), "ttft_s": first - t, "end_s": round(last - origin, 4),
            "cached": cached, "output": list(tokens), "token_gaps_s": [round(g, 5) for g in gaps]}


async def drive(generate: Generate, turns: dict[int, list[tuple[int, list[int]]]], strangers: list[list[int]],
                plan: Plan) -> list[dict[str, Any]]:
    """Run the users' ``turns`` (user -> [(round, prompt)], in order) and the ``strangers`` as
    :class:`Plan` says; every row with its ``kind`` ("user" or "stranger"), ``round`` and ``user``."""
    origin = time.perf_counter()

    async def user(u: int, mine: list[tuple[int, list[int]]]) -> list[dict[str, Any]]:
        rnd = random.Random(plan.seed * 1000 + u)
        await asyncio.sleep(u * plan.stagger_ms / 1000)
        rows = []
        for i, (r, prompt) in enumerate(mine):
            if i:
                await asyncio.sleep(rnd.expovariate(1000 / plan.think_ms) if plan.think_ms else 0)
            rows.append({"kind": "user", "round": r, "user": u,
                         **await one_request(generate, prompt, f"u{u}r{r}", origin)})
        return rows

    async def stranger(k: int, prompt: list[int]) -> list[dict[str, Any]]:
        await asyncio.sleep((k + 1) * plan.stranger_gap_ms / 1000)
        return [{"kind": "stranger", "round": 0, "user": -1 - k,
                 **await one_request(generate, prompt, f"s{k}", origin)}]

    tasks = [user(u, mine) for u, mine in sorted(turns.items())]
    tasks += [stranger(k, p) for k, p in enumerate(strangers[:plan.strangers])]
    done = await asyncio.gather(*tasks)
    return sorted((row for rows in done for row in rows), key=lambda row: row["t0_s"])


def overlap_s(rows: list[dict[str, Any]]) -> float:
    """Seconds during which at least two requests were in flight (what makes this harness differ)."""
    edges = sorted([(r["t0_s"], 1) for r in rows] + [(r["end_s"], -1) for r in rows])
    total, inflight, since = 0.0, 0, 0.0
    for t, d in edges:
        if inflight >= 2:
            total += t - since
        inflight += d
        since = t
    return round(total, 4)


def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures beyond the warm / cold TTFT the harness reports for every mode: strangers'
    TTFT, token gaps (TPOT), output tokens per second, and the time requests overlapped."""
    out: dict[str, Any] = {"requests": len(rows), "overlap_s": overlap_s(rows)}
    strange = [r["ttft_s"] for r in rows if r["kind"] == "stranger"]
    if strange:
        out.update(stranger_ttft_p50=round(statistics.median(strange), 4),
                   stranger_ttft_p90=round(quantile(strange, 0.9), 4))
    gaps = [g for r in rows for g in r["token_gaps_s"]]
    if gaps:
        out.update(tpot_p50=round(statistics.median(gaps), 5), tpot_p90=round(quantile(gaps, 0.9), 5))
    span = max(r["end_s"] for r in rows) - min(r["t0_s"] for r in rows)
    out["out_tok_per_s"] = round(sum(len(r["output"]) for r in rows) / span, 1) if span > 0 else None
    return out


def async_engine(base: dict[str, Any], kw: dict[str, Any], native: float | None):
    """vLLM's ``AsyncLLM`` from the harness's engine kwargs (``base`` and a system's ``kw``; with
    ``native``, vLLM's own offloading of that many GB through its documented engine flags). The
    dict configs ``LLM`` converts itself are converted here; stats logging off, as ``LLM`` has it."""
    from vllm.config import CompilationConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw, base = dict(kw), {"disable_log_stats": True, **base}
    if native is not None:
        kw.pop("kv_transfer_config", None)
        kw.update(kv_offloading_size=native, kv_offloading_backend="native")
    if isinstance(kw.get("kv_transfer_config"), dict):
        kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
    if isinstance(base.get("compilation_config"), dict):
        base["compilation_config"] = CompilationConfig(**base["compilation_config"])
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**base, **kw))


def run(llm, max_tokens: int, warmups: list[list[int]], turns: dict[int, list[tuple[int, list[int]]]],
        strangers: list[list[int]], plan: Plan) -> list[dict[str, Any]]:
    """Warm the engine on ``warmups`` (one at a time, untimed), then :func:`drive` it."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)

    async def generate(prompt: list[int], rid: str):
        async for o in llm.generate({"prompt_token_ids": prompt}, sp, rid):
            yield list(o.outputs[0].token_ids), o.num_cached_tokens or 0

    async def main() -> list[dict[str, Any]]:
        for i, prompt in enumerate(warmups):
            async for _ in generate(prompt, f"warmup{i}"):
                pass
        return await drive(generate, turns, strangers, plan)

    try:
        return asyncio.run(main())
    finally:
        llm.shutdown()
