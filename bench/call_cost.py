"""The host CPU one decode call costs on each side of the data plane, without a transport.

In one process: a worker servicer (NumPy backend, metrics on as deployed, its compute
replaced by a stub that returns a preallocated result, so only the host code runs) and the
client's request code.
For a routed expert group of 8 experts x 1 row (D=6144), the same token as an expert group
call (8 experts, the row repeated for each: the seed ABI's decode call, as the C client
sends it) and a ragged attention call (q [1, 64, 256], one new KV row) it times, per call:

    client build     the request message and its CALL frame (``SessionCalls`` + frames)
    worker parse     the body parsed, the arrays' slices checked
    worker dispatch  ``Dispatch.run``: validation, store, metrics, usage counts, encoding
    worker reply     the REPLY frame (arrays placed, body serialized)
    client decode    the reply parsed and the result decoded
    worker frame     the socket data plane's own code for the frame, its socket a stub: the
                     compiled path (server/fastpath.py) where it takes the call
    worker frame (Python)  the same with the compiled path off: parse, dispatch and reply

and the dispatch again with the per-tensor usage counting switched off, to show its share.
With ``--parts`` the routed dispatch is also timed piece by piece (``parts``): each step the
handler takes, called alone with the same request, so their sum beside the whole says what
the glue between them costs.
Compare the sum with a raw socket echo (bench/harness.py) to see what the transport leaves.

With ``--pool N`` (or ``CALL_COST_POOL=N`` in the environment, which is how
bench/call_instructions.py's runs of this file take it) N experts are uploaded and each
routed or expert group dispatch names a different 8 of them, as a decode step's router picks
them: a ring of
more distinct lists than the worker's expert-list cache holds, so no call finds its list
there (the client steps keep the first 8).

    python bench/call_cost.py [--pool 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402


def build(pool: int | None = None) -> tuple[Any, Any, dict[str, dict[str, Any]]]:
    """A NumPy worker (metrics on) and a client on it, and each call kind's steps: kind ->
    step name -> a function doing that step once (``pool``: as ``run``'s)."""
    from coliworker.client import WorkerClient, requests
    from coliworker.client.session_calls import SessionCalls
    from coliworker.server.app import build_server
    from coliworker.server.backend import Result
    from coliworker.server.config import Config
    from coliworker.server.expert_lists import _EXPERT_CACHE
    from coliworker.v1 import worker_pb2 as pb
    from coliworker.wire import calls, frames, staging
    from coliworker.wire.codec import ArrayIO

    # metrics on, as a deployed worker has them (its /metrics on a free port)
    srv = build_server(Config(backend="numpy", port=0, metrics_port=0, data_port=None))
    srv.start()
    rng = np.random.default_rng(0)
    w = WorkerClient(srv.address, progress=False)
    if pool is None:
        pool = int(os.environ.get("CALL_COST_POOL") or 0)
    uploaded = [harness.upload_expert(w, rng, 16) for _ in range(max(pool, harness.N_EXPERTS))]
    experts = uploaded[: harness.N_EXPERTS]
    kv_b = harness.int4(w, rng, harness.K, harness.H * (harness.Q + harness.V))
    o_proj = harness.int4(w, rng, harness.H * harness.V, harness.D_OUT)
    x = rng.standard_normal((1, harness.D)).astype(np.float32)
    routes = np.arange(harness.TOPK, dtype=np.int32)[None]
    weights = np.full((1, harness.TOPK), 1 / harness.TOPK, np.float32)
    att = dict(
        q_dim=harness.Q,
        rope_dim=harness.R,
        v_dim=harness.V,
        scale=1.0 / np.sqrt(harness.Q + harness.R),
    )
    q = rng.standard_normal((1, harness.H, harness.Q + harness.R)).astype(np.float32)
    lat = rng.standard_normal((1, harness.K)).astype(np.float32)
    rope = rng.standard_normal((1, harness.R)).astype(np.float32)
    be = srv.servicer.backend
    out = np.zeros((1, harness.D), np.float32)
    x8 = np.repeat(x, harness.TOPK, axis=0)  # the token's row for each of its experts
    out8 = np.zeros_like(x8)
    be.expert_group_routed = lambda *a: Result(out)
    be.expert_group = lambda *a: Result(out8)
    be.attention_ragged = lambda *a, **k: Result(out)

    class Client(SessionCalls):
        def __init__(self) -> None:
            self._tls = threading.local()
            self.wire_dtype = pb.DTYPE_FLOAT32

    c = Client()
    cases = {
        "expert_group_routed": (
            lambda: requests.expert_group_routed(c._enc, experts, x, routes, weights),
            "y",
        ),
        "expert_group": (
            lambda: requests.expert_group(c._enc, experts, [1] * harness.TOPK, x8),
            "y",
        ),
        "attention_ragged": (
            lambda: requests.attention_ragged(
                c._enc, kv_b, o_proj, q, sequences=[(7, 0, lat, rope)], **att
            ),
            "out",
        ),
    }
    steps: dict[str, dict[str, Any]] = {}
    for kind, (make, field) in cases.items():
        call = calls.BY_KIND[kind]

        def client_build(make=make, call=call):
            body = make()
            pieces, nd = frames.place(body, c._take_side())
            return frames.frame(frames.CALL, call.method, 1, body.SerializeToString(), pieces, nd)

        raw = b"".join(bytes(b) for b in client_build())
        head = frames.parse(raw)
        body = raw[frames.HEADER_BYTES : frames.HEADER_BYTES + head.body_bytes]
        data = np.frombuffer(raw[frames.HEADER_BYTES + head.body_bytes :], np.uint8)
        if kind == "attention_ragged":  # every call appends the same row at 0: roll back
            srv.servicer.free_sequence(pb.FreeSequenceRequest(sequence_id=7), "", None)

        def parse(call=call, body=body, data=data):
            req = call.request.FromString(body)
            staging.check(req, data, None, call.kind)
            return req

        req = parse()
        reqs = [req]
        if kind.startswith("expert_group") and pool:
            reqs = _subsets(req, uploaded, _EXPERT_CACHE + 1, rng)
        ring = itertools.cycle(reqs)

        def dispatch(call=call, ring=ring, data=data):
            req = next(ring)
            sink: list = []
            io = ArrayIO(staging.source(data, None, call.kind), sink)
            o = srv.servicer.dispatch.run(call, req, "", io, transport="socket")
            assert o.ok, o.message
            return o, sink

        dispatch.request, dispatch.data = req, data  # (for parts)
        o, sink = dispatch()

        def reply(call=call, o=o, sink=sink):
            resp = type(o.response)()
            resp.CopyFrom(o.response)
            pieces, nd = frames.place(resp, list(sink))
            return frames.frame(frames.REPLY, call.method, 1, resp.SerializeToString(), pieces, nd)

        rb = b"".join(bytes(b) for b in reply())
        rh = frames.parse(rb)
        rbody = rb[frames.HEADER_BYTES : frames.HEADER_BYTES + rh.body_bytes]
        rdata = np.frombuffer(rb[frames.HEADER_BYTES + rh.body_bytes :], np.uint8)
        decode = SessionCalls._decoder(field)

        class Fut:
            backend_ns = 0
            lengths: list = []

        def client_decode(call=call, rbody=rbody, rdata=rdata, decode=decode):
            resp = call.response.FromString(rbody)
            staging.check(resp, rdata, None, "result")
            return decode(resp, Fut(), staging.source(rdata, None, "result"))

        conn = _connection(srv, head, body, data, reqs)

        def frame(conn=conn):
            conn.fast = srv.servicer.fastcalls
            conn._frame(conn.io.head, 1 << 30)

        def frame_python(conn=conn):
            conn.fast = None
            conn._frame(conn.io.head, 1 << 30)

        for fn in (frame, frame_python):
            fn()
            conn.io.answered()
        steps[kind] = {
            "client build": client_build,
            "worker parse": parse,
            "worker dispatch": dispatch,
            "worker reply": reply,
            "client decode": client_decode,
            "worker frame": frame,
            "worker frame (Python)": frame_python,
        }
    return srv, w, steps


def _connection(srv: Any, head: Any, body: bytes, data: Any, reqs: list) -> Any:
    """A socket data-plane connection of ``srv`` whose socket is a stub: each
    ``_frame(head, limit)`` reads the next of ``reqs``' bodies (with ``data``) and keeps the
    reply's buffers, so the step runs the data plane's own code for a frame: the compiled
    path where it takes the call, else parse, dispatch and reply."""
    from coliworker.server.dataplane import _Connection
    from coliworker.wire import frames

    class Stub:
        def __init__(self) -> None:
            self.head = head
            self.bodies = itertools.cycle([memoryview(r.SerializeToString()) for r in reqs])
            self.sent: list = []

        def recv_rest(self, head: Any, scratch: Any) -> tuple[Any, Any]:
            return next(self.bodies), data

        def send(self, buffers: list) -> None:
            self.sent = buffers

        def answered(self) -> None:
            """Raise with the worker's message where the last reply was an error."""
            if frames.parse(bytes(self.sent[0])).status:
                raise AssertionError(bytes(self.sent[1]).decode())

    conn = _Connection.__new__(_Connection)
    conn.plane, conn.servicer, conn.dispatch = None, srv.servicer, srv.servicer.dispatch
    conn.owner, conn._big, conn.io = "", None, Stub()
    return conn


def run(n: int, profile: bool = False, pool: int | None = None, pieces: dict | None = None) -> dict:
    """Each step of each kind timed (``_time``, in that order), then the dispatch again with
    the usage counting off; with ``profile`` the dispatch under cProfile; ``pieces`` (a dict)
    is filled with ``parts``'s figures (after the steps: bench/call_instructions.py counts
    the steps by the order of their ``_time`` calls)."""
    srv, w, steps = build(pool)
    result = {}
    for kind, fns in steps.items():
        row = {name: _time(fn, n) for name, fn in fns.items()}
        dispatch = fns["worker dispatch"]
        counts = srv.servicer.tensor_counts
        saved = counts.tensor, counts.experts, counts.routed
        counts.tensor = counts.experts = counts.routed = lambda *a, **k: None
        row["worker dispatch, usage counting off"] = _time(dispatch, n)
        counts.tensor, counts.experts, counts.routed = saved
        row["sum"] = sum(v for k, v in row.items() if "off" not in k and "frame" not in k)
        if profile:
            _profile(kind, dispatch, n)
        result[kind] = row
        print(kind, json.dumps(row, indent=1), flush=True)
    if pieces is not None:
        pieces.update(parts(srv, steps, n))
    w.close()
    srv.stop(0)
    return result


def parts(srv: Any, steps: dict, n: int) -> dict[str, float]:
    """The routed dispatch's pieces, us per call: each of the steps ``Dispatch.run`` and the
    handler (``Compute.expert_group_routed``) take, called alone with the request of the
    ``worker dispatch`` step (its list cached, as a repeated call finds it)."""
    import grpc

    from coliworker.server import validate
    from coliworker.server.backend import Result
    from coliworker.server.compute import _bounds
    from coliworker.wire import staging
    from coliworker.wire.codec import ArrayIO

    s = srv.servicer
    whole = steps["expert_group_routed"]["worker dispatch"]
    req, data = whole.request, whole.data
    op = "expert_group_routed"

    def io() -> ArrayIO:
        return ArrayIO(staging.source(data, None, op), [])

    kept = io()
    triples, device, _ = s._experts(req, op, "", kept)
    routes = kept.decode(req.routes, f"{op}.routes", ndim=2, float_only=False)
    result = Result(np.zeros((1, harness.D), np.float32))
    pieces = {
        "ArrayIO and its source": _time(io, n),
        "_experts (list cached)": _time(lambda: s._experts(req, op, "", kept), n),
        "x decoded and checked": _time(lambda: validate.array(req.x, f"{op}.x", 2, kept), n),
        "routes decoded": _time(
            lambda: kept.decode(req.routes, f"{op}.routes", ndim=2, float_only=False), n
        ),
        "weights decoded and checked": _time(
            lambda: validate.array(req.weights, f"{op}.weights", 2, kept), n
        ),
        "routes' bounds": _time(lambda: _bounds(routes), n),
        "backend call (stub), timed": _time(
            lambda: s._timed(s.backend.expert_group_routed, triples, None, routes, None), n
        ),
        "usage counts": _time(lambda: s.tensor_counts.routed(device, triples.ids, routes), n),
        "response and group records": _time(
            lambda: (
                s._group_done(result, device, len(triples), 1),
                s._group_response(result, 1, io()),
            ),
            n,
        ),
        "session request metric": _time(
            lambda: s.dispatch.hooks.record_session_request(op, grpc.StatusCode.OK, 1e-5, "socket"),
            n,
        ),
    }
    return {
        "worker dispatch (the whole step)": _time(whole, n),
        "the handler alone (no Dispatch.run)": _time(
            lambda: s.expert_group_routed(req, "", io()), n
        ),
        **pieces,
        "the pieces' sum": sum(pieces.values()),
    }


def _subsets(req, pool: list, count: int, rng) -> list:
    """``count`` copies of the (routed) expert group request ``req``, each naming a different
    ``harness.TOPK`` of the ``pool`` experts (its arrays are the same slices of one data
    block)."""
    seen: set[tuple] = set()
    out = []
    while len(out) < count:
        pick = tuple(int(i) for i in rng.choice(len(pool), harness.TOPK, replace=False))
        if pick in seen:
            continue
        seen.add(pick)
        r = type(req)()
        r.CopyFrom(req)
        del r.experts[:]
        for i in pick:
            g, u, d = pool[i]
            r.experts.add(gate=g.handle, up=u.handle, down=d.handle)
        out.append(r)
    return out


def _time(fn, n: int) -> float:
    for _ in range(max(50, n // 10)):
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


def _profile(kind: str, fn, n: int) -> None:
    """The worker dispatch of ``kind`` under cProfile: where its microseconds go, by function."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    print(f"-- {kind}: worker dispatch, {n} calls, by own time", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument(
        "--profile", action="store_true", help="also print the dispatch's cProfile, by function"
    )
    p.add_argument(
        "--pool",
        type=int,
        default=None,
        help="experts uploaded; each routed dispatch names a different 8 of them "
        "(default: $CALL_COST_POOL, else one list of 8 on every call)",
    )
    p.add_argument(
        "--parts", action="store_true", help="also time the routed dispatch piece by piece"
    )
    args = p.parse_args()
    pieces: dict | None = {} if args.parts else None
    result = run(args.calls, args.profile, args.pool, pieces)
    date, doc = harness.run_record("bench/call_cost.py")
    doc["us_per_call"] = result
    if pieces:
        doc["routed_dispatch_parts_us"] = pieces
    mc = doc["machine"]
    stem = harness.write_json(args.out, f"call-cost-{date:%Y-%m-%d}-{mc['host']}", doc)
    names = list(next(iter(result.values())))
    lines = [
        "# bench/call_cost.py — host CPU per decode call, no transport",
        "",
        f"- date: {doc['date']}; commit: {mc['commit']}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, python {mc['python']}",
        f"- command: `{doc['command']}`",
        "",
        "| us per call | " + " | ".join(result) + " |",
        "|---|" + "---|" * len(result),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{r[name]:.1f}" for r in result.values()) + " |")
    if pieces:
        lines += ["", "| routed dispatch, piece by piece | us per call |", "|---|---|"]
        lines += [f"| {name} | {us:.2f} |" for name, us in pieces.items()]
    harness.write_md(stem, lines)


if __name__ == "__main__":
    main()
