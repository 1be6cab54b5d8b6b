"""Where the time of one socket data-plane call goes, stage by stage, beside a raw echo.

A worker process and a client process on one host (as ``bench/harness.py``: GLM-5.2 decode
shapes, a routed expert group of 8 int4 experts x 1 row and ragged MLA attention over T
resident rows). Both take ``time.perf_counter_ns()`` stamps (CLOCK_MONOTONIC, one clock for
both processes) at:

    client  call    the caller starts the call (request built from here on)
    client  sent    the CALL frame is written to the socket
    worker  recv    the worker's connection thread has the frame's header
    worker  run     the call enters the dispatch (body parsed, arrays checked)
    worker  ran     the dispatch returns (its backend time is reported separately)
    worker  sent    the REPLY frame is written
    client  recv    the waiting thread has the reply's header
    client  done    the caller has the decoded result

and prints the p50 of each step over the calls; "handler" is run->ran minus the backend
time (validation, the store, metrics, encoding). A raw socket echo of the same bytes that
first sleeps the call's backend p50 (harness.py's) shows what the transport alone costs.

    python bench/socket_timeline.py --backend cupy --calls 300
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

now = time.perf_counter_ns
STEPS = (
    ("call", "sent", "client: build + write"),
    ("sent", "w_recv", "wire in + worker wake"),
    ("w_recv", "w_run", "worker: read + parse + check"),
    ("w_run", "w_ran", "worker: dispatch (backend inside)"),
    ("w_ran", "w_sent", "worker: encode + write"),
    ("w_sent", "c_recv", "wire out + client wake"),
    ("c_recv", "done", "client: read + decode"),
)


def _stamp_frames(marks: dict, key: str) -> None:
    """Stamp ``key`` whenever a frame header has been read (per request id)."""
    from coliworker.wire import frames

    orig = frames.FrameSocket.recv_header

    def recv_header(self, *args, **kwargs):
        head = orig(self, *args, **kwargs)
        marks.setdefault(head.request_id, {})[key] = now()
        return head

    frames.FrameSocket.recv_header = recv_header


def serve(args: argparse.Namespace) -> None:
    from coliworker.server import dataplane, dispatch
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    marks: dict[int, dict] = {}
    _stamp_frames(marks, "w_recv")
    rid_now = {"rid": 0}
    orig_frame = dataplane._Connection._frame

    def _frame(self, head, limit):
        rid_now["rid"] = head.request_id
        return orig_frame(self, head, limit)

    orig_run = dispatch.Dispatch.run

    def run(self, *a, **kw):
        m = marks.setdefault(rid_now["rid"], {})
        m["w_run"] = now()
        out = orig_run(self, *a, **kw)
        m["w_ran"] = now()
        return out

    orig_reply = dataplane._Connection._reply

    def _reply(self, call, rid, out, sink):
        orig_reply(self, call, rid, out, sink)
        marks.setdefault(rid, {})["w_sent"] = now()

    dataplane._Connection._frame = _frame
    dispatch.Dispatch.run = run
    dataplane._Connection._reply = _reply
    srv = build_server(
        Config(backend=args.backend, port=0, metrics_port=None, data_port=0, memory_limit=0)
    ).start()
    echo = harness.socket_echo(srv.config.data_spin_us)
    print(f"READY {srv.port} {echo}", flush=True)
    for line in sys.stdin:  # "dump": send the marks so far, then forget them
        if line.strip() == "dump":
            print(json.dumps(marks), flush=True)
            marks.clear()
    srv.stop(1)


def measure(s, call, n: int, worker, marks: dict) -> dict:
    rows = []
    for i in range(n + 10):
        t0 = now()
        f = call()
        t1 = now()
        f.result()
        t2 = now()
        if i >= 10:
            marks.setdefault(f.request_id, {}).update(call=t0, sent=t1, done=t2)
            rows.append((f.request_id, f.backend_ns))
    worker.stdin.write("dump\n")
    worker.stdin.flush()
    w = {int(k): v for k, v in json.loads(worker.stdout.readline()).items()}
    steps: dict[str, list[float]] = {label: [] for *_, label in STEPS}
    handler, e2e, backend = [], [], []
    for rid, b in rows:
        m = {**marks[rid], **w.get(rid, {})}
        if not all(k in m for k in ("call", "sent", "w_recv", "w_run", "w_ran", "w_sent")):
            continue
        for a, z, label in STEPS:
            steps[label].append((m[z] - m[a]) / 1e3)
        handler.append((m["w_ran"] - m["w_run"] - b) / 1e3)
        e2e.append((m["done"] - m["call"]) / 1e3)
        backend.append(b / 1e3)
    p50 = {k: float(np.median(v)) for k, v in steps.items() if v}
    return {
        "calls": len(e2e),
        "e2e_us_p50": float(np.median(e2e)),
        "backend_us_p50": float(np.median(backend)),
        "overhead_us_p50": float(np.median(np.subtract(e2e, backend))),
        "handler_us_p50": float(np.median(handler)),
        "steps_us_p50": p50,
    }


def run(args: argparse.Namespace) -> dict:
    from coliworker.client import WorkerClient

    worker, (port, echo_port) = harness.spawn(__file__, "--backend", args.backend)
    try:
        marks: dict[int, dict] = {}
        _stamp_frames(marks, "c_recv")
        rng = np.random.default_rng(0)
        inter = 16 if args.backend == "numpy" else 2048
        t = 256 if args.backend == "numpy" else harness.T
        out = {}
        with WorkerClient(f"127.0.0.1:{port}", timeout=600, progress=False) as w:
            experts = [harness.upload_expert(w, rng, inter) for _ in range(harness.N_EXPERTS)]
            x1 = rng.standard_normal((1, harness.D)).astype(np.float32)
            routes = np.arange(harness.TOPK, dtype=np.int32)[None]
            weights = (rng.random((1, harness.TOPK)) / harness.TOPK).astype(np.float32)
            kv_b = harness.int4(w, rng, harness.K, harness.H * (harness.Q + harness.V))
            o_proj = harness.int4(w, rng, harness.H * harness.V, harness.D_OUT)
            att = dict(
                q_dim=harness.Q,
                rope_dim=harness.R,
                v_dim=harness.V,
                scale=1.0 / np.sqrt(harness.Q + harness.R),
            )
            lat = rng.standard_normal((t + 1, harness.K)).astype(np.float32)
            rope = rng.standard_normal((t + 1, harness.R)).astype(np.float32)
            q = rng.standard_normal((1, harness.H, harness.Q + harness.R)).astype(np.float32)
            with w.session(transport="socket", spin_us=args.spin_us) as s:
                s.attention_ragged_sync(
                    kv_b, o_proj, q, sequences=[(7, 0, lat[:t], rope[:t])], **att
                )
                seq = [(7, t, lat[t:], rope[t:])]
                cases = {
                    "expert_group_routed": lambda: s.expert_group_routed(
                        experts, x1, routes, weights
                    ),
                    "attention_ragged": lambda: s.attention_ragged(
                        kv_b, o_proj, q, sequences=seq, **att
                    ),
                }
                for name, call in cases.items():
                    r = measure(s, call, args.calls, worker, marks)
                    echo = harness.SocketEcho(int(echo_port))
                    req = {"expert_group_routed": 24_800, "attention_ragged": 68_200}[name]
                    resp = 24_700 if name == "expert_group_routed" else harness.D_OUT * 4 + 60
                    ech = echo.measure("socket", req, resp, args.calls)
                    busy = echo.measure(
                        "socket", req, resp, args.calls, max(1, int(r["backend_us_p50"])), True
                    )
                    r["echo_us_p50"] = ech["p50_ms"] * 1e3
                    r["echo_after_sleep_us_p50"] = busy["p50_ms"] * 1e3
                    out[name] = r
                    print(name, json.dumps(r, indent=1), flush=True)
        return out
    finally:
        harness.stop(worker)


def write(result: dict, args: argparse.Namespace) -> None:
    date, doc = harness.run_record("bench/socket_timeline.py")
    doc["calls"] = result
    mc = doc["machine"]
    name = f"socket-timeline-{date:%Y-%m-%d}-{args.backend}"
    stem = harness.write_json(args.out, name, doc)
    lines = [
        f"# bench/socket_timeline.py — {args.backend} backend",
        "",
        f"- date: {doc['date']}; commit: {mc['commit']}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, GPU: {mc['gpu']}",
        f"- command: `{doc['command']}`",
        "",
        "p50 per step, us (each column its own median; they need not add up exactly)",
        "",
        "| step | " + " | ".join(result) + " |",
        "|---|" + "---|" * len(result),
    ]
    for *_, label in STEPS:
        lines.append(
            f"| {label} | "
            + " | ".join(
                f"{r['steps_us_p50'].get(label, float('nan')):.1f}" for r in result.values()
            )
            + " |"
        )
    for key, label in (
        ("backend_us_p50", "backend (worker's backend_ns)"),
        ("handler_us_p50", "worker handler minus backend"),
        ("e2e_us_p50", "end to end"),
        ("overhead_us_p50", "end to end minus backend"),
        ("echo_us_p50", "raw socket echo, same bytes"),
        ("echo_after_sleep_us_p50", "raw echo that first sleeps the backend p50 (minus it)"),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{r[key]:.1f}" for r in result.values()) + " |")
    harness.write_md(stem, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="numpy", choices=("numpy", "cupy"))
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--spin-us", type=int, default=1000, help="the client's poll before sleeping")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return
    write(run(args), args)


if __name__ == "__main__":
    main()
