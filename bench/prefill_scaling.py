"""How the expert-group kernel scales with rows per expert: the evidence for what bounds it.

GLM-5.2 experts (D=6144, I=2048), 64 experts, int4, rows per expert swept: if the kernel were
bound by tensor-core work its time would grow with the rows; if it is bound by how fast the
weights stream in, it stays nearly flat while the weight bytes stay the same. Times the
tensor-core path and the fp32 path (``matmul.TENSOR_CORES = False``) in the same run.

    scripts/devlink && PYTHONPATH=.dev python bench/prefill_scaling.py --out $OUT

Writes ``prefill-scaling-<date>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from bench.kernels import bench_group, run_meta  # run from the repository root

CASES = [  # (rows per expert, fmt, group size, also on the fp32 path)
    (4, 2, 0, False),
    (8, 2, 0, True),
    (16, 2, 0, False),
    (32, 2, 0, True),
    (32, 4, 64, False),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--experts", type=int, default=64)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    from coliworker.kernels import matmul
    from coliworker.server.backends import create_backend

    backend = create_backend("cupy", devices=(0,))
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rows = []
    for r, fmt, gs, fp32 in CASES:
        for tc in (True, False) if fp32 else (True,):
            matmul.TENSOR_CORES = tc
            name = f"{a.experts} experts x {r} rows, fmt {fmt}" + (f" gs={gs}" if gs else "")
            res = bench_group(backend, rng, name, a.experts, r, fmt=fmt, gs=gs, n=10)
            res.update(rows_per_expert=r, fmt=fmt, group_size=gs, tensor_cores=tc)
            rows.append(res)
            print(json.dumps(res), flush=True)
    matmul.TENSOR_CORES = True
    meta = run_meta("PYTHONPATH=.dev python bench/prefill_scaling.py --out $OUT")
    gpu, date = meta["gpu"], meta["date"]
    (a.out / f"prefill-scaling-{date}.json").write_text(
        json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n"
    )
    md = [
        f"# Expert-group kernel vs rows per expert, {gpu}, {date}, commit {meta['commit']}",
        "",
        f"Command: `{meta['command']}`. Kernel = CUDA-event time of one call (median of 10), the",
        "weights rotated so the L2 never holds them.",
        "",
        "| case | path | kernel ms | call ms | weight GB/s | TFLOP/s | rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['name']} | {'tensor cores' if r['tensor_cores'] else 'fp32'} | "
            f"{r['kernel_ms']:.3f} | {r['call_ms']:.3f} | {r['kernel_GBps']:.0f} | "
            f"{r['kernel_TFLOPs']:.1f} | {r['rel_err']:.1e} |"
        )
    text = "\n".join(md) + "\n"
    (a.out / f"prefill-scaling-{date}.md").write_text(text)
    print(text)
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
