"""CuPy wrapper of ``copy.cu``: a call's small host <-> device copies as one kernel launch.

A call's inputs go up and its outputs come back between its arena's pinned host half and its
device half (``server/cupy_calls.py``). In a CUDA graph a copy-engine transfer (memcpy node)
costs several microseconds of launch and of latency (``bench/graph_launch.py``); up to
``KERNEL_BYTES`` the copy is a kernel that reads or writes the pinned memory through its
mapped address instead. Larger copies keep the copy engine, which moves them at the link's
rate without taking SMs. ``ENABLED = False`` (``COLIWORKER_COPY_KERNEL=0``) keeps every copy
on the copy engine (tests run
both: a copy is exact either way).
"""

from __future__ import annotations

import os

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.launch import Launch, cached

VARIANTS = ("coli_copy",)
ENABLED = os.environ.get("COLIWORKER_COPY_KERNEL", "1") != "0"
KERNEL_BYTES = 1 << 20
COPY_BLOCKS = 64
_THREADS = 256


def blocks(n: int) -> int:
    """coli_copy's blocks for ``n`` bytes: four 16-byte lanes per thread, at most
    ``COPY_BLOCKS``."""
    lanes = -(-n // 16)
    return max(1, min(COPY_BLOCKS, -(-lanes // (4 * _THREADS))))


def copy_launch(n: int, device: int | None = None) -> Launch | None:
    """coli_copy for ``n`` bytes on ``device`` (the current one, which it must be; given by
    a caller that knows it, one runtime call less per copy), taking (dst, src) addresses,
    both 16-byte aligned (the caller checks); None where the copy should stay on the copy
    engine."""
    if not ENABLED or n > KERNEL_BYTES or n <= 0:
        return None
    dev = cupy.cuda.runtime.getDevice() if device is None else device

    def make() -> Launch:
        fn = get_function("copy.cu", "coli_copy", VARIANTS)
        return Launch(fn, (blocks(n),), (_THREADS,), (np.int64(n),), 0)

    return cached((dev, "copy", n), make)  # type: ignore[return-value]
