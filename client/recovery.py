"""``RecoveringClient``: a WorkerClient the engine can keep using across worker restarts.

    w = RecoveringClient(address, retain=True)        # keeps host copies of what it uploads
    w = RecoveringClient(address, loader=load)        # or: load(ref) -> (weights, scales)

Every worker response carries the worker's instance id (``coliworker-instance`` metadata).
When a call meets a new instance (an answer from a restarted worker, or a transport
UNAVAILABLE followed by a new instance once the worker is reachable again), the client

1. re-uploads every tensor it holds (from its retained copies or ``loader``; through
   ``upload_many`` in sets of about ``RESTORE_SET_BYTES``, so hashing and streams overlap)
   and points the engine's ``TensorRef`` objects at the new handles (``ref.handle`` changes
   in place; stale integer handles in requests are rewritten too),
2. marks every KV sequence for replay: the next ragged call of each sequence is rewritten to
   ``start = 0`` with the retained rows in front of the new ones,
3. retries the call, and recomputes expert groups whose tickets died with the old worker.

The engine sees no error; ``session()`` streams recover the same way
(``client/recovering_session.py``). Without ``retain`` or ``loader`` it raises
``WorkerRestarted`` (an ``Unavailable``): fall back to the CPU path. KV rows sent are
retained whenever recovery is possible (they are what the replay sends).

Retries: a transport UNAVAILABLE is retried with exponential backoff (``backoff`` doubling
up to ``max_backoff``) while the worker is unreachable, for at most ``recover_timeout``
seconds; then ``Unavailable`` is raised. When the same instance answers again, only
idempotent calls are retried (compute, ragged attention, which sends rows from ``start``,
info, stats, free_sequence); upload, update, free and expert_group_async raise, because the
first attempt may have taken effect. An UNAVAILABLE the worker itself sends (a compute fault,
a draining worker) is never retried: it means "use the CPU path".
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from coliworker.client.errors import NotFound, Unavailable, WorkerRestarted, from_rpc_error
from coliworker.client.recovering_session import RecoveringSession
from coliworker.client.security import TLS, make_channel
from coliworker.client.uploads import UploadItem
from coliworker.client.worker import INSTANCE_METADATA_KEY, ExpertGroupFuture, TensorRef
from coliworker.client.worker import WorkerClient as _Base
from coliworker.v1 import worker_pb2 as pb

T = TypeVar("T")
Loader = Callable[[TensorRef], tuple[np.ndarray, "np.ndarray | None"]]

_HANDLE_FIELDS = ("handle", "gate", "up", "down", "kv_b", "o_proj")
#: (id of the client, instance) while a recovery restores that instance. A context variable,
#: not a thread-local: ``upload_many``'s stream threads run in a copy of the caller's
#: context, so the re-uploads of a recovery expect the new instance on every thread.
_RECOVERING: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "coliworker_recovering", default=None
)
#: A recovery re-uploads in upload_many sets of about this many bytes (a loader's arrays
#: for one set are held at once).
RESTORE_SET_BYTES = 1 << 30
# Reconnect fast once the worker is back (gRPC's default first backoff is 1 s).
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _Restart(WorkerRestarted):
    """A new worker instance answered (internal: becomes a recovery, or WorkerRestarted)."""

    def __init__(self, instance: str) -> None:
        super().__init__(f"worker restarted (new instance {instance})")
        self.instance = instance


class _Down(Unavailable):
    """The transport failed: the worker did not answer (internal: becomes a retry)."""


def _instance_of(call: Any, trailing: bool = False) -> str | None:
    """The worker instance in a call's metadata; ``trailing``: only if the worker completed
    the call (a transport failure mid-call has initial metadata but no trailers)."""
    try:
        metadata = (call.trailing_metadata() if trailing else call.initial_metadata()) or ()
    except Exception:
        return None
    for key, value in metadata:
        if key == INSTANCE_METADATA_KEY:
            return str(value)
    return None


@dataclass
class _Tracked:
    ref: TensorRef
    weights: np.ndarray | None  # retained host copies (retain=True)
    scales: np.ndarray | None


class _Rows:
    """Host copy of the KV rows a sequence holds on the worker: float32 [length, K], [., R]."""

    def __init__(self) -> None:
        self.latent = np.zeros((0, 0), np.float32)
        self.rope = np.zeros((0, 0), np.float32)
        self.length = 0
        self.complete = True  # False: rows were sent before we saw them; cannot replay

    def put(self, start: int, latent: np.ndarray, rope: np.ndarray) -> None:
        if start > self.length:
            self.complete = False
            return
        n = len(latent)
        end = start + n
        if end > len(self.latent) or self.latent.shape[1:] != latent.shape[1:]:
            cap = max(end, 2 * len(self.latent), 16)
            lat = np.empty((cap, latent.shape[1]), np.float32)
            rop = np.empty((cap, rope.shape[1]), np.float32)
            if self.latent.shape[1:] == latent.shape[1:]:
                lat[:start], rop[:start] = self.latent[:start], self.rope[:start]
            self.latent, self.rope = lat, rop
        self.latent[start:end], self.rope[start:end] = latent, rope
        self.length = end


def _retried(fn: Callable[..., T], idempotent: bool) -> Callable[..., T]:
    @functools.wraps(fn)
    def method(self: RecoveringClient, *args: Any, **kwargs: Any) -> T:
        return self._retrying(lambda: fn(self, *args, **kwargs), idempotent)

    return method


class RecoveringClient(_Base):
    """A WorkerClient that survives worker restarts (see the module docstring).

    retain: keep a host copy of every uploaded tensor (and update) to re-upload from.
    loader: ``loader(ref) -> (weights, scales)`` returns a tensor's upload arrays again
    (e.g. from the engine's mmapped weights file); used instead of copies.
    retries: transport retries of an idempotent call against the same worker instance.
    recover_timeout: seconds to wait for an unreachable worker before raising Unavailable.
    Other keyword arguments are WorkerClient's (timeout, token, tls, wire_dtype, ...).
    """

    def __init__(
        self,
        address: str,
        *,
        retain: bool = False,
        loader: Loader | None = None,
        retries: int = 3,
        backoff: float = 0.05,
        max_backoff: float = 1.0,
        recover_timeout: float = 30.0,
        token: str | None = None,
        tls: TLS | bool | None = None,
        max_message_bytes: int = 64 << 20,
        channel: grpc.Channel | None = None,
        **kwargs: Any,
    ) -> None:
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                *_RECONNECT,
            ]
            channel = make_channel(address, options, tls=tls, token=token)
        super().__init__(address, channel=channel, max_message_bytes=max_message_bytes, **kwargs)
        self.retain = retain
        self.loader = loader
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.recover_timeout = recover_timeout
        self.restarts = 0  # worker restarts this client recovered from
        self._tensors: dict[int, _Tracked] = {}  # id(ref) -> what restores it
        self._by_handle: dict[int, TensorRef] = {}  # current handle -> ref
        self._remap: dict[int, int] = {}  # handle of a dead instance -> current handle
        self._kv: dict[tuple[int, int], _Rows] = {}  # (id(kv_b ref), sequence id) -> rows
        self._kv_stale: set[tuple[int, int]] = set()  # to replay on their next call
        self._state = threading.RLock()
        self._recover_lock = threading.Lock()
        self._generation = 0
        self._r = threading.local()  # .pending: a new instance answered this thread's call

    @property
    def can_recover(self) -> bool:
        return self.retain or self.loader is not None

    # -- detection ----------------------------------------------------------------------

    def _recovering_to(self) -> str | None:
        """The instance this context's recovery is restoring, if it is inside one."""
        r = _RECOVERING.get()
        return r[1] if r is not None and r[0] == id(self) else None

    def _expected(self) -> str | None:
        return self._recovering_to() or self.instance_id

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        if self._remap:
            self._rewrite(request)
        try:
            resp, call = method.with_call(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            instance = _instance_of(err, trailing=True) or _instance_of(err)
            answered = _instance_of(err, trailing=True) is not None
            expected = self._expected()
            if instance is not None and expected is None:
                self.instance_id = instance
            elif instance is not None and instance != expected:
                raise _Restart(instance) from None
            if not answered and err.code() == grpc.StatusCode.UNAVAILABLE:
                raise _Down(err.details() or "worker unreachable") from None
            raise from_rpc_error(err) from None
        instance = _instance_of(call)
        expected = self._expected()
        if instance is not None:
            if expected is None:
                self.instance_id = instance
            elif instance != expected:
                # A new worker answered and the call was valid there (it named no handle of
                # the old one): keep the answer, restore the rest before returning it.
                self._r.pending = instance
        return resp

    def _rewrite(self, request: Any) -> None:
        """Point handles of dead instances in ``request`` at their re-uploaded copies."""
        if not hasattr(request, "DESCRIPTOR"):
            return  # a stream of chunks
        names = request.DESCRIPTOR.fields_by_name
        for f in _HANDLE_FIELDS:
            if f in names:
                h = getattr(request, f)
                if h in self._remap:
                    setattr(request, f, self._remap[h])
        if "experts" in names:
            for e in request.experts:
                self._rewrite(e)

    # -- retry and recovery -------------------------------------------------------------

    def _retrying(self, attempt: Callable[[], T], idempotent: bool) -> T:
        if self._recovering_to():
            return attempt()  # inside a recovery: its caller handles failures
        tries = 0
        while True:
            generation = self._generation
            self._r.pending = None
            try:
                result = attempt()
            except _Restart as r:
                self._recover(r.instance, generation)
                continue
            except _Down as down:
                tries += 1
                instance = self._wait_for_worker(down)
                if instance != self.instance_id:
                    self._recover(instance, generation)
                elif not idempotent or tries > self.retries:
                    raise Unavailable(
                        f"{down.message}; the call may or may not have run, so it is not "
                        f"retried: fall back to the CPU path"
                        if not idempotent
                        else f"{down.message} ({tries} attempts): fall back to the CPU path"
                    ) from None
                continue
            pending = self._r.pending
            if pending:
                self._r.pending = None
                self._recover(pending, generation)
            return result

    def _wait_for_worker(self, down: _Down) -> str:
        """Poll Info with backoff until the worker answers; returns its instance id."""
        deadline = time.monotonic() + self.recover_timeout
        delay = self.backoff
        while True:
            try:
                resp = self._stub.Info(pb.InfoRequest(), timeout=max(delay * 4, 0.5))
                return str(resp.instance_id)
            except grpc.RpcError as err:
                code = err.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise from_rpc_error(err) from None
                if time.monotonic() + delay > deadline:
                    raise Unavailable(
                        f"worker at {self.address} unreachable for {self.recover_timeout:g} s "
                        f"({down.message}): fall back to the CPU path"
                    ) from None
            time.sleep(delay)
            delay = min(2 * delay, self.max_backoff)

    def _recover(self, instance: str, generation: int) -> None:
        """Restore this client's tensors on worker ``instance`` (once per restart, whichever
        thread gets here first), following further restarts while it does."""
        with self._recover_lock:
            if self._generation != generation:
                return  # another thread already recovered
            while True:
                try:
                    return self._restore(instance)
                except _Restart as r:
                    instance = r.instance
                except _Down as down:
                    instance = self._wait_for_worker(down)

    def _restore(self, instance: str) -> None:
        old = self.instance_id
        with self._state:
            tracked = list(self._tensors.values())
            sequences = len(self._kv)
        if tracked and not self.can_recover:
            with self._state:
                self._tensors.clear()
                self._by_handle.clear()
                self._kv.clear()
                self._kv_stale.clear()
            self.instance_id = instance
            self._generation += 1
            raise WorkerRestarted(
                f"worker at {self.address} restarted (instance {old} -> {instance}): its "
                f"{len(tracked)} tensors and {sequences} KV sequences are gone and this "
                f"client keeps no means to restore them (retain=True or loader=); fall "
                f"back to the CPU path"
            )
        token = _RECOVERING.set((id(self), instance))
        try:
            batch: list[_Tracked] = []
            size = 0
            for t in tracked:
                batch.append(t)
                size += t.ref.nbytes
                if size >= RESTORE_SET_BYTES:
                    self._reupload(batch)
                    batch, size = [], 0
            if batch:
                self._reupload(batch)
        finally:
            _RECOVERING.reset(token)
        with self._state:
            self._kv_stale = set(self._kv)
        self.instance_id = instance
        self._generation += 1
        self.restarts += 1

    def _reupload(self, batch: list[_Tracked]) -> None:
        """Upload a set of tracked tensors again (one upload_many pipeline) and point their
        refs, and stale integer handles, at the new handles."""
        items = []
        for t in batch:
            ref = t.ref
            if t.weights is not None:
                weights, scales = t.weights, t.scales
            else:
                assert self.loader is not None
                weights, scales = self.loader(ref)
            items.append(
                UploadItem(
                    weights,
                    scales,
                    fmt=ref.fmt,
                    in_features=ref.in_features,
                    out_features=ref.out_features,
                    group_size=ref.group_size,
                    device=ref.device,
                )
            )
        news = _Base.upload_many(self, items, progress=False)
        with self._state:
            for t, new in zip(batch, news, strict=True):
                ref = t.ref
                old = ref.handle
                self._by_handle.pop(old, None)
                for k, v in self._remap.items():
                    if v == old:
                        self._remap[k] = new.handle
                self._remap[old] = new.handle
                ref.handle, ref.content_hash, ref.nbytes = new.handle, new.content_hash, new.nbytes
                self._by_handle[ref.handle] = ref

    # -- tracking -----------------------------------------------------------------------

    def _ref_of(self, t: TensorRef | int | None) -> TensorRef | None:
        if t is None:
            return None
        with self._state:
            if isinstance(t, TensorRef):
                return t if id(t) in self._tensors else None
            h = self._remap.get(int(t), int(t))
            return self._by_handle.get(h)

    def _track(self, ref: TensorRef, weights: np.ndarray, scales: np.ndarray | None) -> None:
        keep = self.retain
        tracked = _Tracked(
            ref,
            np.array(weights, copy=True) if keep else None,
            None if scales is None or not keep else np.array(scales, np.float32, copy=True),
        )
        with self._state:
            self._tensors[id(ref)] = tracked
            self._by_handle[ref.handle] = ref

    # -- the API ------------------------------------------------------------------------

    info = _retried(_Base.info, True)
    stats = _retried(_Base.stats, True)
    matmul = _retried(_Base.matmul, True)
    expert_mlp = _retried(_Base.expert_mlp, True)
    expert_group = _retried(_Base.expert_group, True)
    expert_group_routed = _retried(_Base.expert_group_routed, True)
    attention = _retried(_Base.attention, True)

    def session(self, **options: Any) -> RecoveringSession:
        """A Session stream that survives worker restarts too
        (``client/recovering_session.py``); options as ``WorkerClient.session``'s."""
        return RecoveringSession(self, **options)

    @functools.wraps(_Base.upload)
    def upload(self, weights: np.ndarray, scales: np.ndarray | None, **spec: Any) -> TensorRef:
        ref = self._retrying(lambda: _Base.upload(self, weights, scales, **spec), False)
        self._track(ref, weights, scales)
        return ref

    @functools.wraps(_Base.upload_many)
    def upload_many(self, items: Iterable[UploadItem], **kw: Any) -> list[TensorRef]:
        items = list(items)
        refs = self._retrying(lambda: _Base.upload_many(self, items, **kw), False)
        for ref, item in zip(refs, items, strict=True):
            self._track(ref, item.weights, item.scales)
        return refs

    @functools.wraps(_Base.update)
    def update(self, t: TensorRef, weights: np.ndarray, scales: np.ndarray | None, **kw: Any):
        out = self._retrying(lambda: _Base.update(self, t, weights, scales, **kw), False)
        if id(t) in self._tensors:
            self._track(t, weights, scales)
        return out

    @functools.wraps(_Base.free)
    def free(self, t: TensorRef | int) -> int:
        released = self._retrying(lambda: _Base.free(self, t), False)
        ref = self._ref_of(t)
        if ref is not None:
            with self._state:
                self._tensors.pop(id(ref), None)
                self._by_handle.pop(ref.handle, None)
                for key in [k for k in self._kv if k[0] == id(ref)]:
                    self._kv.pop(key)
                    self._kv_stale.discard(key)
        return released

    @functools.wraps(_Base.free_sequence)
    def free_sequence(self, sequence_id: int, kv_b: TensorRef | int | None = None) -> int:
        released = self._retrying(lambda: _Base.free_sequence(self, sequence_id, kv_b), True)
        ref = self._ref_of(kv_b)
        with self._state:
            for key in [k for k in self._kv if k[1] == int(sequence_id)]:
                if kv_b is None or (ref is not None and key[0] == id(ref)):
                    self._kv.pop(key)
                    self._kv_stale.discard(key)
        return released

    @functools.wraps(_Base.attention_ragged)
    def attention_ragged(
        self,
        kv_b: TensorRef | int,
        o_proj: TensorRef | int | None,
        q: np.ndarray,
        *,
        sequences: Sequence[tuple[int, int, np.ndarray, np.ndarray]],
        **dims: Any,
    ) -> np.ndarray:
        ref = self._ref_of(kv_b)
        seqs = [
            (int(sid), int(start), np.asarray(lat, np.float32), np.asarray(rop, np.float32))
            for sid, start, lat, rop in sequences
        ]

        def attempt() -> np.ndarray:
            sent = [self._with_history(ref, *s) for s in seqs]
            return _Base.attention_ragged(self, kv_b, o_proj, q, sequences=sent, **dims)

        out = self._retrying(attempt, True)
        self._record(ref, seqs)
        return out

    def _record(
        self, ref: TensorRef | None, seqs: Sequence[tuple[int, int, np.ndarray, np.ndarray]]
    ) -> None:
        """Keep the rows a ragged call sent (the sequences are now current on the worker)."""
        if ref is None or not self.can_recover:
            return
        with self._state:
            for sid, start, lat, rop in seqs:
                key = (id(ref), sid)
                rows = self._kv.setdefault(key, _Rows())
                if lat.size:
                    rows.put(start, lat.reshape(len(lat), -1), rop.reshape(len(lat), -1))
                elif start <= rows.length:
                    rows.length = start
                self._kv_stale.discard(key)

    def _with_history(
        self, ref: TensorRef | None, sid: int, start: int, lat: np.ndarray, rop: np.ndarray
    ) -> tuple[int, int, np.ndarray, np.ndarray]:
        """After a restart: the sequence's retained rows before ``start``, then the new ones."""
        if ref is None or start == 0:
            return sid, start, lat, rop
        key = (id(ref), sid)
        with self._state:
            if key not in self._kv_stale:
                return sid, start, lat, rop
            rows = self._kv.get(key)
            if rows is None or not rows.complete or rows.length < start:
                return sid, start, lat, rop  # the worker answers FAILED_PRECONDITION
            k, r = rows.latent.shape[1], rows.rope.shape[1]
            return (
                sid,
                0,
                np.concatenate([rows.latent[:start], lat.reshape(-1, k)]),
                np.concatenate([rows.rope[:start], rop.reshape(-1, r)]),
            )

    def expert_group_async(
        self, experts: Iterable[Sequence[Any]], rows: Sequence[int], x: np.ndarray
    ) -> ExpertGroupFuture:
        """Like WorkerClient's; the future recomputes the group if its worker restarted."""
        triples: list[tuple[Any, ...]] = [tuple(e) for e in experts]
        rows = [int(r) for r in rows]
        x = np.array(x, np.float32, copy=True)
        generation = self._generation
        f = self._retrying(lambda: _Base.expert_group_async(self, triples, rows, x), False)
        return _RecoveringFuture(self, f.ticket, generation, triples, rows, x)


class _RecoveringFuture(ExpertGroupFuture):
    def __init__(
        self,
        client: RecoveringClient,
        ticket: int,
        generation: int,
        experts: list[tuple[Any, ...]],
        rows: list[int],
        x: np.ndarray,
    ) -> None:
        super().__init__(client, ticket)
        self._rc, self._generation = client, generation
        self._args = (experts, rows, x)

    def result(self, timeout: float | None = None) -> np.ndarray:
        c = self._rc
        while True:
            generation = c._generation
            try:
                return super().result(timeout)
            except _Restart as r:
                c._recover(r.instance, generation)
                break
            except _Down as down:
                instance = c._wait_for_worker(down)
                if instance != c.instance_id:
                    c._recover(instance, generation)
                    break
            except NotFound:
                if self._generation == c._generation:
                    raise
                break
        # The ticket died with the old worker: compute the group again.
        with self._lock:
            result: np.ndarray | None = self._result  # type: ignore[has-type]
            if result is None:
                result = self._result = c.expert_group(*self._args)
            return result


__all__ = ["Loader", "RecoveringClient"]
