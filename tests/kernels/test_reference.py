"""The NumPy reference against the spec: NOTES.md test vectors, an independent dequantizer,
and naive per-(row, head) attention loops written here from the formulas."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from coliworker.kernels import reference as ref
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count

# Typical |quantized value| per format, so random tensors give outputs of order 1.
MAGNITUDE = {0: 1.0, 1: 64.0, 2: 4.0, 3: 1.5, 4: 4.0}


def random_qtensor(
    rng: np.random.Generator, fmt: int, out_features: int, in_features: int, group_size: int = 0
) -> QTensor:
    """Random bytes in the wire layout (random normal floats for fmt 0), never zeros."""
    if fmt == 0:
        w = rng.standard_normal(out_features * in_features).astype(np.float32)
        w /= np.float32(math.sqrt(in_features))
        return QTensor.from_arrays(w, None, 0, in_features, out_features)
    n_bytes = out_features * row_bytes(fmt, in_features)
    w = rng.integers(0, 256, n_bytes, dtype=np.uint8)
    n_scales = scale_count(fmt, in_features, out_features, group_size)
    s = rng.uniform(0.5, 1.5, n_scales) / (MAGNITUDE[fmt] * math.sqrt(in_features))
    return QTensor.from_arrays(w, s.astype(np.float32), fmt, in_features, out_features, group_size)


def naive_dequantize(t: QTensor) -> np.ndarray:
    """Element-wise index arithmetic straight from the NOTES.md table (no lookup tables)."""
    n_out, n_in, rb = t.out_features, t.in_features, t.row_bytes
    if t.fmt == 0:
        return np.frombuffer(t.weights.tobytes(), "<f4").reshape(n_out, n_in).astype(np.float64)
    o = np.arange(n_out)[:, None]
    i = np.arange(n_in)[None, :]
    q = t.weights.astype(np.int64)
    s = t.scales.astype(np.float64)
    if t.fmt == 1:
        b = q[o * rb + i]
        return (b - 256 * (b >= 128)) * s[o]
    if t.fmt == 3:
        return (((q[o * rb + i // 4] >> (2 * (i % 4))) & 3) - 2) * s[o]
    nib = (q[o * rb + i // 2] >> (4 * (i % 2))) & 15
    if t.fmt == 2:
        return (nib - 8) * s[o]
    n_groups = -(-n_in // t.group_size)
    return (nib - 8) * s[o * n_groups + i // t.group_size]


def assert_close(out: np.ndarray, want: np.ndarray, rel: float = 1e-6) -> None:
    """out (float32) against a float64 ``want``: max|out - want| <= rel * max|want|."""
    assert out.dtype == np.float32 and out.flags.c_contiguous
    assert out.shape == want.shape
    err = np.max(np.abs(out - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= rel, f"relative error {err:.3g} > {rel:.3g}"


# -- formats ---------------------------------------------------------------------------------

X_NOTES = np.array([[1, -2, 3, -4]], np.float32)


def test_notes_vector_int4() -> None:
    t = QTensor.from_arrays(
        np.array([0x70, 0xF8, 0xA9, 0xCB], np.uint8), np.array([1.0, 0.25]), 2, 4, 2
    )
    assert np.array_equal(ref.dequantize(t), [[-8, -1, 0, 7], [0.25, 0.5, 0.75, 1.0]])
    assert np.array_equal(ref.matmul(t, X_NOTES), [[-34, -2.5]])


def test_notes_vector_int2() -> None:
    t = QTensor.from_arrays(np.array([0xE4, 0x1B], np.uint8), np.array([0.5, 2.0]), 3, 4, 2)
    assert np.array_equal(ref.matmul(t, X_NOTES), [[-2, 12]])


def test_fmt4_is_not_int2(rng: np.random.Generator) -> None:
    """Seed bug 1: fmt 4 decoded as int2 with a row scale. One group = fmt 2 exactly."""
    t2 = random_qtensor(rng, 2, 5, 9)
    t4 = QTensor(4, 9, 5, 9, t2.weights, t2.scales)  # gs = I: one group per row
    assert np.array_equal(ref.dequantize(t4), ref.dequantize(t2))


@pytest.mark.parametrize("n_out", [1, 3, 17])
@pytest.mark.parametrize("n_in", [1, 3, 5, 7, 33, 130])
@pytest.mark.parametrize(
    "fmt, group_size",
    [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1), (4, 3), (4, 7), (4, 64)],
    ids=["f32", "int8", "int4", "int2", "int4g1", "int4g3", "int4g7", "int4g64"],
)
def test_dequantize_matches_independent(
    rng: np.random.Generator, fmt: int, group_size: int, n_in: int, n_out: int
) -> None:
    t = random_qtensor(rng, fmt, n_out, n_in, group_size)
    w = ref.dequantize(t)
    assert w.dtype == np.float64 and w.shape == (n_out, n_in) and w.flags.c_contiguous
    assert np.array_equal(w, naive_dequantize(t))


@pytest.mark.parametrize("fmt", [0, 1, 2, 3, 4])
def test_matmul_across_row_blocks(rng: np.random.Generator, fmt: int) -> None:
    """O large enough that matmul dequantizes several row blocks, the last one partial."""
    n_in = 131
    n_out = 3 * ref._block_rows(random_qtensor(rng, fmt, 1, n_in, 10)) + 5
    t = random_qtensor(rng, fmt, n_out, n_in, 10)
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    assert_close(ref.matmul(t, x), x.astype(np.float64) @ naive_dequantize(t).T)


def test_silu_is_stable() -> None:
    v = np.array([-1e4, -800.0, -30.0, -1.0, 0.0, 1.0, 30.0, 800.0, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = ref.silu(v)
    moderate = np.abs(v) < 100
    assert np.allclose(out[moderate], v[moderate] / (1 + np.exp(-v[moderate])), rtol=1e-15)
    assert np.array_equal(out[v >= 800], v[v >= 800])
    assert np.all(np.abs(out[v <= -800]) < 1e-300)


# -- experts ---------------------------------------------------------------------------------


def random_expert(rng, fmt, d, i_e, group_size=0):
    return (
        random_qtensor(rng, fmt, i_e, d, group_size),
        random_qtensor(rng, fmt, i_e, d, group_size),
        random_qtensor(rng, fmt, d, i_e, group_size),
    )


def naive_expert(expert, x):
    gate, up, down = (naive_dequantize(t) for t in expert)
    x = x.astype(np.float64)
    g = x @ gate.T
    return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("fmt", [0, 1, 2, 3, 4])
def test_expert_mlp(rng: np.random.Generator, fmt: int) -> None:
    expert = random_expert(rng, fmt, 37, 23, group_size=5)
    x = rng.standard_normal((4, 37)).astype(np.float32)
    assert_close(ref.expert_mlp(*expert, x), naive_expert(expert, x))


def test_expert_group_is_per_expert_mlp(rng: np.random.Generator) -> None:
    experts = [random_expert(rng, fmt, 33, 19, 7) for fmt in (2, 4, 0, 3, 1)]
    rows = [1, 3, 0, 5, 2]
    x = rng.standard_normal((sum(rows), 33)).astype(np.float32)
    y = ref.expert_group(experts, rows, x)
    assert y.shape == x.shape and y.dtype == np.float32 and y.flags.c_contiguous
    start = 0
    for expert, n in zip(experts, rows, strict=True):
        want = ref.expert_mlp(*expert, x[start : start + n])
        assert np.array_equal(y[start : start + n], want)
        start += n


def test_expert_group_routed_is_weighted_sum(rng: np.random.Generator) -> None:
    experts = [random_expert(rng, fmt, 21, 13, 4) for fmt in (2, 4, 3, 1)]
    n_tok, top_k = 6, 3
    routes = rng.integers(0, len(experts), (n_tok, top_k)).astype(np.int32)
    routes[0] = [2, 2, 1]  # one token routed twice to the same expert
    weights = rng.uniform(0.1, 1.0, (n_tok, top_k)).astype(np.float32)
    x = rng.standard_normal((n_tok, 21)).astype(np.float32)
    want = np.zeros((n_tok, 21))
    for t in range(n_tok):
        for j in range(top_k):
            want[t] += weights[t, j] * naive_expert(experts[routes[t, j]], x[t : t + 1])[0]
    assert_close(ref.expert_group_routed(experts, x, routes, weights), want)


def test_glm52_decode_expert_group_time(rng: np.random.Generator) -> None:
    """GLM-5.2 decode: 8 int4 experts (gate/up [2048, 6144], down [6144, 2048]) x 1 row."""
    experts = [random_expert(rng, 2, 6144, 2048) for _ in range(8)]
    x = np.repeat(rng.standard_normal((1, 6144)).astype(np.float32), 8, axis=0)
    start = time.perf_counter()
    y = ref.expert_group(experts, [1] * 8, x)
    elapsed = time.perf_counter() - start
    print(f"GLM-5.2 decode expert group (8 x int4 experts, 1 row each): {elapsed * 1e3:.0f} ms")
    assert np.isfinite(y).all()
    assert np.array_equal(y[3], ref.expert_mlp(*experts[3], x[3:4])[0])


# -- attention -------------------------------------------------------------------------------

H, Q, R, V, K = 3, 5, 3, 4, 7
SCALE = 1 / math.sqrt(Q + R)


def naive_attention_row(w, qrow, latent, rope, n_visible):
    """One query row, all heads, from the NOTES.md formulas: float64 [H, V]."""
    ctx = np.zeros((H, V))
    for h in range(H):
        base = h * (Q + V)
        qa = np.array([sum(qrow[h, d] * w[base + d, k] for d in range(Q)) for k in range(K)])
        scores = np.array(
            [(qa @ latent[t] + qrow[h, Q:] @ rope[t]) * SCALE for t in range(n_visible)]
        )
        p = np.exp(scores - scores.max())
        p /= p.sum()
        cl = sum(p[t] * latent[t] for t in range(n_visible))
        for v in range(V):
            ctx[h, v] = cl @ w[base + Q + v]
    return ctx


def random_attention_inputs(rng, fmt, n_rows, n_ctx):
    kv_b = random_qtensor(rng, fmt, H * (Q + V), K, 3)
    o_proj = random_qtensor(rng, fmt, 11, H * V, 5)
    q = rng.standard_normal((n_rows, H, Q + R)).astype(np.float32)
    latent = rng.standard_normal((n_ctx, K)).astype(np.float32)
    rope = rng.standard_normal((n_ctx, R)).astype(np.float32)
    return kv_b, o_proj, q, latent, rope


def project(o_proj, ctx, use_proj):
    return ctx.reshape(ctx.shape[0], -1) @ naive_dequantize(o_proj).T if use_proj else ctx


@pytest.mark.parametrize("use_proj", [False, True], ids=["ctx", "o_proj"])
@pytest.mark.parametrize("n_rows", [1, 3])
@pytest.mark.parametrize("fmt", [0, 2, 4])
def test_attention_matches_naive(rng, fmt: int, n_rows: int, use_proj: bool) -> None:
    n_ctx = 9
    kv_b, o_proj, q, latent, rope = random_attention_inputs(rng, fmt, n_rows, n_ctx)
    w = naive_dequantize(kv_b)
    ctx = np.stack(
        [
            naive_attention_row(w, q[s].astype(np.float64), latent, rope, n_ctx - n_rows + s + 1)
            for s in range(n_rows)
        ]
    )
    out = ref.attention(kv_b, o_proj if use_proj else None, q, latent, rope, Q, R, V, SCALE)
    assert_close(out, project(o_proj, ctx, use_proj))


def test_attention_is_causal(rng: np.random.Generator) -> None:
    n_rows, n_ctx = 3, 7
    kv_b, _, q, latent, rope = random_attention_inputs(rng, 2, n_rows, n_ctx)
    before = ref.attention(kv_b, None, q, latent, rope, Q, R, V, SCALE)
    first_unseen = n_ctx - n_rows + 1  # row 0 sees rows 0 .. n_ctx - n_rows
    latent[first_unseen:] = rng.standard_normal((n_ctx - first_unseen, K))
    rope[first_unseen:] = rng.standard_normal((n_ctx - first_unseen, R))
    after = ref.attention(kv_b, None, q, latent, rope, Q, R, V, SCALE)
    assert np.array_equal(after[0], before[0])
    assert not np.array_equal(after[1], before[1])
    assert not np.array_equal(after[2], before[2])


@pytest.mark.parametrize("use_proj", [False, True], ids=["ctx", "o_proj"])
@pytest.mark.parametrize("fmt", [1, 3, 4])
def test_attention_ragged_matches_naive(rng, fmt: int, use_proj: bool) -> None:
    lengths = [1, 4, 9]
    kv_b, o_proj, q, _, _ = random_attention_inputs(rng, fmt, len(lengths), 0)
    latents = [rng.standard_normal((n, K)).astype(np.float32) for n in lengths]
    ropes = [rng.standard_normal((n, R)).astype(np.float32) for n in lengths]
    w = naive_dequantize(kv_b)
    ctx = np.stack(
        [
            naive_attention_row(w, q[s].astype(np.float64), latents[s], ropes[s], n)
            for s, n in enumerate(lengths)
        ]
    )
    proj = o_proj if use_proj else None
    out = ref.attention_ragged(kv_b, proj, q, latents, ropes, Q, R, V, SCALE)
    assert_close(out, project(o_proj, ctx, use_proj))
    for s in range(len(lengths)):
        one = ref.attention(kv_b, proj, q[s : s + 1], latents[s], ropes[s], Q, R, V, SCALE)
        assert np.array_equal(out[s], one[0])


def test_glm52_attention_time(rng: np.random.Generator) -> None:
    """GLM-5.2 decode attention: H=64, Q=192, R=64, V=256, K=512, T=4096, int4 weights."""
    h, q_dim, r_dim, v_dim, k_dim, n_ctx = 64, 192, 64, 256, 512, 4096
    kv_b = random_qtensor(rng, 4, h * (q_dim + v_dim), k_dim, 64)
    o_proj = random_qtensor(rng, 4, 6144, h * v_dim, 64)
    q = rng.standard_normal((1, h, q_dim + r_dim)).astype(np.float32)
    latent = rng.standard_normal((n_ctx, k_dim)).astype(np.float32)
    rope = rng.standard_normal((n_ctx, r_dim)).astype(np.float32)
    scale = 1 / math.sqrt(q_dim + r_dim)
    start = time.perf_counter()
    out = ref.attention(kv_b, o_proj, q, latent, rope, q_dim, r_dim, v_dim, scale)
    elapsed = time.perf_counter() - start
    print(f"GLM-5.2 attention (T=4096, S=1, with o_proj): {elapsed * 1e3:.0f} ms")
    assert out.shape == (1, 6144) and np.isfinite(out).all()
