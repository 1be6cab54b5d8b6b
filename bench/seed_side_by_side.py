"""The seed's own benchmark (``bench_seed.py``, run unchanged) of the seed's in-process library
beside ``libcoliworker_cuda.so`` (the C client over the data plane to a worker in its own
process), as one table: wall time per call at GLM-5.2 shapes.

    # on the GPU host, after scripts/seed-copy, scripts/build-c and the seed's nvcc build:
    coliworker serve --backend cupy --port 50071 --data-port 50072 &
    ONLY=glm52 SEEDBENCH_JSON=seed.json python3 .seed/bench_seed.py .seed/libseed.so
    COLIWORKER_ADDRESS=127.0.0.1:50072 ONLY=glm52 SEEDBENCH_JSON=ours.json \\
        python3 .seed/bench_seed.py build/libcoliworker_cuda.so
    python bench/seed_side_by_side.py seed.json ours.json --commit <sha> --gpu "NVIDIA H200"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seed")
    p.add_argument("ours")
    p.add_argument("--commit", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    seed = {r["name"]: r for r in json.load(open(args.seed))}
    ours = {r["name"]: r for r in json.load(open(args.ours))}
    rows = []
    for name, s in seed.items():
        o = ours.get(name)
        if o is None or "wall_ms" not in s:
            continue
        rows.append(
            {
                "call": name,
                "seed_wall_ms": s["wall_ms"],
                "seed_kernel_ms": s.get("kernel_ms"),
                "remote_wall_ms": o["wall_ms"],
                "remote_kernel_ms": o.get("kernel_ms"),
                "speedup": s["wall_ms"] / o["wall_ms"],
            }
        )
    stem = os.path.join(args.out, f"c-client-seedbench-{args.date}")
    doc = {"date": args.date, "commit": args.commit, "gpu": args.gpu, "rows": rows}
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=2)

    def ms(v):
        return "-" if v is None else f"{v:.3f}"

    lines = [
        "# The seed's benchmark: seed in-process vs libcoliworker_cuda.so over the data plane",
        "",
        f"- date: {args.date}; commit: {args.commit}; GPU: {args.gpu} (one host: the worker in "
        "its own process, the C client over TCP loopback to its data port)",
        "- command: see bench/seed_side_by_side.py (bench_seed.py run unchanged, ONLY=glm52)",
        "- wall = one ABI call as the engine sees it (ctypes), transfers and, for the remote "
        "library, the data plane included; kernel = the library's group_stats kernel time",
        "",
        "| call (GLM-5.2) | seed wall ms | seed kernel ms | remote wall ms | remote kernel ms "
        "| seed / remote |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['call']} | {ms(r['seed_wall_ms'])} | {ms(r['seed_kernel_ms'])} "
            f"| {ms(r['remote_wall_ms'])} | {ms(r['remote_kernel_ms'])} | {r['speedup']:.2f}x |"
        )
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
