"""The resident weight layout: client rows -> 512-byte interleaved blocks (see common.cuh).

Written against the array module ``xp`` (NumPy here in tests, CuPy on the device at place
time), so the permutation is checked on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from coliworker.kernels.qtensor import QTensor

BLOCK_BYTES = 512
QUADS = {0: 1, 1: 4, 2: 8, 3: 16, 4: 8}  # 4-element quads per lane chunk of 16 bytes


@dataclass(frozen=True)
class Layout:
    """Device geometry of one tensor.

    in_padded: elements per row after padding to whole blocks; ld: bytes per row;
    ngp: scales per row (fmt 4: groups covering in_padded; per-row formats: 1; fmt 0: 0).
    """

    block_elems: int
    in_padded: int
    ld: int
    ngp: int

    @classmethod
    def of(cls, fmt: int, in_features: int, group_size: int) -> Layout:
        blk = QUADS[fmt] * 128
        in_padded = -(-in_features // blk) * blk
        ld = in_padded // blk * BLOCK_BYTES
        if fmt == 4:
            ngp = -(-in_padded // group_size)
        else:
            ngp = 1 if fmt else 0
        return cls(blk, in_padded, ld, ngp)


def codes(xp: Any, t: QTensor, weights: Any) -> Any:
    """Per-element codes [O, I] (uint8; fmt 0: uint32 bit patterns) from the client bytes."""
    o, i = t.out_features, t.in_features
    raw = weights.reshape(o, t.row_bytes)
    if t.fmt == 0:
        return raw.view(xp.uint32).reshape(o, i)
    if t.fmt == 1:
        return raw
    if t.fmt in (2, 4):
        c = xp.stack([raw & 0xF, raw >> 4], axis=-1).reshape(o, -1)
    else:
        c = xp.stack([(raw >> (2 * k)) & 3 for k in range(4)], axis=-1).reshape(o, -1)
    return c[:, :i]


def relayout(xp: Any, t: QTensor, weights: Any) -> Any:
    """Client weight bytes (uint8 [O * row_bytes]) -> resident bytes (uint8 [O * ld])."""
    lay = Layout.of(t.fmt, t.in_features, t.group_size)
    o, q = t.out_features, QUADS[t.fmt]
    c = codes(xp, t, weights)
    padded = xp.zeros((o, lay.in_padded), dtype=c.dtype)
    padded[:, : t.in_features] = c
    nblk = lay.in_padded // lay.block_elems
    # element order (block, quad, lane, k) -> memory order (block, lane, quad, k)
    seq = padded.reshape(o, nblk, q, 32, 4).transpose(0, 1, 3, 2, 4).reshape(o, -1)
    if t.fmt == 0:
        out = xp.ascontiguousarray(seq).view(xp.uint8)
    elif t.fmt == 1:
        out = seq
    elif t.fmt in (2, 4):
        out = (seq[:, 0::2] | (seq[:, 1::2] << 4)).astype(xp.uint8)
    else:
        out = seq[:, 0::4] | (seq[:, 1::4] << 2) | (seq[:, 2::4] << 4) | (seq[:, 3::4] << 6)
        out = out.astype(xp.uint8)
    return xp.ascontiguousarray(out).reshape(-1)


def scales(xp: Any, t: QTensor, scales_in: Any) -> Any:
    """Client scales -> resident float32 scales ([O] per-row, [O, ngp] zero-padded for fmt 4)."""
    if t.fmt == 0:
        return xp.zeros(1, dtype=xp.float32)  # a valid pointer that no kernel reads
    if t.fmt != 4:
        return xp.ascontiguousarray(scales_in, dtype=xp.float32).reshape(-1)
    lay = Layout.of(t.fmt, t.in_features, t.group_size)
    ng = -(-t.in_features // t.group_size)
    s = xp.zeros((t.out_features, lay.ngp), dtype=xp.float32)
    s[:, :ng] = scales_in.reshape(t.out_features, ng)
    return s.reshape(-1)


def decode_resident(t: QTensor, dev_bytes: np.ndarray, dev_scales: np.ndarray) -> np.ndarray:
    """NumPy model of the kernels' decode (``load_elem`` in common.cuh): resident -> W [O, I]."""
    lay = Layout.of(t.fmt, t.in_features, t.group_size)
    o = t.out_features
    i = np.arange(t.in_features)
    b, e = i // lay.block_elems, i % lay.block_elems
    q, lane, k = e >> 7, (e >> 2) & 31, e & 3
    j = 4 * q + k
    base = b * BLOCK_BYTES + lane * 16
    rows = dev_bytes.reshape(o, lay.ld)
    if t.fmt == 0:
        return rows.view(np.float32)[:, (base // 4) + j].astype(np.float64)
    if t.fmt == 1:
        v = rows[:, base + j].view(np.int8).astype(np.float64)
    elif t.fmt == 3:
        v = ((rows[:, base + (j >> 2)] >> (2 * (j & 3))) & 3).astype(np.float64) - 2
    else:
        v = ((rows[:, base + (j >> 1)] >> (4 * (j & 1))) & 15).astype(np.float64) - 8
    if t.fmt == 4:
        s = dev_scales.reshape(o, lay.ngp)[:, i // t.group_size]
        return v * s
    return v * dev_scales.reshape(o, 1)
