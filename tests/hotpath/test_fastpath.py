"""The decode calls' compiled path (``server/fastpath.c``, ``server/fastpath.py``): for routed
expert groups and ragged attention, the same results, KV caches, statistics and errors as the
Python path it stands in for, on the socket data plane and the doorbell; its reply bodies the
bytes protobuf serializes; and every request it does not read left to the Python (None,
nothing taken)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _hotpath import (
    ATT,
    D_OUT,
    I_E,
    D,
    H,
    K,
    Model,
    Q,
    R,
    V,
    int4_tensor,
    routed_reference,
    routing,
    upload,
)

from coliworker.client import InvalidArgument, WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server import fastpath
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec, frames, staging

needs_c = pytest.mark.skipif(
    fastpath.module() is None, reason="server/fastpath.c cannot be built on this host"
)


def _worker(fast: bool):
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None)).start()
    if not fast:
        srv.servicer.fastcalls = None
    assert (srv.servicer.fastcalls is not None) == fast
    return srv


def _model(w: WorkerClient, rng, n: int = 6) -> Model:
    tensors = [
        (int4_tensor(rng, D, I_E), int4_tensor(rng, D, I_E), int4_tensor(rng, I_E, D))
        for _ in range(n)
    ]
    experts = [tuple(upload(w, t) for t in triple) for triple in tensors]
    return Model(experts, tensors, None, None, None, None, None, None)


def _counted(srv, name: str = "expert_group_routed_checked") -> list[int]:
    """How many calls the compiled path ran (its handler ``name`` wrapped)."""
    seen = [0]
    s = srv.servicer
    real = getattr(s, name)

    def counted(request, owner, io=None):
        seen[0] += 1
        return real(request, owner, io)

    setattr(s, name, counted)
    return seen


def _calls(rng, model: Model, n: int):
    """``n`` random routed calls on ``model``'s experts, as a router sends them: the first
    names every expert, each later one a random few in a random order; (expert indexes, x,
    routes into those, weights)."""
    out = []
    e = len(model.experts)
    for i in range(n):
        pick = rng.permutation(e)[: e if i == 0 else int(rng.integers(1, e + 1))]
        t = int(rng.integers(1, 4))
        k = int(rng.integers(1, len(pick) + 1))
        routes, weights = routing(rng, t, k, len(pick))
        x = rng.standard_normal((t, D)).astype(np.float32)
        out.append(([int(j) for j in pick], x, routes, weights))
    return out


def _in_c(model: Model, picks: list[list[int]]) -> int:
    """How many of the routed calls naming ``picks`` of ``model``'s experts (each with an
    array outside its message) the compiled path runs: those whose list, or each of whose
    experts, the caches hold under the call's key. The worker keys an expert by its bytes in
    the request where every expert of the call has as many (random handle ids are 8-10 byte
    varints), else by its ids; the Python path caches the list and each expert, the C the
    list."""
    lists: set = set()
    triples: set = set()
    n = 0
    for pick in picks:
        sizes = {
            pb.Expert(gate=g.handle, up=u.handle, down=d.handle).ByteSize()
            for g, u, d in (model.experts[j] for j in pick)
        }
        form = "bytes" if len(sizes) == 1 else "ids"
        if (form, tuple(pick)) in lists or all((form, j) in triples for j in pick):
            n += 1
        else:
            triples.update((form, j) for j in pick)
        lists.add((form, tuple(pick)))
    return n


@needs_c
@pytest.mark.parametrize("transport", ["socket", "doorbell"])
def test_the_compiled_path_answers_as_the_python(rng, transport):
    """The same calls through a worker with the compiled path and one without: bit-identical
    results (each also against the float64 reference), the same usage counts and group
    statistics; the compiled path ran each call whose list or experts an earlier call
    resolved (``_in_c``)."""
    calls = None
    got = {}
    for fast in (True, False):
        srv = _worker(fast)
        seen = _counted(srv)
        try:
            with WorkerClient(srv.address, progress=False) as w:
                model = _model(w, np.random.default_rng(7))
                if calls is None:
                    calls = _calls(rng, model, 16)
                kw = {"shm": True, "doorbell": True} if transport == "doorbell" else {
                    "transport": "socket"}  # fmt: skip
                with w.session(**kw) as s:
                    ys = [
                        s.expert_group_routed_sync([model.experts[j] for j in pick], *c)
                        for pick, *c in calls
                    ]
                s_ = srv.servicer
                got[fast] = (ys, s_.tensor_counts.top(100), w.stats(), seen[0])
                if fast:
                    expected = _in_c(model, [pick for pick, *_ in calls])
        finally:
            srv.stop(0)
    ys, counts, groups, ran = got[True]
    ys0, counts0, groups0, ran0 = got[False]
    assert ran == expected and ran0 == 0
    assert expected >= len(calls) // 2  # (most: see _in_c)
    for y, y0, (pick, x, routes, weights) in zip(ys, ys0, calls, strict=True):
        assert y.dtype == y0.dtype == np.float32 and y.shape == y0.shape
        np.testing.assert_array_equal(y, y0)
        sub = Model(None, [model.tensors[j] for j in pick], *[None] * 6)
        want = routed_reference(sub, x, routes, weights)
        assert np.abs(y - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert counts == counts0  # (calls, rows) of every tensor, largest first

    def strip(stats):  # (the times differ run to run)
        return [(d.device, d.group.calls, d.group.experts, d.group.rows) for d in stats]

    assert strip(groups) == strip(groups0) and groups[0].group.calls == len(calls)


@needs_c
def test_errors_after_the_list_is_known_are_the_pythons(rng):
    """With the list resolved (the compiled path's cache hit), a bad call still gets the
    Python's typed error, and the session goes on."""
    srv = _worker(True)
    seen = _counted(srv)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            model = _model(w, rng, 4)
            x = rng.standard_normal((2, D)).astype(np.float32)
            routes, weights = routing(rng, 2, 3, 4)
            with w.session(transport="socket") as s:
                want = s.expert_group_routed_sync(model.experts, x, routes, weights)
                np.testing.assert_array_equal(
                    s.expert_group_routed_sync(model.experts, x, routes, weights), want
                )
                assert seen[0] == 1  # the list resolved by the first call, the second's in C
                bad = routes.copy()
                bad[1, 2] = 4
                want_error = r"routes\[1, 2\]: expected 0\.\.3 .*got 4"
                with pytest.raises(InvalidArgument, match=want_error):
                    s.expert_group_routed_sync(model.experts, x, bad, weights)
                with pytest.raises(InvalidArgument, match=rf"x: expected {D} columns"):
                    s.expert_group_routed_sync(model.experts, x[:, :-1], routes, weights)
                with pytest.raises(InvalidArgument, match=r"weights: expected shape \[2, 3\]"):
                    s.expert_group_routed_sync(model.experts, x, routes, weights[:, :2])
                w.free(model.experts[3][0])  # the store's generation moves: no stale list
                with pytest.raises(Exception, match="experts\\[3\\].gate"):
                    s.expert_group_routed_sync(model.experts, x, routes, weights)
                assert seen[0] == 1  # none of the bad calls ran there
                # a new list of three experts the failed call resolved again: in C where it
                # keys them as that call did (_in_c)
                np.testing.assert_array_equal(
                    s.expert_group_routed_sync(model.experts[:3], x, routes % 3, weights),
                    w.expert_group_routed(model.experts[:3], x, routes % 3, weights),
                )
                assert seen[0] == 1 + _in_c(model, [[0, 1, 2, 3], [0, 1, 2]])
    finally:
        srv.stop(0)


def _frame(model: Model, x, routes, weights, out_dtype: int = 0):
    """A routed call's body and data as a socket session sends them."""
    side: list = []
    msg = pb.ExpertGroupRoutedRequest()
    for g, u, d in model.experts:
        msg.experts.add(gate=g.handle, up=u.handle, down=d.handle)
    codec.encode_into(msg.x, x, pb.DTYPE_FLOAT32, side)
    codec.encode_into(msg.routes, routes, pb.DTYPE_INT32)
    codec.encode_into(msg.weights, weights, pb.DTYPE_FLOAT32)
    msg.output_dtype = out_dtype
    pieces, n = frames.place(msg, side)
    data = np.frombuffer(b"".join(bytes(memoryview(p).cast("B")) for p in pieces), np.uint8)
    return msg, data


@needs_c
def test_what_the_c_reads_and_what_it_leaves(rng):
    """``routed_args`` on requests built here: the valid one gives the Python's arrays and the
    cached triples; every variant the Python would refuse or read otherwise gives None."""
    mod = fastpath.module()
    srv = _worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            model = _model(w, rng, 5)
            s = srv.servicer
            x = rng.standard_normal((3, D)).astype(np.float32)
            routes, weights = routing(rng, 3, 4, 5)
            msg, data = _frame(model, x, routes, weights)

            def args(m=msg, d=data, owner="", shm_view=None, max_experts=None):
                return mod.routed_args(
                    m.SerializeToString(),
                    d,
                    owner,
                    s._expert_cache,
                    s._triple_cache,
                    s.store.generation,
                    max_experts or s.config.max_experts,
                    shm_view,
                )

            assert args() is None  # the list not resolved yet
            io = codec.ArrayIO(staging.source(data, None, "t"), [])
            s._experts(msg, "expert_group_routed", "", io)  # as the Python path resolves it
            got = args()
            assert got is not None
            triples, device, gx, groutes, gweights = got
            assert triples is s._experts(msg, "expert_group_routed", "", io)[0]
            assert device == 0
            for a, b in ((gx, x), (groutes, routes), (gweights, weights)):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)

            def variant(change) -> pb.ExpertGroupRoutedRequest:
                m = pb.ExpertGroupRoutedRequest()
                m.CopyFrom(msg)
                change(m)
                return m

            bad_route = routes.copy()
            bad_route[2, 0] = -1

            def put(field: str, a: np.ndarray, dtype: int):
                def change(m):
                    getattr(m, field).Clear()
                    codec.encode_into(getattr(m, field), a, dtype)

                return change

            refused = {
                "route < 0": variant(put("routes", bad_route, pb.DTYPE_INT32)),
                "route >= n": variant(put("routes", np.full_like(routes, 5), pb.DTYPE_INT32)),
                "routes int32 as float": variant(
                    put("routes", routes.astype(np.float32), pb.DTYPE_FLOAT32)
                ),
                "bf16 out": variant(lambda m: setattr(m, "output_dtype", pb.DTYPE_BFLOAT16)),
                "f16 weights": variant(put("weights", weights, pb.DTYPE_FLOAT16)),
                "weights shape": variant(put("weights", weights[:, :3], pb.DTYPE_FLOAT32)),
                "routes rows": variant(put("routes", routes[:2], pb.DTYPE_INT32)),
                "x past the data": variant(
                    lambda m: setattr(m.x.staged, "length", m.x.staged.length + 4)
                ),
                "x shape": variant(lambda m: m.x.shape.__setitem__(1, D - 1)),
                "x rank": variant(lambda m: m.x.shape.append(1)),
                "another expert": variant(
                    lambda m: setattr(m.experts[0], "gate", m.experts[1].gate)
                ),
                "no x": variant(lambda m: m.ClearField("x")),
            }
            for name, m in refused.items():
                assert args(m) is None, name
            # a new list of known experts (a router's next pick): made from the per-triple
            # cache, and cached, as the Python makes it. (The Python resolves it first, so
            # that its experts are cached under this list's key form, _in_c; its list entry
            # is then taken out, for the C to make.)
            for name, change in {
                "one expert less": lambda m: m.experts.__delitem__(4),
                "another order": lambda m: m.experts.reverse(),
            }.items():
                m = variant(change)
                m.routes.Clear()
                codec.encode_into(m.routes, routes % 4, pb.DTYPE_INT32)
                io = codec.ArrayIO(staging.source(data, None, "t"), [])
                before = set(s._expert_cache)
                s._experts(m, "expert_group_routed", "", io)
                (key,) = set(s._expert_cache) - before
                theirs = s._expert_cache.pop(key)
                got = args(m)
                assert got is not None, name
                ours = s._expert_cache[key]  # the same key, made by the C
                assert ours[1] is got[0] and ours is not theirs, name
                assert (ours[0], ours[2], ours[3]) == (theirs[0], theirs[2], theirs[3]), name
                assert all(a is b for a, b in zip(ours[1], theirs[1], strict=True)), name
                assert all(a is b for a, b in zip(ours[1].ids, theirs[1].ids, strict=True))
                assert type(ours[1]) is type(theirs[1])
            assert args(owner="bob") is None, "another owner's list"
            assert args(max_experts=4) is None, "over --max-experts"
            body = msg.SerializeToString()
            for name, extra in {
                "unknown field": b"\x30\x01",
                "x twice": body[body.index(b"\x12") :][:2],
                "truncated": b"\x22\x10",
            }.items():
                assert (
                    mod.routed_args(
                        body + extra,
                        data,
                        "",
                        s._expert_cache,
                        s._triple_cache,
                        s.store.generation,
                        64,
                        None,
                    )
                    is None
                ), name
            shm = variant(
                lambda m: (
                    m.x.ClearField("staged"),
                    setattr(m.x.shm, "offset", 4096),
                    setattr(m.x.shm, "length", x.nbytes),
                )
            )
            assert args(shm) is None, "shm slice, no segment"
            calls = []

            def view(offset, length, field):
                calls.append((offset, length, field))
                return memoryview(x.tobytes()).toreadonly()

            got = args(shm, shm_view=view)
            assert got is not None and calls == [(4096, x.nbytes, "expert_group_routed")]
            np.testing.assert_array_equal(got[2], x)
            assert not got[2].flags.writeable

            def outside(offset, length, field):
                raise ValueError("outside")

            assert args(shm, shm_view=outside) is None
            # every array inline (no outside bytes): the list's other key, (owner, ids...)
            inline = variant(put("x", x, pb.DTYPE_FLOAT32))
            # (the ids' keys are the first call's too where the experts' serialized lengths
            # differ, as random handle ids make them at times)
            s._expert_cache.clear()
            s._triple_cache.clear()
            assert args(inline) is None
            s._experts(inline, "expert_group_routed", "", codec.INLINE)
            got = args(inline)
            assert got is not None and got[0] is s._experts(inline, "x", "", codec.INLINE)[0]
            np.testing.assert_array_equal(got[2], x)
            w.free(model.experts[0][0])
            assert args() is None, "the generation moved"
    finally:
        srv.stop(0)


@needs_c
@pytest.mark.parametrize("shm", [False, True])
def test_the_reply_body_is_protobufs(rng, shm):
    mod = fastpath.module()
    for _ in range(200):
        shape = tuple(int(v) for v in rng.integers(1, 1 << int(rng.integers(1, 31)), size=2))
        nbytes = int(rng.integers(0, 1 << 40))
        ns = [int(v) if rng.random() < 0.8 else 0 for v in rng.integers(0, 1 << 62, size=4)]
        offset = int(rng.integers(0, 1 << 40)) if rng.random() < 0.8 else 0
        resp = pb.ExpertGroupResponse()
        resp.y.dtype = pb.DTYPE_FLOAT32
        resp.y.shape.extend(shape)
        where = resp.y.shm if shm else resp.y.staged
        where.offset, where.length = offset, nbytes
        resp.y.SetInParent()
        if not (offset or nbytes):
            where.SetInParent()
        resp.backend_ns, resp.h2d_ns, resp.kernel_ns, resp.d2h_ns = ns
        want = resp.SerializeToString()
        assert mod.group_reply(shape, nbytes, *ns, shm, offset) == want


def test_where_it_cannot_be_had_the_python_serves(monkeypatch, tmp_path, caplog, rng):
    """No compiler, switched off, or a worker injecting faults: no compiled path, one warning
    for the build, and the data plane answers every call through the Python."""
    import logging

    monkeypatch.setenv("COLIWORKER_KEPT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(fastpath, "_built", [])
    monkeypatch.setattr(fastpath, "ENABLED", True)
    with caplog.at_level(logging.WARNING, logger="coliworker.server.fastpath"):
        assert fastpath.module() is None
        assert fastpath.module() is None  # tried once per process
    (rec,) = caplog.records
    assert "compiled frame path unavailable, the Python runs" in rec.getMessage()
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None)).start()
    try:
        assert srv.servicer.fastcalls is None
        with WorkerClient(srv.address, progress=False) as w:
            model = _model(w, rng, 3)
            x = rng.standard_normal((2, D)).astype(np.float32)
            routes, weights = routing(rng, 2, 2, 3)
            with w.session(transport="socket") as s:
                for _ in range(2):
                    np.testing.assert_array_equal(
                        s.expert_group_routed_sync(model.experts, x, routes, weights),
                        w.expert_group_routed(model.experts, x, routes, weights),
                    )
    finally:
        srv.stop(0)
    monkeypatch.setattr(fastpath, "_built", [])
    monkeypatch.setattr(fastpath, "ENABLED", False)
    assert fastpath.module() is None and os.listdir(tmp_path) == []
    monkeypatch.setattr(fastpath, "_built", [object()])  # (any module: never asked for)
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None, fail_after=5))
    assert srv.servicer.fastcalls is None  # --fail-after counts calls in the Python


def _attention(w: WorkerClient, rng) -> tuple:
    kv_b_t = int4_tensor(rng, K, H * (Q + V))
    o_proj_t = int4_tensor(rng, H * V, D_OUT)
    return upload(w, kv_b_t), upload(w, o_proj_t), kv_b_t, o_proj_t


def _decode_steps(rng, steps: int, n_seq: int) -> list:
    """A decode run of ``n_seq`` sequences: per step, each sequence's one new row (a fresh
    prompt of 1-4 rows on the first), its query; as (q, [(sid, start, latent, rope)])."""
    sids = [int(v) for v in rng.integers(1, 1 << 50, size=n_seq)]
    length = [0] * n_seq
    out = []
    for step in range(steps):
        seqs = []
        for i, sid in enumerate(sids):
            n = int(rng.integers(1, 5)) if step == 0 else 1
            lat = rng.standard_normal((n, K)).astype(np.float32)
            rope = rng.standard_normal((n, R)).astype(np.float32)
            seqs.append((sid, length[i], lat, rope))
            length[i] += n
        out.append((rng.standard_normal((n_seq, H, Q + R)).astype(np.float32), seqs))
    return out


@needs_c
@pytest.mark.parametrize("transport", ["socket", "doorbell"])
@pytest.mark.parametrize("o_proj", [True, False])
def test_ragged_attention_answers_as_the_python(rng, transport, o_proj):
    """Decode steps of several sequences through a worker with the compiled path and one
    without: bit-identical results, the same cache lengths after each call, each result
    against the float64 reference over the rows sent so far; the compiled path ran every
    call after the first (which resolved kv_b and o_proj)."""
    steps = _decode_steps(rng, 6, 3)
    got = {}
    for fast in (True, False):
        srv = _worker(fast)
        seen = _counted(srv, "attention_ragged_checked")
        try:
            with WorkerClient(srv.address, progress=False) as w:
                kv_b, proj, kv_b_t, proj_t = _attention(w, np.random.default_rng(11))
                kw = {"shm": True, "doorbell": True} if transport == "doorbell" else {
                    "transport": "socket"}  # fmt: skip
                outs = []
                with w.session(**kw) as s:
                    for q, seqs in steps:
                        f = s.attention_ragged(kv_b, proj if o_proj else None, q,
                                               sequences=seqs, **ATT)  # fmt: skip
                        outs.append((f.result(10), list(f.lengths)))
                got[fast] = (outs, seen[0], srv.servicer.tensor_counts.top(100))
        finally:
            srv.stop(0)
    (outs, ran, counts), (outs0, ran0, counts0) = got[True], got[False]
    assert ran == len(steps) - 1 and ran0 == 0
    assert counts == counts0
    lat_all: dict[int, list] = {}
    for (y, lengths), (y0, lengths0), (q, seqs) in zip(outs, outs0, steps, strict=True):
        assert lengths == lengths0 == [start + len(lat) for _, start, lat, _ in seqs]
        assert y.dtype == y0.dtype == np.float32 and y.shape == y0.shape
        np.testing.assert_array_equal(y, y0)
        for sid, _, lat, rope in seqs:
            lat_all.setdefault(sid, []).append((lat, rope))
        latents = [np.concatenate([a for a, _ in lat_all[sid]]) for sid, *_ in seqs]
        ropes = [np.concatenate([b for _, b in lat_all[sid]]) for sid, *_ in seqs]
        want = ref.attention_ragged(kv_b_t, proj_t if o_proj else None, q, latents, ropes, **ATT)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)


@needs_c
def test_ragged_errors_and_rollback_after_the_pair_is_known(rng):
    """With kv_b and o_proj resolved, bad calls get the Python's typed errors and change no
    cache; a step that rolls a sequence back (start below its length) runs in C and
    truncates as the Python does."""
    srv = _worker(True)
    seen = _counted(srv, "attention_ragged_checked")
    try:
        with WorkerClient(srv.address, progress=False) as w:
            kv_b, proj, *_ = _attention(w, rng)
            sid = int(rng.integers(1, 1 << 40))
            lat = rng.standard_normal((6, K)).astype(np.float32)
            rope = rng.standard_normal((6, R)).astype(np.float32)
            q = rng.standard_normal((1, H, Q + R)).astype(np.float32)
            with w.session(transport="socket") as s:

                def call(start, a, b, qq=q, **kw):
                    att = {**ATT, **kw}
                    f = s.attention_ragged(kv_b, proj, qq, sequences=[(sid, start, a, b)], **att)
                    return f.result(10), list(f.lengths)

                call(0, lat[:3], rope[:3])
                _, lengths = call(3, lat[3:4], rope[3:4])
                assert seen[0] == 1 and lengths == [4]
                with pytest.raises(InvalidArgument, match=rf"latent: expected {K} columns"):
                    call(4, lat[4:5, :-1], rope[4:5])
                with pytest.raises(InvalidArgument, match=r"rope: expected 1 rows"):
                    call(4, lat[4:5], rope[4:6])
                with pytest.raises(InvalidArgument, match=r"start: expected >= 0"):
                    call(-1, lat[4:5], rope[4:5])
                with pytest.raises(InvalidArgument, match=r"scale: expected a finite"):
                    call(4, lat[4:5], rope[4:5], scale=float("inf"))
                with pytest.raises(InvalidArgument, match=r"sequences: expected 2 \(one per"):
                    call(4, lat[4:5], rope[4:5], qq=np.concatenate([q, q]))
                assert seen[0] == 1
                y, lengths = call(2, lat[2:5], rope[2:5])  # rolls back to 2, then 3 rows
                assert seen[0] == 2 and lengths == [5]
            w.free_sequence(sid)
            want = w.attention_ragged(kv_b, proj, q, sequences=[(sid, 0, lat[:5], rope[:5])], **ATT)
            np.testing.assert_array_equal(y, want)
    finally:
        srv.stop(0)


@needs_c
def test_what_the_c_reads_of_a_ragged_call(rng):
    """``ragged_args`` on requests built here: the valid one gives the Python's arrays, rows
    and handles; each variant the Python refuses or reads otherwise gives None."""
    from coliworker.server.sequences import RowsIn

    mod = fastpath.module()
    srv = _worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            kv_b, proj, *_ = _attention(w, rng)
            s = srv.servicer
            q = rng.standard_normal((2, H, Q + R)).astype(np.float32)
            lat = rng.standard_normal((3, K)).astype(np.float32)
            rope = rng.standard_normal((3, R)).astype(np.float32)
            side: list = []
            msg = pb.AttentionRaggedRequest(kv_b=kv_b.handle, o_proj=proj.handle, **ATT)
            codec.encode_into(msg.q, q, pb.DTYPE_FLOAT32, side)
            a = msg.sequences.add(sequence_id=5, start=0)
            codec.encode_into(a.latent, lat, pb.DTYPE_FLOAT32, side)
            codec.encode_into(a.rope, rope, pb.DTYPE_FLOAT32)
            msg.sequences.add(sequence_id=9, start=2)  # nothing new: zero rows
            pieces, _ = frames.place(msg, side)
            data = np.frombuffer(b"".join(bytes(memoryview(p).cast("B")) for p in pieces), np.uint8)

            def args(m=msg, owner="", limit=None):
                return mod.ragged_args(
                    m.SerializeToString(),
                    data,
                    owner,
                    s._attention_cache,
                    s.store.generation,
                    limit or s.config.max_sequences_per_call,
                    None,
                    RowsIn,
                )

            assert args() is None  # not resolved yet
            first = pb.AttentionRaggedRequest(kv_b=kv_b.handle, o_proj=proj.handle, **ATT)
            codec.encode_into(first.q, q[:1], pb.DTYPE_FLOAT32)
            nine = first.sequences.add(sequence_id=9, start=0)
            codec.encode_into(nine.latent, lat[:2], pb.DTYPE_FLOAT32)
            codec.encode_into(nine.rope, rope[:2], pb.DTYPE_FLOAT32)
            s.attention_ragged(first, "", codec.INLINE)  # the Python resolves (and runs) it
            got = args()
            assert got is not None
            kv, proj_h, proj_r, gq, rows, fresh, k, q_dim, rope_dim, v_dim, scale, o_id = got
            hit = s._attention_cache[("", kv_b.handle, proj.handle)]
            assert (kv, proj_h, proj_r) == hit[1:] and o_id == proj.handle
            assert (k, q_dim, rope_dim, v_dim) == (K, Q, R, V) and scale == np.float32(ATT["scale"])
            np.testing.assert_array_equal(gq, q)
            assert [(r.sequence_id, r.start) for r in rows] == [(5, 0), (9, 2)]
            np.testing.assert_array_equal(rows[0].latent, lat)
            np.testing.assert_array_equal(rows[0].rope, rope)
            assert rows[1].latent.shape == (0, K) and rows[1].rope.shape == (0, R)
            assert [(a.shape, b.shape) for a, b in fresh] == [((3, K), (3, R)), ((0, K), (0, R))]

            def variant(change) -> pb.AttentionRaggedRequest:
                m = pb.AttentionRaggedRequest()
                m.CopyFrom(msg)
                change(m)
                return m

            refused = {
                "same sequence twice": variant(lambda m: setattr(m.sequences[1], "sequence_id", 5)),
                "start < 0": variant(lambda m: setattr(m.sequences[1], "start", -1)),
                "q_dim 0": variant(lambda m: setattr(m, "q_dim", 0)),
                "q_dim < 0": variant(lambda m: setattr(m, "q_dim", -3)),
                "v_dim wrong": variant(lambda m: setattr(m, "v_dim", V + 1)),
                "scale 0": variant(lambda m: setattr(m, "scale", 0.0)),
                "scale nan": variant(lambda m: setattr(m, "scale", float("nan"))),
                "bf16 out": variant(lambda m: setattr(m, "output_dtype", pb.DTYPE_BFLOAT16)),
                "one sequence less": variant(lambda m: m.sequences.__delitem__(1)),
                "latent columns": variant(
                    lambda m: m.sequences[0].latent.shape.__setitem__(1, K - 1)
                ),
                "rope rows": variant(lambda m: m.sequences[0].rope.shape.__setitem__(0, 2)),
                "rope f16": variant(
                    lambda m: (
                        m.sequences[0].rope.Clear(),
                        codec.encode_into(m.sequences[0].rope, rope, pb.DTYPE_FLOAT16),
                    )
                ),
                "q past the data": variant(
                    lambda m: setattr(m.q.staged, "length", m.q.staged.length + 4)
                ),
                "another o_proj": variant(lambda m: setattr(m, "o_proj", 0)),
            }
            for name, m in refused.items():
                assert args(m) is None, name
            assert args(owner="bob") is None, "another owner's pair"
            assert args(limit=1) is None, "over --max-sequences-per-call"
            body = msg.SerializeToString()
            for name, extra in {"unknown field": b"\x50\x01", "q_dim twice": b"\x28\x05"}.items():
                raw = body + extra
                got = mod.ragged_args(raw, data, "", s._attention_cache, s.store.generation, 64,
                                      None, RowsIn)  # fmt: skip
                assert got is None, name
            w.free(proj)
            assert args() is None, "the generation moved"
    finally:
        srv.stop(0)


def test_the_ragged_reply_body_is_protobufs(rng):
    mod = fastpath.module()
    if mod is None:
        pytest.skip("server/fastpath.c cannot be built on this host")
    for _ in range(200):
        ndim = int(rng.integers(2, 4))
        shape = tuple(int(v) for v in rng.integers(1, 1 << int(rng.integers(1, 31)), size=ndim))
        nbytes = int(rng.integers(0, 1 << 40))
        lengths = [
            int(v)
            for v in rng.integers(0, 1 << int(rng.integers(1, 62)), size=int(rng.integers(0, 40)))
        ]
        backend_ns = int(rng.integers(0, 1 << 62)) if rng.random() < 0.8 else 0
        shm = bool(rng.random() < 0.5)
        offset = int(rng.integers(0, 1 << 40)) if rng.random() < 0.8 else 0
        resp = pb.AttentionRaggedResponse()
        resp.out.dtype = pb.DTYPE_FLOAT32
        resp.out.shape.extend(shape)
        where = resp.out.shm if shm else resp.out.staged
        where.offset, where.length = offset, nbytes
        where.SetInParent()
        resp.lengths.extend(lengths)
        resp.backend_ns = backend_ns
        assert (
            mod.ragged_reply(shape, nbytes, lengths, backend_ns, shm, offset)
            == resp.SerializeToString()
        )


def _mutants(rng, body: bytes, n: int):
    """``n`` random corruptions of ``body``: bytes changed, cut out, put in, or the end cut."""
    for _ in range(n):
        b = bytearray(body)
        for _ in range(int(rng.integers(1, 4))):
            op, at = int(rng.integers(0, 4)), int(rng.integers(0, len(b) + 1))
            if op == 0 and at < len(b):
                b[at] = int(rng.integers(0, 256))
            elif op == 1:
                del b[at : at + int(rng.integers(1, 8))]
            elif op == 2:
                b[at:at] = rng.integers(0, 256, int(rng.integers(1, 6))).astype(np.uint8).tobytes()
            else:
                del b[at:]
        yield bytes(b)


@needs_c
def test_what_the_c_reads_of_corrupt_frames_the_python_reads_the_same(rng):
    """Random corruptions of a routed and a ragged call's body: the C reads few of them, and
    each it reads the Python reads too, with the same outcome: the same result (the same
    response but its times) or the same status and message."""
    from coliworker.server.dispatch import OK
    from coliworker.wire import calls as wire_calls

    srv = _worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            s = srv.servicer
            fc = s.fastcalls
            model = _model(w, rng, 4)
            x = rng.standard_normal((2, D)).astype(np.float32)
            routes, weights = routing(rng, 2, 3, 4)
            routed, routed_data = _frame(model, x, routes, weights)
            kv_b, proj, *_ = _attention(w, rng)
            side: list = []
            ragged = pb.AttentionRaggedRequest(kv_b=kv_b.handle, o_proj=proj.handle, **ATT)
            codec.encode_into(ragged.q, rng.standard_normal((1, H, Q + R)).astype(np.float32),
                              pb.DTYPE_FLOAT32, side)  # fmt: skip
            seq = ragged.sequences.add(sequence_id=3, start=0)
            codec.encode_into(seq.latent, rng.standard_normal((2, K)).astype(np.float32),
                              pb.DTYPE_FLOAT32, side)  # fmt: skip
            codec.encode_into(seq.rope, rng.standard_normal((2, R)).astype(np.float32),
                              pb.DTYPE_FLOAT32)  # fmt: skip
            pieces, _ = frames.place(ragged, side)
            ragged_data = np.frombuffer(
                b"".join(bytes(memoryview(p).cast("B")) for p in pieces), np.uint8
            )
            read = 0
            for msg, data in ((routed, routed_data), (ragged, ragged_data)):
                call = wire_calls.BY_KIND[
                    "expert_group_routed" if msg is routed else "attention_ragged"
                ]
                body = msg.SerializeToString()
                # the Python resolves the call first (what the C then finds in the caches)
                io = codec.ArrayIO(staging.source(data, None, call.kind), [])
                assert s.dispatch.run(call, call.request.FromString(body), "", io).ok
                assert fc.run(call.method, body, data, "", "socket") is not None
                for b in _mutants(rng, body, 1500):
                    ours = fc.run(call.method, b, data, "", "socket")
                    if ours is None:
                        continue
                    read += 1
                    req = call.request.FromString(b)  # (raises if protobuf refuses it)
                    assert staging.check(req, data, None, call.kind)
                    sink: list = []
                    io = codec.ArrayIO(staging.source(data, None, call.kind), sink)
                    theirs = s.dispatch.run(call, req, "", io, transport="socket")
                    assert (ours.code, ours.message) == (theirs.code, theirs.message), b.hex()
                    if ours.code is not OK:
                        continue
                    frames.place(theirs.response, sink)
                    got = call.response.FromString(ours.response.body(False, 0))
                    for m in (got, theirs.response):
                        for f in ("backend_ns", "h2d_ns", "kernel_ns", "d2h_ns"):
                            if f in m.DESCRIPTOR.fields_by_name:
                                m.ClearField(f)
                    assert got == theirs.response, b.hex()
                    np.testing.assert_array_equal(
                        ours.response.y, sink[0].reshape(ours.response.y.shape)
                    )
            assert read >= 20  # (those whose changes fall in array bytes or are no-ops)
    finally:
        srv.stop(0)
