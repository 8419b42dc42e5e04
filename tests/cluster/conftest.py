"""Fixtures of the cluster tests: real etcd and nats-server (installed by
install_services.sh), plus kvbm nodes configured to use them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cluster_support import EtcdServer, EventCollector, NatsServer, binary  # noqa: E402

# Reuse the integration tests' Node (leader + workers as child processes).
_spec = importlib.util.spec_from_file_location("kvbm_integration_conftest",
                                              Path(__file__).parent.parent / "integration" / "conftest.py")
_integration = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _integration  # dataclasses look their module up there
_spec.loader.exec_module(_integration)
Node = _integration.Node


def _need(name: str) -> None:
    if binary(name) is None:
        pytest.skip(f"{name} is not installed (tests/cluster/install_services.sh installs it)")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    _need("etcd")
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    _need("nats-server")
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture
def make_cluster_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """``make_cluster_node(node_name, num_workers=1, start=True, etcd=…, nats=…, **env)``."""
    nodes: list[Node] = []

    def factory(node_name: str = "a", num_workers: int = 1, start: bool = True, etcd: EtcdServer | None = None,
                nats: NatsServer | None = None, **env: str) -> Node:
        root = tmp_path / f"node-{node_name}-{len(nodes)}"
        root.mkdir()
        overrides: dict[str, str] = {"DYN_KVBM_JOB_TIMEOUT_SECS": "3", "DYN_KVBM_NODE_NAME": node_name,
                                     "DYN_KVBM_ETCD_LEASE_TTL_SECS": "3"}
        if etcd is not None:
            overrides["ETCD_ENDPOINTS"] = etcd.endpoints
        if nats is not None:
            overrides["NATS_SERVER"] = nats.url
        overrides.update(env)
        node = Node(root, _integration.node_env(root, overrides, drop=("ETCD_ENDPOINTS", "NATS_SERVER")),
                    num_workers)
        nodes.append(node)
        return node.start() if start else node

    yield factory
    for node in nodes:
        node.stop()


@pytest.fixture
def collect_events() -> Iterator[Callable[[str, str], EventCollector]]:
    made: list[EventCollector] = []

    def factory(url: str, subject: str) -> EventCollector:
        c = EventCollector(url, subject)
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()
