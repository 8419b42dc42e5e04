"""benchmarks/cold_path.py against a real node (leader + CPU worker as child processes), tiny
sizes: both variants run the connector's scheduler core through a cold request's lookup and
first step, plan that step's stores whole (the script's own assertion) and time every field."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import cold_path  # noqa: E402

from kvbm_client import KvbmClient, KvbmConfig, ShmKvBuffer  # noqa: E402
from kvbm_client.local_node import LocalNode, isolated_env  # noqa: E402


@pytest.fixture(scope="module")
def node():
    with tempfile.TemporaryDirectory(prefix="kvbm-cold-test-", dir="/tmp") as tmp:
        root = Path(tmp)
        env = isolated_env(root, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "2048", "DYN_LOG": "warning",
                                  "DYN_KVBM_HOST_FREE_WATERMARK": "0"})
        with LocalNode(env, 1, log_dir=root).start() as n:
            engine = ShmKvBuffer(128, 1, 256, directory=str(root))
            client = KvbmClient(KvbmConfig.from_env(env))
            client.register_region("0", engine.spec())
            client.wait_ready(60)
            yield env, n
            client.close()
            engine.close()


@pytest.mark.parametrize("variant", cold_path.VARIANTS)
def test_a_pass_times_the_cold_path_of_every_request(node, variant):
    env, n = node
    spin = cold_path.calibrate(0.05)
    got = cold_path.one_pass(env, n.leader_address, variant, tokens=16 * 100, step_tokens=16 * 80, reps=3,
                             spin=spin, salt=1 + cold_path.VARIANTS.index(variant), gpu_layer_s=0.001)
    assert set(got) == set(cold_path.FIELDS) and all(len(v) == 3 for v in got.values())
    for i in range(3):
        assert got["lookup"][i] + got["step"][i] <= got["first_layer"][i] < got["gpu_end"][i]
        assert got["gpu_end"][i] >= 36 * 1.0, "36 modelled layers of 1 ms"
