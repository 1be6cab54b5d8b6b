"""CuPy wrapper of ``gemv.cu``: a table of ``y = x @ W^T`` jobs in one launch.

One launch serves a matmul (one job), every expert of a group (one job per expert: DUAL for
gate+up with silu*mul fused, then one for the down projections) and the value projection of
MLA attention (one job per head). Jobs of one launch share the weight spec (fmt, I, layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.layout import Layout

# Mirrors ``struct GemvJob`` in gemv.cu (64 bytes, naturally aligned).
JOB_DTYPE = np.dtype(
    [
        ("w0", "<u8"),
        ("s0", "<u8"),
        ("w1", "<u8"),
        ("s1", "<u8"),
        ("x", "<u8"),
        ("y", "<u8"),
        ("rows", "<i4"),
        ("out_rows", "<i4"),
        ("x_stride", "<i4"),
        ("y_stride", "<i4"),
    ]
)
assert JOB_DTYPE.itemsize == 64

WARPS = 8
SB_CHOICES = (1, 4, 8)  # activation rows per block: decode, a few rows, prefill
SMEM_BUDGET = 64 * 1024  # bytes of staged x per block; more K tiles beyond


def _rows_per_warp(dual: bool) -> int:
    return 2 if dual else 4


def _name(fmt: int, sb: int, dual: bool) -> str:
    return f"gemv<{fmt}, {_rows_per_warp(dual)}, {sb}, {'true' if dual else 'false'}>"


VARIANTS = tuple(_name(f, sb, d) for f in range(5) for sb in SB_CHOICES for d in (False, True))


@dataclass(frozen=True)
class WeightSpec:
    """What a launch needs to know about the weights of its jobs."""

    fmt: int
    in_features: int
    group_size: int
    layout: Layout


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


def launch_gemv(
    spec: WeightSpec,
    jobs: cupy.ndarray,
    n_jobs: int,
    max_rows: int,
    max_out: int,
    dual: bool,
) -> None:
    """Launch gemv on the current device and stream.

    jobs: device uint8 view of ``JOB_DTYPE`` [n_jobs] (any 8-byte aligned offset); every job's
    x is float32 [rows, x_stride] with ``in_features`` valid columns, y float32 [rows, y_stride].
    """
    lay = spec.layout
    sb = pick_sb(max_rows)
    r = _rows_per_warp(dual)
    blk = lay.block_elems
    kt = max(blk, (SMEM_BUDGET // (4 * sb)) // blk * blk)
    kt = min(kt, lay.in_padded)
    fn = get_function("gemv.cu", _name(spec.fmt, sb, dual), VARIANTS)
    gs, shift = gs_args(spec.fmt, spec.group_size)
    grid = (-(-max_out // (WARPS * r)), n_jobs, -(-max_rows // sb))
    fn(
        grid,
        (WARPS * 32,),
        (
            jobs,
            np.int32(spec.in_features),
            np.int32(lay.in_padded),
            np.int32(lay.ld),
            np.int32(max(lay.ngp, 1)),
            gs,
            shift,
            np.int32(kt),
        ),
        shared_mem=4 * sb * kt,
    )
