"""Every RPC through a real worker on port 0, checked against the float64 reference.

The worker runs in-process with the NumPy backend and two virtual devices (0 and 1), so
cross-device validation is exercised without GPUs.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from _service import (
    TOL,
    device_stats,
    host_arrays,
    make_expert,
    mla,
    random_tensor,
    rel_err,
    upload,
)

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
from coliworker.kernels.qtensor import QTensor
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec

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


def test_identical_upload_is_shared_and_reference_counted(w, rng):
    t = random_tensor(rng, 2, 64, 32)
    before = device_stats(w)
    a = upload(w, t)
    b = upload(w, t)
    assert not a.deduplicated and b.deduplicated
    assert a.handle != b.handle and a.content_hash == b.content_hash
    mid = device_stats(w)
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
    assert device_stats(w).tensor_bytes == before.tensor_bytes


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
    stats = device_stats(w).group
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
    assert device_stats(w).kv_sequences >= 2
    assert w.free_sequence(7) > 0
    with pytest.raises(FailedPrecondition, match="expected <= 0"):
        call([(7, 1, 2)])
    w.free(hk)  # freeing kv_b drops its caches too
    w.free(ho)


def _update(w: WorkerClient, h, t: QTensor) -> None:
    w.update(h, *host_arrays(t))


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
