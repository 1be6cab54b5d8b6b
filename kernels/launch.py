"""Prepared kernel launches: one ``cuLaunchKernel`` per call with a prebuilt parameter block.

A CuPy ``RawKernel`` call converts and packs every argument on each launch (~6 us of host time
for the 20-argument expert kernels). A ``Launch`` is built once per shape (``cached``): its
constant arguments are packed once, and a call writes only the leading device pointers into the
block and launches on the current stream. Where the driver entry point is missing, it falls
back to the CuPy call. ``max_active_clusters`` asks the driver how many thread-block clusters
of a kernel are resident at once (attention's cluster choice keeps a launch to one wave).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import cupy
import numpy as np

try:
    from cupy_backends.cuda.api import driver as _driver

    _launch_kernel = _driver.launchKernel
except (ImportError, AttributeError):  # pragma: no cover - depends on the CuPy build
    _launch_kernel = None

#: Off: every launch goes through CuPy's RawKernel call (the reference for tests).
RAW = True

_CTYPE = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float,
          np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64}  # fmt: skip


def _ptr(p: object) -> int | float:
    """A slot's value: a device address from an int, a NumPy integer or a CuPy array; a
    NumPy scalar's value."""
    if isinstance(p, cupy.ndarray):
        return int(p.data.ptr)
    if isinstance(p, np.floating):
        return float(p)
    return int(p)  # type: ignore[call-overload]


class Launch:
    """A prepared launch: kernel, grid, block, dynamic shared memory and every argument after
    the leading ones. ``launch(*lead)`` makes it on the current device and stream; leading
    arguments are device addresses (``np.uint64``, int or CuPy arrays) or NumPy scalars of
    other types (``np.int32``), the same types on every call."""

    __slots__ = ("fn", "grid", "block", "tail", "smem", "_raw", "_slots", "_values", "_lock")

    def __init__(self, fn: cupy.RawKernel, grid: tuple, block: tuple, tail: tuple, smem: int):
        self.fn, self.grid, self.block, self.tail, self.smem = fn, grid, block, tail, smem
        self._raw: tuple | None = None  # cuLaunchKernel's arguments but the stream, once built
        self._slots: list[Any] = []  # ctypes values the block points at
        self._lock = threading.Lock()  # one parameter block: one writer at a time

    def _build(self, lead: tuple) -> bool:
        """Pack the parameter block: a slot per leading argument (u64 for a pointer, or the
        type of a NumPy scalar passed there), then the tail's values."""
        if _launch_kernel is None:
            return False
        try:
            tail = [_CTYPE[np.asarray(v).dtype](np.asarray(v).item()) for v in self.tail]
        except KeyError:
            return False
        self._slots = [
            _CTYPE.get(p.dtype, ctypes.c_uint64)(0)
            if isinstance(p, np.generic) and not isinstance(p, np.uint64)
            else ctypes.c_uint64(0)
            for p in lead
        ]
        values: list[Any] = [*self._slots, *tail]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self._values = [*values, params]  # the block points into these: keep them alive
        gx, gy, gz = (*self.grid, 1, 1)[:3]
        bx, by, bz = (*self.block, 1, 1)[:3]
        self._raw = (self.fn.kernel.ptr, gx, gy, gz, bx, by, bz, self.smem,
                     ctypes.addressof(params))  # fmt: skip
        return True

    def __call__(self, *ptrs: object) -> None:
        raw = self._raw
        if RAW and (raw is not None or self._build(ptrs)):
            f, gx, gy, gz, bx, by, bz, smem, params = self._raw  # type: ignore[misc]
            stream = cupy.cuda.get_current_stream().ptr
            with self._lock:
                for slot, p in zip(self._slots, ptrs, strict=True):
                    slot.value = _ptr(p)
                _launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, 0)
            return
        self.fn(self.grid, self.block, ptrs + self.tail, shared_mem=self.smem)


# Prepared launches by (device, kind, spec ids, sizes): the specs are interned, so their ids
# are stable; a plain dict, cleared when it grows past a bound (shapes repeat in practice).
_launches: dict[tuple, Any] = {}
_LAUNCH_CACHE = 4096
T = TypeVar("T")


def cached(key: tuple, make: Callable[[], T]) -> T:
    """The launch (or tuple of launches, or None) made once per key."""
    try:
        return _launches[key]
    except KeyError:
        pass
    if len(_launches) >= _LAUNCH_CACHE:
        _launches.clear()
    ln = _launches[key] = make()
    return ln


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("smem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("n_attrs", ctypes.c_uint),
    ]


def max_active_clusters(fn: cupy.RawKernel, cluster: int, block: int, smem: int) -> int:
    """cuOccupancyMaxActiveClusters: how many clusters of ``cluster`` blocks of ``fn`` (compiled
    with ``__cluster_dims__``, its dynamic shared memory limit already set) fit on the device
    at once with ``block`` threads and ``smem`` bytes each; 0 where the driver cannot say
    (then callers launch no clusters)."""
    try:
        occ = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    except (OSError, AttributeError):  # pragma: no cover - depends on the driver
        return 0
    cfg = LaunchConfig((cluster, 1, 1), (block, 1, 1), smem, None, None, 0)
    n = ctypes.c_int(0)
    err = occ(ctypes.byref(n), ctypes.c_void_p(fn.kernel.ptr), ctypes.byref(cfg))
    return int(n.value) if err == 0 else 0
