"""The routed expert group calls' compiled path (``server/fastpath.c``): the same results,
usage counts, statistics and errors as the Python path, on the socket data plane and the
doorbell, with a router's new pick of experts every call; what its reader takes and leaves;
its reply body the bytes protobuf serializes."""

from __future__ import annotations

import numpy as np
import pytest
from _fastcalls import (
    both_paths,
    check_x_in_shm,
    counted,
    experts_model,
    in_c,
    needs_c,
    routed_frame,
    worker,
)
from _hotpath import D, Model, routed_reference, routing

from coliworker.client import InvalidArgument, WorkerClient
from coliworker.server import fastpath
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec, staging


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


@needs_c
@pytest.mark.parametrize("transport", ["socket", "doorbell"])
def test_the_compiled_path_answers_as_the_python(rng, transport):
    """The same calls through a worker with the compiled path and one without: bit-identical
    results (each also against the float64 reference), the same usage counts and group
    statistics; the compiled path ran each call whose list or experts an earlier call
    resolved (``in_c``)."""
    model, calls, expected, fast, slow = both_paths(
        transport,
        "expert_group_routed_checked",
        7,
        lambda model: _calls(rng, model, 16),
        lambda s, experts, *c: s.expert_group_routed_sync(experts, *c),
    )
    (ys, counts, groups, ran), (ys0, counts0, groups0, ran0) = fast, slow
    assert ran == expected and ran0 == 0
    assert expected >= len(calls) // 2  # (most: see in_c)
    for y, y0, (pick, x, routes, weights) in zip(ys, ys0, calls, strict=True):
        assert y.dtype == y0.dtype == np.float32 and y.shape == y0.shape
        np.testing.assert_array_equal(y, y0)
        sub = Model(None, [model.tensors[j] for j in pick], *[None] * 6)
        want = routed_reference(sub, x, routes, weights)
        assert np.abs(y - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert counts == counts0  # (calls, rows) of every tensor, largest first
    assert groups == groups0 and groups[0][1] == len(calls)  # (calls, experts, rows)


@needs_c
def test_errors_after_the_list_is_known_are_the_pythons(rng):
    """With the list resolved (the compiled path's cache hit), a bad call still gets the
    Python's typed error, and the session goes on."""
    srv = worker(True)
    seen = counted(srv)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            model = experts_model(w, rng, 4)
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
                # keys them as that call did (in_c)
                np.testing.assert_array_equal(
                    s.expert_group_routed_sync(model.experts[:3], x, routes % 3, weights),
                    w.expert_group_routed(model.experts[:3], x, routes % 3, weights),
                )
                assert seen[0] == 1 + in_c(model, [[0, 1, 2, 3], [0, 1, 2]])
    finally:
        srv.stop(0)


@needs_c
def test_what_the_c_reads_and_what_it_leaves(rng):
    """``routed_args`` on requests built here: the valid one gives the Python's arrays and the
    cached triples; every variant the Python would refuse or read otherwise gives None."""
    mod = fastpath.module()
    srv = worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            model = experts_model(w, rng, 5)
            s = srv.servicer
            x = rng.standard_normal((3, D)).astype(np.float32)
            routes, weights = routing(rng, 3, 4, 5)
            msg, data = routed_frame(model, x, routes, weights)

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
            # that its experts are cached under this list's key form, in_c; its list entry
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
            check_x_in_shm(args, variant, x, 4096, "expert_group_routed", 2)
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
