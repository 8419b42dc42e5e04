"""kvbm's TensorRT-LLM connector in the executor-replaying driver, against the real kvbm daemons.

Every run is byte-checked in every pass (each held position of each scheduled request equals what
recompute writes, on every rank) and its output tokens, computed from the KV bytes in the pool,
are compared with a run without any connector. The connector is built the way TensorRT-LLM builds
it (``kv_connector_config`` → importlib → the two classes, constructed from ``llm_args`` alone)
and finds the daemons through the environment. ``device`` runs everything again with CUDA pools
exported through CUDA IPC to ``--gpu`` worker daemons (skipped without CUDA).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.fault_env import fault_env

from kvbm_client.connectors.trtllm import KvbmConnectorScheduler, KvbmConnectorWorker
from kvbm_client.connectors.trtllm.settings import CONFIG_ENV

from .driver import ConnectorFactories, Driver, DriverConfig
from .forward_pass import KvMismatchError
from .kvbm_node import cuda_unready, kvbm_factories
from .scenarios import CONFIG, TP2_GEOMETRY, chats, prefix_then_extension

DRIVER_PROCESS = Path(__file__).with_name("driver_process.py")
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(cuda_unready() is not None,
                                                                   reason=str(cuda_unready())))]


def run(config: DriverConfig, workload, connectors: ConnectorFactories | None = None):
    """Run ``workload``; returns the report and the connector roles (closed by then)."""
    with Driver(config, connectors) as driver:
        report = driver.run(workload)
        roles = (driver.runtime.scheduler, driver.runtime.workers) if driver.runtime else (None, [])
    return report, roles


def baseline(config: DriverConfig, workload) -> dict[str, list[int]]:
    """The outputs without any connector (on the CPU: the model's arithmetic is exact)."""
    return run(replace(config, device="cpu"), workload)[0].outputs()


# ---------------------------------------------------------------- hits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sync", "async-overlap-chunked"])
def test_hits_from_g2_are_bit_exact_and_every_loaded_block_was_checked(kvbm_node, device, mode):
    asynchronous = mode != "sync"
    node = kvbm_node(device, connector={"load_mode": "async" if asynchronous else "sync"})
    config = replace(CONFIG, device=device, overlap_scheduler=asynchronous, enable_chunked_prefill=asynchronous,
                     max_num_tokens=12 if asynchronous else CONFIG.max_num_tokens)
    report, (scheduler, _) = run(config, chats(), kvbm_factories())
    assert report.outputs() == baseline(config, chats())
    stats = report.stats
    assert stats.onboarded_blocks > 0 and stats.delayed_frees > 0
    assert (stats.async_loads > 0) == asynchronous
    counters = node.counters()
    assert counters["kvbm_onboard_blocks_h2d"] == stats.onboarded_blocks, "a block kvbm loaded was never checked"
    assert counters["kvbm_matched_tokens"] == stats.connector_matched_tokens
    assert counters["kvbm_corrupt_blocks"] == 0
    assert scheduler.num_tracked == 0, "the scheduler role kept state of finished requests"


@pytest.mark.parametrize("device", DEVICES)
def test_hits_through_g3_with_a_small_g2(kvbm_node, device):
    node = kvbm_node(device, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="32", DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="512",
                     DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="true")
    config = replace(CONFIG, device=device)
    report, _ = run(config, chats(), kvbm_factories())
    assert report.outputs() == baseline(config, chats())
    counters = node.counters()
    assert counters["kvbm_offload_blocks_h2d"] > 0, "nothing went from G2 to G3"
    assert counters["kvbm_onboard_blocks_d2d"] > 0, "no hit came back from G3"
    assert report.stats.onboarded_blocks == counters["kvbm_onboard_blocks_h2d"] + counters["kvbm_onboard_blocks_d2d"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_fresh_engine_process_hits_the_prefixes_of_the_first(kvbm_node, device, tmp_path):
    """Request ids are per process (the second process reuses the first one's); blocks are keyed by
    tokens, salt and LoRA, so the fresh process's very first requests hit what the first stored."""
    kvbm_node(device)
    config = replace(CONFIG, device=device)
    first, _ = run(config, chats(), kvbm_factories())  # closed: its KV pool is unregistered
    out = tmp_path / "second.json"
    proc = subprocess.run([sys.executable, str(DRIVER_PROCESS), "--out", str(out), "--device", device],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    second = json.loads(out.read_text())["results"]
    assert {name: r["output_tokens"] for name, r in second.items()} == first.outputs() == baseline(config, chats())
    assert first.results["c0-r0"].connector_matched_tokens == 0
    assert second["c0-r0"]["request_id"] == first.results["c0-r0"].request_id
    # 25 prompt tokens, 4 per block: the 6 full blocks before the last token, all from kvbm.
    assert (second["c0-r0"]["device_matched_tokens"], second["c0-r0"]["connector_matched_tokens"]) == (0, 24)


def test_tenants_with_different_salts_never_share_blocks(kvbm_node):
    kvbm_node()
    report, _ = run(CONFIG, prefix_then_extension("globex"), kvbm_factories())
    b, a0 = report.results["b"], report.results["a0"]
    assert (b.device_matched_tokens, b.connector_matched_tokens) == (0, 0), "globex got acme's blocks"
    assert (a0.device_matched_tokens, a0.connector_matched_tokens) == (0, 20), "acme missed its own prefix"
    assert report.outputs() == baseline(CONFIG, prefix_then_extension("globex"))


# ---------------------------------------------------------------- delayed frees


class HeldStoreWorker(KvbmConnectorWorker):
    """TEST-ONLY worker: every store waits until the next ``get_finished`` that hands in finished
    requests, which lets the stores go and waits for them. So a finished request's stores read its
    blocks exactly when TensorRT-LLM has decided, from ``request_finished``, whether to free them."""

    def __init__(self, llm_args):
        super().__init__(llm_args)
        self._gate = threading.Event()

    def _kv_written(self, stream):
        written, gate = super()._kv_written(stream), self._gate

        def later() -> None:
            gate.wait()
            if written is not None:
                written()
        return later

    def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
        if finished_gen_req_ids:
            if self.kv_cache_tensor.is_cuda:  # what the engine enqueued (a free's poison too) ran first
                torch.cuda.synchronize(self.kv_cache_tensor.device)
            self._gate.set()
            self.core.fence()
            self._gate = threading.Event()
        return super().get_finished(finished_gen_req_ids, started_loading_req_ids)

    def shutdown(self) -> None:
        self._gate.set()
        super().shutdown()


HELD_STORES = ConnectorFactories(KvbmConnectorScheduler, HeldStoreWorker)


@pytest.mark.parametrize("device", DEVICES)
def test_a_finished_requests_blocks_stay_allocated_until_its_stores_read_them(kvbm_node, device):
    kvbm_node(device)
    config = replace(CONFIG, device=device)
    report, _ = run(config, prefix_then_extension(), HELD_STORES)
    b = report.results["b"]
    assert (b.device_matched_tokens, b.connector_matched_tokens) == (0, 20)
    assert report.stats.delayed_frees == len(report.results)
    assert report.outputs() == baseline(config, prefix_then_extension())


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_freeing_before_the_stores_read_is_caught(kvbm_node, device):
    """The driver frees (and poisons) a request's blocks as soon as request_finished returned True:
    the held stores then read poison, and the byte check catches it where ``b`` loads it."""
    kvbm_node(device)
    config = replace(CONFIG, device=device, honour_delayed_free=False)
    with pytest.raises(KvMismatchError, match="request b: .*connector-loaded"):
        run(config, prefix_then_extension(), HELD_STORES)


# ---------------------------------------------------------------- faults


class KillingWorker(KvbmConnectorWorker):
    """TEST-ONLY worker: kill -9 its worker daemon right before the first pass that loads (after
    the leader pinned the hit) and wait until the leader dropped it; ``restart_after`` passes
    later start the daemon again, as a supervisor would."""

    def __init__(self, llm_args, *, node, restart_after: int = 4):
        super().__init__(llm_args)
        self.node, self.restart_after = node, restart_after
        self.passes, self.killed_at = 0, 0
        self.counters_at_restart: dict | None = None

    def start_load_kv(self, stream) -> None:
        self.passes += 1
        meta = self.get_connector_meta()
        if not self.killed_at and meta is not None and meta.loads:
            self.node.kill_worker("0")
            self.killed_at = self.passes
        elif self.killed_at and self.counters_at_restart is None and self.passes == self.killed_at + self.restart_after:
            self.node.start_worker("0")
            self.node.wait_ready(60)  # our region is registered again by the connector's watchdog
            self.counters_at_restart = self.node.counters()
        super().start_load_kv(stream)


@pytest.mark.parametrize("device", DEVICES)
def test_worker_killed_mid_run_fails_loads_cleanly_then_hits_resume(kvbm_node, device):
    node = kvbm_node(device)
    config = replace(CONFIG, device=device, max_retries=2)
    factories = ConnectorFactories(KvbmConnectorScheduler, lambda args: KillingWorker(args, node=node))
    report, (scheduler, (worker,)) = run(config, chats(rounds=5), factories)
    assert worker.killed_at and worker.counters_at_restart is not None, "the fault was never injected"
    assert report.stats.failed_attempts > 0, "the load on a dead daemon did not fail"
    assert all("could not be loaded" in r.error for r in report.failed_attempts)
    assert report.outputs() == baseline(config, chats(rounds=5)), "a retry did not recompute the same tokens"
    after = node.counters()
    assert after["kvbm_onboard_blocks_h2d"] > worker.counters_at_restart["kvbm_onboard_blocks_h2d"], \
        "no hit after the daemon came back"
    assert scheduler.num_tracked == 0, "requests failed by the hook were never reclaimed"


def test_negative_control_a_daemon_that_corrupts_loads_is_caught(kvbm_node):
    """``KVBM_FAULT_CORRUPT_LOADS`` (the test-only fault wrapper) makes the CPU worker daemon zero
    every page it loads."""
    kvbm_node(**fault_env(CORRUPT_LOADS="1"))
    with pytest.raises(KvMismatchError, match="connector-loaded"):
        run(CONFIG, chats(), kvbm_factories())


class OverwritingWorker(KvbmConnectorWorker):
    """TEST-ONLY worker: once a pass's loads arrived, flips one bit of the first block loaded."""

    def wait_for_layer_load(self, layer_idx: int, stream) -> None:
        super().wait_for_layer_load(layer_idx, stream)
        meta = self.get_connector_meta()
        blocks = [b for spec in meta.loads for b in spec.engine_blocks] if layer_idx == 0 and meta else []
        if blocks:
            page = self.kv_cache_tensor[blocks[0]].view(torch.int16).view(-1)
            page[0] ^= 1


@pytest.mark.parametrize("device", DEVICES)
def test_negative_control_an_engine_block_changed_after_its_load_is_caught(kvbm_node, device):
    kvbm_node(device)
    config = replace(CONFIG, device=device)
    with pytest.raises(KvMismatchError, match=r"layer 0 rank 0: 1 of \d+ held positions differ.*connector-loaded"):
        run(config, chats(), ConnectorFactories(KvbmConnectorScheduler, OverwritingWorker))


def test_without_kvbm_running_the_engine_serves_and_recomputes(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("DYN_KVBM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DYN_KVBM_SOCKET_DIR", str(tmp_path / "nothing-listens-here"))
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"retry_s": 0.2, "timeout_s": 1.0}))
    report, _ = run(CONFIG, chats(), kvbm_factories())
    assert report.outputs() == baseline(CONFIG, chats())
    assert report.stats.connector_matched_tokens == 0 and report.stats.failed_attempts == 0


# ---------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_each_with_its_own_worker_daemon(kvbm_node, device):
    node = kvbm_node(device, tp=2)
    config = replace(CONFIG, geometry=TP2_GEOMETRY, device=device)
    report, _ = run(config, chats(), kvbm_factories())
    assert report.outputs() == baseline(config, chats())
    assert report.stats.onboarded_blocks > 0
    for worker_id in ("0", "1"):
        counters = node.worker_status(worker_id).counters
        assert counters["bytes_loaded"] > 0 and counters["bytes_stored"] > 0, f"worker {worker_id} moved nothing"
