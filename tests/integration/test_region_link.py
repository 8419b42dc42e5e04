"""The connector's worker side keeps its region registered (``connectors/core/region_link.py``)
and publishes each region id for its scheduler side: real daemons, a worker killed and
restarted, a region dropped by id."""
from __future__ import annotations

import grpc

from kvbm_client.connectors.core import ConnectorSettings, RegionLink
from kvbm_client.connectors.core.region_ids import EngineRegionIds
from kvbm_client.contract import pb, rpc
from kvbm_client.ids import WorkerId
from kvbm_client.security import region_digest
from support.fault_env import fault_env
from support.probes import wait_for

ENGINE = "engine-link-test"


def link_settings(node, ready_timeout_s: float) -> ConnectorSettings:
    return ConnectorSettings(leader_address=node.leader_address,
                             worker_address_template=node.config().worker_address("{id}"), namespace="t",
                             timeout_s=2.0, retry_s=0.2, ready_timeout_s=ready_timeout_s, config=node.config(),
                             engine_id=ENGINE)


def test_the_region_is_kept_registered_and_its_id_published(make_node):
    node = make_node()
    settings = link_settings(node, ready_timeout_s=30.0)
    ids = EngineRegionIds(node.config().resolved_socket_dir, ENGINE)
    link = RegionLink(WorkerId("0"), settings)
    engine = node.engine(num_blocks=16)
    try:
        link.register(engine.spec())
        first = link.region_id
        assert first and ids.lookup("0") == first
        assert [r.digest for r in node.worker_status("0").regions] == [region_digest(first)]
        assert node.worker_status("0").info.state == "ready", "register() returns once the pools are allocated"

        worker = node.workers[WorkerId("0")]
        node.kill(worker)  # SIGKILL, then a fresh worker: it forgot every region
        node.spawn(worker)
        second = wait_for(lambda: link.region_id not in (None, first) and link.region_id, "re-registration", 15.0)
        assert ids.lookup("0") == second
        wait_for(lambda: [r.digest for r in node.worker_status("0").regions] == [region_digest(second)],
                 "the worker to list the new region", 15.0)

        with grpc.insecure_channel(node.config().worker_address("0")) as channel:  # dropped by id
            rpc.WorkerStub(channel).UnregisterRegion(pb.UnregisterRegionRequest(region_id=second), timeout=5)
        third = wait_for(lambda: link.region_id not in (None, second) and link.region_id, "re-registration", 15.0)
        assert ids.lookup("0") == third
    finally:
        link.close()
    assert ids.lookup("0") is None, "the record outlived the region"
    wait_for(lambda: list(node.worker_status("0").regions) == [], "the closed link's region to go")


def test_pools_that_fail_end_the_wait_with_the_reason(make_node, tmp_path, caplog):
    """A worker that could not allocate its pools (here: G3's directory is a file) says so in
    its status, with the reason, beside the leader's view; the engine's wait for the pools ends
    at once with that reason logged instead of waiting out ``ready_timeout_s``."""
    import logging
    import time
    not_a_dir = tmp_path / "g3-is-a-file"
    not_a_dir.write_text("")
    node = make_node(DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS="8", DYN_KVBM_DISK_CACHE_DIR=str(not_a_dir))
    settings = link_settings(node, ready_timeout_s=60.0)
    link = RegionLink(WorkerId("0"), settings)
    try:
        with caplog.at_level(logging.ERROR, logger="kvbm.connector"):
            started = time.monotonic()
            link.register(node.engine(num_blocks=16).spec())
            waited = time.monotonic() - started
        info = node.worker_status("0").info
        assert info.state == "failed" and str(not_a_dir) in info.error
        assert waited < 30.0, f"waited {waited:.1f}s of the 60s ready timeout"
        assert any("could not allocate its pools" in r.getMessage() and str(not_a_dir) in r.getMessage()
                   for r in caplog.records)
        leader_view = {w.worker_id: w for w in node.status().workers}["0"]
        assert leader_view.state == "failed" and str(not_a_dir) in leader_view.error
    finally:
        link.close()


def test_ready_means_the_leader_knows_the_pools(make_node, tmp_path):
    """A worker's Status says "ready" only once the leader accepted its PoolsReady: until then
    the leader plans no store, so the engine's wait for the pools (``register()``) must not end
    sooner. Here the worker tells the leader 2 s after its pools are allocated (test-only fault);
    before the fix ``register()`` returned inside that window and the first stores were skipped
    (a flaky CI failure of tests/stress/test_windows_daemons.py, 2026-11-28)."""
    import time
    faults = tmp_path / "faults.log"
    node = make_node(**fault_env(POOLS_READY_DELAY_SECS="2", LOG=str(faults)))
    settings = link_settings(node, ready_timeout_s=30.0)
    link = RegionLink(WorkerId("0"), settings)
    try:
        started = time.monotonic()
        link.register(node.engine(num_blocks=16).spec())
        waited = time.monotonic() - started
        assert "pools ready reported 2.0 s late" in faults.read_text(), "the window was not opened"
        assert node.status().state == "ready", f"register() returned after {waited:.2f}s, before the leader knew"
        assert node.worker_status("0").info.state == "ready"
        assert waited >= 2.0
    finally:
        link.close()
