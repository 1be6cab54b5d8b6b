"""Where the host time of a backend call goes: cProfile over repeated GLM-5.2 decode calls.

    PYTHONPATH=.dev python bench/host_profile.py [--calls 300] [--gaps 0,1000] [--profile]
    PYTHONPATH=.dev python bench/host_profile.py --prefill [--stages] [--calls 20]
    PYTHONPATH=.dev python bench/host_profile.py --parts [--calls 300]

Prints, per operation, the median wall time per call and the backend's own kernel phase, for
back-to-back calls and for calls spaced by idle gaps (a worker between requests: the host
thread and the GPU idle for a while), from the main thread and from a pool thread (as gRPC
handlers run); with --profile, the top functions by self time. A diagnostic for the gap
between "call" and "kernel" in bench/kernels.py and for backend_ns in bench/rpc.py; it writes
no results file.

``--prefill`` instead takes apart the prefill expert group (64 GLM-5.2 int4 experts x 32 rows,
x float32 [2048, 6144]: 50 MB in, 50 MB out): the host copy into pinned memory by copy
threads, the copy engines up, down and both at once, then the call on the one-launch path and
pipelined (``kernels/expert_group_pipe.py``: PIPE_LAUNCHES x PIPE_PIECES, copy threads) swept, each
checked to the bit against the one-launch result, and pipelined with x in a registered
shared-memory segment (a session's: x goes up from where it lies, no copy into pinned
memory), swept over PIPE_EDGE too (the first and the last run's share of a middle run's rows:
1.0, 0.5, 0.25); with --stages, the steps of the one-launch and the pipelined call.

``--parts`` takes a decode call apart where it runs as its kept graph: the whole call, the
graph alone (its launch and the wait for its end as the call waits, ``cupy_calls.wait``: the
D2H copy's stamp polled, with no Python around them), and on
the GPU the span from the inputs' copy starting to the outputs' copy ending (the copy kernels'
stamps) with its three phases. Python is the call less the graph alone; launch and wake is
the graph alone less the GPU span. First, the same for a graph of one empty kernel and its
event: the launch and wake that any call's graph pays.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.kernels import make_tensor  # noqa: E402  (run from the repository root)


def _stage_timers() -> dict[str, int]:
    """Wrap the CuPy backend's per-call steps with wall-time accumulators (ns, by step).
    Nested steps count in both (``finish`` includes the wait for the GPU)."""
    from coliworker.kernels import (
        attention,
        attention_call,
        expert_group,
        expert_group_pipe,
        launch,
        pinned,
        route,
    )
    from coliworker.kernels import graphs as cupy_graphs
    from coliworker.server import cupy_calls

    acc: dict[str, int] = {}

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kw)
            finally:
                acc[label] = acc.get(label, 0) + time.perf_counter_ns() - t0

        setattr(owner, name, timed)

    for name in ("plan_group", "write_group", "route_plan", "prepare"):
        wrap(expert_group, name, f"expert_group.{name}")
    for name in ("pipe_plan", "pipe_tables", "issue_pipelined"):
        wrap(expert_group_pipe, name, f"expert_group_pipe.{name}")
    wrap(cupy_calls, "put_host", "put_host")  # (Call.put's: the ops write through plan views)
    wrap(pinned, "copy_async", "pinned.copy_async (started)")  # issue_pipelined's, at the call
    for name in ("absorb_launch", "flash_launch", "flash_splits", "flash_ok"):
        wrap(attention, name, f"attention.{name}")
    for name in ("gemv_launch", "_plan", "head_jobs", "stack_into"):
        wrap(attention_call, name, f"attention_call.{name}")
    for name in ("reserve", "put", "send", "receive", "issue", "finish", "__enter__",
                 "__exit__"):  # fmt: skip
        wrap(cupy_calls.Call, name, f"Call.{name}")
    wrap(cupy_graphs.Graphs, "run", "Graphs.run")
    wrap(cupy_graphs, "play", "play (direct work)")
    rt = cupy_calls.cupy.cuda.runtime
    wrap(rt, "eventSynchronize", "eventSynchronize (GPU wait)")
    wrap(rt, "eventElapsedTime", "eventElapsedTime")
    wrap(rt, "graphLaunch", "graphLaunch")
    wrap(launch.Launch, "__call__", "kernel launches")
    for name in ("memcpyAsync", "eventRecord", "streamWaitEvent"):
        wrap(rt, name, f"runtime.{name}")
    for name in ("combine_launch", "gather_launch"):
        wrap(route, name, f"route.{name}")
    return acc


def _floor(calls: int) -> float:
    """Median us of launching a graph of one empty kernel and one event record (a call's
    graph at its smallest) and waiting for the event: the part of launch and wake that no node
    of a call's own adds to. (A stamped call waits by polling its stamp, ``cupy_calls.wait``,
    not by the event; the rows' "graph alone" waits that way.)"""
    import cupy

    from coliworker.kernels import graphs

    rt = cupy.cuda.runtime
    record = graphs._external_record()
    nop = cupy.RawKernel(r'extern "C" __global__ void coli_nop() {}', "coli_nop")
    stream, ev = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event()
    with stream:
        nop((1,), (32,), ())
        rt.streamBeginCapture(stream.ptr, 2)  # relaxed, as kernels/graphs.py captures
        nop((1,), (32,), ())
        if record is not None:
            record(ev.ptr, stream.ptr, 1)  # an event-record node, as a call's last
        graph = rt.streamEndCapture(stream.ptr)
        ex = rt.graphInstantiate(graph)
        rt.graphDestroy(graph)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        rt.graphLaunch(ex, stream.ptr)
        if record is not None:
            rt.eventSynchronize(ev.ptr)
        else:
            stream.synchronize()
        ts.append(time.perf_counter_ns() - t0)
    rt.graphExecDestroy(ex)
    return float(np.median(ts)) / 1e3


def parts(ops: dict, calls: int) -> None:
    """``--parts`` (module docstring), medians of ``calls`` of each."""
    from coliworker.server import cupy_calls

    rt = cupy_calls.cupy.cuda.runtime
    print(
        f"A graph of one empty kernel and its event, launched and waited for: "
        f"{_floor(calls):.1f} us"
    )
    seen: dict[str, object] = {}
    replay = cupy_calls.Call.replay

    def spy(call, rep):  # the replayed plan's graph, arena and stream, as the call ran them
        seen["rep"], seen["arena"], seen["stream"] = rep, call.arena, call.stream
        return replay(call, rep)

    cupy_calls.Call.replay = spy
    print(
        "| operation | call us | graph alone | GPU span | H2D | kernels | D2H | Python "
        "| launch + wake |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for name, fn in ops.items():
            for _ in range(20):
                fn()
            walls, ph = [], []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                r = fn()
                walls.append(time.perf_counter_ns() - t0)
                ph.append((r.phases.h2d_ns, r.phases.kernel_ns, r.phases.d2h_ns))
            rep, arena, stream = seen["rep"], seen["arena"], seen["stream"]
            if rep.exec is None or not rep.stamped:  # type: ignore[attr-defined]
                print(f"| {name} | not a stamped kept graph: skipped |")
                continue
            ex, sp, ev = rep.exec.ptr, stream.ptr, arena.eptr[3]  # type: ignore[attr-defined]
            alone, span = [], []
            for _ in range(calls):  # launched and waited for as the call does (stamp poll)
                arena.stamps[3] = 0  # type: ignore[attr-defined]
                t0 = time.perf_counter_ns()
                rt.graphLaunch(ex, sp)
                cupy_calls.wait(arena, True, ev)
                alone.append(time.perf_counter_ns() - t0)
                h0, _, _, d1 = arena.stamps.tolist()  # type: ignore[attr-defined]
                span.append(d1 - h0)
            call, g, gs = (float(np.median(v)) / 1e3 for v in (walls, alone, span))
            h2d, k, d2h = (float(np.median([p[i] for p in ph])) / 1e3 for i in range(3))
            print(
                f"| {name} | {call:.1f} | {g:.1f} | {gs:.1f} | {h2d:.1f} | {k:.1f} | "
                f"{d2h:.1f} | {call - g:.1f} | {g - gs:.1f} |"
            )
    finally:
        cupy_calls.Call.replay = replay


def _median_ms(fn, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return float(np.median(ts)) / 1e6


def _copy_rates(x: np.ndarray) -> None:
    """The host copy of ``x`` into pinned memory by copy threads, and the copy engines."""
    import cupy
    import cupyx

    from coliworker.kernels import pinned

    nb = x.nbytes
    raw = x.reshape(-1).view(np.uint8)
    dst = cupyx.empty_pinned((nb,), np.uint8)
    threads0 = pinned.COPY_THREADS
    print("| host copy into pinned | threads | ms | GB/s |\n|---|---|---|---|")
    for t in (1, 2, 4, 8, 12):
        pinned.set_copy_threads(t)
        ms = _median_ms(lambda: [f.result() for f in pinned.copy_async(dst, raw)], 10)
        print(f"| x, {nb >> 20} MiB | {t} | {ms:.3f} | {nb / ms / 1e6:.1f} |")
    pinned.set_copy_threads(threads0)
    dev, dev2 = cupy.empty((nb,), cupy.uint8), cupy.empty((nb,), cupy.uint8)
    back = cupyx.empty_pinned((nb,), np.uint8)
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    rt = cupy.cuda.runtime

    def up() -> None:
        rt.memcpyAsync(dev.data.ptr, dst.ctypes.data, nb, 1, s1.ptr)
        s1.synchronize()

    def down() -> None:
        rt.memcpyAsync(back.ctypes.data, dev.data.ptr, nb, 2, s2.ptr)
        s2.synchronize()

    def both() -> None:
        rt.memcpyAsync(dev2.data.ptr, dst.ctypes.data, nb, 1, s1.ptr)
        rt.memcpyAsync(back.ctypes.data, dev.data.ptr, nb, 2, s2.ptr)
        s1.synchronize()
        s2.synchronize()

    print("| copy engine (pinned) | ms | GB/s (each way) |\n|---|---|---|")
    for name, fn in (("H2D", up), ("D2H", down), ("H2D + D2H at once", both)):
        ms = _median_ms(fn, 10)
        print(f"| {name} | {ms:.3f} | {nb / ms / 1e6:.1f} |")


def _in_segment(b, x: np.ndarray) -> tuple[np.ndarray, object]:
    """A copy of ``x`` in a shared-memory segment attached to backend ``b`` as a session's is
    (``server/session.py``): the backend registers it on first use and sends x up from it."""
    from coliworker.wire.shm import HEADER_BYTES, Segment

    seg = Segment.create(x.nbytes + 4096)
    b.attach_segment(seg)
    off = -(-HEADER_BYTES // 4096) * 4096
    xs = seg.buf[off : off + x.nbytes].view(np.float32).reshape(x.shape)
    xs[...] = x
    return xs, seg


def prefill(b, calls: int, stages: bool) -> None:
    """--prefill (module docstring)."""
    from coliworker.kernels import expert_group as eg
    from coliworker.kernels import expert_group_pipe as pipe
    from coliworker.kernels import pinned

    rng = np.random.default_rng(0)
    d, i, n_exp, rows = 6144, 2048, 64, 32
    experts = [
        tuple(b.place(make_tensor(rng, 2, *s), 0) for s in ((d, i), (d, i), (i, d)))
        for _ in range(n_exp)
    ]
    rl = [rows] * n_exp
    x = rng.standard_normal((rows * n_exp, d)).astype(np.float32)
    print(f"== prefill {n_exp}x{rows}: x {x.nbytes / 1e6:.1f} MB in, the same out")
    _copy_rates(x)

    def measure(xin: np.ndarray = x) -> tuple[float, float, float, float]:
        walls, ph = [], []
        b.expert_group(experts, rl, xin)
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            r = b.expert_group(experts, rl, xin)
            walls.append(time.perf_counter_ns() - t0)
            ph.append((r.phases.h2d_ns, r.phases.kernel_ns, r.phases.d2h_ns))
        m = np.median(np.array(ph), axis=0) / 1e6
        return float(np.median(walls)) / 1e6, float(m[0]), float(m[1]), float(m[2])

    keep = (pipe.PIPE_LAUNCHES, pipe.PIPE_PIECES, eg.PIPELINE, eg.PIPE_EDGE)
    threads0 = pinned.COPY_THREADS
    eg.PIPELINE = False
    want = b.expert_group(experts, rl, x).out.copy()
    one = measure()
    eg.PIPELINE = True
    print("| path | launches | pieces | copy threads | call ms | h2d ms | kernel ms | d2h ms | "
          "call / one-launch kernel | bits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| one launch | 1 | 1 | {threads0} | {one[0]:.3f} | {one[1]:.3f} | {one[2]:.3f} | "
          f"{one[3]:.3f} | {one[0] / one[2]:.2f} | - |")  # fmt: skip

    def sweep(
        label: str, xin: np.ndarray, configs: list[tuple[int, int, int | None]], edge: float
    ) -> None:
        """A row per (launches, pieces, copy threads; None: no host copy), checked to the bit,
        with PIPE_EDGE ``edge``."""
        eg.PIPE_EDGE = edge
        for L, P, t in configs:
            pipe.PIPE_LAUNCHES, pipe.PIPE_PIECES = L, P
            if t is not None:
                pinned.set_copy_threads(t)
            same = bool(np.array_equal(b.expert_group(experts, rl, xin).out, want))
            c = measure(xin)
            print(f"| {label} | {L} | {P} | {'-' if t is None else t} | {c[0]:.3f} | "
                  f"{c[1]:.3f} | {c[2]:.3f} | {c[3]:.3f} | {c[0] / one[2]:.2f} | "
                  f"{'same' if same else 'DIFFER'} |")  # fmt: skip
        pipe.PIPE_LAUNCHES, pipe.PIPE_PIECES, eg.PIPE_EDGE = keep[0], keep[1], keep[3]
        pinned.set_copy_threads(threads0)

    configs = [(L, P, t) for t in (4, 8) for L in (2, 4, 8) for P in (1, 2, 4)]
    if (keep[0], keep[1], threads0) not in configs:
        configs.insert(0, (keep[0], keep[1], threads0))
    sweep("pipelined" + (f", edge {keep[3]:g}" if keep[3] != 1.0 else ""), x, configs, keep[3])
    xs, seg = _in_segment(b, x)  # the shared-memory path: x in a session's registered segment
    in_segment = [(keep[0], keep[1], None)] + [(L, P, None) for L in (2, 4, 8) for P in (1, 2)]
    for edge in (1.0, 0.5, 0.25):  # two runs are both edge runs: the edge changes nothing there
        runs = in_segment if edge == 1.0 else [c for c in in_segment if c[0] > 2]
        sweep(f"pipelined, x in a registered segment, edge {edge:g}", xs, runs, edge)
    del xs
    seg.close()
    if not stages:
        eg.PIPELINE = keep[2]
        return
    acc = _stage_timers()
    for label, on in (("one launch", False), ("pipelined, defaults", True)):
        eg.PIPELINE = on
        b.expert_group(experts, rl, x)
        acc.clear()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            b.expert_group(experts, rl, x)
        wall = (time.perf_counter_ns() - t0) / calls / 1e3
        print(f"== prefill ({label}): steps, us per call (wall {wall:.1f})")
        for step, ns in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"  {step:34s} {ns / calls / 1e3:8.1f}")
    eg.PIPELINE = keep[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--gaps",
        default="0,200,1000,s1000",
        help="idle microseconds between calls; s<us>: the thread spins through the gap",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--direct", action="store_true", help="CUDA graphs off: direct launches")
    p.add_argument(
        "--stages",
        action="store_true",
        help="also time the steps of each call (wrapped backend functions, us per call)",
    )
    p.add_argument("--prefill", action="store_true", help="the prefill group only (docstring)")
    p.add_argument("--parts", action="store_true", help="decode calls taken apart (docstring)")
    a = p.parse_args()
    from coliworker.server.backends import create_backend

    b = create_backend("cupy", devices=(0,))
    if a.prefill:
        prefill(b, a.calls if a.calls != 300 else 20, a.stages)
        b.close()
        return
    if a.direct:
        from coliworker.kernels import graphs

        graphs.ENABLED = False
    rng = np.random.default_rng(0)
    d, i = 6144, 2048
    experts = [
        tuple(b.place(make_tensor(rng, 2, *s), 0) for s in ((d, i), (d, i), (i, d)))
        for _ in range(8)
    ]
    w = b.place(make_tensor(rng, 2, 6144, 6144), 0)
    x8 = rng.standard_normal((8, d)).astype(np.float32)
    x1 = rng.standard_normal((1, 6144)).astype(np.float32)
    h, q, rd, v, k = 64, 192, 64, 256, 512
    kv_b = b.place(make_tensor(rng, 2, k, h * (q + v)), 0)
    o_proj = b.place(make_tensor(rng, 2, h * v, d), 0)
    cache = b.new_kv(0, k, rd)
    cache.append(rng.standard_normal((4096, k)).astype(np.float32),
                 rng.standard_normal((4096, rd)).astype(np.float32))  # fmt: skip
    qs = rng.standard_normal((1, h, q + rd)).astype(np.float32)
    routes = np.arange(8, dtype=np.int32).reshape(1, 8)
    rw = rng.random((1, 8)).astype(np.float32)
    ops = {
        "expert_group 8x1": lambda: b.expert_group(experts, [1] * 8, x8),
        "expert_group_routed 1 token, 8 of 8": lambda: b.expert_group_routed(
            experts, x1, routes, rw
        ),
        "matmul S=1 6144^2": lambda: b.matmul(w, x1),
        "attention_ragged 1 seq T=4096": lambda: b.attention_ragged(
            kv_b, o_proj, qs, [cache], q, rd, v, 1 / np.sqrt(q + rd)
        ),
    }
    if a.parts:
        pool64 = [
            tuple(b.place(make_tensor(rng, 2, *s), 0) for s in ((d, i), (d, i), (i, d)))
            for _ in range(56)
        ] + experts
        ring = iter(range(1 << 30))
        ops["expert_group_routed 1 token, new 8 of 64"] = lambda: b.expert_group_routed(
            pool64[8 * (next(ring) % 8) :][:8], x1, routes, rw
        )
        parts(ops, a.calls)
        b.close()
        return
    stages = _stage_timers() if a.stages else None
    pool = ThreadPoolExecutor(1)
    gaps = a.gaps.split(",")
    table = []

    def loop(fn, gap: str) -> tuple[float, float]:
        spin, gap_ns = gap.startswith("s"), int(gap.lstrip("s")) * 1000
        walls, kerns = [], []
        for _ in range(a.calls):
            if spin:
                end = time.perf_counter_ns() + gap_ns
                while time.perf_counter_ns() < end:
                    pass
            elif gap_ns:
                time.sleep(gap_ns / 1e9)
            t0 = time.perf_counter_ns()
            r = fn()
            walls.append(time.perf_counter_ns() - t0)
            kerns.append(r.phases.kernel_ns)
        return float(np.median(walls)) / 1e3, float(np.median(kerns)) / 1e3

    for name, fn in ops.items():
        for _ in range(20):
            fn()
        pool.submit(lambda fn=fn: [fn() for _ in range(20)]).result()
        for gap in gaps:
            main_w, main_k = loop(fn, gap)
            thr_w, _ = pool.submit(loop, fn, gap).result()
            table.append((name, gap, main_w, thr_w, main_k))
        if stages is not None:
            stages.clear()
            t0 = time.perf_counter_ns()
            for _ in range(a.calls):
                fn()
            wall = (time.perf_counter_ns() - t0) / a.calls / 1e3
            print(f"== {name}: steps, us per call (back to back; wall {wall:.1f})")
            for step, ns in sorted(stages.items(), key=lambda kv: -kv[1]):
                print(f"  {step:34s} {ns / a.calls / 1e3:8.1f}")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                fn()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
            print(f"== {name}")
            print(out.getvalue())
    print("| operation | gap us (s: spun) | wall p50 us (main) | (pool thread) | kernel p50 us |")
    print("|---|---|---|---|---|")
    for name, gap, mw, tw, k in table:
        print(f"| {name} | {gap} | {mw:.1f} | {tw:.1f} | {k:.1f} |")
    b.close()


if __name__ == "__main__":
    main()
