"""Where the host time of a backend call goes: cProfile over repeated GLM-5.2 decode calls.

    PYTHONPATH=.dev python bench/host_profile.py [--calls 300] [--gaps 0,1000] [--profile]

Prints, per operation, the median wall time per call and the backend's own kernel phase, for
back-to-back calls and for calls spaced by idle gaps (a worker between requests: the host
thread and the GPU idle for a while), from the main thread and from a pool thread (as gRPC
handlers run); with --profile, the top functions by self time. A diagnostic for the gap
between "call" and "kernel" in bench/kernels.py and for backend_ns in bench/rpc.py; it writes
no results file.
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
    from coliworker.kernels import attention, expert_group, launch, route
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
    for mod in (expert_group, cupy_calls):  # each imported put_host by name
        wrap(mod, "put_host", "put_host")
    for name in ("absorb_launch", "flash_launch", "flash_splits", "flash_ok", "gemv_launch",
                 "_plan", "head_jobs", "stack_into"):  # fmt: skip
        wrap(attention, name, f"attention.{name}")
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
    for name in ("combine_launch", "gather_launch"):
        wrap(route, name, f"route.{name}")
    return acc


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
    a = p.parse_args()
    from coliworker.server.backends import create_backend

    b = create_backend("cupy", devices=(0,))
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
