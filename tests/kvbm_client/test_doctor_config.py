"""`kvbm doctor`'s configuration checks: parse, pool sizes, G2 against RAM and `ulimit -l`,
and the shared sizing rule the leader plans with."""
from __future__ import annotations

import resource
from pathlib import Path

import pytest

from kvbm_client.cli import build_parser
from kvbm_client.config import KvbmConfig
from kvbm_client.doctor import sizes
from kvbm_client.doctor.base import DoctorContext, DoctorOptions, LayoutArg, Status
from kvbm_client.doctor.cli import context_from_args
from kvbm_client.doctor.machine import gb_at_most, memory
from kvbm_client.sizing import PoolSizes, pool_sizes, slot_bytes, tier_slots


def ctx_of(tmp_path: Path, options: DoctorOptions | None = None, **env: str) -> DoctorContext:
    base = {"DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock"), "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk")}
    return DoctorContext.from_env({**base, **env}, options)


# ---- sizing (kvbm_client.sizing: the leader's rule) ---------------------------------------
def test_tier_slots_is_dynamos_rule() -> None:
    assert tier_slots(None, 1.0, 32768) == 30517  # 1e9 // 32768
    assert tier_slots(77, 1.0, 32768) == 77  # the override wins
    assert tier_slots(None, None, 32768) == 0
    assert tier_slots(0, 0.0, 1) == 0


def test_pool_sizes_sum_shards_and_pad_each_worker() -> None:
    cfg = KvbmConfig(cpu_cache_gb=0.001, disk_cache_override_num_blocks=10)
    sizes_ = pool_sizes(cfg, [5000, 5000])
    assert sizes_ == PoolSizes((5000, 5000), 61, 10)  # 1e6 // 16384: two 8192-byte slots
    assert sizes_.slot_bytes == 2 * slot_bytes(5000) == 16384
    assert sizes_.host_bytes == 61 * 16384 and sizes_.disk_bytes == 10 * 16384
    with pytest.raises(ValueError):
        pool_sizes(cfg, [])


def test_layout_arg() -> None:
    assert LayoutArg.parse("36:65536") == LayoutArg(36, 65536, None)
    assert LayoutArg.parse("4:2048:2") == LayoutArg(4, 2048, 2)
    for bad in ("36", "a:b", "0:4096", "1:2:3:4"):
        with pytest.raises(ValueError, match="LAYERS:PAGE_BYTES"):
            LayoutArg.parse(bad)


def test_cli_refuses_a_bad_layout(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["doctor", "--layout", "36"])
    assert exc.value.code == 2
    assert "--layout wants LAYERS:PAGE_BYTES[:WORKERS]" in capsys.readouterr().err


# ---- config.parse -------------------------------------------------------------------------
def test_parse_ok(tmp_path: Path) -> None:
    result = sizes.check_parse(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_GB="1", DYN_KVBM_DISK_CACHE_GB="2"))
    assert result.status is Status.OK
    assert result.message == "parses; tiers G2 + G3"


def test_parse_fails_on_a_bad_variable(tmp_path: Path) -> None:
    result = sizes.check_parse(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_GB="lots"))
    assert result.status is Status.FAIL
    assert "DYN_KVBM_CPU_CACHE_GB='lots'" in result.message
    assert "kvbm serve --help" in result.remedy


def test_parse_fails_on_a_bad_flag(monkeypatch) -> None:
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_GB", raising=False)
    ctx = context_from_args(build_parser().parse_args(["doctor", "--cpu-cache-gb", "-1"]))
    result = sizes.check_parse(ctx)
    assert result.status is Status.FAIL
    assert "DYN_KVBM_CPU_CACHE_GB must be a finite number >= 0, got -1.0" in result.message


def test_parse_fails_without_a_tier(tmp_path: Path) -> None:
    result = sizes.check_parse(ctx_of(tmp_path))
    assert result.status is Status.FAIL
    assert result.message == "no cache tier configured: the leader refuses to start"
    assert "set DYN_KVBM_CPU_CACHE_GB" in result.remedy


# ---- config.pools -------------------------------------------------------------------------
def test_pools_in_blocks_for_a_layout(tmp_path: Path) -> None:
    options = DoctorOptions(workers=2, layout=LayoutArg(4, 4096))
    result = sizes.check_pools(ctx_of(tmp_path, options, DYN_KVBM_CPU_CACHE_GB="1",
                                      DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="50"))
    assert result.status is Status.OK
    assert result.data["host_slots"] == 30517 and result.data["disk_slots"] == 50
    assert "G2 30517 blocks" in result.message and "--layout 2 worker(s) x 4 layers x 4096 B" in result.message


def test_pools_fail_when_a_tier_is_below_one_block(tmp_path: Path) -> None:
    options = DoctorOptions(layout=LayoutArg(36, 65536))
    result = sizes.check_pools(ctx_of(tmp_path, options, DYN_KVBM_CPU_CACHE_GB="0.001"))
    assert result.status is Status.FAIL
    assert result.message.endswith("G2 is smaller than one block")
    assert result.remedy == "raise DYN_KVBM_CPU_CACHE_GB to at least 0.00236 GB (one block)"


def test_pools_skip_without_a_layout(tmp_path: Path) -> None:
    result = sizes.check_pools(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_GB="1"))
    assert result.status is Status.SKIP
    assert "--layout LAYERS:PAGE_BYTES[:WORKERS]" in result.message


# ---- config.host_memory -------------------------------------------------------------------
def test_host_memory_fits(tmp_path: Path) -> None:
    result = sizes.check_host_memory(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_GB="0.1"))
    assert result.status is Status.OK
    assert result.data["host_bytes"] == 100_000_000


def test_host_memory_fails_when_g2_exceeds_ram(tmp_path: Path) -> None:
    too_big = memory().mem_available * 4 / 1e9
    result = sizes.check_host_memory(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_GB=f"{too_big:.1f}"))
    assert result.status is Status.FAIL
    assert "G2 does not fit; the workers would be OOM-killed while allocating" in result.message
    assert result.remedy.startswith("lower DYN_KVBM_CPU_CACHE_GB to at most ")


def test_host_memory_needs_a_layout_for_block_counts(tmp_path: Path) -> None:
    result = sizes.check_host_memory(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="100"))
    assert result.status is Status.SKIP
    options = DoctorOptions(layout=LayoutArg(1, 4096))
    result = sizes.check_host_memory(ctx_of(tmp_path, options, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="100"))
    assert result.status is Status.OK and result.data["host_bytes"] == 100 * 4096


# ---- config.memlock -----------------------------------------------------------------------
@pytest.fixture
def memlock_64k():
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, hard))
    yield
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_memlock_below_g2_is_information(tmp_path: Path, memlock_64k) -> None:
    result = sizes.check_memlock(ctx_of(tmp_path, DoctorOptions(gpus=(0,)), DYN_KVBM_CPU_CACHE_GB="1"))
    assert result.status is Status.INFO
    assert result.message.startswith("ulimit -l 64.00 KiB is below G2 (953.67 MiB): fine for CUDA pinning")
    assert "ulimit -l unlimited" in result.remedy and "LimitMEMLOCK=infinity" in result.remedy


def test_memlock_ok_when_g2_fits(tmp_path: Path, memlock_64k) -> None:
    result = sizes.check_memlock(ctx_of(tmp_path, DoctorOptions(gpus=(0,)), DYN_KVBM_CPU_CACHE_GB="0.00006"))
    assert result.status is Status.OK
    assert result.message == "ulimit -l 64.00 KiB"


def test_memlock_skipped_for_cpu_workers(tmp_path: Path) -> None:
    result = sizes.check_memlock(ctx_of(tmp_path, DYN_KVBM_CPU_CACHE_GB="1"))
    assert result.status is Status.SKIP and "CPU workers" in result.message


def test_gb_suggestions_round_down() -> None:
    assert gb_at_most(52_300_000) == "0.0523"
    assert gb_at_most(18_987_000_000) == "18.9"
    assert gb_at_most(123_900_000_000) == "123"
    assert gb_at_most(0) == "0"
