"""engine.copy.paths: which copy path an op takes (no GPU: the policy alone)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.copy import staged
from engine.copy.base import CopyOp, Direction, LayerPlacement
from engine.copy.checks import Region
from engine.copy.paths import COPY_ENGINE_MARGIN, op_path, path_from_rates

NUM_LAYERS = 4


def _path_of(copy_backend: str, page_bytes: int, fenced: bool = False, misaligned: bool = False,
             has_staging: bool = True) -> str:
    """The path of an op of every layer, where the probe chose the kernel (no GPU)."""
    staging = staged.DeviceStaging.__new__(staged.DeviceStaging)
    staging.buffer_bytes = 64 << 20
    dev = type("Dev", (), {"staging": staging if has_staging else None,
                           "pool_base": (1 << 40) + 8 * misaligned,
                           "paths": {(page_bytes, Direction.LOAD): "kernel"}})()
    op = CopyOp(1, Direction.LOAD, 0, [LayerPlacement(i, 0, i * (page_bytes << 8), page_bytes)
                                       for i in range(NUM_LAYERS)], page_bytes,
                np.array([3]), np.array([0]), record_events=0 if fenced else None)
    regions = [Region(0, b"", 1 << 30, 1 << 40)] * NUM_LAYERS
    return op_path(copy_backend, dev, op, regions)


@pytest.mark.parametrize("copy_backend,page_bytes,fenced,misaligned,expected", [
    ("auto", 64 << 10, False, False, "staged"),
    ("auto", 256 << 10, False, False, "staged"),
    ("auto", 1 << 20, False, False, "kernel"),        # big pages: page by page, the probe's choice
    ("auto", 64 << 10, True, False, "staged"),        # a fenced load too: by DMA, not SMs
    ("auto", 1 << 20, True, False, "kernel"),         # big pages, fenced: a layer in one launch
    ("staged", 1 << 20, False, False, "staged"),      # asked for: staged whatever the page size
    ("staged", 64 << 10, True, False, "staged"),      # asked for: a fenced load too, by DMA
    ("staged", 64 << 10, False, True, "copy-engine"),  # misaligned for the kernel: page by page
])
def test_paths_stage_what_they_should(copy_backend, page_bytes, fenced, misaligned,
                                                 expected):
    assert _path_of(copy_backend, page_bytes, fenced, misaligned) == expected


def test_paths_without_device_staging_take_the_probes_choice():
    assert _path_of("auto", 64 << 10, has_staging=False) == "kernel"


@pytest.mark.parametrize("direction,kernel,dma,expected", [
    (Direction.LOAD, 50.0, 49.0, "copy-engine"),   # loads: the copy engine within 3 %
    (Direction.LOAD, 50.0, 48.0, "kernel"),
    (Direction.SAVE, 50.0, 26.0, "copy-engine"),   # saves: it keeps vLLM's SMs unless below half
    (Direction.SAVE, 50.0, 24.0, "kernel"),
])
def test_paths_from_measured_rates_favour_the_copy_engine_by_the_margin(direction, kernel, dma, expected):
    assert path_from_rates(direction, kernel, dma) == expected
    assert COPY_ENGINE_MARGIN[Direction.SAVE] < COPY_ENGINE_MARGIN[Direction.LOAD] < 1
