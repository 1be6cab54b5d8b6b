"""Request messages of the compute calls, built once for every way of sending them.

The unary client and the Session stream send the same requests; they differ only in how an
activation array becomes an ``Array`` (inline bytes, or staged for chunks / shared memory),
which is the ``enc`` argument: ``enc(field, array, field name, ndim)`` fills the request's
unset Array ``field`` in place. Requests are filled field by field: a message passed to a
constructor (or to ``CopyFrom``) is serialized and parsed again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec

Encoder = Callable[[pb.Array, np.ndarray, str, int], None]


def handle_id(t: Any) -> int:
    """A TensorRef (anything with ``.handle``), a raw handle, or None (0: absent)."""
    if t is None:
        return 0
    return int(getattr(t, "handle", t))


def experts_of(experts: Iterable[Sequence[Any]]) -> list[pb.Expert]:
    return [pb.Expert(gate=handle_id(g), up=handle_id(u), down=handle_id(d)) for g, u, d in experts]


# An engine sends the same few expert lists (a layer's experts) on every decode step:
# their serialized ``experts`` field is kept, and a request starts as a parse of it (~1 us)
# instead of 8-64 Expert messages built and copied (~15 us for 8).
_PREFIXES: dict[tuple, bytes] = {}
_PREFIX_LIMIT = 4096
for _m in (pb.ExpertGroupRequest, pb.ExpertGroupRoutedRequest):  # the prefix fits both
    assert _m.DESCRIPTOR.fields_by_name["experts"].number == 1


def _with_experts(cls: Any, experts: Iterable[Sequence[Any]]) -> Any:
    """A new ``cls`` message whose ``experts`` are the (gate, up, down) triples given."""
    try:
        key = tuple([(g.handle, u.handle, d.handle) for g, u, d in experts])
    except AttributeError:  # raw handles (or None) among them
        key = tuple([(handle_id(g), handle_id(u), handle_id(d)) for g, u, d in experts])
    prefix = _PREFIXES.get(key)
    if prefix is None:
        prefix = pb.ExpertGroupRequest(experts=experts_of(key)).SerializeToString()
        if len(_PREFIXES) >= _PREFIX_LIMIT:
            _PREFIXES.clear()
        _PREFIXES[key] = prefix
    return cls.FromString(prefix)


def matmul(enc: Encoder, t: Any, x: np.ndarray) -> pb.MatmulRequest:
    msg = pb.MatmulRequest(handle=handle_id(t))
    enc(msg.x, x, "x", 2)
    return msg


def expert_mlp(enc: Encoder, gate: Any, up: Any, down: Any, x: np.ndarray) -> pb.ExpertMlpRequest:
    msg = pb.ExpertMlpRequest(gate=handle_id(gate), up=handle_id(up), down=handle_id(down))
    enc(msg.x, x, "x", 2)
    return msg


def expert_group(
    enc: Encoder, experts: Iterable[Sequence[Any]], rows: Sequence[int], x: np.ndarray
) -> pb.ExpertGroupRequest:
    msg = _with_experts(pb.ExpertGroupRequest, experts)
    msg.rows.extend([int(r) for r in rows])
    enc(msg.x, x, "x", 2)
    return msg


def expert_group_routed(
    enc: Encoder,
    experts: Iterable[Sequence[Any]],
    x: np.ndarray,
    routes: np.ndarray,
    weights: np.ndarray,
) -> pb.ExpertGroupRoutedRequest:
    msg = _with_experts(pb.ExpertGroupRoutedRequest, experts)
    enc(msg.x, x, "x", 2)
    codec.encode_into(msg.routes, np.asarray(routes, np.int32), pb.DTYPE_INT32)
    codec.encode_into(msg.weights, np.asarray(weights, np.float32), pb.DTYPE_FLOAT32)
    return msg


def attention(
    enc: Encoder,
    kv_b: Any,
    q: np.ndarray,
    latent: np.ndarray,
    rope: np.ndarray,
    *,
    q_dim: int,
    rope_dim: int,
    v_dim: int,
    scale: float,
    o_proj: Any = None,
) -> pb.AttentionRequest:
    msg = pb.AttentionRequest(
        kv_b=handle_id(kv_b),
        o_proj=handle_id(o_proj),
        q_dim=q_dim,
        rope_dim=rope_dim,
        v_dim=v_dim,
        scale=scale,
    )
    enc(msg.q, q, "q", 3)
    enc(msg.latent, latent, "latent", 2)
    enc(msg.rope, rope, "rope", 2)
    return msg


def attention_ragged(
    enc: Encoder,
    kv_b: Any,
    o_proj: Any,
    q: np.ndarray,
    *,
    sequences: Sequence[tuple[int, int, np.ndarray, np.ndarray]],
    q_dim: int,
    rope_dim: int,
    v_dim: int,
    scale: float,
) -> pb.AttentionRaggedRequest:
    """sequences[s] = (sequence id, start, latent rows [n, K], rope rows [n, R]); n may be 0
    (its latent and rope then present and empty)."""
    msg = pb.AttentionRaggedRequest(
        kv_b=handle_id(kv_b),
        o_proj=handle_id(o_proj),
        q_dim=q_dim,
        rope_dim=rope_dim,
        v_dim=v_dim,
        scale=scale,
    )
    add = msg.sequences.add
    for sid, start, lat, rop in sequences:  # staged in this order, then q (as always)
        lat = np.asarray(lat, np.float32)
        rop = np.asarray(rop, np.float32)
        row = add()
        row.sequence_id = int(sid)
        row.start = int(start)
        if lat.size:
            enc(row.latent, lat, "latent", 2)
        else:
            row.latent.SetInParent()
        if rop.size:
            enc(row.rope, rop, "rope", 2)
        else:
            row.rope.SetInParent()
    enc(msg.q, q, "q", 3)
    return msg
