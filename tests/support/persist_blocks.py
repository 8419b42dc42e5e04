"""Helpers of the persistent-G3 tests (``test_persist*.py``): blocks whose bytes are a function
of their key, so that whatever a restarted node loads can be checked byte for byte."""
from __future__ import annotations

import hashlib
import time
from typing import Sequence

import numpy as np

from kvbm_client import KvbmClient, ShmKvBuffer, sequence_hashes
from kvbm_client.ids import BlockHash
from kvbm_client.local_node import LocalNode

LAYERS, PAGE = 4, 2048


def keys_of(n: int, seed: int = 0) -> list[BlockHash]:
    return sequence_hashes([seed * 1_000_003 + i for i in range(n * 16)], 16)


def shard_bytes(key: bytes, worker_id: str, layers: int = LAYERS, page: int = PAGE) -> np.ndarray:
    """What worker ``worker_id``'s shard of block ``key`` holds (layers x page bytes)."""
    seed = int.from_bytes(hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, (layers, page), dtype=np.uint8)


def fill(engines: dict[str, ShmKvBuffer], keys: Sequence[bytes], blocks: Sequence[int]) -> None:
    for worker_id, engine in engines.items():
        for key, block in zip(keys, blocks):
            engine.array[block] = shard_bytes(key, worker_id, engine.array.shape[1], engine.array.shape[2])


def store(client: KvbmClient, engines: dict[str, ShmKvBuffer], keys: Sequence[bytes], blocks: Sequence[int]) -> None:
    """Offload ``keys`` from engine ``blocks`` (filled with their bytes first)."""
    fill(engines, keys, blocks)
    client.wait(client.offload(list(keys), list(blocks)))


def load_and_check(client: KvbmClient, engines: dict[str, ShmKvBuffer], keys: Sequence[bytes],
                   blocks: Sequence[int]) -> int:
    """Onboard the matchable prefix of ``keys`` into ``blocks`` (zeroed first) and check every
    byte of every rank; returns how many blocks were loaded."""
    n = client.match(list(keys)).num_matched
    if not n:
        return 0
    for engine in engines.values():
        engine.array[list(blocks[:n])] = 0
    client.wait(client.onboard(list(keys[:n]), list(blocks[:n])))
    for worker_id, engine in engines.items():
        for key, block in zip(keys[:n], blocks[:n]):
            expected = shard_bytes(key, worker_id, engine.array.shape[1], engine.array.shape[2])
            assert np.array_equal(engine.array[block], expected), f"wrong bytes for {key.hex()} on worker {worker_id}"
    return n


def counter(node: LocalNode, name: str) -> float:
    return node.status().counters.get(name, 0.0)


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class OffloadLoop:
    """Offloads batch after batch (each its own chain of keys) on a thread until stopped or
    until an offload fails (the daemon it needed was killed); remembers every batch offered."""

    def __init__(self, client: KvbmClient, engines: dict[str, ShmKvBuffer], batch: int = 8, seed: int = 100) -> None:
        import threading
        self.client, self.engines, self.batch = client, engines, batch
        self.offered: list[list[BlockHash]] = []
        self.stored = 0
        self.error: BaseException | None = None
        self._seed = seed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "OffloadLoop":
        self._thread.start()
        return self

    def _run(self) -> None:
        blocks = list(range(self.batch))
        while not self._stop.is_set():
            keys = keys_of(self.batch, self._seed + len(self.offered))
            self.offered.append(keys)
            try:
                store(self.client, self.engines, keys, blocks)
            except BaseException as exc:  # the kill: stop here
                self.error = exc
                return
            self.stored += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the offload loop did not stop"
