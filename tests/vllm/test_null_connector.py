"""The benchmarks' connector that does nothing (benchmarks/null_connector.py), in the vLLM venv:
vLLM's factory can build it (no abstract hook left) and every hook is a no-op: no hit, empty
metadata; traced, it writes the step timeline. (The GPU harness runs it as the system ``null``
beside vLLM alone.)"""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import inspect
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from benchmarks.null_connector import NullConnector as C
assert issubclass(C, KVConnectorBase_V1) and not inspect.isabstract(C), C.__abstractmethods__
c = object.__new__(C)  # (its hooks read no state)
assert c.get_num_new_matched_tokens(None, 0) == (0, False)
assert type(c.build_connector_meta(None)) is KVConnectorMetadata
assert c.update_state_after_alloc(None, None, 0) is None and c.start_load_kv(None) is None
assert c.wait_for_layer_load("l0") is None and c.save_kv_layer("l0", None, None) is None
assert c.wait_for_save() is None
import json, os, sys
from types import SimpleNamespace
from kvbm_client.connectors.core import tracing
tracing.TRACE_PATH = sys.argv[1]
c.get_num_new_matched_tokens(SimpleNamespace(request_id="r1"), 0)
c.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=96))
c.start_load_kv(None)
c.wait_for_save()
c.wait_for_save()  # (no start_load_kv before it: no line)
events = [json.loads(line) for line in open(sys.argv[1])]
assert [e["what"] for e in events] == ["null_lookup", "null_step", "null_forward"], events
assert events[0]["req"] == "r1" and events[1]["tokens"] == 96 and events[2]["ms"] >= 0
print("ok")
"""


def test_vllm_can_build_it_and_every_hook_does_nothing(vllm_python: Path, tmp_path: Path):
    out = subprocess.run([str(vllm_python), "-c", CHECK, str(tmp_path / "trace.jsonl")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
