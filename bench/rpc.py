"""Per-call cost of the remote hot path, against a raw gRPC echo of the same bytes.

A worker process (this script with ``--serve``) and a client process (this script) on one
host. GLM-5.2 decode shapes: an expert group of 8 experts x 1 row at D=6144, and ragged MLA
attention for one sequence of T=4096 resident rows (q [1, 64, 256], a new 576-float KV row,
out [1, 6144] through o_proj). Paths:

    unary         one RPC per call (packed expert group: 8 rows in, 8 rows out)
    unary-routed  one RPC per call, routed form (1 row in, 1 row out)
    session       the Session stream, packed form
    routed        the Session stream, routed form
    routed-uds    the same over a Unix domain socket
    shm           the Session stream, routed form, activations in shared memory
    shm-doorbell  routed form, activations and messages in shared memory, FIFO doorbells
                  instead of a gRPC round trip per call (compared with the TCP stream echo)
    socket        routed form over the socket data plane (frames on TCP, proto/FRAMES.md),
                  compared with a raw socket echo of the same frame bytes

For each: p50/p99 end to end, the worker's backend time, and overhead = end to end minus
backend time, compared with the p50 of a raw gRPC echo (bytes in, bytes out, no protobuf,
no work) of the same request/response sizes on the same transport (unary or stream); the
socket path's echo is a plain socket server (the same frame reader, polling as the worker
does) that answers a frame of the response's size.
Then the throughput of a 50 MB activation batch (chunked stream, shared memory), of a
1 GB upload and its re-upload (hash + Lookup probe only), and of a 1 GB set of int4 expert
tensors through ``upload_many`` and its re-upload.

The expert intermediate width only changes compute, never the wire: the NumPy backend
dequantizes every weight in float64 on every call, so ``--expert-inter`` defaults to 16
there (2048 with CuPy) to keep the run short. Writes bench/results/rpc-<date>-<backend>.json
and .md.

    python bench/rpc.py --backend numpy
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import D_OUT, N_EXPERTS, TOPK, D, H, K, Q, R, T, V  # noqa: E402

# -- worker process -----------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    cfg = Config(
        backend=args.backend,
        port=0,
        metrics_port=None,
        unix_socket=args.unix_socket,
        max_message_bytes=64 << 20,
        memory_limit=0,
        data_port=0,
        workers=32,  # six sessions of one owner at once, each holding a stream's thread
        max_sessions_per_owner=16,
    )
    srv = build_server(cfg)
    srv.server.add_generic_rpc_handlers((harness.echo_handlers(),))
    srv.start()
    print(f"READY {srv.port} {harness.socket_echo(cfg.data_spin_us)}", flush=True)
    sys.stdin.read()  # the client closes stdin when it is done (or dies)
    srv.stop(1)


# -- client -------------------------------------------------------------------------------


def timed(call, n: int, warmup: int) -> tuple[list[int], list[int]]:
    """call() -> backend_ns; returns (end-to-end ns, backend ns) per call."""
    for _ in range(warmup):
        call()
    e2e, backend = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        b = call()
        e2e.append(time.perf_counter_ns() - t0)
        backend.append(b)
    return e2e, backend


def row(name, transport, e2e, backend, echo, req_bytes, resp_bytes, busy=None) -> dict:
    over = [a - b for a, b in zip(e2e, backend, strict=True)]
    s, b, o = harness.stats(e2e), harness.stats(backend), harness.stats(over)
    extra = {}
    if busy is not None:
        extra = {
            "echo_busy_p50_ms": busy["p50_ms"],
            "overhead_vs_busy_echo": o["p50_ms"] / busy["p50_ms"],
        }
    return {
        "path": name,
        "transport": transport,
        "request_bytes": req_bytes,
        "response_bytes": resp_bytes,
        "p50_ms": s["p50_ms"],
        "p99_ms": s["p99_ms"],
        "backend_p50_ms": b["p50_ms"],
        "overhead_p50_ms": o["p50_ms"],
        "overhead_p99_ms": o["p99_ms"],
        "echo_p50_ms": echo["p50_ms"],
        "echo_p99_ms": echo["p99_ms"],
        "overhead_vs_echo": o["p50_ms"] / echo["p50_ms"],
        **extra,
    }


def bench(args: argparse.Namespace) -> dict:
    from coliworker.client import WorkerClient
    from coliworker.v1 import worker_pb2 as pb

    sock = os.path.join(tempfile.mkdtemp(prefix="coliworker-bench-"), "worker.sock")
    worker, (port, echo_port) = harness.spawn(
        __file__, "--backend", args.backend, "--unix-socket", sock
    )
    try:
        args.echo_port = int(echo_port)
        return _run(args, f"127.0.0.1:{port}", f"unix:{sock}", WorkerClient, pb)
    finally:
        harness.stop(worker, 30)


def _run(args, addr, uds, WorkerClient, pb) -> dict:  # noqa: N803
    rng = np.random.default_rng(0)
    n, warm = args.iters, max(3, args.iters // 10)
    w = WorkerClient(addr, timeout=600, progress=False)
    wu = WorkerClient(uds, timeout=600, progress=False)
    echo = harness.Echo(w._channel)
    echo_uds = harness.Echo(wu._channel)
    echo_socket = harness.SocketEcho(args.echo_port)
    info = w.info()
    print(f"worker {info.backend} {[d.name for d in info.devices]}", flush=True)

    experts = [harness.upload_expert(w, rng, args.expert_inter) for _ in range(N_EXPERTS)]
    x1 = rng.standard_normal((1, D)).astype(np.float32)
    x8 = np.repeat(x1, TOPK, axis=0)
    routes = np.arange(TOPK, dtype=np.int32)[None]
    weights = (rng.random((1, TOPK)) / TOPK).astype(np.float32)
    rows = [1] * TOPK

    def req_size(kind, body, shm=False):
        if kind is None:
            return body.ByteSize()
        if shm == "frame":  # a data-plane CALL: header, the message without its arrays, data
            m = type(body)()
            m.CopyFrom(body)
            n = 0
            for a in _arrays(m):
                n += len(a.data)
                a.staged.offset, a.staged.length = n, len(a.data)
                a.ClearField("data")
            return 32 + m.ByteSize() + n
        m = pb.SessionRequest(request_id=1 << 20, **{kind: body})
        if shm:
            for a in _arrays(m):
                a.shm.offset, a.shm.length = 1 << 20, len(a.data)
                a.ClearField("data")
            m.output_shm.offset, m.output_shm.length = 1 << 20, 1 << 16
        return m.ByteSize()

    from coliworker.wire import codec
    from coliworker.wire.staging import iter_arrays as _arrays

    exp_pb = [pb.Expert(gate=g.handle, up=u.handle, down=d.handle) for g, u, d in experts]
    packed = pb.ExpertGroupRequest(experts=exp_pb, rows=rows, x=codec.encode(x8))
    routed = pb.ExpertGroupRoutedRequest(
        experts=exp_pb,
        x=codec.encode(x1),
        routes=codec.encode(routes, pb.DTYPE_INT32),
        weights=codec.encode(weights),
    )
    out8, out1 = 8 * D * 4 + 40, D * 4 + 40
    shm_resp = 60  # request id + Array header + slice + timings
    results = []

    def unary_packed():
        w.expert_group(experts, rows, x8)
        return w.last_call.backend_ns

    def unary_routed():
        w.expert_group_routed(experts, x1, routes, weights)
        return w.last_call.backend_ns

    group_paths = [
        ("unary", "tcp", "unary", w, None, unary_packed, req_size(None, packed), out8),
        ("unary-routed", "tcp", "unary", w, None, unary_routed, req_size(None, routed), out1),
    ]
    spin = {} if args.worker_spin_us is None else {"worker_spin_us": args.worker_spin_us}
    sessions = {
        "session": (w.session(), "tcp", "expert_group"),
        "routed": (w.session(), "tcp", "expert_group_routed"),
        "routed-uds": (wu.session(), "uds", "expert_group_routed"),
        "shm": (w.session(shm=True), "tcp", "expert_group_routed"),
        "shm-doorbell": (
            w.session(shm=True, doorbell=True, **spin),
            "fifo",
            "expert_group_routed",
        ),
        "socket": (w.session(transport="socket"), "socket", "expert_group_routed"),
    }
    for name, (s, tr, kind) in sessions.items():
        if kind == "expert_group":

            def call(s=s):
                f = s.expert_group(experts, rows, x8)
                f.result()
                return f.backend_ns

            body, out = packed, out8
        else:

            def call(s=s):
                f = s.expert_group_routed(experts, x1, routes, weights)
                f.result()
                return f.backend_ns

            body, out = routed, out1
        shm = "frame" if tr == "socket" else name.startswith("shm")
        resp = out + 32 - 40 + 20 if tr == "socket" else shm_resp if shm else out
        group_paths.append((name, tr, "stream", None, s, call, req_size(kind, body, shm), resp))
    for name, tr, ekind, _, _, call, rq, rs in group_paths:
        if not _wanted(args, f"expert_group/{name}"):
            continue
        e2e, backend = timed(call, n, warm)
        ec = echo_uds if tr == "uds" else echo_socket if tr == "socket" else echo
        ech = ec.measure(ekind, rq, rs, n)
        busy = ec.measure(ekind, rq, rs, n, _work_us(backend), args.echo_sleep)
        r = row(f"expert_group/{name}", tr, e2e, backend, ech, rq, rs, busy)
        results.append(r)
        print(_fmt(r), flush=True)

    # -- ragged attention, one sequence of T rows ------------------------------------------
    kv_b = harness.int4(w, rng, K, H * (Q + V))
    o_proj = harness.int4(w, rng, H * V, D_OUT)
    att = dict(q_dim=Q, rope_dim=R, v_dim=V, scale=1.0 / np.sqrt(Q + R))
    lat = rng.standard_normal((T + 1, K)).astype(np.float32)
    rope = rng.standard_normal((T + 1, R)).astype(np.float32)
    q = rng.standard_normal((1, H, Q + R)).astype(np.float32)
    with w.session() as s:  # prefill the cache: T rows (8 MB, chunked)
        s.attention_ragged_sync(kv_b, o_proj, q, sequences=[(7, 0, lat[:T], rope[:T])], **att)
    seq = [(7, T, lat[T:], rope[T:])]  # every call rolls back to T and appends row T
    body = pb.AttentionRaggedRequest(
        kv_b=kv_b.handle,
        o_proj=o_proj.handle,
        q=codec.encode(q),
        sequences=[
            pb.SequenceRows(
                sequence_id=7, start=T, latent=codec.encode(lat[T:]), rope=codec.encode(rope[T:])
            )
        ],
        **att,
    )
    out_att = D_OUT * 4 + 40

    def att_unary():
        w.attention_ragged(kv_b, o_proj, q, sequences=seq, **att)
        return w.last_call.backend_ns

    att_paths = [("unary", "tcp", "unary", att_unary, req_size(None, body), out_att)]
    for name, (s, tr, _) in sessions.items():
        if name == "session":
            continue

        def call(s=s):
            f = s.attention_ragged(kv_b, o_proj, q, sequences=seq, **att)
            f.result()
            return f.backend_ns

        shm = "frame" if tr == "socket" else name.startswith("shm")
        resp = out_att + 32 - 40 + 20 if tr == "socket" else shm_resp if shm else out_att
        att_paths.append(
            (
                name.replace("routed", "session"),
                tr,
                "stream",
                call,
                req_size("attention_ragged", body, shm),
                resp,
            )
        )
    na = args.att_iters
    for name, tr, ekind, call, rq, rs in att_paths:
        if not _wanted(args, f"attention_ragged/{name}"):
            continue
        e2e, backend = timed(call, na, 2)
        ec = echo_uds if tr == "uds" else echo_socket if tr == "socket" else echo
        ech = ec.measure(ekind, rq, rs, max(na, 100))
        busy = ec.measure(ekind, rq, rs, na, _work_us(backend), args.echo_sleep)
        r = row(f"attention_ragged/{name}", tr, e2e, backend, ech, rq, rs, busy)
        results.append(r)
        print(_fmt(r), flush=True)

    # -- 50 MB activation batches ----------------------------------------------------------
    thr = []
    mat = w.upload(
        rng.standard_normal((64, 64)).astype(np.float32), None, fmt=0, in_features=64,
        out_features=64,
    )  # fmt: skip
    big = rng.standard_normal((50 * 1024 * 1024 // 256, 64)).astype(np.float32)
    for name in ("stream-chunks", "shm", "shm-doorbell", "socket") if args.big_iters else ():
        if not _wanted(args, f"batch-50MB/{name}"):
            continue
        s = sessions["routed" if name == "stream-chunks" else name][0]
        times, back = [], []
        for _ in range(args.big_iters + 1):
            t0 = time.perf_counter_ns()
            f = s.matmul(mat, big)
            f.result()
            times.append(time.perf_counter_ns() - t0)
            back.append(f.backend_ns)
        times, back = times[1:], back[1:]
        moved = 2 * big.nbytes
        best = min(range(len(times)), key=lambda i: times[i] - back[i])
        med_t = float(np.median(times)) / 1e9
        med_o = float(np.median([a - b for a, b in zip(times, back, strict=True)])) / 1e9
        r = {
            "path": f"batch-50MB/{name}",
            "bytes_each_way": big.nbytes,
            "e2e_p50_ms": med_t * 1e3,
            "backend_p50_ms": float(np.median(back)) / 1e6,
            "GBps_end_to_end": moved / med_t / 1e9,
            "GBps_transport": moved / med_o / 1e9,
            "GBps_transport_best": moved / ((times[best] - back[best]) / 1e9) / 1e9,
        }
        thr.append(r)
        print(r, flush=True)
    for s, _, _ in sessions.values():
        s.close()

    # -- 1 GB upload and re-upload -----------------------------------------------------------
    if args.upload_gb > 0 and _wanted(args, "upload"):
        cols = 65536
        o = int(args.upload_gb * (1 << 30)) // cols
        wq = rng.integers(0, 256, size=(o, cols), dtype=np.uint8)
        sc = (rng.random(o) * 0.01).astype(np.float32)
        t0 = time.perf_counter()
        ref = w.upload(wq, sc, fmt=1, in_features=cols, out_features=o)
        t_up = time.perf_counter() - t0
        place_s = w.last_call.backend_ns / 1e9  # the backend's copy onto the device
        t0 = time.perf_counter()
        again = w.upload(wq, sc, fmt=1, in_features=cols, out_features=o)
        t_re = time.perf_counter() - t0
        t0 = time.perf_counter()
        codec.content_hash(1, cols, o, 0, wq, sc)
        t_hash = time.perf_counter() - t0
        r = {
            "path": "upload",
            "bytes": int(wq.nbytes + sc.nbytes),
            "upload_s": t_up,
            "upload_GBps": wq.nbytes / t_up / 1e9,
            "backend_place_s": place_s,
            "upload_GBps_transport": wq.nbytes / (t_up - place_s) / 1e9,
            "reupload_s": t_re,
            "reupload_deduplicated": again.deduplicated,
            "client_hash_s": t_hash,
            "reupload_minus_hash_ms": (t_re - t_hash) * 1e3,
        }
        thr.append(r)
        print(r, flush=True)
        w.free(again)
        w.free(ref)
        del wq
    if args.upload_gb > 0 and _wanted(args, "upload-set"):
        r = _upload_set(w, rng, args.upload_gb)
        thr.append(r)
        print(r, flush=True)
    w.close()
    wu.close()
    return {"worker": {"backend": info.backend, "devices": [d.name for d in info.devices]},
            "latency": results, "throughput": thr}  # fmt: skip


def _upload_set(w, rng, gb: float) -> dict:
    """A set of GLM-5.2 int4 experts (gate, up [2048, 6144], down [6144, 2048]: 6.3 MB each)
    totalling ``gb`` GiB of fresh random bytes through ``upload_many`` (3 streams), then
    again (every item a Lookup hit), against the client's SHA-256 of the set on one thread
    and on the 4 hash threads ``upload_many`` uses; then freed and sent with 2 and 4
    streams."""
    from concurrent.futures import ThreadPoolExecutor

    from coliworker.client import UploadItem
    from coliworker.wire import codec

    inter = 2048
    shapes = [(D, inter), (D, inter), (inter, D)]  # (in_features, out_features)
    per_expert = sum(o * ((i + 1) // 2) + 4 * o for i, o in shapes)
    n = max(1, round(gb * (1 << 30) / per_expert))
    items = []
    for _ in range(n):
        for i, o in shapes:
            q = np.frombuffer(rng.bytes(o * ((i + 1) // 2)), np.uint8).reshape(o, -1)
            sc = (rng.random(o) * 0.02 + 0.005).astype(np.float32)
            items.append(UploadItem(q, sc, fmt=2, in_features=i, out_features=o))
    nbytes = sum(it.weights.nbytes + it.scales.nbytes for it in items)
    t0 = time.perf_counter()
    refs = w.upload_many(items)
    t_up = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = w.upload_many(items)
    t_re = time.perf_counter() - t0

    def digest(it):
        return codec.content_hash(2, it.in_features, it.out_features, 0, it.weights, it.scales)

    t0 = time.perf_counter()
    for it in items:
        digest(it)
    t_hash = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(digest, items))
    t_hash4 = time.perf_counter() - t0
    for ref in refs + again:
        w.free(ref)
    others = {}
    for streams in (2, 4):  # the same bytes again, resident no more: the default's neighbours
        t0 = time.perf_counter()
        refs = w.upload_many(items, streams=streams)
        others[streams] = time.perf_counter() - t0
        for ref in refs:
            w.free(ref)
    return {
        "path": "upload-set",
        "tensors": len(items),
        "bytes": int(nbytes),
        "upload_s": t_up,
        "upload_GBps": nbytes / t_up / 1e9,
        "upload_2_streams_s": others[2],
        "upload_4_streams_s": others[4],
        "reupload_s": t_re,
        "reupload_deduplicated": all(r.deduplicated for r in again),
        "client_hash_s": t_hash,
        "client_hash_4_threads_s": t_hash4,
        "reupload_minus_hash_4_threads_ms": (t_re - t_hash4) * 1e3,
    }


def _work_us(backend_ns: list[int]) -> int:
    """The busy echo works as long as the path's median backend call."""
    return max(1, int(np.median(backend_ns) / 1e3))


def _fmt(r: dict) -> str:
    return (
        f"{r['path']:<28} {r['transport']:<4} p50 {r['p50_ms']:7.3f} ms  p99 {r['p99_ms']:7.3f}"
        f"  backend {r['backend_p50_ms']:7.3f}  overhead {r['overhead_p50_ms']:6.3f}"
        f"  echo {r['echo_p50_ms']:6.3f}  ratio {r['overhead_vs_echo']:5.2f}"
        f"  busy echo {r['echo_busy_p50_ms']:6.3f}  ratio {r['overhead_vs_busy_echo']:5.2f}"
    )


def write(result: dict, args: argparse.Namespace) -> None:
    date = datetime.datetime.now(datetime.timezone.utc)
    result["machine"] = harness.machine()
    result["date"] = date.isoformat(timespec="seconds")
    result["command"] = "python " + shlex.join(["bench/rpc.py", *sys.argv[1:]])
    result["settings"] = {
        "echo_work": args.echo_work,
        "iters": args.iters,
        "att_iters": args.att_iters,
        "expert_inter": args.expert_inter,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"rpc-{date:%Y-%m-%d}-{args.backend}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    lines = [
        f"# bench/rpc.py — {args.backend} backend",
        "",
        f"- date: {result['date']}",
        f"- commit: {m['commit']}",
        f"- machine: {m['host']}, {m['cpu']} x{m['cpus']}, GPU: {m['gpu']}",
        f"- python {m['python']}, grpcio {m['grpcio']}",
        f"- command: `{result['command']}`",
        f"- expert intermediate width: {args.expert_inter} (wire bytes do not depend on it)",
        "",
        "Per call, ms. overhead = end to end - backend; echo = raw gRPC echo of the same",
        "request/response bytes on the same transport; ratio = overhead p50 / echo p50.",
        "busy echo = the same echo, but the echo server first "
        + ("sleeps" if args.echo_sleep else "computes (NumPy)")
        + " for the path's backend p50 and that time",
        "is subtracted (what a backend call does to the transport around it);",
        "busy ratio = overhead p50 / busy echo p50.",
        "",
        "| path | transport | req B | resp B | p50 | p99 | backend p50 | overhead p50 "
        "| echo p50 | ratio | busy echo p50 | busy ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["latency"]:
        lines.append(
            f"| {r['path']} | {r['transport']} | {r['request_bytes']} | {r['response_bytes']} "
            f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['backend_p50_ms']:.3f} "
            f"| {r['overhead_p50_ms']:.3f} | {r['echo_p50_ms']:.3f} "
            f"| {r['overhead_vs_echo']:.2f} | {r['echo_busy_p50_ms']:.3f} "
            f"| {r['overhead_vs_busy_echo']:.2f} |"
        )
    lines += ["", "Throughput:", ""]
    for r in result["throughput"]:
        lines.append("- " + ", ".join(f"{k} {_num(v)}" for k, v in r.items()))
    harness.write_md(stem, lines)


def _num(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _wanted(args: argparse.Namespace, path: str) -> bool:
    return not args.paths or any(w in path for w in args.paths.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="numpy", choices=("numpy", "cupy"))
    p.add_argument("--iters", type=int, default=300, help="calls per expert-group path")
    p.add_argument("--att-iters", type=int, default=None, help="calls per attention path")
    p.add_argument("--big-iters", type=int, default=3, help="50 MB batches per path")
    p.add_argument("--expert-inter", type=int, default=None, help="expert I (default: 16 numpy)")
    p.add_argument("--upload-gb", type=float, default=1.0, help="0 skips the upload test")
    p.add_argument(
        "--echo-work",
        default="auto",
        choices=("auto", "compute", "sleep"),
        help="what the busy echo does for the backend time: compute (like the NumPy "
        "backend), sleep (like a backend waiting on its GPU); auto: by backend",
    )
    p.add_argument(
        "--paths", default="", help="comma-separated substrings: time only the paths naming one"
    )
    p.add_argument(
        "--worker-spin-us",
        type=int,
        default=None,
        help="the doorbell worker's spin after an answer (default: the client library's)",
    )
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unix-socket", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return
    if args.expert_inter is None:
        args.expert_inter = 16 if args.backend == "numpy" else 2048
    if args.echo_work == "auto":
        args.echo_work = "sleep" if args.backend == "cupy" else "compute"
    args.echo_sleep = args.echo_work == "sleep"
    if args.att_iters is None:
        args.att_iters = 30 if args.backend == "numpy" else args.iters
    write(bench(args), args)


if __name__ == "__main__":
    main()
