"""The CuPy backend: resident quantized weights, MLA KV caches and kernels on CUDA devices.

Weights are re-laid out on the device at place time (``kernels/layout.py``); a call moves only
its activations: one H2D phase (activations and the per-call job / descriptor tables), the
kernels, one D2H phase, timed with CUDA events.

Host time per call is kept near the floor: every buffer of a call (inputs, outputs, scratch,
on the device and pinned on the host) lies in one reusable arena with its own timing events;
job tables are packed straight into the pinned inputs (``kernels/tables.py``); launches are
prepared once per shape (``matmul.Launch``); the device is switched only when it differs.

Concurrency: every thread gets its own non-blocking stream per device and its own pool of
arenas; a call holds its arena until its result is on the host, so calls from a thread pool,
calls on several devices and outstanding ``expert_group_issue`` results never share mutable
scratch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import cupy
import cupyx
import numpy as np

from coliworker.kernels import attention as att
from coliworker.kernels import layout, route
from coliworker.kernels.matmul import WeightSpec, gemv_launch, moe_launch
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count
from coliworker.kernels.tables import (
    GEMV_JOB,
    KV_DESC,
    counter_bytes,
    plan_group,
    route_plan,
    write_group,
)
from coliworker.server.backend import DeviceInfo, ExpertTriple, Phases, Result
from coliworker.server.errors import InvalidArgument, OutOfDeviceMemory

if TYPE_CHECKING:
    from coliworker.client.shm import Segment

log = logging.getLogger(__name__)

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
            with _oom_guard(device, f"place {wbytes} bytes"):
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
                    self._ptr + offset, data.ctypes.data, k, _H2D, stream.ptr
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
            with _oom_guard(self.device, f"kv cache growth to {cap} rows"):
                lat = cupy.empty((cap, self.k), cupy.float32)
                rop = cupy.empty((cap, self.r), cupy.float32)
            if self.length:
                lat[: self.length] = self.latent[: self.length]
                rop[: self.length] = self.rope[: self.length]
            stream.synchronize()
        self.latent, self.rope, self.cap = lat, rop, cap

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


def _align(n: int) -> int:
    return -(-n // 256) * 256


# Arenas above this many bytes (device or pinned) are freed after their call rather than kept.
ARENA_KEEP_BYTES = 64 << 20
ARENAS_PER_THREAD = 4  # free arenas a thread keeps per device (one per call it has in flight)
# Outputs of at least this many bytes are handed over in their pinned buffer, not copied.
DETACH_BYTES = 1 << 20
# Inputs of at least this many bytes are copied into the pinned buffer by several threads.
SPLIT_COPY_BYTES = 8 << 20
# float32 inputs of at least this many bytes that lie in a session's shared-memory segment go
# to the device straight from it (registered with CUDA on the first such input), not through
# a copy into the pinned buffer.
DIRECT_BYTES = 8 << 20
_COPY_THREADS = 4
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


class _Arena:
    """Reusable scratch of one call at a time: device bytes, a pinned host twin and four timing
    events. A call takes one from its thread's pool and gives it back once its result is on
    the host, so an issued call owns its buffers until ``result()``; calls beyond the pool's
    size (several in flight) get fresh arenas."""

    __slots__ = ("dev", "dptr", "host", "hptr", "events", "eptr", "home")

    def __init__(self, home: list[_Arena]) -> None:
        self.dev: Any = None  # cupy.ndarray uint8, set by reserve()
        self.host: Any = None  # pinned np.ndarray uint8, set by reserve()
        self.dptr = self.hptr = 0
        self.events = [cupy.cuda.Event() for _ in range(4)]
        self.eptr = [e.ptr for e in self.events]  # raw handles: the runtime calls cost less
        self.home = home

    def reserve(self, dev_bytes: int, host_bytes: int) -> None:
        if self.dev is None or self.dev.nbytes < dev_bytes:
            cap = max(_align(dev_bytes), 2 * (self.dev.nbytes if self.dev is not None else 0))
            self.dev = None  # this arena's last call is finished: free before the new one
            if cap > ARENA_KEEP_BYTES:
                cap = _align(dev_bytes)
            self.dev = cupy.empty((cap,), cupy.uint8)
            self.dptr = self.dev.data.ptr
        if self.host is None or self.host.nbytes < host_bytes:
            cap = max(_align(host_bytes), 2 * (self.host.nbytes if self.host is not None else 0))
            self.host = None
            if cap > ARENA_KEEP_BYTES:
                cap = _align(host_bytes)
            self.host = cupyx.empty_pinned((cap,), np.uint8)
            self.hptr = self.host.ctypes.data

    def give_back(self) -> None:
        big = (self.dev is not None and self.dev.nbytes > ARENA_KEEP_BYTES) or (
            self.host is not None and self.host.nbytes > ARENA_KEEP_BYTES
        )
        if big:
            self.dev = self.host = None
        if len(self.home) < ARENAS_PER_THREAD:
            self.home.append(self)


_H2D, _D2H = 1, 2  # cudaMemcpyKind


class _Call:
    """One call: the device made current (only when it is not already), the thread's stream
    and an arena. Layout of the arena: [inputs | outputs] mirrored on host and device (the
    inputs go up in one copy, the outputs come back in one), then device-only scratch."""

    __slots__ = ("backend", "device", "what", "stream", "arena", "_prev", "out", "direct")

    def __init__(self, backend: CupyBackend, device: int, what: str) -> None:
        self.backend = backend
        self.device = device
        self.what = what
        self.stream = backend._stream(device)
        self.arena: Any = None  # _Arena while the call owns one
        self.direct: list[tuple[int, int, int]] = []  # (arena offset, host address, bytes)

    def __enter__(self) -> _Call:
        self._prev = cupy.cuda.runtime.getDevice()
        if self._prev != self.device:
            cupy.cuda.runtime.setDevice(self.device)
        self.stream.__enter__()
        return self

    def __exit__(self, et: type | None, ev: BaseException | None, tb: object) -> None:
        self.stream.__exit__(et, ev, tb)
        if self._prev != self.device:
            cupy.cuda.runtime.setDevice(self._prev)
        if ev is not None:
            if self.arena is not None:  # the GPU may still read it: let it finish, then drop it
                with contextlib.suppress(Exception):
                    self.stream.synchronize()
                self.arena = None
            err = _oom_error(ev, self.device, self.what)
            if err is not None:
                raise err from None

    def reserve(self, dev_bytes: int, host_bytes: int) -> _Arena:
        pool = self.backend._arenas(self.device)
        a = pool.pop() if pool else _Arena(pool)
        a.reserve(dev_bytes, host_bytes)
        self.arena = a
        return a

    def put(self, off: int, a: np.ndarray, nbytes: int) -> None:
        """float32 array ``a`` (``nbytes`` bytes) as the inputs' bytes [off, off + nbytes):
        ``send`` reads it where it lies when that is a registered shared-memory segment
        (``CupyBackend.attach_segment``), else it is copied into the arena (``_put``)."""
        if nbytes >= DIRECT_BYTES and a.dtype == np.float32 and a.flags.c_contiguous:
            ptr = a.ctypes.data
            if self.backend._registered(ptr, nbytes):
                self.direct.append((off, ptr, nbytes))
                return
        _put(self.arena.host, off, a, nbytes)

    def send(self, nbytes: int) -> None:
        """The inputs, bytes [0, nbytes) of the arena, host -> device (the ranges ``put``
        left in a registered segment from there)."""
        a = self.arena
        rt, sp = cupy.cuda.runtime, self.stream.ptr
        pos = 0
        for off, ptr, n in sorted(self.direct):
            if off > pos:
                rt.memcpyAsync(a.dptr + pos, a.hptr + pos, off - pos, _H2D, sp)
            rt.memcpyAsync(a.dptr + off, ptr, n, _H2D, sp)
            pos = off + n
        if pos < nbytes:
            rt.memcpyAsync(a.dptr + pos, a.hptr + pos, nbytes - pos, _H2D, sp)
        self.direct = []

    def receive(self, off: int, shape: tuple[int, ...]) -> None:
        """The output float32 ``shape`` at ``off`` device -> host (same offset)."""
        a = self.arena
        n = 4 * math.prod(shape)
        cupy.cuda.runtime.memcpyAsync(a.hptr + off, a.dptr + off, n, _D2H, self.stream.ptr)
        self.out = (off, n, shape)

    def mark(self, i: int) -> None:
        cupy.cuda.runtime.eventRecord(self.arena.eptr[i], self.stream.ptr)

    def finish(self) -> Result:
        a = self.arena
        ev = a.eptr
        rt = cupy.cuda.runtime
        rt.eventSynchronize(ev[3])
        off, n, shape = self.out
        if n >= DETACH_BYTES:
            # The result keeps the pinned buffer (returned to CuPy's pinned pool when it is
            # dropped): no copy into fresh pages, whose first touch costs more than the copy.
            out = a.host[off : off + n].view(np.float32).reshape(shape)
            a.host, a.hptr = None, 0
        else:
            out = a.host[off : off + n].view(np.float32).reshape(shape).copy()  # arena reused
        phases = Phases(*(int(rt.eventElapsedTime(ev[i], ev[i + 1]) * 1e6) for i in range(3)))
        self.arena = None
        a.give_back()
        return Result(out, phases)


def _oom_error(exc: BaseException, device: int, what: str) -> OutOfDeviceMemory | None:
    """CuPy's device / pinned out-of-memory errors as OutOfDeviceMemory (else None)."""
    if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return OutOfDeviceMemory(f"{what}: device {device} is out of memory ({exc})")
    if isinstance(exc, cupy.cuda.runtime.CUDARuntimeError) and "MemoryAllocation" in str(exc):
        return OutOfDeviceMemory(
            f"{what}: device {device} (or pinned host memory) is out of memory ({exc})"
        )
    return None


class CupyPending:
    """An expert group in flight on its own stream and arena."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._result: Result | None = None

    def result(self) -> Result:
        if self._result is None:
            c = self._call
            prev = cupy.cuda.runtime.getDevice()
            if prev != c.device:
                cupy.cuda.runtime.setDevice(c.device)
            try:
                self._result = c.finish()
            finally:
                if prev != c.device:
                    cupy.cuda.runtime.setDevice(prev)
        return self._result


_UNREGISTERED, _REGISTERED, _FAILED, _GONE = range(4)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device


class _Segment:
    """A shared-memory segment a session maps, and whether CUDA has it registered."""

    __slots__ = ("name", "address", "size", "state")

    def __init__(self, name: str, address: int, size: int) -> None:
        self.name, self.address, self.size = name, address, size
        self.state = _UNREGISTERED


def _register(m: _Segment) -> int:
    """cudaHostRegister the segment; _REGISTERED, or _FAILED (logged) when CUDA refuses."""
    try:
        cupy.cuda.runtime.hostRegister(m.address, m.size, _HOST_REGISTER_PORTABLE)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        log.info("segment %s: cudaHostRegister failed, inputs are copied: %s", m.name, exc)
        return _FAILED
    return _REGISTERED


def _put(host: np.ndarray, off: int, a: np.ndarray, nbytes: int, dtype: Any = np.float32) -> None:
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


def _stack_into(host: np.ndarray, off: int, parts: Sequence[np.ndarray], n: int, w: int) -> None:
    """Row blocks ``parts`` (float32 [n_i, w], n rows in all) stacked into pinned ``host`` at
    off: one copy, no temporary."""
    out = host[off : off + 4 * n * w].view(np.float32).reshape(n, w)
    if len(parts) == 1:
        out[...] = parts[0]
    else:
        np.concatenate(parts, out=out)


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
        self._segments: list[_Segment] = []
        self._segments_lock = threading.Lock()

    # -- shared-memory segments --------------------------------------------------------------
    #
    # A session's segment holds the client's inputs; read through a view (no copy), a large
    # one would still be copied into the pinned arena before it goes up. Registered with CUDA
    # (page-locked), the device reads it directly. Registration pins every page of the
    # segment, so it waits for the first large input: a decode-only session pins nothing.

    def attach_segment(self, seg: Segment) -> None:
        """A session mapped ``seg`` (``server/session.py``); see the comment above. It is
        unregistered before it is unmapped (``Segment.on_close``)."""
        m = _Segment(seg.name, seg.address, seg.size)
        with self._segments_lock:
            self._segments.append(m)
        seg.on_close(lambda: self._detach_segment(m))

    def _registered(self, ptr: int, n: int) -> bool:
        """Whether [ptr, ptr + n) lies in a registered segment (registering it on first use;
        a segment CUDA refuses stays unregistered and its inputs are copied)."""
        for m in self._segments:
            if m.address <= ptr and ptr + n <= m.address + m.size:
                if m.state == _UNREGISTERED:
                    with self._segments_lock:
                        if m.state == _UNREGISTERED:
                            m.state = _register(m)
                return m.state == _REGISTERED
        return False

    def _detach_segment(self, m: _Segment) -> None:
        with self._segments_lock:
            if m in self._segments:
                self._segments.remove(m)
            state, m.state = m.state, _GONE
        if state != _REGISTERED:
            return
        # Copies issued from it may still run: let every device finish them first. A call
        # that found it registered and copies later reads pageable memory (still mapped:
        # its view holds the mapping, see Segment.close), which CUDA stages itself.
        for d in self._devices:
            with cupy.cuda.Device(d):
                cupy.cuda.runtime.deviceSynchronize()
        try:
            cupy.cuda.runtime.hostUnregister(m.address)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            log.warning("segment %s: cudaHostUnregister failed: %s", m.name, exc)

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

    def _arenas(self, device: int) -> list[_Arena]:
        """This thread's free arenas of ``device``."""
        try:
            return self._local.arenas[device]
        except AttributeError:
            self._local.arenas = {}
        except KeyError:
            pass
        pool: list[_Arena] = []
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
            with _oom_guard(device, f"place {tensor.nbytes} bytes"):
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
        j_off = _align(xb)
        y_off = _align(j_off + GEMV_JOB.size)
        with _Call(self, w.device, "matmul") as call:
            go = gemv_launch(w.spec, 1, s, n_out)
            a = call.reserve(y_off + 4 * s * n_out, y_off + 4 * s * n_out)
            call.put(0, x, xb)
            GEMV_JOB.pack_into(a.host, j_off, *w.ptrs, 0, 0, a.dptr, a.dptr + y_off, s, n_out,
                               n_in, n_out)  # fmt: skip
            call.mark(0)
            call.send(j_off + GEMV_JOB.size)
            call.mark(1)
            if go is not None:
                go(np.uint64(a.dptr + j_off))
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
        self, call: _Call, launches: list[tuple], t_ptr: int, h_ptr: int, hu_ptr: int
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
        self, call: _Call, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray,
        extra_in: int = 0, x_rows: Sequence[int] | None = None, extra_out: int = 0,
    ) -> tuple[_Arena, list[tuple], dict[str, int]]:  # fmt: skip
        """Plan a group, reserve its arena and write its inputs; returns the arena, the launches
        and the offsets. Inputs: x float32 [T, D] at 0, the tables, ``extra_in`` more bytes at
        "extra", up to "in_end". Outputs: y float32 [N, dout] at "y", then ``extra_out`` more
        bytes at "out". Device scratch: hidden (and up's, for unfused experts), then, for a
        routed group that gathers (``x_rows`` None and ``extra_in``), the packed x float32
        [N, D] at "xp" that the tables read. ``x_rows[c]``: the token row expert c's
        (consecutive) rows start at; the tables then read x in place."""
        plan = plan_group(experts, rows)
        T, D = x.shape
        N, dout = max(plan.n_rows, 1), experts[0][2].out_features
        t_off = _align(4 * T * D)
        e_off = _align(t_off + plan.table_bytes)
        in_end = e_off + extra_in
        y_off = _align(in_end)
        o_off = _align(y_off + 4 * N * dout)
        out_end = o_off + extra_out
        h_off = _align(out_end)
        n_hid = max(plan.n_hid, 1)
        hu_off = _align(h_off + 4 * n_hid)
        xp_off = _align(hu_off + (4 * n_hid if plan.unfused else 0))
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
        return a, calls, {"extra": e_off, "in_end": in_end, "y": y_off, "out": o_off,
                          "xp": xp_off}  # fmt: skip

    def expert_group_issue(
        self, experts: Sequence[ExpertTriple], rows: Sequence[int], x: np.ndarray
    ) -> CupyPending:
        N = x.shape[0]
        dout = experts[0][2].out_features
        with _Call(self, experts[0][0].device, "expert_group") as call:
            _, calls, off = self._group(call, experts, rows, x)
            call.mark(0)
            call.send(off["in_end"])
            call.mark(1)
            for go, args in calls:
                go(*args)
            call.mark(2)
            call.receive(off["y"], (N, dout))
            call.mark(3)
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
        extra = _align(4 * n) * 2 + (0 if x_rows is not None else 4 * n)  # pos, w (, src)
        with _Call(self, experts[0][0].device, "expert_group_routed") as call:
            a, calls, off = self._group(call, sel, rows, x, extra, x_rows, 4 * T * d_out)
            base, o0 = a.dptr, off["extra"]
            o1, o2 = o0 + _align(4 * n), o0 + 2 * _align(4 * n)
            _put(a.host, o0, pos, 4 * n, np.int32)
            _put(a.host, o1, weights, 4 * n)
            if x_rows is None:
                _put(a.host, o2, src, 4 * n, np.int32)
            combine = route.combine_launch(T, K, d_out)
            u64 = np.uint64
            call.mark(0)
            call.send(off["in_end"])
            call.mark(1)
            if x_rows is None:
                route.gather_launch(n, D)(u64(base + off["xp"]), u64(base), u64(base + o2))
            for go, args in calls:
                go(*args)
            combine(u64(base + off["out"]), u64(base + off["y"]), u64(base + o0), u64(base + o1))
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
        call: _Call,
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
        pacc."""
        S, H = q.shape[0], q.shape[1]
        K, R, V = kv_b.in_features, rope_dim, v_dim
        n_jobs = H + (o_proj is not None)
        n_sm = self._sms[call.device]
        absorb = att.absorb_launch(kv_b.spec, S, H, q_dim, R, V)
        if att.flash_ok(K, R):
            nsplit = att.flash_splits(S, H, t_max, n_sm)
            attend, merge = att.flash_launch(S, H, K, R, scale, nsplit)
        else:
            nsplit = att.attend_splits(S, H, K, R, t_max, n_sm)
            attend, merge = att.attend_launch(S, H, K, R, scale, nsplit)
        value = gemv_launch(kv_b.spec, H, S, V)
        proj = gemv_launch(o_proj.spec, 1, S, o_proj.out_features) if o_proj else None
        dout = o_proj.out_features if o_proj is not None else H * V
        n_up = sum(len(x) for x in latents)
        qb = 4 * q.size
        d_off = _align(qb)
        j_off = _align(d_off + KV_DESC.size * S)
        l_off = _align(j_off + 64 * n_jobs)
        r_off = _align(l_off + 4 * n_up * K)
        in_end = r_off + 4 * n_up * R
        out_off = _align(in_end)
        sizes = [4 * S * H * (K + R), 4 * H * S * K, 4 * S * H * V if o_proj else 0,
                 4 * S * H * nsplit, 4 * S * H * nsplit, 4 * S * H * nsplit * K]  # fmt: skip
        scratch = [_align(out_off + 4 * S * dout)]
        for n in sizes[:-1]:
            scratch.append(_align(scratch[-1] + n))
        a = call.reserve(scratch[-1] + sizes[-1], out_off + 4 * S * dout)
        base, host = a.dptr, a.host
        qfull, cl, ctx, pm, pl, pacc = (base + o for o in scratch)
        if o_proj is None:
            ctx = base + out_off
        call.put(0, q, qb)
        if n_up:
            _stack_into(host, l_off, latents, n_up, K)
            _stack_into(host, r_off, ropes, n_up, R)
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
        jobs = self._head_jobs(kv_b, q_dim, V, S, H, cl, ctx)
        host[j_off : j_off + len(jobs)] = np.frombuffer(jobs, np.uint8)
        if o_proj is not None:
            GEMV_JOB.pack_into(host, j_off + 64 * H, *o_proj.ptrs, 0, 0, ctx, base + out_off, S,
                               o_proj.out_features, H * V, o_proj.out_features)  # fmt: skip
        u64 = np.uint64
        call.mark(0)
        call.send(in_end)
        call.mark(1)
        absorb(u64(qfull), u64(base), u64(kv_b.ptrs[0]), u64(kv_b.ptrs[1]), u64(base + d_off),
               u64(base + l_off), u64(base + r_off), np.int32(scatter))  # fmt: skip
        attend(u64(pm), u64(pl), u64(pacc), u64(qfull), u64(base + d_off))
        merge(u64(cl), u64(pm), u64(pl), u64(pacc))
        if value is not None:
            value(u64(base + j_off))
        if proj is not None:
            proj(u64(base + j_off + 64 * H))
        call.mark(2)
        call.receive(out_off, (S, dout) if o_proj is not None else (S, H, V))
        call.mark(3)
        return call.finish()

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
        with _Call(self, kv_b.device, "attention") as call:
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
        with _Call(self, kv_b.device, "attention_ragged") as call:
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
