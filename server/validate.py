"""Request validation: every check names the field and both values.

Handlers call these before the backend sees anything, so a rejected call changes nothing
resident. Shapes are checked against the resident tensors' specs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from coliworker.kernels.qtensor import MAX_FORMAT, row_bytes, scale_count
from coliworker.server.errors import InvalidArgument
from coliworker.server.store import Handle, Spec
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire.codec import INLINE, ArrayIO, CodecError


def array(msg: pb.Array, field: str, ndim: int, io: ArrayIO = INLINE) -> np.ndarray:
    """Decode a float activation array of rank ``ndim`` to float32 (its bytes from ``io``
    when they travel outside the message)."""
    try:
        return io.decode(msg, field, ndim=ndim)
    except CodecError as exc:
        raise InvalidArgument(str(exc)) from None


def spec(msg: pb.TensorSpec, devices: Sequence[int], field: str) -> Spec:
    """A TensorSpec with a known format, positive dimensions and a served device."""
    if not 0 <= msg.fmt <= MAX_FORMAT:
        raise InvalidArgument(f"{field}.fmt: expected 0..{MAX_FORMAT}, got {msg.fmt}")
    for name in ("in_features", "out_features"):
        value = getattr(msg, name)
        if value < 1:
            raise InvalidArgument(f"{field}.{name}: expected >= 1, got {value}")
    if msg.fmt == 4 and msg.group_size < 1:
        raise InvalidArgument(
            f"{field}.group_size: expected >= 1 for fmt 4 (grouped int4), got {msg.group_size}"
        )
    if msg.fmt != 4 and msg.group_size != 0:
        raise InvalidArgument(
            f"{field}.group_size: expected 0 for fmt {msg.fmt} (no scale groups), "
            f"got {msg.group_size}"
        )
    if msg.device not in devices:
        served = ", ".join(str(d) for d in devices)
        raise InvalidArgument(f"{field}.device: expected one of {served}, got {msg.device}")
    return Spec(msg.fmt, msg.in_features, msg.out_features, msg.group_size, msg.device)


def sizes(s: Spec) -> tuple[int, int]:
    """(weight bytes, scale bytes) a tensor of spec ``s`` carries."""
    return (
        row_bytes(s.fmt, s.in_features) * s.out_features,
        4 * scale_count(s.fmt, s.in_features, s.out_features, s.group_size),
    )


def same_device(handles: Sequence[tuple[str, Handle]], op: str) -> int:
    """All tensors of one call must live on one device."""
    first_field, first = handles[0]
    for f, h in handles[1:]:
        if h.spec.device != first.spec.device:
            raise InvalidArgument(
                f"{op}: tensors on different devices: {first_field} is on device "
                f"{first.spec.device}, {f} on device {h.spec.device}"
            )
    return first.spec.device


def columns(x: np.ndarray, expected: int, field: str, what: str) -> None:
    if x.shape[-1] != expected:
        raise InvalidArgument(f"{field}: expected {expected} columns ({what}), got {x.shape[-1]}")


def mlp(gate: Handle, up: Handle, down: Handle, field: str) -> tuple[int, int]:
    """gate/up [I_e, D], down [D, I_e]; returns (D, I_e)."""
    d, ie = gate.spec.in_features, gate.spec.out_features
    checks = (
        (f"{field}.up", "in_features", up.spec.in_features, d, "gate in_features"),
        (f"{field}.up", "out_features", up.spec.out_features, ie, "gate out_features"),
        (f"{field}.down", "in_features", down.spec.in_features, ie, "gate out_features"),
        (f"{field}.down", "out_features", down.spec.out_features, d, "gate in_features"),
    )
    for f, name, got, want, what in checks:
        if got != want:
            raise InvalidArgument(f"{f}.{name}: expected {want} ({what}), got {got}")
    return d, ie


def attention_dims(
    kv_b: Handle, q: np.ndarray, q_dim: int, rope_dim: int, v_dim: int, scale: float, op: str
) -> tuple[int, int]:
    """Checks dims against q [S, H, Q+R] and kv_b [H*(Q+V), K]; returns (H, K)."""
    if q_dim < 1 or rope_dim < 1 or v_dim < 1:  # the loop, naming the field, on an error only
        for name, value in (("q_dim", q_dim), ("rope_dim", rope_dim), ("v_dim", v_dim)):
            if value < 1:
                raise InvalidArgument(f"{op}.{name}: expected >= 1, got {value}")
    if not math.isfinite(scale) or scale == 0:
        raise InvalidArgument(f"{op}.scale: expected a finite non-zero number, got {scale}")
    shape = q.shape
    heads, width = shape[1], shape[2]
    if width != q_dim + rope_dim:
        raise InvalidArgument(
            f"{op}.q: expected {q_dim + rope_dim} values per head (q_dim + rope_dim), got {width}"
        )
    s = kv_b.data.spec
    if s.out_features != heads * (q_dim + v_dim):
        raise InvalidArgument(
            f"{op}.kv_b: expected {heads * (q_dim + v_dim)} out_features (heads {heads} x "
            f"(q_dim {q_dim} + v_dim {v_dim})), got {s.out_features}"
        )
    return heads, s.in_features


def o_proj(proj: Handle, heads: int, v_dim: int, op: str) -> None:
    if proj.spec.in_features != heads * v_dim:
        raise InvalidArgument(
            f"{op}.o_proj: expected {heads * v_dim} in_features (heads {heads} x v_dim "
            f"{v_dim}), got {proj.spec.in_features}"
        )
