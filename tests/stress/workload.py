"""The stress workload: seeded, shared prefixes, random lengths, conversations that grow.

Pure and synchronous; runs in the harness (kvbm venv). The engine (``engine.py``, vLLM venv)
reads the JSON this writes, so both sides of a comparison serve exactly the same requests.

Shape: ``users`` conversations, each bound to one of ``groups`` shared prefixes (a "system
prompt"); turn ``t`` of a user is its prefix plus the first ``h0 + t * step`` tokens of its
private history, so a later turn shares every full block of the earlier ones. Turns are
served in waves (all requests of a wave submitted at once, in a seeded shuffled order), so
a prefix returns after the small G1 dropped it and must come back from kvbm.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

VOCAB = (10, 1000)  # token ids drawn from here (the tiny model's vocabulary is 1024)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; every random choice derives from ``seed``."""

    users: int = 16
    turns: int = 3
    groups: int = 4
    prefix_len: tuple[int, int] = (64, 256)
    first_turn_len: tuple[int, int] = (8, 96)
    turn_step: tuple[int, int] = (24, 96)
    max_tokens: tuple[int, int] = (16, 80)
    max_prompt_len: int = 560
    seed: int = 1

    @property
    def num_requests(self) -> int:
        return self.users * self.turns


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Wave:
    ids: list[str]
    pause_before_s: float = 0.0


@dataclass
class Workload:
    requests: list[Request]
    waves: list[Wave]
    spec: dict = field(default_factory=dict)

    def by_id(self) -> dict[str, Request]:
        return {r.id: r for r in self.requests}

    def reordered(self, seed: int) -> "Workload":
        """The same requests, each wave in another (seeded) order: a different batch composition."""
        rnd = random.Random(seed)
        waves = []
        for wave in self.waves:
            ids = list(wave.ids)
            rnd.shuffle(ids)
            waves.append(Wave(ids, wave.pause_before_s))
        return Workload(self.requests, waves, self.spec)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps({"requests": [asdict(r) for r in self.requests],
                                    "waves": [asdict(w) for w in self.waves], "spec": self.spec}))
        return path


def _tokens(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(*VOCAB) for _ in range(n)]


def generate(spec: WorkloadSpec, order_seed: int = 0) -> Workload:
    """Build the workload of ``spec``; ``order_seed`` only shuffles each wave."""
    rnd = random.Random(spec.seed)
    prefixes = [_tokens(rnd, rnd.randint(*spec.prefix_len)) for _ in range(spec.groups)]
    requests: list[Request] = []
    waves = [Wave([]) for _ in range(spec.turns)]
    for u in range(spec.users):
        prefix = prefixes[u % spec.groups]
        first, step = rnd.randint(*spec.first_turn_len), rnd.randint(*spec.turn_step)
        history = _tokens(rnd, first + step * (spec.turns - 1))
        for t in range(spec.turns):
            max_tokens = rnd.randint(*spec.max_tokens)
            prompt = (prefix + history[:first + step * t])[:spec.max_prompt_len - max_tokens]
            requests.append(Request(f"u{u}t{t}", prompt, max_tokens))
            waves[t].ids.append(f"u{u}t{t}")
    spec_dict = asdict(spec)
    return Workload(requests, waves, spec_dict).reordered(order_seed)
