"""GPU kernel benchmark: our CuPy backend beside the seed, GLM-5.2 shapes, one run.

For every row of the kernel targets table it times one in-process backend call from Python
(synchronous, activation transfers included: "call") and the backend's CUDA-event kernel
time ("kernel"), rotating among enough weight sets that the 60 MB L2 never holds them,
checks the result against the float64 reference, and puts the seed's figures from the
same run beside them (the seed is built from ``--seed-dir`` with nvcc and timed by its own
``bench_seed.py``). Beside each row, "read us" is the machine's limit at the row's own size:
a plain streaming read of the same bytes (the same buffers: each weight matrix, its scales,
each KV cache) in one launch (``gpu_timing.read_launcher``), timed between CUDA events as
``gpu_timing.time_launch`` times a kernel; "floor us" is the same bytes at the H200's
measured 4.48 TB/s.

    scripts/devlink && PYTHONPATH=.dev python bench/kernels.py --seed-dir .seed --out $OUT

Writes ``kernels-<date>.json`` and ``kernels-<date>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (run from anywhere: bench/ is beside the package)
from bench import gpu_timing, harness  # noqa: E402
from bench.gpu_timing import L2, READ_BW  # noqa: E402

GLM = dict(D=6144, I=2048, H=64, Q=192, R=64, V=256, K=512)


def rel_err(y, want) -> float:
    return float(np.max(np.abs(y - want)) / max(float(np.max(np.abs(want))), 1e-30))


def make_tensor(rng, fmt, i, o, gs=0):
    from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count

    if fmt == 0:
        w = rng.standard_normal((o, i)).astype(np.float32).view(np.uint8).reshape(-1)
    else:
        w = rng.integers(0, 256, size=o * row_bytes(fmt, i), dtype=np.uint8)
    s = (rng.random(scale_count(fmt, i, o, gs)) * 0.02 + 0.001).astype(np.float32)
    return QTensor(fmt, i, o, gs, w, s)


def timed(fn, n: int, warmup: int = 3):
    """Median wall ms and median kernel ms (from Result.phases) over n calls."""
    for _ in range(warmup):
        fn(0)
    walls, kernels = [], []
    for k in range(n):
        t0 = time.perf_counter()
        r = fn(k)
        walls.append(time.perf_counter() - t0)
        kernels.append(r.phases.kernel_ns / 1e6)
    return float(np.median(walls)) * 1e3, float(np.median(kernels))


def plain_read_us(sizes: list[int], iters: int = 50) -> float | None:
    """Median us of one streaming read of buffers of these byte sizes (each rounded up to 16
    bytes), rotated among enough sets that the 60 MB L2 never holds the next: the machine's
    limit for a call that reads them."""
    import cupy

    sizes = [-(-n // 16) * 16 for n in sizes if n > 0]
    nsets = max(2, int(np.ceil(3 * L2 / sum(sizes))))
    try:
        sets = [[cupy.empty(n, cupy.uint8) for n in sizes] for _ in range(nsets)]
        n_sm = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        t = gpu_timing.time_launch(
            gpu_timing.read_launcher(sets, n_sm), gpu_timing.spin_kernel(), iters, 5
        )
    except Exception as exc:  # the row's own figures stand without it
        print(f"plain read of {sum(sizes)} bytes: {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        sets = []
        cupy.get_default_memory_pool().free_all_blocks()
    return t["median_us"]


def _tensor_sizes(tensors) -> list[int]:
    """The device buffers a call reads for these host tensors: each one's weights, its scales."""
    return [n for t in tensors for n in (t.weights.nbytes, t.scales.nbytes)]


def _expert_sets(backend, rng, count, fmt=2, gs=0):
    """(host sets, placed sets, weight bytes of one set): enough sets of ``count`` GLM-5.2
    experts (gate, up, down) that the 60 MB L2 never holds the next one."""
    d, i = GLM["D"], GLM["I"]
    set_bytes = count * 3 * (d * i // 2 if fmt in (2, 4) else d * i)
    nsets = max(2, int(np.ceil(3 * L2 / set_bytes)))
    hosts = [
        [
            (
                make_tensor(rng, fmt, d, i, gs),
                make_tensor(rng, fmt, d, i, gs),
                make_tensor(rng, fmt, i, d, gs),
            )
            for _ in range(count)
        ]
        for _ in range(nsets)
    ]
    res = [[tuple(backend.place(t, 0) for t in e) for e in hs] for hs in hosts]
    return hosts, res, set_bytes


def _release(backend, sets) -> None:
    for experts in sets:
        for e in experts:
            for t in e:
                backend.release(t)


def bench_group(backend, rng, name, count, rows, fmt=2, gs=0, n=50, pool=0):
    """An expert group of ``count`` experts x ``rows`` rows each. ``pool``: each call sends
    ``count`` experts drawn afresh from a pool of that many, and one token's row repeated
    for each (a decode step as a seed-ABI engine sends it: its router's experts, no two
    calls naming the same ones)."""
    from coliworker.kernels import reference as ref

    d, i = GLM["D"], GLM["I"]
    hosts, res, set_bytes = _expert_sets(backend, rng, pool or count, fmt, gs)
    nsets = len(res)
    rl = [rows] * count
    if pool:
        x = np.repeat(rng.standard_normal((rows, d)).astype(np.float32), count, axis=0)
        picks = [rng.permutation(pool)[:count] for _ in range(n + 8)]
        sets = [[res[k % nsets][j] for j in p] for k, p in enumerate(picks)]
        first = [hosts[0][j] for j in picks[0]]
        set_bytes = set_bytes * count // pool
    else:
        x = rng.standard_normal((rows * count, d)).astype(np.float32)
        sets, first = res, hosts[0]
    y = backend.expert_group(sets[0], rl, x).out
    err = rel_err(y, ref.expert_group(first, rl, x))
    call_ms, kern_ms = timed(lambda k: backend.expert_group(sets[k % len(sets)], rl, x), n)
    wbytes = set_bytes + sum(t.scales.nbytes for e in first for t in e)
    _release(backend, res)
    read_us = plain_read_us(_tensor_sizes(t for e in first for t in e))
    flops = 2 * 3 * d * i * rows * count
    return dict(
        name=name,
        call_ms=call_ms,
        kernel_ms=kern_ms,
        rel_err=err,
        weight_MB=wbytes / 1e6,
        kernel_GBps=wbytes / (kern_ms * 1e-3) / 1e9,
        kernel_TFLOPs=flops / (kern_ms * 1e-3) / 1e12,
        floor_us=wbytes / READ_BW * 1e6,
        read_us=read_us,
    )


def bench_routed(backend, rng, name, count, tokens, topk, n=50, pool=0):
    """A routed group as the engine sends it at decode: ``tokens`` tokens, top-``topk`` of
    ``count`` int4 experts, fresh routes every call (the tables change with them). ``pool``:
    instead, each call sends ``count`` experts drawn afresh from a pool of that many (a
    router's choice of the layer's experts, different every token: no two calls name the
    same experts), routes a permutation of them."""
    from coliworker.kernels import reference as ref

    d, i = GLM["D"], GLM["I"]
    hosts, res, _ = _expert_sets(backend, rng, pool or count)
    nsets = len(res)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    routes = [
        np.stack([rng.permutation(count)[:topk] for _ in range(tokens)]).astype(np.int32)
        for _ in range(16)
    ]
    w = rng.random((tokens, topk)).astype(np.float32)
    if pool:
        picks = [rng.permutation(pool)[:count] for _ in range(n + 8)]
        sets = [[res[k % nsets][j] for j in p] for k, p in enumerate(picks)]
        first = [hosts[0][j] for j in picks[0]]
    else:
        sets, first = [res[k % nsets] for k in range(nsets)], hosts[0]
    y = backend.expert_group_routed(sets[0], x, routes[0], w).out
    err = rel_err(y, ref.expert_group_routed(first, x, routes[0], w))
    call_ms, kern_ms = timed(
        lambda k: backend.expert_group_routed(sets[k % len(sets)], x, routes[k % 16], w), n
    )
    used = len(np.unique(routes[0]))
    wbytes = used * 3 * (d * i // 2) + sum(t.scales.nbytes for e in hosts[0][:used] for t in e)
    _release(backend, res)
    return dict(
        name=name,
        call_ms=call_ms,
        kernel_ms=kern_ms,
        rel_err=err,
        weight_MB=wbytes / 1e6,
        kernel_GBps=wbytes / (kern_ms * 1e-3) / 1e9,
        floor_us=wbytes / READ_BW * 1e6,
        read_us=plain_read_us(_tensor_sizes(t for e in hosts[0][:used] for t in e)),
    )


def bench_matmul(backend, rng, name, s, i, o, fmt=2, n=100):
    from coliworker.kernels import reference as ref

    nsets = max(2, int(np.ceil(3 * L2 / (o * i // 2))))
    hosts = [make_tensor(rng, fmt, i, o) for _ in range(nsets)]
    res = [backend.place(t, 0) for t in hosts]
    x = rng.standard_normal((s, i)).astype(np.float32)
    err = rel_err(backend.matmul(res[0], x).out, ref.matmul(hosts[0], x))
    call_ms, kern_ms = timed(lambda k: backend.matmul(res[k % nsets], x), n)
    for r in res:
        backend.release(r)
    wbytes = hosts[0].nbytes
    return dict(
        name=name,
        call_ms=call_ms,
        kernel_ms=kern_ms,
        rel_err=err,
        weight_MB=wbytes / 1e6,
        kernel_GBps=wbytes / (kern_ms * 1e-3) / 1e9,
        floor_us=wbytes / READ_BW * 1e6,
        read_us=plain_read_us(_tensor_sizes([hosts[0]])),
    )


def bench_ragged(backend, rng, name, seqs, t, n=30):
    from coliworker.kernels import reference as ref

    g = GLM
    h, q, r, v, k, dout = g["H"], g["Q"], g["R"], g["V"], g["K"], g["D"]
    kv_b = make_tensor(rng, 2, k, h * (q + v))
    o_proj = make_tensor(rng, 2, h * v, dout)
    rk, ro = backend.place(kv_b, 0), backend.place(o_proj, 0)
    total = t + n + 8
    lat = [rng.standard_normal((total, k)).astype(np.float32) for _ in range(seqs)]
    rope = [rng.standard_normal((total, r)).astype(np.float32) for _ in range(seqs)]
    caches = [backend.new_kv(0, k, r) for _ in range(seqs)]
    for c, la, ro_ in zip(caches, lat, rope, strict=True):
        c.append(la[: t - 8], ro_[: t - 8])
    qs = rng.standard_normal((seqs, h, q + r)).astype(np.float32)
    scale = 1 / np.sqrt(q + r)
    out = backend.attention_ragged(rk, ro, qs, caches, q, r, v, scale).out
    want = ref.attention_ragged(
        kv_b, o_proj, qs, [la[: t - 8] for la in lat], [x[: t - 8] for x in rope], q, r, v, scale
    )
    err = rel_err(out, want)

    def step(_k):
        # One decode step per sequence as the worker makes it: room for the new KV row
        # (sequences.py), then one call that carries the rows and attends.
        rows = []
        for c, la, ro_ in zip(caches, lat, rope, strict=True):
            c.reserve(1)
            rows.append((la[c.length : c.length + 1], ro_[c.length : c.length + 1]))
        return backend.attention_ragged(rk, ro, qs, caches, q, r, v, scale, rows=rows)

    call_ms, kern_ms = timed(step, n)
    kv_rows = [c.length for c in caches]
    kv_bytes = sum(kv_rows) * (k + r) * 4
    wbytes = kv_b.nbytes + o_proj.nbytes + kv_bytes
    for c in caches:
        c.release()
    backend.release(rk)
    backend.release(ro)
    # kv_b, o_proj, and each sequence's latent and rope rows
    sizes = _tensor_sizes([kv_b, o_proj]) + [n * x * 4 for n in kv_rows for x in (k, r)]
    return dict(
        name=name,
        call_ms=call_ms,
        kernel_ms=kern_ms,
        rel_err=err,
        weight_MB=wbytes / 1e6,
        floor_us=wbytes / READ_BW * 1e6,
        read_us=plain_read_us(sizes),
    )


ROWS = [
    # name, seed row name, target call ms, target kernel ms
    ("expert group decode 8x1 int4", "glm52 decode 8x1 w4 dual", 0.090, 0.045),
    ("expert group decode 8x1 gs=64", "glm52 decode 8x1 g4 gs128", None, 0.050),
    ("expert group 8x4 int4", "glm52 decode 8x4 w4 dual", None, 0.060),
    ("expert group prefill 64x32 int4", "glm52 prefill 64x32 w4 dual", 1.5, 0.8),
    ("dense matmul S=1 6144x6144 int4", "glm52 dense S=1 6144x6144 int4", 0.040, 0.010),
    ("MLA ragged+o_proj 1 seq T=4096", "mla ragged H64 S1 T4096", 0.060, None),
    ("MLA ragged+o_proj 8 seqs T=4096", "mla ragged H64 S8 T4096", 0.120, None),
    ("MLA ragged+o_proj 32 seqs T=2048", "mla ragged H64 S32 T2048", 0.250, None),
    ("expert group routed 1 token top-8 of 8", "", None, None),
    ("expert group routed 8 tokens top-8 of 64", "", None, None),
    ("expert group routed 1 token, 8 of a pool of 64, new each call", "", None, None),
    ("expert group decode 8x1 int4, 8 of a pool of 64, new each call", "", None, None),
]
LAYERS = 78  # GLM-5.2: one ragged attention and one routed group per layer and token
TOKEN_ROWS = ("MLA ragged+o_proj 1 seq T=4096", "expert group routed 1 token top-8 of 8")
# The same token with the routed experts a router picks: other experts every call.
TOKEN_ROWS_ROUTED = (TOKEN_ROWS[0], "expert group routed 1 token, 8 of a pool of 64, new each call")
# ... and as a seed-ABI engine sends its experts: an expert group of the 8, the row 8 times.
TOKEN_ROWS_GROUP = (TOKEN_ROWS[0], "expert group decode 8x1 int4, 8 of a pool of 64, new each call")


def run_seed(seed_dir: Path, out: Path) -> dict[str, dict]:
    """Build the seed with nvcc and run its own benchmark; returns its rows by name."""
    seed_dir, out = seed_dir.resolve(), out.resolve()  # it runs with cwd=seed_dir
    lib = seed_dir / "libseed.so"
    subprocess.run(
        [
            "nvcc",
            "-arch=sm_90",
            "-O3",
            "-Xcompiler",
            "-fPIC",
            "-shared",
            "-o",
            str(lib),
            str(seed_dir / "backend_cuda.cu"),
        ],
        check=True,
    )
    js = out / "seed-raw.json"
    env = dict(os.environ, ONLY="glm52", SEEDBENCH_JSON=str(js))
    with open(out / "seed.log", "w") as log:
        subprocess.run(
            [sys.executable, str(seed_dir / "bench_seed.py"), str(lib)],
            env=env,
            check=True,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=seed_dir,
        )
    return {r["name"]: r for r in json.load(open(js))}


def run_meta(command: str) -> dict:
    """What a results file records about its run: GPU, date, commit, host, command."""
    import cupy

    return dict(
        gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        date=datetime.date.today().isoformat(),
        commit=harness.commit(),
        host=platform.node(),
        command=command,
        read_bw_TBps=READ_BW / 1e12,
    )


def render(meta: dict, rows: list[dict]) -> str:
    """The markdown table of a run (``meta`` and ``rows`` as in the JSON file)."""
    md = [
        f"# Kernel benchmark, {meta['gpu']}, {meta['date']}, commit {meta['commit']}",
        "",
        f"Command: `{meta['command']}` (seed built from the seed sources in the same run).",
        "",
        "| operation | ours call ms | ours kernel ms | call - kernel us | direct call ms | "
        "direct kernel ms | seed call ms | seed kernel ms | speedup (call) | GB/s | TFLOP/s | "
        "floor us | read us | target | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, k=3):
        return "-" if v is None else f"{v:.{k}f}"

    for r in rows:
        if "error" in r:
            md.append(f"| {r['name']} | error: {r['error']} ||||||||||||||")
            continue
        sp = (r["seed_call_ms"] / r["call_ms"]) if r.get("seed_call_ms") else None
        tgt = " / ".join(
            x
            for x in (
                f"call<={r['target_call_ms']}" if r["target_call_ms"] else "",
                f"kernel<={r['target_kernel_ms']}" if r["target_kernel_ms"] else "",
            )
            if x
        )
        gap = (r["call_ms"] - r["kernel_ms"]) * 1e3
        md.append(
            f"| {r['name']} | {f(r['call_ms'])} | {f(r['kernel_ms'])} | {f(gap, 1)} | "
            f"{f(r.get('direct_call_ms'))} | {f(r.get('direct_kernel_ms'))} | "
            f"{f(r['seed_call_ms'])} | {f(r['seed_kernel_ms'])} | {f(sp, 1)}x | "
            f"{f(r.get('kernel_GBps'), 0)} | {f(r.get('kernel_TFLOPs'), 1)} | "
            f"{f(r['floor_us'], 1)} | {f(r.get('read_us'), 1)} | {tgt} | "
            f"{r['rel_err']:.1e} |"
        )
    by = {r["name"]: r for r in rows if "error" not in r}
    for names in (TOKEN_ROWS, TOKEN_ROWS_ROUTED, TOKEN_ROWS_GROUP):
        if not all(n in by for n in names):
            continue
        call = LAYERS * sum(by[n]["call_ms"] for n in names)
        kern = LAYERS * sum(by[n]["kernel_ms"] for n in names)
        line = (
            f"One GLM-5.2 decode token ({LAYERS} x ({' + '.join(names)})): backend "
            f"{call:.1f} ms, kernels {kern:.1f} ms, ratio {call / kern:.2f}"
        )
        if all("direct_call_ms" in by[n] for n in names):
            dcall = LAYERS * sum(by[n]["direct_call_ms"] for n in names)
            line += f"; direct launches: backend {dcall:.1f} ms"
        md += ["", line + "."]
    return "\n".join(md) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--seed-dir", type=Path, default=None, help="folder with the seed sources")
    p.add_argument(
        "--only", default="", help="comma-separated substrings: run only rows naming one"
    )
    p.add_argument("--render", type=Path, default=None, help="print a results JSON's table")
    p.add_argument(
        "--direct",
        action="store_true",
        help="also run every row with CUDA graphs off (direct launches), same process",
    )
    a = p.parse_args()
    if a.render is not None:
        d = json.loads(a.render.read_text())
        print(render(d["meta"], d["rows"]), end="")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    from coliworker.server.backends import create_backend

    seed = run_seed(a.seed_dir, a.out) if a.seed_dir else {}
    backend = create_backend("cupy", devices=(0,))
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    fns = [
        lambda: bench_group(backend, rng, ROWS[0][0], 8, 1),
        lambda: bench_group(backend, rng, ROWS[1][0], 8, 1, fmt=4, gs=64),
        lambda: bench_group(backend, rng, ROWS[2][0], 8, 4),
        lambda: bench_group(backend, rng, ROWS[3][0], 64, 32, n=10),
        lambda: bench_matmul(backend, rng, ROWS[4][0], 1, 6144, 6144),
        lambda: bench_ragged(backend, rng, ROWS[5][0], 1, 4096),
        lambda: bench_ragged(backend, rng, ROWS[6][0], 8, 4096),
        lambda: bench_ragged(backend, rng, ROWS[7][0], 32, 2048),
        lambda: bench_routed(backend, rng, ROWS[8][0], 8, 1, 8),
        lambda: bench_routed(backend, rng, ROWS[9][0], 64, 8, 8, n=30),
        lambda: bench_routed(backend, rng, ROWS[10][0], 8, 1, 8, pool=64),
        lambda: bench_group(backend, rng, ROWS[11][0], 8, 1, pool=64),
    ]
    from coliworker.kernels import graphs as cupy_graphs

    rows = []
    for (name, seed_name, t_call, t_kern), fn in zip(ROWS, fns, strict=True):
        if a.only and not any(w in name for w in a.only.split(",")):
            continue
        try:
            if a.direct:  # the same row with every launch direct (no CUDA graphs), first
                cupy_graphs.ENABLED = False
                d = fn()
                cupy_graphs.ENABLED = True
            r = fn()
            if a.direct:
                r.update(direct_call_ms=d["call_ms"], direct_kernel_ms=d["kernel_ms"])
        except Exception as exc:  # keep the other rows
            cupy_graphs.ENABLED = True
            r = dict(name=name, error=f"{type(exc).__name__}: {exc}")
        s = seed.get(seed_name, {})
        r.update(
            seed_call_ms=s.get("wall_ms"),
            seed_kernel_ms=s.get("kernel_ms"),
            target_call_ms=t_call,
            target_kernel_ms=t_kern,
        )
        rows.append(r)
        print(json.dumps(r), flush=True)

    cmd = "PYTHONPATH=.dev python bench/kernels.py " + " ".join(sys.argv[1:])
    meta = run_meta(cmd)
    date = meta["date"]
    (a.out / f"kernels-{date}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = render(meta, rows)
    (a.out / f"kernels-{date}.md").write_text(md)
    print(md)
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
