"""The decode calls' compiled path (``server/fastpath.c``, ``server/fastpath.py``) as a
whole: where it cannot be had the Python serves every call, and of random corruptions of an
expert group, a routed and a ragged body, each the C reads the Python reads too, with the
same outcome. (``test_fastpath_group.py``, ``test_fastpath_routed.py`` and
``test_fastpath_ragged.py`` test each call.)"""

from __future__ import annotations

import os

import numpy as np
from _fastcalls import (
    attention_model,
    experts_model,
    group_frame,
    mutants,
    needs_c,
    ragged_frame,
    routed_frame,
    worker,
)
from _hotpath import D, H, K, Q, R, routing

from coliworker.client import WorkerClient
from coliworker.server import fastpath
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.wire import codec, frames, staging


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
            model = experts_model(w, rng, 3)
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


@needs_c
def test_what_the_c_reads_of_corrupt_frames_the_python_reads_the_same(rng):
    """Random corruptions of an expert group, a routed and a ragged call's body: the C reads
    few of them, and each it reads the Python reads too, with the same outcome: the same
    result (the same response but its times) or the same status and message."""
    from coliworker.server.dispatch import OK
    from coliworker.wire import calls as wire_calls

    srv = worker(True)
    try:
        with WorkerClient(srv.address, progress=False) as w:
            s = srv.servicer
            fc = s.fastcalls
            model = experts_model(w, rng, 4)
            x = rng.standard_normal((2, D)).astype(np.float32)
            routes, weights = routing(rng, 2, 3, 4)
            routed, routed_data = routed_frame(model, x, routes, weights)
            group, group_data = group_frame(model.experts[::-1], [1, 2, 1, 1], x[[0, 1, 1, 0, 1]])
            kv_b, proj, *_ = attention_model(w, rng)
            q = rng.standard_normal((1, H, Q + R)).astype(np.float32)
            lat = rng.standard_normal((2, K)).astype(np.float32)
            rope = rng.standard_normal((2, R)).astype(np.float32)
            ragged, ragged_data = ragged_frame(kv_b, proj, q, [(3, 0, lat, rope)])
            read = 0
            for kind, msg, data in (
                ("expert_group", group, group_data),
                ("expert_group_routed", routed, routed_data),
                ("attention_ragged", ragged, ragged_data),
            ):
                call = wire_calls.BY_KIND[kind]
                body = msg.SerializeToString()
                # the Python resolves the call first (what the C then finds in the caches)
                io = codec.ArrayIO(staging.source(data, None, call.kind), [])
                assert s.dispatch.run(call, call.request.FromString(body), "", io).ok
                assert fc.run(call.method, body, data, "", "socket") is not None
                for b in mutants(rng, body, 1500):
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
