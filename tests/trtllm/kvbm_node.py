"""The real kvbm daemons behind the driver, and the driver set up with kvbm's TensorRT-LLM connector.

A :class:`KvbmNode` is a :class:`~kvbm_client.local_node.LocalNode` of one leader and one worker
daemon per tensor-parallel rank (``--cpu``, or ``--gpu 0`` for ``device="cuda:0"``), as child
processes on real unix sockets, with logs in the test's directory. The connector runs in the test
process and finds them as TensorRT-LLM's would: through ``DYN_KVBM_*`` and
``KVBM_TRTLLM_CONNECTOR_CONFIG`` in the environment (:meth:`KvbmNode.engine_env`).
"""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any, Mapping

from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

from kvbm_client.ids import WorkerId
from kvbm_client.local_node import LocalNode, isolated_env
from kvbm_client.connectors.trtllm.settings import CONFIG_ENV

from .driver_setup import ConnectorFactories

#: The guide's ``kv_connector_config`` with kvbm's classes.
KVBM_CONNECTOR = KvCacheConnectorConfig("kvbm_client.connectors.trtllm", "KvbmConnectorScheduler",
                                        "KvbmConnectorWorker")
#: Seconds for the daemons to attach (a GPU worker imports torch and creates a CUDA context first).
READY_TIMEOUT = {"cpu": 60.0, "cuda": 120.0}
#: Connector options of the tests: short retries, so a restarted daemon is found again quickly.
TEST_CONNECTOR_OPTIONS = {"retry_s": 0.2, "timeout_s": 5.0, "ready_timeout_s": 60.0}


def cuda_unready() -> str | None:
    """Why the CUDA variants cannot run here (``tests/gpu/gpu_support.py``'s check), or None."""
    spec = importlib.util.spec_from_file_location("gpu_support", Path(__file__).parents[1] / "gpu" / "gpu_support.py")
    assert spec is not None and spec.loader is not None
    gpu_support = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_support)
    return gpu_support.cuda_ready()


def kvbm_factories() -> ConnectorFactories:
    """The factories TensorRT-LLM builds from :data:`KVBM_CONNECTOR` (importlib + getattr)."""
    return ConnectorFactories.from_config(KVBM_CONNECTOR)


class KvbmNode(LocalNode):
    """A leader and ``tp`` workers for the driver's ranks (see the module doc).

    Args:
        root: the node's directory (sockets, disk tier, logs).
        device: the driver's device (``"cpu"`` or ``"cuda:N"``).
        tp: workers, one per rank.
        connector: options for ``KVBM_TRTLLM_CONNECTOR_CONFIG`` (on top of :data:`TEST_CONNECTOR_OPTIONS`).
        env: ``DYN_KVBM_*`` (and ``KVBM_FAULT_*``) settings of the daemons.
    """

    def __init__(self, root: Path, device: str = "cpu", tp: int = 1, connector: Mapping[str, Any] | None = None,
                 **env: str) -> None:
        self.kind = "cuda" if device.startswith("cuda") else "cpu"
        defaults = {"DYN_LOG": "debug", "DYN_KVBM_JOB_TIMEOUT_SECS": "5", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "512"}
        if self.kind == "cuda":
            defaults["DYN_KVBM_HOST_FREE_WATERMARK"] = "0"
        daemons_env = isolated_env(root, {**defaults, **env})
        gpus = [int(device.partition(":")[2] or 0)] * tp if self.kind == "cuda" else None
        super().__init__(daemons_env, tp, gpus=gpus, log_dir=root,
                         worker_args=("--no-nixl",) if self.kind == "cuda" else ())
        self.root = root
        self.connector_options = {**TEST_CONNECTOR_OPTIONS, **(connector or {})}

    def start_all(self) -> "KvbmNode":
        return self.start(timeout=READY_TIMEOUT[self.kind])

    def engine_env(self) -> dict[str, str]:
        """What the engine process (the driver) must see: the node's ``DYN_KVBM_*`` and the
        connector options."""
        env = {k: v for k, v in self.env.items() if k.startswith("DYN_KVBM_")}
        env[CONFIG_ENV] = json.dumps(self.connector_options)
        return env

    def counters(self) -> dict[str, float]:
        """The leader's counters (``kvbm_*``: offloads, onboards, hits, lost blocks...)."""
        return dict(self.status(5.0).counters)

    def kill_worker(self, worker_id: str = "0", timeout: float = 10.0) -> None:
        """SIGKILL worker ``worker_id``, then wait until the leader has dropped it."""
        self.kill(self.workers[WorkerId(worker_id)])
        end = time.monotonic() + timeout
        while any(w.worker_id == worker_id for w in self.status(5.0).workers):
            assert time.monotonic() < end, f"the leader still lists killed worker {worker_id}\n{self.log_tails()}"
            time.sleep(0.05)
