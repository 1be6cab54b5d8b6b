"""``tables.route_plan``: a routed group as packed rows, in plain Python (small groups) and in
NumPy (large ones), against a definition written out pair by pair. No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from coliworker.kernels.tables import SMALL_ROUTES, route_plan


def _expected(routes: np.ndarray, n_experts: int):
    """Packed rows by expert (ascending), within an expert by flat index (t * K + j)."""
    T, K = routes.shape
    pairs = sorted(range(T * K), key=lambda i: (int(routes.flat[i]), i))
    used = sorted({int(e) for e in routes.flat})
    rows = [int((routes == e).sum()) for e in used]
    src = [i // K for i in pairs]
    pos = [0] * (T * K)
    for p, i in enumerate(pairs):
        pos[i] = p
    x_rows: list[int] | None = []
    q = 0
    for c in rows:
        if src[q : q + c] != list(range(src[q], src[q] + c)):
            x_rows = None
            break
        x_rows.append(src[q])
        q += c
    assert all(e < n_experts for e in used)
    return used, rows, src, pos, x_rows


def _random_routes(rng, T: int, K: int, n_experts: int, distinct: bool) -> np.ndarray:
    if distinct:  # each token's K experts differ (a top-k router)
        return np.stack([rng.choice(n_experts, K, replace=False) for _ in range(T)]).astype(
            np.int32
        )
    return rng.integers(0, n_experts, size=(T, K), dtype=np.int32)


@pytest.mark.parametrize("small", [True, False, None])
@pytest.mark.parametrize(
    "T,K,E,distinct",
    [(1, 8, 8, True), (1, 8, 64, True), (1, 4, 3, False), (3, 2, 5, True), (8, 8, 64, True),
     (8, 8, 16, False), (32, 8, 256, True), (64, 1, 4, False), (200, 8, 64, True)],
)  # fmt: skip
def test_route_plan_matches_definition(T, K, E, distinct, small):
    rng = np.random.default_rng()
    for _ in range(5):
        routes = _random_routes(rng, T, K, E, distinct)
        plan = route_plan(routes, E, small)
        used, rows, src, pos, x_rows = _expected(routes, E)
        assert plan.used == used
        assert plan.rows == rows
        assert plan.src.dtype == np.int32 and plan.src.tolist() == src
        assert plan.pos.dtype == np.int32 and plan.pos.tolist() == pos
        assert plan.x_rows == x_rows


def test_one_token_reads_x_in_place():
    """At one token with distinct experts every expert's single row is token 0."""
    routes = np.array([[5, 1, 7, 2]], np.int32)
    for small in (True, False):
        plan = route_plan(routes, 8, small)
        assert plan.used == [1, 2, 5, 7]
        assert plan.rows == [1, 1, 1, 1]
        assert plan.x_rows == [0, 0, 0, 0]
        assert plan.pos.tolist() == [2, 0, 3, 1]


def test_size_picks_the_path():
    rng = np.random.default_rng()
    big = _random_routes(rng, SMALL_ROUTES // 8 + 1, 8, 64, True)
    assert big.size > SMALL_ROUTES
    a, b = route_plan(big, 64), route_plan(big, 64, small=True)
    assert a.pos.tolist() == b.pos.tolist() and a.x_rows == b.x_rows
