"""One GLM-5.2 decode token as an engine makes it, over each transport, worker in its own process.

Per layer (``--layers``, default 78, each with its own resident tensors): one ragged MLA
attention call with the new KV row of each sequence over ``--T`` resident rows (default
4096) through o_proj, then one routed expert group, top-8 of the layer's resident int4
experts. ``--sequences`` sequences decode together (default 1). Every token rolls each
sequence back to T rows and appends one, so T stays fixed. Paths:

    unary    WorkerClient's unary RPCs
    grpc     the Session stream (TCP)
    socket   the socket data plane (TCP, proto/FRAMES.md)
    shm      shared memory + doorbell (same host)

Reported per path: ms/token p50 (p90), the worker's backend time per token (the sum of its
calls' backend_ns), the overhead (token minus backend) and tokens/s; per call, each op's
backend time and the routed group's kernel time (the worker's group statistics), so the
backend's cost beyond its kernels inside the worker sits beside bench/decode_backend.py's
in-process figure. ``--spin-us`` / ``--worker-spin-us`` set how long the client and the
worker poll before they sleep, ``--client-cpus`` / ``--worker-cpus`` pin the two processes.
On the NumPy backend the widths shrink (``--small``, the default there) because it
dequantizes every weight in float64 on every call; the wire's per-call costs are what it
shows. Writes bench/results/decode-step-<date>-<backend>[-s<sequences>][-<tag>].json and .md.

    python bench/decode_step.py --backend cupy
    python bench/decode_step.py --backend cupy --sequences 8
    python bench/decode_step.py --backend numpy            # the 2-core VM, small widths
    python bench/decode_step.py --backend cupy --workers 2 # two workers sharing the GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

PATHS = ("unary", "grpc", "socket", "shm")


@dataclass(frozen=True)
class Shape:
    """GLM-5.2's widths (or small ones): hidden D, expert I_e, heads H, Q, R, V, K, D_out."""

    d: int = 6144
    inter: int = 2048
    heads: int = 64
    q: int = 192
    r: int = 64
    v: int = 256
    k: int = 512
    d_out: int = 6144


GLM52 = Shape()
SMALL = Shape(d=256, inter=64, heads=4, q=32, r=16, v=32, k=64, d_out=256)


def draw_routes(rng: np.random.Generator, experts: int, topk: int, rows: int) -> np.ndarray:
    """Routes int32 [rows, topk]: each row top-k of ``experts`` in a new order or choice, as a
    router picks them."""
    return np.stack([rng.permutation(experts)[:topk] for _ in range(rows)]).astype(np.int32)


_all = os.sched_getaffinity(0)


def _cpus(spec: str) -> set[int]:
    """``0-3,8`` as a CPU set."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def serve(args: argparse.Namespace) -> None:
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    spin = {} if args.worker_spin_us is None else {"data_spin_us": args.worker_spin_us}
    srv = build_server(
        Config(
            backend=args.backend,
            port=0,
            metrics_port=None,
            data_port=0,
            max_kv_rows=1 << 20,
            **spin,
        )
    ).start()
    print(f"READY {srv.port}", flush=True)
    sys.stdin.read()  # the client closes stdin when done (or dies)
    srv.stop(1)


class Model:
    """The layers' resident tensors and their sequences on one worker."""

    def __init__(
        self,
        w,
        shape: Shape,
        layers: int,
        experts: int,
        t: int,
        seqs: int,
        seed: int,
        devices: int = 1,
    ):
        from coliworker.client import UploadItem

        self.shape, self.layers, self.t, self.seqs = shape, layers, t, seqs
        rng = np.random.default_rng(seed)
        s = shape
        pool: dict[tuple[int, int], np.ndarray] = {}

        def item(i: int, o: int, salt: int, device: int) -> UploadItem:
            base = pool.get((i, o))
            if base is None:
                raw = rng.integers(0, 256, size=(o, (i + 1) // 2), dtype=np.uint8)
                base = pool[(i, o)] = raw
            q = base ^ np.uint8(salt % 251 + 1)  # distinct content per tensor, cheaply
            q[0, :8] = np.frombuffer(salt.to_bytes(8, "little"), np.uint8)
            sc = (rng.random(o) * 0.02 + 0.005).astype(np.float32)
            return UploadItem(q, sc, fmt=2, in_features=i, out_features=o, device=device)

        items, salt = [], 0
        for li in range(layers):
            dev = li * devices // layers  # a layer's tensors on one device (of a pool)
            items.append(item(s.k, s.heads * (s.q + s.v), salt := salt + 1, dev))  # kv_b
            items.append(item(s.heads * s.v, s.d_out, salt := salt + 1, dev))  # o_proj
            for _ in range(experts):
                items.append(item(s.d, s.inter, salt := salt + 1, dev))
                items.append(item(s.d, s.inter, salt := salt + 1, dev))
                items.append(item(s.inter, s.d, salt := salt + 1, dev))
        t0 = time.perf_counter()
        refs = w.upload_many(items)
        self.upload_s = time.perf_counter() - t0
        self.bytes = sum(it.weights.nbytes + it.scales.nbytes for it in items)
        per = 2 + 3 * experts
        self.kv_b, self.o_proj, self.experts = [], [], []
        for li in range(layers):
            r = refs[li * per : (li + 1) * per]
            self.kv_b.append(r[0])
            self.o_proj.append(r[1])
            self.experts.append([tuple(r[2 + 3 * e : 5 + 3 * e]) for e in range(experts)])
        self.att = dict(q_dim=s.q, rope_dim=s.r, v_dim=s.v, scale=1.0 / np.sqrt(s.q + s.r))
        self.q = rng.standard_normal((seqs, s.heads, s.q + s.r)).astype(np.float32)
        self.x = rng.standard_normal((seqs, s.d)).astype(np.float32)
        topk = min(8, experts)
        self.routes = draw_routes(rng, experts, topk, seqs)
        self.weights = (rng.random((seqs, topk)) / topk).astype(np.float32)
        self.rng, self.n_experts, self.topk = rng, experts, topk
        self.layer_routes = [self.routes] * layers  # each layer's routes this token (``draw``)
        self.lat = rng.standard_normal((seqs, t + 1, s.k)).astype(np.float32)
        self.rope = rng.standard_normal((seqs, t + 1, s.r)).astype(np.float32)
        self.ids = [[1000 * li + j + 1 for j in range(seqs)] for li in range(layers)]

    def draw(self) -> None:
        """New routes for every layer and sequence (``--routes random``): top-k of the layer's
        experts in a new order or choice, as a router picks them token by token."""
        self.layer_routes = [
            draw_routes(self.rng, self.n_experts, self.topk, self.seqs) for _ in self.layer_routes
        ]

    def prefill(self, session) -> None:
        """T rows of each layer's sequences (once; each token then rolls back to T)."""
        for li in range(self.layers):
            seqs = [
                (sid, 0, self.lat[j, : self.t], self.rope[j, : self.t])
                for j, sid in enumerate(self.ids[li])
            ]
            session.attention_ragged_sync(
                self.kv_b[li], self.o_proj[li], self.q, sequences=seqs, **self.att
            )

    def token_session(self, s) -> tuple[int, int]:
        """One token through a session (each call waited for, as the engine must: the next
        layer needs this one's output). Returns the backend ns summed: attention, routed."""
        att = routed = 0
        t = self.t
        for li in range(self.layers):
            seqs = [
                (sid, t, self.lat[j, t:], self.rope[j, t:]) for j, sid in enumerate(self.ids[li])
            ]
            f = s.attention_ragged(
                self.kv_b[li], self.o_proj[li], self.q, sequences=seqs, **self.att
            )
            f.result()
            att += f.backend_ns
            g = s.expert_group_routed(self.experts[li], self.x, self.layer_routes[li], self.weights)
            g.result()
            routed += g.backend_ns
        return att, routed

    def token_unary(self, w) -> tuple[int, int]:
        att = routed = 0
        t = self.t
        for li in range(self.layers):
            seqs = [
                (sid, t, self.lat[j, t:], self.rope[j, t:]) for j, sid in enumerate(self.ids[li])
            ]
            w.attention_ragged(self.kv_b[li], self.o_proj[li], self.q, sequences=seqs, **self.att)
            att += w.last_call.backend_ns
            w.expert_group_routed(self.experts[li], self.x, self.layer_routes[li], self.weights)
            routed += w.last_call.backend_ns
        return att, routed


def run(args: argparse.Namespace) -> dict:
    from coliworker.client import WorkerClient, WorkerPool

    workers, addresses = [], []
    try:
        serve_args = ["--backend", args.backend]
        if args.worker_spin_us is not None:
            serve_args += ["--worker-spin-us", str(args.worker_spin_us)]
        if args.worker_cpus:
            os.sched_setaffinity(0, _cpus(args.worker_cpus))  # the worker inherits it
        for _ in range(args.workers):
            proc, (port,) = harness.spawn(__file__, *serve_args)
            workers.append(proc)
            addresses.append(f"127.0.0.1:{port}")
        if args.client_cpus or args.worker_cpus:
            os.sched_setaffinity(0, _cpus(args.client_cpus) if args.client_cpus else _all)
        client = (
            WorkerPool(addresses, timeout=600, progress=False)
            if args.workers > 1
            else WorkerClient(addresses[0], timeout=600, progress=False)
        )
        with client as w:
            info = w.info()
            print(f"worker {info.backend} {[d.name for d in info.devices]}", flush=True)
            shape = SMALL if args.small else GLM52
            m = Model(
                w,
                shape,
                args.layers,
                args.experts,
                args.T,
                args.sequences,
                args.seed,
                devices=len(info.devices) if args.workers > 1 else 1,
            )
            print(f"uploaded {m.bytes / 1e9:.2f} GB in {m.upload_s:.1f} s", flush=True)
            with w.session(transport="socket") as s:
                m.prefill(s)
            rows = [measure(w, m, p, args) for p in args.paths.split(",")]
        return {
            "worker": {"backend": info.backend, "devices": [d.name for d in info.devices]},
            "workers": args.workers,
            "shape": shape.__dict__,
            "layers": args.layers,
            "T": args.T,
            "sequences": args.sequences,
            "experts_per_layer": args.experts,
            "resident_bytes": m.bytes,
            "upload_s": m.upload_s,
            "paths": rows,
        }
    finally:
        for worker in workers:
            harness.stop(worker)


def measure(w, m: Model, path: str, args: argparse.Namespace) -> dict:
    if path not in PATHS:
        raise SystemExit(f"--paths: expected some of {', '.join(PATHS)}, got {path!r}")
    options = {}
    if args.spin_us is not None:
        options["spin_us"] = args.spin_us
    if args.worker_spin_us is not None and path == "shm":
        options["worker_spin_us"] = args.worker_spin_us
    session = None if path == "unary" else w.session(transport=path, **options)
    if session is not None:
        assert session.transport == path, (session.transport, path)

    def token() -> tuple[int, int]:
        return m.token_unary(w) if session is None else m.token_session(session)

    def group_ns() -> np.ndarray:  # the worker's routed groups: calls, h2d, kernel, d2h
        return np.sum(
            [(g.calls, g.h2d_ns, g.kernel_ns, g.d2h_ns) for g in (d.group for d in w.stats())],
            axis=0,
        )

    try:
        for _ in range(args.warmup):
            if args.routes == "random":
                m.draw()
            token()
        e2e, backend, att, routed = [], [], [], []
        g0 = group_ns()
        for _ in range(args.tokens):
            if args.routes == "random":
                m.draw()
            t0 = time.perf_counter_ns()
            a, b = token()
            e2e.append(time.perf_counter_ns() - t0)
            backend.append(a + b)
            att.append(a)
            routed.append(b)
        groups = group_ns() - g0
    finally:
        if session is not None:
            session.close()
    ms = np.asarray(e2e) / 1e6
    bk = np.asarray(backend) / 1e6
    over = ms - bk
    calls = 2 * m.layers
    n_groups = max(int(groups[0]), 1)
    h2d, kernel, d2h = (float(v) / n_groups / 1e3 for v in groups[1:])
    routed_us = float(np.sum(routed)) / (args.tokens * m.layers) / 1e3
    r = {
        "path": path,
        "ms_per_token_p50": float(np.percentile(ms, 50)),
        "ms_per_token_p90": float(np.percentile(ms, 90)),
        "backend_ms_per_token_p50": float(np.percentile(bk, 50)),
        "overhead_ms_per_token_p50": float(np.percentile(over, 50)),
        "overhead_us_per_call_p50": float(np.percentile(over, 50)) * 1e3 / calls,
        "tokens_per_s": 1e3 / float(np.percentile(ms, 50)),
        "calls_per_token": calls,
        "tokens": args.tokens,
        # per call, us, means over the timed tokens: each op's backend_ns, and the routed
        # group's GPU phases from the worker's group statistics (Stats)
        "attention_backend_us": float(np.sum(att)) / (args.tokens * m.layers) / 1e3,
        "routed_backend_us": routed_us,
        "routed_h2d_us": h2d,
        "routed_kernel_us": kernel,
        "routed_d2h_us": d2h,
        "routed_backend_minus_kernel_us": routed_us - kernel,
        "routes": args.routes,
        "client_spin_us": args.spin_us,
        "worker_spin_us": args.worker_spin_us,
    }
    print(
        f"{path:<7} {r['ms_per_token_p50']:8.2f} ms/token"
        f"  backend {r['backend_ms_per_token_p50']:7.2f}"
        f"  overhead {r['overhead_ms_per_token_p50']:7.2f} ms"
        f" ({r['overhead_us_per_call_p50']:.0f} us/call)  {r['tokens_per_s']:6.2f} tok/s"
        f"  | per call: attention backend {r['attention_backend_us']:.1f} us, routed backend"
        f" {routed_us:.1f} = kernel {kernel:.1f} + {routed_us - kernel:.1f}",
        flush=True,
    )
    return r


def write(result: dict, args: argparse.Namespace) -> None:
    date, record = harness.run_record("bench/decode_step.py")
    result.update(record)
    suffix = f"-s{args.sequences}" if args.sequences != 1 else ""
    suffix += f"-w{args.workers}" if args.workers != 1 else ""
    suffix += f"-{args.tag}" if args.tag else ""
    stem = harness.write_json(
        args.out, f"decode-step-{date:%Y-%m-%d}-{args.backend}{suffix}", result
    )
    mc = result["machine"]
    shape = "GLM-5.2 widths" if not args.small else f"small widths {result['shape']}"
    lines = [
        f"# bench/decode_step.py — {args.backend} backend",
        "",
        f"- date: {result['date']}",
        f"- commit: {mc['commit']}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, GPU: {mc['gpu']}",
        f"- command: `{result['command']}`",
        f"- one token: {args.layers} layers x (ragged MLA attention over T={args.T} rows + o_proj,"
        f" routed expert group top-{min(8, args.experts)} of {args.experts} int4 experts,"
        f" routes {args.routes}),"
        f" {args.sequences} sequence(s); {shape}; {result['resident_bytes'] / 1e9:.2f} GB"
        f" resident; {args.tokens} tokens timed after {args.warmup}"
        + (
            f"; a WorkerPool of {args.workers} worker processes on this host's GPU(s), the"
            " layers split between them"
            if args.workers > 1
            else ""
        ),
        "",
        "| path | ms/token p50 | p90 | backend ms/token | overhead ms/token | overhead us/call "
        "| tokens/s | attention backend us/call | routed backend us/call | routed kernel us "
        "| routed backend - kernel us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["paths"]:
        lines.append(
            f"| {r['path']} | {r['ms_per_token_p50']:.2f} | {r['ms_per_token_p90']:.2f} "
            f"| {r['backend_ms_per_token_p50']:.2f} | {r['overhead_ms_per_token_p50']:.2f} "
            f"| {r['overhead_us_per_call_p50']:.0f} | {r['tokens_per_s']:.2f} "
            f"| {r['attention_backend_us']:.1f} | {r['routed_backend_us']:.1f} "
            f"| {r['routed_kernel_us']:.1f} | {r['routed_backend_minus_kernel_us']:.1f} |"
        )
    harness.write_md(stem, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="numpy", choices=("numpy", "cupy"))
    p.add_argument("--layers", type=int, default=None, help="layers (default 78; 8 with --small)")
    p.add_argument("--T", type=int, default=None, help="resident KV rows (default 4096; 256 small)")
    p.add_argument("--sequences", type=int, default=1)
    p.add_argument("--experts", type=int, default=8, help="resident experts per layer")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes behind a WorkerPool (the layers split between them)",
    )
    p.add_argument("--tokens", type=int, default=20, help="tokens timed per path")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument(
        "--small",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="small widths (default: on for numpy, off for cupy)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--spin-us",
        type=int,
        default=None,
        help="how long the client's waiting thread polls before it sleeps (default: the"
        " session's own, 1000 socket / 250 shm)",
    )
    p.add_argument(
        "--worker-spin-us",
        type=int,
        default=None,
        help="how long the worker's connection thread polls for the next call (default: the"
        " worker's --data-spin-us, 1000; shm: the doorbell's worker_spin_us, 1000)",
    )
    p.add_argument(
        "--routes",
        default="fixed",
        choices=("fixed", "random"),
        help="fixed: each layer's routes the same every token; random: drawn anew every token"
        " (top-k of the layer's experts), as a router picks them",
    )
    p.add_argument("--tag", default="", help="a suffix for the results' file names")
    p.add_argument("--worker-cpus", default="", help="CPUs the worker runs on (e.g. 0-3)")
    p.add_argument("--client-cpus", default="", help="CPUs the client runs on (e.g. 8-11)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return
    if args.small is None:
        args.small = args.backend == "numpy"
    if args.layers is None:
        args.layers = 8 if args.small else 78
    if args.T is None:
        args.T = 256 if args.small else 4096
    write(run(args), args)


if __name__ == "__main__":
    main()
