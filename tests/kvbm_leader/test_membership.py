"""Membership: attached workers, layouts and the pool plan (Dynamo's sizing rule)."""
from __future__ import annotations

import pytest

from kvbm_client.config import KvbmConfig
from kvbm_client.ids import WorkerId
from kvbm_leader.membership import Layout, Membership, PoolSizes, WorkerRecord


def make_layout(num_layers: int = 32, page_bytes: int = 65536, rank: int = 0) -> Layout:
    return Layout(num_layers=num_layers, page_bytes=page_bytes, dtype="bfloat16",
                  num_engine_blocks=1000, rank=rank)


def make_record(worker_id: str, rank: int = 0) -> WorkerRecord:
    return WorkerRecord(WorkerId(worker_id), rank, f"unix:/tmp/w{worker_id}.sock", 1000 + rank, cuda=False)


def make_membership(*ids: str, **config) -> Membership:
    return Membership(KvbmConfig(**config), [WorkerId(i) for i in ids])


def attach_all(m: Membership, layouts: dict[str, Layout]) -> None:
    for rank, (wid, layout) in enumerate(layouts.items()):
        m.attach(make_record(wid, rank))
        m.set_layout(WorkerId(wid), layout)


def mark_ready(m: Membership, *ids: str) -> None:
    assert m.pools is not None
    for wid in ids:
        m.workers[WorkerId(wid)].ready_epoch = m.pools.epoch


def test_layout_block_bytes() -> None:
    assert make_layout(num_layers=4, page_bytes=100).block_bytes == 400


@pytest.mark.parametrize("layouts, config, expected", [
    # one worker: 1 GB / (32 * 65536) bytes
    ({"0": make_layout(32, 65536)}, dict(cpu_cache_gb=1.0), PoolSizes(1, 476, 0)),
    # two workers (TP=2) with different shard sizes: the sum of their (4096-aligned) slots is
    # one logical block: 12288 + 20480 bytes
    ({"0": make_layout(10, 1000), "1": make_layout(20, 1000)}, dict(cpu_cache_gb=1.0, disk_cache_gb=3.0),
     PoolSizes(1, 1e9 // 32_768, 3e9 // 32_768)),
    ({"0": make_layout(10, 1000)}, dict(cpu_cache_gb=0.5), PoolSizes(1, 5e8 // 12_288, 0)),
    # a 1-byte layout takes a whole 4096-byte slot: the plan never promises more memory than
    # the worker allocates (a client once grew G2 4096x this way)
    ({"0": make_layout(1, 1)}, dict(cpu_cache_gb=0.001), PoolSizes(1, 1e6 // 4096, 0)),
    # overrides win over GB
    ({"0": make_layout(10, 1000)}, dict(cpu_cache_gb=1.0, cpu_cache_override_num_blocks=7,
                                        disk_cache_gb=1.0, disk_cache_override_num_blocks=9),
     PoolSizes(1, 7, 9)),
    ({"0": make_layout(10, 1000)}, dict(disk_cache_override_num_blocks=5), PoolSizes(1, 0, 5)),
])
def test_pool_sizing(layouts: dict[str, Layout], config: dict, expected: PoolSizes) -> None:
    m = make_membership(*layouts, **config)
    attach_all(m, layouts)

    plan = m.replan()

    assert plan == expected
    assert isinstance(plan.host_slots, int) and isinstance(plan.disk_slots, int)
    assert m.pools is plan


def test_block_bytes_sums_over_every_worker() -> None:
    m = make_membership("0", "1")
    attach_all(m, {"0": make_layout(2, 4096), "1": make_layout(3, 4096)})
    assert m.block_bytes() == 5 * 4096
    m = make_membership("0", "1")
    attach_all(m, {"0": make_layout(2, 10), "1": make_layout(3, 10)})
    assert m.block_bytes() == 2 * 4096  # each shard's slot is rounded up to 4096 bytes


def test_replan_is_none_until_every_expected_worker_has_a_layout() -> None:
    m = make_membership("0", "1", cpu_cache_gb=1.0)
    assert m.replan() is None  # nobody attached

    m.attach(make_record("0"))
    m.set_layout(WorkerId("0"), make_layout())
    assert m.replan() is None  # worker 1 missing

    m.attach(make_record("1", 1))
    assert m.replan() is None  # worker 1 has no layout yet
    assert (m.epoch, m.pools) == (0, None)

    m.set_layout(WorkerId("1"), make_layout(rank=1))
    plan = m.replan()
    assert plan is not None and plan.epoch == 1 == m.epoch


def test_each_replan_bumps_the_epoch_and_resets_progress() -> None:
    m = make_membership("0", cpu_cache_gb=1.0)
    attach_all(m, {"0": make_layout()})
    first = m.replan()
    m.workers[WorkerId("0")].alloc_progress = 1.0

    second = m.replan()

    assert (first.epoch, second.epoch, m.epoch) == (1, 2, 2)
    assert m.workers[WorkerId("0")].alloc_progress == 0.0


def test_attach_of_a_duplicate_raises_key_error() -> None:
    m = make_membership("0")
    original = make_record("0")
    m.attach(original)
    with pytest.raises(KeyError):
        m.attach(make_record("0"))
    assert m.workers[WorkerId("0")] is original


def test_attach_of_an_unknown_worker_raises_lookup_error() -> None:
    m = make_membership("0", "1")
    with pytest.raises(LookupError, match="unknown worker") as info:
        m.attach(make_record("7"))
    assert not isinstance(info.value, KeyError)  # distinguishable from a duplicate
    assert WorkerId("7") not in m.workers
    assert m.missing == ["0", "1"]


def test_missing_and_all_attached() -> None:
    m = make_membership("0", "1")
    m.attach(make_record("1"))
    assert (m.missing, m.all_attached) == (["0"], False)
    m.attach(make_record("0"))
    assert (m.missing, m.all_attached) == ([], True)


def test_ready_only_when_every_worker_reported_the_current_epoch() -> None:
    m = make_membership("0", "1", cpu_cache_gb=1.0)
    attach_all(m, {"0": make_layout(), "1": make_layout(rank=1)})
    assert not m.ready  # no plan

    m.replan()
    assert not m.ready
    mark_ready(m, "0")
    assert not m.ready
    mark_ready(m, "1")
    assert m.ready

    m.replan()  # a new epoch: the old allocation no longer counts
    assert not m.ready
    mark_ready(m, "0", "1")
    assert m.ready


def test_detach_drops_the_plan() -> None:
    m = make_membership("0", cpu_cache_gb=1.0)
    attach_all(m, {"0": make_layout()})
    m.replan()
    mark_ready(m, "0")

    assert m.detach(WorkerId("0")) is not None

    assert m.pools is None and not m.ready
    assert m.missing == ["0"]
    assert m.detach(WorkerId("0")) is None


def test_set_layout_reports_when_a_replan_is_needed() -> None:
    m = make_membership("0", cpu_cache_gb=1.0)
    m.attach(make_record("0"))
    assert m.set_layout(WorkerId("0"), make_layout()) is True  # no plan yet
    m.replan()
    assert m.set_layout(WorkerId("0"), make_layout()) is False  # same layout, plan exists
    assert m.set_layout(WorkerId("0"), make_layout(num_layers=8)) is True


@pytest.mark.parametrize("error, layout, ready_epoch, expected", [
    ("", None, -1, "waiting-for-engine"),
    ("", make_layout(), -1, "allocating"),
    ("", make_layout(), 3, "ready"),
    ("oom", make_layout(), 3, "failed"),
])
def test_worker_state(error: str, layout, ready_epoch: int, expected: str) -> None:
    record = make_record("0")
    record.error, record.layout, record.ready_epoch = error, layout, ready_epoch
    assert record.state(epoch=3) == expected


def test_replan_with_no_expected_list_sizes_by_attached_workers() -> None:
    m = make_membership(cpu_cache_gb=1.0)
    attach_all(m, {"a": make_layout(10, 1000)})

    plan = m.replan()

    assert plan is not None and plan.host_slots == 1e9 // 12_288


# --------------------------------------------------------------------------- layout checks
@pytest.mark.parametrize("layout, config, expected", [
    (make_layout(32, 65536), dict(cpu_cache_gb=1.0), None),
    # the 50002-layer region that sized G2 and G3 to 0 blocks: over the layer bound
    (make_layout(50002, 4096), dict(cpu_cache_gb=1.0, disk_cache_gb=1.0), "num_layers 50002 outside 1..8192"),
    (make_layout(5000, 65536), dict(cpu_cache_gb=0.1),
     "G2 would hold 0 blocks: one block takes 327680000 bytes over the node's workers (slots aligned to 4096) "
     "and DYN_KVBM_CPU_CACHE_GB=0.1 allows 100000000 bytes"),
    (make_layout(5000, 65536), dict(cpu_cache_gb=10.0, disk_cache_gb=0.2), "G3 would hold 0 blocks"),
    (make_layout(5000, 65536), dict(cpu_cache_override_num_blocks=4), None),  # the override is a count
    (make_layout(0, 4096), dict(cpu_cache_gb=1.0), "num_layers 0 outside"),
    (make_layout(2, 0), dict(cpu_cache_gb=1.0), "a block shard must hold"),
    (make_layout(4096, 1 << 21), dict(cpu_cache_gb=1.0), "a block shard must hold"),
    (Layout(2, 4096, "bf16", 0, 0), dict(cpu_cache_gb=1.0), "num_engine_blocks 0 outside"),
    (Layout(2, 4096, "x" * 300, 8, 0), dict(cpu_cache_gb=1.0), "dtype of 300 bytes"),
])
def test_layout_problem(layout: Layout, config: dict, expected: str | None) -> None:
    m = make_membership("0", **config)
    m.attach(make_record("0"))
    problem = m.layout_problem(WorkerId("0"), layout)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem
    assert m.workers[WorkerId("0")].layout is None  # checking records nothing


def test_layout_problem_counts_the_other_workers_slots() -> None:
    # 0.1 GB over two workers: each alone fits (60 MB slots), together 120 MB > 100 MB
    m = make_membership("0", "1", cpu_cache_gb=0.1)
    attach_all(m, {"0": make_layout(15, 4_000_000)})
    m.attach(make_record("1", 1))
    assert m.layout_problem(WorkerId("1"), make_layout(15, 4_000_000, rank=1)) is not None
    assert m.layout_problem(WorkerId("1"), make_layout(1, 4096, rank=1)) is None
