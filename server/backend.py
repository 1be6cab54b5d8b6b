"""The backend protocol: what a compute backend (NumPy, CuPy) implements.

Handlers validate every request before a backend sees it: backends may assume shapes,
formats, devices and lengths are consistent. Backends own device memory; the tensor store
(``store.py``) owns names, references and byte accounting.

Array conventions (host side, NumPy): activations in and results out are float32,
C-contiguous. Shapes are documented per method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from coliworker.kernels.qtensor import QTensor


@dataclass
class Phases:
    """Where a call's time went, in nanoseconds (GPU backends time them with CUDA events)."""

    h2d_ns: int = 0
    kernel_ns: int = 0
    d2h_ns: int = 0

    @property
    def total_ns(self) -> int:
        return self.h2d_ns + self.kernel_ns + self.d2h_ns


@dataclass
class Result:
    """A compute result: float32 host array plus its phase times."""

    out: np.ndarray
    phases: Phases = field(default_factory=Phases)
    wall_ns: int = 0  # the whole backend call as the caller timed it (host work included)

    @property
    def backend_ns(self) -> int:
        """Time spent in the backend: the call's wall time when timed, else its phases."""
        return self.wall_ns or self.phases.total_ns


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    name: str
    total_memory_bytes: int
    free_memory_bytes: int


@runtime_checkable
class Resident(Protocol):
    """Backend-owned device copy of one weight tensor."""

    device: int
    nbytes: int  # weights + scales as stored on the device


@runtime_checkable
class KVCache(Protocol):
    """Backend-owned MLA KV cache of one sequence for one kv_b tensor.

    Holds ``length`` rows of latent ``[K]`` and rope ``[R]`` float32 values; grows by pages.
    """

    device: int
    length: int
    nbytes: int  # allocated capacity in bytes

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows (``length <= self.length``)."""

    def reserve(self, n: int) -> None:
        """Room for ``n`` rows past ``length`` (capacity, ``nbytes``, grows; ``length`` does
        not); may raise OutOfDeviceMemory and then leaves the cache as it was."""

    def growth(self, rows: int) -> int:
        """Bytes ``reserve`` would add for the cache to hold ``rows`` rows in all (0: there
        is room), so a call is admitted against budgets before any cache changes."""

    def append(self, latent: np.ndarray, rope: np.ndarray) -> None:
        """Append rows now: latent float32 [n, K], rope float32 [n, R]; may raise
        OutOfDeviceMemory and then leaves the cache as it was. The hot path passes new rows to
        ``Backend.attention_ragged`` instead (one upload with the call)."""

    def release(self) -> None:
        """Return the memory; the cache is unusable afterwards."""


class Placement(Protocol):
    """A tensor placed while its bytes arrive (``Backend.begin_place``): device memory is
    allocated up front and each block is copied in as soon as it is here, so the device
    copy overlaps the rest of the stream instead of following it."""

    def write(self, offset: int, data: np.ndarray) -> None:
        """Bytes ``[offset, offset + len(data))`` of weights || scales, as the client sends
        them. data: uint8 [n], host memory the caller reuses once this returns (fastest from
        ``Backend.staging``). Called in order, by one thread at a time."""

    def finish(self) -> Resident:
        """Every byte written: the resident tensor, laid out as ``place`` lays it out. On an
        error nothing stays allocated."""

    def abort(self) -> None:
        """Free what was allocated; the placement is unusable afterwards. Idempotent."""


def split_write(weights: np.ndarray, scales: np.ndarray, offset: int, data: np.ndarray) -> None:
    """Copy bytes ``[offset, offset + len(data))`` of weights || scales (both uint8 views)
    into the two arrays; NumPy drops the GIL while it copies."""
    n, wb = len(data), len(weights)
    k = max(0, min(n, wb - offset))  # how many of them are weights
    if k:
        weights[offset : offset + k] = data[:k]
    if k < n:
        scales[offset + k - wb : offset + n - wb] = data[k:]


class Pending(Protocol):
    """An expert group started by ``expert_group_issue``."""

    def result(self) -> Result:
        """Block until done; the same bits ``expert_group`` would have returned."""


ExpertTriple = tuple[Any, Any, Any]  # (gate, up, down) Residents


class Backend(Protocol):
    name: str

    def devices(self) -> list[DeviceInfo]:
        """The served devices, in id order, with memory read now."""

    def place(self, tensor: QTensor, device: int) -> Resident:
        """Copy a tensor to ``device``. Raises OutOfDeviceMemory."""

    def begin_place(
        self, fmt: int, in_features: int, out_features: int, group_size: int, device: int
    ) -> Placement:
        """Allocate a tensor of this spec on ``device`` whose bytes ``Placement.write`` will
        bring. Raises OutOfDeviceMemory."""

    def staging(self, nbytes: int) -> np.ndarray:
        """A host buffer uint8 [nbytes] that ``Placement.write`` copies from fastest (page-
        locked memory for a GPU backend); callers keep and reuse it."""

    def replace(self, resident: Resident, tensor: QTensor) -> None:
        """Overwrite a resident tensor's contents in place (same spec)."""

    def release(self, resident: Resident) -> None:
        """Free a resident tensor's device memory."""

    def matmul(self, w: Resident, x: np.ndarray) -> Result:
        """x float32 [S, I] -> y float32 [S, O]."""

    def expert_mlp(self, gate: Resident, up: Resident, down: Resident, x: np.ndarray) -> Result:
        """x float32 [S, D] -> down(silu(gate x) * up x) float32 [S, D]."""

    def expert_group(
        self,
        experts: Sequence[ExpertTriple],
        rows: Sequence[int],
        x: np.ndarray,
        lend: bool = False,
    ) -> Result:
        """x float32 [sum(rows), D], rows[c] rows per expert c in order -> y packed the same.

        ``lend``: y may be lent, not owned: a view of the backend's memory that stays as it is
        only until this thread's next call on the backend (a caller that answers with it
        before anything else, as the data plane's compiled path does; CuPy: the call's pinned
        output, one host copy of y fewer)."""

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> Pending:
        """Start ``expert_group`` and return at once; bit-identical result."""

    def expert_group_routed(
        self,
        experts: Sequence[ExpertTriple],
        x: np.ndarray,
        routes: np.ndarray,
        weights: np.ndarray,
    ) -> Result:
        """x float32 [T, D], routes int32 [T, K] into experts, weights float32 [T, K]
        -> y float32 [T, D] with y[t] = sum_j weights[t, j] * expert_{routes[t, j]}(x[t])."""

    def attention(
        self,
        kv_b: Resident,
        o_proj: Resident | None,
        q: np.ndarray,
        latent: np.ndarray,
        rope: np.ndarray,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
    ) -> Result:
        """Causal MLA over one sequence: q [S, H, Q+R], latent [T, K], rope [T, R];
        row s sees T - S + s + 1 rows. -> ctx [S, H, V], or [S, D_out] with o_proj."""

    def new_kv(self, device: int, k: int, r: int) -> KVCache:
        """An empty KV cache on ``device`` for latent width K and rope width R."""

    def attention_ragged(
        self,
        kv_b: Resident,
        o_proj: Resident | None,
        q: np.ndarray,
        caches: Sequence[KVCache],
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        rows: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> Result:
        """Row s of q [S, H, Q+R] attends all rows of its cache ``caches[s]``, after the call
        appends ``rows[s]`` = (latent float32 [n_s, K], rope float32 [n_s, R]) to it (n_s may
        be 0). -> ctx [S, H, V], or [S, D_out] with o_proj.

        Callers that account memory ``reserve`` room first (a cache without room grows here).
        The lengths advance only when the call succeeds: after an error every cache holds the
        rows it held before (rows written past its length are not claimed).
        """

    def close(self) -> None:
        """Release everything (process exit)."""


BackendFactory = Callable[..., Backend]
