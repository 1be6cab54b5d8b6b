"""Set uploads (``WorkerClient.upload_many``) and the streamed placement behind every upload,
through a real worker on port 0, on each backend.

What is resident is compared with what was sent bit for bit: the NumPy backend's resident
bytes directly, the CuPy backend's device layout decoded back (``layout.decode_resident``)
against the float64 reference's dequantization. Sizes span one staging block and several.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from test_service import random_tensor, rel_err

from coliworker.client import (
    InvalidArgument,
    ResourceExhausted,
    UploadItem,
    WorkerClient,
)
from coliworker.client.uploads import _Progress
from coliworker.kernels import layout
from coliworker.kernels import reference as ref
from coliworker.kernels.qtensor import QTensor, scale_shape
from coliworker.server import upload as server_upload
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec

BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
]


def serve(backend: str, **config):
    return build_server(
        Config(host="127.0.0.1", port=0, backend=backend, metrics_port=None, **config)
    ).start()


@pytest.fixture(scope="module", params=BACKENDS)
def server(request):
    srv = serve(request.param)
    yield srv
    srv.stop(grace=None)


def item(t: QTensor, device: int = 0) -> UploadItem:
    shape = scale_shape(t.fmt, t.in_features, t.out_features, t.group_size)
    return UploadItem(
        t.weights.reshape(t.out_features, -1),
        t.scales.reshape(shape) if shape else None,
        fmt=t.fmt,
        in_features=t.in_features,
        out_features=t.out_features,
        group_size=t.group_size,
        device=device,
    )


def assert_resident(server, ref_, t: QTensor) -> None:
    """The worker holds exactly ``t``'s content under ``ref_``."""
    resident = server.servicer.store.get(ref_.handle, "test").data.resident
    if server.backend.name == "numpy":
        np.testing.assert_array_equal(resident.tensor.weights, t.weights)
        np.testing.assert_array_equal(
            resident.tensor.scales.view(np.uint32), t.scales.view(np.uint32)
        )
        return
    got = layout.decode_resident(t, resident.w.get(), resident.s.get())
    np.testing.assert_array_equal(got, ref.dequantize(t))


def usage(w: WorkerClient, device: int = 0):
    d = next(d for d in w.stats() if d.device == device)
    return d.tensors, d.tensor_bytes, d.handles


# Shapes: one block and less, a GLM-5.2 expert projection (6144 x 2048 int4, 6.3 MB: two
# blocks), three blocks and a bit (fmt 1), odd sizes of every format.
SET = [
    (2, 6144, 2048, 0),
    (1, 4099, 3100, 0),
    (0, 33, 5, 0),
    (2, 33, 17, 0),
    (3, 130, 9, 0),
    (4, 130, 4, 64),
    (4, 7, 3, 7),
]


def test_set_is_resident_bit_for_bit(server, w, rng):
    hosts = [random_tensor(rng, *s) for s in SET]
    before = usage(w)
    refs = w.upload_many([item(t) for t in hosts])
    assert [r.fmt for r in refs] == [t.fmt for t in hosts]
    assert not any(r.deduplicated for r in refs)
    for r, t in zip(refs, hosts, strict=True):
        assert r.nbytes == t.nbytes
        assert_resident(server, r, t)
    x = rng.standard_normal((2, hosts[3].in_features)).astype(np.float32)
    assert rel_err(w.matmul(refs[3], x), ref.matmul(hosts[3], x)) < 1e-4
    after = usage(w)
    assert after == (
        before[0] + len(SET),
        before[1] + sum(t.nbytes for t in hosts),
        before[2] + len(SET),
    )
    for r in refs:
        w.free(r)
    assert usage(w) == before


@pytest.mark.parametrize("streams", [1, 3])
def test_dedup_within_and_across_sets(server, w, rng, streams):
    a, b, c, d = (random_tensor(rng, 2, 2048, 1100) for _ in range(4))
    before = usage(w)
    first = w.upload_many([item(t) for t in (a, b, a, c, b)], streams=streams)
    assert [r.deduplicated for r in first] == [False, False, True, False, True]
    assert first[2].content_hash == first[0].content_hash != first[1].content_hash
    assert len({r.handle for r in first}) == 5
    mid = usage(w)
    assert mid == (before[0] + 3, before[1] + 3 * a.nbytes, before[2] + 5)
    second = w.upload_many([item(t) for t in (c, d, a)], streams=streams)
    assert [r.deduplicated for r in second] == [True, False, True]
    assert usage(w)[:2] == (before[0] + 4, before[1] + 4 * a.nbytes)
    assert_resident(server, second[1], d)
    assert_resident(server, first[2], a)
    for r in first + second:
        w.free(r)
    assert usage(w) == before


def test_the_first_of_identical_items_is_the_lowest_index_whatever_hash_ends_first(
    server, w, rng, monkeypatch
):
    """Item 0's hash finishes last; item 2 (the same content) must still wait for item 0,
    not be sent in its place."""
    a, b = (random_tensor(rng, 2, 512, 64) for _ in range(2))
    slow = codec.content_hash(a.fmt, a.in_features, a.out_features, 0, a.weights, a.scales)
    calls = []
    real = codec.content_hash

    def content_hash(*args):
        digest = real(*args)
        calls.append(digest)
        if digest == slow and calls.count(slow) == 1:
            time.sleep(0.3)  # the first of a's two hashes (item 0 or 2) comes in late
        return digest

    monkeypatch.setattr("coliworker.client.uploads.codec.content_hash", content_hash)
    before = usage(w)
    refs = w.upload_many([item(t) for t in (a, b, a)], streams=3, hash_threads=3)
    assert [r.deduplicated for r in refs] == [False, False, True]
    assert refs[0].content_hash == refs[2].content_hash
    for r in refs:
        w.free(r)
    assert usage(w) == before


def test_item_checked_before_anything_is_sent(w, rng):
    good = [item(random_tensor(rng, 2, 64, 8)) for _ in range(3)]
    before = usage(w)
    short = random_tensor(rng, 2, 64, 8)
    bad = UploadItem(short.weights[:-1], short.scales, fmt=2, in_features=64, out_features=8)
    with pytest.raises(
        InvalidArgument, match=r"upload_many.items\[2\].weights: expected 256 bytes .*got 255"
    ) as e:
        w.upload_many([*good[:2], bad, good[2]])
    assert e.value.index == 2
    with pytest.raises(InvalidArgument, match=r"upload_many.items\[1\].scales: expected 8 float32"):
        w.upload_many(
            [
                good[0],
                UploadItem(short.weights, short.scales[:7], fmt=2, in_features=64, out_features=8),
            ]
        )
    with pytest.raises(
        InvalidArgument, match=r"upload_many.items\[0\].group_size: expected >= 1 for fmt 4"
    ):
        w.upload_many(
            [UploadItem(short.weights, short.scales, fmt=4, in_features=64, out_features=8)]
        )
    assert usage(w) == before


def test_worker_error_in_item_k_names_k_and_releases_the_rest(w, rng):
    hosts = [random_tensor(rng, 2, 2048, 1100) for _ in range(4)]
    kept = w.upload_many([item(hosts[0])])  # already resident: item 0 below is a reference
    before = usage(w)
    items = [item(t) for t in hosts]
    items[2] = item(hosts[2], device=7)
    with pytest.raises(
        InvalidArgument, match=r"upload_many.items\[2\]: lookup.device: expected one of"
    ) as e:
        w.upload_many(items, streams=1)
    assert e.value.index == 2
    assert usage(w) == before  # items 0 and 1 were released again
    w.free(kept[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_holds_for_streamed_uploads(backend, rng):
    # Room for two 2.25 MB tensors, not three: item 2 is refused before its bytes arrive.
    t = [random_tensor(rng, 1, 1500, 1500) for _ in range(3)]
    srv = serve(backend, memory_limit=5_000_000)
    try:
        with WorkerClient(srv.address, timeout=60, progress=False) as w:
            with pytest.raises(
                ResourceExhausted, match=r"upload_many.items\[2\]: upload: .*memory-limit"
            ) as e:
                w.upload_many([item(x) for x in t], streams=1)
            assert e.value.index == 2
            assert usage(w) == (0, 0, 0)
            assert srv.servicer.budget.used[0] == 0
            refs = w.upload_many([item(x) for x in t[:2]])
            assert_resident(srv, refs[1], t[1])
    finally:
        srv.stop(None)


def test_hash_mismatch_leaves_nothing(server, w, rng):
    # Several blocks: the mismatch shows only after the device copy has begun.
    t = random_tensor(rng, 1, 4096, 3000)
    spec = pb.TensorSpec(fmt=1, in_features=4096, out_features=3000)
    wv, sv = w._payload(t.weights, t.scales)
    before, budget = usage(w), server.servicer.budget.used[0]
    with pytest.raises(
        InvalidArgument, match=r"upload.header.content_hash: expected [0-9a-f]{64} .*got (ab){32}"
    ):
        w._stream(w._stub.Upload, spec, b"\xab" * 32, wv, sv, 0, _Progress(0, "", False))
    assert usage(w) == before
    assert server.servicer.budget.used[0] == budget


def test_stream_cut_midway_leaves_nothing(server, w, rng):
    t = random_tensor(rng, 1, 4096, 3000)
    digest = codec.content_hash(1, 4096, 3000, 0, t.weights, t.scales)
    header = pb.UploadHeader(
        spec=pb.TensorSpec(fmt=1, in_features=4096, out_features=3000),
        content_hash=digest,
        weight_bytes=t.weights.nbytes,
        scale_bytes=t.scales.nbytes,
    )
    budget = server.servicer.budget.used[0]

    def messages():
        yield pb.UploadChunk(header=header)
        for off in range(0, 8 << 20, 1 << 20):
            yield pb.UploadChunk(data=t.weights[off : off + (1 << 20)].tobytes())
        raise RuntimeError("client gave up")

    with pytest.raises(grpc.RpcError):
        w._stub.Upload(messages())
    deadline = time.monotonic() + 10
    while server.servicer.budget.used[0] != budget and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.servicer.budget.used[0] == budget


def test_data_chunks_read_in_place():
    for n in (0, 1, 127, 128, 300, 1 << 20):
        raw = pb.UploadChunk(
            data=bytes(range(256)) * (n // 256) + bytes(n % 256)
        ).SerializeToString()
        view = server_upload._data_view(raw)
        assert (
            view is not None
            and len(view) == n
            and bytes(view) == pb.UploadChunk.FromString(raw).data
        )
    assert (
        server_upload._data_view(pb.UploadChunk(header=pb.UploadHeader()).SerializeToString())
        is None
    )
    raw = pb.UploadChunk(data=b"abc").SerializeToString()
    assert server_upload._data_view(raw + b"\x08\x01") is None  # more fields: parsed instead
