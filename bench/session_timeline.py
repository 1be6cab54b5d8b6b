"""Where the time of one Session-stream call goes, stage by stage, beside a raw echo.

A worker process and a client process on one host (as ``bench/rpc.py``). Both take
``time.perf_counter_ns()`` stamps (CLOCK_MONOTONIC: one clock for both processes) at the
points below, for decode-shaped routed expert-group calls on a Session stream (plain and
shared-memory) and for a raw bytes echo stream of the same sizes:

    client  call     the caller starts the call (request built from here on)
    client  sub      the call is submitted (request built and queued for the stream)
    client  taken    gRPC's request thread takes the message from the session's queue
    worker  recv     the worker's handler thread has the request
    worker  run      the handler starts (request accepted and dispatched)
    worker  ran      the handler is done (backend time inside, reported separately)
    worker  yield    the response leaves the handler thread for gRPC
    worker  resume   gRPC asks the handler thread for the next response (send done)
    client  recv     the client's reader thread has the response
    client  set      the response is decoded and the future resolved
    client  done     the caller has the result

Runs: "routed" and "shm" (the Session client), "routed-raw" (the Session RPC driven by hand:
serialized here, answers read on the calling thread, so only the worker's side is ours),
then raw echoes of the routed sizes read three ways (on the calling thread, by a reader
thread that hands over, by a reader thread while the caller polls), answering at once, after
sleeping for the routed call's backend p50, and (CuPy) after a GPU kernel of that length.

Per stage it prints the p50 (and p90) over the calls, so an overhead that the totals only
show as a ratio gets a place. The stamps cost ~1 us each. TIMELINE_PROFILE=1 also writes a
cProfile of each worker stream's handler thread next to the trace.

    python bench/session_timeline.py --backend numpy --calls 300
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rpc  # noqa: E402  (bench/rpc.py: worker setup, shapes)

now = time.perf_counter_ns
STAGES = ("call", "taken", "recv", "run", "ran", "yield", "recv_c", "set", "done")


# -- worker side ----------------------------------------------------------------------------


def _patch_worker(path: str) -> None:
    """Stamp the Session stream's stages; lines of JSON go to ``path`` in batches."""
    import grpc

    from coliworker.server import dispatch
    from coliworker.server import session as ss

    buf: list[tuple] = []

    def flush() -> None:
        with open(path, "a") as f:
            for r in buf:
                f.write(json.dumps(r) + "\n")
        buf.clear()

    def mark(*rec) -> None:
        buf.append(rec)
        if len(buf) >= 256:
            flush()

    orig_responses = ss.SessionStream.responses
    orig_execute = ss.SessionStream._execute
    orig_run = dispatch.Dispatch.run
    inside = threading.local()  # set while a session stream runs a call

    def execute(self, job, chunks=True):
        inside.on = True
        try:
            return orig_execute(self, job, chunks)
        finally:
            inside.on = False

    def run(self, *args, **kwargs):
        if not getattr(inside, "on", False):
            return orig_run(self, *args, **kwargs)
        t0 = now()
        try:
            return orig_run(self, *args, **kwargs)
        finally:
            mark("h", t0, now())

    def responses(self, it):
        prof = None
        if os.environ.get("TIMELINE_PROFILE"):
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        try:
            yield from traced(self, it)
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(f"{path}.{id(self)}.prof")

    def traced(self, it):
        def reqs():
            for r in it:
                mark("recv", r.request_id, now())
                yield r

        for item in orig_responses(self, reqs()):
            mark("yield", item.request_id, now())
            yield item
            mark("resume", item.request_id, now())

    ss.SessionStream._execute = execute
    dispatch.Dispatch.run = run
    ss.SessionStream.responses = responses

    spin = None

    def work(us: int, how: int) -> None:
        nonlocal spin
        if how == 1:
            time.sleep(us / 1e6)
        elif how == 2:  # a GPU kernel that runs ``us`` and a synchronize, as a backend call
            import cupy

            if spin is None:
                spin = cupy.RawKernel(
                    'extern "C" __global__ void spin(long long n) {'
                    " long long t = clock64(); while (clock64() - t < n) {} }",
                    "spin",
                )
            spin((1,), (1,), (np.int64(us * 1980),))
            cupy.cuda.get_current_stream().synchronize()

    def stream(it, context):
        for req in it:
            t = now()
            size = int.from_bytes(req[:8], "little")
            tag = int.from_bytes(req[8:16], "little")
            mark("erecv", tag, t)
            if req[16]:
                work(int.from_bytes(req[17:25], "little"), req[16])
            out = bytes(size)
            mark("eyield", tag, now())
            yield out
            mark("eresume", tag, now())

    echo = grpc.method_handlers_generic_handler(
        "coliworker.bench.TEcho",
        {"Stream": grpc.stream_stream_rpc_method_handler(stream)},
    )
    orig = rpc.harness.echo_handlers
    rpc.harness.echo_handlers = lambda: _Both(orig(), echo)
    import atexit

    atexit.register(flush)
    rpc._flush = flush


class _Both:
    """Two generic handlers as one (the worker adds one generic handler for the echo)."""

    def __init__(self, *hs) -> None:
        self.hs = hs

    def service(self, details):
        for h in self.hs:
            r = h.service(details)
            if r is not None:
                return r
        return None


# -- client side ----------------------------------------------------------------------------


def _patch_client(marks: list) -> None:
    from coliworker.client import session as cs

    orig_requests = cs.Session._requests
    orig_receive = cs.Session._receive

    def requests(self):
        for m in orig_requests(self):
            marks.append(("taken", m.request_id, now()))
            yield m

    def receive(self, resp):
        marks.append(("recv_c", resp.request_id, now()))
        orig_receive(self, resp)
        marks.append(("set", resp.request_id, now()))

    cs.Session._requests = requests
    cs.Session._receive = receive


def _table(name: str, per_call: list[dict], backend_ns: list[int]) -> list[str]:
    """p50/p90 of each consecutive stage gap, us."""
    order = ["call", "sub", "taken", "recv", "run", "ran", "yield", "resume", "recv_c", "set"]
    order.append("done")
    lines = [f"\n{name}: {len(per_call)} calls (us; p50 / p90)"]
    rows = []
    for a, b in zip(order, order[1:], strict=False):
        if b == "resume":
            continue
        a2 = "yield" if b == "recv_c" else a
        d = [c[b] - c[a2] for c in per_call if a2 in c and b in c]
        if d:
            rows.append((f"{a2} -> {b}", np.percentile(d, 50) / 1e3, np.percentile(d, 90) / 1e3))
    d = [c["resume"] - c["yield"] for c in per_call if "resume" in c and "yield" in c]
    if d:
        rows.append(("yield -> resume (worker)", np.percentile(d, 50) / 1e3, 0.0))
    tot = [c["done"] - c["call"] for c in per_call]
    rows.append(("total", np.percentile(tot, 50) / 1e3, np.percentile(tot, 90) / 1e3))
    if backend_ns:
        rows.append(("  backend (inside run -> ran)", np.percentile(backend_ns, 50) / 1e3, 0.0))
    for label, p50, p90 in rows:
        lines.append(f"  {label:32s} {p50:8.1f} {p90:8.1f}")
    return lines


def _echo(w, marks: list, n: int, wait: str, how: int, us: int, base: int) -> dict[int, dict]:
    """Echo round trips of the routed sizes. wait: "main" (the caller reads the stream),
    "reader" (a reader thread reads and hands over through a queue, as the Session client
    does) or "spin" (the same, but the caller polls for the answer instead of sleeping).
    how: 0 answer at once, 1 sleep ``us`` first, 2 run a GPU kernel of ``us`` first."""
    stream = w._channel.stream_stream("/coliworker.bench.TEcho/Stream")
    q: queue.SimpleQueue = queue.SimpleQueue()

    def gen():
        while (m := q.get()) is not None:
            marks.append(("taken", int.from_bytes(m[8:16], "little"), now()))
            yield m

    it = stream(gen())
    got: queue.SimpleQueue = queue.SimpleQueue()
    box: list = []
    if wait != "main":

        def read():
            for i, r in enumerate(it):
                marks.append(("recv_c", base + i, now()))
                if wait == "spin":
                    box.append(r)
                else:
                    got.put(r)
                marks.append(("set", base + i, now()))

        threading.Thread(target=read, daemon=True).start()
    echo: dict[int, dict] = {}
    head = (24616).to_bytes(8, "little")
    for i in range(n + 20):
        tag = base + i
        t0 = now()
        body = tag.to_bytes(8, "little") + bytes([how]) + us.to_bytes(8, "little")
        q.put(head + body + bytes(24931 - 8 - len(body)))
        if wait == "reader":
            got.get()
        elif wait == "spin":
            while not box:
                os.sched_yield()
            box.pop()
        else:
            next(it)
            marks.append(("recv_c", tag, now()))
        t1 = now()
        if i >= 20:
            echo[tag] = {"call": t0, "done": t1}
    q.put(None)
    if wait == "main":
        for _ in it:
            pass
    return echo


def _raw_session(w, marks: list, n: int, body, base: int) -> tuple[dict[int, dict], list[int]]:
    """The Session RPC driven by hand: requests serialized here, responses read as bytes
    on the calling thread (no reader thread, no futures) and parsed after the stamp."""
    from coliworker.v1 import worker_pb2 as pb

    stream = w._channel.stream_stream("/coliworker.v1.Worker/Session")
    q: queue.SimpleQueue = queue.SimpleQueue()

    def gen():
        while (m := q.get()) is not None:
            marks.append(("taken", m[0], now()))
            yield m[1]

    it = stream(gen())
    calls: dict[int, dict] = {}
    backend = []
    for i in range(n + 20):
        rid = base + i
        t0 = now()
        req = pb.SessionRequest(request_id=rid, expert_group_routed=body)
        q.put((rid, req.SerializeToString()))
        raw = next(it)
        marks.append(("recv_c", rid, now()))
        resp = pb.SessionResponse.FromString(raw)
        t1 = now()
        if i >= 20:
            calls[rid] = {"call": t0, "done": t1}
            backend.append(resp.expert_group_routed.backend_ns)
    q.put(None)
    for _ in it:
        pass
    return calls, backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="numpy")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--expert-inter", type=int, default=None)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unix-socket", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args()
    if args.serve:
        _patch_worker(args.trace)
        rpc.serve(args)
        rpc._flush()
        return
    inter = args.expert_inter or (16 if args.backend == "numpy" else 2048)
    tmp = tempfile.mkdtemp()
    trace = os.path.join(tmp, "worker.jsonl")
    worker = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--backend", args.backend, "--trace", trace],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    import grpc

    from coliworker.client.worker import WorkerClient

    marks: list = []
    _patch_client(marks)
    try:
        line = worker.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit(f"worker did not start: {line}")
        w = WorkerClient(f"127.0.0.1:{line[1]}", timeout=600, progress=False)
        rng = np.random.default_rng()
        experts = [rpc.harness.upload_expert(w, rng, inter) for _ in range(rpc.N_EXPERTS)]
        x1 = rng.standard_normal((1, rpc.D)).astype(np.float32)
        routes = np.arange(rpc.TOPK, dtype=np.int32)[None]
        weights = (rng.random((1, rpc.TOPK)) / rpc.TOPK).astype(np.float32)
        runs = {}
        for name, kw in (("routed", {}), ("shm", {"shm": True})):
            s = w.session(**kw)
            t_start = now()
            calls: dict[int, dict] = {}
            backend = []
            for i in range(args.calls + 20):
                t0 = now()
                f = s.expert_group_routed(experts, x1, routes, weights)
                ts = now()
                f.result()
                t1 = now()
                if i >= 20:
                    calls[f.request_id] = {"call": t0, "sub": ts, "done": t1}
                    backend.append(f.backend_ns)
            s.close()
            runs[name] = (calls, backend, t_start, now())
        # raw echo of the routed sizes, stamped the same way: the caller reads the stream
        # itself ("echo"), or a reader thread reads it and hands each response over
        # ("echo-reader", as the Session client does)
        from coliworker.v1 import worker_pb2 as pb
        from coliworker.wire import codec

        body = pb.ExpertGroupRoutedRequest(
            experts=[pb.Expert(gate=g.handle, up=u.handle, down=d.handle) for g, u, d in experts],
            x=codec.encode(x1),
            routes=codec.encode(routes, pb.DTYPE_INT32),
            weights=codec.encode(weights),
        )
        t_start = now()
        calls, backend = _raw_session(w, marks, args.calls, body, 1 << 30)
        runs["routed-raw"] = (calls, backend, t_start, now())
        variants = [(f"echo-{wt}", wt, 0, 0) for wt in ("main", "reader", "spin")]
        kinds = [(1, "sleep")] + ([(2, "gpu")] if args.backend == "cupy" else [])
        for how, label in kinds:
            us = int(np.percentile(runs["routed"][1], 50) / 1e3)
            for wt in ("main", "reader", "spin"):
                variants.append((f"echo-{wt}-{label}{us}", wt, how, us))
        for k, (name, wt, how, us) in enumerate(variants):
            t_start = now()
            echo = _echo(w, marks, args.calls, wt, how, us, (k + 1) << 40)
            runs[name] = (echo, [], t_start, now())
        del grpc
    finally:
        worker.stdin.close()
        worker.wait(30)
    # join the stamps (request ids restart per stream: one time window per run)
    wrecs = [json.loads(x) for x in open(trace)]
    hs = sorted((r[1], r[2]) for r in wrecs if r[0] == "h")
    lines = [f"session_timeline: backend {args.backend}, inter {inter}"]
    for name, (calls, backend, t_start, t_end) in runs.items():
        by_rid: dict[int, dict] = {}
        for r in wrecs:
            if r[0] != "h" and t_start <= r[2] <= t_end:
                key = {"erecv": "recv", "eyield": "yield", "eresume": "resume"}.get(r[0], r[0])
                by_rid.setdefault(r[1], {}).setdefault(key, r[2])
        for kind, rid, t in marks:
            if t_start <= t <= t_end:
                by_rid.setdefault(rid, {}).setdefault(kind, t)
        per = []
        for rid, c in calls.items():
            c = {**by_rid.get(rid, {}), **c}
            if "recv" in c and "yield" in c:
                inside = [h for h in hs if c["recv"] <= h[0] <= c["yield"]]
                if inside:
                    c["run"], c["ran"] = inside[0]
            per.append(c)
        lines += _table(name, per, backend)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
