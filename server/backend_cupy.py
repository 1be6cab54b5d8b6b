"""The CuPy backend: resident quantized weights, MLA KV caches and kernels on CUDA devices.

Weights are re-laid out on the device at place time (``kernels/layout.py``); a call moves only
its activations: one H2D phase (activations and the per-call job / descriptor tables), the
kernels, one D2H phase, timed with CUDA events.

Concurrency: every thread gets its own non-blocking stream per device, and every per-call
buffer (device and pinned) is allocated for that call from CuPy's pools and held by the call
until its result is on the host, so calls from a thread pool, calls on several devices and
outstanding ``expert_group_issue`` results never share mutable scratch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import cupy
import cupyx
import numpy as np

from coliworker.kernels import attention as att
from coliworker.kernels import layout
from coliworker.kernels.matmul import JOB_DTYPE, WeightSpec, launch_gemv
from coliworker.kernels.qtensor import QTensor
from coliworker.server.backend import DeviceInfo, ExpertTriple, Phases, Result
from coliworker.server.errors import InvalidArgument, OutOfDeviceMemory

KV_PAGE_ROWS = 256


@contextlib.contextmanager
def _oom_guard(device: int, what: str) -> Iterator[None]:
    """Turn CuPy's device / pinned out-of-memory errors into OutOfDeviceMemory."""
    try:
        yield
    except cupy.cuda.memory.OutOfMemoryError as exc:
        raise OutOfDeviceMemory(f"{what}: device {device} is out of memory ({exc})") from None
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        if "MemoryAllocation" in str(exc):
            raise OutOfDeviceMemory(
                f"{what}: device {device} (or pinned host memory) is out of memory ({exc})"
            ) from None
        raise


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

    @property
    def spec(self) -> WeightSpec:
        return WeightSpec(self.fmt, self.in_features, self.group_size, self.layout)

    def row_ptrs(self, row: int) -> tuple[int, int]:
        """Device addresses of row ``row``'s weights and scales."""
        s_stride = self.layout.ngp * 4 if self.fmt else 0
        return self.w.data.ptr + row * self.layout.ld, self.s.data.ptr + row * s_stride


class CupyKVCache:
    """Device-resident latent [cap, K] / rope [cap, R] float32, grown by pages (copy on grow)."""

    def __init__(self, backend: CupyBackend, device: int, k: int, r: int) -> None:
        self._backend = backend
        self.device = device
        self.k, self.r = k, r
        self.length = 0
        self.cap = 0
        self.latent: cupy.ndarray | None = None
        self.rope: cupy.ndarray | None = None

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
            with _oom_guard(self.device, f"kv cache growth to {cap} rows"):
                lat = cupy.empty((cap, self.k), cupy.float32)
                rop = cupy.empty((cap, self.r), cupy.float32)
            if self.length:
                lat[: self.length] = self.latent[: self.length]
                rop[: self.length] = self.rope[: self.length]
            stream.synchronize()
        self.latent, self.rope, self.cap = lat, rop, cap

    def append(self, latent: np.ndarray, rope: np.ndarray) -> None:
        n = latent.shape[0]
        if n == 0:
            return
        if self.length + n > self.cap:
            self._grow(self.length + n)
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


class _Call:
    """One call's stream, events and buffers; the buffers live until the result is read."""

    def __init__(self, backend: CupyBackend, device: int, what: str) -> None:
        self.device = device
        self.what = what
        self.stream = backend._stream(device)
        self.keep: list[object] = []
        self.events = [cupy.cuda.Event() for _ in range(4)]
        self._dev = cupy.cuda.Device(device)

    def __enter__(self) -> _Call:
        self._dev.__enter__()
        self.stream.__enter__()
        self._guard = _oom_guard(self.device, self.what)
        self._guard.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._guard.__exit__(*exc)
        finally:
            self.stream.__exit__(*exc)
            self._dev.__exit__(*exc)

    def empty(self, shape: tuple[int, ...], dtype: object = cupy.float32) -> cupy.ndarray:
        a = cupy.empty(shape, dtype)
        self.keep.append(a)
        return a

    def h2d(self, dst: cupy.ndarray, host: np.ndarray) -> None:
        pinned = cupyx.empty_pinned(host.shape, host.dtype)
        pinned[...] = host
        dst.set(pinned, stream=self.stream)
        self.keep.append(pinned)

    def d2h(self, src: cupy.ndarray) -> np.ndarray:
        out = cupyx.empty_pinned(src.shape, src.dtype)
        src.get(stream=self.stream, out=out)
        self.keep.append(out)
        return out

    def mark(self, i: int) -> None:
        self.events[i].record(self.stream)

    def finish(self, out: np.ndarray) -> Result:
        ev = self.events
        ev[3].synchronize()

        def ns(a: int, b: int) -> int:
            return int(cupy.cuda.get_elapsed_time(ev[a], ev[b]) * 1e6)

        result = Result(np.array(out, copy=True), Phases(ns(0, 1), ns(1, 2), ns(2, 3)))
        self.keep.clear()
        return result


class CupyPending:
    """An expert group in flight on its own stream and buffers."""

    def __init__(self, call: _Call, out: np.ndarray) -> None:
        self._call, self._out = call, out
        self._result: Result | None = None

    def result(self) -> Result:
        if self._result is None:
            with cupy.cuda.Device(self._call.device):
                self._result = self._call.finish(self._out)
        return self._result


def _pointer_table(n: int) -> np.ndarray:
    return np.zeros(n, JOB_DTYPE)


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

    # -- devices and streams ---------------------------------------------------------------

    def _stream(self, device: int) -> cupy.cuda.Stream:
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        s = streams.get(device)
        if s is None:
            with cupy.cuda.Device(device):
                s = streams[device] = cupy.cuda.Stream(non_blocking=True)
        return s

    def devices(self) -> list[DeviceInfo]:
        out = []
        for d in self._devices:
            with cupy.cuda.Device(d):
                free, total = cupy.cuda.runtime.memGetInfo()
                name = cupy.cuda.runtime.getDeviceProperties(d)["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            out.append(DeviceInfo(d, name, total, free))
        return out

    # -- resident tensors ------------------------------------------------------------------

    def _layout_on_device(self, tensor: QTensor, device: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        stream = self._stream(device)
        with cupy.cuda.Device(device), stream:
            with _oom_guard(device, f"place {tensor.nbytes} bytes"):
                raw = cupy.asarray(tensor.weights)
                w = layout.relayout(cupy, tensor, raw)
                s = layout.scales(cupy, tensor, cupy.asarray(tensor.scales))
                stream.synchronize()
        return w, s

    def place(self, tensor: QTensor, device: int) -> CupyResident:
        w, s = self._layout_on_device(tensor, device)
        return CupyResident(tensor, device, w, s)

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

    # -- dense products ----------------------------------------------------------------------

    def matmul(self, w: CupyResident, x: np.ndarray) -> Result:
        S = x.shape[0]
        with _Call(self, w.device, "matmul") as call:
            x_dev = call.empty((S, w.in_features))
            y_dev = call.empty((S, w.out_features))
            jobs = _pointer_table(1)
            jobs[0] = (*w.row_ptrs(0), 0, 0, x_dev.data.ptr, y_dev.data.ptr, S,
                       w.out_features, w.in_features, w.out_features)  # fmt: skip
            jobs_dev = call.empty((jobs.nbytes,), cupy.uint8)
            call.mark(0)
            call.h2d(x_dev, np.ascontiguousarray(x, np.float32))
            call.h2d(jobs_dev, jobs.view(np.uint8))
            call.mark(1)
            launch_gemv(w.spec, jobs_dev, 1, S, w.out_features, dual=False)
            call.mark(2)
            out = call.d2h(y_dev)
            call.mark(3)
            return call.finish(out)

    def expert_mlp(
        self, gate: CupyResident, up: CupyResident, down: CupyResident, x: np.ndarray
    ) -> Result:
        return self.expert_group([(gate, up, down)], [x.shape[0]], x)

    # -- expert groups -----------------------------------------------------------------------

    def _group_on_device(
        self, call: _Call, experts: Sequence[ExpertTriple], rows: Sequence[int],
        x_dev: cupy.ndarray, y_dev: cupy.ndarray,
    ) -> tuple[list[tuple[WeightSpec, int, int, int, int, bool]], np.ndarray]:  # fmt: skip
        """Device buffers and job tables of a group; returns the launches to make and the host
        job table (uploaded by the caller in its H2D phase)."""
        n = len(experts)
        D = x_dev.shape[1]
        hid_sizes = [int(r) * g.out_features for (g, _, _), r in zip(experts, rows, strict=True)]
        h_dev = call.empty((max(sum(hid_sizes), 1),))
        jobs = _pointer_table(2 * n)
        by_spec_gu: dict[tuple, list[int]] = {}
        by_spec_dn: dict[tuple, list[int]] = {}
        row_off = hid_off = 0
        for c, ((g, u, dn), r) in enumerate(zip(experts, rows, strict=True)):
            r = int(r)
            ie = g.out_features
            gw, gs_ = g.row_ptrs(0)
            uw, us = u.row_ptrs(0)
            x_ptr = x_dev.data.ptr + row_off * D * 4
            h_ptr = h_dev.data.ptr + hid_off * 4
            jobs[c] = (gw, gs_, uw, us, x_ptr, h_ptr, r, ie, D, ie)
            dw, ds = dn.row_ptrs(0)
            y_ptr = y_dev.data.ptr + row_off * dn.out_features * 4
            jobs[n + c] = (dw, ds, 0, 0, h_ptr, y_ptr, r, dn.out_features, ie, dn.out_features)
            by_spec_gu.setdefault((g.spec, u.spec), []).append(c)
            by_spec_dn.setdefault(dn.spec, []).append(n + c)
            row_off += r
            hid_off += hid_sizes[c]
        # Jobs sharing a spec are contiguous in the table after this reorder.
        order = [j for js in by_spec_gu.values() for j in js] + [
            j for js in by_spec_dn.values() for j in js
        ]
        jobs = jobs[order]
        launches = []
        start = 0
        for (spec, _), js in by_spec_gu.items():
            sel = jobs[start : start + len(js)]
            launches.append((spec, start, len(js), int(sel["rows"].max()),
                             int(sel["out_rows"].max()), True))  # fmt: skip
            start += len(js)
        for spec, js in by_spec_dn.items():
            sel = jobs[start : start + len(js)]
            launches.append((spec, start, len(js), int(sel["rows"].max()),
                             int(sel["out_rows"].max()), False))  # fmt: skip
            start += len(js)
        return launches, jobs

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> CupyPending:
        device = experts[0][0].device
        N = int(sum(int(r) for r in rows))
        D = x.shape[1]
        d_out = experts[0][2].out_features
        with _Call(self, device, "expert_group") as call:
            x_dev = call.empty((N, D))
            y_dev = call.empty((N, d_out))
            launches, jobs = self._group_on_device(call, experts, rows, x_dev, y_dev)
            jobs_dev = call.empty((jobs.nbytes,), cupy.uint8)
            call.mark(0)
            call.h2d(x_dev, np.ascontiguousarray(x, np.float32))
            call.h2d(jobs_dev, jobs.view(np.uint8))
            call.mark(1)
            for spec, start, count, max_rows, max_out, dual in launches:
                table = jobs_dev[start * JOB_DTYPE.itemsize :]
                launch_gemv(spec, table, count, max_rows, max_out, dual)
            call.mark(2)
            out = call.d2h(y_dev)
            call.mark(3)
        return CupyPending(call, out)

    def expert_group(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> Result:
        return self.expert_group_issue(experts, rows, x).result()

    def expert_group_routed(
        self,
        experts: Sequence[ExpertTriple],
        x: np.ndarray,
        routes: np.ndarray,
        weights: np.ndarray,
    ) -> Result:
        device = experts[0][0].device
        T, K = routes.shape
        D = x.shape[1]
        flat = np.ascontiguousarray(routes, np.int64).reshape(-1)
        order = np.argsort(flat, kind="stable")  # packed row p holds (t, j) = divmod(order[p], K)
        counts = np.bincount(flat, minlength=len(experts))
        used = [e for e in range(len(experts)) if counts[e]]
        pos = np.empty(T * K, np.int64)
        pos[order] = np.arange(T * K)
        with _Call(self, device, "expert_group_routed") as call:
            x_dev = call.empty((T, D))
            tok_dev = call.empty((T * K,), cupy.int64)
            pos_dev = call.empty((T * K,), cupy.int64)
            w_dev = call.empty((T, K))
            xp_dev = call.empty((T * K, D))
            d_out = experts[0][2].out_features
            yp_dev = call.empty((T * K, d_out))
            sel = [experts[e] for e in used]
            launches, jobs = self._group_on_device(
                call, sel, [int(counts[e]) for e in used], xp_dev, yp_dev
            )
            jobs_dev = call.empty((jobs.nbytes,), cupy.uint8)
            call.mark(0)
            call.h2d(x_dev, np.ascontiguousarray(x, np.float32))
            call.h2d(tok_dev, order // K)
            call.h2d(pos_dev, pos)
            call.h2d(w_dev, np.ascontiguousarray(weights, np.float32))
            call.h2d(jobs_dev, jobs.view(np.uint8))
            call.mark(1)
            cupy.take(x_dev, tok_dev, axis=0, out=xp_dev)
            for spec, start, count, max_rows, max_out, dual in launches:
                table = jobs_dev[start * JOB_DTYPE.itemsize :]
                launch_gemv(spec, table, count, max_rows, max_out, dual)
            y_dev = (yp_dev[pos_dev].reshape(T, K, d_out) * w_dev[:, :, None]).sum(axis=1)
            call.keep.append(y_dev)
            call.mark(2)
            out = call.d2h(y_dev)
            call.mark(3)
            return call.finish(out)

    # -- MLA attention -----------------------------------------------------------------------

    def new_kv(self, device: int, k: int, r: int) -> CupyKVCache:
        return CupyKVCache(self, device, k, r)

    def _attention(
        self,
        call: _Call,
        kv_b: CupyResident,
        o_proj: CupyResident | None,
        q: np.ndarray,
        descs: np.ndarray,
        t_max: int,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        uploads: list[tuple[cupy.ndarray, np.ndarray]],
    ) -> Result:
        S, H = q.shape[0], q.shape[1]
        K, R, V = kv_b.in_features, rope_dim, v_dim
        q_dev = call.empty((S, H, q_dim + R))
        kv_dev = call.empty((descs.nbytes,), cupy.uint8)
        qfull = call.empty((S, H, K + R))
        cl = call.empty((H, S, K))
        ctx = call.empty((S, H * V))
        jobs = _pointer_table(H)
        for h in range(H):
            w, s = kv_b.row_ptrs(h * (q_dim + V) + q_dim)
            jobs[h] = (w, s, 0, 0, cl.data.ptr + h * S * K * 4, ctx.data.ptr + h * V * 4,
                       S, V, K, H * V)  # fmt: skip
        n_tables = 1
        if o_proj is not None:
            out_dev = call.empty((S, o_proj.out_features))
            pj = _pointer_table(1)
            pj[0] = (*o_proj.row_ptrs(0), 0, 0, ctx.data.ptr, out_dev.data.ptr, S,
                     o_proj.out_features, H * V, o_proj.out_features)  # fmt: skip
            jobs = np.concatenate([jobs, pj])
            n_tables = 2
        else:
            out_dev = ctx
        jobs_dev = call.empty((jobs.nbytes,), cupy.uint8)
        call.mark(0)
        call.h2d(q_dev, np.ascontiguousarray(q, np.float32))
        call.h2d(kv_dev, descs.view(np.uint8))
        call.h2d(jobs_dev, jobs.view(np.uint8))
        for dst, src in uploads:
            call.h2d(dst, src)
        call.mark(1)
        att.absorb(qfull, q_dev, kv_b.w, kv_b.s, kv_b.spec, H, q_dim, R, V)
        att.attend(cl, qfull, kv_dev, H, K, R, scale, t_max, self._sms[call.device])
        launch_gemv(kv_b.spec, jobs_dev, H, S, V, dual=False)
        if n_tables == 2:
            launch_gemv(o_proj.spec, jobs_dev[H * JOB_DTYPE.itemsize :], 1, S,
                        o_proj.out_features, dual=False)  # fmt: skip
        call.mark(2)
        out = call.d2h(out_dev)
        call.mark(3)
        res = call.finish(out)
        if o_proj is None:
            res.out = res.out.reshape(S, H, V)
        return res

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
        S, T = q.shape[0], latent.shape[0]
        with _Call(self, kv_b.device, "attention") as call:
            lat = call.empty((T, kv_b.in_features))
            rop = call.empty((T, rope_dim))
            descs = np.zeros(S, att.KV_DTYPE)
            descs["latent"] = lat.data.ptr
            descs["rope"] = rop.data.ptr
            descs["len"] = T - S + 1 + np.arange(S)
            uploads = [
                (lat, np.ascontiguousarray(latent, np.float32)),
                (rop, np.ascontiguousarray(rope, np.float32)),
            ]
            return self._attention(call, kv_b, o_proj, q, descs, T, q_dim, rope_dim, v_dim,
                                   scale, uploads)  # fmt: skip

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
    ) -> Result:
        self._check_kr(kv_b.in_features, rope_dim)
        S = q.shape[0]
        descs = np.zeros(S, att.KV_DTYPE)
        for s, c in enumerate(caches):
            if c.latent is not None and c.length:
                descs[s] = (c.latent.data.ptr, c.rope.data.ptr, c.length, 0)
        t_max = max((c.length for c in caches), default=0)
        with _Call(self, kv_b.device, "attention_ragged") as call:
            return self._attention(call, kv_b, o_proj, q, descs, max(t_max, 1), q_dim,
                                   rope_dim, v_dim, scale, [])  # fmt: skip

    def close(self) -> None:
        for d in self._devices:
            with cupy.cuda.Device(d):
                cupy.cuda.Device(d).synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
