"""``WorkerPool``: several workers as one client, their GPUs numbered 0..N-1.

    pool = WorkerPool(["gpu-a:50051", "gpu-b:50051"])            # or one DNS name
    pool = WorkerPool("coliworker.ns.svc:50051", retain=True)    # recovering members
    e = pool.upload(w, s, fmt=2, in_features=I, out_features=O, device=3)  # on worker 1
    y = pool.expert_group([(g, u, d)], [S], x)                   # runs where its tensors are
    with pool.session(transport="socket") as s: fut = s.expert_group_routed(...)

Devices: each member's devices in the order it reports them, members in address order
(worker 0's devices first). A tensor uploaded with ``device=k`` lives on the member that
owns k and comes back as a ``PoolRef`` (a ``TensorRef`` whose ``device`` is k); a call goes
to the member its tensors are on, and one naming tensors of two members is refused with
``InvalidArgument`` naming both fields, workers and devices (a group call runs on one GPU).

Members are ``WorkerClient``s, or ``RecoveringClient``s with any of the recovering options
(``retain``, ``loader``, ``retries``, ``backoff``, ``max_backoff``, ``recover_timeout``).
A member that stops answering is marked down: calls on its devices raise ``Unavailable``
at once (the engine runs those experts on the CPU) while the other members serve; every
``probe_interval`` seconds one call first asks it for ``Info``, and when it answers it is
up again. A recovering member restores its tensors and KV sequences then (on the first
call that meets the new instance); a plain one that restarted lost them, and calls naming
them raise ``WorkerRestarted``. ``addresses`` given as one name (``host:port``) is resolved
to its addresses (a Kubernetes headless Service: one per pod, named by their stable pod
names where reverse DNS has them) and resolved again when a member fails: new members add
devices after the existing ones; a member whose address went is re-pointed at a new one.

The session (``PoolSession``) opens one session per member with the same transport and
routes each call to its member's session; ``free_sequence`` without ``kv_b`` goes to
every member that is up.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from coliworker.client import errors
from coliworker.client.pool_members import (
    PROBE_INTERVAL,
    PROBE_TIMEOUT,
    RECONNECT,
    RECOVERY_OPTIONS,
    PoolRef,
    Resolver,
    _Member,
    resolve,
)
from coliworker.client.pool_routes import on_client
from coliworker.client.recovery import RecoveringClient
from coliworker.client.security import make_channel
from coliworker.client.uploads import UploadItem
from coliworker.client.worker import DeviceInfo, DeviceStats, TensorRef, WorkerClient, WorkerInfo
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc

#: Expert lists whose routing is kept (cleared when full).
ROUTES_KEPT = 4096


class WorkerPool:
    """Several workers as one client (see the module docstring).

    addresses: a list of ``host:port``, or one ``host:port`` name that resolves to several
    workers. devices_per_worker: how many devices each member serves, if known: then a
    member down at construction still owns its device ids (else every member is asked
    for Info at construction). resolver: ``name -> [host:port]`` (default ``resolve``).
    Other keyword arguments go to each member (``timeout``, ``token``, ``tls``,
    ``wire_dtype``; the recovering options make members ``RecoveringClient``s).
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        devices_per_worker: int | None = None,
        probe_interval: float = PROBE_INTERVAL,
        resolver: Resolver | None = None,
        **client_options: Any,
    ) -> None:
        self._name = addresses if isinstance(addresses, str) else None
        self._resolver = resolver or resolve
        listed = self._resolver(addresses) if isinstance(addresses, str) else list(addresses)
        if not listed:
            raise ValueError(
                f"WorkerPool.addresses: expected at least one worker, got {addresses!r}"
            )
        self.recovering = any(k in client_options for k in RECOVERY_OPTIONS)
        if self.recovering:
            client_options.setdefault("recover_timeout", 1.0)  # a dead member fails fast
        client_options.setdefault("progress", False)
        self._options = client_options
        self._per_worker = devices_per_worker
        self.probe_interval = probe_interval
        self._lock = threading.RLock()
        self._members: list[_Member] = []
        self._device: list[tuple[_Member, int]] = []  # pool device -> (member, local id)
        self._refs: dict[int, PoolRef] = {}  # handle -> ref (raw integer handles)
        self._live: dict[int, PoolRef] = {}  # id(ref) -> ref
        self._local = threading.local()
        # expert lists -> (member, its epoch, the member's refs): see _experts
        self._routes: dict[tuple, tuple[_Member, int, list[tuple[Any, ...]]]] = {}
        self._resolved_at = time.monotonic()
        for address in listed:
            self._add(address)

    # -- members --------------------------------------------------------------------------

    def _client(self, address: str) -> WorkerClient:
        if self.recovering:
            return RecoveringClient(address, **self._options)
        return WorkerClient(address, channel=self._channel(address), **self._options)

    def _channel(self, address: str) -> Any:
        """A channel that reconnects within a second of a member coming back (gRPC's own
        backoff grows to two minutes)."""
        size = self._options.get("max_message_bytes", 64 << 20)
        options = [
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            *RECONNECT,
        ]
        o = self._options
        return make_channel(address, options, tls=o.get("tls"), token=o.get("token"))

    def _add(self, address: str) -> _Member:
        """A new member after the existing ones: its devices follow theirs."""
        m = _Member(len(self._members), address, self._client(address), len(self._device))
        try:
            m.info = m.client.info()
            m.local, m.instance = tuple(d.id for d in m.info.devices), m.info.instance_id
        except errors.Unavailable:
            if self._per_worker is None:
                m.client.close()
                raise errors.Unavailable(
                    f"WorkerPool: worker {m.index} ({address}) did not answer, so its "
                    f"devices cannot be numbered; start it first or pass devices_per_worker"
                ) from None
            m.local, m.down_since = tuple(range(self._per_worker)), time.monotonic()
        if self._per_worker is not None and len(m.local) != self._per_worker:
            raise errors.InvalidArgument(
                f"WorkerPool.devices_per_worker: expected {self._per_worker} devices on "
                f"worker {m.index} ({address}), it serves {len(m.local)}"
            )
        self._members.append(m)
        self._device += [(m, d) for d in m.local]
        return m

    @property
    def members(self) -> list[_Member]:
        return list(self._members)

    @property
    def device_count(self) -> int:
        return len(self._device)

    def device_of(self, device: int) -> tuple[int, int]:
        """(member index, the member's own device id) of pool device ``device``."""
        m, local = self._at(device, "device")
        return m.index, local

    def _at(self, device: int, field: str) -> tuple[_Member, int]:
        if not 0 <= device < len(self._device):
            raise errors.InvalidArgument(
                f"{field}: expected 0..{len(self._device) - 1} (the pool's devices), got {device}"
            )
        return self._device[device]

    def up(self, member: int) -> bool:
        """Whether the member answered its last call."""
        return self._members[member].down_since is None

    def _ready(self, m: _Member) -> None:
        """Raise Unavailable at once for a member that is down, unless it is time to probe
        it; a probe that finds it up marks it up (and notes a restart)."""
        if m.down_since is None:
            return
        with m.lock:
            if m.down_since is None:
                return
            now = time.monotonic()
            if now - m.last_try < self.probe_interval:
                raise self._down(m, now)
            m.last_try = now
            instance = self._probe(m)
            if instance is None:
                raise self._down(m, now)
            if instance != m.instance and not self.recovering:
                m.epoch += 1  # its tensors are gone with the old instance
            m.instance, m.down_since = instance, None
            m.revived += 1

    @staticmethod
    def _down(m: _Member, now: float) -> errors.Unavailable:
        since = now - (m.down_since or now)
        return errors.Unavailable(
            f"{m.name()} is down (for {since:.1f} s): fall back to the CPU path"
        )

    def _probe(self, m: _Member) -> str | None:
        """The member's instance if it answers Info within PROBE_TIMEOUT, else None (after
        re-resolving the pool's name, which may re-point it)."""
        for attempt in range(2):
            try:
                r = m.client._stub.Info(
                    pb.InfoRequest(), timeout=PROBE_TIMEOUT, wait_for_ready=True
                )
                return str(r.instance_id)
            except Exception:
                if attempt or not self._reresolve(m):
                    return None
        return None

    def _failed(self, m: _Member, err: errors.WorkerError) -> None:
        """A call on ``m`` raised Unavailable: down if Info does not answer either (a
        compute fault the worker reports is not a dead worker)."""
        if m.down_since is not None or isinstance(err, errors.WorkerRestarted):
            return
        with m.lock:
            if m.down_since is None and self._probe(m) is None:
                m.down_since = m.last_try = time.monotonic()

    def _reresolve(self, m: _Member) -> bool:
        """Resolve the pool's name again (at most once per probe interval): new addresses
        become new members; ``m``, if its address went, takes a new one. True if ``m``
        was re-pointed."""
        if self._name is None or time.monotonic() - self._resolved_at < self.probe_interval:
            return False
        with self._lock:
            self._resolved_at = time.monotonic()
            try:
                found = self._resolver(self._name)
            except (OSError, ValueError):
                return False
            known = {x.address for x in self._members}
            fresh = [a for a in found if a not in known]
            moved = False
            if m.address not in found and fresh:
                self._repoint(m, fresh.pop(0))
                moved = True
            for address in fresh:
                try:
                    self._add(address)
                except errors.WorkerError:
                    pass  # not up yet: the next failure resolves again
            return moved

    def _repoint(self, m: _Member, address: str) -> None:
        """Point member ``m``'s client at ``address`` (a pod that came back elsewhere); a
        recovering client keeps what it tracks and restores it there."""
        c = m.client
        old = c._channel
        c._channel = self._channel(address)
        c._stub = pb_grpc.WorkerStub(c._channel)
        c._raw.clear()
        c.address = m.address = address
        m.generation += 1
        old.close()

    def _run(self, m: _Member, fn: Callable[[], Any]) -> Any:
        self._ready(m)
        self._local.member = m
        try:
            return fn()
        except errors.Unavailable as err:
            self._failed(m, err)
            raise
        except errors.NotFound:
            self._restarted(m)
            raise

    def _restarted(self, m: _Member) -> None:
        """A plain member answered NotFound: if it is a new instance (it restarted between
        two calls, never seen down), its tensors are gone: raise WorkerRestarted."""
        if self.recovering:
            return
        instance = self._probe(m)
        with m.lock:
            if instance is None or instance == m.instance:
                return
            m.instance, m.epoch = instance, m.epoch + 1
        raise errors.WorkerRestarted(
            f"{m.name()} restarted (instance {instance}): its tensors are gone (a pool "
            f"without retain/loader); upload them again or fall back to the CPU path"
        )

    # -- routing ----------------------------------------------------------------------------

    def _where(self, op: str, field: str, t: Any) -> tuple[_Member, Any, int | None]:
        """(member, the member's own reference or handle, pool device) of one argument."""
        if isinstance(t, PoolRef):
            m = self._members[t.member]
            self._ready(m)  # a member down raises here; one back may have restarted
            if t.epoch != m.epoch:
                raise errors.WorkerRestarted(
                    f"{op}.{field}: tensor {t.handle} was on {m.name()}, which restarted: "
                    f"its tensors are gone (a pool without retain/loader); upload it again "
                    f"or fall back to the CPU path"
                )
            return m, t.inner, t.device
        h = int(getattr(t, "handle", t))
        ref = self._refs.get(h)
        if ref is None:
            with self._lock:  # handles a recovery changed: look again by current handle
                self._refs.update({r.handle: r for r in self._live.values()})
                ref = self._refs.get(h)
        if ref is not None:
            return self._where(op, field, ref)
        if len(self._members) == 1:
            return self._members[0], t, None
        raise errors.NotFound(
            f"{op}.{field}: unknown tensor handle {h} (not uploaded through this pool; pass "
            f"its PoolRef)"
        )

    def _route(self, op: str, named: Iterable[tuple[str, Any]]) -> tuple[_Member, list[Any]]:
        """The one member every named tensor is on, and the arguments as that member's."""
        first: tuple[str, _Member, int | None] | None = None
        out = []
        for field, t in named:
            if t is None or (isinstance(t, int) and t == 0):
                out.append(t)
                continue
            m, inner, device = self._where(op, field, t)
            if first is None:
                first = (field, m, device)
            elif m is not first[1]:
                raise errors.InvalidArgument(
                    f"{op}.{field}: expected a tensor on worker {first[1].index} "
                    f"({first[1].address}, device {first[2]}) like {op}.{first[0]}, got one "
                    f"on worker {m.index} ({m.address}, device {device}): a call runs on one "
                    f"worker"
                )
            out.append(inner)
        if first is None:
            raise errors.InvalidArgument(f"{op}: expected a tensor handle, got none")
        return first[1], out

    def _experts(
        self, op: str, experts: Iterable[Sequence[Any]]
    ) -> tuple[_Member, list[tuple[Any, ...]]]:
        """``_route`` of an expert list; a decode step sends the same lists every token, so
        their routing is kept (by the refs themselves; dropped on free, checked against
        the member's state): ~1 us instead of ~20 for 8 experts."""
        triples = [tuple(e) for e in experts]
        try:
            key = tuple(triples)
            hit = self._routes.get(key)
        except TypeError:  # an unhashable handle: route it the long way
            key, hit = None, None
        if hit is not None:
            m, epoch, out = hit
            if m.down_since is None and m.epoch == epoch:
                return m, out
        m, out = self._experts_routed(op, triples)
        if key is not None:
            if len(self._routes) >= ROUTES_KEPT:
                self._routes.clear()
            self._routes[key] = (m, m.epoch, out)
        return m, out

    def _experts_routed(
        self, op: str, triples: list[tuple[Any, ...]]
    ) -> tuple[_Member, list[tuple[Any, ...]]]:
        names = ("gate", "up", "down")
        m, flat = self._route(
            op,
            (
                (f"experts[{c}].{names[j]}", t)
                for c, e in enumerate(triples)
                for j, t in enumerate(e)
            ),
        )
        return m, [tuple(flat[3 * c : 3 * c + 3]) for c in range(len(triples))]

    def _wrap(self, m: _Member, inner: TensorRef, device: int) -> PoolRef:
        ref = PoolRef(inner, device, m.index, m.epoch)
        with self._lock:
            self._refs[ref.handle] = ref
            self._live[id(ref)] = ref
        return ref

    # -- info and lifecycle -------------------------------------------------------------------

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for m in self._members:
            m.client.close()

    @property
    def last_call(self) -> Any:
        """backend_ns (and ragged lengths) of this thread's last call, on its member."""
        m = getattr(self._local, "member", None) or self._members[0]
        return m.client.last_call

    def info(self) -> WorkerInfo:
        """The pool as one worker: every device with its pool id (a member that is down
        shows what it last reported), the smallest of each limit, members' versions and
        instances joined with ','."""
        infos = []
        for m in self._members:
            try:
                m.info = self._run(m, m.client.info)
            except errors.Unavailable:
                pass
            infos.append((m, m.info))
        devices = []
        for m, info in infos:
            by_id = {d.id: d for d in info.devices} if info else {}
            for g, local in zip(m.devices, m.local, strict=True):
                d = by_id.get(local)
                devices.append(
                    dataclasses.replace(d, id=g) if d else DeviceInfo(g, "down", 0, 0, 0)
                )
        known = [i for _, i in infos if i is not None]
        limits: dict[str, int] = {}
        for i in known:
            for k, v in i.limits.items():
                limits[k] = min(limits.get(k, v), v)
        return WorkerInfo(
            ",".join(sorted({i.version for i in known})),
            ",".join(sorted({i.backend for i in known})),
            ",".join(i.instance_id for i in known),
            tuple(devices),
            limits,
        )

    def stats(self) -> list[DeviceStats]:
        """Every up member's devices' stats, with pool device ids."""
        out = []
        for m in self._members:
            try:
                rows = self._run(m, m.client.stats)
            except errors.Unavailable:
                continue
            local = {d: g for g, d in zip(m.devices, m.local, strict=True)}
            out += [dataclasses.replace(s, device=local[s.device]) for s in rows]
        return out

    def upload(
        self, weights: np.ndarray, scales: np.ndarray | None, *, device: int = 0, **spec: Any
    ) -> PoolRef:
        """``WorkerClient.upload`` onto pool device ``device``."""
        m, local = self._at(device, "upload.device")
        inner = self._run(m, lambda: m.client.upload(weights, scales, device=local, **spec))
        return self._wrap(m, inner, device)

    def upload_many(self, items: Iterable[UploadItem], **kw: Any) -> list[PoolRef]:
        """``WorkerClient.upload_many`` over the pool: each member's items in one pipeline,
        the members' at once; all or nothing (an item that fails releases what every member
        took, and the error names ``upload_many.items[k]`` with the pool's k)."""
        items = list(items)
        groups: dict[int, list[int]] = {}
        for k, item in enumerate(items):
            m, _ = self._at(item.device, f"upload_many.items[{k}].device")
            groups.setdefault(m.index, []).append(k)

        def one(index: int) -> list[TensorRef]:
            m = self._members[index]
            mine = [
                dataclasses.replace(items[k], device=self._device[items[k].device][1])
                for k in groups[index]
            ]
            return self._run(m, lambda: m.client.upload_many(mine, **kw))

        with ThreadPoolExecutor(max(1, len(groups))) as ex:
            futures = {i: ex.submit(one, i) for i in groups}
        done = {i: f.result() for i, f in futures.items() if f.exception() is None}
        failed = [(i, f.exception()) for i, f in futures.items() if f.exception() is not None]
        if failed:
            for i, refs in done.items():
                for r in refs:
                    try:
                        self._members[i].client.free(r)
                    except errors.WorkerError:
                        pass
            i, exc = failed[0]
            assert exc is not None
            at = getattr(exc, "index", None)
            if isinstance(exc, errors.WorkerError) and isinstance(at, int):
                g = groups[i][at]
                err = type(exc)(exc.message.replace(f"items[{at}]", f"items[{g}]", 1), exc.code)
                err.index = g  # type: ignore[attr-defined]
                raise err from None
            raise exc
        out: list[PoolRef | None] = [None] * len(items)
        for i, refs in done.items():
            for k, r in zip(groups[i], refs, strict=True):
                out[k] = self._wrap(self._members[i], r, items[k].device)
        return out  # type: ignore[return-value]

    def update(
        self, t: PoolRef, weights: np.ndarray, scales: np.ndarray | None, **kw: Any
    ) -> PoolRef:
        m, (inner,) = self._route("update", [("t", t)])
        self._run(m, lambda: m.client.update(inner, weights, scales, **kw))
        return t

    def free(self, t: Any) -> int:
        """Drop this reference; returns the bytes its worker released."""
        m, (inner,) = self._route("free", [("handle", t)])
        released = int(self._run(m, lambda: m.client.free(inner)))
        with self._lock:
            ref = t if isinstance(t, PoolRef) else self._refs.get(int(getattr(t, "handle", t)))
            if ref is not None:
                self._live.pop(id(ref), None)
                self._refs.pop(ref.handle, None)
            self._routes.clear()  # a kept route may name it (or its raw handle)
        return released

    def free_sequence(self, sequence_id: int, kv_b: Any = None) -> int:
        """A sequence's KV caches: of one kv_b (its member), or on every member that is up."""
        if kv_b is not None:
            m, (inner,) = self._route("free_sequence", [("kv_b", kv_b)])
            return int(self._run(m, lambda: m.client.free_sequence(sequence_id, inner)))
        total = 0
        for m in self._members:
            try:
                total += int(self._run(m, functools.partial(m.client.free_sequence, sequence_id)))
            except errors.Unavailable:
                pass
        return total

    def tensor_usage(
        self, top: int = 0, device: int = -1
    ) -> list[tuple[PoolRef | int, int, int, int]]:
        """(ref, pool device, calls, rows) of this pool's tensors, most called first, from
        every member that is up (``TensorUsage``); ``device`` filters one pool device."""
        members = self._members
        if device != -1:
            members = [self._at(device, "tensor_usage.device")[0]]
        out = []
        for m in members:
            local = -1 if device == -1 else self._device[device][1]
            req = pb.TensorUsageRequest(top=top, device=local)
            try:
                r = self._run(m, functools.partial(m.client._call, m.client._stub.TensorUsage, req))
            except errors.Unavailable:
                continue
            to_pool = dict(zip(m.local, m.devices, strict=True))
            for u in r.tensors:
                ref = self._refs.get(u.handle)
                out.append((ref or int(u.handle), to_pool[u.device], int(u.calls), int(u.rows)))
        out.sort(key=lambda t: (-t[2], -t[3]))
        return out[: top or None]

    # -- compute: each call on the member its tensors are on (``pool_routes.py``) ------------

    matmul = on_client("matmul")
    expert_mlp = on_client("expert_mlp")
    expert_group = on_client("expert_group")
    expert_group_async = on_client("expert_group_async")
    expert_group_routed = on_client("expert_group_routed")
    attention = on_client("attention")
    attention_ragged = on_client("attention_ragged")

    def session(self, transport: str | None = None, **options: Any) -> Any:
        """A session over every member (``PoolSession``): one member session each, opened
        with ``transport`` and ``options`` as ``WorkerClient.session``'s."""
        from coliworker.client.pool_session import PoolSession

        return PoolSession(self, transport, **options)

    def rebalance(
        self,
        plan: Any,
        experts: Any,
        load: Callable[[Any], Sequence[UploadItem]],
        swap: Callable[[dict], None] | None = None,
    ) -> dict:
        """Move experts as ``plan`` says (``coliworker.client.placement``); see
        ``placement.rebalance``."""
        from coliworker.client.placement import rebalance

        return rebalance(self, plan, experts, load, swap)


__all__ = ["PoolRef", "WorkerPool", "resolve"]
