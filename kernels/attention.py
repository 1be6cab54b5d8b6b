"""CuPy wrappers of ``attention.cu``: absorbed q, split-T attention with online softmax, merge.

Two attention kernels: ``mla_flash`` (tensor cores, every head of a block scores each KV tile
staged once; the default where it fits: K <= 512 and its shared memory) and ``mla_attend``
(fp32 FMA, any K + R up to ``MAX_KR``). ``FLASH = False`` keeps mla_attend (tests run both).

The value projection and o_proj are gemv jobs (``matmul.py``); the backend chains them.
Launches are prepared once per shape (``matmul.Launch``) and take device pointers.
"""

from __future__ import annotations

import functools

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.matmul import Launch, WeightSpec, _cached, gs_args

# Mirrors ``struct KvDesc`` in attention.cu.
KV_DTYPE = np.dtype([("latent", "<u8"), ("rope", "<u8"), ("len", "<i4"), ("src", "<i4")])

ABS_P = 4  # mla_absorb: parts of the Q rows per column, one 128-thread group each
ATT_WARPS = 8
ATT_TT = 8
# (lanes' share of K + R, heads per warp): registers hold q and the weighted latent.
NPL_CHOICES = ((2, 2), (4, 2), (8, 2), (18, 2), (36, 1))
# Every variant of attention.cu: the file compiles once per device with all of them.
VARIANTS = (
    tuple(f"mla_absorb<{f}>" for f in range(5))
    + tuple(f"mla_attend<{n}, {h}>" for n, h in NPL_CHOICES)
    + ("mla_merge",)
    + tuple(f"mla_flash<{n}>" for n in (1, 2, 4, 8, 16, 32))
)
FLASH = True
FL_TT = 16  # cache rows per tile (attention.cu)
FL_HB = 64  # heads per block
FL_MIN_ROWS = 32  # fewest cache rows per T slice (2 tiles): fewer slices, less pacc to merge
FL_SMEM_MAX = 227 * 1024
MAX_KR = 32 * NPL_CHOICES[-1][0]


def absorb_launch(spec: WeightSpec, s: int, heads: int, q_dim: int, rope_dim: int,
                  v_dim: int) -> Launch:  # fmt: skip
    """mla_absorb, taking seven pointers and a count: qfull float32 [S, H, K+R] <- [q_nope @
    W_k(h) | q_rope], q float32 [S, H, Q+R], kv_b [H*(Q+V), K]'s resident bytes and scales, the
    call's ``KV_DTYPE`` [S] descriptors, then its new cache rows: latent float32 [n, K], rope
    float32 [n, R] and ``np.int32(n)`` (written into the caches the descriptors name; n = 0:
    none)."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> Launch:
        k = spec.in_features
        fn = get_function("attention.cu", f"mla_absorb<{spec.fmt}>", VARIANTS)
        gs, shift = gs_args(spec.fmt, spec.group_size)
        tail = (np.int32(s), np.int32(heads), np.int32(q_dim), np.int32(rope_dim),
                np.int32(v_dim), np.int32(k), np.int32(spec.layout.ld),
                np.int32(max(spec.layout.ngp, 1)), gs, shift)  # fmt: skip
        smem = 4 * (8 * max(q_dim, 1) + (ABS_P - 1) * 8 * 128)
        return Launch(fn, (heads, -(-k // 128), -(-s // 8)), (128 * ABS_P,), tail, smem)

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
        return att, _merge(s, heads, k, nsplit)

    key = (dev, "attend", s, heads, k, r, float(scale), nsplit)
    return _cached(key, make)  # type: ignore[return-value,arg-type]


def _merge(s: int, heads: int, k: int, nsplit: int) -> Launch:
    merge = get_function("attention.cu", "mla_merge", VARIANTS)
    args = (np.int32(s), np.int32(heads), np.int32(k), np.int32(nsplit))
    return Launch(merge, (heads, s, -(-k // 128)), (128,), args, 4 * nsplit)


@functools.cache
def _flash_geometry(k: int, r: int) -> tuple[int, int, int, int] | None:
    """(NTC, QST, KST, shared bytes) of mla_flash, or None where it does not fit."""
    krp = -(-(k + r) // 8) * 8
    ntc = next((n for n in (1, 2, 4, 8, 16, 32) if 16 * n >= k), None)
    if ntc is None:
        return None
    qst, kst = krp + 4, max(krp, 16 * ntc) + 4  # 4 mod 8: conflict-free fragment loads
    smem = 4 * (FL_HB * qst + FL_TT * kst + 2 * FL_HB * FL_TT)
    return (ntc, qst, kst, smem) if smem <= FL_SMEM_MAX else None


def flash_ok(k: int, r: int) -> bool:
    """Whether mla_flash serves these widths (and ``FLASH`` is on)."""
    return FLASH and _flash_geometry(k, r) is not None


def flash_splits(s: int, heads: int, t_max: int, n_sm: int) -> int:
    """nsplit of ``flash_launch``: one wave of one-block-per-SM blocks, >= FL_MIN_ROWS rows per
    slice. Scratch as ``attend_splits``'s."""
    per = s * -(-heads // FL_HB)
    return max(1, min(max(1, n_sm // per), -(-t_max // FL_MIN_ROWS), 1024))


def flash_launch(s: int, heads: int, k: int, r: int, scale: float, nsplit: int
                 ) -> tuple[Launch, Launch]:  # fmt: skip
    """(mla_flash, mla_merge), taking the same pointers as ``attend_launch``'s pair."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> tuple[Launch, Launch]:
        geo = _flash_geometry(k, r)
        assert geo is not None  # callers check flash_ok
        ntc, qst, kst, smem = geo
        fn = get_function("attention.cu", f"mla_flash<{ntc}>", VARIANTS)
        fn.max_dynamic_shared_size_bytes = max(smem, 160 * 1024)
        att = Launch(fn, (nsplit, s, -(-heads // FL_HB)), (256,),
                     (np.int32(s), np.int32(heads), np.int32(k), np.int32(r), np.float32(scale),
                      np.int32(nsplit), np.int32(qst), np.int32(kst)), smem)  # fmt: skip
        return att, _merge(s, heads, k, nsplit)

    key = (dev, "flash", s, heads, k, r, float(scale), nsplit)
    return _cached(key, make)  # type: ignore[return-value,arg-type]
