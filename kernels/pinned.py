"""Writing a call's inputs into its pinned host buffer (every op's host side uses these).

``put_host`` copies an array in (large ones in slices on several threads: NumPy releases the
GIL while it copies), ``copy_async`` starts such a copy and returns at once (the pipelined
expert group, ``kernels/expert_group.py``, sends each piece up as soon as its copy is done),
``stack_into`` stacks row blocks without a temporary, ``at`` views a buffer's bytes as an
array of a shape (a plan keeps its inputs' and output's views), ``align`` rounds an offset in
a call's arena up to 256 bytes. The copy threads are one pool per process, ``COPY_THREADS`` of them
(``set_copy_threads``: the host-profile bench sweeps it). No CuPy here.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np


def align(n: int) -> int:
    """``n`` rounded up to a multiple of 256 (offsets in a call's arena)."""
    return -(-n // 256) * 256


def at(buf: np.ndarray, off: int, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """The bytes of uint8 ``buf`` from ``off`` as a ``dtype`` array of ``shape`` (a view)."""
    n = np.dtype(dtype).itemsize * math.prod(shape)
    return buf[off : off + n].view(dtype).reshape(shape)


# Inputs of at least this many bytes are copied into the pinned buffer by several threads.
SPLIT_COPY_BYTES = 8 << 20
#: Threads of the copy pool (a large copy is cut in this many slices): half the CPUs, 2 to 8.
#: On the 16-core H200 host one thread copies 48 MiB into pinned memory at 5 GB/s, 4 at 30,
#: 8 at 46 and 12 at 40 (``bench/host_profile.py --prefill``); COLIWORKER_COPY_THREADS sets it.
COPY_THREADS = int(os.environ.get("COLIWORKER_COPY_THREADS", 0)) or min(
    8, max(2, (os.cpu_count() or 4) // 2)
)
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="pinned-copy")
        return _copy_pool


def set_copy_threads(n: int) -> None:
    """Use ``n`` copy threads from now on (the old pool finishes its copies, then ends)."""
    global _copy_pool, COPY_THREADS
    with _copy_pool_lock:
        old, _copy_pool, COPY_THREADS = _copy_pool, None, max(1, int(n))
    if old is not None:
        old.shutdown(wait=False)


def copy_async(dst: np.ndarray, src: np.ndarray) -> list[Future]:
    """Start ``dst[...] = src`` (uint8 arrays of one size) in ``COPY_THREADS`` slices on the
    copy pool; returns the slices' futures (the copy is done once all are)."""
    n = dst.nbytes
    pool = _pool()
    step = -(-n // COPY_THREADS) if n else 1
    step = -(-step // 4096) * 4096  # whole pages per slice
    return [pool.submit(np.copyto, dst[i : i + step], src[i : i + step]) for i in range(0, n, step)]


def put_host(
    host: np.ndarray, off: int, a: np.ndarray, nbytes: int, dtype: Any = np.float32
) -> None:
    """Copy array ``a`` (as ``dtype``, C order, ``nbytes`` bytes) into pinned ``host`` at off;
    large copies in slices on several threads (NumPy releases the GIL while it copies)."""
    b = np.ascontiguousarray(a, dtype).reshape(-1).view(np.uint8)
    dst = host[off : off + nbytes]
    if nbytes < SPLIT_COPY_BYTES:
        dst[...] = b
        return
    for f in copy_async(dst, b):
        f.result()


def stack_into(out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """Row blocks ``parts`` (float32 [n_i, w]) stacked into ``out`` (a view of [sum n_i, w] in
    pinned memory): one copy, no temporary."""
    if len(parts) == 1:
        out[...] = parts[0]
    else:
        np.concatenate(parts, out=out)
