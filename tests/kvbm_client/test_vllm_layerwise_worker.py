"""The vLLM worker role's side of layer-pipelined loads (``load_mode: layerwise``), without vLLM:
layer names to pages, one wait per layer that needs more pages, and the step's settlement."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvbm_client.connectors.core.settings import ConnectorSettings, LoadMode
from kvbm_client.connectors.core.specs import LoadSpec, StepPlan
from kvbm_client.connectors.vllm.worker import KvbmConnectorWorker, layer_page_ends


def test_layer_page_ends_per_tensor():
    # 3 tensors, 6 pages per block: 2 pages (K, V) each; a tensor shared by two layers
    ends = layer_page_ends([["a"], ["b", "b2"], ["c"]], 6)
    assert ends == {"a": 2, "b": 4, "b2": 4, "c": 6}
    assert layer_page_ends([["a"], ["b"]], 1) == {}, "pages that do not split: no map (wait for all)"
    assert layer_page_ends([], 4) == {}


class FakeCore:
    """Records what the adapter asks of the core."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_region(self, spec, signals=None) -> None:
        self.calls.append(("region",))

    def start_loads(self, loads, wait=True, ready=None) -> None:
        self.calls.append(("start", len(loads), wait))

    def wait_pages(self, end, per_block) -> None:
        self.calls.append(("pages", end, per_block))

    def wait_loads(self, forward_waited=True) -> None:
        self.calls.append(("settle", forward_waited))

    def start_stores(self, stores, ready=None) -> None:
        self.calls.append(("stores", len(stores)))

    def finished(self, delayed):
        return set(), set()


def worker(mode: LoadMode) -> tuple[KvbmConnectorWorker, FakeCore]:
    settings = ConnectorSettings("unix:/nowhere/l.sock", "unix:/nowhere/w-{id}.sock", "m", 1.0, 1.0, load_mode=mode)
    w = KvbmConnectorWorker("0", settings)
    w.core = fake = FakeCore()  # type: ignore[assignment]
    spec = SimpleNamespace(layers=(None,) * 6)  # 6 pages per block
    w.set_region(spec, names_by_tensor=[["l0"], ["l1"], ["l2"]])  # type: ignore[arg-type]
    return w, fake


def step(loads: int) -> StepPlan:
    return StepPlan(loads=[LoadSpec("r", b"p", b"s", [1], sync=True, layer_groups=3) for _ in range(loads)])


def test_each_layer_waits_for_its_pages_and_the_step_settles_before_stores():
    w, core = worker(LoadMode.LAYERWISE)
    w.start_loads(step(1))  # type: ignore[arg-type]
    for name in ("l0", "l0", "l1", "l2"):
        w.wait_layer(name)
    w.start_stores(StepPlan())  # type: ignore[arg-type]
    w.finished(StepPlan())  # type: ignore[arg-type]  (already settled: nothing more)
    assert core.calls[1:] == [("start", 1, False), ("pages", 2, 6), ("pages", 4, 6), ("pages", 6, 6),
                              ("settle", True)]


def test_a_forward_that_ran_no_hook_fails_its_loads():
    w, core = worker(LoadMode.LAYERWISE)
    w.start_loads(step(1))  # type: ignore[arg-type]
    w.finished(StepPlan())  # type: ignore[arg-type]  (vLLM skipped wait_for_save)
    assert core.calls[-1] == ("settle", False)


def test_an_unknown_layer_waits_for_every_page():
    w, core = worker(LoadMode.LAYERWISE)
    w.start_loads(step(1))  # type: ignore[arg-type]
    w.wait_layer("drafter.0")
    w.wait_layer("l2")
    assert [c for c in core.calls if c[0] == "pages"] == [("pages", 6, 6)]


@pytest.mark.parametrize("mode", [LoadMode.LAYERWISE, LoadMode.SYNC])
def test_steps_without_layerwise_loads_never_wait_in_the_hooks(mode):
    w, core = worker(mode)
    w.start_loads(step(0 if mode is LoadMode.LAYERWISE else 1))  # type: ignore[arg-type]
    w.wait_layer("l0")
    w.start_stores(StepPlan())  # type: ignore[arg-type]
    assert not [c for c in core.calls if c[0] in ("pages", "settle")]
    assert core.calls[1] == ("start", 0 if mode is LoadMode.LAYERWISE else 1, mode is not LoadMode.LAYERWISE)


def test_the_trace_times_every_steps_forward_and_names_those_that_loaded(tmp_path, monkeypatch):
    """Traced: a step that loaded gives "forward" (the warm breakdown's), one that did not
    "step_forward" (the cold breakdown's); untraced, neither."""
    from kvbm_client.connectors.core import tracing
    path = tmp_path / "trace.jsonl"
    w, _ = worker(LoadMode.LAYERWISE)
    w.start_loads(step(0))  # type: ignore[arg-type]
    w.start_stores(StepPlan())  # type: ignore[arg-type]
    assert not path.exists()
    monkeypatch.setattr(tracing, "TRACE_PATH", str(path))
    for loads in (1, 0):
        w.start_loads(step(loads))  # type: ignore[arg-type]
        w.wait_layer("l2")
        w.start_stores(StepPlan())  # type: ignore[arg-type]
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["what"] for e in events] == ["layer_waits", "forward", "step_forward"]
    assert all(e["ms"] >= 0 and e["cpu_ms"] >= 0 for e in events[1:])
