"""How the order of a decode expert group's weight reads sets their speed (issue #14).

The decode kernels read each 16-row group of a weight matrix in the order their tensor-core
fragments want: per 64-byte step, 16 rows x 64 bytes (lane gid, t: rows gid and gid + 8,
bytes t * 16 of the step). A plain streaming read runs through memory in order. This bench
reads the same bytes (GLM-5.2's group: 8 experts, gate and up [2048 x 6144] and down
[6144 x 2048] in int4, 151 MB) in three orders, with the same warps, the same loads in flight
and the same work queue (each warp takes one 16-row group at a time with an atomic ticket):

- ``linear``: the group's 16 rows are one contiguous range; load i of a lane reads bytes
  i * 512 + lane * 16 of it;
- ``frag``: the fragment order of moe_tc / moe_tc_f / gemv_st's math (step i / 2, row
  gid + 8 * (i % 2), bytes t * 16 of the step);
- ``rowline``: 512 contiguous bytes of one row per load, the 16 rows in turn.

Beside them: ``gpu_timing.read_launcher``'s plain read of the same buffers, and moe_tc_f on
the same shape (``bench/moe_tc.py``'s case), timed the same way (CUDA events, each launch
behind a spin kernel, weight sets rotated past the L2). If ``frag`` is as fast as ``linear``
the order is not what holds the decode kernels back; if it is as slow as moe_tc_f, it is.

    scripts/devlink && PYTHONPATH=.dev:. python bench/read_patterns.py --out $OUT

Writes ``read-patterns-<date>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gpu_timing, harness  # noqa: E402

PATTERNS = ("linear", "frag", "rowline")

_SRC = r"""
template <int PAT>
__device__ __forceinline__ const uint4 *pat_addr(const unsigned char *base, int rb, int i,
                                                 int lane) {
    if (PAT == 0) return reinterpret_cast<const uint4 *>(base + (size_t)i * 512 + lane * 16);
    if (PAT == 1) {
        const int gid = lane >> 2, t = lane & 3, st = i >> 1, row = gid + 8 * (i & 1);
        return reinterpret_cast<const uint4 *>(base + (size_t)row * rb + st * 64 + t * 16);
    }
    const int row = i & 15, seg = i >> 4;
    return reinterpret_cast<const uint4 *>(base + (size_t)row * rb + seg * 512 + lane * 16);
}

template <int PAT, int NL>
__global__ void __launch_bounds__(256)
pat_read(const unsigned long long *__restrict__ ptrs, const int *__restrict__ rbs, int n_items,
         int *ctr, unsigned int *sink) {
    const int lane = threadIdx.x & 31;
    unsigned int acc = 0;
    for (;;) {
        int it = 0;
        if (lane == 0) it = atomicAdd(ctr, 1);
        it = __shfl_sync(0xffffffffu, it, 0);
        if (it >= n_items) break;
        const unsigned char *base = reinterpret_cast<const unsigned char *>(ptrs[it]);
        const int rb = rbs[it], nld = rb / 32;  // 16 rows x rb bytes / 512 bytes per load
        for (int i0 = 0; i0 < nld; i0 += NL) {
            uint4 v[NL];
#pragma unroll
            for (int j = 0; j < NL; ++j)
                v[j] = i0 + j < nld ? __ldcs(pat_addr<PAT>(base, rb, i0 + j, lane))
                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int j = 0; j < NL; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
        }
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}
"""


def _module():
    import cupy

    names = [f"pat_read<{p}, {nl}>" for p in range(3) for nl in (4, 8, 16)]
    return cupy.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=names), names


def main() -> int:
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--occ", default="1,2,4,8", help="blocks of 8 warps per SM to try")
    ap.add_argument("--no-moe", action="store_true", help="leave out moe_tc_f")
    args = ap.parse_args()
    started, meta = harness.run_record("bench/read_patterns.py")
    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    d, ie, n = 6144, 2048, 8
    shapes = [(ie, d // 2), (ie, d // 2), (d, ie // 2)] * n  # (rows, row bytes) per matrix
    total = sum(r * b for r, b in shapes)
    nsets = max(2, int(np.ceil(3 * gpu_timing.L2 / total)))
    sets = [[cupy.random.randint(0, 256, r * b, dtype=cupy.uint8) for r, b in shapes]
            for _ in range(nsets)]  # fmt: skip
    tables = []
    for st in sets:
        ptrs, rbs = [], []
        for a, (r, b) in zip(st, shapes, strict=True):
            for g in range(r // 16):
                ptrs.append(a.data.ptr + g * 16 * b)
                rbs.append(b)
        tables.append((cupy.asarray(np.array(ptrs, np.uint64)),
                       cupy.asarray(np.array(rbs, np.int32)), np.int32(len(ptrs))))  # fmt: skip
    mod, names = _module()
    ctr = cupy.zeros(1, cupy.int32)
    sink = cupy.zeros(1, cupy.uint32)
    spin = gpu_timing.spin_kernel()
    rows = []

    def reset(_k):
        ctr.fill(0)

    read = gpu_timing.time_launch(gpu_timing.read_launcher(sets, n_sm), spin, args.iters,
                                  args.warmup)  # fmt: skip
    rows.append(dict(path="read_launcher", occ=4, nl=4, **read))
    print(f"read_launcher {read['median_us']:.1f} us", flush=True)
    for occ in [int(o) for o in args.occ.split(",")]:
        for name in names:
            fn = mod.get_function(name)
            pat = PATTERNS[int(name.split("<")[1].split(",")[0])]
            nl = int(name.split(",")[1].rstrip(">"))

            def launch(k, fn=fn, occ=occ):
                p, r, m = tables[k % len(tables)]
                fn((occ * n_sm,), (256,), (p, r, m, ctr, sink))

            t = gpu_timing.time_launch(launch, spin, args.iters, args.warmup, before=reset)
            rows.append(dict(path=pat, occ=occ, nl=nl, regs=int(fn.num_regs), **t))
            print(f"{pat:8s} occ {occ} nl {nl:2d} {t['median_us']:7.1f} us", flush=True)
    if not args.no_moe:
        from bench import moe_tc

        rng = np.random.default_rng()
        case = moe_tc.Case(rng, 2, 0, 1, d, ie, n)
        ln = case.launch(True)
        from functools import partial

        t = gpu_timing.time_launch(partial(case.call, ln), spin, args.iters, args.warmup,
                                   before=case.reset)  # fmt: skip
        rows.append(dict(path="moe_tc_f 8x1 int4", occ=0, nl=0, **t))
        print(f"moe_tc_f {t['median_us']:.1f} us", flush=True)
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    doc = dict(meta, gpu=gpu, commit=harness.commit(), bytes=total, rows=rows)
    base = f"read-patterns-{started:%Y-%m-%d}"
    os.makedirs(args.out, exist_ok=True)
    harness.write_json(args.out, base, doc)
    lines = [
        f"# Read orders of a decode expert group's weights, {gpu}, "
        f"{started:%Y-%m-%d}, commit {harness.commit()}",
        "",
        f"Command: `{meta.get('command')}`. {total / 1e6:.0f} MB per launch; median us of "
        f"{args.iters} launches. GB/s = bytes / median.",
        "",
        "| order | blocks of 8 warps per SM | 16-byte loads in flight per lane | us | GB/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['path']} | {r['occ'] or '-'} | {r['nl'] or '-'} | "
                     f"{r['median_us']:.1f} | {total / r['median_us'] / 1e3:.0f} |")  # fmt: skip
    with open(os.path.join(args.out, base + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
