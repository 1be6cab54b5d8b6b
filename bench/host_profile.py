"""Where the host time of a backend call goes: cProfile over repeated GLM-5.2 decode calls.

    PYTHONPATH=.dev python bench/host_profile.py [--calls 300]

Prints, per operation, the median wall time per call, the backend's own kernel phase, and
the top functions by self time. A diagnostic for the gap between "call" and "kernel" in
bench/kernels.py; it writes no results file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np

from bench.kernels import make_tensor  # noqa: E402  (run from the repository root)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    from coliworker.server.backends import create_backend

    b = create_backend("cupy", devices=(0,))
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
    ops = {
        "expert_group 8x1": lambda: b.expert_group(experts, [1] * 8, x8),
        "matmul S=1 6144^2": lambda: b.matmul(w, x1),
        "attention_ragged 1 seq T=4096": lambda: b.attention_ragged(
            kv_b, o_proj, qs, [cache], q, rd, v, 1 / np.sqrt(q + rd)
        ),
    }
    for name, fn in ops.items():
        for _ in range(20):
            fn()
        walls, kerns = [], []
        for _ in range(a.calls):
            t0 = time.perf_counter_ns()
            r = fn()
            walls.append(time.perf_counter_ns() - t0)
            kerns.append(r.phases.kernel_ns)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(
            f"== {name}: wall p50 {np.median(walls) / 1e3:.1f} us, kernel phase p50 "
            f"{np.median(kerns) / 1e3:.1f} us"
        )
        print(s.getvalue())
    b.close()


if __name__ == "__main__":
    main()
