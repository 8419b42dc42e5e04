"""`kvbm doctor`'s filesystem checks on real filesystems mounted for the test: the G3
directory (writable, O_DIRECT, fallocate, space, benchmark), /dev/shm for CPU engines, and
NIXL's POSIX backend.

The failing filesystems are real ones (mounting needs root; the tests skip otherwise):
* ramfs refuses O_DIRECT (EINVAL) and fallocate(2). NOTE: tmpfs is no such example any more:
  since Linux 6.6 tmpfs accepts O_DIRECT (checked on this machine's 6.18 kernel).
* ext2 (on a loop device) takes O_DIRECT but has no fallocate(2), so glibc's posix_fallocate
  emulation writes single bytes into the O_DIRECT file and fails with EINVAL: the failure the
  Dynamo guide fixes with DYN_KVBM_DISK_ZEROFILL_FALLBACK.
* a tmpfs mounted read-only (chmod 0500 would not stop root), and a tiny tmpfs that is full.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from kvbm_client.doctor import disk, nixl, sizes
from kvbm_client.doctor.base import DoctorContext, DoctorOptions, Status

from support.mounts import mounted


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    with mounted(tmp_path / "ramfs", "ramfs") as path:
        yield path


@pytest.fixture
def ext2(tmp_path: Path) -> Iterator[Path]:
    image = tmp_path / "ext2.img"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext2", "-q", "-F", str(image)], check=True, capture_output=True)
    with mounted(tmp_path / "ext2", "ext2", "loop", str(image)) as path:
        yield path


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    with mounted(tmp_path / "ro", "tmpfs", "ro,size=1m") as path:
        yield path


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 256 KiB: too small for any G3 and for a 1 MiB write."""
    with mounted(tmp_path / "tiny", "tmpfs", "size=256k") as path:
        yield path


def ctx_of(tmp_path: Path, disk_dir: Path, options: DoctorOptions | None = None, **env: str) -> DoctorContext:
    base = {"DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock"), "DYN_KVBM_DISK_CACHE_DIR": str(disk_dir),
            "DYN_KVBM_DISK_CACHE_GB": "0.01"}
    return DoctorContext.from_env({**base, **env}, options)


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(disk.PROBE_PREFIX)]


# ---- disk.dir -----------------------------------------------------------------------------
def test_dir_writable(tmp_path: Path) -> None:
    (tmp_path / "g3").mkdir()
    result = disk.check_dir(ctx_of(tmp_path, tmp_path / "g3"))
    assert result.status is Status.OK and result.message.endswith("writable")
    assert leftovers(tmp_path / "g3") == []


def test_dir_missing_is_created_for_the_probe_and_removed(tmp_path: Path) -> None:
    result = disk.check_dir(ctx_of(tmp_path, tmp_path / "a" / "b"))
    assert result.status is Status.OK
    assert "does not exist yet; can be created (the worker does) and written" in result.message
    assert not (tmp_path / "a").exists()


def test_dir_read_only_fails(tmp_path: Path, read_only: Path) -> None:
    result = disk.check_dir(ctx_of(tmp_path, read_only))
    assert result.status is Status.FAIL
    assert result.message == f"cannot write in {read_only}: Read-only file system (errno 30)"
    assert result.remedy.startswith("mount it read-write")


def test_dir_that_is_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = disk.check_dir(ctx_of(tmp_path, tmp_path / "file"))
    assert result.status is Status.FAIL
    assert result.message == f"{tmp_path / 'file'} exists and is not a directory"
    assert result.remedy == "point DYN_KVBM_DISK_CACHE_DIR at a directory"


def test_dir_in_ram_warns(tmp_path: Path, ramfs: Path) -> None:
    result = disk.check_dir(ctx_of(tmp_path, ramfs))
    assert result.status is Status.WARN and "in RAM" in result.message
    assert result.remedy == "point DYN_KVBM_DISK_CACHE_DIR at a local NVMe/SSD filesystem"


# ---- disk.o_direct ------------------------------------------------------------------------
def test_o_direct_ok(tmp_path: Path, ext2: Path) -> None:
    result = disk.check_o_direct(ctx_of(tmp_path, ext2))
    assert result.status is Status.OK and result.message == "O_DIRECT write and read back on ext2"


def test_o_direct_refused_fails_with_the_switch(tmp_path: Path, ramfs: Path) -> None:
    result = disk.check_o_direct(ctx_of(tmp_path, ramfs))
    assert result.status is Status.FAIL
    assert result.message == ("ramfs refuses O_DIRECT (Invalid argument (errno 22)): "
                              "the worker cannot open its G3 file")
    assert result.remedy == "export DYN_KVBM_DISK_DISABLE_O_DIRECT=true"
    assert leftovers(ramfs) == []


def test_o_direct_refused_but_disabled_is_ok(tmp_path: Path, ramfs: Path) -> None:
    result = disk.check_o_direct(ctx_of(tmp_path, ramfs, DYN_KVBM_DISK_DISABLE_O_DIRECT="true"))
    assert result.status is Status.OK
    assert result.message.endswith("DYN_KVBM_DISK_DISABLE_O_DIRECT=true is set")


def test_o_direct_disabled_needlessly_warns(tmp_path: Path, ext2: Path) -> None:
    result = disk.check_o_direct(ctx_of(tmp_path, ext2, DYN_KVBM_DISK_DISABLE_O_DIRECT="true"))
    assert result.status is Status.WARN and result.remedy == "unset DYN_KVBM_DISK_DISABLE_O_DIRECT"


# ---- disk.fallocate -----------------------------------------------------------------------
def test_fallocate_ok(tmp_path: Path) -> None:
    (tmp_path / "g3").mkdir()
    result = disk.check_fallocate(ctx_of(tmp_path, tmp_path / "g3"))
    if result.data.get("fallocate") is False:
        pytest.skip(f"{tmp_path} has no fallocate: {result.message}")
    assert result.status is Status.OK and result.message.startswith("fallocate(2) works on ")


def test_fallocate_unsupported_fails_with_the_zerofill_switch(tmp_path: Path, ext2: Path) -> None:
    result = disk.check_fallocate(ctx_of(tmp_path, ext2))
    assert result.status is Status.FAIL
    assert result.message == ("ext2 has no fallocate(2) and posix_fallocate on the worker's O_DIRECT file "
                              "fails: Invalid argument (errno 22)")
    assert result.remedy == "export DYN_KVBM_DISK_ZEROFILL_FALLBACK=true"
    assert leftovers(ext2) == []


def test_fallocate_unsupported_with_zerofill_warns(tmp_path: Path, ext2: Path) -> None:
    result = disk.check_fallocate(ctx_of(tmp_path, ext2, DYN_KVBM_DISK_ZEROFILL_FALLBACK="true"))
    assert result.status is Status.WARN
    assert "DYN_KVBM_DISK_ZEROFILL_FALLBACK=true: workers write G3's size in zeros at start" in result.message


def test_fallocate_emulated_without_o_direct_warns(tmp_path: Path, ext2: Path) -> None:
    result = disk.check_fallocate(ctx_of(tmp_path, ext2, DYN_KVBM_DISK_DISABLE_O_DIRECT="true"))
    assert result.status is Status.WARN
    assert "glibc emulates it by writing every 4 KiB block" in result.message
    assert "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS" in result.remedy


def test_fallocate_on_a_full_disk_fails(tmp_path: Path, tiny: Path) -> None:
    result = disk.check_fallocate(ctx_of(tmp_path, tiny))
    assert result.status is Status.FAIL
    assert result.message == "fallocate(2) fails on tmpfs: No space left on device (errno 28)"
    assert result.remedy.startswith("free space on that filesystem")


# ---- config.disk_space --------------------------------------------------------------------
def test_disk_space_fails_on_a_full_disk(tmp_path: Path, tiny: Path) -> None:
    result = sizes.check_disk_space(ctx_of(tmp_path, tiny))
    assert result.status is Status.FAIL
    assert "the disk is too small; sizing the G3 file would fail (ENOSPC)" in result.message
    assert result.remedy.startswith("lower DYN_KVBM_DISK_CACHE_GB to at most 0.000235, ")  # 90 % of 256 KiB


def test_disk_space_ok(tmp_path: Path) -> None:
    result = sizes.check_disk_space(ctx_of(tmp_path, tmp_path / "g3"))
    assert result.status is Status.OK and result.data["disk_bytes"] == 10_000_000


# ---- config.shm ---------------------------------------------------------------------------
def test_shm_too_small_for_the_cpu_engine_fails(tmp_path: Path, tiny: Path) -> None:
    result = sizes.check_shm(ctx_of(tmp_path, tmp_path, DoctorOptions(shm_dir=str(tiny)),
                                    VLLM_CPU_KVCACHE_SPACE="1"))
    assert result.status is Status.FAIL
    assert result.message.endswith("CPU engine KV cache 1 x 1 GiB (VLLM_CPU_KVCACHE_SPACE): does not fit")
    assert result.remedy.startswith("grow it (docker --shm-size=2g")


def test_shm_large_enough(tmp_path: Path) -> None:
    with mounted(tmp_path / "shm", "tmpfs", "size=3g") as shm:  # a limit, not a reservation
        result = sizes.check_shm(ctx_of(tmp_path, tmp_path, DoctorOptions(workers=2, shm_dir=str(shm)),
                                        VLLM_CPU_KVCACHE_SPACE="1"))
    assert result.status is Status.OK and result.data["need"] == 2 << 30


# ---- disk.bench ---------------------------------------------------------------------------
def test_bench_measures_both_directions(tmp_path: Path) -> None:
    with mounted(tmp_path / "bench", "tmpfs", "size=64m") as directory:
        result = disk.check_bench(ctx_of(tmp_path, directory))
        assert leftovers(directory) == []
    assert result.status is Status.INFO
    assert result.data["bytes"] == 16 << 20 and result.data["write_gbps"] > 0 and result.data["read_gbps"] > 0


# ---- nixl.posix ---------------------------------------------------------------------------
def test_nixl_moves_bytes(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="NIXL is not installed")
    (tmp_path / "g3").mkdir()
    result = nixl.check_posix(ctx_of(tmp_path, tmp_path / "g3"))
    assert result.status is Status.OK
    assert result.message.startswith("POSIX backend wrote and read back 1 MiB")
    assert leftovers(tmp_path / "g3") == []


def test_nixl_write_on_a_full_disk_fails(tmp_path: Path, tiny: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="NIXL is not installed")
    result = nixl.check_posix(ctx_of(tmp_path, tiny))
    assert result.status is Status.FAIL
    assert result.message.startswith(f"NIXL POSIX write + read of 1 MiB in {tiny} failed: ")
    assert result.remedy.startswith("the worker would fail every G3 copy")
    assert leftovers(tiny) == []


def test_disk_checks_skip_without_g3(tmp_path: Path) -> None:
    ctx = DoctorContext.from_env({"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_SOCKET_DIR": str(tmp_path / "s")})
    for check in (disk.check_dir, disk.check_o_direct, disk.check_fallocate, nixl.check_posix,
                  sizes.check_disk_space):
        assert check(ctx).status is Status.SKIP
