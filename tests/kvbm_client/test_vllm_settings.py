"""The connectors' settings (vLLM's ``kv_connector_extra_config`` over ``DYN_KVBM_*``), without
vLLM (they live in the engine-independent core)."""
from __future__ import annotations

import pytest


@pytest.fixture
def settings():
    from kvbm_client.connectors.core import settings
    return settings


def test_loads_are_synchronous_unless_asked(settings, monkeypatch):
    monkeypatch.setenv("DYN_KVBM_SOCKET_DIR", "/run/kvbm-test")
    s = settings.ConnectorSettings.from_extra({}, "model|bf16|16")
    assert s.load_mode == "sync"
    assert s.leader_address == "unix:/run/kvbm-test/leader.sock"
    assert s.worker_address("3") == "unix:/run/kvbm-test/worker-3.sock"
    assert settings.ConnectorSettings.from_extra({"load_mode": "ASYNC"}, "ns").load_mode == "async"


def test_unknown_load_mode_is_refused_with_the_choices(settings):
    with pytest.raises(ValueError, match="load_mode='eager': one of sync, async"):
        settings.ConnectorSettings.from_extra({"load_mode": "eager"}, "ns")


@pytest.mark.parametrize("value,expected", [(None, True), (False, False), ("false", False), ("0", False),
                                            (True, True), ("on", True)])
def test_early_loads_are_on_unless_turned_off(settings, value, expected):
    extra = {} if value is None else {"early_loads": value}
    assert settings.ConnectorSettings.from_extra(extra, "ns").early_loads is expected


def test_a_malformed_early_loads_flag_is_refused(settings):
    with pytest.raises(ValueError, match="early_loads='sometimes': true or false"):
        settings.ConnectorSettings.from_extra({"early_loads": "sometimes"}, "ns")


@pytest.mark.parametrize("value,expected", [(None, True), ("true", True), (True, True), ("0", False), (False, False)])
def test_staged_loads_are_on_unless_turned_off(settings, value, expected):
    extra = {} if value is None else {"staged_loads": value}
    assert settings.ConnectorSettings.from_extra(extra, "ns").staged_loads is expected
    with pytest.raises(ValueError, match="staged_loads='maybe': true or false"):
        settings.ConnectorSettings.from_extra({"staged_loads": "maybe"}, "ns")


@pytest.mark.parametrize("value,expected", [(None, "tail"), ("eager", "eager"), ("EAGER", "eager"),
                                            (True, "true"), ("on", "true"), (False, "false"), ("0", "false"),
                                            ("tail", "tail"), (" Tail", "tail"), ("after_first", "after_first")])
def test_gpu_layer_waits_default_to_the_last_layers_only(settings, value, expected):
    """Default "tail": only the last layers' waits on the GPU, under either module loading;
    "eager": every wait on the GPU only where CUDA loads kernels eagerly; true: under lazy
    loading too; after_first: those after the daemon's first layer group; false: always on the CPU."""
    extra = {} if value is None else {"gpu_layer_waits": value}
    got = settings.ConnectorSettings.from_extra(extra, "ns").gpu_layer_waits
    assert got is settings.GpuWaits(expected)


def test_a_malformed_gpu_layer_waits_is_refused_with_the_choices(settings):
    with pytest.raises(ValueError, match="gpu_layer_waits='lazy': true, false, eager, tail or after_first"):
        settings.ConnectorSettings.from_extra({"gpu_layer_waits": "lazy"}, "ns")


@pytest.mark.parametrize("pages,groups,expected", [(36, 6, 4), (28, 6, 3), (36, 2, 36), (1, 6, 1), (36, 64, 1)])
def test_tail_layers_are_the_front_shapes_last_two_groups(settings, pages, groups, expected):
    """``gpu_layer_waits`` tail puts the waits of ~4/groups**2 of the layers on the GPU (the
    daemon's last two front-loaded groups: 36 pages in 6 groups end ..., 32, 35, 36), never
    none and never more than the block has."""
    assert settings.tail_layers(pages, groups) == expected


@pytest.mark.parametrize("pages,groups,expected", [(36, 6, 11), (28, 6, 9), (36, 2, 27), (1, 6, 1), (36, 64, 1),
                                                   (36, 1, 36), (5, 4, 2), (80, 7, 22)])
def test_first_group_end_is_the_daemons_first_group(settings, pages, groups, expected):
    """``gpu_layer_waits`` after_first waits on the CPU exactly for the pages of the worker
    daemon's first front-loaded group (``kvbm_client.layer_groups.group_bounds``, which the
    daemon copies in), so every later group's layers wait on the GPU."""
    from kvbm_worker.grouping import group_bounds  # the daemon's
    assert settings.first_group_end(pages, groups) == group_bounds(pages, groups)[0] == expected


@pytest.mark.parametrize("waits,expected", [("tail", 32), ("after_first", 11), ("true", 0), ("eager", 0)])
def test_which_layer_waits_stay_on_the_cpu(settings, waits, expected):
    """36 pages in 6 groups (11, 9, 7, 5, 3, 1): tail keeps the waits up to page 32 on the
    CPU, after_first those up to page 11, true and eager none."""
    assert settings.gpu_waits_from(settings.GpuWaits(waits), 36, 6) == expected


@pytest.mark.parametrize("value", [0, -3])
def test_an_async_store_threshold_below_one_block_is_refused(settings, value):
    with pytest.raises(ValueError, match=f"async_store_min_blocks={value}: at least 1"):
        settings.ConnectorSettings.from_extra({"async_store_min_blocks": value}, "ns")
    assert settings.ConnectorSettings.from_extra({"async_store_min_blocks": 1}, "ns").async_store_min_blocks == 1


@pytest.mark.parametrize("value,expected", [(None, True), ("false", False), (False, False), ("on", True)])
def test_steps_without_loads_plan_their_stores_off_the_thread_unless_turned_off(settings, value, expected):
    extra = {} if value is None else {"async_decode_store_plans": value}
    assert settings.ConnectorSettings.from_extra(extra, "ns").async_decode_store_plans is expected
    with pytest.raises(ValueError, match="async_decode_store_plans='often': true or false"):
        settings.ConnectorSettings.from_extra({"async_decode_store_plans": "often"}, "ns")


@pytest.mark.parametrize("value,expected", [(None, True), ("false", False), (False, False), ("on", True)])
def test_the_presence_filter_is_used_unless_turned_off(settings, value, expected):
    extra = {} if value is None else {"presence_filter": value}
    assert settings.ConnectorSettings.from_extra(extra, "ns").presence_filter is expected


@pytest.mark.parametrize("value,expected", [(None, True), ("false", False), (False, False), ("1", True)])
def test_blocks_are_stored_unless_turned_off(settings, value, expected):
    extra = {} if value is None else {"store_blocks": value}
    assert settings.ConnectorSettings.from_extra(extra, "ns").store_blocks is expected
    if value is None:
        with pytest.raises(ValueError, match="store_blocks='maybe': true or false"):
            settings.ConnectorSettings.from_extra({"store_blocks": "maybe"}, "ns")
