"""The matmul op's host side (``run``, and ``run_kept`` for a kept plan's call; reference
``reference.matmul``; tests ``tests/kernels/test_matmul.py``) and the launches of the GEMV
kernels every op uses (``gemv.cu``, ``gemv_tc.cu``, ``prefill_tc.cu``): a table of
``y = x @ W^T`` jobs in one launch (``gemv_launch``), and a whole expert group in one
persistent launch (``moe_launch``), each on the path its switches pick (``settings()``: all
of them, gemv_stream's and prefill_tc's included). gemv_st's host side (its switches,
geometry and launch) is ``kernels/gemv_stream.py``, gemv_pf's and moe_pf's
``kernels/prefill_tc.py``; matmul imports both.

gemv serves a matmul (one job), the value projection of MLA attention (one job per head) and
the unfused expert path; jobs of one launch share the weight spec (fmt, I, layout). moe runs
gate+up (silu*mul fused) and down of every expert of a group whose gate and up share one spec
and whose down matrices share one spec of the same format.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

from coliworker.kernels import gemv_stream as st
from coliworker.kernels import prefill_tc as pf
from coliworker.kernels._module import get_function
from coliworker.kernels.expert_group import PLANS_PER_ARENA
from coliworker.kernels.launch import Launch
from coliworker.kernels.launch import cached as _cached
from coliworker.kernels.layout import Layout
from coliworker.kernels.pinned import align, at
from coliworker.kernels.records import GEMV_JOB

WARPS = 8
SB_CHOICES = (1, 4, 8)  # activation rows per block: decode, a few rows, prefill
SMEM_BUDGET = 64 * 1024  # bytes of staged x per block; more K tiles beyond
MOE_RA = 2  # hidden rows per warp in moe's gate+up tiles (gemv.cu)


def moe_rb(fmt: int, sb: int) -> int:
    """Output rows per warp in moe's down tiles (``MoeRB`` in gemv.cu)."""
    return 8 if sb == 1 and fmt != 4 else 4


def _rows_per_warp(sb: int) -> int:
    return 2 if sb == 1 else 4


def _gemv_name(fmt: int, sb: int) -> str:
    return f"gemv<{fmt}, {_rows_per_warp(sb)}, {sb}>"


def _moe_name(fmt: int, sb: int) -> str:
    return f"moe<{fmt}, {sb}>"


VARIANTS = tuple(_gemv_name(f, sb) for f in range(5) for sb in SB_CHOICES) + tuple(
    _moe_name(f, sb) for f in range(5) for sb in SB_CHOICES
)

# ---- tensor-core decode path (gemv_tc.cu): int4 weights, up to TC_MAX_ROWS activation rows ----
#
# Taken for fmt 2, and fmt 4 with group sizes that are multiples of 16, whenever every job has
# at most TC_MAX_ROWS rows; every other case keeps gemv / moe. ``TENSOR_CORES`` switches it off
# (tests run both paths); launches are cached per setting.
TENSOR_CORES = True
TC_MAX_ROWS = 4
# Split-K gemv jobs (gemv_tc_k / gemv_tc_sk, SPLIT_K on) of at least SB8_MIN_K padded inputs
# take up to GEMV_TC_MAX_ROWS rows (SB = 8 past TC_MAX_ROWS: 24 columns, three n=8 tiles),
# where gemv_pf pads each job to prefill_tc.PF_SROWS rows. Measured on the H200 at 8 rows
# (bench/gemv_splitk.py): o_proj 16384 -> 6144 101 -> 72 us, dense 6144^2 gs=64 62 -> 59 us,
# but the value projection (64 jobs of K = 512) 14 -> 21 us: short jobs keep gemv_pf.
GEMV_TC_MAX_ROWS = 8
SB8_MIN_K = 4096
TC_RG = 2  # 16-row groups per block tile (gemv_tc.cu)
TC_STAGE_BUDGET = 48 * 1024  # bytes of staged bf16 activations per block; more K tiles beyond
# Split-K (gemv_tc_k / gemv_tc_sk in gemv_tc_splitk.cuh): a row tile is computed by a cluster of C
# blocks, each over 1/C of K, their sums meeting in distributed shared memory in a fixed order.
# ``SPLIT_K`` switches it off (gemv_tc as before; tests run both paths); ``SPLIT_K_FORCE``
# fixes C (tests and bench/gemv_splitk.py); launches are cached per setting.
SPLIT_K = True
SPLIT_K_FORCE: int | None = None
SK_CLUSTERS = (1, 2, 4, 8)  # C = 1: gemv_tc_k (no cluster); 2..8: gemv_tc_sk<FMT, SB, C>
SK_BLOCK_COST = 16  # a block's fixed cost (launch, staging, reductions) in 64-byte weight steps
# moe_tc_f (moe_tc_fast.cuh): moe_tc with its loads issued ahead (the next tile's ticket and first
# round, a tile's first batch before its wait and staging, an L2 window of TC_PFD rounds) and
# 3 blocks per SM at one row, fmt 4's scales staged in shared memory: the same tiles and
# summation order, the same bits as moe_tc.
# ``MOE_TC_FAST`` switches it off (moe_tc as before; tests compare both); launches are cached
# per setting, and the plans a backend keeps per arena are keyed by ``settings()``;
# COLIWORKER_MOE_TC_FAST=0 in the environment sets it off from the start.
MOE_TC_FAST = os.environ.get("COLIWORKER_MOE_TC_FAST", "1") != "0"
# moe_wq (moe_wq.cu): the decode expert group at 1-4 rows (fmt 2, fmt 4 with gs 32..256) with
# every warp its own queue client and cp.async ring (16 hidden rows of gate and up, or 32 of
# down, per item; no block barriers). Not moe_tc's bits (one accumulator over K instead of four
# k slices), within the same error of float64. ``WQ_SD`` = (S, D): 64-byte steps per stage
# (fmt 4: at most gs / 16), stages per ring. ``MOE_WQ`` (COLIWORKER_MOE_WQ): "auto" (the
# default) takes it only where it measured faster than moe_tc_f, grouped scales (fmt 4) at one
# row per expert, in the form ``WQ_AUTO_SD`` (GLM-5.2's 8x1 gs=64 group on an H100: 99.1
# against 129.8 us; at fmt 2 it is 0.85-0.88x, at 4 rows 0.33-0.67x:
# bench/results/moe-wq-2026-12-07-h100.md); True ("1") wherever it serves, in the form
# COLIWORKER_WQ_SD="S,D"; False ("0") never.
_WQ_ENV = os.environ.get("COLIWORKER_MOE_WQ", "auto")
MOE_WQ: bool | str = "auto" if _WQ_ENV == "auto" else _WQ_ENV == "1"
WQ_FORMS = ((2, 4), (2, 6), (4, 3), (4, 4))
WQ_SD = tuple(int(v) for v in os.environ.get("COLIWORKER_WQ_SD", "2,4").split(","))
WQ_AUTO_SD = (4, 3)


def settings() -> tuple:
    """The switches that pick launches (TENSOR_CORES, SPLIT_K, SPLIT_K_FORCE, MOE_TC_FAST;
    gemv_stream's STREAM, ST_WARPS, ST_BLOCKS, ST_Q8; prefill_tc's PF_SPLIT_K, PF_SK_FORCE):
    part of every cached plan's key, so a plan made under other settings is not reused."""
    return (TENSOR_CORES, SPLIT_K, SPLIT_K_FORCE, MOE_TC_FAST, MOE_WQ, WQ_SD, st.STREAM,
            st.ST_WARPS, st.ST_BLOCKS, st.ST_Q8, pf.PF_SPLIT_K, pf.PF_SK_FORCE)  # fmt: skip


TC_VARIANTS = (
    tuple(f"{k}<{f}, {sb}>" for k in ("gemv_tc", "moe_tc", "gemv_tc_k", "moe_tc_f")
          for f in (2, 4) for sb in (1, 4))
    + tuple(f"gemv_tc_k<{f}, 8>" for f in (2, 4))
    + tuple(f"gemv_tc_sk<{f}, {sb}, {c}>" for f in (2, 4) for sb in (1, 4, 8)
            for c in SK_CLUSTERS[1:])
    + tuple(f"gemv_st<{f}, {sb}, {d}, {mw}>" for f in (2, 4) for sb in (1, 4)
            for d in ("false", "true") for mw in (8, 16))
    + tuple(f"gemv_st<{f}, {sb}, {d}, {mw}, true>" for f in (2, 4) for sb in (1, 4)
            for d in ("false", "true") for mw in (8, 16))
)  # fmt: skip


def tc_eligible(spec: WeightSpec, max_rows: int, most: int = TC_MAX_ROWS) -> bool:
    """Whether the tensor-core path serves this weight spec at ``max_rows`` rows per job
    (``most``: the path's row limit; the split-K gemv's is GEMV_TC_MAX_ROWS)."""
    if not TENSOR_CORES or max_rows > most:
        return False
    return spec.fmt == 2 or (spec.fmt == 4 and spec.group_size % 16 == 0)


def prefill_eligible(spec: WeightSpec, max_rows: int, fewest: int = TC_MAX_ROWS + 1) -> bool:
    """Whether the tensor-core prefill path (``kernels/prefill_tc.py``) serves this weight spec
    at ``max_rows`` rows (``fewest``: where it starts; the gemv's is past GEMV_TC_MAX_ROWS with
    split-K on)."""
    if not TENSOR_CORES or max_rows < fewest:
        return False
    return spec.fmt == 2 or (spec.fmt == 4 and spec.group_size % 16 == 0)


def tc_sb(max_rows: int) -> int:
    """Activation rows per block (SB) of a tensor-core launch: 1, 4, or 8 past TC_MAX_ROWS
    (split-K gemv only)."""
    return 1 if max_rows == 1 else 4 if max_rows <= TC_MAX_ROWS else 8


def _tc_geometry(max_rows: int, in_padded: int) -> tuple[int, int, int]:
    """(SB, kt, dynamic shared bytes) of a tensor-core launch."""
    sb = tc_sb(max_rows)
    nt = (3 * sb + 7) // 8
    kt = max(1024, TC_STAGE_BUDGET // (6 * sb) // 1024 * 1024)
    kt = min(kt, in_padded)
    red = 4 * WARPS * 2 * 16 * 8 * nt  # k-slice partials (tc_red_floats)
    return sb, kt, red + 2 * 3 * sb * (kt + 16)


def _sk_geometry(max_rows: int, in_padded: int, c: int) -> tuple[int, int, int]:
    """(SB, kts, dynamic shared bytes) of a split-K launch of cluster size ``c``: kts is the
    most 128-element steps staged at once, the rank's share of K in equal tiles."""
    sb = tc_sb(max_rows)
    nt = (3 * sb + 7) // 8
    share = -(-(in_padded // 128) // c)  # steps of the largest rank
    most = max(1, TC_STAGE_BUDGET // (6 * sb * 128))
    kts = -(-share // -(-share // most))
    floats = TC_RG * 16 * sb + WARPS * 16 * 8 * nt  # tc_sk_part_floats + tc_sk_red_floats
    return sb, kts, 4 * floats + 2 * 3 * sb * (kts * 128 + 16)


def _sk_name(fmt: int, sb: int, c: int) -> str:
    return f"gemv_tc_k<{fmt}, {sb}>" if c == 1 else f"gemv_tc_sk<{fmt}, {sb}, {c}>"


def _sk_choice(
    spec: WeightSpec, n_jobs: int, max_rows: int, max_out: int, n_sm: int,
    per_sm: Callable[[int, int], int],
) -> int:  # fmt: skip
    """The cluster size of a split-K launch: ``SPLIT_K_FORCE``, else the one of ``SK_CLUSTERS``
    with the least modelled time, waves x (SK_BLOCK_COST + steps per block). Blocks of one
    launch run side by side and are latency bound, so splitting pays while the grid leaves
    block slots empty and stops paying where it adds waves. per_sm(c, smem): resident blocks
    per SM of that variant."""
    if SPLIT_K_FORCE is not None:
        if SPLIT_K_FORCE not in SK_CLUSTERS:
            raise ValueError(f"SPLIT_K_FORCE={SPLIT_K_FORCE}: not one of {SK_CLUSTERS}")
        return SPLIT_K_FORCE
    steps = spec.layout.in_padded // 128
    sb = tc_sb(max_rows)
    base = -(-max_out // (TC_RG * 16)) * n_jobs * -(-max_rows // sb)
    best = (0, 0)
    for c in SK_CLUSTERS:
        _, _, smem = _sk_geometry(max_rows, spec.layout.in_padded, c)
        slots = max(per_sm(c, smem) * n_sm // c * c, c)
        cost = -(-base * c // slots) * (SK_BLOCK_COST + -(-steps // c))
        if best[1] == 0 or cost < best[0]:
            best = (cost, c)
    return best[1]


def _gemv_sk(spec: WeightSpec, n_jobs: int, max_rows: int, max_out: int, n_sm: int) -> Launch:
    """gemv_launch's launch on the split-K tensor-core path (same jobs, same pointer)."""
    sb = tc_sb(max_rows)

    def per_sm(c: int, smem: int) -> int:
        name = _sk_name(spec.fmt, sb, c)
        fn = get_function("gemv_tc.cu", name, TC_VARIANTS)
        return _resident_blocks(fn, name, smem, n_sm) // n_sm

    c = _sk_choice(spec, n_jobs, max_rows, max_out, n_sm, per_sm)
    sb, kts, smem = _sk_geometry(max_rows, spec.layout.in_padded, c)
    fn = get_function("gemv_tc.cu", _sk_name(spec.fmt, sb, c), TC_VARIANTS)
    grid = (-(-max_out // (TC_RG * 16)) * c, n_jobs, -(-max_rows // sb))
    return Launch(fn, grid, (WARPS * 32,), (*spec.geom(), np.int32(kts)), smem)


_sm_counts: dict[int, int] = {}


def _sm_count(dev: int) -> int:
    n = _sm_counts.get(dev)
    if n is None:
        n = _sm_counts[dev] = int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return n


@dataclass(frozen=True)
class WeightSpec:
    """What a launch needs to know about the weights of its jobs."""

    fmt: int
    in_features: int
    group_size: int
    layout: Layout

    @classmethod
    def of(cls, fmt: int, in_features: int, group_size: int) -> WeightSpec:
        """The one interned spec of these values: per-call code compares specs by identity."""
        spec = cls(fmt, in_features, group_size, Layout.of(fmt, in_features, group_size))
        return _SPECS.setdefault(spec, spec)

    def geom(self) -> tuple[np.int32, ...]:
        """The fields of ``struct WGeom`` as kernel arguments, in order."""
        gs, shift = gs_args(self.fmt, self.group_size)
        lay = self.layout
        return (np.int32(self.in_features), np.int32(lay.in_padded), np.int32(lay.ld),
                np.int32(max(lay.ngp, 1)), gs, shift)  # fmt: skip


_SPECS: dict[WeightSpec, WeightSpec] = {}


def gs_args(fmt: int, group_size: int) -> tuple[np.int32, np.int32]:
    """(gs, gs_shift) kernel arguments: shift = log2(gs) for powers of two, else -1."""
    gs = group_size if fmt == 4 else 4
    shift = gs.bit_length() - 1 if gs & (gs - 1) == 0 else -1
    return np.int32(gs), np.int32(shift)


def pick_sb(max_rows: int) -> int:
    for sb in SB_CHOICES:
        if max_rows <= sb:
            return sb
    return SB_CHOICES[-1]


def _kt(sb: int, blk: int, in_padded: int) -> int:
    kt = max(blk, (SMEM_BUDGET // (4 * sb)) // blk * blk)
    return min(kt, in_padded)


def gemv_launch(spec: WeightSpec, n_jobs: int, max_rows: int, max_out: int,
                dual: bool = False) -> Launch | None:  # fmt: skip
    """The gemv launch of a job table (None when there is nothing to do), taking one pointer:
    the jobs, device ``records.GEMV_JOB`` [n_jobs] (8-byte aligned). Every job's x is float32
    [rows, x_stride] with ``in_features`` valid columns, y float32 [rows, y_stride]. dual:
    each job's w0 / s0 and w1 / s1 are an expert's gate and up, y = silu(gate x) * (up x)
    (gemv_st only: where ``gemv_stream.stream_eligible(spec, max_rows, True)``)."""
    if n_jobs <= 0 or max_rows <= 0 or max_out <= 0:
        return None
    dev = cupy.cuda.runtime.getDevice()

    def make() -> Launch:
        lay = spec.layout
        if dual:
            if not st.stream_eligible(spec, max_rows, True):
                raise ValueError(
                    "gemv_launch: dual jobs need gemv_st (gemv_stream.STREAM on, fmt 2, "
                    f"<= {TC_MAX_ROWS} rows), got fmt {spec.fmt}, {max_rows} rows"
                )
            return st._gemv_st(spec, n_jobs, max_rows, max_out, _sm_count(dev), True)
        most = GEMV_TC_MAX_ROWS if SPLIT_K and lay.in_padded >= SB8_MIN_K else TC_MAX_ROWS
        if prefill_eligible(spec, max_rows, most + 1):
            return pf._gemv_pf(spec, n_jobs, max_rows, max_out, _sm_count(dev))
        if st.stream_eligible(spec, max_rows):
            return st._gemv_st(spec, n_jobs, max_rows, max_out, _sm_count(dev))
        if tc_eligible(spec, max_rows, most) and SPLIT_K:
            return _gemv_sk(spec, n_jobs, max_rows, max_out, _sm_count(dev))
        if tc_eligible(spec, max_rows):
            sb, kt, smem = _tc_geometry(max_rows, lay.in_padded)
            fn = get_function("gemv_tc.cu", f"gemv_tc<{spec.fmt}, {sb}>", TC_VARIANTS)
            grid = (-(-max_out // (TC_RG * 16)), n_jobs, -(-max_rows // sb))
            return Launch(fn, grid, (WARPS * 32,), (*spec.geom(), np.int32(kt)), smem)
        sb = pick_sb(max_rows)
        r = _rows_per_warp(sb)
        kt = _kt(sb, lay.block_elems, lay.in_padded)
        fn = get_function("gemv.cu", _gemv_name(spec.fmt, sb), VARIANTS)
        grid = (-(-max_out // (WARPS * r)), n_jobs, -(-max_rows // sb))
        return Launch(fn, grid, (WARPS * 32,), (*spec.geom(), np.int32(kt)), 4 * sb * kt)

    key = (dev, "gemv", id(spec), n_jobs, max_rows, max_out, settings(), dual)
    return _cached(key, make)


def launch_gemv(
    spec: WeightSpec, jobs: cupy.ndarray, n_jobs: int, max_rows: int, max_out: int
) -> None:
    """Launch gemv now on the current device and stream (see ``gemv_launch``)."""
    ln = gemv_launch(spec, n_jobs, max_rows, max_out)
    if ln is not None:
        ln(jobs)


_occupancy: dict[tuple[int, str], int] = {}


def _resident_blocks(
    fn: cupy.RawKernel, name: str, smem: int, n_sm: int, warps: int = WARPS, static: int = 16
) -> int:
    """Blocks of ``fn`` (``warps`` warps each, ``static`` bytes of static shared memory beside
    ``smem``) that fit on the device at once: registers, shared memory, threads, and at most
    32 blocks per SM."""
    dev = cupy.cuda.Device().id
    key = (dev, f"{name}/{smem}")
    occ = _occupancy.get(key)
    if occ is None:
        regs = max(int(fn.num_regs), 1)
        by_regs = 65536 // (((regs * 32 + 255) // 256 * 256) * warps)
        by_smem = (227 * 1024) // (smem + 1024 + static)
        occ = _occupancy[key] = max(1, min(2048 // (warps * 32), 32, by_regs, by_smem))
    return occ * n_sm


def moe_launch(
    gu: WeightSpec, dn: WeightSpec, n_jobs: int, max_rows: int, max_ie: int, max_dout: int,
    n_sm: int,
) -> Launch | None:  # fmt: skip
    """One persistent launch for a whole expert group (gate+up, silu*mul, down), taking two
    pointers: the ``records.MOE_JOB`` [n_jobs] jobs, then the int32 counters [1 + n_jobs], ZERO at
    launch (in a table they come first: counters, padded to ``counter_bytes``, then jobs).
    Every job's x is float32 [rows, D], h [rows, ie], y [rows, dout]; gate and up share
    ``gu`` (format, group size, geometry), every down matrix ``dn``.
    """
    dev = cupy.cuda.runtime.getDevice()

    def make() -> Launch | None:
        if prefill_eligible(gu, max_rows) and prefill_eligible(dn, max_rows) and gu.fmt == dn.fmt:
            return pf._moe_pf(gu, dn, n_jobs, max_rows, max_ie, max_dout, n_sm)
        if tc_eligible(gu, max_rows) and tc_eligible(dn, max_rows) and gu.fmt == dn.fmt:
            return _moe_tc(gu, dn, n_jobs, max_rows, max_ie, max_dout, n_sm)
        sb = pick_sb(max_rows)
        kt = max(_kt(sb, gu.layout.block_elems, gu.layout.in_padded),
                 _kt(sb, dn.layout.block_elems, dn.layout.in_padded))  # fmt: skip
        name = _moe_name(gu.fmt, sb)
        fn = get_function("gemv.cu", name, VARIANTS)
        nz = -(-max_rows // sb)
        ta = -(-max_ie // (WARPS * MOE_RA))
        tb = -(-max_dout // (WARPS * moe_rb(gu.fmt, sb)))
        total = (ta + tb) * nz * n_jobs
        if total <= 0:
            return None
        smem = 4 * sb * kt
        blocks = min(total, _resident_blocks(fn, name, smem, n_sm))
        tail = (np.int32(n_jobs), np.int32(ta), np.int32(tb), np.int32(nz), *gu.geom(),
                *dn.geom(), np.int32(kt))  # fmt: skip
        return Launch(fn, (blocks,), (WARPS * 32,), tail, smem)

    key = (dev, "moe", id(gu), id(dn), n_jobs, max_rows, max_ie, max_dout, n_sm, TENSOR_CORES,
           MOE_TC_FAST, MOE_WQ, WQ_SD)  # fmt: skip
    return _cached(key, make)


def _moe_tc(
    gu: WeightSpec, dn: WeightSpec, n_jobs: int, max_rows: int, max_ie: int, max_dout: int,
    n_sm: int,
) -> Launch | None:  # fmt: skip
    """moe_launch's launch on the tensor-core path (same arguments, same pointers): moe_tc_f
    when ``MOE_TC_FAST`` (for fmt 4 where the tile's staged scales leave room for 2 blocks per
    SM), else moe_tc. The grid is every resident block (the kernel's real registers and
    shared memory: 3 per SM for moe_tc_f<F, 1> at GLM-5.2 widths), at most one per tile.
    ``MOE_WQ`` takes moe_wq where ``wq_choice`` names a form."""
    sd = wq_choice(gu, dn, max_rows)
    if sd is not None:
        return _moe_wq(gu, dn, n_jobs, max_rows, max_ie, max_dout, n_sm, sd)
    sb, kt_a, smem_a = _tc_geometry(max_rows, gu.layout.in_padded)
    _, kt_b, smem_b = _tc_geometry(max_rows, dn.layout.in_padded)
    kt, smem = (kt_a, smem_a) if kt_a >= kt_b else (kt_b, smem_b)
    fast = MOE_TC_FAST
    if fast and gu.fmt == 4:  # moe_tc_f stages a tile's scales (tc_ssc_floats, moe_tc_fast.cuh)
        ngp_a, ngp_b = max(gu.layout.ngp, 1), max(dn.layout.ngp, 1)
        nsc = max(2 * TC_RG * 16 * (ngp_a | 1), TC_RG * 16 * (ngp_b | 1))
        smem_f = smem + 4 * (-(-nsc // 4) * 4)
        fast = 2 * (smem_f + 1024 + 16) <= 227 * 1024  # else (gs < 32 at D = 6144): moe_tc
        if fast:
            smem = smem_f
    name = f"{'moe_tc_f' if fast else 'moe_tc'}<{gu.fmt}, {sb}>"
    fn = get_function("gemv_tc.cu", name, TC_VARIANTS)
    nz = -(-max_rows // sb)
    ta = -(-max_ie // (TC_RG * 16))
    tb = -(-max_dout // (TC_RG * 16))
    total = (ta + tb) * nz * n_jobs
    if total <= 0:
        return None
    blocks = min(total, _resident_blocks(fn, name, smem, n_sm))
    tail = (np.int32(n_jobs), np.int32(ta), np.int32(tb), np.int32(nz), *gu.geom(), *dn.geom(),
            np.int32(kt))  # fmt: skip
    return Launch(fn, (blocks,), (WARPS * 32,), tail, smem)


WQ_VARIANTS = tuple(
    f"moe_wq<{f}, {r}, {s}, {d}>" for f in (2, 4) for r in (1, 4)
    for s, d in sorted({(s2, d) for s, d in WQ_FORMS for s2 in (2, s)})
)  # fmt: skip


def wq_eligible(gu: WeightSpec, dn: WeightSpec, max_rows: int) -> bool:
    """moe_wq serves up to 4 activation rows per job, fmt 2 or fmt 4 with one power of two
    group size of 32 to 256, and widths that keep every activation row's float4 copies
    16-byte aligned."""
    fmt_ok = (gu.fmt == dn.fmt == 2) or (
        gu.fmt == dn.fmt == 4
        and gu.group_size == dn.group_size
        and gu.group_size in (32, 64, 128, 256)
    )
    return 1 <= max_rows <= 4 and fmt_ok and gu.in_features % 4 == 0 and dn.in_features % 4 == 0


def wq_choice(gu: WeightSpec, dn: WeightSpec, max_rows: int) -> tuple[int, ...] | None:
    """The (S, D) that ``MOE_WQ`` asks of moe_wq for this group before ``wq_form``'s limits
    (``WQ_AUTO_SD`` under "auto", else ``WQ_SD``), or None where the group runs moe_tc_f or
    moe_tc: ``MOE_WQ`` off, a group moe_wq does not serve (``wq_eligible``), or under "auto"
    one that is not fmt 4 at one row per expert."""
    if not MOE_WQ or not wq_eligible(gu, dn, max_rows):
        return None
    if MOE_WQ == "auto":
        return WQ_AUTO_SD if gu.fmt == 4 and max_rows == 1 else None
    return WQ_SD


def wq_form(fmt: int, gs: int, r: int, sd: tuple[int, ...]) -> tuple[int, int]:
    """moe_wq's (S, D) for a format and R from the asked ``sd`` (``wq_choice``): S at most
    gs / 16 for fmt 4, and 2 for fmt 4 at R = 4 (at S = 4 its 8 weight chunks per step and two
    n-tiles spill: ptxas, nvcc 13.0, sm_90, 128 bytes)."""
    s, d = sd
    if fmt == 4:
        s = min(s, gs // 16, 2 if r == 4 else 4)
    return s, d


def wq_smem(fmt: int, r: int, s: int, d: int) -> int:
    """moe_wq<F, R, S, D>'s shared memory (MoeWq::SMEM in moe_wq.cu)."""
    stage = 2 * 16 * s * 64 + r * s * 512 + (2 * 16 * 144 if fmt == 4 else 0)
    nt = (3 * r + 7) // 8
    return d * stage + max(s * 3 * r * 144 * 2, 2 * 16 * 8 * nt * 4)


def _moe_wq(
    gu: WeightSpec, dn: WeightSpec, n_jobs: int, max_rows: int, max_ie: int, max_dout: int,
    n_sm: int, sd: tuple[int, ...],
) -> Launch | None:  # fmt: skip
    """moe_launch's launch on moe_wq<F, R, S, D> (one warp per block, every resident one, at
    most one per item; R = 1 at one row, else 4; S and D from ``sd``, ``wq_form``):
    ceil(ie / 16) gate+up items and ceil(dout / 32) down items per job."""
    r = 1 if max_rows == 1 else 4
    s, d = wq_form(gu.fmt, gu.group_size, r, sd)
    smem = wq_smem(gu.fmt, r, s, d)
    name = f"moe_wq<{gu.fmt}, {r}, {s}, {d}>"
    fn = get_function("moe_wq.cu", name, WQ_VARIANTS, smem)
    ta, tb = -(-max_ie // 16), -(-max_dout // 32)
    total = (ta + tb) * n_jobs
    if total <= 0:
        return None
    blocks = min(total, _resident_blocks(fn, name, smem, n_sm, warps=1, static=0))
    tail = (np.int32(n_jobs), np.int32(ta), np.int32(tb), *gu.geom(), *dn.geom())
    return Launch(fn, (blocks,), (32,), tail, smem)


def run_kept(pool: list, w: Any, x: np.ndarray, ready: Any) -> tuple[Any, Any] | None:
    """A matmul whose plan the thread's free arena on top of ``pool`` keeps with its graph ready
    to launch and its output's view made (``ready(rep)``, ``cupy_calls.rerunnable``): that arena
    taken from the pool (``Arena.take``) with the call's inputs written as ``run`` writes them
    (x, and the job where the arena does not hold it: the same bytes), and the plan's
    ``Replay``, which the backend launches without a ``Call`` (``cupy_calls.rerun``). None
    where there is no such plan, nothing taken or written: the call goes through ``run``."""
    a = pool[-1]
    plan = a.plans.get(("matmul", id(w), x.shape[0], settings()))
    if plan is None:
        return None
    _, _, job, rep, (xv, jv) = plan
    if not ready(rep):
        return None
    last = a.take()
    xv[...] = x
    if not a.keep(last, plan):
        jv[...] = job
    return a, rep


def run(call: Any, w: Any, x: np.ndarray) -> Any:
    """matmul: y float32 [S, out] = x float32 [S, in] @ W^T as one gemv job in the call's arena
    (``call``: the backend's call context, ``server/cupy_calls.py``): x at 0, the job, y. The
    plan (the launch, the job's bytes, the kept graph) is kept per arena, weight and rows."""
    s, n_in = x.shape
    n_out = w.out_features
    xb = 4 * s * n_in
    j_off = align(xb)
    y_off = align(j_off + GEMV_JOB.size)
    end = y_off + 4 * s * n_out
    a = call.take()
    key = ("matmul", id(w), s, settings())
    plan = a.plans.get(key)
    if plan is None:
        go = gemv_launch(w.spec, 1, s, n_out)
        a = call.reserve(end, end)  # a reallocated arena forgets its plans: size it first
        job = bytearray(GEMV_JOB.size)
        GEMV_JOB.pack_into(job, 0, *w.ptrs, 0, 0, a.dptr, a.dptr + y_off, s, n_out, n_in,
                           n_out)  # fmt: skip
        if len(a.plans) >= PLANS_PER_ARENA:
            a.plans.clear()
        # The plan holds w: the id in its key stays its own while the plan lives; and views of
        # x and the job in the arena's host half (the arena forgets its plans when it grows).
        views = (at(a.host, 0, (s, n_in)), a.host[j_off : j_off + GEMV_JOB.size])
        plan = a.plans[key] = (w, go, np.frombuffer(bytes(job), np.uint8), call.new_replay(),
                               views)  # fmt: skip
    _, go, job, rep, (xv, jv) = plan
    call.put(0, x, xb, xv)
    if not call.kept(plan):
        jv[...] = job
    if call.replay(rep):  # the same plan: the same work, as its graph
        return call.finish()
    call.send(j_off + GEMV_JOB.size)
    if go is not None:
        call.launch(go, np.uint64(a.dptr + j_off))
    call.receive(y_off, (s, n_out))
    return call.finish()
