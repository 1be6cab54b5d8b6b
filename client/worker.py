"""``WorkerClient``: the Python API of a coliworker.

Arrays are NumPy, float32 in and out. Tensors are uploaded once: the client hashes the
content and asks the worker whether it already holds it before sending any bytes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from coliworker.client import requests, uploads
from coliworker.client.errors import WorkerError, from_rpc_error
from coliworker.client.security import TLS, make_channel
from coliworker.client.unary import UnaryCalls, sync
from coliworker.client.uploads import UploadItem, _Progress
from coliworker.kernels.qtensor import row_bytes, scale_count
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc
from coliworker.wire import codec

T = TypeVar("T")
INSTANCE_METADATA_KEY = "coliworker-instance"


@dataclass
class TensorRef:
    """A resident tensor as this client holds it (one reference on the worker)."""

    handle: int
    fmt: int
    in_features: int
    out_features: int
    group_size: int
    device: int
    content_hash: bytes
    nbytes: int
    deduplicated: bool = False

    @classmethod
    def _from(cls, info: pb.TensorInfo, deduplicated: bool = False) -> TensorRef:
        s = info.spec
        return cls(
            info.handle,
            s.fmt,
            s.in_features,
            s.out_features,
            s.group_size,
            s.device,
            info.content_hash,
            info.nbytes,
            deduplicated,
        )


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    name: str
    total_memory_bytes: int
    free_memory_bytes: int
    memory_limit_bytes: int


@dataclass(frozen=True)
class WorkerInfo:
    version: str
    backend: str
    instance_id: str
    devices: tuple[DeviceInfo, ...]
    limits: dict[str, int]


@dataclass(frozen=True)
class GroupStats:
    calls: int
    experts: int
    rows: int
    h2d_ns: int
    kernel_ns: int
    d2h_ns: int


@dataclass(frozen=True)
class DeviceStats:
    device: int
    tensors: int
    tensor_bytes: int
    handles: int
    kv_sequences: int
    kv_bytes: int
    group: GroupStats


@dataclass
class CallInfo:
    """Details of the last compute call on this client (per thread)."""

    backend_ns: int = 0
    lengths: list[int] = field(default_factory=list)


Handle = TensorRef | int


_hid = requests.handle_id


_DATA_TAG = bytes([2 << 3 | 2])  # UploadChunk.data: field 2, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _serialize(m: Any) -> bytes:
    return m if isinstance(m, bytes) else m.SerializeToString()


class ExpertGroupFuture:
    """An expert group running on the worker; ``result()`` fetches its output."""

    _result: np.ndarray | None

    def __init__(self, client: WorkerClient, ticket: int) -> None:
        self._client, self.ticket = client, ticket
        self._result = None
        self._lock = threading.Lock()

    def result(self, timeout: float | None = None) -> np.ndarray:
        with self._lock:
            if self._result is None:
                resp = self._client._call(
                    self._client._stub.ExpertGroupTake,
                    pb.ExpertGroupTakeRequest(ticket=self.ticket),
                    timeout=timeout,
                )
                self._result = codec.decode(resp.y, "y")
            return self._result


class WorkerClient:
    """A connection to one worker.

    ``timeout`` is the deadline of every call in seconds (None: none). ``progress``: show a
    progress bar on uploads (None: when stderr is a terminal). ``wire_dtype``: activation
    type on the wire, "float32" (exact), "float16" or "bfloat16" (halves traffic; adds
    rounding of inputs and outputs, see the README). ``tune_malloc``: keep glibc from
    returning message-sized memory to the kernel after every call (process-wide mallopt;
    about half the per-call overhead of a decode call on small VMs); pass False to leave the
    host process's allocator settings alone.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = 120.0,
        progress: bool | None = None,
        wire_dtype: str = "float32",
        max_message_bytes: int = 64 << 20,
        channel: grpc.Channel | None = None,
        token: str | None = None,
        tls: TLS | bool | None = None,
        tune_malloc: bool = True,
    ) -> None:
        if tune_malloc:
            codec.tune_allocator()
        self.address = address
        self.timeout = timeout
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.wire_dtype = codec.wire_dtype(wire_dtype)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        # token: bearer token sent on every call; tls: TLS settings (True: system roots).
        self._channel = channel or make_channel(address, options, tls=tls, token=token)
        self.token, self.tls = token, tls  # the data plane authenticates the same way
        self._unary = UnaryCalls(self)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._local = threading.local()
        self._raw: dict[str, Any] = {}
        self.instance_id: str | None = None

    # -- plumbing -----------------------------------------------------------------------

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def session(
        self,
        transport: str | None = None,
        *,
        shm: bool | None = None,
        shm_bytes: int = 256 << 20,
        doorbell: bool | None = None,
        **options: Any,
    ) -> Any:
        """A session for the hot calls, several in flight. ``transport``:

        - ``"socket"``: the worker's socket data plane (``client/socket_session.py``; TCP, or
          its Unix socket when on this host): the fast remote path.
        - ``"shm"``: shared memory and a doorbell (same host only; ``client/doorbell.py``).
        - ``"grpc"``: the Session stream (works through any gRPC proxy); ``shm=True`` /
          ``doorbell=True`` add shared memory / the doorbell to it (the older flags; alone
          they imply ``"grpc"``).
        - ``"auto"`` (the default): shm when the worker can open this client's segment,
          else socket, else the gRPC stream. ``session.transport`` says which was chosen.

        ``options`` go to the session (``spin_us``, ``worker_spin_us``, ``timeout``; the
        socket session takes ``spin_us``, ``timeout`` and ``address``)."""
        from coliworker.client.session import open_session

        return open_session(
            self, transport, shm=shm, shm_bytes=shm_bytes, doorbell=doorbell, **options
        )

    @property
    def last_call(self) -> CallInfo:
        """backend_ns (and ragged lengths) of this thread's last compute call."""
        info = getattr(self._local, "info", None)
        if info is None:
            info = self._local.info = CallInfo()
        return info

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            resp, call = method.with_call(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        self._note_instance(call)
        return resp

    def _note_instance(self, call: Any) -> None:
        for key, value in call.initial_metadata() or ():
            if key == INSTANCE_METADATA_KEY:
                self.instance_id = value

    def _enc(self, msg: pb.Array, x: np.ndarray, name: str, ndim: int) -> None:
        a = np.asarray(x, dtype=np.float32)
        if a.ndim != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
        codec.encode_into(msg, a, self.wire_dtype)

    # -- info and lifecycle -------------------------------------------------------------

    def info(self) -> WorkerInfo:
        r = self._call(self._stub.Info, pb.InfoRequest())
        devices = tuple(
            DeviceInfo(
                d.id, d.name, d.total_memory_bytes, d.free_memory_bytes, d.memory_limit_bytes
            )
            for d in r.devices
        )
        limits = {f.name: v for f, v in r.limits.ListFields()}
        return WorkerInfo(r.version, r.backend, r.instance_id, devices, limits)

    def upload(
        self,
        weights: np.ndarray,
        scales: np.ndarray | None,
        *,
        fmt: int,
        in_features: int,
        out_features: int,
        group_size: int = 0,
        device: int = 0,
        progress: bool | None = None,
    ) -> TensorRef:
        """Make a tensor resident; identical content already on the device is not resent.

        weights: the documented layout (uint8 [O, row_bytes] or any array with those bytes;
        float32 [O, I] for fmt 0). scales: float32 [O] or [O, ceil(I/group_size)]; None for
        fmt 0.
        """
        spec = pb.TensorSpec(
            fmt=fmt,
            in_features=in_features,
            out_features=out_features,
            group_size=group_size,
            device=device,
        )
        w, s = self._payload(weights, scales)
        digest = codec.content_hash(fmt, in_features, out_features, group_size, w, s)
        hit = self._call(
            self._stub.Lookup, pb.LookupRequest(content_hash=digest, device=device, acquire=True)
        )
        if hit.found:
            return TensorRef._from(hit.tensor, deduplicated=True)
        bar = self._bar(len(w) + len(s), "upload", progress)
        r = self._stream(self._stub.Upload, spec, digest, w, s, 0, bar)
        self.last_call.backend_ns = r.backend_ns  # placing the bytes on the device
        return TensorRef._from(r.tensor, r.deduplicated)

    def update(
        self,
        t: TensorRef,
        weights: np.ndarray,
        scales: np.ndarray | None,
        *,
        progress: bool | None = None,
    ) -> TensorRef:
        """Replace the contents of ``t`` (same spec); updates ``t`` in place and returns it."""
        spec = pb.TensorSpec(
            fmt=t.fmt,
            in_features=t.in_features,
            out_features=t.out_features,
            group_size=t.group_size,
            device=t.device,
        )
        w, s = self._payload(weights, scales)
        digest = codec.content_hash(t.fmt, t.in_features, t.out_features, t.group_size, w, s)
        bar = self._bar(len(w) + len(s), "update", progress)
        r = self._stream(self._stub.Update, spec, digest, w, s, t.handle, bar)
        t.content_hash, t.nbytes = r.tensor.content_hash, r.tensor.nbytes
        return t

    def upload_many(
        self,
        items: Iterable[UploadItem],
        *,
        streams: int = 3,
        hash_threads: int = 4,
        progress: bool | None = None,
    ) -> list[TensorRef]:
        """Make a set of tensors resident; returns their references in item order.

        Pipelined (``client/uploads.py``): items are hashed on ``hash_threads`` threads
        while earlier ones stream, ``streams`` uploads are in flight at once, content the
        worker (or an earlier item) already holds is not resent. All or nothing: an item
        that fails releases what the call took and raises with ``upload_many.items[k]`` in
        its message and ``index`` = k.
        """
        bar = self._bar(0, "upload_many", progress)
        return uploads.upload_many(self, items, streams=streams, hash_threads=hash_threads, bar=bar)

    def _bar(self, total: int, label: str, progress: bool | None) -> _Progress:
        return _Progress(total, label, self.progress if progress is None else progress)

    @staticmethod
    def _payload(weights: np.ndarray, scales: np.ndarray | None) -> tuple[memoryview, memoryview]:
        w = np.ascontiguousarray(weights)
        s = np.zeros(0, np.float32) if scales is None else np.ascontiguousarray(scales, np.float32)
        return w.data.cast("B"), s.data.cast("B")

    def _stream(
        self,
        method: Callable[..., Any],
        spec: pb.TensorSpec,
        digest: bytes,
        w: memoryview,
        s: memoryview,
        handle: int,
        bar: _Progress,
    ) -> Any:
        total = len(w) + len(s)

        def messages() -> Iterator[pb.UploadChunk]:
            yield pb.UploadChunk(
                header=pb.UploadHeader(
                    spec=spec,
                    content_hash=digest,
                    weight_bytes=len(w),
                    scale_bytes=len(s),
                    handle=handle,
                )
            )
            for piece in codec.chunks(w, s):
                # UploadChunk{data} serialized by hand: one copy of the bytes, not three
                # (bytes(), the message, its serialization)
                yield b"".join((_DATA_TAG, _varint(len(piece)), piece))
                bar.advance(len(piece))

        # Large uploads take as long as they take: the deadline scales with the size.
        timeout = None if self.timeout is None else self.timeout + total / 50e6
        return self._call(self._raw_method(method), messages(), timeout=timeout)

    def _raw_method(self, method: Any) -> Any:
        """Upload / Update taking pre-serialized chunks (``method`` is the stub's)."""
        name = "Upload" if method is self._stub.Upload else "Update"
        raw = self._raw.get(name)
        if raw is None:
            response = pb.UploadResponse if name == "Upload" else pb.UpdateResponse
            raw = self._raw[name] = self._channel.stream_unary(
                f"/coliworker.v1.Worker/{name}",
                request_serializer=_serialize,
                response_deserializer=response.FromString,
            )
        return raw

    def free(self, t: Handle) -> int:
        """Drop this reference; returns the bytes the worker released (0 if still shared)."""
        return int(self._call(self._stub.Free, pb.FreeRequest(handle=_hid(t))).released_bytes)

    def stats(self) -> list[DeviceStats]:
        r = self._call(self._stub.Stats, pb.StatsRequest())
        return [
            DeviceStats(
                d.device,
                d.tensors,
                d.tensor_bytes,
                d.handles,
                d.kv_sequences,
                d.kv_bytes,
                GroupStats(
                    d.group.calls,
                    d.group.experts,
                    d.group.rows,
                    d.group.h2d_ns,
                    d.group.kernel_ns,
                    d.group.d2h_ns,
                ),
            )
            for d in r.devices
        ]

    # -- compute: the session calls (``SessionCalls``), each one unary RPC (``unary.py``) ---

    matmul = sync("matmul")
    expert_mlp = sync("expert_mlp")
    expert_group = sync("expert_group")
    expert_group_routed = sync("expert_group_routed")
    attention = sync("attention")
    attention_ragged = sync("attention_ragged")

    def expert_group_async(
        self, experts: Iterable[Sequence[Handle]], rows: Sequence[int], x: np.ndarray
    ) -> ExpertGroupFuture:
        """Start an expert group; ``.result()`` returns what ``expert_group`` would."""
        req = requests.expert_group(self._enc, experts, rows, x)
        t = self._call(self._stub.ExpertGroupIssue, req)
        return ExpertGroupFuture(self, t.ticket)

    def free_sequence(self, sequence_id: int, kv_b: Handle | None = None) -> int:
        """Release a sequence's KV caches (all layers, or one kv_b); returns bytes freed."""
        r = self._call(
            self._stub.FreeSequence,
            pb.FreeSequenceRequest(sequence_id=int(sequence_id), kv_b=_hid(kv_b)),
        )
        return int(r.released_bytes)


def expected_sizes(
    fmt: int, in_features: int, out_features: int, group_size: int
) -> tuple[int, int]:
    """(weight bytes, scale count) of a tensor: handy for building uploads."""
    return row_bytes(fmt, in_features) * out_features, scale_count(
        fmt, in_features, out_features, group_size
    )


__all__ = [
    "DeviceStats",
    "ExpertGroupFuture",
    "TensorRef",
    "UploadItem",
    "WorkerClient",
    "WorkerError",
    "WorkerInfo",
    "expected_sizes",
]
