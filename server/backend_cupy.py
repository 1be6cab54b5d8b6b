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
from coliworker.kernels.matmul import (
    JOB_DTYPE,
    WeightSpec,
    counter_bytes,
    prepare_gemv,
    prepare_moe,
)
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
        # Made once: the per-call planning compares and hashes specs.
        self.spec = WeightSpec(self.fmt, self.in_features, self.group_size, self.layout)
        self.ptrs = (w.data.ptr, s.data.ptr)  # stable: replace() writes in place

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

    def packed(self, layout: Sequence[tuple[tuple[int, ...], object]]) -> _Packed:
        """One device buffer and one pinned buffer for several arrays: one H2D copy."""
        return _Packed(self, layout)

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


class _Packed:
    """Arrays of one call packed into one device buffer (256-byte aligned parts) with a pinned
    host twin, so the whole H2D phase is one copy; ``dev(i)`` is known before ``send()``, which
    lets job tables hold pointers into the same buffer."""

    def __init__(self, call: _Call, layout: Sequence[tuple[tuple[int, ...], object]]) -> None:
        self._call = call
        self._parts = []
        off = 0
        for shape, dtype in layout:
            dt = np.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            self._parts.append((off, n, tuple(shape), dt))
            off += -(-max(n, 1) // 256) * 256
        self._dev = call.empty((off,), cupy.uint8)
        self._host = cupyx.empty_pinned((off,), np.uint8)
        call.keep.append(self._host)

    def dev(self, i: int) -> cupy.ndarray:
        """Part i on the device; record (structured) parts as raw uint8 bytes."""
        off, n, shape, dt = self._parts[i]
        if dt.names is not None:
            return self._dev[off : off + n]
        return self._dev[off : off + n].view(dt).reshape(shape)

    def ptr(self, i: int) -> int:
        return self._dev.data.ptr + self._parts[i][0]

    def put(self, i: int, a: np.ndarray) -> None:
        """Fill part i (or, for byte parts, a prefix of it) from host array a."""
        off, n, _, dt = self._parts[i]
        b = np.ascontiguousarray(a, dt).view(np.uint8).reshape(-1)
        if b.size > n:
            raise ValueError(f"packed part {i}: {b.size} bytes do not fit {n}")
        self._host[off : off + b.size] = b

    def send(self) -> None:
        self._dev.set(self._host, stream=self._call.stream)


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


def _table_bound(n_experts: int) -> int:
    """Bytes that hold any group's tables: per expert at most one moe record (88) and its share
    of a counter block (4 + 15 padding + 4 for the queue slot), or three gemv records (192)."""
    return 192 * n_experts + 64


_silu_mul = cupy.ElementwiseKernel(
    "float32 g, float32 u", "float32 h", "h = g / (1.f + expf(-g)) * u", "coli_silu_mul"
)


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
            pk = call.packed([((S, w.in_features), np.float32), ((1,), JOB_DTYPE)])
            y_dev = call.empty((S, w.out_features))
            jobs = np.zeros(1, JOB_DTYPE)
            jobs[0] = (*w.row_ptrs(0), 0, 0, pk.ptr(0), y_dev.data.ptr, S,
                       w.out_features, w.in_features, w.out_features)  # fmt: skip
            pk.put(0, x)
            pk.put(1, jobs)
            go = prepare_gemv(w.spec, pk.dev(1), 1, S, w.out_features)
            call.mark(0)
            pk.send()
            call.mark(1)
            go()
            call.mark(2)
            out = call.d2h(y_dev)
            call.mark(3)
            return call.finish(out)

    def expert_mlp(
        self, gate: CupyResident, up: CupyResident, down: CupyResident, x: np.ndarray
    ) -> Result:
        return self.expert_group([(gate, up, down)], [x.shape[0]], x)

    # -- expert groups -----------------------------------------------------------------------
    #
    # Experts whose gate and up share one spec (format, size, group size) and whose down has the
    # same format run in ONE persistent moe launch per (gate/up spec, down spec) combination:
    # one launch for a model's usual group. Any other expert (gate and up of different formats
    # or group sizes, say) runs unfused and still exact: gate and up as separate gemv jobs, silu
    # times up elementwise, then down as a gemv job.

    def _group_tables(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x_ptr: int, y_ptr: int,
        h_ptr: int, hu_ptr: int,
    ) -> tuple[np.ndarray, list[tuple]]:  # fmt: skip
        """Host bytes of every table of a group and the launches that read them (at offsets).

        x float32 [N, D] packed rows at x_ptr, y [N, dout] at y_ptr, hidden [sum rows*ie] at
        h_ptr (and up's, for unfused experts, at hu_ptr). Launch tuples:
        ("moe", gu, dn, offset, n, max_rows, max_ie, max_dout) or
        ("gemv", spec, offset, n, max_rows, max_out) or ("silu_mul", floats): the unfused
        experts' h = silu(h) * hu, over the whole hidden buffer (the fused experts' part of it
        is dead by then: their moe launches come first and consume it).
        """
        D = experts[0][0].in_features
        fused: dict[tuple, list[int]] = {}
        unfused: list[int] = []
        for c, (g, u, dn) in enumerate(experts):
            if g.spec == u.spec and dn.fmt == g.fmt:
                fused.setdefault((g.spec, dn.spec), []).append(c)
            else:
                unfused.append(c)
        row_off = np.zeros(len(experts) + 1, np.int64)
        row_off[1:] = np.cumsum([int(r) for r in rows])
        hid = [int(r) * g.out_features for (g, _, _), r in zip(experts, rows, strict=True)]
        hid_off = np.zeros(len(experts) + 1, np.int64)
        hid_off[1:] = np.cumsum(hid)
        dout = experts[0][2].out_features
        chunks: list[np.ndarray] = []
        launches: list[tuple] = []
        pos = 0

        def add(b: np.ndarray) -> int:
            nonlocal pos
            start = pos
            chunks.append(b)
            pad = -len(b) % 16
            if pad:
                chunks.append(np.zeros(pad, np.uint8))
            pos += len(b) + pad
            return start

        for (gu, dn), cs in fused.items():
            # MoeJob records as rows of 10 uint64 (the int32 pairs packed low word first).
            recs = []
            for c in cs:
                g, u, d = experts[c]
                r = int(rows[c])
                recs.append((*g.ptrs, *u.ptrs, *d.ptrs, x_ptr + int(row_off[c]) * D * 4,
                             h_ptr + int(hid_off[c]) * 4, y_ptr + int(row_off[c]) * dout * 4,
                             r | (g.out_features << 32), d.out_features))  # fmt: skip
            t = np.array(recs, np.uint64)
            off = add(np.zeros(counter_bytes(len(cs)), np.uint8))
            add(t.view(np.uint8).reshape(-1))
            launches.append(("moe", gu, dn, off, len(cs), int(max(rows[c] for c in cs)),
                             max(experts[c][0].out_features for c in cs),
                             max(experts[c][2].out_features for c in cs)))  # fmt: skip
        if unfused:
            first: dict[WeightSpec, list[tuple]] = {}
            second: dict[WeightSpec, list[tuple]] = {}
            for c in unfused:
                g, u, d = experts[c]
                r, ie = int(rows[c]), g.out_features
                xp = x_ptr + int(row_off[c]) * D * 4
                hg = h_ptr + int(hid_off[c]) * 4
                hu = hu_ptr + int(hid_off[c]) * 4
                first.setdefault(g.spec, []).append((*g.ptrs, 0, 0, xp, hg, r, ie, D, ie))
                first.setdefault(u.spec, []).append((*u.ptrs, 0, 0, xp, hu, r, ie, D, ie))
                second.setdefault(d.spec, []).append(
                    (
                        *d.ptrs,
                        0,
                        0,
                        hg,
                        y_ptr + int(row_off[c]) * dout * 4,
                        r,
                        d.out_features,
                        ie,
                        dout,
                    )  # fmt: skip
                )
            for phase in (first, second):
                for spec, recs in phase.items():
                    t = np.array(recs, JOB_DTYPE)
                    off = add(t.view(np.uint8))
                    launches.append(("gemv", spec, off, len(recs), int(t["rows"].max()),
                                     int(t["out_rows"].max())))  # fmt: skip
                if phase is first:
                    launches.append(("silu_mul", int(hid_off[-1])))
        table = np.concatenate(chunks) if chunks else np.zeros(16, np.uint8)
        return table, launches

    def _prepare_group(
        self, call: _Call, table: cupy.ndarray, launches: list[tuple], h: cupy.ndarray,
        hu: cupy.ndarray | None,
    ) -> list:  # fmt: skip
        """The calls that launch a group's kernels, in order (host work done here)."""
        calls = []
        for ln in launches:
            if ln[0] == "moe":
                _, gu, dn, off, n, max_rows, max_ie, max_dout = ln
                calls.append(prepare_moe(gu, dn, table[off:], n, max_rows, max_ie, max_dout,
                                         self._sms[call.device]))  # fmt: skip
            elif ln[0] == "gemv":
                _, spec, off, n, max_rows, max_out = ln
                calls.append(prepare_gemv(spec, table[off:], n, max_rows, max_out))
            else:
                k = ln[1]
                calls.append(lambda k=k: _silu_mul(h[:k], hu[:k], h[:k]))
        return calls

    def _group_buffers(
        self, call: _Call, experts: Sequence[ExpertTriple], rows: Sequence[int]
    ) -> tuple[cupy.ndarray, cupy.ndarray | None, cupy.ndarray]:
        n_hid = max(
            sum(int(r) * g.out_features for (g, _, _), r in zip(experts, rows, strict=True)), 1
        )
        h = call.empty((n_hid,))
        mixed = any(not (g.spec == u.spec and d.fmt == g.fmt) for g, u, d in experts)
        hu = call.empty((n_hid,)) if mixed else None
        n = max(int(sum(int(r) for r in rows)), 1)
        y = call.empty((n, experts[0][2].out_features))
        return h, hu, y

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> CupyPending:
        device = experts[0][0].device
        N, D = x.shape
        with _Call(self, device, "expert_group") as call:
            h, hu, y_dev = self._group_buffers(call, experts, rows)
            size = _table_bound(len(experts))
            pk = call.packed([((N, D), np.float32), ((size,), np.uint8)])
            table, launches = self._group_tables(
                experts, rows, pk.ptr(0), y_dev.data.ptr, h.data.ptr,
                hu.data.ptr if hu is not None else 0,
            )  # fmt: skip
            pk.put(0, x)
            pk.put(1, table)
            calls = self._prepare_group(call, pk.dev(1), launches, h, hu)
            call.mark(0)
            pk.send()
            call.mark(1)
            for go in calls:
                go()
            call.mark(2)
            out = call.d2h(y_dev[:N])
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
        sel = [experts[e] for e in used]
        rows = [int(counts[e]) for e in used]
        d_out = experts[0][2].out_features
        with _Call(self, device, "expert_group_routed") as call:
            xp_dev = call.empty((T * K, D))
            h, hu, yp_dev = self._group_buffers(call, sel, rows)
            size = _table_bound(len(sel))
            pk = call.packed([((T, D), np.float32), ((size,), np.uint8), ((T * K,), np.int64),
                              ((T * K,), np.int64), ((T, K), np.float32)])  # fmt: skip
            table, launches = self._group_tables(
                sel, rows, xp_dev.data.ptr, yp_dev.data.ptr, h.data.ptr,
                hu.data.ptr if hu is not None else 0,
            )  # fmt: skip
            pk.put(0, x)
            pk.put(1, table)
            pk.put(2, order // K)
            pk.put(3, pos)
            pk.put(4, weights)
            calls = self._prepare_group(call, pk.dev(1), launches, h, hu)
            call.mark(0)
            pk.send()
            call.mark(1)
            cupy.take(pk.dev(0), pk.dev(2), axis=0, out=xp_dev)
            for go in calls:
                go()
            y_dev = (yp_dev[pk.dev(3)].reshape(T, K, d_out) * pk.dev(4)[:, :, None]).sum(axis=1)
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
        uploads: list[np.ndarray],
    ) -> Result:
        S, H = q.shape[0], q.shape[1]
        K, R, V = kv_b.in_features, rope_dim, v_dim
        n_jobs = H + (o_proj is not None)
        parts = [((S, H, q_dim + R), np.float32), ((len(descs),), att.KV_DTYPE),
                 ((n_jobs,), JOB_DTYPE)]  # fmt: skip
        pk = call.packed(parts + [(a.shape, np.float32) for a in uploads])
        if uploads:  # batch attention: its cache rows travel in the same upload
            descs = descs.copy()
            descs["latent"], descs["rope"] = pk.ptr(3), pk.ptr(4)
            pk.put(3, uploads[0])
            pk.put(4, uploads[1])
        qfull = call.empty((S, H, K + R))
        cl = call.empty((H, S, K))
        ctx = call.empty((S, H * V))
        jobs = _pointer_table(n_jobs)
        w0, s0 = kv_b.row_ptrs(q_dim)
        h_idx = np.arange(H, dtype=np.uint64)
        w_stride = np.uint64((q_dim + V) * kv_b.layout.ld)
        s_stride = np.uint64((q_dim + V) * kv_b.layout.ngp * 4 if kv_b.fmt else 0)
        jobs["w0"][:H] = np.uint64(w0) + h_idx * w_stride
        jobs["s0"][:H] = np.uint64(s0) + h_idx * s_stride
        jobs["x"][:H] = np.uint64(cl.data.ptr) + h_idx * np.uint64(S * K * 4)
        jobs["y"][:H] = np.uint64(ctx.data.ptr) + h_idx * np.uint64(V * 4)
        jobs["rows"][:H], jobs["out_rows"][:H] = S, V
        jobs["x_stride"][:H], jobs["y_stride"][:H] = K, H * V
        if o_proj is not None:
            out_dev = call.empty((S, o_proj.out_features))
            jobs[H] = (*o_proj.row_ptrs(0), 0, 0, ctx.data.ptr, out_dev.data.ptr, S,
                       o_proj.out_features, H * V, o_proj.out_features)  # fmt: skip
        else:
            out_dev = ctx
        pk.put(0, q)
        pk.put(1, descs)
        pk.put(2, jobs)
        value = prepare_gemv(kv_b.spec, pk.dev(2), H, S, V)
        proj = (
            prepare_gemv(
                o_proj.spec, pk.dev(2)[H * JOB_DTYPE.itemsize :], 1, S, o_proj.out_features
            )  # fmt: skip
            if o_proj is not None
            else None
        )
        call.mark(0)
        pk.send()
        call.mark(1)
        att.absorb(qfull, pk.dev(0), kv_b.w, kv_b.s, kv_b.spec, H, q_dim, R, V)
        att.attend(cl, qfull, pk.dev(1), H, K, R, scale, t_max, self._sms[call.device])
        value()
        if proj is not None:
            proj()
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
            descs = np.zeros(S, att.KV_DTYPE)
            descs["len"] = T - S + 1 + np.arange(S)
            uploads = [
                np.ascontiguousarray(latent, np.float32),
                np.ascontiguousarray(rope, np.float32),
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
