"""The vLLM version shims of the connector (``kvbm_client/connectors/vllm/compat.py``), without
vLLM (the package imports ``KvbmConnector`` lazily)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture
def compat():
    from kvbm_client.connectors.vllm import compat
    return compat


def strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@pytest.mark.parametrize("text,expected", [("0.26.0", (0, 26)), ("0.32.0+cpu", (0, 32)), ("0.32.1rc1", (0, 32)),
                                           ("garbage", (0, 0))])
def test_parse_version(compat, text, expected):
    assert compat.parse_version(text) == expected


@pytest.mark.parametrize("version,ok", [("0.26.0", True), ("0.32.0+cpu", True), ("0.29.3", True),
                                        ("0.25.1", False), ("0.33.0", False)])
def test_supported_range(compat, version, ok):
    assert compat.check_version(version) is ok


def test_is_cuda(compat):
    assert compat.is_cuda(SimpleNamespace(device_config=SimpleNamespace(device="cuda:0")))
    assert not compat.is_cuda(SimpleNamespace(device_config=SimpleNamespace(device="cpu")))
    assert not compat.is_cuda(SimpleNamespace())


def test_block_page_contiguous_layouts(compat):
    # 0.32 CPU per-layer view [B, H, N, 2D]; 0.26 cross-layer buffer [B, L, N, H, 2D]
    assert compat.block_page((1024, 2, 32, 128), strides((1024, 2, 32, 128))) == 2 * 32 * 128
    shape = (2600, 36, 16, 8, 256)
    assert compat.block_page(shape, strides(shape)) == 36 * 16 * 8 * 256


def test_block_page_permuted_flash_attention_view(compat):
    # vLLM 0.26 FlashAttention: logical (B, H, N, 2D) over physical NHD (B, N, H, 2D)
    B, N, H, D2 = 100, 16, 8, 256
    logical = (B, H, N, D2)
    physical_strides = (N * H * D2, D2, H * D2, 1)
    assert compat.block_page(logical, physical_strides) == N * H * D2


def test_block_page_per_layer_view_of_a_cross_layer_buffer(compat):
    # one layer's view of [B, L, page]: block stride L * page > page, still one dense page
    B, L, N, H, D2 = 10, 4, 16, 2, 128
    assert compat.block_page((B, N, H, D2), (L * N * H * D2, H * D2, D2, 1)) == N * H * D2


@pytest.mark.parametrize("shape,st", [
    ((2, 100, 16, 8, 128), strides((2, 100, 16, 8, 128))[:1] + (16 * 8 * 128 * 2,) + strides((16, 8, 128))),
    ((100, 16, 8, 128), (16 * 8 * 128, 8 * 128, 128, 2)),  # gaps inside a block
    ((100, 16, 8, 128), (1000, 8 * 128, 128, 1)),  # blocks overlap
    ((100,), (1,)),
])
def test_block_page_refuses_scattered_blocks(compat, shape, st):
    assert compat.block_page(shape, st) is None


def test_block_pages_view(compat):
    torch = pytest.importorskip("torch")
    raw = torch.arange(4 * 3 * 2 * 5, dtype=torch.int32).view(4, 3, 2, 5)  # physical (B, N, H, D)
    logical = raw.permute(0, 2, 1, 3)  # (B, H, N, D), as vLLM 0.26 hands it over
    pages = compat.block_pages(logical)
    assert pages.shape == (4, 30)
    assert torch.equal(pages[2], raw[2].reshape(-1))
    with pytest.raises(ValueError):
        compat.block_pages(raw.permute(1, 0, 2, 3))


def test_overlapping_steps_follow_asynchronous_scheduling(compat):
    assert compat.overlapping_steps(SimpleNamespace(max_concurrent_batches=2)) == 2  # vLLM 0.32 computes it
    sync = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))
    overlapped = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    assert compat.overlapping_steps(sync) == 1 and compat.overlapping_steps(overlapped) == 2


class _RaisingConfig:
    """A config whose ``use_v2_model_runner`` property cannot decide (it raises)."""

    kv_transfer_config = SimpleNamespace(kv_load_failure_policy="recompute")

    @property
    def use_v2_model_runner(self) -> bool:
        raise RuntimeError("cannot tell")


@pytest.mark.parametrize("v2,async_scheduling,expected", [(True, False, "async"), (True, True, "async"),
                                                          (False, True, "async"), (False, False, "sync"),
                                                          (None, False, "sync"), (None, True, "async")])
def test_auto_load_mode_is_sync_only_where_vllm_recomputes_a_failed_sync_load_correctly(compat, v2, async_scheduling,
                                                                                        expected):
    # measured on vLLM 0.26 (H200, tests/stress): V2 runner -> wrong tokens or an illegal memory access;
    # V1 runner with async scheduling -> an index-out-of-bounds assert; the CPU build (V1, no async) -> correct.
    # The policy is not consulted: a MultiConnector child's config says "fail" whatever the outer one says.
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy="fail"),
                             scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    if v2 is not None:  # None: a vLLM without the V2 runner (the attribute is missing)
        config.use_v2_model_runner = v2
    mode, why = compat.auto_load_mode(config)
    assert mode == expected
    assert ("49250" in why) == (expected == "async")
    assert ("async scheduling" in why) == (expected == "async" and not v2)


def test_auto_load_mode_takes_the_safe_side_when_the_runner_is_unknown(compat):
    assert compat.auto_load_mode(_RaisingConfig())[0] == "async"


def test_settings_resolve_auto_and_keep_an_explicit_mode():
    from kvbm_client.connectors.core.settings import ConnectorSettings, LoadMode
    for extra, auto, expected in (({}, LoadMode.ASYNC, LoadMode.ASYNC), ({}, LoadMode.SYNC, LoadMode.SYNC),
                                  ({"load_mode": "AUTO"}, LoadMode.ASYNC, LoadMode.ASYNC),
                                  ({"load_mode": "sync"}, LoadMode.ASYNC, LoadMode.SYNC),
                                  ({"load_mode": "async"}, LoadMode.SYNC, LoadMode.ASYNC)):
        assert ConnectorSettings.from_extra(extra, "ns", auto_load_mode=auto).load_mode is expected
    with pytest.raises(ValueError, match="load_mode"):
        ConnectorSettings.from_extra({"load_mode": "eager"}, "ns")
    with pytest.raises(ValueError, match="resolve 'auto'"):
        ConnectorSettings(leader_address="a", worker_address_template="{id}", namespace="n", timeout_s=1,
                          retry_s=1, load_mode=LoadMode.AUTO)


def test_per_layer_pages_of_a_cross_layer_buffer(compat):
    torch = pytest.importorskip("torch")
    raw = torch.arange(4 * 3 * 2 * 5, dtype=torch.int32).view(4, 3, 2, 5)  # [blocks, layers, 2, page]
    pages = compat.per_layer_pages(raw, 3)
    assert pages.shape == (4, 3, 10)
    assert torch.equal(pages[2, 1], raw[2, 1].reshape(-1))
    assert compat.per_layer_pages(raw, 2) is None, "not that many layers"
    assert compat.per_layer_pages(raw.permute(0, 2, 1, 3), 2) is None, "layers not outermost in a block"


def test_layers_follow_blocks_only_where_the_stride_order_says_so(compat):
    class NHD:  # physical [blocks, layers, ...]
        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            return (1, 0, 2, 3, 4, 5)

    class HND:  # physical [blocks, heads, layers, ...]: with heads == layers the shape looks the same
        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            return (1, 3, 0, 2, 4, 5)

    class Unknown:
        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension=False):
            raise NotImplementedError

    assert compat.layers_follow_blocks(NHD)
    assert not compat.layers_follow_blocks(HND)
    assert not compat.layers_follow_blocks(Unknown)
    assert not compat.layers_follow_blocks(None)


def test_kernel_blocks_that_are_not_vllm_blocks_are_refused(compat):
    compat.check_block_count(100, SimpleNamespace(num_blocks=100))
    compat.check_block_count(100, None)  # unknown: nothing to check
    with pytest.raises(ValueError, match="kernel blocks"):
        compat.check_block_count(200, SimpleNamespace(num_blocks=100))


class _Mode:
    """A stand-in for vLLM's ``CUDAGraphMode``: a plain mode, or a (decode, mixed) pair."""

    def __init__(self, decode: str, mixed: str | None = None) -> None:
        self.name = decode if mixed is None else f"{decode}_AND_{mixed}"
        self._pair = (decode, decode if mixed is None else mixed)

    def decode_mode(self):
        return SimpleNamespace(name=self._pair[0])

    def mixed_mode(self):
        return SimpleNamespace(name=self._pair[1])


def graphs(mode, spec=None):
    config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))
    if spec is not None:
        config.num_speculative_tokens = spec
    return config


@pytest.mark.parametrize("mode,expected", [(_Mode("FULL", "PIECEWISE"), ("FULL", "PIECEWISE")),
                                           (_Mode("PIECEWISE"), ("PIECEWISE", "PIECEWISE")),
                                           (_Mode("FULL"), ("FULL", "FULL")), (_Mode("FULL", "NONE"), ("FULL", "NONE")),
                                           (_Mode("NONE"), ("NONE", "NONE")), (None, ("NONE", "NONE"))])
def test_cuda_graph_modes_of_decode_and_mixed_batches(compat, mode, expected):
    assert compat.cuda_graph_modes(graphs(mode)) == expected
    assert compat.cuda_graph_modes(SimpleNamespace()) == ("NONE", "NONE")


@pytest.mark.parametrize("mode,spec,expected", [
    (_Mode("FULL", "PIECEWISE"), None, 2),  # vLLM's default: a load's step must not be a uniform decode batch
    (_Mode("FULL", "PIECEWISE"), 3, 5),     # with 3 speculative tokens a decode query is 4 tokens
    (_Mode("FULL", "NONE"), 0, 2),          # FULL_DECODE_ONLY: other batches eager
    (_Mode("PIECEWISE"), 3, 1), (_Mode("NONE"), None, 1), (None, None, 1),  # the hooks always run
    (_Mode("FULL"), None, None),            # every batch a FULL graph: the hooks never run
])
def test_layerwise_loads_fit_every_graph_mode_but_full(compat, mode, spec, expected):
    assert compat.layerwise_graph_fit(graphs(mode, spec)) == expected
