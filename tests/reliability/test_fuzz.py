"""Property-based fuzzing of every RPC: random requests built from the wire contract's own
descriptors (wrong lengths, shapes, dtypes, handles, huge dimensions, truncated and
reordered upload streams) and raw garbage bytes. The worker never crashes, answers every
call with a typed status (never INTERNAL or UNKNOWN), and resident data stays intact."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from _rel import Mla, random_tensor, rel_err, serve, stats_snapshot, upload
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coliworker.client import WorkerClient
from coliworker.kernels import reference as ref
from coliworker.v1 import worker_pb2 as pb

TYPED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
SERVICE = pb.DESCRIPTOR.services_by_name["Worker"]
# Session multiplexes the others and reports errors in-stream; it gets garbage bytes only.
FUZZED = [m for m in SERVICE.methods if m.name != "Session"]
BASELINE_SEQUENCE = 987_654_321  # never drawn below
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)


class Resident:
    """What the worker holds before fuzzing, and how to check it still does."""

    def __init__(self, w: WorkerClient) -> None:
        rng = np.random.default_rng()
        self.t = random_tensor(rng, 2, 16, 8)
        self.h = upload(w, self.t)
        self.experts = [upload(w, random_tensor(rng, 2, 16, 12)) for _ in range(2)]
        self.experts.append(upload(w, random_tensor(rng, 2, 12, 16)))
        self.mla = Mla()
        self.kv_b, self.o_proj = self.mla.tensors(rng)
        self.kv, self.o = upload(w, self.kv_b), upload(w, self.o_proj)
        self.lat, self.rop = self.mla.rows(rng, 4)
        q = self.mla.q(rng, 1)
        w.attention_ragged(
            self.kv,
            self.o,
            q,
            sequences=[(BASELINE_SEQUENCE, 0, self.lat, self.rop)],
            **self.mla.dims(),
        )
        self.x = rng.standard_normal((3, 16)).astype(np.float32)
        self.q = q
        self.stats = stats_snapshot(w)
        self.handles = [self.h.handle, self.kv.handle, self.o.handle] + [
            e.handle for e in self.experts
        ]

    def check(self, w: WorkerClient) -> None:
        assert stats_snapshot(w) == self.stats
        assert rel_err(w.matmul(self.h, self.x), ref.matmul(self.t, self.x)) < 1e-5
        m = self.mla
        y = w.attention_ragged(
            self.kv,
            self.o,
            self.q,
            sequences=[(BASELINE_SEQUENCE, 4, self.lat[:0], self.rop[:0])],
            **m.dims(),
        )
        want = m.reference(self.kv_b, self.o_proj, self.q, [self.lat], [self.rop])
        assert rel_err(y, want) < 1e-5


@pytest.fixture(scope="module")
def worker():
    srv = serve(max_message_bytes=4 << 20, memory_limit=256 << 20)
    w = WorkerClient(srv.address, timeout=30, progress=False)
    resident = Resident(w)
    yield srv, w, resident
    resident.check(w)
    w.close()
    srv.stop(grace=None)


INTS = [0, 1, 2, 3, 7, 8, 16, 64, -1, -(2**31), 2**31 - 1, 2**32 + 1, 2**40, 2**62]


def message(desc, handles: list[int], depth: int = 0) -> st.SearchStrategy:
    """Random instances of message type ``desc``: every field sometimes set, values drawn
    from edge cases, resident handles and valid-looking small numbers."""
    fields = {}
    for f in desc.fields:
        if f.message_type is not None:
            if depth > 3:
                continue
            value = message(f.message_type, handles, depth + 1)
        elif f.type == F.TYPE_BYTES:
            value = st.one_of(st.binary(max_size=64), st.binary(min_size=32, max_size=32))
        elif f.type == F.TYPE_STRING:
            value = st.text(max_size=8)
        elif f.type == F.TYPE_BOOL:
            value = st.booleans()
        elif f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            value = st.floats(width=32)
        elif f.type == F.TYPE_ENUM:
            value = st.integers(-1, 8)
        else:
            unsigned = f.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED64, F.TYPE_FIXED32)
            bits = 32 if f.type in (F.TYPE_INT32, F.TYPE_UINT32, F.TYPE_SINT32) else 64
            lo, hi = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            pool = [v for v in INTS + handles if lo <= v <= hi]
            value = st.one_of(st.sampled_from(pool), st.integers(lo, hi), st.integers(0, 20))
        if f.is_repeated:
            value = st.lists(value, max_size=4)
        fields[f.name] = st.one_of(st.none(), value)

    cls = getattr(pb, desc.name)

    @st.composite
    def build(draw):
        msg = cls()
        oneof_set = set()
        for name, strategy in fields.items():
            v = draw(strategy)
            if v is None:
                continue
            f = desc.fields_by_name[name]
            if f.containing_oneof is not None:
                if f.containing_oneof.name in oneof_set:
                    continue
                oneof_set.add(f.containing_oneof.name)
            if f.is_repeated:
                if f.message_type is not None:
                    getattr(msg, name).extend(v)
                else:
                    getattr(msg, name).extend(v)
            elif f.message_type is not None:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return build()


def call(channel: grpc.Channel, method, request) -> grpc.StatusCode:
    path = f"/{SERVICE.full_name}/{method.name}"
    out = getattr(pb, method.output_type.name)
    try:
        if method.client_streaming:
            fn = channel.stream_unary(path, lambda m: m.SerializeToString(), out.FromString)
            fn(iter(request), timeout=20)
        else:
            fn = channel.unary_unary(path, lambda m: m.SerializeToString(), out.FromString)
            fn(request, timeout=20)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", FUZZED, ids=lambda m: m.name)
def test_random_requests_get_typed_statuses(worker, method):
    srv, w, resident = worker
    # Free/Update/FreeSequence with a resident handle would legitimately change state.
    destructive = method.name in ("Free", "Update", "FreeSequence")
    handles = [] if destructive else resident.handles
    request = message(method.input_type, handles)
    if method.client_streaming:
        request = st.lists(request, max_size=5)
    channel = grpc.insecure_channel(srv.address)

    @FUZZ
    @given(request)
    def fuzz(req):
        code = call(channel, method, req)
        assert code in TYPED, f"{method.name}: {code} for {req}"

    try:
        fuzz()
    finally:
        channel.close()
    resident.check(w)


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_garbage_bytes_get_typed_statuses(worker, method):
    srv, w, resident = worker
    path = f"/{SERVICE.full_name}/{method.name}"
    channel = grpc.insecure_channel(srv.address)

    @settings(FUZZ, max_examples=80)
    @given(st.lists(st.binary(max_size=128), min_size=1, max_size=3))
    def fuzz(blobs):
        try:
            if method.client_streaming:
                kind = channel.stream_stream if method.server_streaming else channel.stream_unary
                reply = kind(path)(iter(blobs), timeout=10)
            else:
                reply = channel.unary_unary(path)(blobs[0], timeout=10)
            if method.server_streaming:
                for _ in reply:
                    pass
        except grpc.RpcError as err:
            assert err.code() in TYPED, f"{method.name}: {err.code()} {err.details()}"

    try:
        fuzz()
    finally:
        channel.close()
    resident.check(w)


def test_truncated_upload_streams_are_refused_and_leave_nothing(worker):
    srv, w, resident = worker
    rng = np.random.default_rng()
    t = random_tensor(rng, 1, 64, 16)
    from coliworker.wire import codec

    digest = codec.content_hash(1, 64, 16, 0, t.weights, t.scales)
    data = t.weights.tobytes() + t.scales.tobytes()
    header = pb.UploadChunk(
        header=pb.UploadHeader(
            spec=pb.TensorSpec(fmt=1, in_features=64, out_features=16),
            content_hash=digest,
            weight_bytes=t.weights.nbytes,
            scale_bytes=t.scales.nbytes,
        )
    )
    channel = grpc.insecure_channel(srv.address)
    try:
        for cut in (0, 1, len(data) // 2, len(data) - 1):
            chunks = [header, pb.UploadChunk(data=data[:cut])]
            assert call(channel, SERVICE.methods_by_name["Upload"], chunks) == (
                grpc.StatusCode.INVALID_ARGUMENT
            )
        flipped = bytes([data[0] ^ 1]) + data[1:]
        chunks = [header, pb.UploadChunk(data=flipped)]
        assert call(channel, SERVICE.methods_by_name["Upload"], chunks) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
    finally:
        channel.close()
    resident.check(w)
