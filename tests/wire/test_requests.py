"""``client/requests.py``: every compute request, filled field by field through either
encoder (the unary client's inline bytes, the Session's staged side arrays), equals the
message built whole from its parts (constructors and ``codec.encode``), an independent
reference: same fields, same bytes, same staged order."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from coliworker.client import requests
from coliworker.client.session_calls import SessionCalls
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec


class _Staged(SessionCalls):
    """The Session's encoder alone (its side list per thread)."""

    def __init__(self) -> None:
        self._tls = threading.local()
        self.wire_dtype = pb.DTYPE_FLOAT32


def _inline(msg, a, field, ndim):
    codec.encode_into(msg, np.asarray(a, np.float32), pb.DTYPE_FLOAT32)


def _ref_inline(a):
    return codec.encode(np.asarray(a, np.float32))


def _ref_staged(side):
    def enc(a):
        raw = np.ascontiguousarray(np.asarray(a, np.float32), "<f4")
        side.append(raw)
        return pb.Array(
            dtype=pb.DTYPE_FLOAT32,
            shape=list(raw.shape),
            staged=pb.Slice(offset=len(side) - 1, length=raw.nbytes),
        )

    return enc


def _same(got, want):
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


@pytest.mark.parametrize("staged", [False, True])
def test_requests_equal_the_messages_built_whole(rng, staged):
    if staged:
        c = _Staged()
        enc, side = c._enc, []
        ref = _ref_staged(side)
    else:
        enc, ref, side = _inline, _ref_inline, None
    x = rng.standard_normal((3, 16)).astype(np.float32)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    lat = rng.standard_normal((2, 6)).astype(np.float32)
    rope = rng.standard_normal((2, 3)).astype(np.float32)
    empty = np.zeros((0, 6), np.float32)
    routes = rng.integers(0, 4, (3, 2)).astype(np.int32)
    weights = rng.random((3, 2)).astype(np.float32)
    experts = [(int(g), int(g) + 1, int(g) + 2) for g in rng.integers(1, 1000, 4)]
    dims = dict(q_dim=8, rope_dim=3, v_dim=5, scale=0.25)

    def taken():
        return c._take_side() if staged else None

    _same(requests.matmul(enc, 7, x), pb.MatmulRequest(handle=7, x=ref(x)))
    assert side is None or [a.tobytes() for a in taken()] == [a.tobytes() for a in side]
    if side is not None:
        side.clear()
    _same(
        requests.expert_mlp(enc, 1, 2, 3, x),
        pb.ExpertMlpRequest(gate=1, up=2, down=3, x=ref(x)),
    )
    want = pb.ExpertGroupRequest(
        experts=[pb.Expert(gate=g, up=u, down=d) for g, u, d in experts],
        rows=[1, 0, 2, 0],
        x=ref(x),
    )
    _same(requests.expert_group(enc, experts, [1, 0, 2, 0], x), want)
    want = pb.ExpertGroupRoutedRequest(
        experts=[pb.Expert(gate=g, up=u, down=d) for g, u, d in experts],
        x=ref(x),
        routes=codec.encode(routes, pb.DTYPE_INT32),
        weights=codec.encode(weights, pb.DTYPE_FLOAT32),
    )
    _same(requests.expert_group_routed(enc, experts, x, routes, weights), want)
    want = pb.AttentionRequest(kv_b=4, o_proj=5, q=ref(q), latent=ref(lat), rope=ref(rope), **dims)
    _same(requests.attention(enc, 4, q, lat, rope, o_proj=5, **dims), want)
    seqs = [(9, 3, lat, rope), (2, 0, empty, np.zeros((0, 3), np.float32)), (5, 1, lat, rope)]
    rows = [
        pb.SequenceRows(
            sequence_id=s,
            start=t,
            latent=ref(la) if la.size else pb.Array(),
            rope=ref(ro) if ro.size else pb.Array(),
        )
        for s, t, la, ro in seqs
    ]
    want = pb.AttentionRaggedRequest(kv_b=4, o_proj=5, q=ref(q), sequences=rows, **dims)
    got = requests.attention_ragged(enc, 4, 5, q, sequences=seqs, **dims)
    _same(got, want)
    assert got.sequences[1].HasField("latent") and got.sequences[1].HasField("rope")
    if staged:  # the side arrays in the order the offsets name them
        assert [a.tobytes() for a in taken()] == [a.tobytes() for a in side]


def test_encoder_refuses_a_wrong_rank(rng):
    with pytest.raises(ValueError, match=r"x: expected 2 dimensions, got shape \(3,\)"):
        requests.matmul(_Staged()._enc, 7, np.zeros(3, np.float32))
