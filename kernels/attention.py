"""CuPy wrappers of ``attention.cu``: absorbed q, split-T attention with online softmax, merge.

The value projection and o_proj are gemv jobs (``matmul.py``); the backend chains them.
"""

from __future__ import annotations

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.matmul import WeightSpec, gs_args

# Mirrors ``struct KvDesc`` in attention.cu.
KV_DTYPE = np.dtype([("latent", "<u8"), ("rope", "<u8"), ("len", "<i4"), ("pad", "<i4")])

ATT_WARPS = 8
ATT_TT = 8
# (lanes' share of K + R, heads per warp): registers hold q and the weighted latent.
NPL_CHOICES = ((2, 2), (4, 2), (8, 2), (18, 2), (36, 1))
# Every variant of attention.cu: the file compiles once per device with all of them.
VARIANTS = (
    tuple(f"mla_absorb<{f}>" for f in range(5))
    + tuple(f"mla_attend<{n}, {h}>" for n, h in NPL_CHOICES)
    + ("mla_merge",)
)
MAX_KR = 32 * NPL_CHOICES[-1][0]


def absorb(
    qfull: cupy.ndarray,
    q: cupy.ndarray,
    w: cupy.ndarray,
    s: cupy.ndarray,
    spec: WeightSpec,
    heads: int,
    q_dim: int,
    rope_dim: int,
    v_dim: int,
) -> None:
    """qfull float32 [S, H, K+R] <- [q_nope @ W_k(h) | q_rope]; q float32 [S, H, Q+R];
    w/s: kv_b [H*(Q+V), K] resident bytes and scales."""
    S = q.shape[0]
    k = spec.in_features
    fn = get_function("attention.cu", f"mla_absorb<{spec.fmt}>", VARIANTS)
    gs, shift = gs_args(spec.fmt, spec.group_size)
    fn(
        (heads, -(-k // 128), -(-S // 8)),
        (128,),
        (
            qfull,
            q,
            w,
            s,
            np.int32(S),
            np.int32(heads),
            np.int32(q_dim),
            np.int32(rope_dim),
            np.int32(v_dim),
            np.int32(k),
            np.int32(spec.layout.ld),
            np.int32(max(spec.layout.ngp, 1)),
            gs,
            shift,
        ),
        shared_mem=4 * 8 * max(q_dim, 1),
    )


def pick_npl(kr: int) -> tuple[int, int]:
    for npl, hpw in NPL_CHOICES:
        if kr <= 32 * npl:
            return npl, hpw
    raise ValueError(f"attention: K + R = {kr} exceeds the supported {MAX_KR}")


def pick_splits(n_sm: int, blocks: int, t_max: int) -> int:
    """Slices of T per (s, head group): about two waves of blocks, >= 2 tiles per slice."""
    want = -(-2 * n_sm // max(blocks, 1))
    return max(1, min(want, -(-t_max // (2 * ATT_TT)), 1024))


def attend(
    cl: cupy.ndarray,
    qfull: cupy.ndarray,
    kv: cupy.ndarray,
    heads: int,
    k: int,
    r: int,
    scale: float,
    t_max: int,
    n_sm: int,
) -> None:
    """cl float32 [H, S, K] <- softmax(qfull . [latent | rope] * scale) @ latent per (s, h).

    qfull float32 [S, H, K+R]; kv: device KV_DTYPE [S] (row s: its cache pointers, length).
    """
    S = qfull.shape[0]
    npl, hpw = pick_npl(k + r)
    groups = -(-heads // (ATT_WARPS * hpw))
    nsplit = pick_splits(n_sm, groups * S, t_max)
    pm = cupy.empty((S, heads, nsplit), cupy.float32)
    pl = cupy.empty((S, heads, nsplit), cupy.float32)
    pacc = cupy.empty((S, heads, nsplit, k), cupy.float32)
    fn = get_function("attention.cu", f"mla_attend<{npl}, {hpw}>", VARIANTS)
    fn(
        (groups, S, nsplit),
        (ATT_WARPS * 32,),
        (
            pm,
            pl,
            pacc,
            qfull,
            kv,
            np.int32(S),
            np.int32(heads),
            np.int32(k),
            np.int32(r),
            np.float32(scale),
            np.int32(nsplit),
        ),
        shared_mem=4 * ATT_TT * npl * 32,
    )
    merge = get_function("attention.cu", "mla_merge", VARIANTS)
    merge(
        (heads, S),
        (128,),
        (cl, pm, pl, pacc, np.int32(S), np.int32(heads), np.int32(k), np.int32(nsplit)),
        shared_mem=4 * nsplit,
    )
