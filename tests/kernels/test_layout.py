"""The resident layout (kernels/layout.py) decoded by a NumPy model of the kernels' decode,
against the reference's dequantization. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest
from _kern import FMT_GS, make_tensor

from coliworker.kernels import layout, reference


@pytest.mark.parametrize("fmt,gs", FMT_GS)
@pytest.mark.parametrize("i", [1, 7, 33, 130, 1025, 2100])
def test_layout_decode_matches_reference(rng, fmt, gs, i):
    t = make_tensor(rng, fmt, 3, i, gs)
    dev = layout.relayout(np, t, t.weights)
    sc = layout.scales(np, t, t.scales)
    assert dev.size == 3 * layout.Layout.of(fmt, i, gs).ld
    assert np.array_equal(layout.decode_resident(t, dev, sc), reference.dequantize(t))
