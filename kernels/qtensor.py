"""Quantized weight tensors: the five formats, their byte sizes, and a host-side container.

A weight tensor is row-major ``[O, I]`` (O outputs, I inputs), each row padded to whole
bytes. Dequantized element ``W[o, i]`` per format:

====  ===================  ================  ==============================================
fmt   name                 row bytes         ``W[o, i]``
====  ===================  ================  ==============================================
0     float32              ``4*I``           ``w[o, i]``
1     int8, per-row scale  ``I``             ``int8(q[o, i]) * s[o]``
2     int4, per-row scale  ``ceil(I/2)``     ``(nib - 8) * s[o]``
3     int2, per-row scale  ``ceil(I/4)``     ``(((q[o, i/4] >> 2*(i%4)) & 3) - 2) * s[o]``
4     int4, grouped        ``ceil(I/2)``     ``(nib - 8) * s[o, i // gs]``, ``ceil(I/gs)`` groups
====  ===================  ================  ==============================================

int4 element ``2j`` is the low nibble of byte ``j`` and ``2j+1`` the high nibble, stored
offset-binary (``q + 8``); with odd I the last high nibble is padding. int2 element ``i``
sits at bits ``2*(i%4)`` of byte ``i//4``, offset by 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_FORMAT = 4
FORMAT_NAMES = {
    0: "float32",
    1: "int8 per-row",
    2: "int4 per-row",
    3: "int2 per-row",
    4: "int4 grouped",
}


def row_bytes(fmt: int, in_features: int) -> int:
    """Bytes of one stored row of ``in_features`` elements in format ``fmt``."""
    if fmt == 0:
        return 4 * in_features
    if fmt == 1:
        return in_features
    if fmt in (2, 4):
        return (in_features + 1) // 2
    if fmt == 3:
        return (in_features + 3) // 4
    raise ValueError(f"fmt: expected 0..{MAX_FORMAT}, got {fmt}")


def scale_shape(fmt: int, in_features: int, out_features: int, group_size: int) -> tuple[int, ...]:
    """Shape of the float32 scales: ``()`` for fmt 0, ``(O,)`` per-row, ``(O, ng)`` grouped."""
    if fmt == 0:
        return ()
    if fmt == 4:
        return (out_features, -(-in_features // group_size))
    return (out_features,)


def scale_count(fmt: int, in_features: int, out_features: int, group_size: int) -> int:
    """Number of float32 scales the tensor carries (0 for fmt 0)."""
    shape = scale_shape(fmt, in_features, out_features, group_size)
    return int(np.prod(shape)) if shape else 0


@dataclass(frozen=True)
class QTensor:
    """A quantized weight tensor held in host memory.

    weights: uint8 [O * row_bytes(fmt, I)], the rows back to back, as clients send them.
    scales:  float32 [scale_count(...)], empty for fmt 0.
    """

    fmt: int
    in_features: int
    out_features: int
    group_size: int
    weights: np.ndarray
    scales: np.ndarray

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.fmt, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of weights plus scales (what residency accounting counts)."""
        return int(self.weights.nbytes + self.scales.nbytes)

    @classmethod
    def from_arrays(
        cls,
        weights: np.ndarray,
        scales: np.ndarray | None,
        fmt: int,
        in_features: int,
        out_features: int,
        group_size: int = 0,
    ) -> QTensor:
        """Build from caller arrays of any shape whose bytes are the documented layout."""
        w = np.ascontiguousarray(weights).view(np.uint8).reshape(-1)
        s = (
            np.zeros(0, np.float32)
            if scales is None
            else np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
        )
        return cls(fmt, in_features, out_features, group_size, w, s)
