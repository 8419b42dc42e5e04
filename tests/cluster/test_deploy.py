"""deploy/: compose files parse and wire what they claim, the dashboard shows every seed
metric, the systemd units are valid (systemd-analyze when present, else parsed)."""
from __future__ import annotations

import configparser
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvbm_client.config import OPTIONS

DEPLOY = Path(__file__).parent.parent.parent / "deploy"
SEED_METRICS = ["kvbm_matched_tokens", "kvbm_offload_blocks_d2h", "kvbm_offload_blocks_h2d",
                "kvbm_offload_blocks_d2d", "kvbm_onboard_blocks_h2d", "kvbm_onboard_blocks_d2d",
                "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate"]


def test_compose_files_define_the_services():
    base = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {"etcd", "nats"} <= set(base["services"])
    assert any("2379" in p for p in base["services"]["etcd"]["ports"])
    obs = yaml.safe_load((DEPLOY / "docker-observability.yml").read_text())
    assert {"prometheus", "grafana"} <= set(obs["services"])
    for volume in obs["services"]["grafana"]["volumes"] + obs["services"]["prometheus"]["volumes"]:
        assert (DEPLOY / volume.split(":")[0]).exists(), volume
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"][0].endswith(":6880")
    for f in (DEPLOY / "grafana" / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(f.read_text())["apiVersion"] == 1


def test_dashboard_shows_every_seed_metric():
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "kvbm.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in SEED_METRICS:
        assert metric in exprs, metric
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_env_file_names_only_known_variables():
    known = {o.env for o in OPTIONS} | {"KVBM_NUM_WORKERS", "KVBM_LEADER_ARGS", "KVBM_WORKER_ARGS"}
    for line in (DEPLOY / "kvbm.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert line.split("=", 1)[0] in known, line


@pytest.mark.parametrize("unit", ["kvbm-leader.service", "kvbm-worker@.service"])
def test_systemd_units(unit, tmp_path):
    path = DEPLOY / "systemd" / unit
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(path.read_text())
    assert {"Unit", "Service", "Install"} <= set(parser.sections())
    assert parser["Service"]["EnvironmentFile"] == "/etc/kvbm/kvbm.env"
    assert parser["Service"]["Restart"] == "on-failure"
    assert parser["Service"]["ExecStart"].split()[0].endswith("kvbm-leader" if "leader" in unit else "kvbm-worker")
    # the extra arguments of kvbm.env (e.g. the worker's --stage-mib), split into words by systemd
    assert parser["Service"]["ExecStart"].split()[-1] == ("$KVBM_LEADER_ARGS" if "leader" in unit else "$KVBM_WORKER_ARGS")
    if shutil.which("systemd-analyze"):
        # The binaries live in /opt/kvbm on a real host; check the unit's syntax only.
        text = path.read_text().replace("/opt/kvbm/.venv/bin/", "/bin/true # ")
        name = unit.replace("@", "@0") if unit.endswith("@.service") else unit
        (tmp_path / name).write_text(text)
        out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / name)],
                             capture_output=True, text=True, timeout=60)
        problems = [line for line in out.stderr.splitlines()
                    if str(tmp_path) in line and "EnvironmentFile" not in line]
        assert not problems, out.stderr
