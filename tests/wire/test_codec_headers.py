"""An array decoded through an ``ArrayIO`` over ``staging.source`` keeps its checked header
(``codec._HEADERS``): the same header again is decoded from its slice, or from its inline
bytes, without its fields read. What comes back, and every error, must be what the plain
decode gives, whatever was kept before."""

from __future__ import annotations

import numpy as np
import pytest

from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec, staging
from coliworker.wire.codec import ArrayIO, CodecError

_TYPES = [pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_INT32, pb.DTYPE_UINT8]


def _plain(msg: pb.Array, src, ndim, float_only, rows: int | None = None):
    """The plain decode's array or error text (no header kept or used)."""
    try:
        if rows is not None:
            return codec.decode_rows(msg, "a", rows, src)
        return codec.decode(msg, "a", ndim=ndim, float_only=float_only, source=src)
    except CodecError as exc:
        return str(exc)


def _kept(msg: pb.Array, io: ArrayIO, ndim, float_only, rows: int | None = None):
    try:
        if rows is not None:
            return io.decode_rows(msg, "a", rows)
        return io.decode(msg, "a", ndim=ndim, float_only=float_only)
    except CodecError as exc:
        return str(exc)


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("where", ["staged", "shm", "inline"])
def test_kept_headers_decode_as_the_plain_decode(where):
    rng = np.random.default_rng()
    codec._HEADERS.clear()
    for _ in range(300):
        dtype = int(rng.choice(_TYPES))
        item = codec._NUMPY_OF[dtype].itemsize
        shape = [int(d) for d in rng.integers(1, 5, int(rng.integers(1, 4)))]
        if rng.random() < 0.1:
            shape[int(rng.integers(len(shape)))] = 0  # a bad dimension
        n = int(np.prod(shape)) * item + (int(rng.integers(-2, 3)) if rng.random() < 0.2 else 0)
        n = max(n, 0)
        block = rng.integers(0, 256, n + 64, np.uint8).tobytes()
        off = int(rng.integers(0, 32))  # (shapes repeat: a few offsets, so headers repeat)
        msg = pb.Array(dtype=dtype, shape=shape)
        if where == "inline":
            msg.data = block[off : off + n]
            if rng.random() < 0.1:  # more after the data: not the inline layout kept
                msg.staged.offset = 1
        else:
            getattr(msg, where).offset = off
            getattr(msg, where).length = n

        def shm(o: int, k: int, field: str, block: bytes = block) -> bytes:
            return block[o : o + k]

        src = staging.source(block if where == "staged" else None, shm, "call", None)
        io = ArrayIO(src, [])
        ndim = int(rng.choice([1, 2, 3])) if rng.random() < 0.3 else None
        float_only = bool(rng.random() < 0.5)
        rows = int(rng.integers(1, 5)) if rng.random() < 0.2 else None
        want = _plain(msg, src, ndim, float_only, rows)
        for _ in range(2):  # the second finds what the first kept, if it kept it
            assert _same(_kept(msg, io, ndim, float_only, rows), want)
    assert codec._HEADERS  # (some were kept and found)


def test_a_known_header_is_decoded_without_its_fields():
    codec._HEADERS.clear()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    block = b"\0" * 8 + x.tobytes()
    msg = pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[3, 4])
    msg.staged.offset, msg.staged.length = 8, x.nbytes
    io = ArrayIO(staging.source(block, None, "call"), [])
    assert np.array_equal(io.decode(msg, "x", ndim=2), x)
    assert msg.SerializeToString() in codec._HEADERS
    # the next call's bytes are new; the header is the same
    y = x + 1
    io = ArrayIO(staging.source(b"\0" * 8 + y.tobytes(), None, "call"), [])
    assert np.array_equal(io.decode(msg, "x", ndim=2), y)
    with pytest.raises(CodecError, match=r"x.shape: expected 3 dimensions"):
        io.decode(msg, "x", ndim=3)  # the same checks made on a known header
    short = ArrayIO(staging.source(b"\0" * 8, None, "call"), [])
    with pytest.raises(CodecError, match=r"x.data: expected 48 bytes"):
        short.decode(msg, "x", ndim=2)


def test_an_inline_array_with_a_longer_data_field_is_not_read_by_a_kept_header():
    codec._HEADERS.clear()
    io = ArrayIO(staging.source(b"", None, "call"), [])
    good = pb.Array(dtype=pb.DTYPE_INT32, shape=[2], data=np.int32([1, 2]).tobytes())
    assert io.decode(good, "r", float_only=False).tolist() == [1, 2]
    # same dtype and shape, the data 4 bytes short and an unknown field making up the length
    bad = pb.Array(dtype=pb.DTYPE_INT32, shape=[2], data=np.int32([7]).tobytes())
    raw = bad.SerializeToString() + bytes([0x78, 0x05, 0x78, 0x05])  # field 15, twice
    bad = pb.Array.FromString(raw)
    assert len(raw) == len(good.SerializeToString())
    with pytest.raises(CodecError, match=r"r.data: expected 8 bytes"):
        io.decode(bad, "r", float_only=False)
