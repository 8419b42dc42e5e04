"""The worker's command line: one data path (``--cpu`` or ``--gpu``), and what it implies."""
from __future__ import annotations

import pytest

from kvbm_client.errors import KvbmConfigError
from kvbm_worker.daemon import build_parser, data_path
from kvbm_worker.grouping import GroupPacing, GroupShape
from kvbm_worker.handlers.cuda_copier import CopyMechanism


def test_cpu_and_gpu_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cpu", "--gpu", "0"])
    assert "not allowed with" in capsys.readouterr().err


def test_the_data_path_of_the_arguments():
    path = data_path(build_parser().parse_args(["--gpu", "1", "--cuda-copy", "gather", "--no-nixl"]))
    assert path.gpu == 1 and path.cuda_copy is CopyMechanism.GATHER and not path.prefer_nixl
    path = data_path(build_parser().parse_args(["--cpu"]))
    assert path.gpu is None and path.cuda_copy is CopyMechanism.AUTO and path.prefer_nixl
    with pytest.raises(KvbmConfigError, match="--gpu"):
        data_path(build_parser().parse_args(["--cuda-copy", "runs"]))


def test_the_cuda_copy_help_names_the_rule_auto_follows():
    text = " ".join(build_parser().format_help().split())
    assert "cudaMemcpyBatchAsync" in text and "256 KiB" in text


def test_the_pacing_of_layer_grouped_loads_comes_from_the_arguments():
    path = data_path(build_parser().parse_args(["--cpu"]))
    assert path.pacing == GroupPacing(), "defaults: front-loaded groups, 256 MiB pieces, 3 queued ahead"
    assert path.pacing.bounds(36, 6) == [11, 20, 27, 32, 35, 36]
    path = data_path(build_parser().parse_args(["--gpu", "0", "--load-piece-mb", "512", "--load-ahead", "0",
                                                "--load-group-shape", "even"]))
    assert path.pacing == GroupPacing(piece_bytes=512 << 20, ahead=0, shape=GroupShape.EVEN)
    assert path.pacing.bounds(36, 6) == [6, 12, 18, 24, 30, 36] and path.pacing.bounds(4, 3) == [1, 2, 4]
    assert build_parser().parse_args([]).switch_interval_ms == 0.5, "the daemon's GIL switch interval, ms"
    for bad in (["--load-ahead", "-1"], ["--load-piece-mb", "0"], ["--switch-interval-ms", "0"]):
        with pytest.raises(KvbmConfigError):
            data_path(build_parser().parse_args(bad))


def test_issue_threads_come_from_the_arguments_and_are_bounded():
    assert data_path(build_parser().parse_args(["--cpu"])).issue_threads == 2, "default: the lane and one helper"
    assert data_path(build_parser().parse_args(["--gpu", "0", "--issue-threads", "1"])).issue_threads == 1
    for bad in ("0", "9"):
        with pytest.raises(KvbmConfigError):
            data_path(build_parser().parse_args(["--gpu", "0", "--issue-threads", bad]))


def test_the_split_threshold_comes_from_the_arguments_and_is_bounded():
    assert data_path(build_parser().parse_args(["--cpu"])).issue_split_copies == 512
    path = data_path(build_parser().parse_args(["--gpu", "0", "--issue-split-copies", "256"]))
    assert path.issue_split_copies == 256 and path.issue_threads == 2
    for bad in (["--issue-split-copies", "1"], ["--issue-threads", "4", "--issue-split-copies", "3"],
                ["--issue-split-copies", str((1 << 20) + 1)]):
        with pytest.raises(KvbmConfigError, match="--issue-split-copies"):
            data_path(build_parser().parse_args(["--gpu", "0", *bad]))


def test_a_stores_wait_for_loads_comes_from_the_arguments_and_is_bounded():
    assert data_path(build_parser().parse_args(["--cpu"])).store_yield_ms == 200.0
    assert data_path(build_parser().parse_args(["--gpu", "0", "--store-yield-ms", "0"])).store_yield_ms == 0.0
    for bad in ("-1", "10001"):
        with pytest.raises(KvbmConfigError, match="--store-yield-ms"):
            data_path(build_parser().parse_args(["--gpu", "0", "--store-yield-ms", bad]))


def test_the_staging_area_comes_from_the_arguments_and_is_bounded():
    assert data_path(build_parser().parse_args([])).stage_bytes == 0, "no staging area unless asked for"
    assert data_path(build_parser().parse_args(["--gpu", "0", "--stage-mib", "512"])).stage_bytes == 512 << 20
    assert data_path(build_parser().parse_args(["--stage-mib", "0.5"])).stage_bytes == 1 << 19
    for bad in ("-1", str(64 * 1024 + 1)):
        with pytest.raises(KvbmConfigError, match="--stage-mib"):
            data_path(build_parser().parse_args(["--stage-mib", bad]))
