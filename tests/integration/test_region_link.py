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
from support.probes import wait_for

ENGINE = "engine-link-test"


def test_the_region_is_kept_registered_and_its_id_published(make_node):
    node = make_node()
    settings = ConnectorSettings(leader_address=node.leader_address,
                                 worker_address_template=node.config().worker_address("{id}"), namespace="t",
                                 timeout_s=2.0, retry_s=0.2, ready_timeout_s=30.0, config=node.config(),
                                 engine_id=ENGINE)
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
