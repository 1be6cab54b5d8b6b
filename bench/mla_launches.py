"""Where the kernel phase of a ragged MLA call goes: GPU time of each launch (absorb, flash or
attend, merge, value projection, o_proj) from CUDA events around it, GLM-5.2 widths, and the
flash + merge time against the number of T slices.

Each measured call waits behind a short spin kernel on its stream, so every launch is queued
before the GPU reaches it and the events time the GPU work alone (no host launch gaps). The
plain decode step as ``bench/kernels.py`` makes it (call wall, kernel phase) is printed too.

    PYTHONPATH=.dev:. python bench/mla_launches.py [--calls 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import cupy
import numpy as np

from bench.kernels import GLM, make_tensor
from coliworker.kernels import attention as att
from coliworker.kernels import graphs
from coliworker.kernels import reference as ref
from coliworker.server.backends import create_backend

SPIN = cupy.RawKernel(
    r"""
extern "C" __global__ void coli_spin(long long ns) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""",
    "coli_spin",
)
CONFIGS = [(1, 4096), (8, 4096), (32, 2048)]
SPLITS = {1: (32, 64, 128, 132), 8: (8, 16, 32), 32: (2, 4, 8)}
CLUSTERS = (1, 2, 4, 8)
# In-process variants, where this tree's attention module has the switches: (label, settings).
VARIANTS = (
    ("new kernels", dict(ABSORB_W=True, FL_CLUSTER=None, FL_F16=False, MERGE_ZG=True, FL_KP=2)),
    (
        "new kernels, 16 flash warps",
        dict(ABSORB_W=True, FL_CLUSTER=None, FL_F16=False, MERGE_ZG=True, FL_KP=4),
    ),
    ("old kernels", dict(ABSORB_W=False, FL_CLUSTER=1, FL_F16=False)),
    (
        "fp16 flash",
        dict(ABSORB_W=True, FL_CLUSTER=None, FL_F16=True, QSPLIT_FUSED=True, MERGE_ZG=True),
    ),
    (
        "fp16 flash, mla_qsplit",
        dict(ABSORB_W=True, FL_CLUSTER=None, FL_F16=True, QSPLIT_FUSED=False, MERGE_ZG=True),
    ),
    (
        "fp16 flash, merge ZG 1",
        dict(ABSORB_W=True, FL_CLUSTER=None, FL_F16=True, QSPLIT_FUSED=True, MERGE_ZG=False),
    ),
)


class Timed:
    """A prepared launch that records an event pair around itself on the current stream."""

    def __init__(self, name: str, launch, log: list) -> None:
        self.name, self.launch, self.log = name, launch, log

    def __call__(self, *args) -> None:
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        self.launch(*args)
        e1.record()
        self.log.append((self.name, e0, e1))


def forget_plans(backend) -> None:
    """Drop the plans (and graphs) of this thread's arenas: the next call builds its launches
    through the module's launch builders again."""
    for a in backend._arenas(0):
        a.plans.clear()
        a.graphs.clear()


def instrument(backend, log: list):
    """Wrap the launch builders the attention plan calls (graphs off: every launch is played
    directly, between its events); returns a function that undoes it."""
    gemv_name = "gemv_launch" if hasattr(att, "gemv_launch") else None
    saved = (att.absorb_launch, att.flash_launch, att.attend_launch,
             getattr(att, gemv_name) if gemv_name else None, graphs.ENABLED)  # fmt: skip
    absorb, flash, attend, gemv, _ = saved

    def pair(fn, name):
        def make(*a, **k):
            x, m = fn(*a, **k)
            return Timed(name, x, log), (None if m is None else Timed("merge", m, log))

        return make

    def gemv_make(spec, n, *a, **k):
        ln = gemv(spec, n, *a, **k)
        return None if ln is None else Timed("o_proj" if n == 1 else "value", ln, log)

    att.absorb_launch = lambda *a, **k: Timed("absorb", absorb(*a, **k), log)
    att.flash_launch = pair(flash, "flash")
    qsplit = getattr(att, "qsplit_launch", None)
    # mla_flash_h's q rows, split once (None without FL_F16; not asked for where the absorb
    # splits them, QSPLIT_FUSED: then no "qsplit" row, its time in "absorb")
    if qsplit is not None:
        att.qsplit_launch = lambda *a, **k: (
            None if (x := qsplit(*a, **k)) is None else Timed("qsplit", x, log)
        )
    att.attend_launch = pair(attend, "attend")
    if gemv_name:
        setattr(att, gemv_name, gemv_make)
    graphs.ENABLED = False
    forget_plans(backend)

    def restore() -> None:
        att.absorb_launch, att.flash_launch, att.attend_launch = saved[:3]
        if qsplit is not None:
            att.qsplit_launch = qsplit
        if gemv_name:
            setattr(att, gemv_name, saved[3])
        graphs.ENABLED = saved[4]
        forget_plans(backend)

    return restore


def settings(**kw) -> dict:
    """Set the attention module's switches that exist here; returns the previous values."""
    old = {}
    for k, v in kw.items():
        if hasattr(att, k):
            old[k] = getattr(att, k)
            setattr(att, k, v)
    return old


class Decode:
    """``seqs`` sequences of ``t - 1`` resident rows; ``step`` is one decode step as the worker
    makes it: room for each new row, then one call that carries the rows and attends."""

    def __init__(self, backend, rng, weights, placed, seqs: int, t: int, steps: int) -> None:
        g = GLM
        self.h, self.q, self.r, self.v, k = g["H"], g["Q"], g["R"], g["V"], g["K"]
        self.backend, self.weights, self.placed = backend, weights, placed
        total = t + steps + 8
        self.lat = [rng.standard_normal((total, k)).astype(np.float32) for _ in range(seqs)]
        self.rope = [rng.standard_normal((total, self.r)).astype(np.float32) for _ in range(seqs)]
        self.caches = [backend.new_kv(0, k, self.r) for _ in range(seqs)]
        for c, la, rp in zip(self.caches, self.lat, self.rope, strict=True):
            c.append(la[: t - 1], rp[: t - 1])
        self.qs = rng.standard_normal((seqs, self.h, self.q + self.r)).astype(np.float32)
        self.scale = 1 / np.sqrt(self.q + self.r)
        self.stream = backend._stream(0)

    def step(self, spin: bool = False):
        rows = []
        for c, la, rp in zip(self.caches, self.lat, self.rope, strict=True):
            c.reserve(1)
            rows.append((la[c.length : c.length + 1], rp[c.length : c.length + 1]))
        if spin:
            with self.stream:
                SPIN((1,), (1,), (np.int64(3_000_000),))
        return self.backend.attention_ragged(*self.placed, self.qs, self.caches, self.q, self.r,
                                             self.v, self.scale, rows=rows)  # fmt: skip

    def rel_err(self) -> float:
        out = self.step().out
        lats = [la[: c.length] for la, c in zip(self.lat, self.caches, strict=True)]
        ropes = [rp[: c.length] for rp, c in zip(self.rope, self.caches, strict=True)]
        want = ref.attention_ragged(*self.weights, self.qs, lats, ropes, self.q, self.r, self.v,
                                    self.scale)  # fmt: skip
        return float(np.abs(out - want).max() / np.abs(want).max())

    def release(self) -> None:
        for c in self.caches:
            c.release()


def breakdown(dec: Decode, log: list, calls: int) -> dict[str, float]:
    """Median GPU us per launch name over ``calls`` queued decode steps."""
    per: dict[str, list[float]] = {}
    kp = []
    for _ in range(calls):
        log.clear()
        res = dec.step(spin=True)
        kp.append(res.phases.kernel_ns / 1e3)
        for name, e0, e1 in log:
            per.setdefault(name, []).append(1e3 * cupy.cuda.get_elapsed_time(e0, e1))
    d = {n: float(np.median(x)) for n, x in per.items()}
    d["sum"] = sum(v for n, v in d.items())
    d["phase"] = float(np.median(kp))
    return d


def max_clusters() -> dict[int, int | str]:
    """cuOccupancyMaxActiveClusters of mla_flash_c<NTC, C, FL_KP> at GLM-5.2 widths: clusters
    of C one-block-per-SM blocks resident at once (S=1 needs 128 / C of them in one wave)."""
    out: dict[int, int | str] = {}
    if not hasattr(att, "FL_CLUSTERS"):
        return out
    for c in att.FL_CLUSTERS.get(512, ()):
        try:
            out[c] = att._max_clusters(GLM["K"], GLM["R"], c)
        except Exception as exc:  # noqa: BLE001 - a report, not a check
            out[c] = f"n/a ({exc})"
    return out


def fm(d: dict) -> float:
    """flash (or attend) + merge us of a breakdown."""
    return d.get("flash", d.get("attend", 0.0)) + d.get("merge", 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seqs", default="1,8,32", help="configs by sequence count (1, 8, 32)")
    ap.add_argument("--profile", action="store_true", help="ncu: check, --calls steps, no graphs")
    args = ap.parse_args()
    backend = create_backend("cupy", devices=(0,))
    rng = np.random.default_rng(1)
    g = GLM
    kv_b = make_tensor(rng, 2, g["K"], g["H"] * (g["Q"] + g["V"]))
    o_proj = make_tensor(rng, 2, g["H"] * g["V"], g["D"])
    weights = (kv_b, o_proj)
    placed = (backend.place(kv_b, 0), backend.place(o_proj, 0))
    plain_splits = att.flash_splits
    results, lines = [], []
    log: list = []
    want = {int(x) for x in args.seqs.split(",")}
    for seqs, t in CONFIGS:
        if seqs not in want:
            continue
        n_bd = 2 + len(VARIANTS) + len(CLUSTERS) + len(SPLITS[seqs])
        dec = Decode(backend, rng, weights, placed, seqs, t, args.calls * (n_bd + 2) + 16)
        if args.profile:
            graphs.ENABLED = False
            err = dec.rel_err()
            for _ in range(args.calls):
                dec.step()
            for _, kw in VARIANTS:
                old = settings(**kw)
                if old:
                    for _ in range(args.calls):
                        dec.step()
                    settings(**old)
            cupy.cuda.runtime.deviceSynchronize()
            lines.append(f"S={seqs} T={t} profiled, err {err:.1e}")
            dec.release()
            continue
        err = dec.rel_err()
        walls, kerns, h2d, d2h = [], [], [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            res = dec.step()
            walls.append(time.perf_counter() - t0)
            kerns.append(res.phases.kernel_ns / 1e3)
            h2d.append(res.phases.h2d_ns / 1e3)
            d2h.append(res.phases.d2h_ns / 1e3)
        restore = instrument(backend, log)
        launches = breakdown(dec, log, args.calls)
        variants, variant_err = {}, {}
        for label, kw in VARIANTS:
            old = settings(**kw)
            if old:
                forget_plans(backend)
                variant_err[label] = dec.rel_err()
                variants[label] = breakdown(dec, log, args.calls)
                settings(**old)
        by_cluster = {}
        if hasattr(att, "FL_CLUSTER"):
            for c in CLUSTERS:
                old = settings(FL_CLUSTER=c)
                forget_plans(backend)
                by_cluster[c] = fm(breakdown(dec, log, args.calls))
                settings(**old)
        sweep = {}
        old = settings(FL_CLUSTER=None)  # the sweep with clusters where this tree has them
        for ns in SPLITS[seqs]:
            att.flash_splits = lambda *a, _n=ns: _n
            forget_plans(backend)
            sweep[ns] = fm(breakdown(dec, log, args.calls))
        att.flash_splits = plain_splits
        settings(**old)
        restore()
        dec.release()
        row = dict(seqs=seqs, t=t, rel_err=err, call_us=1e6 * float(np.median(walls)),
                   kernel_us=float(np.median(kerns)), h2d_us=float(np.median(h2d)),
                   d2h_us=float(np.median(d2h)), launch_us=launches,
                   nsplit=plain_splits(seqs, g["H"], t, backend._sms[0], g["K"], g["R"]),
                   variants_us=variants, variants_rel_err=variant_err,
                   flash_merge_us_by_cluster=by_cluster,
                   flash_merge_us_by_nsplit=sweep)  # fmt: skip
        results.append(row)
        lines.append(
            f"S={seqs:<3} T={t:<5} call {row['call_us']:6.1f} kernel {row['kernel_us']:6.1f} us"
            f" h2d {row['h2d_us']:.1f} d2h {row['d2h_us']:.1f} err {err:.1e} | "
            + " ".join(f"{n} {x:.1f}" for n, x in launches.items())
            + "".join(
                f" | {lb} (err {variant_err[lb]:.1e}): "
                + " ".join(f"{n} {x:.1f}" for n, x in d.items())
                for lb, d in variants.items()
            )
            + f" | nsplit {row['nsplit']}; flash+merge by C: "
            + " ".join(f"{n}:{x:.1f}" for n, x in by_cluster.items())
            + "; by nsplit: "
            + " ".join(f"{n}:{x:.1f}" for n, x in sweep.items())
        )
    if not args.profile:
        occ = max_clusters()
        lines.append(f"max active clusters of mla_flash_c<NTC, C, {att.FL_KP}>: " + str(occ))
        results.append(dict(max_active_clusters=occ))
    if args.out is not None and not args.profile:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mla_launches.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
