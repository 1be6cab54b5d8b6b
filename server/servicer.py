"""The gRPC handlers: decode, validate, call the store/backend, encode.

Errors become statuses in ONE place (``_guard``): a ``WorkerError`` maps to its status with
its message; anything else is logged with a request id and answered INTERNAL with a generic
message. Validation runs before any resident state changes, so a rejected call leaves every
tensor and KV sequence as it was.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from coliworker import __version__
from coliworker.client import codec
from coliworker.server import upload
from coliworker.server.auth import TokenTable
from coliworker.server.backend import Backend, Pending, Phases, Result
from coliworker.server.compute import ComputeOps
from coliworker.server.config import Config
from coliworker.server.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    WorkerError,
)
from coliworker.server.idle import IdleWatchdog
from coliworker.server.limits import Quota, check_upload
from coliworker.server.owners import owner_limits
from coliworker.server.sequences import SequenceStore
from coliworker.server.session import SessionManager
from coliworker.server.store import Budget, DeviceUsage, Handle, TensorStore
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

INSTANCE_METADATA_KEY = "coliworker-instance"


class Hooks:
    """Observers the metrics module plugs in; no-ops by default."""

    def record_group(self, device: int, experts: int, rows: int, phases: Phases) -> None: ...
    def record_upload(self, device: int, nbytes: int, deduplicated: bool) -> None: ...
    def record_eviction(self, device: int) -> None: ...
    def record_session_request(self, call: str, code: object, seconds: float) -> None: ...


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


def _guard(method: Callable) -> Callable:
    """Turn exceptions into gRPC statuses (the one place this happens)."""

    @functools.wraps(method)
    def wrapper(self: WorkerServicer, request, context: grpc.ServicerContext):
        context.send_initial_metadata(((INSTANCE_METADATA_KEY, self.instance_id),))
        try:
            return method(self, request, context)
        except WorkerError as exc:
            if type(exc) is WorkerError:
                return self._internal(exc, context, method.__name__)
            context.abort(exc.code, exc.message)
        except codec.CodecError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise  # already aborted (context.abort raises)
            return self._internal(exc, context, method.__name__)

    return wrapper


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
        # (owner, (gate, up, down) handles...) -> (store generation, triples, device, D):
        # a decode step resolves and checks the same experts' 3N handles on every call.
        self._expert_cache: dict[tuple, tuple[int, list[tuple], int, int]] = {}
        self.sessions = SessionManager(self)

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

    def _internal(self, exc: BaseException, context: grpc.ServicerContext, op: str):
        request_id = uuid.uuid4().hex[:12]
        log.error("internal error in %s (request %s)", op, request_id, exc_info=exc)
        context.abort(
            grpc.StatusCode.INTERNAL,
            f"internal error (request {request_id}); the worker log has the details",
        )

    def _tensor(self, handle: int, field: str, owner: str) -> Handle:
        if handle == 0:
            raise InvalidArgument(f"{field}: expected a tensor handle, got 0")
        return self.store.get(handle, field, owner)

    # -- info and lifecycle -------------------------------------------------------------

    @_guard
    def Info(self, request, context):
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
        )
        return pb.InfoResponse(
            version=__version__,
            backend=self.backend.name,
            devices=devices,
            limits=limits,
            instance_id=self.instance_id,
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
            references=h.data.refs,
        )

    @_guard
    def Lookup(self, request, context):
        if len(request.content_hash) != 32:
            raise InvalidArgument(
                f"lookup.content_hash: expected 32 bytes (SHA-256), got {len(request.content_hash)}"
            )
        if request.device not in self.devices:
            raise InvalidArgument(
                f"lookup.device: expected one of "
                f"{', '.join(map(str, self.devices))}, got {request.device}"
            )
        h = self.store.lookup(
            request.content_hash, request.device, request.acquire, self.owner(context)
        )
        if h is None:
            return pb.LookupResponse(found=False)
        if request.acquire:
            self.hooks.record_upload(request.device, 0, True)
            return pb.LookupResponse(found=True, tensor=self._info(h))
        return pb.LookupResponse(found=True)

    def _header(self, messages: Iterator, op: str) -> upload.Header:
        return upload.read_header(messages, op, self.devices, self.config.memory_limit)

    @_guard
    def Upload(self, request_iterator, context):
        owner = self.owner(context)
        header = self._header(request_iterator, "upload")
        spec, digest = header.spec, header.content_hash
        if self.store.lookup(digest, spec.device, False) is not None:
            # Resident already (a client that did not probe first): check the bytes, then
            # take a reference, or place them after all should that copy go meanwhile.
            tensor = upload.receive_host(request_iterator, header, "upload", self.staging)
            handle, dedup, phases = self.store.upload(spec, digest, tensor, owner)
        else:
            check_upload(
                self.quota, self.budget, self.backend, spec.device, header.total, owner, "upload"
            )
            incoming = self.store.begin_upload(spec, digest, header.total, owner)
            try:
                upload.receive(request_iterator, header, "upload", incoming, self.staging)
                handle, dedup, phases = incoming.commit()
            finally:
                incoming.abort()  # a no-op once committed
        self.hooks.record_upload(spec.device, 0 if dedup else header.total, dedup)
        return pb.UploadResponse(
            tensor=self._info(handle), deduplicated=dedup, backend_ns=phases.total_ns
        )

    @_guard
    def Update(self, request_iterator, context):
        owner = self.owner(context)
        header = self._header(request_iterator, "update")
        spec = header.spec
        if self.store.lookup(header.content_hash, spec.device, False) is None:
            check_upload(
                self.quota, self.budget, self.backend, spec.device, header.total, owner, "update"
            )
        tensor = upload.receive_host(request_iterator, header, "update", self.staging)
        handle = self._tensor(header.handle, "update.header.handle", owner)
        if handle.spec != spec:
            raise InvalidArgument(
                f"update.header.spec: expected {handle.spec} (the handle's spec), got {spec}"
            )
        self._settle_tickets(handle)
        phases = self.store.update(handle, header.content_hash, tensor)
        self.hooks.record_upload(spec.device, tensor.nbytes, False)
        return pb.UpdateResponse(tensor=self._info(handle), backend_ns=phases.total_ns)

    @_guard
    def Free(self, request, context):
        handle = self._tensor(request.handle, "free.handle", self.owner(context))
        self._settle_tickets(handle)
        with self.sequences.lock:
            self.sequences.drop_handle(handle)
            released, refs = self.store.free(handle)
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

    def usage(self) -> list[DeviceUsage]:
        tensors = self.store.tensor_usage()
        kv = self.sequences.usage()
        return [
            DeviceUsage(d, *tensors[d], *kv.get(d, (0, 0)), self.store.group_totals(d))
            for d in self.devices
        ]

    @_guard
    def Stats(self, request, context):
        out = []
        for u in self.usage():
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

    # -- compute ------------------------------------------------------------------------

    @_guard
    def Matmul(self, request, context):
        return self.matmul(request, self.owner(context))

    @_guard
    def ExpertMlp(self, request, context):
        return self.expert_mlp(request, self.owner(context))

    @_guard
    def ExpertGroup(self, request, context):
        return self.expert_group(request, self.owner(context))

    @_guard
    def ExpertGroupRouted(self, request, context):
        return self.expert_group_routed(request, self.owner(context))

    @_guard
    def ExpertGroupIssue(self, request, context):
        owner = self.owner(context)
        triples, rows, x, device = self._group_args(request, "expert_group_issue", owner)
        with self._lock:
            if len(self._tickets) >= self.config.max_pending_tickets:
                raise ResourceExhausted(
                    f"expert_group_issue: {len(self._tickets)} tickets outstanding, limit "
                    f"{self.config.max_pending_tickets} (--max-pending-tickets); take some first"
                )
        self._begin_compute("expert_group_issue")
        pending = self.backend.expert_group_issue(triples, rows, x)
        ticket = next(self._ticket_ids)
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

    @_guard
    def ExpertGroupTake(self, request, context):
        owner = self.owner(context)
        with self._lock:
            t = self._tickets.get(request.ticket)
            if t is None or t.owner != owner:
                raise NotFound(
                    f"expert_group_take.ticket: unknown or already taken ticket {request.ticket}"
                )
            del self._tickets[request.ticket]
        r = t.settle()
        return self._group_response(r, t.device, t.experts, t.rows, t.output_dtype)

    @_guard
    def Attention(self, request, context):
        return self.attention(request, self.owner(context))

    @_guard
    def AttentionRagged(self, request, context):
        return self.attention_ragged(request, self.owner(context))

    @_guard
    def FreeSequence(self, request, context):
        owner = self.owner(context)
        kv_b = None
        if request.kv_b:
            kv_b = self._tensor(request.kv_b, "free_sequence.kv_b", owner).id
        count, released = self.sequences.free(owner, request.sequence_id, kv_b)
        return pb.FreeSequenceResponse(caches=count, released_bytes=released)

    def Session(self, request_iterator, context):
        """The hot calls multiplexed on one stream (``server/session.py``)."""
        context.send_initial_metadata(((INSTANCE_METADATA_KEY, self.instance_id),))
        return self.sessions.serve(request_iterator, context)


__all__ = ["INSTANCE_METADATA_KEY", "Hooks", "WorkerServicer"]
