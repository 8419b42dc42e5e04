"""`kvbm serve`'s supervisor: which daemons it starts, with which arguments."""
import pytest

from kvbm_client.cli import Supervisor, build_parser
from kvbm_client.config import KvbmConfig


def argv_tail(child) -> list[str]:
    return child.argv[2:]  # drop the interpreter and "-m"


def test_cpu_workers_by_default() -> None:
    sup = Supervisor(KvbmConfig(cpu_cache_gb=1), 2, {}, False)
    assert argv_tail(sup.leader) == ["kvbm_leader", "--num-workers", "2"]
    assert [argv_tail(w) for w in sup.workers] == [["kvbm_worker", "--worker-id", "0", "--cpu"],
                                                   ["kvbm_worker", "--worker-id", "1", "--cpu"]]


def test_one_gpu_worker_per_device() -> None:
    sup = Supervisor(KvbmConfig(cpu_cache_gb=1), 1, {}, True, gpus=[2, 3])
    assert argv_tail(sup.leader) == ["kvbm_leader", "--num-workers", "2"]
    assert [argv_tail(w) for w in sup.workers] == [["kvbm_worker", "--worker-id", "0", "--gpu", "2"],
                                                   ["kvbm_worker", "--worker-id", "1", "--gpu", "3"]]
    assert sup.env["DYN_LOG"] == "debug"


def test_serve_rejects_bad_gpu_list(capsys) -> None:
    args = build_parser().parse_args(["serve", "--gpus", "zero", "--cpu-cache-gb", "1"])
    assert args.func(args) == 2
    assert "--gpus wants comma-separated device ordinals" in capsys.readouterr().err


def test_serve_without_a_tier_explains(capsys, monkeypatch) -> None:
    for var in ("DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_DISK_CACHE_GB", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
                "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["serve"])
    assert args.func(args) == 2
    assert "no cache tier configured" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["status", "--help"]])
def test_help_explains(argv, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 0
    assert len(capsys.readouterr().out) > 200
