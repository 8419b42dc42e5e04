"""Workloads and engine shapes shared by the driver's tests (test doubles and kvbm alike).

``chats`` is a multi-round, two-tenant conversation whose working set exceeds a 40-block device
pool, so later rounds find their prefix evicted from the device and only an offloading
connector can supply it. ``prefix_then_extension`` is a scripted sequence around one prefix:
computed, flushed out of the device, then extended under the same or another cache salt.
"""
from __future__ import annotations

from .driver_setup import DriverConfig
from .kv_model import KvGeometry
from .workload import Conversations, RequestSpec, Sequential, random_tokens

GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4)
#: The same model split over two tensor-parallel ranks (two KV heads each).
TP2_GEOMETRY = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, tokens_per_block=4, tp_size=2)
CONFIG = DriverConfig(geometry=GEOMETRY, num_blocks=40)


def chats(tenants=("acme", "globex"), rounds: int = 3, num_conversations: int = 6, seed: int = 0):
    return Conversations(num_conversations=num_conversations, rounds=rounds, system_prompt_len=18, turn_len=7,
                         max_new_tokens=5, tenants=tenants, concurrency=2, seed=seed)


def flush(tag: int, n: int = 3):
    """Unrelated requests that push every cached block out of the 40-block device pool."""
    return [RequestSpec(f"flush{tag}-{i}", random_tokens((99, tag, i), 60, 1000), 2) for i in range(n)]


def prefix_then_extension(salt_b="acme", n=2):
    """``a`` computes a 22-token prefix; after a flush ``b`` extends it (salt ``salt_b``); after
    another flush the ``a<i>`` extend it under ``a``'s salt."""
    base = random_tokens((5,), 22, 1000)
    return Sequential([RequestSpec("a", base, 2, "acme"), *flush(1),
                       RequestSpec("b", base + random_tokens((6,), 5, 1000), 2, salt_b), *flush(2),
                       *[RequestSpec(f"a{i}", base + random_tokens((7, i), 5, 1000), 2, "acme") for i in range(n)]])
