"""`kvbm doctor` as a command: the runner (order, options, a crashing check), the table and the
JSON, exit codes, and NIXL missing from the environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvbm_client.doctor import ALL_CHECKS, run_checks
from kvbm_client.doctor.base import Check, DoctorContext, DoctorOptions, Status, ok
from kvbm_client.doctor.report import render_json, render_table

REPO = Path(__file__).resolve().parents[2]


def env_of(tmp_path: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("DYN_KVBM_") and k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    base.update({"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
                 "DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock"),
                 "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk")})
    base.update(extra)
    return base


def doctor(tmp_path: Path, *args: str, pythonpath: str | None = None, **env: str) -> subprocess.CompletedProcess:
    full = env_of(tmp_path, **env)
    full["COLUMNS"] = "200"  # the table's width (a runner's own COLUMNS would wrap the lines read below)
    if pythonpath:
        full["PYTHONPATH"] = f"{pythonpath}:{full['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-m", "kvbm_client.cli", "doctor", *args], env=full,
                          capture_output=True, text=True, timeout=120)


def by_id(report: dict) -> dict[str, dict]:
    return {c["check"]: c for c in report["checks"]}


# ---- runner -------------------------------------------------------------------------------
def test_a_crashing_check_fails_alone(tmp_path: Path) -> None:
    def boom(ctx):
        raise RuntimeError("boom")

    checks = (Check("t", "boom", boom), Check("t", "fine", lambda ctx: ok("fine")))
    report = run_checks(DoctorContext.from_env({"DYN_KVBM_CPU_CACHE_GB": "1"}), checks)
    assert report.get("t.boom").status is Status.FAIL
    assert report.get("t.boom").message == "the check itself failed: RuntimeError: boom"
    assert report.get("t.fine").status is Status.OK
    assert report.exit_code == 1


def test_checks_needing_config_skip_when_it_does_not_parse() -> None:
    report = run_checks(DoctorContext.from_env({"DYN_KVBM_CPU_CACHE_GB": "lots"}))
    assert report.get("config.parse").status is Status.FAIL
    assert report.get("disk.dir").message == "configuration does not parse (see config.parse)"
    assert report.get("disk.dir").status is Status.SKIP


def test_benchmarks_run_only_when_asked(tmp_path: Path) -> None:
    env = {"DYN_KVBM_DISK_CACHE_GB": "0.01", "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path),
           "DYN_KVBM_SOCKET_DIR": str(tmp_path / "sock")}
    picked = [c for c in ALL_CHECKS if c.id in ("disk.bench", "disk.dir")]
    plain = run_checks(DoctorContext.from_env(env), picked)
    assert [f.check.id for f in plain.findings] == ["disk.dir"]
    asked = run_checks(DoctorContext.from_env(env, DoctorOptions(bench_disk=True)), picked)
    assert [f.check.id for f in asked.findings] == ["disk.dir", "disk.bench"]


def test_warnings_do_not_fail() -> None:
    checks = (Check("t", "w", lambda ctx: ok("x")),)
    report = run_checks(DoctorContext.from_env({}), checks)
    assert report.exit_code == 0 and not report.failed


def test_table_and_json_render_every_check(tmp_path: Path) -> None:
    report = run_checks(DoctorContext.from_env({"DYN_KVBM_CPU_CACHE_GB": "lots"}))
    table = render_table(report, 120)
    assert table.splitlines()[0].split() == ["CHECK", "RESULT", "WHAT", "TO", "DO"]
    assert "config.parse" in table and "FAIL" in table and table.splitlines()[-1].endswith("FAILED (exit 1)")
    data = json.loads(render_json(report))
    assert data["ok"] is False and data["exit_code"] == 1
    assert [c["check"] for c in data["checks"]] == [f.check.id for f in report.findings]
    assert data["counts"]["fail"] == 1


# ---- the command --------------------------------------------------------------------------
def test_command_exit_0_and_json(tmp_path: Path) -> None:
    done = doctor(tmp_path, "--json", DYN_KVBM_CPU_CACHE_GB="0.1", DYN_KVBM_DISK_CACHE_GB="0.01")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # NIXL's own INFO lines went to stderr
    checks = by_id(report)
    assert report["ok"] is True
    assert checks["config.parse"]["status"] == "ok"
    assert checks["node.leader"]["status"] == "info" and checks["node.leader"]["message"].startswith("not running")
    assert checks["disk.o_direct"]["status"] in ("ok", "fail")


def test_command_exit_1_on_a_config_that_does_not_parse(tmp_path: Path) -> None:
    done = doctor(tmp_path, DYN_KVBM_CPU_CACHE_GB="lots")
    assert done.returncode == 1
    line = next(line for line in done.stdout.splitlines() if line.startswith("config.parse"))
    assert "FAIL" in line and "DYN_KVBM_CPU_CACHE_GB='lots'" in line


def test_a_staging_area_out_of_bounds_fails_the_configuration(tmp_path: Path) -> None:
    done = doctor(tmp_path, "--json", "--stage-mib", "1e9", DYN_KVBM_CPU_CACHE_GB="0.1")
    checks = by_id(json.loads(done.stdout))
    assert done.returncode == 1
    assert checks["config.parse"]["status"] == "fail"
    assert "--stage-mib must be in [0, 65536]" in checks["config.parse"]["message"]


def test_command_flags_override_the_environment(tmp_path: Path) -> None:
    done = doctor(tmp_path, "--json", "--cpu-cache-gb", "0.1", "--layout", "4:4096:2", DYN_KVBM_CPU_CACHE_GB="5")
    checks = by_id(json.loads(done.stdout))
    assert checks["config.parse"]["status"] == "ok"
    assert checks["config.pools"]["data"]["host_slots"] == 100_000_000 // 32768


def test_nixl_missing_is_a_warning(tmp_path: Path) -> None:
    """An environment without NIXL (both import names shadowed by modules that fail to import)."""
    shadow = tmp_path / "shadow"
    for name in ("nixl_cu13", "nixl"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f"raise ImportError('no module named {name} (test)')\n")
    done = doctor(tmp_path, "--json", pythonpath=str(shadow), DYN_KVBM_DISK_CACHE_GB="0.01")
    check = by_id(json.loads(done.stdout))["nixl.posix"]
    assert check["status"] == "warn"
    assert "the worker falls back to preadv/pwritev" in check["message"]
    assert check["remedy"] == "pip install 'kvbm[nixl]' (nixl-cu13) to use NIXL's POSIX backend"
