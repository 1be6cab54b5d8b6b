"""The ragged attention calls' compiled path (``server/fastpath.c``): the same results, KV
cache lengths, usage counts and errors as the Python path over decode steps, on the socket
data plane and the doorbell; rollback; what its reader takes and leaves; its reply body the
bytes protobuf serializes."""

from __future__ import annotations

import numpy as np
import pytest
from _fastcalls import attention_model, counted, needs_c, ragged_frame, worker
from _hotpath import ATT, H, K, Q, R, V

from coliworker.client import InvalidArgument, WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server import fastpath
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec


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
        srv = worker(fast)
        seen = counted(srv, "attention_ragged_checked")
        try:
            with WorkerClient(srv.address, progress=False) as w:
                kv_b, proj, kv_b_t, proj_t = attention_model(w, np.random.default_rng(11))
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
    srv = worker(True)
    seen = counted(srv, "attention_ragged_checked")
    try:
        with WorkerClient(srv.address, progress=False) as w:
            kv_b, proj, *_ = attention_model(w, rng)
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
    srv = worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            kv_b, proj, *_ = attention_model(w, rng)
            s = srv.servicer
            q = rng.standard_normal((2, H, Q + R)).astype(np.float32)
            lat = rng.standard_normal((3, K)).astype(np.float32)
            rope = rng.standard_normal((3, R)).astype(np.float32)
            # sequence 9 sends nothing new: zero rows
            msg, data = ragged_frame(kv_b, proj, q, [(5, 0, lat, rope), (9, 2, None, None)])

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


@needs_c
def test_the_ragged_reply_body_is_protobufs(rng):
    mod = fastpath.module()
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
