"""The CuPy backend: resident quantized weights, MLA KV caches and kernels on CUDA devices.

Weights are re-laid out on the device at place time (``kernels/layout.py``); a call moves only
its activations: one H2D phase (activations and the per-call job / descriptor tables), the
kernels, one D2H phase, timed with CUDA events.

This module is the dispatcher: each op's host side (plan, job tables, arena layout,
launches) is its own module (``kernels/matmul.py``, ``kernels/expert_group.py``,
``kernels/attention_call.py``), run inside a ``Call`` (``server/cupy_calls.py``: the device, the
thread's stream, a reusable arena, the device work issued at the end as a CUDA graph once
seen before, ``kernels/graphs.py``). What stays on a device (weights, tensors arriving block
by block, KV caches) is in ``server/cupy_residents.py``; sessions' shared-memory segments in
``server/cupy_segments.py``.

Concurrency: every thread gets its own non-blocking stream per device and its own pool of
arenas; a call holds its arena until its result is on the host, so calls from a thread pool,
calls on several devices and outstanding ``expert_group_issue`` results never share mutable
scratch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cupy
import numpy as np

from coliworker.kernels import attention as att
from coliworker.kernels import attention_call, expert_group, layout
from coliworker.kernels import matmul as mm
from coliworker.kernels.qtensor import QTensor
from coliworker.server import kept
from coliworker.server.backend import DeviceInfo, ExpertTriple, Result
from coliworker.server.cupy_calls import (
    DIRECT_BYTES,
    Arena,
    Call,
    CupyPending,
    oom_guard,
    pinned,
    rerun,
    rerunnable,
)
from coliworker.server.cupy_residents import CupyKVCache, CupyPlacement, CupyResident
from coliworker.server.cupy_segments import HostSegments
from coliworker.server.errors import InvalidArgument

if TYPE_CHECKING:
    from coliworker.wire.shm import Segment


class CupyBackend:
    """Backend on CUDA devices through CuPy; see the module docstring."""

    name = "cupy"

    def __init__(self, devices: tuple[int, ...] = (0,)) -> None:
        count = cupy.cuda.runtime.getDeviceCount()
        for d in devices:
            if not 0 <= d < count:
                raise InvalidArgument(f"devices: expected ids in 0..{count - 1}, got {d}")
        self._devices = tuple(sorted(set(devices)))
        self._local = threading.local()
        self._sms = {
            d: cupy.cuda.Device(d).attributes["MultiProcessorCount"] for d in self._devices
        }
        self._names: dict[int, str] = {}
        self._segments = HostSegments(self._devices)
        # the compiled twins of the kept decode calls (server/kept.c), or None: the Python
        self._compiled = kept.twins()

    # -- shared-memory segments --------------------------------------------------------------

    def attach_segment(self, seg: Segment) -> None:
        """A session mapped ``seg`` (``server/session.py``): large float32 inputs in it go to the
        device straight from it once registered (``server/cupy_segments.py``)."""
        self._segments.attach(seg)

    def _registered(self, ptr: int, n: int) -> bool:
        return self._segments.registered(ptr, n)

    # -- devices and streams ---------------------------------------------------------------

    def _thread(self, device: int) -> tuple[cupy.cuda.Stream, list[Arena]]:
        """This thread's stream and free arenas of ``device``, made on first use: what a
        ``Call`` takes, in one look-up."""
        try:
            return self._local.calls[device]
        except AttributeError:
            self._local.calls = {}
        except KeyError:
            pass
        pool: list[Arena] = []
        with cupy.cuda.Device(device):
            got = (cupy.cuda.Stream(non_blocking=True), pool)
        self._local.calls[device] = got
        return got

    def _kept(
        self, device: int, nbytes: int, what: str, find: Any, *args: Any, lend: bool = False
    ) -> Result | None:
        """A decode call of a kept plan made without a ``Call``: ``find(pool, *args, ready)`` (the
        op's ``expert_group.routed_kept``, ``group_kept``, ``attention_call.run_kept`` or
        ``matmul.run_kept``) takes this thread's top arena and writes the call's inputs, the
        same bytes as through a ``Call``, and ``cupy_calls.rerun`` launches the plan's graph
        (each find with the rerun compiled where ``server/kept.c`` is built, ``server/kept.py``).
        None (nothing done) where the device is not current, the input (``nbytes``) would be
        read from a registered segment, or ``find`` has no such plan: the caller makes the call
        through a ``Call``. ``lend``: the result's ``out`` is the arena's own view (``rerun``'s
        ``lend``; the expert group's only)."""
        stream, pool = self._thread(device)
        if not pool or nbytes >= DIRECT_BYTES or cupy.cuda.runtime.getDevice() != device:
            return None
        run = rerun
        c = self._compiled
        if c is not None:  # server/kept.c: each find with its rerun, or the rerun
            if find is c.routed_kept:
                return c.routed(pool, *args, stream, device, what)
            if find is c.group_kept:
                return c.group(pool, *args, stream, device, what, lend)
            if find is c.run_kept:
                return c.ragged(pool, *args, stream, device, what)
            if find is c.matmul_kept:
                return c.matmul(pool, *args, stream, device, what)
            run = c.rerun
        got = find(pool, *args, rerunnable)
        return None if got is None else run(*got, stream, device, what, lend)

    def _stream(self, device: int) -> cupy.cuda.Stream:
        """This thread's stream on ``device``."""
        return self._thread(device)[0]

    def _arenas(self, device: int) -> list[Arena]:
        """This thread's free arenas of ``device``."""
        return self._thread(device)[1]

    def devices(self) -> list[DeviceInfo]:
        out = []
        for d in self._devices:
            with cupy.cuda.Device(d):
                free, total = cupy.cuda.runtime.memGetInfo()
            out.append(DeviceInfo(d, self._name(d), total, free))
        return out

    def _name(self, d: int) -> str:
        # Read once: getDeviceProperties fills in every property, and each upload asks
        # for the free memory (limits.check_upload).
        if d not in self._names:
            name = cupy.cuda.runtime.getDeviceProperties(d)["name"]
            self._names[d] = name.decode() if isinstance(name, bytes) else str(name)
        return self._names[d]

    # -- resident tensors ------------------------------------------------------------------

    def _layout_on_device(self, tensor: QTensor, device: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        stream = self._stream(device)
        with cupy.cuda.Device(device), stream:
            with oom_guard(device, f"place {tensor.nbytes} bytes"):
                raw = cupy.asarray(tensor.weights)
                w = layout.relayout(cupy, tensor, raw)
                s = layout.scales(cupy, tensor, cupy.asarray(tensor.scales))
                stream.synchronize()
        return w, s

    def place(self, tensor: QTensor, device: int) -> CupyResident:
        w, s = self._layout_on_device(tensor, device)
        return CupyResident(tensor, device, w, s)

    def begin_place(
        self, fmt: int, in_features: int, out_features: int, group_size: int, device: int
    ) -> CupyPlacement:
        return CupyPlacement(self, fmt, in_features, out_features, group_size, device)

    def staging(self, nbytes: int) -> np.ndarray:
        return pinned(nbytes, "upload staging")

    def replace(self, resident: CupyResident, tensor: QTensor) -> None:
        w, s = self._layout_on_device(tensor, resident.device)
        stream = self._stream(resident.device)
        with cupy.cuda.Device(resident.device), stream:
            resident.w[...] = w
            resident.s[...] = s
            stream.synchronize()

    def release(self, resident: CupyResident) -> None:
        resident.w = resident.s = None  # type: ignore[assignment]
        resident.nbytes = 0

    # -- dense products (host side: kernels/matmul.py) --------------------------------------

    def matmul(self, w: CupyResident, x: np.ndarray) -> Result:
        res = self._kept(w.device, x.nbytes, "matmul", mm.run_kept, w, x)
        if res is not None:
            return res
        with Call(self, w.device, "matmul") as call:
            return mm.run(call, w, x)

    def expert_mlp(
        self, gate: CupyResident, up: CupyResident, down: CupyResident, x: np.ndarray
    ) -> Result:
        return self.expert_group([(gate, up, down)], [x.shape[0]], x)

    # -- expert groups (host side: kernels/expert_group.py) ----------------------------------

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> CupyPending:
        with Call(self, experts[0][0].device, "expert_group") as call:
            expert_group.issue(call, experts, rows, x, self._sms[call.device])
        return CupyPending(call)

    def expert_group(
        self,
        experts: Sequence[ExpertTriple],
        rows: Sequence[int],
        x: np.ndarray,
        lend: bool = False,
    ) -> Result:
        res = self._kept(experts[0][0].device, x.nbytes, "expert_group",
                         expert_group.group_kept, experts, rows, x, lend=lend)  # fmt: skip
        return res if res is not None else self.expert_group_issue(experts, rows, x).result()

    def expert_group_routed(
        self,
        experts: Sequence[ExpertTriple],
        x: np.ndarray,
        routes: np.ndarray,
        weights: np.ndarray,
    ) -> Result:
        device = experts[0][0].device
        res = self._kept(device, x.nbytes, "expert_group_routed", expert_group.routed_kept,
                         experts, x, routes, weights)  # fmt: skip
        if res is not None:
            return res
        with Call(self, device, "expert_group_routed") as call:
            return expert_group.routed(call, experts, x, routes, weights, self._sms[device])

    # -- MLA attention (host side: kernels/attention_call.py) --------------------------------

    def new_kv(self, device: int, k: int, r: int) -> CupyKVCache:
        return CupyKVCache(self, device, k, r)

    def _check_kr(self, k: int, r: int) -> None:
        if k + r > att.MAX_KR:
            raise InvalidArgument(
                f"attention: expected K + R <= {att.MAX_KR} (kv_lora + rope), got {k + r}"
            )

    def attention(
        self,
        kv_b: CupyResident,
        o_proj: CupyResident | None,
        q: np.ndarray,
        latent: np.ndarray,
        rope: np.ndarray,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
    ) -> Result:
        self._check_kr(kv_b.in_features, rope_dim)
        with Call(self, kv_b.device, "attention") as call:
            n_sm = self._sms[call.device]
            return attention_call.run(call, kv_b, o_proj, q, None, (), max(latent.shape[0], 1),
                                      q_dim, rope_dim, v_dim, scale, [latent], [rope],
                                      n_sm)  # fmt: skip

    def attention_ragged(
        self,
        kv_b: CupyResident,
        o_proj: CupyResident | None,
        q: np.ndarray,
        caches: Sequence[CupyKVCache],
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        rows: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> Result:
        """The new rows travel in the call's one upload; absorb's launch writes them into their
        caches before the attention kernels read them, and the lengths advance once the call
        has succeeded."""
        self._check_kr(kv_b.in_features, rope_dim)
        lats: list[np.ndarray] = []
        ropes: list[np.ndarray] = []
        if rows is None:
            fresh = [0] * len(caches)
        else:  # one pass over the rows (a decode call's host time: no comprehensions)
            fresh = []
            for lat, rop in rows:
                fresh.append(len(lat))
                lats.append(lat)
                ropes.append(rop)
        t_max = 1
        for c, n in zip(caches, fresh, strict=True):
            if n:
                c.reserve(n)
            if c.length + n > t_max:
                t_max = c.length + n
        device = kv_b.device
        n_sm = self._sms[device]
        res = self._kept(device, q.nbytes, "attention_ragged", attention_call.run_kept, kv_b,
                         o_proj, q, caches, fresh, t_max, q_dim, rope_dim, v_dim, scale, lats,
                         ropes, n_sm)  # fmt: skip
        if res is None:
            with Call(self, device, "attention_ragged") as call:
                res = attention_call.run(call, kv_b, o_proj, q, caches, fresh, t_max, q_dim,
                                         rope_dim, v_dim, scale, lats, ropes, n_sm)  # fmt: skip
        for i, c in enumerate(caches):  # (as many as fresh: the zip above checked)
            c.length += fresh[i]
        return res

    def close(self) -> None:
        self._local = threading.local()  # this thread's arenas go with it
        for d in self._devices:
            with cupy.cuda.Device(d):
                cupy.cuda.Device(d).synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
