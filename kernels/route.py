"""CuPy wrappers of ``route.cu``: the gather and the weighted combine of a routed expert group.

Both take device pointers and run on the current stream; launches are prepared once per shape.
"""

from __future__ import annotations

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.launch import Launch, cached

VARIANTS = ("route_gather", "route_combine")


def gather_launch(n: int, d: int) -> Launch:
    """route_gather, taking xp float32 [n, d] (out), x float32 [T, d], src int32 [n]."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> Launch:
        fn = get_function("route.cu", "route_gather", VARIANTS)
        return Launch(fn, (-(-d // 1024), n), (256,), (np.int32(d),), 0)

    return cached((dev, "route_gather", n, d), make)  # type: ignore[return-value]


def combine_launch(t: int, k: int, d: int) -> Launch:
    """route_combine, taking y float32 [t, d] (out), yp float32 [n, d], pos int32 [t * k],
    w float32 [t, k]."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> Launch:
        fn = get_function("route.cu", "route_combine", VARIANTS)
        return Launch(fn, (-(-d // 256), t), (256,), (np.int32(k), np.int32(d)), 0)

    return cached((dev, "route_combine", t, k, d), make)  # type: ignore[return-value]
