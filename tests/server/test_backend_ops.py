"""Every backend against the NumPy reference, through the Backend protocol only.

Runs once per backend (the ``backend`` fixture in conftest.py): formats 0..4 (fmt 4 also
with a group size that does not divide I), odd shapes, one GLM-5.2 shape, issue/take,
routed experts, causal and ragged MLA attention with KV caches. Results are checked by
relative error ``max|y - ref| / max|ref|`` against ``TOLERANCE[fmt]``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from coliworker.kernels import reference as ref
from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count
from coliworker.server.backend import Result

# Backends accumulate in float32 (NumPy: float64 then rounded, about 1e-7).
TOLERANCE = {0: 1e-3, 1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3}

FORMATS = [
    pytest.param(0, 0, id="f32"),
    pytest.param(1, 0, id="int8"),
    pytest.param(2, 0, id="int4"),
    pytest.param(3, 0, id="int2"),
    pytest.param(4, 64, id="int4g64"),
    pytest.param(4, 5, id="int4g5"),
]

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
    w = rng.integers(0, 256, out_features * row_bytes(fmt, in_features), dtype=np.uint8)
    n_scales = scale_count(fmt, in_features, out_features, group_size)
    s = rng.uniform(0.5, 1.5, n_scales) / (MAGNITUDE[fmt] * math.sqrt(in_features))
    return QTensor.from_arrays(w, s.astype(np.float32), fmt, in_features, out_features, group_size)


def random_expert(rng, fmt, d, i_e, group_size=0):
    """(gate [i_e, d], up [i_e, d], down [d, i_e]) QTensors."""
    return (
        random_qtensor(rng, fmt, i_e, d, group_size),
        random_qtensor(rng, fmt, i_e, d, group_size),
        random_qtensor(rng, fmt, d, i_e, group_size),
    )


def rows_of(rng, n, width):
    return rng.standard_normal((n, width)).astype(np.float32)


def check(result: Result, want: np.ndarray, tol: float) -> None:
    out = result.out
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
    assert out.shape == want.shape
    assert result.phases.total_ns >= 0
    err = float(np.max(np.abs(out.astype(np.float64) - want)) / np.max(np.abs(want)))
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


# -- devices and residency -------------------------------------------------------------------


def test_devices(backend) -> None:
    devices = backend.devices()
    assert devices and [d.id for d in devices] == sorted(d.id for d in devices)
    for d in devices:
        assert d.name and 0 <= d.free_memory_bytes <= d.total_memory_bytes


@pytest.mark.parametrize("fmt, gs", FORMATS)
@pytest.mark.parametrize("n_rows", [1, 3])
def test_matmul(backend, rng, fmt: int, gs: int, n_rows: int) -> None:
    t = random_qtensor(rng, fmt, 19, 131, gs)
    w = backend.place(t, 0)
    assert w.device == 0 and w.nbytes >= t.nbytes
    x = rows_of(rng, n_rows, 131)
    check(backend.matmul(w, x), ref.matmul(t, x), TOLERANCE[fmt])


def test_place_copies_caller_arrays(backend, rng) -> None:
    t = random_qtensor(rng, 2, 9, 40)
    w = backend.place(t, 0)
    x = rows_of(rng, 2, 40)
    want = ref.matmul(t, x)
    t.weights[:] = rng.integers(0, 256, t.weights.size, dtype=np.uint8)
    t.scales[:] *= 3
    check(backend.matmul(w, x), want, TOLERANCE[2])


def test_replace_changes_results(backend, rng) -> None:
    a = random_qtensor(rng, 4, 23, 100, 64)
    b = random_qtensor(rng, 4, 23, 100, 64)
    w = backend.place(a, 0)
    x = rows_of(rng, 2, 100)
    check(backend.matmul(w, x), ref.matmul(a, x), TOLERANCE[4])
    backend.replace(w, b)
    check(backend.matmul(w, x), ref.matmul(b, x), TOLERANCE[4])


def test_release(backend, rng) -> None:
    a, b = random_qtensor(rng, 1, 7, 30), random_qtensor(rng, 3, 7, 30)
    wa, wb = backend.place(a, 0), backend.place(b, 0)
    backend.release(wa)
    x = rows_of(rng, 1, 30)
    check(backend.matmul(wb, x), ref.matmul(b, x), TOLERANCE[3])
    wa = backend.place(a, 0)
    check(backend.matmul(wa, x), ref.matmul(a, x), TOLERANCE[1])
    backend.release(wa)
    backend.release(wb)


def test_devices_keep_separate_residents(backend, rng) -> None:
    """The same spec placed on the first and last device (the same one on 1-device hosts)."""
    first, last = backend.devices()[0].id, backend.devices()[-1].id
    a, b = random_qtensor(rng, 2, 11, 50), random_qtensor(rng, 2, 11, 50)
    wa, wb = backend.place(a, first), backend.place(b, last)
    assert (wa.device, wb.device) == (first, last)
    x = rows_of(rng, 3, 50)
    check(backend.matmul(wa, x), ref.matmul(a, x), TOLERANCE[2])
    check(backend.matmul(wb, x), ref.matmul(b, x), TOLERANCE[2])


# -- experts ---------------------------------------------------------------------------------


def place_expert(backend, expert, device=0):
    return tuple(backend.place(t, device) for t in expert)


@pytest.mark.parametrize("fmt, gs", FORMATS)
def test_expert_mlp(backend, rng, fmt: int, gs: int) -> None:
    expert = random_expert(rng, fmt, 67, 45, gs)
    x = rows_of(rng, 3, 67)
    got = backend.expert_mlp(*place_expert(backend, expert), x)
    check(got, ref.expert_mlp(*expert, x), TOLERANCE[fmt])


def mixed_group(rng, d=75, i_e=37):
    """Six experts, one per format (fmt 4 twice), and rows including 1 and odd counts."""
    formats = [(2, 0), (4, 64), (0, 0), (3, 0), (1, 0), (4, 5)]
    experts = [random_expert(rng, fmt, d, i_e, gs) for fmt, gs in formats]
    rows = [1, 3, 1, 7, 2, 5]
    return experts, rows, rows_of(rng, sum(rows), d)


def test_expert_group(backend, rng) -> None:
    experts, rows, x = mixed_group(rng)
    placed = [place_expert(backend, e) for e in experts]
    check(backend.expert_group(placed, rows, x), ref.expert_group(experts, rows, x), 1e-3)


def test_expert_group_glm52_decode(backend, rng) -> None:
    """The real decode shape: 8 experts (D=6144, I_e=2048, int4 gs=64) x 1 row each."""
    experts = [random_expert(rng, 4, 6144, 2048, 64) for _ in range(8)]
    placed = [place_expert(backend, e) for e in experts]
    x = np.repeat(rows_of(rng, 1, 6144), 8, axis=0)
    rows = [1] * 8
    check(backend.expert_group(placed, rows, x), ref.expert_group(experts, rows, x), TOLERANCE[4])


def test_expert_group_issue_is_bit_identical(backend, rng) -> None:
    """Several groups outstanding at once, a sync call in between, taken in reverse order."""
    experts, rows, _ = mixed_group(rng)
    placed = [place_expert(backend, e) for e in experts]
    inputs = [rows_of(rng, sum(rows), 75) for _ in range(3)]
    pending = [backend.expert_group_issue(placed, rows, x) for x in inputs]
    sync = [backend.expert_group(placed, rows, x).out for x in inputs]
    for x in inputs:
        x[:] = 0  # callers may reuse their buffers once issue returns
    for p, want in reversed(list(zip(pending, sync, strict=True))):
        out = p.result().out
        assert out.dtype == np.float32 and np.array_equal(out, want)


def test_expert_group_routed(backend, rng) -> None:
    formats = [(2, 0), (4, 64), (3, 0), (1, 0), (4, 5)]
    experts = [random_expert(rng, fmt, 53, 29, gs) for fmt, gs in formats]
    placed = [place_expert(backend, e) for e in experts]
    n_tok, top_k = 7, 3
    routes = rng.integers(0, len(experts), (n_tok, top_k)).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (n_tok, top_k)).astype(np.float32)
    x = rows_of(rng, n_tok, 53)
    got = backend.expert_group_routed(placed, x, routes, weights)
    check(got, ref.expert_group_routed(experts, x, routes, weights), 1e-3)


@pytest.mark.parametrize(
    "routes",
    [
        [[3, 0, 2]],  # one decode token: every expert reads row 0 in place
        [[0, 1], [0, 1], [2, 1]],  # consecutive rows per expert: read in place
        [[0, 1], [2, 3], [0, 3]],  # expert 0 reads rows 0 and 2: packed copy
        [[1, 1], [2, 0]],  # a token routed twice to one expert: packed copy
    ],
)
def test_expert_group_routed_row_patterns(backend, rng, routes) -> None:
    """The routed group reads x in place or through a packed copy; both give the weighted sum."""
    experts = [random_expert(rng, 2, 40, 24) for _ in range(4)]
    placed = [place_expert(backend, e) for e in experts]
    r = np.asarray(routes, np.int32)
    weights = rng.uniform(-1.0, 1.0, r.shape).astype(np.float32)
    x = rows_of(rng, r.shape[0], 40)
    got = backend.expert_group_routed(placed, x, r, weights)
    check(got, ref.expert_group_routed(experts, x, r, weights), TOLERANCE[2])


# -- attention -------------------------------------------------------------------------------

H, Q, R, V, K = 3, 7, 5, 6, 33
SCALE = 1 / math.sqrt(Q + R)


def attention_weights(rng, fmt, gs, n_heads=H, q_dim=Q, v_dim=V, k_dim=K, d_out=19):
    return (
        random_qtensor(rng, fmt, n_heads * (q_dim + v_dim), k_dim, gs),
        random_qtensor(rng, fmt, d_out, n_heads * v_dim, gs),
    )


@pytest.mark.parametrize("use_proj", [False, True], ids=["ctx", "o_proj"])
@pytest.mark.parametrize("n_rows", [1, 4])
@pytest.mark.parametrize("fmt, gs", FORMATS)
def test_attention(backend, rng, fmt: int, gs: int, n_rows: int, use_proj: bool) -> None:
    n_ctx = 13
    kv_b, o_proj = attention_weights(rng, fmt, gs)
    proj = o_proj if use_proj else None
    q = rng.standard_normal((n_rows, H, Q + R)).astype(np.float32)
    latent, rope = rows_of(rng, n_ctx, K), rows_of(rng, n_ctx, R)
    got = backend.attention(
        backend.place(kv_b, 0),
        backend.place(o_proj, 0) if use_proj else None,
        q,
        latent,
        rope,
        Q,
        R,
        V,
        SCALE,
    )
    want = ref.attention(kv_b, proj, q, latent, rope, Q, R, V, SCALE)
    check(got, want, TOLERANCE[fmt])


class HostKV:
    """A backend KV cache and the host copy of the rows it should hold."""

    def __init__(self, backend, k: int, r: int) -> None:
        self.cache = backend.new_kv(0, k, r)
        self.latent = np.zeros((0, k), np.float32)
        self.rope = np.zeros((0, r), np.float32)

    def append(self, rng, n: int) -> None:
        latent, rope = rows_of(rng, n, self.latent.shape[1]), rows_of(rng, n, self.rope.shape[1])
        self.cache.append(latent, rope)
        self.latent = np.concatenate([self.latent, latent])
        self.rope = np.concatenate([self.rope, rope])
        latent[:] = 0  # the cache holds its own copy
        self.check_size()

    def truncate(self, n: int) -> None:
        self.cache.truncate(n)
        self.latent, self.rope = self.latent[:n], self.rope[:n]
        self.check_size()

    def check_size(self) -> None:
        row = 4 * (self.latent.shape[1] + self.rope.shape[1])
        assert self.cache.length == len(self.latent)
        assert self.cache.nbytes >= self.cache.length * row and self.cache.nbytes % row == 0


def check_ragged(backend, rng, caches, weights, placed, dims, tol) -> None:
    """attention_ragged over ``caches`` against the reference over their host rows.

    weights: (kv_b, o_proj or None) QTensors; placed: the same as backend residents.
    dims: (H, Q, R, V, scale).
    """
    h, q_dim, r_dim, v_dim, scale = dims
    q = rng.standard_normal((len(caches), h, q_dim + r_dim)).astype(np.float32)
    got = backend.attention_ragged(*placed, q, [c.cache for c in caches], *dims[1:])
    latents, ropes = [c.latent for c in caches], [c.rope for c in caches]
    check(got, ref.attention_ragged(*weights, q, latents, ropes, q_dim, r_dim, v_dim, scale), tol)


@pytest.mark.parametrize("use_proj", [False, True], ids=["ctx", "o_proj"])
@pytest.mark.parametrize("fmt, gs", [(2, 0), (4, 5), (0, 0)], ids=["int4", "int4g5", "f32"])
def test_kv_append_truncate_attention_ragged(backend, rng, fmt, gs, use_proj) -> None:
    kv_b, o_proj = attention_weights(rng, fmt, gs)
    weights = (kv_b, o_proj if use_proj else None)
    placed = tuple(None if t is None else backend.place(t, 0) for t in weights)
    dims = (H, Q, R, V, SCALE)
    caches = [HostKV(backend, K, R) for _ in range(3)]
    for c, n in zip(caches, [1, 5, 70], strict=True):  # 70 crosses a 64-row page
        c.append(rng, n)
    check_ragged(backend, rng, caches, weights, placed, dims, TOLERANCE[fmt])
    caches[2].truncate(33)  # rollback, then rewrite the rolled-back rows
    caches[2].append(rng, 2)
    caches[1].append(rng, 1)  # one decode step
    caches[0].append(rng, 130)  # grows past several pages at once
    check_ragged(backend, rng, caches, weights, placed, dims, TOLERANCE[fmt])
    caches[2].truncate(1)
    check_ragged(backend, rng, caches, weights, placed, dims, TOLERANCE[fmt])
    for c in caches:
        c.cache.release()


def test_attention_ragged_glm52_shape(backend, rng) -> None:
    """GLM-5.2 widths (H=64, Q=192, R=64, V=256, K=512, o_proj [6144, 16384], int4 gs=64)."""
    h, q_dim, r_dim, v_dim, k_dim = 64, 192, 64, 256, 512
    kv_b, o_proj = attention_weights(rng, 4, 64, h, q_dim, v_dim, k_dim, d_out=6144)
    caches = [HostKV(backend, k_dim, r_dim) for _ in range(2)]
    caches[0].append(rng, 1)
    caches[1].append(rng, 257)
    dims = (h, q_dim, r_dim, v_dim, 1 / math.sqrt(q_dim + r_dim))
    placed = (backend.place(kv_b, 0), backend.place(o_proj, 0))
    check_ragged(backend, rng, caches, (kv_b, o_proj), placed, dims, TOLERANCE[4])


def test_attention_ragged_carries_new_rows(backend, rng) -> None:
    """Rows passed with the call (none, one, several, across a page, onto an empty cache,
    after a rollback) are attended by it and held afterwards, as private copies."""
    kv_b, o_proj = attention_weights(rng, 2, 0)
    weights = (kv_b, o_proj)
    placed = (backend.place(kv_b, 0), backend.place(o_proj, 0))
    dims = (H, Q, R, V, SCALE)
    caches = [HostKV(backend, K, R) for _ in range(5)]
    for c, n in zip(caches, [3, 1, 62, 0, 40], strict=True):
        if n:
            c.append(rng, n)
    caches[4].truncate(17)
    rows = [(rows_of(rng, n, K), rows_of(rng, n, R)) for n in (0, 1, 5, 2, 1)]
    for c, (lat, rop) in zip(caches, rows, strict=True):
        c.cache.reserve(len(lat))
        c.latent = np.concatenate([c.latent, lat])
        c.rope = np.concatenate([c.rope, rop])
    q = rng.standard_normal((len(caches), H, Q + R)).astype(np.float32)
    got = backend.attention_ragged(*placed, q, [c.cache for c in caches], Q, R, V, SCALE,
                                   rows=rows)  # fmt: skip
    want = ref.attention_ragged(*weights, q, [c.latent for c in caches],
                                [c.rope for c in caches], Q, R, V, SCALE)  # fmt: skip
    check(got, want, TOLERANCE[2])
    for lat, rop in rows:
        lat[:] = 0  # the caches hold their own copies
        rop[:] = 0
    for c in caches:
        c.check_size()
    check_ragged(backend, rng, caches, weights, placed, dims, TOLERANCE[2])
    for c in caches:
        c.cache.release()


def test_attention_ragged_failed_call_claims_no_rows(backend, rng) -> None:
    """A call that fails after its room is reserved (here: rope rows one value too wide)
    leaves every cache at its length; the next call attends exactly the held rows."""
    kv_b, _ = attention_weights(rng, 2, 0)
    placed = (backend.place(kv_b, 0), None)
    caches = [HostKV(backend, K, R) for _ in range(2)]
    caches[0].append(rng, 4)
    caches[1].append(rng, 63)
    rows = [(rows_of(rng, n, K), rows_of(rng, n, R + 1)) for n in (1, 2)]
    for c, (lat, _) in zip(caches, rows, strict=True):
        c.cache.reserve(len(lat))
    q = rng.standard_normal((2, H, Q + R)).astype(np.float32)
    with pytest.raises(ValueError):
        backend.attention_ragged(*placed, q, [c.cache for c in caches], Q, R, V, SCALE,
                                 rows=rows)  # fmt: skip
    for c in caches:
        c.check_size()
    check_ragged(backend, rng, caches, (kv_b, None), placed, (H, Q, R, V, SCALE), TOLERANCE[2])
    for c in caches:
        c.cache.release()


# -- one real GLM-5.2 shape per operation -----------------------------------------------------

GLM_D, GLM_IE = 6144, 2048


def test_matmul_glm52_dense(backend, rng) -> None:
    """A dense int4 6144 x 6144 projection at decode (S=1) and a small batch (S=5)."""
    w = random_qtensor(rng, 2, GLM_D, GLM_D)
    placed = backend.place(w, 0)
    for s in (1, 5):
        x = rows_of(rng, s, GLM_D)
        check(backend.matmul(placed, x), ref.matmul(w, x), TOLERANCE[2])


def test_expert_mlp_glm52(backend, rng) -> None:
    """The shared expert: gate/up [2048, 6144], down [6144, 2048], int4 gs=64, 3 rows."""
    expert = random_expert(rng, 4, GLM_D, GLM_IE, 64)
    x = rows_of(rng, 3, GLM_D)
    check(
        backend.expert_mlp(*place_expert(backend, expert), x),
        ref.expert_mlp(*expert, x),
        TOLERANCE[4],
    )


def test_expert_group_routed_glm52(backend, rng) -> None:
    """Two decode tokens routed to 8 of 10 int4 experts each, weighted sum on the worker."""
    experts = [random_expert(rng, 2, GLM_D, GLM_IE) for _ in range(10)]
    placed = [place_expert(backend, e) for e in experts]
    routes = np.stack([rng.permutation(10)[:8] for _ in range(2)]).astype(np.int32)
    weights = rng.uniform(0.05, 0.3, (2, 8)).astype(np.float32)
    x = rows_of(rng, 2, GLM_D)
    got = backend.expert_group_routed(placed, x, routes, weights)
    check(got, ref.expert_group_routed(experts, x, routes, weights), TOLERANCE[2])


def test_attention_glm52_causal_batch(backend, rng) -> None:
    """Causal MLA over one sequence at GLM-5.2 widths: 3 query rows, T=300, with o_proj."""
    h, q_dim, r_dim, v_dim, k_dim = 64, 192, 64, 256, 512
    kv_b, o_proj = attention_weights(rng, 2, 0, h, q_dim, v_dim, k_dim, d_out=GLM_D)
    q = rng.standard_normal((3, h, q_dim + r_dim)).astype(np.float32)
    latent, rope = rows_of(rng, 300, k_dim), rows_of(rng, 300, r_dim)
    scale = 1 / math.sqrt(q_dim + r_dim)
    got = backend.attention(
        backend.place(kv_b, 0),
        backend.place(o_proj, 0),
        q,
        latent,
        rope,
        q_dim,
        r_dim,
        v_dim,
        scale,
    )
    want = ref.attention(kv_b, o_proj, q, latent, rope, q_dim, r_dim, v_dim, scale)
    check(got, want, TOLERANCE[2])
