"""Split-K and streamed tensor-core decode GEMV (issue #14): gemv_tc against gemv_tc_k /
gemv_tc_sk and gemv_st.

For each shape it builds the job table itself (as the backend would: one job per matrix, or
one per head for the value projection), rotates among enough weight sets that the 60 MB L2
never holds the next one, and times ``gemv_launch``'s launch with CUDA events, median of
``--iters`` (>= 50) launches after ``--warmup``, each kernel alone between its two events:
a spin kernel runs first, so the events and the kernel are queued back to back and the
host's launch time is not counted. Paths (STREAM off but in the last): SPLIT_K off (gemv_tc),
on (the host's choice of cluster size C), each C forced (``--no-sweep`` drops those), and
"stream" (gemv_st where it serves the shape, else as "on"). Every path is checked
against float64 (max over activation rows of max|y - ref| / max|ref|) and for the same bits
on repeated calls.

    scripts/devlink && PYTHONPATH=.dev python bench/gemv_splitk.py --out $OUT

Writes ``gemv-splitk-<date>.json`` and ``.md`` into ``--out``: GPU, date, commit
(COLIWORKER_COMMIT, else git), the command, per shape the weight bytes read (row padding and
scales included), the floor at 4.48 TB/s, the times, % of roofline and errors.

Counters before / after (device machine): ``--profile`` launches each path twice (a checked
call, then one more) with no timing loop, so ncu sees 2 launches per path and shape (its
default cache control flushes the caches before each, so both read the weights from HBM);
``-k regex:gemv_tc`` takes gemv_tc (off), gemv_tc_k and gemv_tc_sk (on and the forced C),
never the spin kernel; the kernel names and grids in the report tell the paths apart. Achieved
occupancy is sm__warps_active (Occupancy section), stall reasons the WarpStateStats section:

    M=dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
    M=$M,sm__warps_active.avg.pct_of_peak_sustained_active
    ncu --clock-control none -k regex:gemv_tc --metrics $M \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        -o $OUT/gemv-splitk python bench/gemv_splitk.py --profile \\
        --only "dense S=1 6144x6144 int4,o_proj S=1,value proj 64 x [256x512] S=1,gs=64" \\
        --out $OUT/ncu-run
    ncu --import $OUT/gemv-splitk.ncu-rep --page raw --csv > $OUT/gemv-splitk-ncu.csv
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gpu_timing, harness, variants  # noqa: E402  (run from anywhere: bench/ is beside the package)

# gemv_st's other forms timed beside its defaults: (math warps, blocks per SM)
ST_FORMS = ((16, 1), (8, 2), (16, 2))
# (name, fmt, group size, activation rows, in_features, output rows per job, jobs)
SHAPES = [
    ("dense S=1 6144x6144 int4", 2, 0, 1, 6144, 6144, 1),
    ("dense S=4 6144x6144 int4", 2, 0, 4, 6144, 6144, 1),
    ("o_proj S=1 16384->6144 int4", 2, 0, 1, 16384, 6144, 1),
    ("value proj 64 x [256x512] S=1 int4", 2, 0, 1, 512, 256, 64),
    ("dense S=1 6144x6144 gs=64", 4, 64, 1, 6144, 6144, 1),
    # Beside the brief's five: the same families at other row counts and group sizes.
    ("o_proj S=4 16384->6144 int4", 2, 0, 4, 16384, 6144, 1),
    ("value proj 64 x [256x512] S=4 int4", 2, 0, 4, 512, 256, 64),
    ("dense S=4 6144x6144 gs=64", 4, 64, 4, 6144, 6144, 1),
    ("dense S=1 6144x6144 gs=128", 4, 128, 1, 6144, 6144, 1),
    # 8 rows (MLA of 8 sequences): SB = 8 split-K tiles; "off" is gemv_pf there.
    ("o_proj S=8 16384->6144 int4", 2, 0, 8, 16384, 6144, 1),
    ("value proj 64 x [256x512] S=8 int4", 2, 0, 8, 512, 256, 64),
    ("dense S=8 6144x6144 gs=64", 4, 64, 8, 6144, 6144, 1),
    # o_proj of 16 and 32 sequences: gemv_pf, its K split over clusters (gemv_pf_sk).
    ("o_proj S=16 16384->6144 int4", 2, 0, 16, 16384, 6144, 1),
    ("o_proj S=32 16384->6144 int4", 2, 0, 32, 16384, 6144, 1),
    ("value proj 64 x [256x512] S=32 int4", 2, 0, 32, 512, 256, 64),
]
# gemv_pf's forms (KS, C) timed on every shape of more than 4 rows (PF_SK_FORCE; (4, 1) is
# gemv_pf's k slices, C > 1 gemv_pf_sk)
PF_FORMS = ((4, 1), (1, 1), (1, 2), (1, 4), (1, 8), (4, 2), (4, 4))


def job_dtype() -> np.dtype:
    """The dtype of ``struct GemvJob`` (kernels/records.py)."""
    from coliworker.kernels.records import GEMV_JOB

    return GEMV_JOB.dtype


class Case:
    """One shape: nsets device weight sets (set 0 from a host tensor, the reference's), one
    job table per set, the activations and outputs."""

    def __init__(self, rng, fmt, gs, s, i, o, n_jobs):
        import cupy

        from coliworker.kernels import layout, matmul

        self.fmt, self.n_jobs, self.s, self.o = fmt, n_jobs, s, o
        self.t = gpu_timing.make_tensor(rng, fmt, o * n_jobs, i, gs)
        self.spec = matmul.WeightSpec.of(fmt, i, gs)
        lay = self.spec.layout
        ngp = max(lay.ngp, 1) if fmt == 4 else 1
        w0 = layout.relayout(cupy, self.t, cupy.asarray(self.t.weights))
        s0 = layout.scales(cupy, self.t, cupy.asarray(self.t.scales))
        self.bytes = int(w0.nbytes + s0.nbytes)
        nsets = max(2, int(np.ceil(3 * gpu_timing.L2 / self.bytes)))
        self.w = [w0] + [
            cupy.random.randint(0, 256, w0.size, dtype=cupy.uint8) for _ in range(nsets - 1)
        ]
        self.sc = [s0] + [
            (cupy.random.random(s0.size, dtype=cupy.float32) * 0.02 + 0.001)
            for _ in range(nsets - 1)
        ]
        self.xh = [rng.standard_normal((s, i)).astype(np.float32) for _ in range(n_jobs)]
        self.x = cupy.asarray(np.stack(self.xh))  # [n_jobs, s, i]
        self.y = cupy.zeros((n_jobs, s, o), cupy.float32)
        self.tables = []
        for w, sc in zip(self.w, self.sc, strict=True):
            host = np.zeros(n_jobs, job_dtype())
            for j in range(n_jobs):
                host[j]["w0"] = w.data.ptr + j * o * lay.ld
                host[j]["s0"] = sc.data.ptr + 4 * j * o * ngp
                host[j]["x"] = self.x.data.ptr + 4 * j * s * i
                host[j]["y"] = self.y.data.ptr + 4 * j * s * o
                host[j]["rows"], host[j]["out_rows"] = s, o
                host[j]["x_stride"], host[j]["y_stride"] = i, o
            self.tables.append(cupy.asarray(host.view(np.uint8)))

    def reference(self) -> np.ndarray:
        """float64 [n_jobs, s, o] of set 0."""
        from coliworker.kernels import reference

        if self.n_jobs == 1:
            return reference.matmul(self.t, self.xh[0])[None].astype(np.float64)
        w = reference.dequantize(self.t)
        return np.stack(
            [
                self.xh[j].astype(np.float64) @ w[j * self.o : (j + 1) * self.o].T
                for j in range(self.n_jobs)
            ]
        )

    def launch(self, split: bool, force: int | None, stream: bool | str | tuple = False):
        """stream: True for gemv_st as set, "q8" for its integer path (ST_Q8), or (math
        warps, blocks per SM[, q8]) for it; ("pf", KS, C): gemv_pf's form (KS, C), whatever
        the rows."""
        from coliworker.kernels import gemv_stream, matmul, prefill_tc

        if isinstance(stream, tuple) and stream[0] == "pf":
            saved_pf = prefill_tc.PF_SK_FORCE
            prefill_tc.PF_SK_FORCE = stream[1:]
            try:
                n_sm = matmul._sm_count(0)
                return prefill_tc._gemv_pf(self.spec, self.n_jobs, self.s, self.o, n_sm)
            finally:
                prefill_tc.PF_SK_FORCE = saved_pf
        names = ((matmul, "SPLIT_K"), (matmul, "SPLIT_K_FORCE"), (gemv_stream, "STREAM"),
                 (gemv_stream, "ST_WARPS"), (gemv_stream, "ST_BLOCKS"),
                 (gemv_stream, "ST_Q8"))  # fmt: skip
        saved = [getattr(m, n) for m, n in names]
        form = (gemv_stream.ST_WARPS, gemv_stream.ST_BLOCKS, stream == "q8")
        if isinstance(stream, tuple):
            form = (*stream, False)[:3]
        for (m, n), v in zip(names, (split, force, bool(stream), *form), strict=True):
            setattr(m, n, v)
        try:
            return matmul.gemv_launch(self.spec, self.n_jobs, self.s, self.o)
        finally:
            for (m, n), v in zip(names, saved, strict=True):
                setattr(m, n, v)

    def call(self, ln, k: int) -> None:
        """Launch ``ln`` on weight set ``k`` (modulo the sets)."""
        ln(np.uint64(self.tables[k % len(self.tables)].data.ptr))

    def run_once(self, ln, k: int = 0) -> np.ndarray:
        import cupy

        self.y.fill(np.nan)
        ln(np.uint64(self.tables[k].data.ptr))
        cupy.cuda.get_current_stream().synchronize()
        return self.y.get()


def bench_case(rng, spin, spec: tuple, iters: int, warmup: int, sweep: bool) -> dict:
    from coliworker.kernels import matmul

    name, fmt, gs, s, i, o, n_jobs = spec
    case = Case(rng, fmt, gs, s, i, o, n_jobs)
    ref = case.reference()
    ntiles = -(-o // (matmul.TC_RG * 16))
    paths = [("off", False, None, False), ("on", True, None, False)]
    if sweep:
        paths += [(f"C={c}", True, c, False) for c in matmul.SK_CLUSTERS]
    paths.append(("stream", True, None, True))
    # its integer path (gemv_stream.cuh's Q8; fmt 2 only, elsewhere as "stream")
    paths += [("q8", True, None, "q8"), ("q8w16", True, None, (16, 1, True))]
    # gemv_st's math warps and blocks per SM (gemv_stream.ST_WARPS, ST_BLOCKS) beside its defaults
    paths += [(f"st{w}b{b}", True, None, (w, b)) for w, b in ST_FORMS]
    if s > matmul.TC_MAX_ROWS:
        paths += [(f"pf{ks}c{c}", True, None, ("pf", ks, c)) for ks, c in PF_FORMS]
    out: dict = dict(
        name=name, fmt=fmt, gs=gs, rows=s, in_features=i, out_features=o, n_jobs=n_jobs,
        bytes=case.bytes, floor_us=case.bytes / gpu_timing.READ_BW * 1e6, sets=len(case.tables),
        paths={},
    )  # fmt: skip
    for pname, split, force, stream in paths:
        try:
            ln = case.launch(split, force, stream)
            y = case.run_once(ln)
            same = all(np.array_equal(case.run_once(ln), y) for _ in range(3))
            r = dict(
                rel_err=gpu_timing.rel_err(y, ref),
                bit_identical=bool(same),
                grid=list(ln.grid),
                smem=int(ln.smem),
                cluster=(ln.grid[0] // ntiles) if split else None,
            )
            if iters > 0:
                r.update(gpu_timing.time_launch(partial(case.call, ln), spin, iters, warmup))
            else:  # --profile: one more launch, for ncu
                case.run_once(ln)
                r.update(median_us=np.nan, min_us=np.nan, p90_us=np.nan)
        except Exception as exc:  # a launch that fails: the rest of the table still comes
            print(f"  {name:38s} {pname:5s} FAILED: {type(exc).__name__}: {exc}", flush=True)
            out["paths"][pname] = dict(error=f"{type(exc).__name__}: {exc}")
            continue
        out["paths"][pname] = r
        print(
            f"  {name:38s} {pname:5s} {r['median_us']:8.2f} us  (min {r['min_us']:.2f}, "
            f"grid {tuple(r['grid'])}, C {r['cluster']}) rel err {r['rel_err']:.1e}"
            f"{'' if same else '  NOT BIT-IDENTICAL'}",
            flush=True,
        )
    if iters > 0:  # the machine's limit at this size: a plain read of the same bytes
        reads = [[w, sc] for w, sc in zip(case.w, case.sc, strict=True)]
        r = gpu_timing.time_launch(gpu_timing.read_launcher(reads), spin, iters, warmup)
        out["read"] = r
        print(
            f"  {name:38s} read  {r['median_us']:8.2f} us  (plain read of the same bytes)",
            flush=True,
        )
    on = out["paths"]["on"].get("median_us", np.nan)
    off = out["paths"]["off"].get("median_us", np.nan)
    out["roofline_pct_on"] = out["floor_us"] / on * 100
    out["roofline_pct_off"] = out["floor_us"] / off * 100
    out["speedup"] = off / on
    return out


def render(meta: dict, rows: list[dict]) -> str:
    md = [
        f"# Split-K decode GEMV, {meta['gpu']}, {meta['date']}, commit {meta['commit']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Kernel time between CUDA events, median of {meta['iters']} launches after "
        f"{meta['warmup']} warm-up, each alone (a spin kernel ahead of its events), weight sets "
        "rotated past the L2. Floor: weight bytes read (row padding and scales included) at "
        f"{gpu_timing.READ_BW / 1e12:.2f} TB/s; read: a plain streaming-read kernel of the same "
        "bytes, timed alike (the machine's limit at this size). Error: max over rows of "
        "max|y - ref| / max|ref| against float64.",
        "",
        "| shape | MB | floor us | read us | off us | on us | C | speedup | % roofline off | "
        "% roofline on | stream us | % roofline stream | rel err off | rel err on | "
        "rel err stream | same bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["paths"]
        same = all(v["bit_identical"] for v in p.values() if "error" not in v)
        err = {k: f"{v['rel_err']:.1e}" if "rel_err" in v else "error" for k, v in p.items()}
        md.append(
            f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | "
            f"{gpu_timing.us(r['read']) if 'read' in r else '-'} | "
            f"{gpu_timing.us(p['off'])} | {gpu_timing.us(p['on'])} | "
            f"{p['on'].get('cluster', '-')} | "
            f"{r['speedup']:.2f}x | {r['roofline_pct_off']:.0f} | {r['roofline_pct_on']:.0f} | "
            f"{gpu_timing.us(p['stream'])} | "
            f"{r['floor_us'] / p['stream'].get('median_us', np.nan) * 100:.0f} | "
            f"{err['off']} | {err['on']} | {err['stream']} | {'yes' if same else 'NO'} |"
        )
    sweep = [k for k in rows[0]["paths"] if k.startswith("C=")] if rows else []
    if sweep:
        md += [
            "",
            "Each cluster size forced (median us; C=1 is gemv_tc_k, no cluster):",
            "",
            "| shape | " + " | ".join(sweep) + " | grid of the best |",
            "|---|" + "---|" * (len(sweep) + 1),
        ]
        for r in rows:
            p = r["paths"]
            ok = [k for k in sweep if "error" not in p[k]]
            best = min(ok, key=lambda k: p[k]["median_us"]) if ok else None
            md.append(
                f"| {r['name']} | "
                + " | ".join(gpu_timing.us(p[k]) for k in sweep)
                + (f" | {best}: {tuple(p[best]['grid'])} |" if best else " | - |")
            )
    forms = [k for k in rows[0]["paths"] if k[:2] in ("st", "q8") and k != "stream"] if rows else []
    if forms:
        md += [
            "",
            'gemv_st\'s forms, stWbB: W math warps, B blocks per SM (median us; "stream" is '
            'the default form; a form that does not serve a shape falls back as "on"):',
            "",
            "| shape | stream | " + " | ".join(forms) + " |",
            "|---|---|" + "---|" * len(forms),
        ]
        for r in rows:
            p = r["paths"]
            md.append(
                f"| {r['name']} | {gpu_timing.us(p['stream'])} | "
                + " | ".join(gpu_timing.us(p[k]) for k in forms)
                + " |"
            )
    pf = sorted({k for r in rows for k in r["paths"] if k.startswith("pf")})
    if pf:
        md += [
            "",
            "gemv_pf's forms on the shapes of more than 4 rows, pfKcC: KS = K (4: k slices "
            "meeting in shared memory), C = cluster size (gemv_pf_sk past 1); median us:",
            "",
            "| shape | on | " + " | ".join(pf) + " | rel err (C = 8) |",
            "|---|---|" + "---|" * (len(pf) + 1),
        ]
        for r in rows:
            p = r["paths"]
            if not any(k in p for k in pf):
                continue
            e = p.get("pf1c8", {})
            err = f"{e['rel_err']:.1e}" if "rel_err" in e else "-"
            md.append(
                f"| {r['name']} | {gpu_timing.us(p['on'])} | "
                + " | ".join(gpu_timing.us(p[k]) if k in p else "-" for k in pf)
                + f" | {err} |"
            )
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown")
    ap.add_argument("--iters", type=int, default=100, help="timed launches per path (>= 50)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--no-sweep", action="store_true", help="only off and on, no forced C")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--profile", action="store_true", help="2 launches per path, no timing")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=OLD=>NEW[;...]",
                    help="also build and time every shape with gemv_tc.cu's text OLD replaced "
                    "by NEW, labelled LABEL (bench/variants.py); repeatable")  # fmt: skip
    a = ap.parse_args()
    if a.profile:
        a.iters = 0
    elif a.iters < 50:
        print("note: fewer than 50 timed launches per path", file=sys.stderr)

    import cupy

    spin = gpu_timing.spin_kernel()
    rng = np.random.default_rng(a.seed)
    only = [x.strip() for x in a.only.split(",") if x.strip()]
    shapes = [sh for sh in SHAPES if not only or any(o in sh[0] for o in only)]
    env = " ".join(f"{k}={os.environ[k]}" for k in ("COLIWORKER_COMMIT",) if k in os.environ)
    meta = dict(
        gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        sms=int(cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]),
        date=datetime.date.today().isoformat(),
        commit=harness.commit(),
        host=platform.node(),
        command=(env + " " if env else "")
        + f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} python "
        + " ".join(sys.argv),
        read_bw_TBps=gpu_timing.READ_BW / 1e12,
        iters=a.iters,
        warmup=a.warmup,
        cupy=cupy.__version__,
    )
    print(f"{meta['gpu']}, {meta['sms']} SMs, commit {meta['commit']}", flush=True)
    rows = []
    for label, subs in [("", [])] + [variants.parse(v) for v in a.variant]:
        if label:
            variants.build_with(subs, "gemv_tc.cu")
        for sh in shapes:
            row = bench_case(rng, spin, sh, a.iters, a.warmup, not a.no_sweep)
            if label:
                row["name"] += f" {label}"
                row["variant"] = [f"{o} => {n}" for o, n in subs]
            rows.append(row)
            cupy.get_default_memory_pool().free_all_blocks()
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"gemv-splitk-{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = render(meta, rows)
    stem.with_suffix(".md").write_text(md)
    print(md)
    bad = [r["name"] for r in rows for p in r["paths"].values()
           if "error" in p or p["rel_err"] >= 1e-5 or not p["bit_identical"]]  # fmt: skip
    if bad:
        print(f"FAILED (error >= 1e-5 or bits differ): {sorted(set(bad))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
