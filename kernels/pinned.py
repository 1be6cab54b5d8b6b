"""Writing a call's inputs into its pinned host buffer (every op's host side uses these).

``put_host`` copies an array in (large ones in slices on several threads: NumPy releases the
GIL while it copies), ``stack_into`` stacks row blocks without a temporary, ``align`` rounds
an offset in a call's arena up to 256 bytes. No CuPy here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def align(n: int) -> int:
    """``n`` rounded up to a multiple of 256 (offsets in a call's arena)."""
    return -(-n // 256) * 256


# Inputs of at least this many bytes are copied into the pinned buffer by several threads.
SPLIT_COPY_BYTES = 8 << 20
_COPY_THREADS = 4
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


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
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="pinned-copy")
    step = -(-nbytes // _COPY_THREADS)
    parts = [(dst[i : i + step], b[i : i + step]) for i in range(0, nbytes, step)]
    for f in [_copy_pool.submit(np.copyto, d, src) for d, src in parts]:
        f.result()


def stack_into(host: np.ndarray, off: int, parts: Sequence[np.ndarray], n: int, w: int) -> None:
    """Row blocks ``parts`` (float32 [n_i, w], n rows in all) stacked into pinned ``host`` at
    off: one copy, no temporary."""
    out = host[off : off + 4 * n * w].view(np.float32).reshape(n, w)
    if len(parts) == 1:
        out[...] = parts[0]
    else:
        np.concatenate(parts, out=out)
