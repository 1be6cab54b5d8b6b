"""The CuPy backend: resident quantized weights, MLA KV caches and kernels on CUDA devices.

Weights are re-laid out on the device at place time (``kernels/layout.py``); a call moves only
its activations: one H2D phase (activations and the per-call job / descriptor tables), the
kernels, one D2H phase, timed with CUDA events.

Host time per call is kept near the floor: every buffer of a call lies in one reusable arena
(``server/cupy_calls.py``: arenas, the call context, pinned copies, registered segments); job
tables are packed straight into the pinned inputs (``kernels/tables.py``); launches are
prepared once per shape (``kernels/launch.py``). What stays on a device (weights, tensors
arriving block by block, KV caches) is in ``server/cupy_residents.py``.

Concurrency: every thread gets its own non-blocking stream per device and its own pool of
arenas; a call holds its arena until its result is on the host, so calls from a thread pool,
calls on several devices and outstanding ``expert_group_issue`` results never share mutable
scratch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import cupy
import cupyx
import numpy as np

from coliworker.kernels import attention as att
from coliworker.kernels import layout, route
from coliworker.kernels import matmul as mm
from coliworker.kernels.matmul import gemv_launch, moe_launch
from coliworker.kernels.qtensor import QTensor
from coliworker.kernels.tables import (
    GEMV_JOB,
    KV_DESC,
    counter_bytes,
    plan_group,
    route_plan,
    write_group,
)
from coliworker.server.backend import DeviceInfo, ExpertTriple, Result
from coliworker.server.cupy_calls import (
    PLANS_PER_ARENA,
    Arena,
    Call,
    CupyPending,
    HostSegments,
    align,
    oom_guard,
    put_host,
    stack_into,
)
from coliworker.server.cupy_residents import CupyKVCache, CupyPlacement, CupyResident
from coliworker.server.errors import InvalidArgument

if TYPE_CHECKING:
    from coliworker.wire.shm import Segment

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
        self._jobs_cache: dict[tuple, bytes] = {}
        self._names: dict[int, str] = {}
        self._segments = HostSegments(self._devices)

    # -- shared-memory segments --------------------------------------------------------------

    def attach_segment(self, seg: Segment) -> None:
        """A session mapped ``seg`` (``server/session.py``): large float32 inputs in it go to the
        device straight from it once registered (``cupy_calls.HostSegments``)."""
        self._segments.attach(seg)

    def _registered(self, ptr: int, n: int) -> bool:
        return self._segments.registered(ptr, n)

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

    def _arenas(self, device: int) -> list[Arena]:
        """This thread's free arenas of ``device``."""
        try:
            return self._local.arenas[device]
        except AttributeError:
            self._local.arenas = {}
        except KeyError:
            pass
        pool: list[Arena] = []
        self._local.arenas[device] = pool
        return pool

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
        return cupyx.empty_pinned((nbytes,), np.uint8)

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
        s, n_in = x.shape
        n_out = w.out_features
        xb = 4 * s * n_in
        j_off = align(xb)
        y_off = align(j_off + GEMV_JOB.size)
        with Call(self, w.device, "matmul") as call:
            go = gemv_launch(w.spec, 1, s, n_out)
            a = call.reserve(y_off + 4 * s * n_out, y_off + 4 * s * n_out)
            call.put(0, x, xb)
            GEMV_JOB.pack_into(a.host, j_off, *w.ptrs, 0, 0, a.dptr, a.dptr + y_off, s, n_out,
                               n_in, n_out)  # fmt: skip
            call.mark(0)
            call.send(j_off + GEMV_JOB.size)
            call.mark(1)
            if go is not None:
                call.launch(go, np.uint64(a.dptr + j_off))
            call.mark(2)
            call.receive(y_off, (s, n_out))
            call.mark(3)
            return call.finish()

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
    # times up elementwise, then down as a gemv job. Tables: ``kernels/tables.py``.

    def _group_launches(
        self, call: Call, launches: list[tuple], t_ptr: int, h_ptr: int, hu_ptr: int
    ) -> list[tuple]:
        """(launch, pointer args) of a group's kernels, in order (host work done here)."""
        out: list[tuple] = []
        for ln in launches:
            if ln[0] == "moe":
                _, gu, dn, off, n, max_rows, max_ie, max_dout = ln
                go = moe_launch(gu, dn, n, max_rows, max_ie, max_dout, self._sms[call.device])
                if go is not None:
                    ptr = t_ptr + off
                    out.append((go, (np.uint64(ptr + counter_bytes(n)), np.uint64(ptr))))
            elif ln[0] == "gemv":
                _, spec, off, n, max_rows, max_out = ln
                go = gemv_launch(spec, n, max_rows, max_out)
                if go is not None:
                    out.append((go, (np.uint64(t_ptr + off),)))
            else:
                k = ln[1]
                mem = cupy.cuda.UnownedMemory(h_ptr, hu_ptr - h_ptr + 4 * k, call.arena)
                hh = cupy.ndarray((k,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
                hu = cupy.ndarray((k,), cupy.float32, cupy.cuda.MemoryPointer(mem, hu_ptr - h_ptr))
                out.append((_silu_mul, (hh, hu, hh)))
        return out

    def _group(
        self, call: Call, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray,
        extra_in: int = 0, x_rows: Sequence[int] | None = None, extra_out: int = 0,
    ) -> tuple[Arena, list[tuple], dict[str, int]]:  # fmt: skip
        """Plan a group, reserve its arena and write its inputs; returns the arena, the launches
        and the offsets. Inputs: x float32 [T, D] at 0, the tables, ``extra_in`` more bytes at
        "extra", up to "in_end". Outputs: y float32 [N, dout] at "y", then ``extra_out`` more
        bytes at "out". Device scratch: hidden (and up's, for unfused experts), then, for a
        routed group that gathers (``x_rows`` None and ``extra_in``), the packed x float32
        [N, D] at "xp" that the tables read. ``x_rows[c]``: the token row expert c's
        (consecutive) rows start at; the tables then read x in place."""
        T, D = x.shape
        a = call.take()
        key = ("group", mm.TENSOR_CORES, *map(id, experts), *rows, T, D, extra_in, extra_out,
               None if x_rows is None else tuple(x_rows))  # fmt: skip
        hit = a.plans.get(key)
        if hit is not None:  # the same experts and shapes in this arena: the same tables
            _, end, out_end, t_off, table, calls, off = hit
            a.reserve(end, out_end)
            call.put(0, x, 4 * T * D)
            a.host[t_off : t_off + len(table)] = table
            return a, calls, off
        plan = plan_group(experts, rows)
        N, dout = max(plan.n_rows, 1), experts[0][2].out_features
        t_off = align(4 * T * D)
        e_off = align(t_off + plan.table_bytes)
        in_end = e_off + extra_in
        y_off = align(in_end)
        o_off = align(y_off + 4 * N * dout)
        out_end = o_off + extra_out
        h_off = align(out_end)
        n_hid = max(plan.n_hid, 1)
        hu_off = align(h_off + 4 * n_hid)
        xp_off = align(hu_off + (4 * n_hid if plan.unfused else 0))
        packed = bool(extra_in) and x_rows is None
        end = xp_off + (4 * N * D if packed else 0)
        a = call.reserve(end, out_end)
        call.put(0, x, 4 * T * D)
        base = a.dptr
        x_at = None if x_rows is None else [base + 4 * D * r for r in x_rows]
        launches = write_group(a.host, t_off, plan, experts, D, dout,
                               base + (xp_off if packed else 0), base + y_off, base + h_off,
                               base + hu_off, x_at)  # fmt: skip
        calls = self._group_launches(call, launches, base + t_off, base + h_off, base + hu_off)
        off = {"extra": e_off, "in_end": in_end, "y": y_off, "out": o_off, "xp": xp_off}
        if not plan.unfused:  # (unfused experts' launches hold views of this call's arena)
            if len(a.plans) >= PLANS_PER_ARENA:
                a.plans.clear()
            # The entry holds the triples: their ids in the key stay theirs while it lives.
            table = a.host[t_off : t_off + plan.table_bytes].copy()
            a.plans[key] = (list(experts), end, out_end, t_off, table, calls, off)
        return a, calls, off

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> CupyPending:
        N = x.shape[0]
        dout = experts[0][2].out_features
        with Call(self, experts[0][0].device, "expert_group") as call:
            _, calls, off = self._group(call, experts, rows, x)
            call.mark(0)
            call.send(off["in_end"])
            call.mark(1)
            for go, args in calls:
                call.launch(go, *args)
            call.mark(2)
            call.receive(off["y"], (N, dout))
            call.mark(3)
            call.issue()
        return CupyPending(call)

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
        T, K = routes.shape
        D = x.shape[1]
        n = T * K
        plan = route_plan(routes, len(experts))
        rows, src, pos, x_rows = plan.rows, plan.src, plan.pos, plan.x_rows
        sel = [experts[e] for e in plan.used]
        d_out = experts[0][2].out_features
        extra = align(4 * n) * 2 + (0 if x_rows is not None else 4 * n)  # pos, w (, src)
        with Call(self, experts[0][0].device, "expert_group_routed") as call:
            a, calls, off = self._group(call, sel, rows, x, extra, x_rows, 4 * T * d_out)
            base, o0 = a.dptr, off["extra"]
            o1, o2 = o0 + align(4 * n), o0 + 2 * align(4 * n)
            put_host(a.host, o0, pos, 4 * n, np.int32)
            put_host(a.host, o1, weights, 4 * n)
            if x_rows is None:
                put_host(a.host, o2, src, 4 * n, np.int32)
            combine = route.combine_launch(T, K, d_out)
            u64 = np.uint64
            call.mark(0)
            call.send(off["in_end"])
            call.mark(1)
            if x_rows is None:
                call.launch(route.gather_launch(n, D), u64(base + off["xp"]), u64(base),
                            u64(base + o2))  # fmt: skip
            for go, args in calls:
                call.launch(go, *args)
            call.launch(combine, u64(base + off["out"]), u64(base + off["y"]), u64(base + o0),
                        u64(base + o1))  # fmt: skip
            call.mark(2)
            call.receive(off["out"], (T, d_out))
            call.mark(3)
            return call.finish()

    # -- MLA attention -----------------------------------------------------------------------

    def new_kv(self, device: int, k: int, r: int) -> CupyKVCache:
        return CupyKVCache(self, device, k, r)

    def _head_jobs(self, kv_b: CupyResident, q_dim: int, v_dim: int, s: int, heads: int,
                   cl: int, ctx: int) -> bytes:  # fmt: skip
        """The value projection's GemvJob records, one per head (cached: with a reused arena
        the same call shape gives the same bytes)."""
        w0, s0 = kv_b.row_ptrs(q_dim)
        k = kv_b.in_features
        key = (w0, s0, q_dim, v_dim, s, heads, cl, ctx)
        b = self._jobs_cache.get(key)
        if b is None:
            h = np.arange(heads, dtype=np.int64)
            t = np.zeros((heads, 8), np.int64)
            t[:, 0] = w0 + h * ((q_dim + v_dim) * kv_b.layout.ld)
            t[:, 1] = s0 + h * ((q_dim + v_dim) * kv_b.layout.ngp * 4 if kv_b.fmt else 0)
            t[:, 4] = cl + h * (4 * s * k)
            t[:, 5] = ctx + h * (4 * v_dim)
            t[:, 6] = s | (v_dim << 32)  # rows, out_rows
            t[:, 7] = k | ((heads * v_dim) << 32)  # x_stride, y_stride
            if len(self._jobs_cache) > 256:
                self._jobs_cache.clear()
            b = self._jobs_cache[key] = t.tobytes()
        return b

    def _attention(
        self,
        call: Call,
        kv_b: CupyResident,
        o_proj: CupyResident | None,
        q: np.ndarray,
        caches: Sequence[CupyKVCache] | None,
        fresh: Sequence[int],
        t_max: int,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        latents: Sequence[np.ndarray],
        ropes: Sequence[np.ndarray],
    ) -> Result:
        """Absorb (which also writes a ragged call's new cache rows), attend (+ merge), value
        projection (+ o_proj). ``latents`` / ``ropes``: the rows to upload, stacked in order
        (batch attention: its whole cache; ragged: ``fresh[s]`` new rows of ``caches[s]``, which
        have room for them). Arena inputs: q, the KvDescs, the gemv jobs, the rows; output: ctx
        float32 [S, H*V] or o_proj's [S, D_out]; scratch: qfull, cl, ctx (with o_proj), pm, pl,
        pacc. The plan (launches, layout, gemv jobs) is kept per arena and call shape."""
        S, H = q.shape[0], q.shape[1]
        K, R, V = kv_b.in_features, rope_dim, v_dim
        n_sm = self._sms[call.device]
        flash = att.flash_ok(K, R)
        if flash:
            nsplit = att.flash_splits(S, H, t_max, n_sm)
        else:
            nsplit = att.attend_splits(S, H, K, R, t_max, n_sm)
        n_up = sum(len(x) for x in latents)
        a = call.take()
        key = ("attention", id(kv_b), id(o_proj), S, H, q_dim, R, V, scale, n_up, nsplit,
               caches is None, flash, mm.TENSOR_CORES)  # fmt: skip
        plan = a.plans.get(key)
        if plan is None:
            plan = self._attention_plan(call, kv_b, o_proj, S, H, q_dim, R, V, scale, n_up,
                                        nsplit, flash)  # fmt: skip
            if len(a.plans) >= PLANS_PER_ARENA:
                a.plans.clear()
        (_, dev_end, host_end, d_off, j_off, l_off, r_off, in_end, out_off, dout, scratch,
         jobs, launches) = plan  # fmt: skip
        a.reserve(dev_end, host_end)
        a.plans[key] = plan  # after reserve: a reallocated arena forgets the old plans
        base, host = a.dptr, a.host
        qfull, cl, _, pm, pl, pacc = (base + o for o in scratch)
        call.put(0, q, 4 * q.size)
        if n_up:
            stack_into(host, l_off, latents, n_up, K)
            stack_into(host, r_off, ropes, n_up, R)
        if caches is not None:
            p, src = d_off, 0
            for c, n in zip(caches, fresh, strict=True):
                if c.latent is not None:
                    KV_DESC.pack_into(host, p, c.latent.data.ptr, c.rope.data.ptr, c.length + n,
                                      src)  # fmt: skip
                else:
                    KV_DESC.pack_into(host, p, 0, 0, 0, src)
                p += KV_DESC.size
                src += n
            scatter = n_up
        else:  # batch attention: the kernels read its cache rows in the upload
            for s in range(S):
                KV_DESC.pack_into(host, d_off + KV_DESC.size * s, base + l_off, base + r_off,
                                  n_up - S + 1 + s, 0)  # fmt: skip
            scatter = 0
        host[j_off : j_off + len(jobs)] = jobs
        absorb, attend, merge, value, proj = launches
        u64 = np.uint64
        call.mark(0)
        call.send(in_end)
        call.mark(1)
        call.launch(absorb, u64(qfull), u64(base), u64(kv_b.ptrs[0]), u64(kv_b.ptrs[1]),
                    u64(base + d_off), u64(base + l_off), u64(base + r_off),
                    np.int32(scatter))  # fmt: skip
        call.launch(attend, u64(pm), u64(pl), u64(pacc), u64(qfull), u64(base + d_off))
        call.launch(merge, u64(cl), u64(pm), u64(pl), u64(pacc))
        if value is not None:
            call.launch(value, u64(base + j_off))
        if proj is not None:
            call.launch(proj, u64(base + j_off + 64 * H))
        call.mark(2)
        call.receive(out_off, (S, dout) if o_proj is not None else (S, H, V))
        call.mark(3)
        return call.finish()

    def _attention_plan(
        self, call: Call, kv_b: CupyResident, o_proj: CupyResident | None, S: int, H: int,
        q_dim: int, R: int, V: int, scale: float, n_up: int, nsplit: int, flash: bool,
    ) -> tuple:  # fmt: skip
        """The launches, arena layout and gemv job bytes of one attention call shape in the
        call's arena (``_attention``); the plan holds kv_b and o_proj: the ids in its key
        stay theirs while it lives."""
        K = kv_b.in_features
        n_jobs = H + (o_proj is not None)
        absorb = att.absorb_launch(kv_b.spec, S, H, q_dim, R, V)
        if flash:
            attend, merge = att.flash_launch(S, H, K, R, scale, nsplit)
        else:
            attend, merge = att.attend_launch(S, H, K, R, scale, nsplit)
        value = gemv_launch(kv_b.spec, H, S, V)
        proj = gemv_launch(o_proj.spec, 1, S, o_proj.out_features) if o_proj else None
        dout = o_proj.out_features if o_proj is not None else H * V
        d_off = align(4 * S * H * (q_dim + R))
        j_off = align(d_off + KV_DESC.size * S)
        l_off = align(j_off + 64 * n_jobs)
        r_off = align(l_off + 4 * n_up * K)
        in_end = r_off + 4 * n_up * R
        out_off = align(in_end)
        sizes = [4 * S * H * (K + R), 4 * H * S * K, 4 * S * H * V if o_proj else 0,
                 4 * S * H * nsplit, 4 * S * H * nsplit, 4 * S * H * nsplit * K]  # fmt: skip
        scratch = [align(out_off + 4 * S * dout)]
        for n in sizes[:-1]:
            scratch.append(align(scratch[-1] + n))
        dev_end, host_end = scratch[-1] + sizes[-1], out_off + 4 * S * dout
        a = call.reserve(dev_end, host_end)  # the job pointers below are this arena's
        base = a.dptr
        cl = base + scratch[1]
        ctx = base + (scratch[2] if o_proj is not None else out_off)
        jobs = bytearray(self._head_jobs(kv_b, q_dim, V, S, H, cl, ctx))
        if o_proj is not None:
            jobs += GEMV_JOB.pack(*o_proj.ptrs, 0, 0, ctx, base + out_off, S,
                                  o_proj.out_features, H * V, o_proj.out_features)  # fmt: skip
        return ((kv_b, o_proj), dev_end, host_end, d_off, j_off, l_off, r_off, in_end, out_off,
                dout, scratch, np.frombuffer(bytes(jobs), np.uint8),
                (absorb, attend, merge, value, proj))  # fmt: skip

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
            return self._attention(call, kv_b, o_proj, q, None, (), max(latent.shape[0], 1),
                                   q_dim, rope_dim, v_dim, scale, [latent], [rope])  # fmt: skip

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
        fresh = [len(lat) for lat, _ in rows] if rows is not None else [0] * len(caches)
        for c, n in zip(caches, fresh, strict=True):
            if n:
                c.reserve(n)
        t_max = max((c.length + n for c, n in zip(caches, fresh, strict=True)), default=0)
        lats = [lat for lat, _ in rows] if rows is not None else []
        ropes = [rop for _, rop in rows] if rows is not None else []
        with Call(self, kv_b.device, "attention_ragged") as call:
            res = self._attention(call, kv_b, o_proj, q, caches, fresh, max(t_max, 1), q_dim,
                                  rope_dim, v_dim, scale, lats, ropes)  # fmt: skip
        for c, n in zip(caches, fresh, strict=True):
            c.length += n
        return res

    def close(self) -> None:
        self._local = threading.local()  # this thread's arenas go with it
        for d in self._devices:
            with cupy.cuda.Device(d):
                cupy.cuda.Device(d).synchronize()
                cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
