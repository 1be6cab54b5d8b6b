"""CuPy wrappers of ``attention.cu``: absorbed q, split-T attention with online softmax, merge.

The value projection and o_proj are gemv jobs (``matmul.py``); the backend chains them.
Launches are prepared once per shape (``matmul.Launch``) and take device pointers.
"""

from __future__ import annotations

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.matmul import Launch, WeightSpec, _cached, gs_args

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


def absorb_launch(spec: WeightSpec, s: int, heads: int, q_dim: int, rope_dim: int,
                  v_dim: int) -> Launch:  # fmt: skip
    """mla_absorb, taking four pointers: qfull float32 [S, H, K+R] <- [q_nope @ W_k(h) |
    q_rope], q float32 [S, H, Q+R], then kv_b [H*(Q+V), K]'s resident bytes and scales."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> Launch:
        k = spec.in_features
        fn = get_function("attention.cu", f"mla_absorb<{spec.fmt}>", VARIANTS)
        gs, shift = gs_args(spec.fmt, spec.group_size)
        tail = (np.int32(s), np.int32(heads), np.int32(q_dim), np.int32(rope_dim),
                np.int32(v_dim), np.int32(k), np.int32(spec.layout.ld),
                np.int32(max(spec.layout.ngp, 1)), gs, shift)  # fmt: skip
        return Launch(fn, (heads, -(-k // 128), -(-s // 8)), (128,), tail, 4 * 8 * max(q_dim, 1))

    key = (dev, "absorb", id(spec), s, heads, q_dim, rope_dim, v_dim)
    return _cached(key, make)  # type: ignore[return-value]


def pick_npl(kr: int) -> tuple[int, int]:
    for npl, hpw in NPL_CHOICES:
        if kr <= 32 * npl:
            return npl, hpw
    raise ValueError(f"attention: K + R = {kr} exceeds the supported {MAX_KR}")


def pick_splits(n_sm: int, blocks: int, t_max: int) -> int:
    """Slices of T per (s, head group): about two waves of blocks, >= 2 tiles per slice."""
    want = -(-2 * n_sm // max(blocks, 1))
    return max(1, min(want, -(-t_max // (2 * ATT_TT)), 1024))


def attend_splits(s: int, heads: int, k: int, r: int, t_max: int, n_sm: int) -> int:
    """nsplit of ``attend_launch``: its scratch is pm, pl float32 [S, H, nsplit] and pacc
    float32 [S, H, nsplit, K]."""
    _, hpw = pick_npl(k + r)
    return pick_splits(n_sm, -(-heads // (ATT_WARPS * hpw)) * s, t_max)


def attend_launch(s: int, heads: int, k: int, r: int, scale: float, nsplit: int
                  ) -> tuple[Launch, Launch]:  # fmt: skip
    """(mla_attend, mla_merge). attend takes five pointers: pm, pl, pacc (scratch, see
    ``attend_splits``), qfull float32 [S, H, K+R], kv (device ``KV_DTYPE`` [S]: row s's cache
    pointers and length); merge takes four: cl float32 [H, S, K] <- softmax(qfull .
    [latent | rope] * scale) @ latent per (s, h), then pm, pl, pacc."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> tuple[Launch, Launch]:
        npl, hpw = pick_npl(k + r)
        groups = -(-heads // (ATT_WARPS * hpw))
        fn = get_function("attention.cu", f"mla_attend<{npl}, {hpw}>", VARIANTS)
        att = Launch(fn, (groups, s, nsplit), (ATT_WARPS * 32,),
                     (np.int32(s), np.int32(heads), np.int32(k), np.int32(r), np.float32(scale),
                      np.int32(nsplit)), 4 * ATT_TT * npl * 32)  # fmt: skip
        merge = get_function("attention.cu", "mla_merge", VARIANTS)
        mg = Launch(
            merge,
            (heads, s),
            (128,),
            (np.int32(s), np.int32(heads), np.int32(k), np.int32(nsplit)),
            4 * nsplit,
        )
        return att, mg

    key = (dev, "attend", s, heads, k, r, float(scale), nsplit)
    return _cached(key, make)  # type: ignore[return-value,arg-type]
