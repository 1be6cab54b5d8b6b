"""Decode expert group on tensor cores (issue #14): moe_tc against moe_tc_f (matmul.MOE_TC_FAST).

For each shape (GLM-5.2's group: 8 experts, D = 6144, I = 2048; gate+up [2048 x 6144] and
down [6144 x 2048] each) it builds the job table itself (int32 counters, then the MoeJob
records, as kernels/expert_group.py writes them), rotates among enough weight sets that the
60 MB L2 never holds the next one, and times ``moe_launch``'s launch with CUDA events, median
of ``--iters`` (>= 50) launches after ``--warmup``, each kernel alone between its two events:
the counters are reset by a device copy of the pristine table and a spin kernel runs before
the first event, so neither the copy nor the host's launch time is counted. Every path is
checked against float64 (max over rows of max|y - ref| / max|ref|), for the same bits on
repeated calls, and moe_tc_f for the same bits as moe_tc.

    scripts/devlink && PYTHONPATH=.dev:. python bench/moe_tc.py --out $OUT

``--variant LABEL=OLD=>NEW[;OLD=>NEW]`` (repeatable) also times every shape with kernels built
from gemv_tc.cu's text so patched (``bench/variants.py``): a knob such as TC_PFD, the blocks
per SM (OCC) tried without editing the tree; its rows carry LABEL.

Writes ``moe-tc-<date>.json`` and ``.md`` into ``--out``: GPU, date, commit
(COLIWORKER_COMMIT, else git), the command, per shape the bytes read (row padding and scales
included), the floor at 4.48 TB/s, old and new times, % of roofline, errors, grid and
registers of each kernel.

Counters before / after (device machine): ``--profile`` launches each path twice (a checked
call, then one more) with no timing loop; ncu's default cache control flushes the caches
before each launch, so both read the weights from HBM. ``-k regex:moe_tc`` takes moe_tc and
moe_tc_f (never the spin kernel or the table copy):

    M=dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
    M=$M,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
    ncu --clock-control none -k regex:moe_tc --metrics $M \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        -o $OUT/moe-tc python bench/moe_tc.py --profile --out $OUT/ncu-run
    ncu --import $OUT/moe-tc.ncu-rep --page raw --csv > $OUT/moe-tc-ncu.csv
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

# (name, fmt, group size, rows per expert, D, I, experts, target us from issue #14)
SHAPES = [
    ("decode 8x1 int4", 2, 0, 1, 6144, 2048, 8, 45.0),
    ("decode 8x1 gs=64", 4, 64, 1, 6144, 2048, 8, 50.0),
    ("decode 8x4 int4", 2, 0, 4, 6144, 2048, 8, 55.0),
    ("decode 8x1 gs=128", 4, 128, 1, 6144, 2048, 8, None),
]


class Case:
    """One shape: nsets device weight sets (set 0 from host tensors, the reference's), a
    pristine job table per set, the activations, hidden and outputs."""

    def __init__(self, rng, fmt, gs, r, d, ie, n):
        import cupy

        from coliworker.kernels import layout, matmul
        from coliworker.kernels.group_tables import counter_bytes
        from coliworker.kernels.records import MOE_JOB

        self.n, self.r, self.d, self.ie = n, r, d, ie
        self.rows = [r] * n
        self.host = [
            tuple(gpu_timing.make_tensor(rng, fmt, *sh, gs) for sh in ((ie, d), (ie, d), (d, ie)))
            for _ in range(n)
        ]
        self.gu = matmul.WeightSpec.of(fmt, d, gs)
        self.dn = matmul.WeightSpec.of(fmt, ie, gs)
        set0 = [
            [
                (layout.relayout(cupy, t, cupy.asarray(t.weights)),
                 layout.scales(cupy, t, cupy.asarray(t.scales)))
                for t in e
            ]
            for e in self.host
        ]  # fmt: skip
        self.bytes = int(sum(w.nbytes + s.nbytes for e in set0 for w, s in e))
        nsets = max(2, int(np.ceil(3 * gpu_timing.L2 / self.bytes)))
        sets = [set0]
        for _ in range(nsets - 1):
            sets.append(
                [
                    [
                        (cupy.random.randint(0, 256, w.size, dtype=cupy.uint8),
                         cupy.random.random(s.size, dtype=cupy.float32) * 0.02 + 0.001)
                        for w, s in e
                    ]
                    for e in set0
                ]
            )  # fmt: skip
        self.sets = sets
        total = r * n
        self.xh = rng.standard_normal((total, d)).astype(np.float32)
        self.x = cupy.asarray(self.xh)
        self.h = cupy.zeros(total * ie, cupy.float32)
        self.y = cupy.zeros((total, d), cupy.float32)
        self.cb = counter_bytes(n)
        self.pristine = []
        for st in sets:
            buf = np.zeros(self.cb + MOE_JOB.size * n, np.uint8)
            for c, ((wg, sg), (wu, su), (wd, sd)) in enumerate(st):
                MOE_JOB.pack_into(buf, self.cb + c * MOE_JOB.size, wg.data.ptr, sg.data.ptr,
                                  wu.data.ptr, su.data.ptr, wd.data.ptr, sd.data.ptr,
                                  self.x.data.ptr + 4 * c * r * d,
                                  self.h.data.ptr + 4 * c * r * ie,
                                  self.y.data.ptr + 4 * c * r * d, r, ie, d, 0)  # fmt: skip
            self.pristine.append(cupy.asarray(buf))
        self.table = cupy.empty_like(self.pristine[0])

    def reference(self) -> np.ndarray:
        from coliworker.kernels import reference

        return reference.expert_group(self.host, self.rows, self.xh).astype(np.float64)

    def launch(self, fast: bool, wq: tuple | None = None):
        """moe_tc_f (fast) or moe_tc; with ``wq`` = (S, D), moe_wq<S, D> where it serves."""
        from coliworker.kernels import matmul

        saved = matmul.MOE_TC_FAST, matmul.MOE_WQ, matmul.WQ_SD
        matmul.MOE_TC_FAST = fast
        matmul.MOE_WQ = wq is not None
        matmul.WQ_SD = wq or saved[2]
        try:
            n_sm = matmul._sm_count(0)
            return matmul.moe_launch(self.gu, self.dn, self.n, self.r, self.ie, self.d, n_sm)
        finally:
            matmul.MOE_TC_FAST, matmul.MOE_WQ, matmul.WQ_SD = saved

    def reset(self, k: int) -> None:
        p = self.pristine[k % len(self.pristine)]
        self.table.data.copy_from_device_async(p.data, p.nbytes)

    def call(self, ln, _k: int = 0) -> None:
        """Launch ``ln`` on the job table (``reset`` put set k's pristine copy there)."""
        ln(np.uint64(self.table.data.ptr + self.cb), np.uint64(self.table.data.ptr))

    def run_once(self, ln) -> np.ndarray:
        import cupy

        self.y.fill(np.nan)
        self.reset(0)
        self.call(ln)
        cupy.cuda.get_current_stream().synchronize()
        return self.y.get()


def _phase_launch(ln, which: str):
    """moe_tc_f's launch with only its gate+up tiles ("a": no down tiles) or only its down
    tiles ("b": no gate+up tiles, so no down tile waits; they read whatever the hidden buffer
    holds): each phase's time alone, outputs not checked."""
    from coliworker.kernels.launch import Launch

    tail = list(ln.tail)  # (n_jobs, gate+up tiles per row, down tiles per row, nz, ...)
    tail[2 if which == "a" else 1] = np.int32(0)
    return Launch(ln.fn, ln.grid, ln.block, tuple(tail), ln.smem)


def _time_phases(case, spin, iters: int, warmup: int) -> dict:
    """moe_tc_f's gate+up tiles alone and down tiles alone, and a plain streaming read of all
    the group's bytes, of gate and up's, and of down's (each set rotated as the kernels)."""
    ln = case.launch(True)
    out = {}
    for which in ("a", "b"):
        go = _phase_launch(ln, which)
        out[f"new {which}"] = gpu_timing.time_launch(partial(case.call, go), spin, iters,
                                                     warmup, before=case.reset)  # fmt: skip
    for label, mats in (("read", (0, 1, 2)), ("read a", (0, 1)), ("read b", (2,))):
        bufs = [[a for e in st for m in mats for a in e[m]] for st in case.sets]
        out[label] = gpu_timing.time_launch(gpu_timing.read_launcher(bufs), spin, iters, warmup)
    return out


def bench_case(rng, spin, spec: tuple, iters: int, warmup: int, phases: bool = False,
               wq: tuple = ()) -> dict:  # fmt: skip
    name, fmt, gs, r, d, ie, n, target = spec
    case = Case(rng, fmt, gs, r, d, ie, n)
    ref = case.reference()
    out: dict = dict(
        name=name, fmt=fmt, gs=gs, rows=r, d=d, ie=ie, experts=n, bytes=case.bytes,
        floor_us=case.bytes / gpu_timing.READ_BW * 1e6, target_us=target, sets=len(case.sets),
        paths={},
    )  # fmt: skip
    ys = {}
    from coliworker.kernels import matmul

    forms = [("old", False, None), ("new", True, None)]
    if matmul.wq_eligible(case.gu, case.dn, r):
        forms += [(f"wq{s}x{d}", True, (s, d)) for s, d in wq]
    for pname, fast, sd in forms:
        try:
            ln = case.launch(fast, sd)
            y = case.run_once(ln)
            same = all(np.array_equal(case.run_once(ln), y) for _ in range(3))
            ys[pname] = y
            p = dict(
                rel_err=gpu_timing.rel_err(y, ref),
                bit_identical=bool(same),
                grid=list(ln.grid),
                smem=int(ln.smem),
                regs=int(ln.fn.num_regs),
                local_bytes=int(ln.fn.local_size_bytes),
            )
            if iters > 0:
                launch = partial(case.call, ln)
                p.update(gpu_timing.time_launch(launch, spin, iters, warmup, before=case.reset))
            else:  # --profile: one more launch, for ncu
                case.run_once(ln)
                p.update(median_us=np.nan, min_us=np.nan, p90_us=np.nan)
        except Exception as exc:  # a launch that fails: the rest of the table still comes
            print(f"  {name:20s} {pname:4s} FAILED: {type(exc).__name__}: {exc}", flush=True)
            out["paths"][pname] = dict(error=f"{type(exc).__name__}: {exc}")
            continue
        out["paths"][pname] = p
        print(
            f"  {name:20s} {pname:4s} {p['median_us']:8.2f} us (min {p['min_us']:.2f}, "
            f"grid {p['grid'][0]}, {p['regs']} regs, {p['local_bytes']} B local) "
            f"rel err {p['rel_err']:.1e}{'' if same else '  NOT BIT-IDENTICAL'}",
            flush=True,
        )
    if phases and iters > 0 and "error" not in out["paths"].get("new", {"error": 1}):
        out["phases"] = _time_phases(case, spin, iters, warmup)
        print(
            f"  {name:20s} phases "
            + ", ".join(f"{k} {v['median_us']:.2f}" for k, v in out["phases"].items()),
            flush=True,
        )
    out["new_equals_old"] = (
        bool(np.array_equal(ys["new"].view(np.uint32), ys["old"].view(np.uint32)))
        if "new" in ys and "old" in ys  # (moe_wq's forms, where timed, are in ys too)
        else False
    )
    old = out["paths"]["old"].get("median_us", np.nan)
    new = out["paths"]["new"].get("median_us", np.nan)
    out["roofline_pct_old"] = out["floor_us"] / old * 100
    out["roofline_pct_new"] = out["floor_us"] / new * 100
    out["speedup"] = old / new
    return out


def render(meta: dict, rows: list[dict]) -> str:
    md = [
        f"# Decode expert group moe_tc vs moe_tc_f, {meta['gpu']}, {meta['date']}, "
        f"commit {meta['commit']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Kernel time between CUDA events, median of {meta['iters']} launches after "
        f"{meta['warmup']} warm-up, each alone (counter reset and a spin kernel ahead of its "
        "events), weight sets rotated past the L2. Floor: weight bytes read (row padding and "
        f"scales included) at {gpu_timing.READ_BW / 1e12:.2f} TB/s. Error: max over rows of "
        "max|y - ref| / max|ref| against float64. new = old: moe_tc_f's outputs the same "
        "bits as moe_tc's.",
        "",
        "| shape | MB | floor us | target us | old us | new us | speedup | % roofline old | "
        "% roofline new | rel err old | rel err new | grid old / new | regs old / new | "
        "same bits | new = old |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["paths"]
        ok = [v for v in p.values() if "error" not in v]
        same = len(ok) == len(p) and all(v["bit_identical"] for v in ok)
        err = {k: f"{v['rel_err']:.1e}" if "rel_err" in v else "error" for k, v in p.items()}
        grid = " / ".join(str(p[k].get("grid", ["-"])[0]) for k in ("old", "new"))
        regs = " / ".join(str(p[k].get("regs", "-")) for k in ("old", "new"))
        tgt = "-" if r["target_us"] is None else f"{r['target_us']:.0f}"
        md.append(
            f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {tgt} | "
            f"{gpu_timing.us(p['old'])} | {gpu_timing.us(p['new'])} | {r['speedup']:.2f}x | "
            f"{r['roofline_pct_old']:.0f} | {r['roofline_pct_new']:.0f} | {err['old']} | "
            f"{err['new']} | {grid} | {regs} | {'yes' if same else 'NO'} | "
            f"{'yes' if r['new_equals_old'] else 'NO'} |"
        )
    wq = [(r, k) for r in rows for k in r["paths"] if k.startswith("wq")]
    if wq:
        md += [
            "",
            "moe_wq<S, D> (matmul.MOE_WQ) beside moe_tc_f (new) on the shapes it serves:",
            "",
            "| shape | form | us | new / it | % roofline | rel err | grid | regs | same bits |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r, k in wq:
            v, n = r["paths"][k], r["paths"]["new"]
            if "error" in v:
                md.append(f"| {r['name']} | {k} | error | | | | | | |")
                continue
            md.append(
                f"| {r['name']} | {k} | {gpu_timing.us(v)} | "
                f"{n.get('median_us', np.nan) / v['median_us']:.2f}x | "
                f"{r['floor_us'] / v['median_us'] * 100:.0f} | {v['rel_err']:.1e} | "
                f"{v['grid'][0]} | {v['regs']} | {'yes' if v['bit_identical'] else 'NO'} |"
            )
    ph = [r for r in rows if "phases" in r]
    if ph:
        md += [
            "",
            "moe_tc_f by phase (median us): its gate+up tiles alone (a), its down tiles alone "
            "(b), beside a plain streaming read of the same bytes:",
            "",
            "| shape | whole | a | b | read all | read a | read b |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in ph:
            q = r["phases"]
            md.append(
                f"| {r['name']} | {gpu_timing.us(r['paths']['new'])} | "
                + " | ".join(
                    gpu_timing.us(q[k]) for k in ("new a", "new b", "read", "read a", "read b")
                )  # fmt: skip
                + " |"
            )
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown")
    ap.add_argument("--iters", type=int, default=100, help="timed launches per path (>= 50)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--profile", action="store_true", help="2 launches per path, no timing")
    ap.add_argument("--phases", action="store_true",
                    help="also time moe_tc_f's gate+up tiles alone and its down tiles alone, "
                    "beside plain reads of the same bytes")  # fmt: skip
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=OLD=>NEW[;...]",
                    help="also build and time every shape with gemv_tc.cu's text OLD replaced "
                    "by NEW, labelled LABEL (bench/variants.py): a knob of moe_tc_f "
                    "(TC_PFD, OCC) tried without editing the tree; repeatable")  # fmt: skip
    ap.add_argument(
        "--wq",
        default="",
        metavar="S,D[;S,D...]",
        help="also time moe_wq<S, D> (matmul.WQ_FORMS) on the shapes it serves",
    )
    a = ap.parse_args()
    wq = tuple(tuple(int(v) for v in f.split(",")) for f in a.wq.split(";") if f.strip())
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
    props = cupy.cuda.runtime.getDeviceProperties(0)
    meta = dict(
        gpu=props["name"].decode(),
        sms=int(props["multiProcessorCount"]),
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
            row = bench_case(rng, spin, sh, a.iters, a.warmup, a.phases, wq)
            if label:
                row["name"] += f" {label}"
                row["variant"] = [f"{o} => {n}" for o, n in subs]
            rows.append(row)
            cupy.get_default_memory_pool().free_all_blocks()
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"moe-tc-{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = render(meta, rows)
    stem.with_suffix(".md").write_text(md)
    print(md)
    bad = [r["name"] for r in rows if not r["new_equals_old"]] + [
        r["name"]
        for r in rows
        for p in r["paths"].values()
        if "error" in p or p["rel_err"] >= 1e-5 or not p["bit_identical"]
    ]
    if bad:
        print(f"FAILED (error >= 1e-5, bits differ, or new != old): {sorted(set(bad))}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
