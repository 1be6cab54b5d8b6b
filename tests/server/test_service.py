"""Every RPC through a real worker on port 0, checked against the float64 reference.

The worker runs in-process with the NumPy backend and two virtual devices (0 and 1), so
cross-device validation is exercised without GPUs.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from coliworker.client import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    WorkerClient,
    requests,
)
from coliworker.kernels import reference as ref
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count, scale_shape
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec

TOL = 1e-5  # NumPy backend vs float64 reference, float32 results


def rel_err(y: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(y - want)) / max(float(np.max(np.abs(want))), 1e-30))


def random_tensor(rng: np.random.Generator, fmt: int, i: int, o: int, gs: int = 0) -> QTensor:
    if fmt == 0:
        w = rng.standard_normal((o, i)).astype(np.float32).view(np.uint8).reshape(-1)
    else:
        w = rng.integers(0, 256, size=o * row_bytes(fmt, i), dtype=np.uint8)
    s = (rng.random(scale_count(fmt, i, o, gs)) * 0.05 + 0.01).astype(np.float32)
    return QTensor(fmt, i, o, gs, w, s)


def upload(w: WorkerClient, t: QTensor, device: int = 0):
    shape = scale_shape(t.fmt, t.in_features, t.out_features, t.group_size)
    scales = t.scales.reshape(shape) if shape else None
    return w.upload(
        t.weights.reshape(t.out_features, -1),
        scales,
        fmt=t.fmt,
        in_features=t.in_features,
        out_features=t.out_features,
        group_size=t.group_size,
        device=device,
    )


@pytest.fixture(scope="module")
def server():
    srv = build_server(
        Config(host="127.0.0.1", port=0, backend="numpy", devices=(0, 1), metrics_port=None)
    ).start()
    yield srv
    srv.stop(grace=None)


# -- info, test vectors, formats -----------------------------------------------------------


def test_info_reports_backend_devices_limits(w):
    info = w.info()
    assert info.backend == "numpy"
    assert [d.id for d in info.devices] == [0, 1]
    assert all(d.total_memory_bytes > 0 for d in info.devices)
    assert info.limits["max_experts"] == 64
    assert len(info.instance_id) == 32
    assert w.instance_id == info.instance_id


def test_notes_test_vectors(w):
    x = np.array([[1, -2, 3, -4]], np.float32)
    t2 = w.upload(
        np.array([0x70, 0xF8, 0xA9, 0xCB], np.uint8),
        np.array([1.0, 0.25], np.float32),
        fmt=2,
        in_features=4,
        out_features=2,
    )
    np.testing.assert_array_equal(w.matmul(t2, x), [[-34.0, -2.5]])
    t3 = w.upload(
        np.array([0xE4, 0x1B], np.uint8),
        np.array([0.5, 2.0], np.float32),
        fmt=3,
        in_features=4,
        out_features=2,
    )
    np.testing.assert_array_equal(w.matmul(t3, x), [[-2.0, 12.0]])
    w.free(t2)
    w.free(t3)


SHAPES = [
    (0, 5, 3, 0),
    (1, 7, 4, 0),
    (2, 1, 1, 0),
    (2, 33, 17, 0),
    (3, 5, 6, 0),
    (3, 130, 9, 0),
    (4, 9, 5, 1),
    (4, 33, 7, 3),
    (4, 130, 4, 64),
    (4, 7, 3, 7),
    (4, 100, 2, 128),
]


@pytest.mark.parametrize("fmt,i,o,gs", SHAPES)
def test_matmul_every_format_odd_shapes(w, rng, fmt, i, o, gs):
    t = random_tensor(rng, fmt, i, o, gs)
    ref_t = upload(w, t)
    for s in (1, 3):
        x = rng.standard_normal((s, i)).astype(np.float32)
        assert rel_err(w.matmul(ref_t, x), ref.matmul(t, x)) < TOL
    w.free(ref_t)


def test_large_upload_is_chunked_and_exact(w, rng):
    # 6144 x 2048 int4 = 6.3 MB of weights: more than gRPC's default 4 MiB message.
    t = random_tensor(rng, 2, 2048 * 2 * 3, 1024)
    h = upload(w, t)
    x = rng.standard_normal((2, t.in_features)).astype(np.float32)
    assert rel_err(w.matmul(h, x), ref.matmul(t, x)) < TOL
    w.free(h)


# -- dedup, update, free -------------------------------------------------------------------


def _device_stats(w, device=0):
    return next(d for d in w.stats() if d.device == device)


def test_identical_upload_is_shared_and_reference_counted(w, rng):
    t = random_tensor(rng, 2, 64, 32)
    before = _device_stats(w)
    a = upload(w, t)
    b = upload(w, t)
    assert not a.deduplicated and b.deduplicated
    assert a.handle != b.handle and a.content_hash == b.content_hash
    mid = _device_stats(w)
    assert mid.tensors == before.tensors + 1
    assert mid.tensor_bytes == before.tensor_bytes + t.nbytes
    assert mid.handles == before.handles + 2
    # Same content on the other device is a separate copy.
    c = upload(w, t, device=1)
    assert not c.deduplicated
    assert w.free(a) == 0  # still referenced by b
    x = rng.standard_normal((1, 64)).astype(np.float32)
    assert rel_err(w.matmul(b, x), ref.matmul(t, x)) < TOL
    assert w.free(b) == t.nbytes
    w.free(c)
    assert _device_stats(w).tensor_bytes == before.tensor_bytes


def test_lookup_probe_without_acquire(w, rng):
    t = random_tensor(rng, 1, 16, 8)
    digest = codec.content_hash(1, 16, 8, 0, t.weights, t.scales)
    stub = w._stub
    assert not stub.Lookup(pb.LookupRequest(content_hash=digest, device=0)).found
    h = upload(w, t)
    assert stub.Lookup(pb.LookupRequest(content_hash=digest, device=0)).found
    assert not stub.Lookup(pb.LookupRequest(content_hash=digest, device=1)).found
    w.free(h)


def test_update_replaces_contents_and_copies_on_write(w, rng):
    t1, t2 = random_tensor(rng, 4, 40, 6, 16), random_tensor(rng, 4, 40, 6, 16)
    a, b = upload(w, t1), upload(w, t1)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    w.update(a, t2.weights, t2.scales.reshape(6, 3))
    assert rel_err(w.matmul(a, x), ref.matmul(t2, x)) < TOL
    assert rel_err(w.matmul(b, x), ref.matmul(t1, x)) < TOL  # the other reference kept its data
    w.update(b, t2.weights, t2.scales)  # now both point at t2's content: one copy
    assert rel_err(w.matmul(b, x), ref.matmul(t2, x)) < TOL
    w.free(a)
    w.free(b)


def test_freed_handle_is_not_found(w, rng):
    h = upload(w, random_tensor(rng, 2, 8, 2))
    w.free(h)
    with pytest.raises(NotFound, match="matmul.handle: unknown tensor handle"):  # one text
        w.matmul(h, np.ones((1, 8), np.float32))
    with pytest.raises(NotFound, match="unknown tensor handle 12345"):
        w.matmul(12345, np.ones((1, 8), np.float32))
    with pytest.raises(NotFound):
        w.free(h)


# -- experts -------------------------------------------------------------------------------


def make_expert(w, rng, d, ie, fmts=(2, 2, 2), gs=0, device=0):
    g = random_tensor(rng, fmts[0], d, ie, gs if fmts[0] == 4 else 0)
    u = random_tensor(rng, fmts[1], d, ie, gs if fmts[1] == 4 else 0)
    dn = random_tensor(rng, fmts[2], ie, d, gs if fmts[2] == 4 else 0)
    hosts = (g, u, dn)
    return hosts, tuple(upload(w, t, device) for t in hosts)


def test_expert_mlp_mixed_formats(w, rng):
    hosts, hs = make_expert(w, rng, 21, 11, fmts=(4, 1, 3), gs=5)
    x = rng.standard_normal((3, 21)).astype(np.float32)
    assert rel_err(w.expert_mlp(*hs, x), ref.expert_mlp(*hosts, x)) < TOL
    for h in hs:
        w.free(h)


def test_expert_group_sync_async_and_routed(w, rng):
    d, ie = 48, 24
    experts = [
        make_expert(w, rng, d, ie, fmts=f, gs=7)
        for f in ((2, 2, 2), (4, 4, 4), (0, 1, 3), (2, 4, 2))
    ]
    hosts = [e[0] for e in experts]
    hs = [e[1] for e in experts]
    rows = [1, 3, 2, 5]
    x = rng.standard_normal((sum(rows), d)).astype(np.float32)
    want = ref.expert_group(hosts, rows, x)
    y = w.expert_group(experts=hs, rows=rows, x=x)
    assert rel_err(y, want) < TOL
    futures = [w.expert_group_async(experts=hs, rows=rows, x=x) for _ in range(3)]
    for f in futures:
        np.testing.assert_array_equal(f.result(), y)  # bit-identical to the sync path
    routes = rng.integers(0, 4, size=(5, 2)).astype(np.int32)
    weights = rng.random((5, 2)).astype(np.float32)
    xt = rng.standard_normal((5, d)).astype(np.float32)
    yr = w.expert_group_routed(hs, xt, routes, weights)
    assert rel_err(yr, ref.expert_group_routed(hosts, xt, routes, weights)) < TOL
    stats = _device_stats(w).group
    assert stats.calls >= 5 and stats.rows >= 4 * sum(rows)
    for e in hs:
        for h in e:
            w.free(h)


def test_expert_group_glm52_decode_shape(w, rng):
    """A real GLM-5.2 decode call: 8 experts x 1 row, D=6144, I_e=2048, int4 per-row."""
    experts = [make_expert(w, rng, 6144, 2048) for _ in range(8)]
    row = rng.standard_normal((1, 6144)).astype(np.float32)
    x = np.repeat(row, 8, axis=0)
    y = w.expert_group(experts=[e[1] for e in experts], rows=[1] * 8, x=x)
    assert rel_err(y, ref.expert_group([e[0] for e in experts], [1] * 8, x)) < TOL
    for e in experts:
        for h in e[1]:
            w.free(h)


# -- attention -----------------------------------------------------------------------------


def mla(w, rng, heads=3, q=8, r=4, v=6, k=10, d_out=7, fmt=2):
    kv_b = random_tensor(rng, fmt, k, heads * (q + v))
    o_proj = random_tensor(rng, 1, heads * v, d_out)
    return (kv_b, o_proj), (upload(w, kv_b), upload(w, o_proj)), dict(q_dim=q, rope_dim=r, v_dim=v)


def test_attention_causal_batch_with_and_without_o_proj(w, rng):
    (kv_b, o_proj), (hk, ho), dims = mla(w, rng, fmt=3)
    s, t = 3, 9
    q = rng.standard_normal((s, 3, 12)).astype(np.float32)
    lat = rng.standard_normal((t, 10)).astype(np.float32)
    rope = rng.standard_normal((t, 4)).astype(np.float32)
    scale = 1 / np.sqrt(12)
    ctx = w.attention(hk, q, lat, rope, scale=scale, **dims)
    assert ctx.shape == (s, 3, 6)
    assert rel_err(ctx, ref.attention(kv_b, None, q, lat, rope, scale=scale, **dims)) < TOL
    out = w.attention(hk, q, lat, rope, scale=scale, o_proj=ho, **dims)
    assert out.shape == (s, 7)
    assert rel_err(out, ref.attention(kv_b, o_proj, q, lat, rope, scale=scale, **dims)) < TOL
    w.free(hk)
    w.free(ho)


def test_attention_ragged_append_rollback_free(w, rng):
    (kv_b, o_proj), (hk, ho), dims = mla(w, rng)
    scale = 0.3
    lat = {
        7: rng.standard_normal((20, 10)).astype(np.float32),
        9: rng.standard_normal((20, 10)).astype(np.float32),
    }
    rope = {
        7: rng.standard_normal((20, 4)).astype(np.float32),
        9: rng.standard_normal((20, 4)).astype(np.float32),
    }

    def call(spans):
        q = rng.standard_normal((len(spans), 3, 12)).astype(np.float32)
        seqs = [(sid, a, lat[sid][a:b], rope[sid][a:b]) for sid, a, b in spans]
        out = w.attention_ragged(hk, ho, q, sequences=seqs, scale=scale, **dims)
        want = ref.attention_ragged(
            kv_b,
            o_proj,
            q,
            [lat[sid][:b] for sid, _, b in spans],
            [rope[sid][:b] for sid, _, b in spans],
            scale=scale,
            **dims,
        )
        assert rel_err(out, want) < TOL
        assert w.last_call.lengths == [b for _, _, b in spans]

    call([(7, 0, 5), (9, 0, 3)])  # prefill both
    call([(7, 5, 6), (9, 3, 4)])  # decode one row each
    call([(9, 4, 4)])  # nothing new: attend the resident rows again
    lat[7][3:] = rng.standard_normal((17, 10))  # the engine rewrites from position 3
    rope[7][3:] = rng.standard_normal((17, 4))
    call([(7, 3, 8)])  # rollback to 3 rows then append 5
    with pytest.raises(FailedPrecondition, match=r"sequences\[0\].start: expected <= 8"):
        call([(7, 9, 10)])
    call([(7, 8, 9), (9, 4, 5)])  # the rejected call changed nothing
    assert _device_stats(w).kv_sequences >= 2
    assert w.free_sequence(7) > 0
    with pytest.raises(FailedPrecondition, match="expected <= 0"):
        call([(7, 1, 2)])
    w.free(hk)  # freeing kv_b drops its caches too
    w.free(ho)


def _update(w: WorkerClient, h, t: QTensor) -> None:
    shape = scale_shape(t.fmt, t.in_features, t.out_features, t.group_size)
    w.update(h, t.weights.reshape(t.out_features, -1), t.scales.reshape(shape) if shape else None)


def test_attention_ragged_weights_follow_free_and_update(w, rng):
    """The servicer keeps a ragged call's resolved kv_b and o_proj for the next call on the
    same handles: an update or a free in between is seen by that call as it would be
    without the cache. Each replacement points the handle at content another handle holds
    (a new resident copy, not the old one overwritten), and each free leaves that content
    resident, so a stale entry would answer with the old weights instead of failing."""
    (kv_b, o_proj), (hk, ho), dims = mla(w, rng)
    kv_b2, o_proj2 = random_tensor(rng, 2, 10, 3 * (8 + 6)), random_tensor(rng, 1, 18, 7)
    hk2, ho2 = upload(w, kv_b2), upload(w, o_proj2)
    lat = rng.standard_normal((8, 10)).astype(np.float32)
    rope = rng.standard_normal((8, 4)).astype(np.float32)
    q = rng.standard_normal((1, 3, 12)).astype(np.float32)

    def call(k, o, kv, op, n):  # append row n - 1 of sequence 3, attend its n rows
        seq = (3, n - 1, lat[n - 1 : n], rope[n - 1 : n])
        out = w.attention_ragged(k, o, q, sequences=[seq], scale=0.3, **dims)
        want = ref.attention_ragged(kv, op, q, [lat[:n]], [rope[:n]], scale=0.3, **dims)
        assert rel_err(out, want) < TOL
        assert w.last_call.lengths == [n]

    call(hk, ho, kv_b, o_proj, 1)
    call(hk, ho, kv_b, o_proj, 2)  # the same handles again
    _update(w, ho, o_proj2)  # ho now on ho2's copy
    call(hk, ho, kv_b, o_proj2, 3)
    _update(w, hk, kv_b2)  # hk now on hk2's copy
    call(hk, ho, kv_b2, o_proj2, 4)
    call(hk, 0, kv_b2, None, 5)  # no o_proj: the context
    # o_proj checked against this call's heads x v_dim (6 x 6, kv_b's 42 rows as 6 x (1 + 6))
    q6 = rng.standard_normal((1, 6, 5)).astype(np.float32)
    with pytest.raises(InvalidArgument, match=r"attention_ragged.o_proj: expected 36 in_features"):
        w.attention_ragged(hk, ho, q6, sequences=[(3, 5, lat[5:6], rope[5:6])], scale=0.3,
                           q_dim=1, rope_dim=4, v_dim=6)  # fmt: skip
    w.free(ho)  # its content stays resident: ho2 holds it
    with pytest.raises(NotFound, match="attention_ragged.o_proj: unknown tensor handle"):
        call(hk, ho, kv_b2, o_proj2, 6)
    call(hk, ho2, kv_b2, o_proj2, 6)
    w.free(hk)  # its content stays resident: hk2 holds it
    for o in (ho2, 0):
        with pytest.raises(NotFound, match="attention_ragged.kv_b: unknown tensor handle"):
            call(hk, o, kv_b2, o_proj2, 1)
    w.free(hk2)
    w.free(ho2)


def test_attention_ragged_weights_are_per_owner(server, w, rng):
    """Another owner naming this owner's handles is told they are unknown, after this
    owner's calls on them as before (the resolved handles are kept per owner)."""
    (kv_b, o_proj), (hk, ho), dims = mla(w, rng)
    lat = rng.standard_normal((1, 10)).astype(np.float32)
    rope = rng.standard_normal((1, 4)).astype(np.float32)
    q = rng.standard_normal((1, 3, 12)).astype(np.float32)

    def inline(msg, a, field, ndim):  # the unary client's encoder: every array in its message
        codec.encode_into(msg, a)

    req = requests.attention_ragged(
        inline, hk, ho, q, sequences=[(4, 0, lat, rope)], scale=0.3, **dims
    )
    run = server.servicer.dispatch.run
    call = calls.BY_KIND["attention_ragged"]
    for owner in ("", "", "someone else", ""):
        out = run(call, req, owner)
        if owner:
            assert out.code == grpc.StatusCode.NOT_FOUND
            assert out.message == f"attention_ragged.kv_b: unknown tensor handle {hk.handle}"
        else:
            assert out.ok, out.message
            want = ref.attention_ragged(kv_b, o_proj, q, [lat], [rope], scale=0.3, **dims)
            assert rel_err(codec.decode(out.response.out, "out"), want) < TOL
    w.free_sequence(4)
    w.free(hk)
    w.free(ho)


# -- bad input: typed errors naming the field, nothing resident changes -------------------


@pytest.fixture
def resident(w, rng):
    """A tensor whose results are re-checked after each rejected call."""
    t = random_tensor(rng, 2, 16, 4)
    h = upload(w, t)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    y = w.matmul(h, x)
    before = w.stats()
    yield h
    np.testing.assert_array_equal(w.matmul(h, x), y)
    after = w.stats()
    assert [(d.tensors, d.tensor_bytes, d.handles) for d in after] == [
        (d.tensors, d.tensor_bytes, d.handles) for d in before
    ]
    w.free(h)


def raw_upload(w, header, chunks):
    msgs = [pb.UploadChunk(header=header)] + [pb.UploadChunk(data=c) for c in chunks]
    return w._call(w._stub.Upload, iter(msgs))


def header(fmt=2, i=8, o=2, gs=0, device=0, wbytes=None, sbytes=None, digest=b"\0" * 32):
    spec = pb.TensorSpec(fmt=fmt, in_features=i, out_features=o, group_size=gs, device=device)
    valid = 0 <= fmt <= 4 and i > 0 and o > 0
    wb = row_bytes(fmt, i) * o if wbytes is None and valid else (wbytes or 0)
    sb = 4 * max(o, 0) if sbytes is None else sbytes
    return pb.UploadHeader(spec=spec, content_hash=digest, weight_bytes=wb, scale_bytes=sb)


@pytest.mark.parametrize(
    "hdr,match",
    [
        (header(fmt=5), r"upload.header.spec.fmt: expected 0..4, got 5"),
        (header(fmt=-1), r"spec.fmt: expected 0..4, got -1"),
        (header(i=0), r"spec.in_features: expected >= 1, got 0"),
        (header(o=-3), r"spec.out_features: expected >= 1, got -3"),
        (header(fmt=4, gs=0), r"spec.group_size: expected >= 1 for fmt 4"),
        (header(fmt=2, gs=64), r"spec.group_size: expected 0 for fmt 2"),
        (header(device=7), r"spec.device: expected one of 0, 1, got 7"),
        (header(wbytes=7), r"header.weight_bytes: expected 8 .*got 7"),
        (header(sbytes=4), r"header.scale_bytes: expected 8 .*got 4"),
        (header(digest=b"short"), r"header.content_hash: expected 32 bytes"),
    ],
)
def test_bad_upload_headers(w, resident, hdr, match):
    with pytest.raises(InvalidArgument, match=match):
        raw_upload(w, hdr, [b"\0" * 16])


def test_bad_upload_data(w, resident):
    with pytest.raises(InvalidArgument, match=r"expected 16 bytes, stream ended after 10"):
        raw_upload(w, header(), [b"\1" * 10])
    with pytest.raises(InvalidArgument, match=r"expected 16 bytes in all, got more"):
        raw_upload(w, header(), [b"\1" * 10, b"\1" * 10])
    with pytest.raises(InvalidArgument, match=r"content_hash: expected [0-9a-f]{64}"):
        raw_upload(w, header(), [b"\1" * 16])
    with pytest.raises(InvalidArgument, match="expected a header as the first message"):
        w._call(w._stub.Upload, iter([pb.UploadChunk(data=b"x")]))


def test_bad_compute_requests(w, rng, resident):
    x = np.ones((2, 16), np.float32)
    with pytest.raises(InvalidArgument, match=r"matmul.x: expected 16 columns .*got 15"):
        w.matmul(resident, np.ones((2, 15), np.float32))
    bad = pb.MatmulRequest(
        handle=resident.handle, x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[2, 16], data=b"\0" * 100)
    )
    with pytest.raises(InvalidArgument, match=r"matmul.x.data: expected 128 bytes .*got 100"):
        w._call(w._stub.Matmul, bad)
    bad = pb.MatmulRequest(
        handle=resident.handle, x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[0, 16], data=b"")
    )
    with pytest.raises(InvalidArgument, match=r"matmul.x.shape\[0\]: expected >= 1, got 0"):
        w._call(w._stub.Matmul, bad)
    bad = pb.MatmulRequest(
        handle=resident.handle, x=pb.Array(dtype=pb.DTYPE_INT32, shape=[2, 16], data=b"\0" * 128)
    )
    with pytest.raises(InvalidArgument, match=r"matmul.x.dtype: expected float32"):
        w._call(w._stub.Matmul, bad)
    with pytest.raises(InvalidArgument, match="expected a tensor handle, got 0"):
        w.matmul(0, x)
    _, e = make_expert(w, rng, 16, 8)
    _, e1 = make_expert(w, rng, 16, 8, device=1)
    with pytest.raises(InvalidArgument, match=r"expert_group.rows: expected 1 entries"):
        w.expert_group(experts=[e], rows=[1, 1], x=x)
    with pytest.raises(InvalidArgument, match=r"expert_group.rows\[0\]: expected >= 1, got 0"):
        w.expert_group(experts=[e], rows=[0], x=x)
    with pytest.raises(InvalidArgument, match=r"expert_group.x: expected 3 rows"):
        w.expert_group(experts=[e], rows=[3], x=x)
    with pytest.raises(InvalidArgument, match="different devices: expert_group.experts"):
        w.expert_group(experts=[e, e1], rows=[1, 1], x=x)
    with pytest.raises(ResourceExhausted, match=r"expected 1..64 experts, got 65"):
        w.expert_group(experts=[e] * 65, rows=[1] * 65, x=np.ones((65, 16), np.float32))
    with pytest.raises(InvalidArgument, match=r"expert_group.experts: expected 1..64 experts"):
        w.expert_group(experts=[], rows=[], x=x)
    with pytest.raises(InvalidArgument, match=r"expert_mlp.down.in_features: expected 8"):
        w.expert_mlp(e[0], e[1], resident, x)
    with pytest.raises(InvalidArgument, match=r"routes\[1, 0\]: expected 0..0"):
        w.expert_group_routed([e], x, np.array([[0], [3]]), np.ones((2, 1), np.float32))
    with pytest.raises(NotFound, match="ticket"):
        w._call(w._stub.ExpertGroupTake, pb.ExpertGroupTakeRequest(ticket=999999))
    for h in (*e, *e1):
        w.free(h)


def test_bad_attention_requests(w, rng, resident):
    (kv_b, _), (hk, ho), dims = mla(w, rng)
    q = rng.standard_normal((2, 3, 12)).astype(np.float32)
    lat = rng.standard_normal((4, 10)).astype(np.float32)
    rope = rng.standard_normal((4, 4)).astype(np.float32)
    with pytest.raises(InvalidArgument, match=r"attention.q: expected 13 values per head"):
        w.attention(hk, q, lat, rope, q_dim=9, rope_dim=4, v_dim=6, scale=0.1)
    with pytest.raises(InvalidArgument, match=r"attention.kv_b: expected 54 out_features"):
        w.attention(hk, q, lat, rope, q_dim=8, rope_dim=4, v_dim=10, scale=0.1)
    with pytest.raises(InvalidArgument, match=r"attention.latent: expected 10 columns"):
        w.attention(hk, q, lat[:, :9], rope, scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"attention.latent: expected >= 2 rows"):
        w.attention(hk, q, lat[:1], rope[:1], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"attention.o_proj: expected 18 in_features"):
        w.attention(hk, q, lat, rope, scale=0.1, o_proj=resident, **dims)
    with pytest.raises(InvalidArgument, match=r"attention.v_dim: expected >= 1, got 0"):
        w.attention(hk, q, lat, rope, q_dim=8, rope_dim=4, v_dim=0, scale=0.1)
    seq = (1, 0, lat[:2], rope[:2])
    with pytest.raises(InvalidArgument, match=r"sequence_id: 1 already appears"):
        w.attention_ragged(hk, ho, q, sequences=[seq, seq], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"attention_ragged.sequences: expected 2"):
        w.attention_ragged(hk, ho, q, sequences=[seq], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"sequences\[1\].rope: expected 2 rows"):
        w.attention_ragged(hk, ho, q, sequences=[seq, (2, 0, lat[:2], rope[:1])], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"would attend 0 rows"):
        w.attention_ragged(hk, ho, q, sequences=[seq, (2, 0, lat[:0], rope[:0])], scale=0.1, **dims)
    assert _device_stats(w).kv_sequences == 0  # nothing was created by rejected calls
    w.free(hk)
    w.free(ho)


# -- limits and faults ---------------------------------------------------------------------


def test_memory_limit_and_fault_injection(rng):
    cfg = Config(port=0, backend="numpy", metrics_port=None, memory_limit=4096, fail_after=2)
    srv = build_server(cfg).start()
    try:
        with WorkerClient(srv.address, timeout=30, progress=False) as w:
            small = upload(w, random_tensor(rng, 2, 64, 32))  # 1152 bytes
            with pytest.raises(ResourceExhausted, match="memory-limit"):
                upload(w, random_tensor(rng, 0, 64, 32))  # 8 KiB > budget
            with pytest.raises(ResourceExhausted, match="budget"):
                upload(w, random_tensor(rng, 1, 64, 48))  # fits alone, not beside `small`
            x = rng.standard_normal((1, 64)).astype(np.float32)
            w.matmul(small, x)
            w.matmul(small, x)
            with pytest.raises(Unavailable, match="injected fault"):
                w.matmul(small, x)
            assert w.stats()[0].tensors == 1  # still serving, nothing lost
            assert w.free(small) > 0
    finally:
        srv.stop(None)


def test_kv_eviction_under_budget_is_reported(rng):
    # Room for the tensors plus ~one 64-row page of KV (64 x 14 x 4 = 3584 bytes).
    cfg = Config(port=0, backend="numpy", metrics_port=None, memory_limit=5000)
    srv = build_server(cfg).start()
    try:
        with WorkerClient(srv.address, timeout=30, progress=False) as w:
            (kv_b, o_proj), (hk, ho), dims = mla(w, rng, heads=1, q=2, r=4, v=2, k=10, d_out=3)
            q = rng.standard_normal((1, 1, 6)).astype(np.float32)
            lat = rng.standard_normal((3, 10)).astype(np.float32)
            rope = rng.standard_normal((3, 4)).astype(np.float32)
            w.attention_ragged(hk, ho, q, sequences=[(1, 0, lat, rope)], scale=0.5, **dims)
            w.attention_ragged(hk, ho, q, sequences=[(2, 0, lat, rope)], scale=0.5, **dims)
            with pytest.raises(FailedPrecondition, match="evicted"):
                w.attention_ragged(
                    hk, ho, q, sequences=[(1, 3, lat[:0], rope[:0])], scale=0.5, **dims
                )
            out = w.attention_ragged(hk, ho, q, sequences=[(1, 0, lat, rope)], scale=0.5, **dims)
            want = ref.attention_ragged(kv_b, o_proj, q, [lat], [rope], scale=0.5, **dims)
            assert rel_err(out, want) < TOL
    finally:
        srv.stop(None)


def test_attention_ragged_failed_call_claims_no_rows(w, rng, monkeypatch):
    """A call that fails inside the backend (after its rows' room is reserved) leaves every
    sequence at the rows it held: the next call resends from there."""
    (kv_b, o_proj), (hk, ho), dims = mla(w, rng)
    lat = rng.standard_normal((12, 10)).astype(np.float32)
    rope = rng.standard_normal((12, 4)).astype(np.float32)
    q = rng.standard_normal((1, 3, 12)).astype(np.float32)
    w.attention_ragged(hk, ho, q, sequences=[(5, 0, lat[:4], rope[:4])], scale=0.3, **dims)

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")

    with monkeypatch.context() as m:
        m.setattr(ref, "attention_ragged", broken)
        with pytest.raises(InternalError):
            w.attention_ragged(hk, ho, q, sequences=[(5, 4, lat[4:9], rope[4:9])], scale=0.3,
                               **dims)  # fmt: skip
    with pytest.raises(FailedPrecondition, match=r"start: expected <= 4"):
        w.attention_ragged(hk, ho, q, sequences=[(5, 9, lat[9:10], rope[9:10])], scale=0.3,
                           **dims)  # fmt: skip
    out = w.attention_ragged(hk, ho, q, sequences=[(5, 4, lat[4:9], rope[4:9])], scale=0.3,
                             **dims)  # fmt: skip
    assert w.last_call.lengths == [9]
    want = ref.attention_ragged(kv_b, o_proj, q, [lat[:9]], [rope[:9]], scale=0.3, **dims)
    assert rel_err(out, want) < TOL
    w.free_sequence(5)
