"""What the CuPy backend keeps on a device: resident weight tensors (``CupyResident``), tensors
arriving block by block (``CupyPlacement``) and MLA KV caches (``CupyKVCache``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cupy
import numpy as np

from coliworker.kernels import layout
from coliworker.kernels.matmul import WeightSpec
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count
from coliworker.server.cupy_calls import H2D, oom_guard

if TYPE_CHECKING:
    from coliworker.server.backend_cupy import CupyBackend

KV_PAGE_ROWS = 256


class CupyResident:
    """A weight tensor on one device: resident bytes uint8 [O * ld] and float32 scales."""

    def __init__(self, tensor: QTensor, device: int, w: cupy.ndarray, s: cupy.ndarray) -> None:
        self.device = device
        self.fmt = tensor.fmt
        self.in_features = tensor.in_features
        self.out_features = tensor.out_features
        self.group_size = tensor.group_size
        self.layout = layout.Layout.of(tensor.fmt, tensor.in_features, tensor.group_size)
        self.w = w
        self.s = s
        self.nbytes = int(w.nbytes + (s.nbytes if tensor.fmt else 0))
        # Made once: the per-call planning compares and hashes specs.
        self.spec = WeightSpec.of(self.fmt, self.in_features, self.group_size)
        self.ptrs = (w.data.ptr, s.data.ptr)  # stable: replace() writes in place

    def row_ptrs(self, row: int) -> tuple[int, int]:
        """Device addresses of row ``row``'s weights and scales."""
        s_stride = self.layout.ngp * 4 if self.fmt else 0
        return self.w.data.ptr + row * self.layout.ld, self.s.data.ptr + row * s_stride


class CupyPlacement:
    """A tensor arriving block by block (``Backend.begin_place``): the client's weight bytes
    go straight into device memory (uint8 [O * row_bytes], allocated up front), the scales
    into a small host array; ``finish`` lays both out on the device as ``place`` does."""

    def __init__(self, backend: CupyBackend, fmt: int, i: int, o: int, gs: int, device: int):
        self._backend = backend
        self.spec = (fmt, i, o, gs)
        self.device = device
        wbytes = row_bytes(fmt, i) * o
        stream = backend._stream(device)
        with cupy.cuda.Device(device), stream:
            with oom_guard(device, f"place {wbytes} bytes"):
                self._raw: Any = cupy.empty(wbytes, cupy.uint8)
            # Pool memory may still be read by work queued earlier on this stream, and the
            # blocks are written from other threads: let that work finish first.
            stream.synchronize()
        self._ptr = self._raw.data.ptr
        self._scales: Any = np.empty(scale_count(fmt, i, o, gs), np.float32)

    def write(self, offset: int, data: np.ndarray) -> None:
        n, wb = len(data), self._raw.nbytes
        k = max(0, min(n, wb - offset))  # how many of them are weights
        if k:
            # On this thread's stream, waited for (the caller reuses ``data`` at once), both
            # without the GIL; from pinned memory at PCIe speed (1 MiB: ~0.05 ms).
            stream = self._backend._stream(self.device)
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.memcpyAsync(
                    self._ptr + offset, data.ctypes.data, k, H2D, stream.ptr
                )
                stream.synchronize()
        if k < n:
            self._scales.view(np.uint8)[offset + k - wb : offset + n - wb] = data[k:]

    def finish(self) -> CupyResident:
        tensor = QTensor(*self.spec, self._raw, self._scales)
        try:
            w, s = self._backend._layout_on_device(tensor, self.device)
        finally:
            self.abort()
        return CupyResident(tensor, self.device, w, s)

    def abort(self) -> None:
        self._raw = self._scales = None
        self._ptr = 0


class CupyKVCache:
    """Device-resident latent [cap, K] / rope [cap, R] float32, grown by pages (copy on grow)."""

    def __init__(self, backend: CupyBackend, device: int, k: int, r: int) -> None:
        self._backend = backend
        self.device = device
        self.k, self.r = k, r
        self.length = 0
        self.cap = 0
        # cupy.ndarray [cap, K] / [cap, R] once the first rows arrive (None before).
        self.latent: Any = None
        self.rope: Any = None

    @property
    def nbytes(self) -> int:
        return self.cap * (self.k + self.r) * 4

    def truncate(self, length: int) -> None:
        self.length = min(self.length, max(0, int(length)))

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.cap)
        cap = -(-cap // KV_PAGE_ROWS) * KV_PAGE_ROWS
        stream = self._backend._stream(self.device)
        with cupy.cuda.Device(self.device), stream:
            with oom_guard(self.device, f"kv cache growth to {cap} rows"):
                lat = cupy.empty((cap, self.k), cupy.float32)
                rop = cupy.empty((cap, self.r), cupy.float32)
            if self.length:
                lat[: self.length] = self.latent[: self.length]
                rop[: self.length] = self.rope[: self.length]
            stream.synchronize()
        self.latent, self.rope, self.cap = lat, rop, cap

    def growth(self, rows: int) -> int:
        """Bytes ``reserve`` would add for the cache to hold ``rows`` rows in all (0: room)."""
        if rows <= self.cap:
            return 0
        cap = -(-max(rows, 2 * self.cap) // KV_PAGE_ROWS) * KV_PAGE_ROWS
        return (cap - self.cap) * (self.k + self.r) * 4

    def reserve(self, n: int) -> None:
        """Room for ``n`` rows past ``length``; on OutOfDeviceMemory the cache is unchanged."""
        if self.length + n > self.cap:
            self._grow(self.length + n)

    def append(self, latent: np.ndarray, rope: np.ndarray) -> None:
        """Copy rows in now: two copies and a synchronize. A ragged call carries its new rows
        in its own upload instead (``CupyBackend.attention_ragged``)."""
        n = latent.shape[0]
        if n == 0:
            return
        self.reserve(n)
        stream = self._backend._stream(self.device)
        with cupy.cuda.Device(self.device), stream:
            a, b = self.length, self.length + n
            self.latent[a:b].set(np.ascontiguousarray(latent, np.float32), stream=stream)
            self.rope[a:b].set(np.ascontiguousarray(rope, np.float32), stream=stream)
            stream.synchronize()
        self.length = b

    def release(self) -> None:
        self.latent = self.rope = None
        self.cap = self.length = 0
