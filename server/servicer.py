"""The worker's handlers, one per call of ``service Worker``, and its gRPC methods.

Each handler is named by the call's kind (``info``, ``upload``, ``matmul``...; the compute
ones live in ``compute.py``) and takes ``(request, owner, io)``: the request message, the
caller's owner name and the call's ``ArrayIO``. Every transport runs them through one
``Dispatch`` (``dispatch.py``), which maps errors to statuses; the gRPC methods here are
generated from the call table and only move a call in and its answer out. Validation runs
before any resident state changes, so a rejected call leaves every tensor and KV sequence
as it was.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from coliworker import __version__
from coliworker.server import intake, upload
from coliworker.server.auth import TokenTable
from coliworker.server.backend import Backend, Pending, Phases, Result
from coliworker.server.compute import ComputeOps
from coliworker.server.config import Config
from coliworker.server.dispatch import Dispatch
from coliworker.server.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    WorkerError,
)
from coliworker.server.expert_lists import Experts
from coliworker.server.fastpath import FastCalls
from coliworker.server.idle import IdleWatchdog
from coliworker.server.limits import Quota
from coliworker.server.owners import owner_limits
from coliworker.server.sequences import SequenceStore
from coliworker.server.session import SessionManager
from coliworker.server.store import Budget, DeviceUsage, Handle, TensorStore, held
from coliworker.server.tickets import DataTickets
from coliworker.server.usage import UsageCounts
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc
from coliworker.wire import calls, codec
from coliworker.wire.calls import Call
from coliworker.wire.codec import ArrayIO

log = logging.getLogger(__name__)

INSTANCE_METADATA_KEY = "coliworker-instance"


class Hooks:
    """Observers the metrics module plugs in; no-ops by default."""

    def record_group(self, device: int, experts: int, rows: int, phases: Phases) -> None: ...
    def record_upload(self, device: int, nbytes: int, deduplicated: bool) -> None: ...
    def record_eviction(self, device: int) -> None: ...
    def record_session_request(
        self, call: str, code: object, seconds: float, transport: str = "grpc"
    ) -> None: ...
    def bind_usage(self, top: Callable[[int], dict[int, list[tuple[int, int]]]]) -> None: ...


@dataclass
class _Ticket:
    pending: Pending
    owner: str
    device: int
    experts: int
    rows: int
    output_dtype: int
    residents: frozenset[int] = frozenset()  # id() of the tensors the work reads
    _outcome: Result | BaseException | None = None

    def settle(self) -> Result:
        """Wait for the work once; later calls return (or raise) the same outcome."""
        if self._outcome is None:
            try:
                self._outcome = self.pending.result()
            except BaseException as exc:
                self._outcome = exc
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome


def _unary(call: Call) -> Callable:
    """The gRPC method of a unary call: everything but the transport is ``Dispatch.run``."""

    def method(self: WorkerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve_unary(call, request, context)

    method.__name__ = method.__qualname__ = call.name
    return method


def _uploading(call: Call) -> Callable:
    """The gRPC method of Upload / Update: the stream's messages are the handler's data
    (header first)."""

    def method(self: WorkerServicer, request_iterator: Iterator, context: grpc.ServicerContext):
        return self._serve_unary(call, None, context, request_iterator)

    method.__name__ = method.__qualname__ = call.name
    return method


class WorkerServicer(ComputeOps, pb_grpc.WorkerServicer):
    def __init__(self, config: Config, backend: Backend, hooks: Hooks | None = None) -> None:
        codec.tune_allocator()
        self.config = config
        self.backend = backend
        self.hooks = hooks or Hooks()
        self.instance_id = uuid.uuid4().hex
        self.devices = tuple(config.devices)
        self.budget = Budget(self.devices, config.memory_limit)
        self.tokens = TokenTable.from_config(config)  # None: authentication off
        self.quota = Quota(config.quota)
        self.store = TensorStore(backend, self.devices, self.budget, self.quota)
        # per-handle calls and rows; pruned against the live handles when full (usage.py)
        self.tensor_counts = UsageCounts(live=lambda: self.store._handles)
        self.hooks.bind_usage(self.tensor_counts.top)  # the top-N metrics
        self.staging = upload.Staging(backend)
        self.owners = owner_limits(config)  # per-owner sessions, uploads, staged bytes
        self.idle = IdleWatchdog(config.idle_timeout)  # stalled streams end (idle.py)
        self.sequences = SequenceStore(
            backend,
            self.budget,
            config.max_kv_rows,
            on_evict=self.hooks.record_eviction,
            quota=self.quota,
        )
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._compute_calls = 0
        # (owner, gate, up, down handles of each expert...) -> (store generation, triples,
        # device, D): a decode step resolves and checks the same experts' 3N handles on every
        # call.
        self._expert_cache: dict[tuple, tuple[int, Experts, int, int]] = {}
        # (owner, (gate, up, down) handles) -> (store generation, resident triple, device, D,
        # the (gate, up, down) tuple of the key): a router's new list of known experts is
        # answered triple by triple.
        self._triple_cache: dict[
            tuple[str, tuple[int, int, int]],
            tuple[int, tuple[Any, Any, Any], int, int, tuple[int, int, int]],
        ] = {}
        # (owner, kv_b, o_proj handles) -> (store generation, kv_b, o_proj, o_proj's resident):
        # a decode step's ragged attention resolves the same two handles on every call.
        self._attention_cache: dict[
            tuple[str, int, int], tuple[int, Handle, Handle | None, Any]
        ] = {}
        self.sessions = SessionManager(self)
        self.dispatch = Dispatch(self, self.hooks)
        # the decode calls' compiled path of the data-plane transports (None: the Python's)
        self.fastcalls = FastCalls.of(self)
        # (port, unix socket path, tls) of the socket data plane, set once it listens
        self.data_endpoint: tuple[int, str, bool] = (0, "", False)
        self.data_tickets = DataTickets()

    # -- plumbing -----------------------------------------------------------------------

    def owner(self, context: grpc.ServicerContext) -> str:
        """Who owns the handles this call may touch: the name of the call's bearer token
        ("" when authentication is off). AuthInterceptor has already refused calls without
        a valid token; this is the second line of defence."""
        if self.tokens is None:
            return ""
        owner = self.tokens.owner_from_metadata(context.invocation_metadata())
        if owner is None:
            raise Unauthenticated("missing or invalid bearer token")
        return owner

    def _serve_unary(
        self,
        call: Call,
        request: Any,
        context: grpc.ServicerContext,
        data: Iterator | None = None,
    ) -> Any:
        context.send_initial_metadata(((INSTANCE_METADATA_KEY, self.instance_id),))
        try:
            owner = self.owner(context)
        except WorkerError as exc:
            context.abort(exc.code, exc.message)
        out = self.dispatch.run(call, request, owner, data=data)
        if not out.ok:
            context.abort(out.code, out.message)
        return out.response

    def _tensor(self, handle: int, field: str, owner: str) -> Handle:
        if handle == 0:
            raise InvalidArgument(f"{field}: expected a tensor handle, got 0")
        return self.store.get(handle, field, owner)

    # -- info and lifecycle -------------------------------------------------------------

    def info(self, request: pb.InfoRequest, owner: str, io: ArrayIO) -> pb.InfoResponse:
        limit = self.config.memory_limit
        devices = [
            pb.DeviceInfo(
                id=d.id,
                name=d.name,
                total_memory_bytes=d.total_memory_bytes,
                free_memory_bytes=d.free_memory_bytes,
                memory_limit_bytes=limit,
            )
            for d in self.backend.devices()
        ]
        c = self.config
        limits = pb.Limits(
            max_experts=c.max_experts,
            max_message_bytes=c.max_message_bytes,
            upload_chunk_bytes=codec.CHUNK_BYTES,
            max_pending_tickets=c.max_pending_tickets,
            max_sequences_per_call=c.max_sequences_per_call,
            max_kv_rows=c.max_kv_rows,
            max_frame_bytes=c.max_frame_bytes,
        )
        port, unix_path, tls = self.data_endpoint
        return pb.InfoResponse(
            version=__version__,
            backend=self.backend.name,
            devices=devices,
            limits=limits,
            instance_id=self.instance_id,
            data_port=port,
            data_unix_socket=unix_path,
            data_tls=tls,
        )

    def _info(self, h: Handle) -> pb.TensorInfo:
        s = h.spec
        return pb.TensorInfo(
            handle=h.id,
            spec=pb.TensorSpec(
                fmt=s.fmt,
                in_features=s.in_features,
                out_features=s.out_features,
                group_size=s.group_size,
                device=s.device,
            ),
            content_hash=h.data.content_hash,
            nbytes=h.data.nbytes,
            references=h.data.holders.get(h.owner, 0),  # this owner's own handles on it
        )

    def lookup(self, request: pb.LookupRequest, owner: str, io: ArrayIO) -> pb.LookupResponse:
        if len(request.content_hash) != 32:
            raise InvalidArgument(
                f"lookup.content_hash: expected 32 bytes (SHA-256), got {len(request.content_hash)}"
            )
        if request.device not in self.devices:
            raise InvalidArgument(
                f"lookup.device: expected one of "
                f"{', '.join(map(str, self.devices))}, got {request.device}"
            )
        h = self.store.lookup(request.content_hash, request.device, request.acquire, owner)
        if h is None:
            return pb.LookupResponse(found=False)
        if request.acquire:
            self.hooks.record_upload(request.device, 0, True)
            return pb.LookupResponse(found=True, tensor=self._info(h))
        return pb.LookupResponse(found=True)

    def _header(self, header: pb.UploadHeader | None, data: Iterator, op: str) -> upload.Header:
        """The checked header: the message itself (data plane) or the first of ``data``
        (a gRPC stream)."""
        if header is None:
            return upload.read_header(data, op, self.devices, self.config.memory_limit)
        return upload.check_header(header, op, self.devices, self.config.memory_limit)

    def upload(
        self,
        header_msg: pb.UploadHeader | None,
        owner: str,
        io: ArrayIO,
        request_iterator: Iterator,
    ) -> pb.UploadResponse:
        handle, dedup, phases, header = intake.put(self, header_msg, request_iterator, owner)
        self.hooks.record_upload(header.spec.device, 0 if dedup else header.total, dedup)
        return pb.UploadResponse(
            tensor=self._info(handle), deduplicated=dedup, backend_ns=phases.total_ns
        )

    def update(
        self,
        header_msg: pb.UploadHeader | None,
        owner: str,
        io: ArrayIO,
        request_iterator: Iterator,
    ) -> pb.UpdateResponse:
        handle, phases, header = intake.replace(self, header_msg, request_iterator, owner)
        self.hooks.record_upload(header.spec.device, header.total, False)
        return pb.UpdateResponse(tensor=self._info(handle), backend_ns=phases.total_ns)

    def free(self, request: pb.FreeRequest, owner: str, io: ArrayIO) -> pb.FreeResponse:
        handle = self._tensor(request.handle, "free.handle", owner)
        self._settle_tickets(handle)
        with self.sequences.ordered(handle):  # after a ragged call on it ends
            self.sequences.drop_handle(handle)
            released, refs = self.store.free(handle)
        self.tensor_counts.drop(handle.id)
        return pb.FreeResponse(released_bytes=released, references=refs)

    def _settle_tickets(self, handle: Handle) -> None:
        """Issued work still reading this tensor finishes before its data changes or goes
        (its result is kept for the take)."""
        key = id(handle.data.resident)
        with self._lock:
            waiting = [t for t in self._tickets.values() if key in t.residents]
        for t in waiting:
            try:
                t.settle()
            except Exception:
                pass  # reported to whoever takes the ticket

    def usage(self, owner: str | None = None) -> list[DeviceUsage]:
        """Residency by device: the worker's (metrics), or one owner's (its Stats)."""
        tensors = self.store.tensor_usage(owner)
        kv = self.sequences.usage(owner)
        return [
            DeviceUsage(d, *tensors[d], *kv.get(d, (0, 0)), self.store.group_totals(d))
            for d in self.devices
        ]

    def stats(self, request: pb.StatsRequest, owner: str, io: ArrayIO) -> pb.StatsResponse:
        out = []
        for u in self.usage(owner):  # an owner sees its own residency only
            g = u.group
            out.append(
                pb.DeviceStats(
                    device=u.device,
                    tensors=u.tensors,
                    tensor_bytes=u.tensor_bytes,
                    handles=u.handles,
                    kv_sequences=u.kv_sequences,
                    kv_bytes=u.kv_bytes,
                    group=pb.GroupStats(
                        calls=g.calls,
                        experts=g.experts,
                        rows=g.rows,
                        h2d_ns=g.h2d_ns,
                        kernel_ns=g.kernel_ns,
                        d2h_ns=g.d2h_ns,
                    ),
                )
            )
        return pb.StatsResponse(devices=out)

    # -- compute (the per-op handlers are ComputeOps'; tickets here) ------------------

    @held
    def expert_group_issue(
        self, request: pb.ExpertGroupRequest, owner: str, io: ArrayIO
    ) -> pb.ExpertGroupTicket:
        triples, rows, x, device = self._group_args(request, "expert_group_issue", owner, io)
        with self._lock:
            mine = sum(1 for t in self._tickets.values() if t.owner == owner)
            if mine >= self.config.max_pending_tickets:  # per owner: none blocks another
                raise ResourceExhausted(
                    f"expert_group_issue: {mine} tickets of this owner outstanding, limit "
                    f"{self.config.max_pending_tickets} (--max-pending-tickets); take some first"
                )
        self._begin_compute("expert_group_issue")
        pending = self.backend.expert_group_issue(triples, rows, x)
        self.tensor_counts.experts(device, triples.ids, rows)
        ticket = secrets.randbits(62) + 1  # random: says nothing of other owners' tickets
        with self._lock:
            self._tickets[ticket] = _Ticket(
                pending,
                owner,
                device,
                len(triples),
                sum(rows),
                request.output_dtype or request.x.dtype,
                frozenset(id(r) for triple in triples for r in triple),
            )
        return pb.ExpertGroupTicket(ticket=ticket)

    def expert_group_take(
        self, request: pb.ExpertGroupTakeRequest, owner: str, io: ArrayIO
    ) -> pb.ExpertGroupResponse:
        with self._lock:
            t = self._tickets.get(request.ticket)
            if t is None or t.owner != owner:
                raise NotFound(
                    f"expert_group_take.ticket: unknown or already taken ticket {request.ticket}"
                )
            del self._tickets[request.ticket]
        r = t.settle()
        self._group_done(r, t.device, t.experts, t.rows)
        return self._group_response(r, t.output_dtype, io)

    def free_sequence(
        self, request: pb.FreeSequenceRequest, owner: str, io: ArrayIO
    ) -> pb.FreeSequenceResponse:
        kv_b = None
        if request.kv_b:
            kv_b = self._tensor(request.kv_b, "free_sequence.kv_b", owner).id
        count, released = self.sequences.free(owner, request.sequence_id, kv_b)
        return pb.FreeSequenceResponse(caches=count, released_bytes=released)

    def data_ticket(
        self, request: pb.DataTicketRequest, owner: str, io: ArrayIO
    ) -> pb.DataTicketResponse:
        ticket = self.data_tickets.issue(owner)
        return pb.DataTicketResponse(ticket=ticket, expires_ms=self.data_tickets.ttl_ms)

    def tensor_usage(
        self, request: pb.TensorUsageRequest, owner: str, io: ArrayIO
    ) -> pb.TensorUsageResponse:
        device = request.device
        if device != -1 and device not in self.devices:
            raise InvalidArgument(
                f"tensor_usage.device: expected -1 (all) or one of "
                f"{', '.join(map(str, self.devices))}, got {device}"
            )
        mine = [(h.id, h.spec.device) for h in self.store.handles_of(owner)]
        rows = self.tensor_counts.of(t for t in mine if device in (-1, t[1]))
        return pb.TensorUsageResponse(
            tensors=[
                pb.TensorUsage(handle=h, device=d, calls=c, rows=r)
                for h, d, c, r in rows[: request.top or None]
            ]
        )

    # -- gRPC -------------------------------------------------------------------------------

    def Session(self, request_iterator, context):
        """The hot calls multiplexed on one stream (``server/session.py``)."""
        context.send_initial_metadata(((INSTANCE_METADATA_KEY, self.instance_id),))
        return self.owners.session_stream(  # one of the owner's --max-sessions-per-owner
            self.owner(context), context, lambda: self.sessions.serve(request_iterator, context)
        )


for _c in calls.CALLS:
    if _c.name != "Session":
        setattr(WorkerServicer, _c.name, (_uploading if _c.streams_data else _unary)(_c))


__all__ = ["INSTANCE_METADATA_KEY", "Hooks", "WorkerServicer"]
