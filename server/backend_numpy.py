"""The NumPy backend: the reference on the host, behind the Backend protocol.

Every compute method delegates to ``coliworker.kernels.reference``, so this backend *is*
the oracle, and it is the embedded default where no GPU is usable. Each served device id
is a virtual CPU device: they share host RAM but keep separate residents, so multi-device
placement and validation are testable without GPUs.

Residents and KV caches hold private copies of what callers pass: a caller reusing its
buffers after ``place`` / ``append`` never changes what is resident.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from coliworker.kernels import reference
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count
from coliworker.server import hostmem
from coliworker.server.backend import (
    DeviceInfo,
    ExpertTriple,
    Phases,
    Result,
    split_write,
)
from coliworker.server.errors import FailedPrecondition, InvalidArgument, OutOfDeviceMemory

KV_PAGE_ROWS = 64  # KV capacity is a multiple of this many rows, doubled when it grows
ISSUE_WORKERS = 4  # threads running issued expert groups (NumPy/BLAS release the GIL)

_T = TypeVar("_T")


def _physical_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes, read now, bounded by the process's memory
    cgroup (a container's limit, not the host's RAM: ``hostmem.py``)."""
    return hostmem.host_memory()


def _allocate(what: str, make: Callable[[], _T]) -> _T:
    """Run an allocation, turning a host MemoryError into the protocol's OutOfDeviceMemory."""
    try:
        return make()
    except MemoryError:
        raise OutOfDeviceMemory(f"{what}: host memory exhausted") from None


def _copy(tensor: QTensor) -> QTensor:
    """A QTensor owning fresh contiguous copies of the caller's weights and scales."""
    return QTensor(
        tensor.fmt,
        tensor.in_features,
        tensor.out_features,
        tensor.group_size,
        np.array(tensor.weights, dtype=np.uint8, copy=True).reshape(-1),
        np.array(tensor.scales, dtype=np.float32, copy=True).reshape(-1),
    )


class NumpyResident:
    """One weight tensor resident on a virtual device: a private QTensor copy."""

    __slots__ = ("device", "nbytes", "tensor")

    def __init__(self, tensor: QTensor, device: int) -> None:
        self.tensor = tensor
        self.device = device
        self.nbytes = tensor.nbytes

    def __repr__(self) -> str:
        t = self.tensor
        return (
            f"NumpyResident(fmt={t.fmt}, shape=[{t.out_features}, {t.in_features}], "
            f"device={self.device}, nbytes={self.nbytes})"
        )


class NumpyPlacement:
    """A tensor arriving block by block into its own fresh arrays (``Backend.begin_place``)."""

    def __init__(self, fmt: int, i: int, o: int, gs: int, device: int) -> None:
        self.spec = (fmt, i, o, gs)
        self.device = device
        wbytes = row_bytes(fmt, i) * o
        self._w: np.ndarray | None = _allocate("place", lambda: np.empty(wbytes, np.uint8))
        self._s: np.ndarray | None = np.empty(scale_count(fmt, i, o, gs), np.float32)

    def write(self, offset: int, data: np.ndarray) -> None:
        assert self._w is not None and self._s is not None, "write after finish/abort"
        split_write(self._w, self._s.view(np.uint8), offset, data)

    def finish(self) -> NumpyResident:
        assert self._w is not None and self._s is not None, "finish after finish/abort"
        tensor = QTensor(*self.spec, self._w, self._s)
        self._w = self._s = None
        return NumpyResident(tensor, self.device)

    def abort(self) -> None:
        self._w = self._s = None


class NumpyKVCache:
    """MLA KV cache of one sequence: latent float32 [capacity, K], rope float32 [capacity, R].

    Rows ``0 .. length-1`` are valid. Capacity is a whole number of ``KV_PAGE_ROWS`` pages
    and at least doubles when it grows, so appending one row per decode step is amortized
    O(1) copies. ``nbytes`` counts the capacity (what is allocated), not ``length``.
    """

    def __init__(self, device: int, k: int, r: int) -> None:
        self.device = device
        self.k = k
        self.r = r
        self.length = 0
        self._latent = np.empty((0, k), np.float32)
        self._rope = np.empty((0, r), np.float32)
        self._released = False

    @property
    def nbytes(self) -> int:
        return int(self._latent.nbytes + self._rope.nbytes)

    @property
    def capacity(self) -> int:
        return int(self._latent.shape[0])

    @property
    def latent(self) -> np.ndarray:
        """The valid latent rows: float32 [length, K], a view (read only by callers)."""
        return self._latent[: self.length]

    @property
    def rope(self) -> np.ndarray:
        """The valid rope rows: float32 [length, R], a view (read only by callers)."""
        return self._rope[: self.length]

    def _check_live(self, op: str) -> None:
        if self._released:
            raise FailedPrecondition(f"kv.{op}: the cache was released")

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows; the capacity stays allocated for re-appending."""
        self._check_live("truncate")
        self.length = max(0, min(int(length), self.length))

    def reserve(self, n: int) -> None:
        """Room for ``n`` rows past ``length``; on OutOfDeviceMemory the cache is unchanged."""
        self._check_live("reserve")
        need = self.length + n
        if need > self.capacity:
            pages = -(-need // KV_PAGE_ROWS) * KV_PAGE_ROWS
            capacity = max(pages, 2 * self.capacity)
            new_latent = _allocate("kv.reserve", lambda: np.empty((capacity, self.k), np.float32))
            new_rope = _allocate("kv.reserve", lambda: np.empty((capacity, self.r), np.float32))
            new_latent[: self.length] = self._latent[: self.length]
            new_rope[: self.length] = self._rope[: self.length]
            self._latent, self._rope = new_latent, new_rope

    def growth(self, rows: int) -> int:
        """Bytes ``reserve`` would add for the cache to hold ``rows`` rows in all (0: there
        is room): what a ragged call admits against budgets before anything changes."""
        if rows <= self.capacity:
            return 0
        pages = -(-rows // KV_PAGE_ROWS) * KV_PAGE_ROWS
        return (max(pages, 2 * self.capacity) - self.capacity) * 4 * (self.k + self.r)

    def stage(self, latent: np.ndarray, rope: np.ndarray) -> int:
        """Write rows past ``length`` without claiming them (room reserved); returns their
        count. ``length`` is the caller's to advance."""
        latent = np.asarray(latent, dtype=np.float32).reshape(-1, self.k)
        rope = np.asarray(rope, dtype=np.float32).reshape(-1, self.r)
        n = latent.shape[0]
        self.reserve(n)
        self._latent[self.length : self.length + n] = latent
        self._rope[self.length : self.length + n] = rope
        return n

    def staged(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the valid rows and the next ``n`` (staged) ones: latent float32
        [length + n, K], rope float32 [length + n, R]."""
        return self._latent[: self.length + n], self._rope[: self.length + n]

    def append(self, latent: np.ndarray, rope: np.ndarray) -> None:
        """Copy in rows: latent float32 [n, K], rope float32 [n, R]. On OutOfDeviceMemory the
        cache is unchanged."""
        self._check_live("append")
        self.length += self.stage(latent, rope)

    def release(self) -> None:
        self._latent = np.empty((0, self.k), np.float32)
        self._rope = np.empty((0, self.r), np.float32)
        self.length = 0
        self._released = True

    def __repr__(self) -> str:
        return (
            f"NumpyKVCache(device={self.device}, K={self.k}, R={self.r}, "
            f"length={self.length}, capacity={self.capacity})"
        )


class NumpyPending:
    """An issued expert group: ``result()`` blocks until the worker thread is done."""

    def __init__(self, future: Future[Result]) -> None:
        self._future = future

    def result(self) -> Result:
        return self._future.result()


def _timed(compute: Callable[[], np.ndarray]) -> Result:
    start = time.perf_counter_ns()
    out = compute()
    return Result(out, Phases(kernel_ns=time.perf_counter_ns() - start))


def _tensors(experts: Sequence[ExpertTriple]) -> list[tuple[QTensor, QTensor, QTensor]]:
    return [(g.tensor, u.tensor, d.tensor) for g, u, d in experts]


class NumpyBackend:
    """The Backend protocol on the host CPU with NumPy; ``devices`` are virtual device ids."""

    name = "numpy"

    def __init__(self, devices: tuple[int, ...] = (0,)) -> None:
        self._device_ids = tuple(int(d) for d in devices)
        self._pool = ThreadPoolExecutor(ISSUE_WORKERS, thread_name_prefix="numpy-issue")

    def _check_device(self, what: str, device: int) -> None:
        if device not in self._device_ids:
            raise InvalidArgument(
                f"{what}.device: expected one of {self._device_ids}, got {device}"
            )

    # -- devices and residency -------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        """One "cpu" entry per served id, each reporting the whole host RAM."""
        total, free = _physical_memory()
        return [DeviceInfo(d, "cpu", total, free) for d in self._device_ids]

    def place(self, tensor: QTensor, device: int) -> NumpyResident:
        self._check_device("place", device)
        return NumpyResident(_allocate("place", lambda: _copy(tensor)), device)

    def begin_place(
        self, fmt: int, in_features: int, out_features: int, group_size: int, device: int
    ) -> NumpyPlacement:
        self._check_device("place", device)
        return NumpyPlacement(fmt, in_features, out_features, group_size, device)

    def staging(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def replace(self, resident: NumpyResident, tensor: QTensor) -> None:
        resident.tensor = _allocate("replace", lambda: _copy(tensor))
        resident.nbytes = resident.tensor.nbytes

    def release(self, resident: NumpyResident) -> None:
        t = resident.tensor
        empty = np.empty(0, np.uint8)
        resident.tensor = QTensor(
            t.fmt, t.in_features, 0, t.group_size, empty, empty.view(np.float32)
        )
        resident.nbytes = 0

    # -- compute ---------------------------------------------------------------------------

    def matmul(self, w: NumpyResident, x: np.ndarray) -> Result:
        return _timed(lambda: reference.matmul(w.tensor, x))

    def expert_mlp(
        self, gate: NumpyResident, up: NumpyResident, down: NumpyResident, x: np.ndarray
    ) -> Result:
        return _timed(lambda: reference.expert_mlp(gate.tensor, up.tensor, down.tensor, x))

    def expert_group(
        self,
        experts: Sequence[ExpertTriple],
        rows: Sequence[int],
        x: np.ndarray,
        lend: bool = False,
    ) -> Result:
        tensors = _tensors(experts)  # (lend: the result is always its own)
        return _timed(lambda: reference.expert_group(tensors, rows, x))

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> NumpyPending:
        """Run ``expert_group`` on a worker thread. The arguments are captured now (x copied,
        residents' current tensors taken), so the caller may reuse its buffers at once."""
        tensors = _tensors(experts)
        rows = list(rows)
        x = np.array(x, dtype=np.float32, copy=True)
        return NumpyPending(
            self._pool.submit(_timed, lambda: reference.expert_group(tensors, rows, x))
        )

    def expert_group_routed(
        self,
        experts: Sequence[ExpertTriple],
        x: np.ndarray,
        routes: np.ndarray,
        weights: np.ndarray,
    ) -> Result:
        tensors = _tensors(experts)
        return _timed(lambda: reference.expert_group_routed(tensors, x, routes, weights))

    def attention(
        self,
        kv_b: NumpyResident,
        o_proj: NumpyResident | None,
        q: np.ndarray,
        latent: np.ndarray,
        rope: np.ndarray,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
    ) -> Result:
        proj = None if o_proj is None else o_proj.tensor
        return _timed(
            lambda: reference.attention(
                kv_b.tensor, proj, q, latent, rope, q_dim, rope_dim, v_dim, scale
            )
        )

    def new_kv(self, device: int, k: int, r: int) -> NumpyKVCache:
        self._check_device("new_kv", device)
        return NumpyKVCache(device, k, r)

    def attention_ragged(
        self,
        kv_b: NumpyResident,
        o_proj: NumpyResident | None,
        q: np.ndarray,
        caches: Sequence[NumpyKVCache],
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        rows: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> Result:
        proj = None if o_proj is None else o_proj.tensor
        fresh = [0] * len(caches)
        if rows is not None:
            fresh = [c.stage(lat, rop) for c, (lat, rop) in zip(caches, rows, strict=True)]
        # The staged rows take part; the lengths advance once the call has succeeded.
        views = [c.staged(n) for c, n in zip(caches, fresh, strict=True)]
        latents, ropes = [v[0] for v in views], [v[1] for v in views]
        res = _timed(
            lambda: reference.attention_ragged(
                kv_b.tensor, proj, q, latents, ropes, q_dim, rope_dim, v_dim, scale
            )
        )
        for c, n in zip(caches, fresh, strict=True):
            c.length += n
        return res

    def close(self) -> None:
        """Wait for issued groups, then stop the worker threads."""
        self._pool.shutdown(wait=True)
