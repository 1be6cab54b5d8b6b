"""One GLM-5.2 decode token on the backend in this process: what the backend and its kernels
cost over a real token's rotation of layers, with no worker or transport around them.

``bench/kernels.py`` repeats one call's shape on rotating weight sets, and the worker's
``bench/decode_step.py`` reports only the backend's wall time per token. This bench makes the
token as the engine does (``decode_step``'s shape: per layer one ragged MLA attention with one
new KV row over ``--T`` resident rows through o_proj, then one routed group, top-8 of the
layer's 8 int4 experts), each layer with its own resident tensors and KV cache, straight on
the backend, and times each call's wall (``call``) beside its GPU phases from
``Result.phases`` (H2D, kernels, D2H). Forms, each timed in this one process:

    layers   ``--layers`` layers (default 78), each its own tensors: a token's real rotation
    one      one layer's tensors, the same call ``--layers`` times a token (bench/kernels.py's
             case: the plan kept and its graph the last one launched)

``--routes random`` draws each layer's routes anew every token (top-8 of the layer's
``--experts`` in a new order or choice), as a router does: no call finds the plan kept for
its experts' order, where fixed routes (the default) repeat each layer's call exactly.
``--gaps`` runs each form again with something between the calls (a worker's calls come
with ~180 us of transport and dispatch between them): sched_yield polling, plain Python,
a sleep, or a copy that turns the caches over.

Per form: backend ms/token (sum of call walls), kernel ms/token (sum of kernel phases), their
ratio (the backend host-path issue's token target), and per op the median call, kernel,
H2D and D2H, and call - kernel, in us.

    PYTHONPATH=.dev python bench/decode_backend.py [--layers 78] [--T 4096] [--tokens 20] \\
        [--forms layers,one] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.decode_step import GLM52, SMALL, Shape, draw_routes  # noqa: E402

OPS = ("attention_ragged", "expert_group_routed")


class Layers:
    """``n`` layers' resident tensors (kv_b, o_proj, ``experts`` experts, fmt 2) and one KV
    cache each of ``t`` rows, placed on ``backend``'s device 0; distinct bytes per tensor."""

    def __init__(self, backend, shape: Shape, n: int, experts: int, t: int, seed: int):
        from coliworker.kernels.qtensor import QTensor

        rng = np.random.default_rng(seed)
        s = shape
        base: dict[tuple[int, int], np.ndarray] = {}
        salt = 0

        def place(i: int, o: int):
            nonlocal salt
            salt += 1
            raw = base.get((i, o))
            if raw is None:
                raw = base[(i, o)] = rng.integers(0, 256, (o * ((i + 1) // 2),), np.uint8)
            w = raw ^ np.uint8(salt % 251 + 1)
            sc = (rng.random(o) * 0.02 + 0.005).astype(np.float32)
            return backend.place(QTensor(2, i, o, 0, w, sc), 0)

        self.kv_b, self.o_proj, self.experts, self.caches = [], [], [], []
        for _ in range(n):
            self.kv_b.append(place(s.k, s.heads * (s.q + s.v)))
            self.o_proj.append(place(s.heads * s.v, s.d_out))
            self.experts.append(
                [
                    (place(s.d, s.inter), place(s.d, s.inter), place(s.inter, s.d))
                    for _ in range(experts)
                ]  # fmt: skip
            )
            c = backend.new_kv(0, s.k, s.r)
            c.append(rng.standard_normal((t, s.k), np.float32),
                     rng.standard_normal((t, s.r), np.float32))  # fmt: skip
            self.caches.append(c)
        self.t = t
        self.q = rng.standard_normal((1, s.heads, s.q + s.r)).astype(np.float32)
        self.x = rng.standard_normal((1, s.d)).astype(np.float32)
        topk = min(8, experts)
        self.routes = draw_routes(rng, experts, topk, 1)
        self.rng, self.n_experts, self.topk = rng, experts, topk
        self.layer_routes = [self.routes] * n  # each layer's routes this token (``draw``)
        self.weights = (rng.random((1, topk)) / topk).astype(np.float32)
        self.row = (rng.standard_normal((1, s.k), np.float32),
                    rng.standard_normal((1, s.r), np.float32))  # fmt: skip
        self.att = (s.q, s.r, s.v, 1.0 / np.sqrt(s.q + s.r))

    def draw(self) -> None:
        """New routes for every layer (``--routes random``): top-k of the layer's experts in a
        new order or choice, as a router picks them token by token."""
        self.layer_routes = [
            draw_routes(self.rng, self.n_experts, self.topk, 1) for _ in self.layer_routes
        ]


def _gap(spec: str):
    """What runs between two calls (``--gaps``): None, or a function that takes ``us``
    microseconds as ``kind`` (spin: sched_yield until then, as a worker polls its socket for
    the next call; busy: Python without system calls; sleep: time.sleep; churn: 8 MB copied,
    then busy, as other work would turn the caches over)."""
    if spec in ("", "none"):
        return None
    kind, _, us = spec.partition(":")
    ns = int(us or 0) * 1000
    src = bytearray(8 << 20)
    dst = bytearray(8 << 20)

    def gap() -> None:
        end = time.perf_counter_ns() + ns
        if kind == "sleep":
            time.sleep(ns / 1e9)
            return
        if kind == "churn":
            dst[:] = src
        while time.perf_counter_ns() < end:
            if kind == "spin":
                os.sched_yield()

    if kind not in ("spin", "busy", "sleep", "churn"):
        raise SystemExit(f"--gaps: expected spin, busy, sleep or churn:US, got {spec!r}")
    return gap


def token(backend, m: Layers, order: list[int], out: dict[str, list], gap=None) -> None:
    """One token over the layers ``order`` names: each layer's cache rolled back to T rows and
    one row appended by the attention call, then its routed group; per call (wall ns, phases)
    appended to ``out[op]``. ``gap``: run before each call (``_gap``)."""
    q_dim, r, v, scale = m.att
    for li in order:
        if gap is not None:
            gap()
        c = m.caches[li]
        c.truncate(m.t)
        t0 = time.perf_counter_ns()
        c.reserve(1)  # what the worker's sequences.prepare does for a call's new row
        res = backend.attention_ragged(m.kv_b[li], m.o_proj[li], m.q, [c], q_dim, r, v, scale,
                                       rows=[m.row])  # fmt: skip
        out["attention_ragged"].append((time.perf_counter_ns() - t0, res.phases))
        if gap is not None:
            gap()
        t0 = time.perf_counter_ns()
        res = backend.expert_group_routed(m.experts[li], m.x, m.layer_routes[li], m.weights)
        out["expert_group_routed"].append((time.perf_counter_ns() - t0, res.phases))


def measure(
    backend,
    m: Layers,
    form: str,
    layers: int,
    tokens: int,
    warmup: int,
    gap: str = "none",
    routes: str = "fixed",
) -> dict:
    order = list(range(layers)) if form == "layers" else [0] * layers
    between = _gap(gap)
    if between is not None:
        form = f"{form}, gap {gap}"
    if routes == "random":
        form = f"{form}, routes random"
    else:
        m.layer_routes = [m.routes] * len(m.layer_routes)
    for _ in range(warmup):
        if routes == "random":
            m.draw()
        token(backend, m, order, {op: [] for op in OPS}, between)
    per_token, kern_token = [], []
    calls: dict[str, list] = {op: [] for op in OPS}
    for _ in range(tokens):
        got: dict[str, list] = {op: [] for op in OPS}
        if routes == "random":
            m.draw()
        token(backend, m, order, got, between)
        per_token.append(sum(w for op in OPS for w, _ in got[op]))
        kern_token.append(sum(p.kernel_ns for op in OPS for _, p in got[op]))
        for op in OPS:
            calls[op] += got[op]
    row: dict = {
        "form": form,
        "backend_ms_per_token": float(np.median(per_token)) / 1e6,
        "kernel_ms_per_token": float(np.median(kern_token)) / 1e6,
    }
    row["ratio"] = row["backend_ms_per_token"] / row["kernel_ms_per_token"]
    for op in OPS:
        w = np.array([c[0] for c in calls[op]]) / 1e3
        k = np.array([c[1].kernel_ns for c in calls[op]]) / 1e3
        h = np.array([c[1].h2d_ns for c in calls[op]]) / 1e3
        d = np.array([c[1].d2h_ns for c in calls[op]]) / 1e3
        row[op] = {
            "call_us": float(np.median(w)),
            "kernel_us": float(np.median(k)),
            "h2d_us": float(np.median(h)),
            "d2h_us": float(np.median(d)),
            "call_minus_kernel_us": float(np.median(w - k)),
            "call_minus_span_us": float(np.median(w - k - h - d)),
        }
    print(
        f"{form:<7} backend {row['backend_ms_per_token']:6.2f} ms/token, kernels "
        f"{row['kernel_ms_per_token']:6.2f}, ratio {row['ratio']:.3f}; call - kernel us: "
        + ", ".join(f"{op} {row[op]['call_minus_kernel_us']:.1f}" for op in OPS),
        flush=True,
    )
    return row


def render(result: dict) -> str:
    mc = result["machine"]
    lines = [
        "# bench/decode_backend.py: a decode token on the backend, in process",
        "",
        f"- date: {result['date']}; commit: {mc['commit']}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, GPU: {mc['gpu']}",
        f"- command: `{result['command']}`",
        f"- {result['layers']} layers x (ragged MLA 1 seq, T={result['T']}, one new row, + "
        f"o_proj; routed group top-8 of 8 int4), {result['tokens']} tokens after "
        f"{result['warmup']}",
        "",
        "| form | backend ms/token | kernel ms/token | ratio | op | call us | kernel us | H2D us "
        "| D2H us | call - kernel us | call - GPU phases us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["forms"]:
        for i, op in enumerate(OPS):
            o = r[op]
            head = (f"| {r['form']} | {r['backend_ms_per_token']:.2f} | "
                    f"{r['kernel_ms_per_token']:.2f} | {r['ratio']:.3f} " if i == 0
                    else "| | | | ")  # fmt: skip
            lines.append(
                head + f"| {op} | {o['call_us']:.1f} | {o['kernel_us']:.1f} | {o['h2d_us']:.1f} "
                f"| {o['d2h_us']:.1f} | {o['call_minus_kernel_us']:.1f} "
                f"| {o['call_minus_span_us']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cupy", choices=("cupy", "numpy"))
    p.add_argument("--layers", type=int, default=None, help="layers (default 78; 4 with --small)")
    p.add_argument("--T", type=int, default=None, help="resident KV rows (default 4096; 64 small)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--forms", default="layers,one")
    p.add_argument("--small", action="store_true", help="small widths (the NumPy backend's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gaps",
        default="none",
        help="what runs between calls, each its own row of every form: none, or KIND:US with"
        " KIND spin (sched_yield, as a worker polls for its next call), busy, sleep or churn"
        " (e.g. none,spin:180,sleep:180)",
    )
    p.add_argument(
        "--routes",
        default="fixed",
        help="fixed (each layer's routes the same every token), random (new top-k of the"
        " layer's experts every token, as a router picks them), or both (each its own row)",
    )
    p.add_argument("--out", default=None, help="write decode-backend-<date>.json and .md here")
    args = p.parse_args()
    small = args.small or args.backend == "numpy"
    layers = args.layers or (4 if small else 78)
    t = args.T or (64 if small else 4096)
    from coliworker.server.backends import create_backend

    backend = create_backend(args.backend)
    m = Layers(backend, SMALL if small else GLM52, layers, args.experts, t, args.seed)
    forms = [f for f in args.forms.split(",") if f]
    for f in forms:
        if f not in ("layers", "one"):
            raise SystemExit(f"--forms: expected layers and/or one, got {f!r}")
    routing = ["fixed", "random"] if args.routes == "both" else [args.routes]
    if not set(routing) <= {"fixed", "random"}:
        raise SystemExit(f"--routes: expected fixed, random or both, got {args.routes!r}")
    gaps = [g for g in args.gaps.split(",") if g]
    for g in gaps:
        _gap(g)  # an unknown kind fails here, before any measuring
    result = {
        "layers": layers,
        "T": t,
        "tokens": args.tokens,
        "warmup": args.warmup,
        "forms": [
            measure(backend, m, f, layers, args.tokens, args.warmup, g, r)
            for f in forms
            for g in gaps
            for r in routing
        ],
    }
    if args.out:
        date, record = harness.run_record("bench/decode_backend.py")
        result.update(record)
        stem = harness.write_json(args.out, f"decode-backend-{date:%Y-%m-%d}", result)
        with open(stem + ".md", "w") as f:
            f.write(render(result))
        print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
