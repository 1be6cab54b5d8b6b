"""The expert group calls' compiled path (``server/fastpath.c``'s ``group_args``): the call a
seed-ABI engine makes at decode through the C client (each expert's rows of x packed in
turn). The same results, usage counts, statistics and errors as the Python path, on the
socket data plane and the doorbell, with new experts and rows every call; what its reader
takes and leaves."""

from __future__ import annotations

import numpy as np
import pytest
from _fastcalls import (
    both_paths,
    check_x_in_shm,
    counted,
    experts_model,
    group_frame,
    in_c,
    needs_c,
    worker,
)
from _hotpath import D

from coliworker.client import InvalidArgument, WorkerClient
from coliworker.kernels import reference
from coliworker.server import fastpath
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec, staging

OP = "expert_group_checked"  # the compiled path's handler (counted)


def _calls(rng, n_experts: int, n: int):
    """``n`` random expert group calls: the first names every expert, each later one a random
    few in a random order, each with 1-3 rows; (expert indexes, rows, x)."""
    out = []
    for i in range(n):
        pick = rng.permutation(n_experts)[: n_experts if i == 0 else int(rng.integers(1, 5))]
        rows = [int(v) for v in rng.integers(1, 4, len(pick))]
        x = rng.standard_normal((sum(rows), D)).astype(np.float32)
        out.append(([int(j) for j in pick], rows, x))
    return out


@needs_c
@pytest.mark.parametrize("transport", ["socket", "doorbell"])
def test_the_compiled_path_answers_as_the_python(rng, transport):
    """The same calls through a worker with the compiled path and one without: bit-identical
    results (each also against the float64 reference), the same usage counts and group
    statistics; the compiled path ran each call whose list or experts an earlier call
    resolved (``in_c``)."""
    model, calls, expected, fast, slow = both_paths(
        transport,
        OP,
        11,
        lambda model: _calls(rng, len(model.experts), 16),
        lambda s, experts, rows, x: s.expert_group_sync(experts, rows, x),
    )
    (ys, counts, groups, ran), (ys0, counts0, groups0, ran0) = fast, slow
    assert ran == expected and ran0 == 0
    assert expected >= len(calls) // 2  # (most: see in_c)
    for y, y0, (pick, rows, x) in zip(ys, ys0, calls, strict=True):
        assert y.dtype == y0.dtype == np.float32 and y.shape == y0.shape == x.shape
        np.testing.assert_array_equal(y, y0)
        want = reference.expert_group([model.tensors[j] for j in pick], rows, x)
        assert np.abs(y - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert counts == counts0  # (calls, rows) of every tensor, largest first
    assert groups == groups0 and groups[0][1] == len(calls)  # (calls, experts, rows)
    assert groups[0][3] == sum(sum(rows) for _, rows, _ in calls)


@needs_c
def test_errors_after_the_list_is_known_are_the_pythons(rng):
    """With the list resolved (the compiled path's cache hit), a bad call still gets the
    Python's typed error, and the session goes on."""
    srv = worker(True)
    seen = counted(srv, OP)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            model = experts_model(w, rng, 3)
            rows = [2, 1, 3]
            x = rng.standard_normal((6, D)).astype(np.float32)
            with w.session(transport="socket") as s:
                want = s.expert_group_sync(model.experts, rows, x)
                np.testing.assert_array_equal(s.expert_group_sync(model.experts, rows, x), want)
                np.testing.assert_array_equal(want, w.expert_group(model.experts, rows, x))
                assert seen[0] == 1  # the list resolved by the first call, the second's in C
                with pytest.raises(
                    InvalidArgument, match=r"x: expected 7 rows \(sum of rows\), got 6"
                ):
                    s.expert_group_sync(model.experts, [2, 1, 4], x)
                with pytest.raises(InvalidArgument, match=r"rows\[1\]: expected >= 1, got 0"):
                    s.expert_group_sync(model.experts, [2, 0, 4], x)
                with pytest.raises(InvalidArgument, match=r"rows: expected 3 entries"):
                    s.expert_group_sync(model.experts, [2, 4], x)
                with pytest.raises(InvalidArgument, match=rf"x: expected {D} columns"):
                    s.expert_group_sync(model.experts, rows, x[:, :-1])
                w.free(model.experts[2][1])  # the store's generation moves: no stale list
                with pytest.raises(Exception, match=r"experts\[2\].up"):
                    s.expert_group_sync(model.experts, rows, x)
                assert seen[0] == 1  # none of the bad calls ran there
                np.testing.assert_array_equal(
                    s.expert_group_sync(model.experts[:2], rows[:2], x[:3]), want[:3]
                )
                assert seen[0] == 1 + in_c(model, [[0, 1, 2], [0, 1]])
    finally:
        srv.stop(0)


@needs_c
def test_what_the_c_reads_and_what_it_leaves(rng):
    """``group_args`` on requests built here: the valid one gives the Python's rows, x and
    cached triples; every variant the Python would refuse or read otherwise gives None."""
    mod = fastpath.module()
    srv = worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            model = experts_model(w, rng, 4)
            s = srv.servicer
            rows = [1, 3, 2, 1]
            x = rng.standard_normal((7, D)).astype(np.float32)
            msg, data = group_frame(model.experts, rows, x)

            def args(m=msg, d=data, owner="", shm_view=None, max_experts=None, body=None):
                return mod.group_args(
                    m.SerializeToString() if body is None else body,
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
            triples = s._experts(msg, "expert_group", "", io)[0]  # as the Python resolves it
            got = args()
            assert got is not None
            gtriples, device, grows, gx = got
            assert gtriples is triples and device == 0
            assert grows == rows and type(grows) is list
            assert gx.dtype == np.float32 and gx.shape == x.shape
            np.testing.assert_array_equal(gx, x)
            # the routed call's list of the same experts is this one (one cache, one key)
            assert s._experts(msg, "expert_group_routed", "", io)[0] is triples

            def variant(change) -> pb.ExpertGroupRequest:
                m = pb.ExpertGroupRequest()
                m.CopyFrom(msg)
                change(m)
                return m

            def put_x(a: np.ndarray, dtype: int):
                def change(m):
                    m.x.Clear()
                    codec.encode_into(m.x, a, dtype)

                return change

            refused = {
                "a row count 0": variant(lambda m: m.rows.__setitem__(1, 0)),
                "a row count < 0": variant(lambda m: m.rows.__setitem__(2, -3)),
                "rows short": variant(lambda m: m.rows.__delitem__(3)),
                "rows long": variant(lambda m: m.rows.append(1)),
                "sum(rows) != x rows": variant(lambda m: m.rows.__setitem__(0, 2)),
                "bf16 out": variant(lambda m: setattr(m, "output_dtype", pb.DTYPE_BFLOAT16)),
                "f16 x": variant(put_x(x, pb.DTYPE_FLOAT16)),
                "x past the data": variant(
                    lambda m: setattr(m.x.staged, "length", m.x.staged.length + 4)
                ),
                "x shape": variant(lambda m: m.x.shape.__setitem__(1, D - 1)),
                "x rank": variant(lambda m: m.x.shape.append(1)),
                "another expert": variant(
                    lambda m: setattr(m.experts[0], "gate", m.experts[1].gate)
                ),
                "no x": variant(lambda m: m.ClearField("x")),
                "no experts": variant(lambda m: m.ClearField("experts")),
            }
            for name, m in refused.items():
                assert args(m) is None, name
            assert args(owner="bob") is None, "another owner's list"
            assert args(max_experts=3) is None, "over --max-experts"
            body = msg.SerializeToString()
            for name, extra in {
                "unknown field": b"\x28\x01",
                "x twice": body[body.index(b"\x1a") :][:2],
                "truncated": b"\x1a\x10",
                "out dtype twice": b"\x20\x01\x20\x01",
            }.items():
                assert args(body=body + extra) is None, name
            # rows one value at a time (unpacked), and in two packed runs: protobuf appends
            # them all, and so does the C
            ex = b"".join(msg.SerializeToString().split(b"\x12\x04\x01\x03\x02\x01"))
            assert ex != body
            for form in (
                b"\x10\x01\x10\x03\x10\x02\x10\x01",
                b"\x12\x02\x01\x03\x10\x02\x12\x01\x01",
            ):
                b2 = ex + form
                assert list(pb.ExpertGroupRequest.FromString(b2).rows) == rows
                got = args(body=b2)
                assert got is not None and got[2] == rows, form
            # a new list of known experts (the engine's next pick): made from the per-triple
            # cache and cached, as the Python makes it (the Python resolves it first, so
            # that its experts are cached under this list's key form; its list entry is then
            # taken out, for the C to make)
            m = variant(lambda m: (m.experts.reverse(), m.rows.reverse()))
            before = set(s._expert_cache)
            s._experts(m, "expert_group", "", io)
            (key,) = set(s._expert_cache) - before
            theirs = s._expert_cache.pop(key)
            got = args(m)
            assert got is not None
            ours = s._expert_cache[key]
            assert ours[1] is got[0] and ours is not theirs
            assert all(a is b for a, b in zip(ours[1], theirs[1], strict=True))
            assert got[2] == rows[::-1]
            # x in the session's segment, read there (a read-only view)
            check_x_in_shm(args, variant, x, 8192, "expert_group", 3)
            w.free(model.experts[0][2])
            assert args() is None, "the generation moved"
    finally:
        srv.stop(0)
