"""The NumPy reference: the oracle every backend and kernel is checked against.

Pure functions, one per operation, with the backend's names. Everything is computed in
float64 from exactly dequantized weights (every format's ``W[o, i]`` is exact in float64),
and activations come back as float32, C-contiguous, like a backend's results.

Weights are :class:`~coliworker.kernels.qtensor.QTensor` (row-major ``[O, I]``, the byte
layout in ``qtensor.py``). Products never materialize a whole float64 weight matrix: rows
are dequantized in blocks of about 1 MiB (``_BLOCK_ELEMENTS``), which stay in cache while
BLAS multiplies them; that is what makes a GLM-5.2 decode expert group (24 tensors of 12.6 M
weights each) take a fraction of a second on two cores instead of several seconds.

Integer unpacking is one gather per block: a 256-entry table maps a byte to its 2 (int4)
or 4 (int2) signed values, packed into one int16 / int32 item so ``take`` moves one word.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coliworker.kernels.qtensor import QTensor

__all__ = [
    "attention",
    "attention_ragged",
    "dequantize",
    "expert_group",
    "expert_group_routed",
    "expert_mlp",
    "matmul",
    "silu",
]

_BLOCK_ELEMENTS = 1 << 17  # float64 weights dequantized at once: 1 MiB, about L2-sized

_BYTES = np.arange(256)


def _byte_table(fields: list[np.ndarray], word: type[np.integer]) -> np.ndarray:
    """256 entries: byte -> its signed values as int8, packed into one ``word`` item."""
    return np.stack(fields, axis=1).astype(np.int8).view(word).reshape(256)


# int4: byte -> (low nibble - 8, high nibble - 8), elements 2j and 2j+1.
_INT4_LUT = _byte_table([(_BYTES & 15) - 8, (_BYTES >> 4) - 8], np.int16)
# int2: byte -> four (2-bit field - 2) values, element i at bits 2*(i%4).
_INT2_LUT = _byte_table([((_BYTES >> (2 * k)) & 3) - 2 for k in range(4)], np.int32)


def _dequantize_rows(t: QTensor, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``t`` dequantized: float64 [stop - start, I] (exact)."""
    n_in = t.in_features
    rb = t.row_bytes
    q = t.weights[start * rb : stop * rb].reshape(stop - start, rb)
    if t.fmt == 0:
        return q.view(np.float32).astype(np.float64)
    if t.fmt == 1:
        values = q.view(np.int8)
    else:
        lut = _INT2_LUT if t.fmt == 3 else _INT4_LUT
        values = lut.take(q).view(np.int8)[:, :n_in]  # one gather; drops the row padding
    if t.fmt != 4:
        return values * t.scales[start:stop, None].astype(np.float64)
    # fmt 4: scales [O, ng], group g covers inputs g*gs .. min((g+1)*gs, I) - 1.
    n_groups = -(-n_in // t.group_size)
    groups = t.scales.reshape(-1, n_groups)[start:stop].astype(np.float64)
    return values * np.repeat(groups, t.group_size, axis=1)[:, :n_in]


def dequantize(t: QTensor) -> np.ndarray:
    """The exact dequantized weights of ``t``: float64 [O, I], C-contiguous.

    t: any format 0..4, any I (odd I for int4, I % 4 != 0 for int2: the row padding is dropped),
    fmt 4 with any positive group size, including one that does not divide I.
    """
    return np.ascontiguousarray(_dequantize_rows(t, 0, t.out_features))


def _block_rows(t: QTensor) -> int:
    return max(1, _BLOCK_ELEMENTS // max(1, t.in_features))


def _matmul64(w: QTensor, x: np.ndarray) -> np.ndarray:
    """x float64 [S, I] -> x @ W^T float64 [S, O], dequantizing W a block of rows at a time."""
    x = np.asarray(x, dtype=np.float64)
    y = np.empty((x.shape[0], w.out_features), np.float64)
    step = _block_rows(w)
    for start in range(0, w.out_features, step):
        stop = min(start + step, w.out_features)
        y[:, start:stop] = x @ _dequantize_rows(w, start, stop).T
    return y


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def matmul(w: QTensor, x: np.ndarray) -> np.ndarray:
    """x float32 [S, I] -> y = x @ W^T, float32 [S, O]."""
    return _f32(_matmul64(w, x))


def silu(v: np.ndarray) -> np.ndarray:
    """silu(v) = v / (1 + exp(-v)) elementwise: float array, any shape -> float64, same shape.

    Written with exp(-|v|) so no intermediate overflows for large |v|.
    """
    v = np.asarray(v, dtype=np.float64)
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, v / (1.0 + e), v * e / (1.0 + e))


def _expert_mlp64(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray) -> np.ndarray:
    h = silu(_matmul64(gate, x)) * _matmul64(up, x)
    return _matmul64(down, h)


def expert_mlp(gate: QTensor, up: QTensor, down: QTensor, x: np.ndarray) -> np.ndarray:
    """One expert: gate, up [I_e, D], down [D, I_e]; x float32 [S, D]
    -> down(silu(gate x) * up x) float32 [S, D] (the hidden [S, I_e] stays float64)."""
    return _f32(_expert_mlp64(gate, up, down, x))


def expert_group(
    experts: Sequence[tuple[QTensor, QTensor, QTensor]], rows: Sequence[int], x: np.ndarray
) -> np.ndarray:
    """Many experts, each on its own rows: experts[c] = (gate, up, down) as in ``expert_mlp``;
    x float32 [sum(rows), D] with rows[c] consecutive rows for expert c, in order
    -> y float32 [sum(rows), D] packed the same way. Experts with 0 rows are skipped."""
    y = np.zeros(np.shape(x), np.float32)
    start = 0
    for (gate, up, down), n in zip(experts, rows, strict=True):
        if n > 0:
            y[start : start + n] = _expert_mlp64(gate, up, down, x[start : start + n])
        start += n
    return y


def expert_group_routed(
    experts: Sequence[tuple[QTensor, QTensor, QTensor]],
    x: np.ndarray,
    routes: np.ndarray,
    weights: np.ndarray,
) -> np.ndarray:
    """Routed MoE: x float32 [T, D]; routes int32 [T, K] index ``experts``; weights float32
    [T, K] -> y float32 [T, D], y[t] = sum_j weights[t, j] * expert_{routes[t, j]}(x[t]).

    Tokens are grouped per expert, so each expert's weights are read once.
    """
    x = np.asarray(x)
    routes = np.asarray(routes)
    weights = np.asarray(weights, dtype=np.float64)
    y = np.zeros(x.shape, np.float64)
    for e in np.unique(routes):
        tokens, slots = np.nonzero(routes == e)
        out = _expert_mlp64(*experts[int(e)], x[tokens])
        np.add.at(y, tokens, weights[tokens, slots, None] * out)
    return _f32(y)


def _split_kv_b(kv_b: QTensor, n_heads: int, q_dim: int, v_dim: int):
    """kv_b [H*(Q+V), K] -> (w_k float64 [H, Q, K] "k_nope", w_v float64 [H, V, K] "value")."""
    w = dequantize(kv_b).reshape(n_heads, q_dim + v_dim, kv_b.in_features)
    return w[:, :q_dim], w[:, q_dim:]


def _mla_context(
    w_k: np.ndarray,
    w_v: np.ndarray,
    q: np.ndarray,
    latent: np.ndarray,
    rope: np.ndarray,
    q_dim: int,
    scale: float,
) -> np.ndarray:
    """Causal absorbed MLA over one sequence, float64 throughout.

    w_k [H, Q, K], w_v [H, V, K]; q [S, H, Q+R]; latent [T, K]; rope [T, R]. Row s sees the
    first T - S + s + 1 rows (all T when S == 1); a row that sees none gets zeros.
    Returns ctx float64 [S, H, V].
    """
    n_seq, n_heads = q.shape[0], q.shape[1]
    n_ctx = latent.shape[0]
    q = np.asarray(q, dtype=np.float64).transpose(1, 0, 2)  # [H, S, Q+R]
    latent = np.asarray(latent, dtype=np.float64)
    rope = np.asarray(rope, dtype=np.float64)
    visible = n_ctx - n_seq + np.arange(n_seq) + 1  # [S] rows each query sees
    masked = np.arange(n_ctx)[None, :] >= visible[:, None]  # [S, T]
    ctx = np.zeros((n_heads, n_seq, w_v.shape[1]), np.float64)
    if n_ctx == 0:
        return ctx.transpose(1, 0, 2)
    # Heads in chunks so the [h, S, T] scores stay near 16 M elements for long prefill.
    chunk = max(1, (1 << 24) // max(1, n_seq * n_ctx))
    for h0 in range(0, n_heads, chunk):
        h1 = min(h0 + chunk, n_heads)
        qa = q[h0:h1, :, :q_dim] @ w_k[h0:h1]  # [h, S, K]: q_nope absorbed into latent space
        scores = qa @ latent.T + q[h0:h1, :, q_dim:] @ rope.T  # [h, S, T]
        scores *= scale
        scores[:, masked] = -np.inf
        peak = scores.max(axis=-1, keepdims=True)
        peak[~np.isfinite(peak)] = 0.0  # rows that see nothing: exp(-inf) = 0 below
        p = np.exp(scores - peak)
        total = p.sum(axis=-1, keepdims=True)
        p /= np.where(total > 0, total, 1.0)
        ctx[h0:h1] = (p @ latent) @ w_v[h0:h1].transpose(0, 2, 1)  # [h, S, V]
    return ctx.transpose(1, 0, 2)


def _project(o_proj: QTensor | None, ctx: np.ndarray) -> np.ndarray:
    """ctx float64 [S, H, V] -> float32 ctx, or ctx [S, H*V] @ o_proj^T float32 [S, D_out]."""
    if o_proj is None:
        return _f32(ctx)
    return _f32(_matmul64(o_proj, ctx.reshape(ctx.shape[0], -1)))


def attention(
    kv_b: QTensor,
    o_proj: QTensor | None,
    q: np.ndarray,
    latent: np.ndarray,
    rope: np.ndarray,
    q_dim: int,
    rope_dim: int,
    v_dim: int,
    scale: float,
) -> np.ndarray:
    """Causal MLA absorbed attention over one sequence (NOTES.md, "MLA absorbed attention").

    kv_b: [H*(Q+V), K], per head Q "k_nope" rows then V "value" rows.
    o_proj: [D_out, H*V] or None.
    q: float32 [S, H, Q+R], per head Q nope values then R rope values.
    latent: float32 [T, K]; rope: float32 [T, R]; query row s sees the first T - S + s + 1.
    scale: multiplies the scores before the softmax (GLM-5.2: 1/sqrt(Q+R)).
    Returns ctx float32 [S, H, V], or float32 [S, D_out] with o_proj.
    """
    del rope_dim  # implied by q and rope; kept so every backend has one signature
    w_k, w_v = _split_kv_b(kv_b, q.shape[1], q_dim, v_dim)
    return _project(o_proj, _mla_context(w_k, w_v, q, latent, rope, q_dim, scale))


def attention_ragged(
    kv_b: QTensor,
    o_proj: QTensor | None,
    q: np.ndarray,
    latents: Sequence[np.ndarray],
    ropes: Sequence[np.ndarray],
    q_dim: int,
    rope_dim: int,
    v_dim: int,
    scale: float,
) -> np.ndarray:
    """MLA absorbed attention, one query row per sequence: row s of q float32 [S, H, Q+R]
    attends all rows of latents[s] float32 [T_s, K] and ropes[s] float32 [T_s, R].

    kv_b, o_proj, q_dim, v_dim, scale as in ``attention``. Returns ctx float32 [S, H, V], or
    float32 [S, D_out] with o_proj.
    """
    del rope_dim
    n_heads = q.shape[1]
    w_k, w_v = _split_kv_b(kv_b, n_heads, q_dim, v_dim)
    ctx = np.zeros((q.shape[0], n_heads, v_dim), np.float64)
    for s, (latent, rope) in enumerate(zip(latents, ropes, strict=True)):
        ctx[s] = _mla_context(w_k, w_v, q[s : s + 1], latent, rope, q_dim, scale)[0]
    return _project(o_proj, ctx)
