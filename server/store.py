"""The tensor store: handles, content-hash dedup with reference counts, byte accounting.

A *handle* is one client's reference; handles that upload identical content (same SHA-256,
same device) share one resident copy, counted in ``TensorData.refs`` (and per owner in
``TensorData.holders``). Byte budgets are enforced here, per device, before the backend
allocates anything. Handles are owned: a handle is only visible to the owner that created it
(the empty owner when authentication is off), its id is random (63 bits: one owner's ids
say nothing about another's uploads), and an owner finds content by hash (``lookup``) only
where it holds a handle on it itself: reaching another owner's copy takes sending the bytes.

A call holds what it uses until it ends (``held``, ``begin_call`` / ``end_call``): a tensor
whose last handle goes while calls that began before are running is unlinked at once (no
new call finds it) and its memory released once those calls have ended; an in-place
``update`` waits for the running calls to end and keeps new ones waiting meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from coliworker.kernels.qtensor import QTensor
from coliworker.server.backend import Backend, Phases, Placement, Resident
from coliworker.server.errors import NotFound, ResourceExhausted
from coliworker.server.quota import Quota


@dataclass(frozen=True)
class Spec:
    fmt: int
    in_features: int
    out_features: int
    group_size: int
    device: int


@dataclass
class TensorData:
    """One resident copy, shared by every handle with the same (device, content hash)."""

    spec: Spec
    content_hash: bytes
    resident: Resident
    nbytes: int
    refs: int = 0
    holders: dict[str, int] = field(default_factory=dict)  # owner -> its handles on this


@dataclass
class Handle:
    id: int
    owner: str
    data: TensorData

    @property
    def spec(self) -> Spec:
        return self.data.spec


@dataclass
class GroupTotals:
    calls: int = 0
    experts: int = 0
    rows: int = 0
    h2d_ns: int = 0
    kernel_ns: int = 0
    d2h_ns: int = 0


@dataclass(frozen=True)
class DeviceUsage:
    """What the Stats RPC and the metrics report for one device."""

    device: int
    tensors: int
    tensor_bytes: int
    handles: int
    kv_sequences: int
    kv_bytes: int
    group: GroupTotals


class Budget:
    """Per-device byte budget shared by tensors and KV caches (0: unlimited)."""

    def __init__(self, devices: tuple[int, ...], limit: int) -> None:
        self.limit = limit
        self.used = dict.fromkeys(devices, 0)
        self._lock = threading.Lock()

    def reserve(self, device: int, nbytes: int, what: str) -> None:
        with self._lock:
            if self.limit and self.used[device] + nbytes > self.limit:
                raise ResourceExhausted(
                    f"{what}: needs {nbytes} bytes on device {device}, which has "
                    f"{self.limit - self.used[device]} of its {self.limit}-byte budget left "
                    f"(--memory-limit)"
                )
            self.used[device] += nbytes

    def fits(self, device: int, nbytes: int) -> bool:
        if not self.limit:  # unlimited (``limit`` is fixed at construction): no lock needed
            return True
        with self._lock:
            return self.used[device] + nbytes <= self.limit

    def charge(self, device: int, nbytes: int) -> None:
        """Account bytes already allocated (may go over the limit; ``fits`` then says so)."""
        with self._lock:
            self.used[device] += nbytes

    def release(self, device: int, nbytes: int) -> None:
        with self._lock:
            self.used[device] -= nbytes


class Incoming:
    """A tensor being placed while its bytes arrive (``TensorStore.begin_upload``): its bytes
    are reserved and its device memory allocated; exactly one of ``commit`` / ``abort``
    ends it, and after an abort nothing of it is resident or reserved."""

    def __init__(
        self,
        store: TensorStore,
        spec: Spec,
        content_hash: bytes,
        nbytes: int,
        owner: str,
        placement: Placement,
    ) -> None:
        self.store, self.spec, self.content_hash = store, spec, content_hash
        self.nbytes, self.owner = nbytes, owner
        self._placement: Placement | None = placement
        self.write_ns = 0  # time spent copying blocks in (overlapped with the stream)

    def write(self, offset: int, data: np.ndarray) -> None:
        """Bytes ``[offset, offset + len(data))`` of weights || scales (uint8 [n])."""
        if self._placement is None:
            raise RuntimeError("write on an ended upload")
        t0 = time.perf_counter_ns()
        self._placement.write(offset, data)
        self.write_ns += time.perf_counter_ns() - t0

    def commit(self) -> tuple[Handle, bool, Phases]:
        """Every byte written and the content hash checked: (handle, deduplicated, phases:
        h2d = the block copies, kernel = the layout after the last block)."""
        placement, self._placement = self._placement, None
        if placement is None:
            raise RuntimeError("commit on an ended upload")
        try:
            t0 = time.perf_counter_ns()
            resident = placement.finish()
            phases = Phases(h2d_ns=self.write_ns, kernel_ns=time.perf_counter_ns() - t0)
        except BaseException:
            self._unreserve()
            raise
        handle, dedup = self.store._register(
            self.spec, self.content_hash, resident, self.nbytes, self.owner
        )
        return handle, dedup, phases

    def abort(self) -> None:
        """Free the device memory and the reservations (a no-op once ended)."""
        placement, self._placement = self._placement, None
        if placement is not None:
            try:
                placement.abort()
            finally:
                self._unreserve()

    def _unreserve(self) -> None:
        self.store._unreserve(self.owner, self.spec.device, self.nbytes)


class TensorStore:
    def __init__(
        self,
        backend: Backend,
        devices: tuple[int, ...],
        budget: Budget,
        quota: Quota | None = None,
    ) -> None:
        self.backend = backend
        self.devices = devices
        self.budget = budget
        self.quota = quota or Quota()  # per-owner bytes (quota.py)
        self._lock = threading.RLock()
        self._by_key: dict[tuple[int, bytes], TensorData] = {}
        self._handles: dict[int, Handle] = {}
        # Calls in progress by the epoch they began in, and copies unlinked while they ran
        # (released once no call that began before the unlink is left).
        self._epoch = 0
        self._active: dict[int, int] = {}  # epoch -> calls running that began in it
        self._deferred: list[tuple[int, TensorData]] = []
        self._writers = 0  # in-place updates waiting for the running calls to end
        self._calls_changed = threading.Condition(self._lock)
        # Bumped whenever a handle goes or changes what it points at: validation results
        # cached against handles (the servicer's expert triples) are stale once it moves.
        self.generation = 0
        self.group = {d: GroupTotals() for d in devices}

    # -- handles ------------------------------------------------------------------------

    def _new_handle(self, owner: str, data: TensorData) -> Handle:
        while True:  # random, so ids tell nothing about other owners' uploads
            hid = secrets.randbits(63)
            if hid and hid not in self._handles:
                break
        self._ref(owner, data)
        h = Handle(hid, owner, data)
        self._handles[h.id] = h
        return h

    @staticmethod
    def _ref(owner: str, data: TensorData) -> None:
        data.refs += 1
        data.holders[owner] = data.holders.get(owner, 0) + 1

    def get(self, handle_id: int, field: str, owner: str = "") -> Handle:
        """The live handle ``handle_id`` of ``owner``; NotFound names the field otherwise
        (one text for freed, never issued and another owner's)."""
        lock = self._lock  # acquire / release in try: about half the instructions of a with
        lock.acquire()
        try:
            h = self._handles.get(handle_id)
            if h is None or h.owner != owner:
                raise NotFound(f"{field}: unknown tensor handle {handle_id}")
            return h
        finally:
            lock.release()

    def lookup(
        self, content_hash: bytes, device: int, acquire: bool, owner: str = ""
    ) -> Handle | None:
        """Content ``owner`` holds a handle on (another owner's copy is not found: an owner
        reaches it only by sending the bytes); with ``acquire`` a new handle on it."""
        with self._lock:
            data = self._by_key.get((device, content_hash))
            if data is None or not data.holders.get(owner):
                return None
            if not acquire:
                return Handle(0, owner, data)
            self.quota.acquire(owner, data, "lookup")
            return self._new_handle(owner, data)

    def acquire_same(self, content_hash: bytes, spec: Spec, owner: str, op: str) -> Handle | None:
        """A new handle of ``owner`` on resident content of this hash *and* spec, whoever
        holds it (the caller then verifies the bytes and frees the handle if they differ),
        charged to the owner's quota now; None when there is none."""
        with self._lock:
            data = self._by_key.get((spec.device, content_hash))
            if data is None or data.spec != spec:
                return None
            self.quota.acquire(owner, data, op)
            return self._new_handle(owner, data)

    # -- calls hold what they use -------------------------------------------------------

    def begin_call(self) -> int:
        """A call starts using resident tensors; returns its epoch for ``end_call``."""
        lock = self._lock  # acquire / release in try: about half the instructions of a with
        lock.acquire()
        try:
            while self._writers:
                self._calls_changed.wait()
            epoch = self._epoch
            self._active[epoch] = self._active.get(epoch, 0) + 1
            return epoch
        finally:
            lock.release()

    def end_call(self, epoch: int) -> None:
        lock = self._lock
        lock.acquire()
        try:
            n = self._active[epoch] - 1
            if n:
                self._active[epoch] = n
            else:
                del self._active[epoch]
            ready = None
            if self._deferred:  # a free waits for the calls before it: the rare case
                oldest = min(self._active) if self._active else self._epoch + 1
                ready = [d for e, d in self._deferred if e < oldest]
                if ready:
                    self._deferred = [(e, d) for e, d in self._deferred if e >= oldest]
            if not self._active and self._writers:  # only a writer waits for no calls
                self._calls_changed.notify_all()
        finally:
            lock.release()
        if ready:
            for data in ready:
                self._release(data)

    def _release(self, data: TensorData) -> None:
        self.backend.release(data.resident)
        self.budget.release(data.spec.device, data.nbytes)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """``begin_call`` / ``end_call`` around the body."""
        epoch = self.begin_call()
        try:
            yield
        finally:
            self.end_call(epoch)

    # -- lifecycle ----------------------------------------------------------------------

    def upload(
        self, spec: Spec, content_hash: bytes, tensor: QTensor, owner: str = ""
    ) -> tuple[Handle, bool, Phases]:
        """A new handle on this content; places a copy only if none is resident yet."""
        hit = self.lookup(content_hash, spec.device, acquire=True, owner=owner)
        if hit is not None:
            return hit, True, Phases()
        nbytes = tensor.nbytes
        with self._reserved(owner, spec.device, nbytes, "upload"):
            t0 = time.perf_counter_ns()
            resident = self.backend.place(tensor, spec.device)
            phases = Phases(h2d_ns=time.perf_counter_ns() - t0)
        handle, dedup = self._register(spec, content_hash, resident, nbytes, owner)
        return handle, dedup, phases

    def begin_upload(self, spec: Spec, content_hash: bytes, nbytes: int, owner: str) -> Incoming:
        """Reserve ``nbytes`` (quota, device budget) and the device memory of a tensor whose
        bytes are still arriving; ``Incoming.commit`` makes it a handle once they are all
        here and verified, ``Incoming.abort`` undoes everything."""
        with self._reserved(owner, spec.device, nbytes, "upload"):
            placement = self.backend.begin_place(
                spec.fmt, spec.in_features, spec.out_features, spec.group_size, spec.device
            )
        return Incoming(self, spec, content_hash, nbytes, owner, placement)

    @contextlib.contextmanager
    def _reserved(self, owner: str, device: int, nbytes: int, op: str) -> Iterator[None]:
        """Hold ``nbytes`` of the owner's quota and the device's budget for the body; both
        are given back if it raises (on success the caller keeps them)."""
        self.quota.reserve(owner, nbytes, op)
        try:
            self.budget.reserve(device, nbytes, op)
        except BaseException:
            self.quota.unreserve(owner, nbytes)
            raise
        try:
            yield
        except BaseException:
            self._unreserve(owner, device, nbytes)
            raise

    def _unreserve(self, owner: str, device: int, nbytes: int) -> None:
        self.budget.release(device, nbytes)
        self.quota.unreserve(owner, nbytes)

    def _register(
        self, spec: Spec, content_hash: bytes, resident: Resident, nbytes: int, owner: str
    ) -> tuple[Handle, bool]:
        """A placed copy whose ``nbytes`` are reserved becomes the first handle on its
        content, or, when an identical upload finished first, is dropped for a reference
        to that one (True: deduplicated)."""
        key = (spec.device, content_hash)
        with self._lock:
            raced = self._by_key.get(key)
            if raced is None:
                data = TensorData(spec, content_hash, resident, nbytes)
                self._by_key[key] = data
                self.quota.bind(owner, data)
                return self._new_handle(owner, data), False
            # Same content, same bytes: the reservation becomes a reference (never raises).
            self.quota.unreserve(owner, nbytes)
            self.quota.acquire(owner, raced, "upload")
            handle = self._new_handle(owner, raced)
        # An identical upload finished first: keep its copy, drop ours.
        self.backend.release(resident)
        self.budget.release(spec.device, nbytes)
        return handle, True

    def update(self, handle: Handle, content_hash: bytes, tensor: QTensor | None) -> Phases:
        """Point ``handle`` at new content (same spec). Other handles keep the old data.
        ``tensor`` may be None only while the content is resident (the caller holds a handle
        on it)."""
        spec = handle.spec
        key = (spec.device, content_hash)
        with self._lock:
            self.generation += 1
            old = handle.data
            if old.content_hash == content_hash:
                return Phases()
            existing = self._by_key.get(key)
            if existing is not None:
                self.quota.acquire(handle.owner, existing, "update")
                self._ref(handle.owner, existing)
                handle.data = existing
                self.quota.release(handle.owner, old)
                self._drop_ref(handle.owner, old)
                return Phases()
            if tensor is None:
                raise RuntimeError("update: content not resident and no tensor given")
            if old.refs == 1:
                # Sole owner: overwrite in place, no second allocation, once no running call
                # can be reading it (new calls wait meanwhile).
                self._writers += 1
                try:
                    while self._active:
                        self._calls_changed.wait()
                    t0 = time.perf_counter_ns()
                    self.backend.replace(old.resident, tensor)
                finally:
                    self._writers -= 1
                    self._calls_changed.notify_all()
                del self._by_key[(spec.device, old.content_hash)]
                old.content_hash = content_hash
                self._by_key[key] = old
                return Phases(h2d_ns=time.perf_counter_ns() - t0)
        # Shared: copy on write.
        with self._reserved(handle.owner, spec.device, tensor.nbytes, "update"):
            t0 = time.perf_counter_ns()
            resident = self.backend.place(tensor, spec.device)
            phases = Phases(h2d_ns=time.perf_counter_ns() - t0)
        with self._lock:
            self.generation += 1
            data = TensorData(spec, content_hash, resident, tensor.nbytes)
            self._ref(handle.owner, data)
            self._by_key[key] = data
            self.quota.bind(handle.owner, data)
            old = handle.data
            handle.data = data
            self.quota.release(handle.owner, old)
            self._drop_ref(handle.owner, old)
        return phases

    def free(self, handle: Handle) -> tuple[int, int]:
        """Drop a handle; returns (bytes released, the owner's handles left on its data)."""
        with self._lock:
            if self._handles.pop(handle.id, None) is None:
                raise NotFound(f"free.handle: unknown tensor handle {handle.id}")
            self.generation += 1
            data = handle.data
            self.quota.release(handle.owner, data)
            released = self._drop_ref(handle.owner, data)
            return released, data.holders.get(handle.owner, 0)

    def _drop_ref(self, owner: str, data: TensorData) -> int:
        """One handle of ``owner`` on ``data`` went; the last one unlinks it and releases its
        memory now, or once the calls running meanwhile have ended (call with the lock)."""
        data.refs -= 1
        n = data.holders.get(owner, 0) - 1
        if n > 0:
            data.holders[owner] = n
        else:
            data.holders.pop(owner, None)
        if data.refs > 0:
            return 0
        del self._by_key[(data.spec.device, data.content_hash)]
        if self._active:
            self._deferred.append((self._epoch, data))
            self._epoch += 1
        else:
            self._release(data)
        return data.nbytes

    # -- statistics ---------------------------------------------------------------------

    def record_group(self, device: int, experts: int, rows: int, phases: Phases) -> None:
        h2d, kernel, d2h = phases.h2d_ns, phases.kernel_ns, phases.d2h_ns  # (outside the lock)
        lock = self._lock  # acquire / release in try: about half the instructions of a with
        lock.acquire()
        try:
            g = self.group[device]
            g.calls += 1
            g.experts += experts
            g.rows += rows
            g.h2d_ns += h2d
            g.kernel_ns += kernel
            g.d2h_ns += d2h
        finally:
            lock.release()

    def tensor_usage(self, owner: str | None = None) -> dict[int, tuple[int, int, int]]:
        """device -> (distinct tensors, their bytes, live handles): the worker's, or with
        ``owner`` only what that owner holds (the Stats view of one owner)."""
        with self._lock:
            out = {d: [0, 0, 0] for d in self.devices}
            for data in self._by_key.values():
                if owner is None or data.holders.get(owner):
                    out[data.spec.device][0] += 1
                    out[data.spec.device][1] += data.nbytes
            for h in self._handles.values():
                if owner is None or h.owner == owner:
                    out[h.spec.device][2] += 1
            return {d: (v[0], v[1], v[2]) for d, v in out.items()}

    def group_totals(self, device: int) -> GroupTotals:
        with self._lock:
            g = self.group[device]
            return GroupTotals(g.calls, g.experts, g.rows, g.h2d_ns, g.kernel_ns, g.d2h_ns)

    def handles_of(self, owner: str) -> list[Handle]:
        with self._lock:
            return [h for h in self._handles.values() if h.owner == owner]


_F = TypeVar("_F", bound=Callable[..., Any])


#: The parameters of a handler ``held`` wraps (the wrapper takes exactly these).
_HANDLER_PARAMS = ("self", "request", "owner", "io")


def held(op: _F) -> _F:
    """Decorate a handler method of an object with a ``store``: the call holds every tensor
    it resolves until it returns (``TensorStore.begin_call``), so a concurrent free or update
    can never leave it reading released or half-written memory.

    The handler takes ``(self, request, owner, io)``, and so does the wrapper, with the
    handler's default for ``io`` (if any): a fixed signature, so a call builds no ``*args``
    tuple and ``**kwargs`` dict on its way in."""
    code = op.__code__
    extra = code.co_kwonlyargcount or code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    if code.co_varnames[: code.co_argcount] != _HANDLER_PARAMS or extra:
        raise TypeError(f"held: {op.__qualname__} must take exactly {_HANDLER_PARAMS}")

    def run(self: Any, request: Any, owner: str, io: Any) -> Any:
        store = self.store
        epoch = store.begin_call()
        try:
            return op(self, request, owner, io)
        finally:
            store.end_call(epoch)

    run.__defaults__ = op.__defaults__  # io's default where the handler has one
    return functools.update_wrapper(run, op)  # type: ignore[return-value]
