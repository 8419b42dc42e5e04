"""What one region registration may describe, checked before anything is opened or mapped."""
from __future__ import annotations

import pytest

from kvbm_client.contract import pb
from kvbm_worker.regions import RegionError, RegionLimits, check_request

LIMITS = RegionLimits(max_pages=4, max_buffers=2, max_name_bytes=8)


def request(layers: int = 1, buffers: int = 1, engine_id: str = "e") -> "pb.RegisterRegionRequest":
    return pb.RegisterRegionRequest(
        engine_id=engine_id, pid=1, page_bytes=64, num_blocks=1,
        buffers=[pb.RegionBuffer(shm_path="/nonexistent", size_bytes=64) for _ in range(buffers)],
        layers=[pb.LayerPlacement(buffer_index=0, offset_bytes=0, block_stride_bytes=64) for _ in range(layers)])


def test_within_limits():
    check_request(request(layers=4, buffers=2, engine_id="e" * 8), LIMITS)


@pytest.mark.parametrize("req, setting", [(request(layers=5), "DYN_KVBM_MAX_REGION_PAGES"),
                                          (request(buffers=3), "DYN_KVBM_MAX_REGION_BUFFERS"),
                                          (request(engine_id="é" * 5), "DYN_KVBM_MAX_NAME_BYTES")])
def test_each_limit_names_its_setting(req, setting):
    with pytest.raises(RegionError, match=setting):
        check_request(req, LIMITS)
