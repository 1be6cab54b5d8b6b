"""The CuPy wrappers of the MLA attention kernels, ``attention.cu`` (its flash kernels in
``attention_flash.cuh`` and ``attention_flash_h.cuh``): absorbed q, split-T attention with
online softmax, merge
(reference: ``reference.attention`` / ``reference.attention_ragged``; tests:
``tests/kernels/test_attention.py`` on the GPU, ``test_attention_cpu.py`` (absorb) and
``test_attention_flash_cpu.py`` (flash, merge) on the CPU).

Two attention kernels: ``mla_flash`` (tensor cores, every head of a block scores each KV tile
staged once; the default where it fits: K <= 512 and its shared memory) and ``mla_attend``
(fp32 FMA, any K + R up to ``MAX_KR``). ``FLASH = False`` keeps mla_attend (tests run both).
``mla_absorb_w`` (``ABSORB_W``: whole-row kv_b loads) serves kv_b in fmt 2 and fmt 4 (gs % 4 ==
0), ``mla_absorb`` any format; ``mla_flash_c`` (``FL_CLUSTER``: clusters of T slices merged in
distributed shared memory, fewer or no mla_merge partials) serves the widths where its clusters
fit in one wave (``cluster_choice``). Both are measured against the kernels they replace in
``bench/results/mla-launches-2026-12-01.md``; the tests run both ways on the GPU, and on the
CPU through a stand-in for the CUDA built-ins. ``mla_flash_h`` / ``mla_flash_hc`` (``FL_F16``,
off by default; COLIWORKER_FLASH_F16=1 takes them) do the flash kernels' work on
fp16 tensor cores, every q row (once per call) and cache row (as its tile is staged) split
once into fp16 parts (attention_flash_h.cuh says how its numerics hold). The q rows are split
by ``mla_absorb_w`` itself where it serves kv_b and K <= 512 (``QSPLIT_FUSED``,
``qsplit_fused``: one launch fewer per call), else by a ``mla_qsplit`` launch after the absorb.

The ops' host side (``attention``, ``attention_ragged``: a call's plan, arena layout, gemv
jobs and launches in order) is ``kernels/attention_call.py``; the value projection and o_proj
are gemv jobs (``matmul.py``). Launches are prepared once per shape (``launch.Launch``) and
take device pointers. The switches (``FLASH``, ``ABSORB_W``, ``FL_CLUSTER``, ``FL_F16``,
``QSPLIT_FUSED``, ``MERGE_ZG``) live here; attention_call reads them here on every call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import cupy
import numpy as np

from coliworker.kernels._module import get_function
from coliworker.kernels.launch import max_active_clusters
from coliworker.kernels.matmul import Launch, WeightSpec, _cached, gs_args

ABS_P = 4  # mla_absorb: parts of the Q rows per column, one 128-thread group each
#: mla_flash's k parts per head group (attention_flash.cuh): its block is 4 KP warps, each
#: taking 1 / KP of the scores' k-steps and of the latent's columns; 2 (8 warps) or 4 (16
#: warps: twice the warps per SM to hide the mma and shared loads' latency with, at one block
#: per SM). The default is 2: on an H100 KP 4 tied at one sequence and was 9-11% slower at 8 and 32
#: (bench/results/flash-kp-2026-12-06.md). COLIWORKER_FLASH_KP sets it; tests run both.
#: mla_flash_h is always KP = 2.
FL_KPS = (2, 4)


def _flash_kp(text: str | None) -> int:
    """``FL_KP`` from COLIWORKER_FLASH_KP's text (None: unset, the default); a ValueError for
    anything but one of ``FL_KPS``."""
    if text is None:
        return 2
    if text.strip() not in {str(k) for k in FL_KPS}:
        raise ValueError(f"COLIWORKER_FLASH_KP={text!r}: must be one of {FL_KPS}")
    return int(text)


FL_KP = _flash_kp(os.environ.get("COLIWORKER_FLASH_KP"))


def _ntcs(kp: int) -> tuple[int, ...]:
    """The NTC of mla_flash<NTC, KP>: 8-column n-tiles per warp, up to K = 512."""
    return tuple(n for n in (1, 2, 4, 8, 16, 32) if 8 * kp * n <= 512)


ATT_WARPS = 8
ATT_TT = 8
# (lanes' share of K + R, heads per warp): registers hold q and the weighted latent.
NPL_CHOICES = ((2, 2), (4, 2), (8, 2), (18, 2), (36, 1))
# mla_absorb_w (whole-row weight loads; fmt 2, and fmt 4 with gs a multiple of 4; the kernel
# takes FMT 1..4, the others are not compiled): tokens per block. ``ABSORB_W`` off: mla_absorb
# for every format (tests run both).
ABW_SB = (1, 4, 8)
ABW_MIN_BLOCKS = 128  # about one block per SM (absorb_w_sb)
ABSORB_W = True
# mla_flash_c: clusters of C T slices merged in distributed shared memory, by the latent columns
# a block's warps cover (KP * 8 * NTC: the widths that have them). ``FL_CLUSTER``: None (the
# default): C and nsplit from ``cluster_choice``; 1: mla_flash and mla_merge only; c: that C
# wherever it divides nsplit.
FL_CLUSTERS = {512: (2, 4, 8), 128: (4,)}
FL_CLUSTER: int | None = None
#: The share of the one-block-per-SM nsplit that ``cluster_choice`` may give up so that a
#: launch's clusters fit in one wave.
FL_WAVE_LOSS = 0.1
# Every variant of attention.cu: the file compiles once per device with all of them.
VARIANTS = (
    tuple(f"mla_absorb<{f}>" for f in range(5))
    + tuple(
        f"mla_absorb_w<{f}, {sb}, {x}>" for f in (2, 4) for sb in ABW_SB for x in ("false", "true")
    )
    + tuple(f"mla_attend<{n}, {h}>" for n, h in NPL_CHOICES)
    + ("mla_merge<1>", "mla_merge<4>")
    + tuple(f"mla_flash<{n}, {kp}>" for kp in FL_KPS for n in _ntcs(kp))
    + tuple(
        f"mla_flash_c<{w // (8 * kp)}, {c}, {kp}>"
        for kp in FL_KPS
        for w, cs in FL_CLUSTERS.items()
        for c in cs
    )
    + tuple(f"mla_flash_h<{n}>" for n in (1, 2, 4, 8, 16, 32))
    + tuple(f"mla_flash_hc<{w // 16}, {c}>" for w, cs in FL_CLUSTERS.items() for c in cs)
    + ("mla_qsplit",)
)
FLASH = True
#: mla_flash_h / mla_flash_hc (fp16 tensor cores, each q row and cache row scaled by its power of
#: two and split once into fp16 parts: the q rows by mla_qsplit, the cache rows as a tile is
#: staged; attention_flash_h.cuh) in place of mla_flash / mla_flash_c where their rows fit (K + R
#: <= FH_MAX_W). Off: with one exponent per row segment (latent, rope) the H100 measured the
#: fp16 flash slower than the tf32 one, 147.6 against 141.4 us at 8 sequences and 276.2
#: against 256.9 at 32 (bench/results/pf-split-k-2026-12-05.md), where the form with one
#: exponent per row had measured 97 against 143 (bench/results/mla-flash-f16-2026-12-05.md);
#: closer to float64 either way. COLIWORKER_FLASH_F16=1 takes the fp16 kernels. Tests run both.
FL_F16 = os.environ.get("COLIWORKER_FLASH_F16", "0") == "1"
#: mla_absorb_w splits the q rows for mla_flash_h itself (mla_absorb_w<FMT, SB, true>, the bits
#: of mla_qsplit) where ``qsplit_fused`` says so: the call has no mla_qsplit launch.
#: On an H100 (bench/results/pf-split-k-2026-12-05.md) the MLA call's kernel phase 122.6 ->
#: 116.8 us at one sequence, 269.5 -> 263.1 at 8, 535.6 -> 530.9 at 32 (the CPU run of the
#: source gives the same bytes as mla_qsplit). COLIWORKER_QSPLIT_FUSED=0 keeps the mla_qsplit
#: launch. Tests run both.
QSPLIT_FUSED = os.environ.get("COLIWORKER_QSPLIT_FUSED", "1") != "0"
FH_MAX_W = 128 * 5  # FH_MQ: the widest row mla_flash_h stages
FL_TT = 16  # cache rows per tile (attention.cu)
FL_HB = 64  # heads per block
FL_MIN_ROWS = 32  # fewest cache rows per T slice (2 tiles): fewer slices, less pacc to merge
FL_SMEM_MAX = 227 * 1024
MAX_KR = 32 * NPL_CHOICES[-1][0]


def absorb_launch(spec: WeightSpec, s: int, heads: int, q_dim: int, rope_dim: int,
                  v_dim: int) -> Launch:  # fmt: skip
    """mla_absorb, taking nine pointers and a count: qfull float32 [S, H, K+R] <- [q_nope @
    W_k(h) | q_rope], qs and qe (where ``qsplit_fused``: the q rows split as ``qsplit_launch``
    splits them, written by the same launch; else unused), q float32 [S, H, Q+R], kv_b
    [H*(Q+V), K]'s resident bytes and scales, the call's ``KV_DESC`` [S] descriptors, then its
    new cache rows: latent float32 [n, K], rope float32 [n, R] and ``np.int32(n)`` (written
    into the caches the descriptors name; n = 0: none)."""
    dev = cupy.cuda.runtime.getDevice()
    fused = qsplit_fused(spec, rope_dim)

    def make() -> Launch:
        k = spec.in_features
        gs, shift = gs_args(spec.fmt, spec.group_size)
        tail = (np.int32(s), np.int32(heads), np.int32(q_dim), np.int32(rope_dim),
                np.int32(v_dim), np.int32(k), np.int32(spec.layout.ld),
                np.int32(max(spec.layout.ngp, 1)), gs, shift)  # fmt: skip
        if absorb_w_ok(spec):
            sb = absorb_w_sb(s, heads, k)
            name = f"mla_absorb_w<{spec.fmt}, {sb}, {str(fused).lower()}>"
            fn = get_function("attention.cu", name, VARIANTS)
            smem = 4 * (-(-max(q_dim, 1) * sb // 4) * 4 + 4 * sb * 512)
            return Launch(fn, (heads, -(-k // 512), -(-s // sb)), (256,), tail, smem)
        fn = get_function("attention.cu", f"mla_absorb<{spec.fmt}>", VARIANTS)
        smem = 4 * (8 * max(q_dim, 1) + (ABS_P - 1) * 8 * 128)
        return Launch(fn, (heads, -(-k // 128), -(-s // 8)), (128 * ABS_P,), tail, smem)

    key = (dev, "absorb", id(spec), s, heads, q_dim, rope_dim, v_dim, ABSORB_W, fused)
    return _cached(key, make)  # type: ignore[return-value]


def absorb_w_sb(s: int, heads: int, k: int) -> int:
    """Tokens per block of mla_absorb_w: the most of ``ABW_SB`` (each block reads its head's
    W_k once for its tokens) that still gives ABW_MIN_BLOCKS blocks, else the fewest that
    hold all ``s`` tokens. Measured on the H200 at GLM-5.2 widths (ncu): 8 tokens in one
    block per head (64 blocks) took 17.4 us where mla_absorb took 15.6."""
    blocks = heads * -(-k // 512)
    for sb in sorted(ABW_SB, reverse=True):
        if sb <= max(s, 1) and blocks * -(-s // sb) >= ABW_MIN_BLOCKS:
            return sb
    return next((b for b in ABW_SB if s <= b), ABW_SB[-1])


def absorb_w_ok(spec: WeightSpec) -> bool:
    """Whether mla_absorb_w serves this kv_b (and ``ABSORB_W`` is on)."""
    return ABSORB_W and (spec.fmt == 2 or (spec.fmt == 4 and spec.group_size % 4 == 0))


def qsplit_fused(spec: WeightSpec, r: int) -> bool:
    """Whether the absorb launch splits the q rows for mla_flash_h itself (no mla_qsplit
    launch): ``QSPLIT_FUSED``, the flash launch mla_flash_h's (``flash_ok`` and ``flash_f16``),
    mla_absorb_w serving kv_b (``absorb_w_ok``) and K <= 512 (one column group: a block holds
    whole rows)."""
    k = spec.in_features
    return QSPLIT_FUSED and k <= 512 and flash_ok(k, r) and flash_f16(k, r) and absorb_w_ok(spec)


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
    ``attend_splits``), qfull float32 [S, H, K+R], kv (device ``KV_DESC`` [S]: row s's cache
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

    key = (dev, "attend", s, heads, k, r, float(scale), nsplit, MERGE_ZG)
    return _cached(key, make)  # type: ignore[return-value,arg-type]


#: mla_merge's split groups (``MERGE_ZG``: ZG = 4, the block's warps take every 4th split of 32
#: columns, a quarter of the dependent loads per thread) from MERGE_ZG_MIN splits on; fewer,
#: or the switch off, keep ZG = 1 (one column per thread over all splits). On an H100 the
#: merge of one sequence's 64 partials (T = 4096) 14.5 -> 7.0 us
#: (bench/results/pf-split-k-2026-12-05.md). COLIWORKER_MERGE_ZG=0 sets it off. Tests run both.
MERGE_ZG = os.environ.get("COLIWORKER_MERGE_ZG", "1") != "0"
MERGE_ZG_MIN = 16


def _merge(s: int, heads: int, k: int, nsplit: int) -> Launch:
    zg = 4 if MERGE_ZG and nsplit >= MERGE_ZG_MIN else 1
    merge = get_function("attention.cu", f"mla_merge<{zg}>", VARIANTS)
    args = (np.int32(s), np.int32(heads), np.int32(k), np.int32(nsplit))
    smem = 4 * (-(-nsplit // 4) * 4 + (zg - 1) * (128 // zg))
    return Launch(merge, (heads, s, -(-k // (128 // zg))), (128,), args, smem)


@functools.cache
def _flash_geometry(k: int, r: int, f16: bool = False, kp: int = 2
                    ) -> tuple[int, int, int, int] | None:  # fmt: skip
    """(NTC, QST, KST, shared bytes) of mla_flash<NTC, kp>, or with ``f16`` of mla_flash_h
    (always kp 2; QSTH, KSTH: row strides in fp16 values), or None where it does not fit."""
    kp = 2 if f16 else kp
    ntc = next((n for n in _ntcs(kp) if 8 * kp * n >= k), None)
    if ntc is None:
        return None
    if f16:  # two fp16 planes (4 bytes a value, as fp32), exponents of 64 q rows and a tile
        krp = krp16(k, r)
        qst, kst = krp + 8, max(krp, 16 * ntc) + 8  # 8 mod 16: conflict-free ldmatrix rows
        smem = 4 * (FL_HB * qst + FL_TT * kst + 2 * FL_HB * FL_TT) + 8 * (FL_HB + FL_TT)
        fits = smem <= FL_SMEM_MAX and kst - 8 <= FH_MAX_W
        return (ntc, qst, kst, smem) if fits else None
    krp = -(-(k + r) // 8) * 8
    qst, kst = krp + 4, max(krp, 8 * kp * ntc) + 4  # 4 mod 8: conflict-free fragment loads
    smem = 4 * (FL_HB * qst + FL_TT * kst + kp * FL_HB * FL_TT)
    return (ntc, qst, kst, smem) if smem <= FL_SMEM_MAX else None


def _launch_kp(f16: bool) -> int:
    """KP of a flash launch: 2 for mla_flash_h (``f16``), else ``FL_KP``."""
    return 2 if f16 else FL_KP


def flash_f16(k: int, r: int) -> bool:
    """Whether the flash launch at these widths is mla_flash_h's (``FL_F16`` and it fits)."""
    return FL_F16 and _flash_geometry(k, r, True) is not None


def flash_ok(k: int, r: int) -> bool:
    """Whether mla_flash serves these widths (and ``FLASH`` is on)."""
    return FLASH and _flash_geometry(k, r, False, FL_KP) is not None


def flash_splits(s: int, heads: int, t_max: int, n_sm: int, k: int, r: int) -> int:
    """nsplit of ``flash_launch``: one wave of one-block-per-SM blocks, >= FL_MIN_ROWS rows per
    slice; with clusters (``FL_CLUSTER`` != 1) the nsplit of ``cluster_choice`` (None), or
    rounded down to a multiple of the forced C. Scratch as ``attend_splits``'s."""
    key = (s, heads, t_max, n_sm, k, r, FL_CLUSTER, FL_F16, FL_KP)
    got = _splits.get(key)
    if got is None:
        per = s * -(-heads // FL_HB)
        n = max(1, min(max(1, n_sm // per), -(-t_max // FL_MIN_ROWS), 1024))
        if FL_CLUSTER is None:
            ckey = (per, n, n_sm, k, r, FL_F16, FL_KP)
            cands = _candidates.get(ckey)
            if cands is None:
                if len(_candidates) > 1024:
                    _candidates.clear()
                cands = _candidates[ckey] = cluster_candidates(
                    per, n, _cluster_sizes(k, r), functools.partial(_max_clusters, k, r)
                )
            got = fitting(cands, n, functools.partial(slice_tiles, t_max))[1]
        elif FL_CLUSTER in _cluster_sizes(k, r) and n >= FL_CLUSTER:
            got = n // FL_CLUSTER * FL_CLUSTER
        else:
            got = n
        if len(_splits) > 4096:
            _splits.clear()
        _splits[key] = got
    return got


# flash_splits' answers by its arguments and the switches it reads (S, H, T, SMs, K, R,
# FL_CLUSTER, FL_F16, FL_KP): asked on every call, looked up before any arithmetic (a decode
# token's layers share T: one miss per token). Keyed by SM count, not device: devices of one SM
# count are taken to hold as many clusters (a wrong guess costs a second wave of clusters,
# never a wrong result). A new T (one per token) costs the tile rule alone: the candidates
# cluster_choice picks from do not depend on T and are kept by (blocks per slice, one-wave
# nsplit, SMs, K, R, FL_F16, FL_KP) in _candidates.
_splits: dict[tuple, int] = {}
_candidates: dict[tuple, tuple[tuple[int, int], ...]] = {}


def slice_tiles(t_max: int, nsplit: int) -> int:
    """FL_TT-row tiles of the longest T slice (mla_flash's chunk of a ``t_max``-row cache cut
    in ``nsplit``): the tile loop's length on the critical path."""
    rows = -(-t_max // nsplit)
    return -(-rows // FL_TT)


def cluster_choice(per: int, nsplit: int, sizes: Sequence[int],
                   max_clusters: Callable[[int], int],
                   tiles: Callable[[int], int] | None = None) -> tuple[int, int]:  # fmt: skip
    """(C, nsplit) of mla_flash_c for ``per`` blocks per T slice (sequences x head blocks) and
    the one-wave ``nsplit``: the largest C of ``sizes`` whose ``per * nsplit' / C`` clusters
    are all resident at once (``max_clusters(C)``, the driver's count) with nsplit' a multiple
    of C, at most nsplit rounded up to one, no more than ``FL_WAVE_LOSS`` below nsplit and,
    where ``tiles`` (tiles of the longest slice, by nsplit) is given, no more tiles in its
    longest slice than at nsplit (the largest such nsplit'); else (1, nsplit), mla_flash and
    mla_merge.

    A second wave of clusters costs a whole slice's time again: measured on the H200 at
    GLM-5.2 widths, 8 sequences' 128 blocks in clusters of 8 (15 resident) took 1.8x the
    unclustered time, in clusters of 2 (66 resident) 0.95x. A longer slice costs its tiles:
    at one sequence of T = 4096, 120 slices in clusters of 8 (3 tiles a slice, 15 partials)
    took 37.2 + 6.1 us (flash + merge), 128 in clusters of 2 (2 tiles, 64 partials) 39.8 us
    in all (bench/results/mla-launches-2026-12-02-b15a625.json)."""
    return fitting(cluster_candidates(per, nsplit, sizes, max_clusters), nsplit, tiles)


def cluster_candidates(
    per: int, nsplit: int, sizes: Sequence[int], max_clusters: Callable[[int], int]
) -> tuple[tuple[int, int], ...]:
    """``cluster_choice``'s candidates before its tile rule, largest C first: (C, nsplit') for
    each C of ``sizes`` whose clusters fit at an nsplit' within ``FL_WAVE_LOSS`` of nsplit."""
    out = []
    for c in sorted(sizes, reverse=True):
        # nsplit rounded to a multiple of C: up where the clusters still fit (an odd one-wave
        # nsplit would otherwise lose its clusters to the tile rule), else down
        n = min(-(-nsplit // c) * c, max_clusters(c) * c // per // c * c)
        if n >= c and n >= (1 - FL_WAVE_LOSS) * nsplit:
            out.append((c, n))
    return tuple(out)


def fitting(cands: Sequence[tuple[int, int]], nsplit: int,
            tiles: Callable[[int], int] | None = None) -> tuple[int, int]:  # fmt: skip
    """``cluster_choice``'s tile rule: the first candidate (``cluster_candidates``) with no more
    tiles in its longest slice than at ``nsplit`` (``tiles``; None: any), else (1, nsplit)."""
    most = tiles(nsplit) if tiles is not None else 0
    for c, n in cands:
        if tiles is None or tiles(n) <= most:
            return c, n
    return 1, nsplit


def cluster_for(per: int, nsplit: int, sizes: Sequence[int],
                max_clusters: Callable[[int], int]) -> int:  # fmt: skip
    """The largest C of ``sizes`` that divides ``nsplit`` and whose ``per * nsplit / C``
    clusters are all resident at once; else 1. At the nsplit ``cluster_choice`` gives, this is
    its C."""
    for c in sorted(sizes, reverse=True):
        if nsplit % c == 0 and per * nsplit // c <= max_clusters(c):
            return c
    return 1


def flash_cluster(k: int, r: int, nsplit: int, s: int, heads: int) -> int:
    """C of ``flash_launch``: with ``FL_CLUSTER`` None, ``cluster_for``'s (at the nsplit of
    ``flash_splits``, the C it chose); a forced C where that variant exists and divides
    nsplit; else 1 (mla_flash + mla_merge)."""
    have = _cluster_sizes(k, r)
    if FL_CLUSTER is None:
        per = s * -(-heads // FL_HB)
        return cluster_for(per, nsplit, have, functools.partial(_max_clusters, k, r))
    return FL_CLUSTER if FL_CLUSTER in have and nsplit % FL_CLUSTER == 0 else 1


def _cluster_sizes(k: int, r: int) -> tuple[int, ...]:
    """The C of mla_flash_c (mla_flash_hc) at these widths (none where mla_flash does not serve
    them or the exchanged context does not fit in its Q and KV buffers)."""
    f16 = flash_f16(k, r)
    kp = _launch_kp(f16)
    geo = _flash_geometry(k, r, f16, kp)
    if geo is None:
        return ()
    ntc, qst, kst, _ = geo
    ast = -(-k // 32) * 32 + 8  # fl_ast: the exchanged context must fit in Qs + KVs
    if FL_HB * ast > FL_HB * qst + FL_TT * kst:
        return ()
    return FL_CLUSTERS.get(8 * kp * ntc, ())


_resident: dict[tuple, int] = {}


def _max_clusters(k: int, r: int, c: int) -> int:
    """Clusters of C mla_flash_c blocks at these widths resident at once on this device
    (asked of the driver once per device and widths)."""
    f16 = flash_f16(k, r)
    kp = _launch_kp(f16)
    key = (cupy.cuda.runtime.getDevice(), k, r, c, f16, kp)
    n = _resident.get(key)
    if n is None:
        ntc, _, _, smem = _flash_geometry(k, r, f16, kp)  # type: ignore[misc]
        fn = get_function("attention.cu", _flash_name(f16, ntc, c, kp), VARIANTS, smem)
        n = _resident[key] = max_active_clusters(fn, c, 128 * kp, smem)
    return n


def _flash_name(f16: bool, ntc: int, c: int, kp: int = 2) -> str:
    """The flash kernel's variant: mla_flash<NTC, KP> or, in clusters of C > 1,
    mla_flash_c<NTC, C, KP>; their fp16 forms (``f16``, KP 2) mla_flash_h and mla_flash_hc."""
    if f16:
        return f"mla_flash_hc<{ntc}, {c}>" if c > 1 else f"mla_flash_h<{ntc}>"
    return f"mla_flash_c<{ntc}, {c}, {kp}>" if c > 1 else f"mla_flash<{ntc}, {kp}>"


def qsplit_launch(s: int, heads: int, k: int, r: int) -> Launch | None:
    """mla_qsplit where the flash launch is mla_flash_h's (else None), taking three pointers:
    qs (per q row its fp16 hi and lo planes of ``krp16`` values), qe (int32 exponents, latent
    and rope, per q row) and qfull."""
    if not flash_f16(k, r):
        return None
    fn = get_function("attention.cu", "mla_qsplit", VARIANTS)
    rows = s * heads
    return Launch(fn, (-(-rows // 8),), (256,),
                  (np.int32(rows), np.int32(k), np.int32(r), np.int32(krp16(k, r))),
                  0)  # fmt: skip


def krp16(k: int, r: int) -> int:
    """mla_flash_h's staged row width: the latent and the rope each padded to 16 (no k16 step
    holds both)."""
    return -(-k // 16) * 16 + -(-r // 16) * 16


def flash_launch(s: int, heads: int, k: int, r: int, scale: float, nsplit: int
                 ) -> tuple[Launch, Launch | None]:  # fmt: skip
    """(mla_flash or mla_flash_c, mla_merge or None). The first takes six pointers: the five
    of ``attend_launch``'s attend, then cl (written by mla_flash_c when its clusters span
    nsplit: then there is no merge); the merge takes the same four as there. mla_flash_h and
    mla_flash_hc (``FL_F16``) take qs in qfull's place and qe after cl (``qsplit_launch``)."""
    dev = cupy.cuda.runtime.getDevice()

    def make() -> tuple[Launch, Launch | None]:
        f16 = flash_f16(k, r)
        kp = _launch_kp(f16)
        geo = _flash_geometry(k, r, f16, kp)
        assert geo is not None  # callers check flash_ok
        ntc, qst, kst, smem = geo
        c = flash_cluster(k, r, nsplit, s, heads)
        fn = get_function("attention.cu", _flash_name(f16, ntc, c, kp), VARIANTS, smem)
        att = Launch(fn, (nsplit, s, -(-heads // FL_HB)), (128 * kp,),
                     (np.int32(s), np.int32(heads), np.int32(k), np.int32(r), np.float32(scale),
                      np.int32(nsplit), np.int32(qst), np.int32(kst)), smem)  # fmt: skip
        return att, (None if c > 1 and nsplit == c else _merge(s, heads, k, nsplit // c))

    key = (dev, "flash", s, heads, k, r, float(scale), nsplit, FL_CLUSTER, FL_F16, FL_KP,
           MERGE_ZG)  # fmt: skip
    return _cached(key, make)  # type: ignore[return-value,arg-type]
