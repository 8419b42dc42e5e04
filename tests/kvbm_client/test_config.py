"""KvbmConfig: the DYN_KVBM_* environment, flags, validation and the child-process round trip."""
from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from kvbm_client.config import (OPTIONS, KvbmConfig, add_config_arguments, config_from_args, config_to_env,
                                parse_bool)
from kvbm_client.errors import KvbmConfigError

CPU = "DYN_KVBM_CPU_CACHE_GB"
DISK = "DYN_KVBM_DISK_CACHE_GB"


def make_config(**env: str) -> KvbmConfig:
    """A config read from exactly ``env`` (never the test process's environment)."""
    return KvbmConfig.from_env(dict(env))


def make_parser(fields: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, fields)
    return parser


def test_dynamo_defaults() -> None:
    cfg = make_config()
    assert cfg.disk_cache_dir == "/tmp"
    assert cfg.leader_worker_init_timeout_secs == 1800.0
    assert cfg.metrics_port == 6880
    assert cfg.metrics is False
    assert cfg.disable_disk_offload_filter is False  # the filter is on
    assert (cfg.cpu_cache_gb, cfg.disk_cache_gb) == (None, None)
    assert (cfg.cpu_cache_override_num_blocks, cfg.disk_cache_override_num_blocks) == (None, None)
    assert cfg == KvbmConfig()


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU, "2.5")
    monkeypatch.setenv("DYN_KVBM_METRICS_PORT", "7001")
    cfg = KvbmConfig.from_env()
    assert (cfg.cpu_cache_gb, cfg.metrics_port) == (2.5, 7001)


def test_every_option_has_a_matching_field_and_default() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(KvbmConfig)}
    assert {o.field for o in OPTIONS} == set(fields)
    for opt in OPTIONS:
        assert opt.env.startswith("DYN_KVBM_") or opt.env in ("ETCD_ENDPOINTS", "NATS_SERVER")
        assert fields[opt.field] == opt.default, opt.field
    assert len({o.env for o in OPTIONS}) == len(OPTIONS)


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("1", True), ("TRUE", True), (" yes ", True), ("on", True),
    ("false", False), ("0", False), ("no", False), ("off", False), ("", False),
])
def test_bool_parsing(text: str, expected: bool) -> None:
    assert parse_bool(text) is expected
    assert make_config(DYN_KVBM_METRICS=text).metrics is expected


@pytest.mark.parametrize("env, field, expected", [
    ({CPU: "4"}, "cpu_cache_gb", 4.0),
    ({CPU: ""}, "cpu_cache_gb", None),
    ({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "128"}, "cpu_cache_override_num_blocks", 128),
    ({"DYN_KVBM_DISK_CACHE_DIR": "/mnt/nvme"}, "disk_cache_dir", "/mnt/nvme"),
    ({"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "1"}, "disable_disk_offload_filter", True),
    ({"DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "60"}, "leader_worker_init_timeout_secs", 60.0),
    ({"DYN_KVBM_METRICS_PORT": "9100"}, "metrics_port", 9100),
    ({"DYN_KVBM_HOST_FREE_WATERMARK": "0.2"}, "host_free_watermark", 0.2),
    ({}, "store_demotion_mb", 64.0),
    ({"DYN_KVBM_STORE_DEMOTION_MB": "0"}, "store_demotion_mb", 0.0),
    ({"DYN_KVBM_STORE_DEMOTION_MB": "-1"}, "store_demotion_mb", -1.0),
])
def test_env_values_are_parsed(env: dict, field: str, expected) -> None:
    assert getattr(make_config(**env), field) == expected


@pytest.mark.parametrize("var, raw", [
    ("DYN_KVBM_METRICS", "maybe"),
    ("DYN_KVBM_METRICS_PORT", "http"),
    ("DYN_KVBM_METRICS_PORT", "6880.5"),
    (CPU, "lots"),
    ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "1.5"),
    ("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "soon"),
    ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "2"),
])
def test_unparsable_values_raise_naming_the_variable(var: str, raw: str) -> None:
    with pytest.raises(KvbmConfigError) as info:
        make_config(**{var: raw})
    assert var in str(info.value)
    assert isinstance(info.value, ValueError)  # leaf errors also subclass the built-in


@pytest.mark.parametrize("var, raw", [
    (CPU, "-1"),
    (DISK, "-0.5"),
    ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "-3"),
    ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "-3"),
    ("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "0"),
    ("DYN_KVBM_METRICS_PORT", "0"),
    ("DYN_KVBM_METRICS_PORT", "65536"),
    ("DYN_KVBM_HOST_FREE_WATERMARK", "1"),
    ("DYN_KVBM_HOST_FREE_WATERMARK", "-0.1"),
    ("DYN_KVBM_STORE_DEMOTION_MB", "-2"),
    ("DYN_KVBM_STORE_DEMOTION_MB", "inf"),
])
def test_out_of_range_values_raise_naming_the_variable(var: str, raw: str) -> None:
    with pytest.raises(KvbmConfigError, match=var):
        make_config(**{var: raw})


@pytest.mark.parametrize("var", ["DYN_KVBM_MAX_HASHES_PER_REQUEST", "DYN_KVBM_JOB_TIMEOUT_SECS",
                                 "DYN_KVBM_SESSION_TTL_SECS"])
def test_non_positive_limits_are_rejected(var: str) -> None:
    with pytest.raises(KvbmConfigError):
        make_config(**{var: "0"})


@pytest.mark.parametrize("var, raw", [
    (CPU, "nan"),
    (CPU, "inf"),
    (DISK, "nan"),
    ("DYN_KVBM_DISK_FILTER_MAX_ENTRIES", "0"),
    ("DYN_KVBM_DISK_FILTER_MAX_ENTRIES", "-1"),
])
def test_values_that_crash_the_leader_are_rejected(var: str, raw: str) -> None:
    with pytest.raises(KvbmConfigError, match=var):
        make_config(**{var: raw})


# --------------------------------------------------------------------------- tiers
@pytest.mark.parametrize("env, host, disk, disk_only", [
    ({}, False, False, False),
    ({CPU: "1"}, True, False, False),
    ({DISK: "1"}, False, True, True),
    ({CPU: "1", DISK: "1"}, True, True, False),
    ({CPU: "0", DISK: "1"}, False, True, True),
    ({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "8"}, True, False, False),
    ({"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8"}, False, True, True),
])
def test_tier_properties(env: dict, host: bool, disk: bool, disk_only: bool) -> None:
    cfg = make_config(**env)
    assert (cfg.host_enabled, cfg.disk_enabled, cfg.disk_only) == (host, disk, disk_only)
    if host or disk:
        cfg.require_tier()
    else:
        with pytest.raises(KvbmConfigError, match="no cache tier configured") as info:
            cfg.require_tier()
        assert CPU in str(info.value) and DISK in str(info.value)


# --------------------------------------------------------------------------- addresses
def test_socket_dir_and_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    cfg = make_config()
    assert cfg.resolved_socket_dir.startswith("/run/user/1234/kvbm-")
    assert cfg.resolved_leader_address == f"unix:{cfg.resolved_socket_dir}/leader.sock"

    cfg = make_config(DYN_KVBM_SOCKET_DIR="/s", DYN_KVBM_LEADER_ADDRESS="localhost:5000")
    assert cfg.resolved_leader_address == "localhost:5000"
    assert cfg.worker_address("3") == "unix:/s/worker-3.sock"


def test_socket_dir_falls_back_to_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert make_config().resolved_socket_dir.startswith("/tmp/kvbm-")


# --------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("cfg", [
    KvbmConfig(),
    KvbmConfig(cpu_cache_gb=4.5, disk_cache_gb=100.0, disk_cache_dir="/mnt/nvme 0",
               disable_disk_offload_filter=True, metrics=True, metrics_port=9000,
               socket_dir="/run/kvbm", leader_address="unix:/run/kvbm/l.sock",
               host_free_watermark=0.125, session_ttl_secs=2.5),
    KvbmConfig(disk_cache_override_num_blocks=1024, cpu_cache_override_num_blocks=12,
               disk_zerofill_fallback=True, disk_disable_o_direct=True, max_hashes=7),
], ids=["defaults", "everything", "overrides"])
def test_config_to_env_round_trip(cfg: KvbmConfig) -> None:
    env = config_to_env(cfg)
    assert all(k.startswith("DYN_KVBM_") and isinstance(v, str) for k, v in env.items())
    assert KvbmConfig.from_env(env) == cfg


def test_config_to_env_writes_booleans_lowercase_and_skips_none() -> None:
    env = config_to_env(KvbmConfig(metrics=True))
    assert env["DYN_KVBM_METRICS"] == "true"
    assert env["DYN_KVBM_DISK_ZEROFILL_FALLBACK"] == "false"
    assert CPU not in env and "DYN_KVBM_SOCKET_DIR" not in env


# --------------------------------------------------------------------------- flags
def test_flags_override_env() -> None:
    env = {CPU: "1", "DYN_KVBM_METRICS": "false", "DYN_KVBM_METRICS_PORT": "7000", DISK: "9"}
    args = make_parser().parse_args(["--cpu-cache-gb", "8", "--metrics", "true", "--metrics-port", "7100"])

    cfg = config_from_args(args, env)

    assert (cfg.cpu_cache_gb, cfg.metrics, cfg.metrics_port) == (8.0, True, 7100)
    assert cfg.disk_cache_gb == 9.0  # not given as a flag: env value kept


def test_no_flags_means_env_only() -> None:
    cfg = config_from_args(make_parser().parse_args([]), {CPU: "3"})
    assert cfg == KvbmConfig(cpu_cache_gb=3.0)


def test_invalid_flag_raises_naming_the_flag() -> None:
    args = make_parser().parse_args(["--metrics-port", "abc"])
    with pytest.raises(KvbmConfigError, match="--metrics-port"):
        config_from_args(args, {})


def test_flag_values_are_validated_too() -> None:
    args = make_parser().parse_args(["--cpu-cache-gb", "-2"])
    with pytest.raises(KvbmConfigError, match=CPU):
        config_from_args(args, {})


def test_every_option_gets_a_flag_whose_help_names_its_variable() -> None:
    parser = make_parser()
    actions = {a.dest: a for a in parser._actions}
    for opt in OPTIONS:
        action = actions[opt.field]
        assert action.option_strings == ["--" + opt.field.replace("_", "-")]
        assert opt.env in action.help
        assert action.default is None  # so an absent flag never overrides the environment


def test_field_subset_limits_the_flags() -> None:
    parser = make_parser(("cpu_cache_gb",))
    args = parser.parse_args(["--cpu-cache-gb", "2"])
    assert config_from_args(args, {}).cpu_cache_gb == 2.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics", "true"])


def test_a_unix_socket_path_too_long_to_bind_is_a_clear_error(tmp_path) -> None:
    from kvbm_client.endpoints import MAX_UNIX_PATH_BYTES, prepare_unix_socket
    from kvbm_client.errors import KvbmConfigError
    deep = tmp_path / ("d" * (MAX_UNIX_PATH_BYTES - len(str(tmp_path)) - 5))
    with pytest.raises(KvbmConfigError, match="DYN_KVBM_SOCKET_DIR"):
        prepare_unix_socket(f"unix:{deep}/worker-0.regions.sock")
    assert not deep.exists(), "nothing is created for a socket that cannot be bound"
    fits = tmp_path / "s"
    assert prepare_unix_socket(f"unix:{fits}/leader.sock") == f"{fits}/leader.sock"


def test_a_leader_whose_socket_path_is_too_long_exits_with_the_reason(tmp_path) -> None:
    import subprocess
    import sys
    deep = tmp_path / ("d" * 100)
    proc = subprocess.run([sys.executable, "-m", "kvbm_leader"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DYN_KVBM_SOCKET_DIR": str(deep), "DYN_KVBM_CPU_CACHE_GB": "0.01"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "DYN_KVBM_SOCKET_DIR to a shorter directory" in proc.stderr and "Traceback" not in proc.stderr


def test_a_worker_waiting_for_its_leader_stops_on_sigterm(tmp_path) -> None:
    """No leader ever comes: the worker waits for the node key, and SIGTERM ends that wait."""
    import signal
    import subprocess
    import sys
    import time
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_worker", "--cpu"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DYN_KVBM_SOCKET_DIR": str(tmp_path / "s"),
                                 "DYN_KVBM_CPU_CACHE_GB": "0.01"})
    time.sleep(2)
    assert proc.poll() is None, "the worker should be waiting for its leader"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0, proc.stderr.read()[-2000:] if proc.stderr else ""


def test_a_worker_whose_socket_path_is_too_long_exits_with_the_reason(tmp_path) -> None:
    """The leader's socket fits, the worker's region socket does not: the worker says so."""
    import signal
    import subprocess
    import sys
    from kvbm_client.endpoints import MAX_UNIX_PATH_BYTES
    room = MAX_UNIX_PATH_BYTES - len(str(tmp_path)) - len("/leader.sock") - 1
    sock = tmp_path / ("d" * room)
    env = {**os.environ, "DYN_KVBM_SOCKET_DIR": str(sock), "DYN_KVBM_CPU_CACHE_GB": "0.01"}
    leader = subprocess.Popen([sys.executable, "-m", "kvbm_leader"], env=env, stderr=subprocess.DEVNULL)
    try:
        worker = subprocess.run([sys.executable, "-m", "kvbm_worker", "--cpu"], capture_output=True, text=True,
                                timeout=60, env=env)
    finally:
        leader.send_signal(signal.SIGTERM)
        leader.wait(10)
    assert worker.returncode == 2, worker.stderr[-2000:]
    assert "DYN_KVBM_SOCKET_DIR to a shorter directory" in worker.stderr and "Traceback" not in worker.stderr
