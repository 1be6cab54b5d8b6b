"""Every transport agrees: unary gRPC (``WorkerClient`` methods), the gRPC Session stream,
the socket data plane and shared memory with the doorbell give bit-identical results for
every hot call on one worker with the same inputs, and the same typed errors (class and
message) for the same bad calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from _hotpath import ATT, D, H, K, Q, R, routing

from coliworker.client import WorkerClient
from coliworker.client.errors import WorkerError

SESSIONS = ("grpc", "socket", "shm")
TRANSPORTS = ("unary", *SESSIONS)


class Unary:
    """The session call surface over a client's unary methods (``*_sync`` names)."""

    transport = "unary"

    def __init__(self, client: WorkerClient) -> None:
        self.c = client

    def matmul_sync(self, t, x):
        return self.c.matmul(t, x)

    def expert_mlp_sync(self, g, u, d, x):
        return self.c.expert_mlp(g, u, d, x)

    def expert_group_sync(self, experts, rows, x):
        return self.c.expert_group(experts, rows, x)

    def expert_group_routed_sync(self, experts, x, routes, weights):
        return self.c.expert_group_routed(experts, x, routes, weights)

    def attention_sync(self, *args, **kwargs):
        return self.c.attention(*args, **kwargs)

    def attention_ragged_sync(self, *args, **kwargs):
        return self.c.attention_ragged(*args, **kwargs)


@contextmanager
def opened(client: WorkerClient, transport: str) -> Iterator[Any]:
    if transport == "unary":
        yield Unary(client)
        return
    with client.session(transport=transport) as s:
        assert s.transport == transport
        yield s


def each(client: WorkerClient, fn: Callable[[Any, str], Any]) -> dict[str, Any]:
    """fn(session, transport) through every transport; their results by transport."""
    out = {}
    for t in TRANSPORTS:
        with opened(client, t) as s:
            out[t] = fn(s, t)
    return out


def assert_all_equal(results: dict[str, Any]) -> None:
    want = results["unary"]
    for t, got in results.items():
        assert isinstance(got, np.ndarray), t
        assert got.dtype == want.dtype and got.shape == want.shape, t
        np.testing.assert_array_equal(got, want, err_msg=f"{t} differs from unary")


def error_of(fn: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(WorkerError) as info:
        fn()
    return type(info.value), str(info.value)


def assert_same_errors(client: WorkerClient, fn: Callable[[Any, str], Any]) -> tuple[type, str]:
    errs = {}
    for t in TRANSPORTS:
        with opened(client, t) as s:
            errs[t] = error_of(lambda s=s, t=t: fn(s, t))
    want = errs["unary"]
    for t, got in errs.items():
        assert got == want, f"{t}: {got} != unary {want}"
    return want


@pytest.mark.parametrize("transport", SESSIONS)
def test_session_transport_is_what_was_asked(client, transport):
    with client.session(transport=transport) as s:
        assert s.transport == transport


def test_auto_picks_shm_on_this_host(client):
    with client.session(transport="auto") as s:
        assert s.transport == "shm"


def test_matmul(client, model, rng):
    x = rng.standard_normal((5, D)).astype(np.float32)
    assert_all_equal(each(client, lambda s, t: s.matmul_sync(model.mat, x)))


def test_expert_mlp(client, model, rng):
    x = rng.standard_normal((4, D)).astype(np.float32)
    g, u, d = model.experts[1]
    assert_all_equal(each(client, lambda s, t: s.expert_mlp_sync(g, u, d, x)))


def test_expert_group(client, model, rng):
    rows = [2, 1, 3, 1]
    x = rng.standard_normal((sum(rows), D)).astype(np.float32)
    experts = model.experts[:4]
    assert_all_equal(each(client, lambda s, t: s.expert_group_sync(experts, rows, x)))


def test_expert_group_routed(client, model, rng):
    x = rng.standard_normal((6, D)).astype(np.float32)
    routes, w = routing(rng, 6, 3, len(model.experts))
    assert_all_equal(
        each(client, lambda s, t: s.expert_group_routed_sync(model.experts, x, routes, w))
    )


@pytest.mark.parametrize("with_o_proj", [True, False], ids=["o_proj", "no_o_proj"])
def test_attention(client, model, rng, with_o_proj):
    q = rng.standard_normal((3, H, Q + R)).astype(np.float32)
    lat = rng.standard_normal((7, K)).astype(np.float32)
    rope = rng.standard_normal((7, R)).astype(np.float32)
    o = model.o_proj if with_o_proj else None
    assert_all_equal(
        each(client, lambda s, t: s.attention_sync(model.kv_b, q, lat, rope, o_proj=o, **ATT))
    )


@pytest.mark.parametrize("with_o_proj", [True, False], ids=["o_proj", "no_o_proj"])
def test_attention_ragged_new_rows_and_rollback(client, model, rng, with_o_proj):
    """Three steps on two sequences, each transport on its own sequence ids from an empty
    cache: a prefill, new rows appended, then a rollback (start below the resident rows)
    with replacement rows."""
    lat = rng.standard_normal((12, K)).astype(np.float32)
    rope = rng.standard_normal((12, R)).astype(np.float32)
    qs = [rng.standard_normal((2, H, Q + R)).astype(np.float32) for _ in range(3)]
    o = model.o_proj if with_o_proj else None
    base = int(rng.integers(1, 1 << 40))
    ids = {t: (base + 2 * i, base + 2 * i + 1) for i, t in enumerate(TRANSPORTS)}

    def steps(a: int, b: int) -> list[list[tuple]]:
        return [
            [(a, 0, lat[:4], rope[:4]), (b, 0, lat[:6], rope[:6])],  # prefill
            [(a, 4, lat[4:6], rope[4:6]), (b, 6, lat[6:7], rope[6:7])],  # new rows
            [(a, 2, lat[8:11], rope[8:11]), (b, 3, lat[11:12], rope[11:12])],  # rollback
        ]

    want_lengths = [[4, 6], [6, 7], [5, 4]]
    results: dict[int, dict[str, np.ndarray]] = {0: {}, 1: {}, 2: {}}
    try:
        for t in TRANSPORTS:
            with opened(client, t) as s:
                for i, seqs in enumerate(steps(*ids[t])):
                    if t == "unary":
                        y = s.c.attention_ragged(model.kv_b, o, qs[i], sequences=seqs, **ATT)
                        lengths = client.last_call.lengths
                    else:
                        fut = s.attention_ragged(model.kv_b, o, qs[i], sequences=seqs, **ATT)
                        y = fut.result(30)
                        lengths = fut.lengths
                    assert list(lengths) == want_lengths[i], (t, i)
                    results[i][t] = y
    finally:
        for pair in ids.values():
            for sid in pair:
                client.free_sequence(sid)
    for i in range(3):
        assert_all_equal(results[i])


# -- the same typed errors -------------------------------------------------------------------


def test_unknown_handle(client, model, rng):
    x = rng.standard_normal((2, D)).astype(np.float32)
    cls, msg = assert_same_errors(client, lambda s, t: s.matmul_sync(987_654_321, x))
    assert cls.__name__ == "NotFound" and "matmul.handle" in msg


def test_wrong_columns(client, model, rng):
    x = rng.standard_normal((2, D - 1)).astype(np.float32)
    cls, msg = assert_same_errors(client, lambda s, t: s.matmul_sync(model.mat, x))
    assert cls.__name__ == "InvalidArgument" and "matmul.x" in msg


def test_bad_route_index(client, model, rng):
    x = rng.standard_normal((3, D)).astype(np.float32)
    routes, w = routing(rng, 3, 2, len(model.experts))
    routes[1, 0] = len(model.experts)  # one past the last expert
    cls, msg = assert_same_errors(
        client, lambda s, t: s.expert_group_routed_sync(model.experts, x, routes, w)
    )
    assert cls.__name__ == "InvalidArgument" and "routes" in msg


def test_too_many_experts(client, model, rng):
    n = 65  # --max-experts is 64 at most
    experts = [model.experts[i % len(model.experts)] for i in range(n)]
    rows = [1] * n
    x = rng.standard_normal((n, D)).astype(np.float32)
    cls, msg = assert_same_errors(client, lambda s, t: s.expert_group_sync(experts, rows, x))
    assert cls.__name__ == "ResourceExhausted" and "expert_group.experts" in msg


def test_ragged_start_past_resident_rows(client, model, rng):
    lat = rng.standard_normal((2, K)).astype(np.float32)
    rope = rng.standard_normal((2, R)).astype(np.float32)
    q = rng.standard_normal((1, H, Q + R)).astype(np.float32)
    sid = int(rng.integers(1, 1 << 40))  # never used: 0 resident rows, start 3 is past them
    try:
        cls, msg = assert_same_errors(
            client,
            lambda s, t: s.attention_ragged_sync(
                model.kv_b, model.o_proj, q, sequences=[(sid, 3, lat, rope)], **ATT
            ),
        )
    finally:
        client.free_sequence(sid)
    assert "start" in msg and cls.__name__ in ("InvalidArgument", "FailedPrecondition")


def test_auto_takes_the_socket_when_no_segment_can_be_allocated(client, monkeypatch):
    from coliworker.wire import shm

    def no_room(size: int):
        raise shm.ShmError("exhausted", f"shm_bytes: cannot allocate {size} bytes (test)")

    monkeypatch.setattr(shm.Segment, "create", classmethod(lambda cls, size: no_room(size)))
    with client.session(transport="auto") as s:
        assert s.transport == "socket"
