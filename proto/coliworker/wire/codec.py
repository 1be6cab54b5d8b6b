"""The wire codec: NumPy arrays <-> ``coliworker.v1.Array``, content hashes, chunking.

Client and worker both convert through this one module, on every transport. An ``Array``
holds its bytes inline (``data``) or outside its message (a ``staged`` slice of a frame's
data or of a Session request's chunks, a ``shm`` slice of a shared-memory segment); where
those bytes are is the transport's business, handed to ``decode`` and ``encode`` as an
``ArrayIO`` (``INLINE`` when there is no outside: unary gRPC). Decoding checks
``len(data) == prod(shape) * itemsize`` and names the field on a mismatch.
Half-precision wire types: float16 is IEEE binary16; bfloat16 is the upper half of
binary32 rounded to nearest even (NumPy has no bfloat16, so it travels as uint16 bits).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from coliworker.v1 import worker_pb2 as pb

#: Size of the data chunks on upload streams (Python gRPC streams 1 MiB chunks ~5x faster
#: than one large message).
CHUNK_BYTES = 1 << 20

_NUMPY_OF: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
    pb.DTYPE_UINT8: np.dtype("u1"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}

DTYPE_NAMES = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT16: "float16",
    pb.DTYPE_BFLOAT16: "bfloat16",
    pb.DTYPE_UINT8: "uint8",
    pb.DTYPE_INT32: "int32",
}
_DTYPE_OF_NAME = {v: k for k, v in DTYPE_NAMES.items()}
FLOAT_WIRE_TYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16)


class CodecError(ValueError):
    """A malformed Array; the message names the field and both values."""


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_tuned = False


def tune_allocator() -> None:
    """Keep glibc from handing message-sized memory back to the kernel after every call.

    Each call allocates and frees a few 25 KB..200 KB buffers (protobuf arenas, arrays,
    gRPC slices). With glibc's defaults the heap top is trimmed and the pages faulted in
    again on the next call: measured 0.4-0.7 ms per decode call on a 2-core VM (about half
    the per-call overhead). Keeping 64 MB of padding at the heap top, trimming only above
    128 MB free, and serving blocks below 32 MB from the heap removes that. Process-wide,
    once; a no-op where the C library is not glibc.
    """
    global _tuned
    if _tuned:
        return
    _tuned = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_TOP_PAD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 << 20)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError):
        pass


def wire_dtype(name: str | int) -> int:
    """``"float32"``/``"float16"``/``"bfloat16"`` (or the enum value) -> DType enum value."""
    if isinstance(name, int):
        if name not in DTYPE_NAMES:
            raise CodecError(f"dtype: expected one of {sorted(DTYPE_NAMES)}, got {name}")
        return name
    if name not in _DTYPE_OF_NAME:
        raise CodecError(f"dtype: expected one of {', '.join(_DTYPE_OF_NAME)}, got {name!r}")
    return _DTYPE_OF_NAME[name]


def float32_to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bits, round to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bfloat16_bits_to_float32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(a: np.ndarray, dtype: int = pb.DTYPE_FLOAT32, sink: list | None = None) -> pb.Array:
    """Encode a NumPy array as ``dtype`` (float arrays convert; others must match). With a
    ``sink`` the bytes stay out of the message: the wire-typed array is appended to the
    sink and the result's ``staged.offset`` is its index there, until the transport places
    it (``staging.place``)."""
    msg = pb.Array()
    encode_into(msg, a, dtype, sink)
    return msg


def encode_into(
    msg: pb.Array, a: np.ndarray, dtype: int = pb.DTYPE_FLOAT32, sink: list | None = None
) -> None:
    """``encode`` into ``msg``, an empty Array (a new message, or the unset Array field of
    one: ``encode_into(response.out, ...)``), the same message ``encode`` makes. Its fields
    are set one by one: keyword arguments to a message's constructor cost more (a message
    argument is serialized and parsed), and an Array made apart and passed to its parent's
    constructor is copied in the same way."""
    arr = np.asarray(a)
    if dtype == pb.DTYPE_BFLOAT16:
        raw = float32_to_bfloat16_bits(arr.astype(np.float32, copy=False))
    else:
        raw = np.ascontiguousarray(arr, _NUMPY_OF[dtype])
    msg.dtype = dtype  # (sets msg's presence in its parent, whatever the value)
    msg.shape.extend(arr.shape)
    if sink is not None:
        sink.append(raw)
        staged = msg.staged
        staged.offset = len(sink) - 1
        staged.length = raw.nbytes
    else:
        msg.data = raw.tobytes()


def decode(
    msg: pb.Array,
    field: str,
    *,
    ndim: int | None = None,
    float_only: bool = True,
    source: Callable[[pb.Array], Any] | None = None,
) -> np.ndarray:
    """Decode an Array; float wire types come back as float32, others as their own type.

    ``source`` gives the bytes of an array held outside the message (its ``data`` empty).
    Raises CodecError naming ``field`` when the dtype is unknown, a dimension is < 1, the
    rank is not ``ndim``, or the byte length disagrees with the shape.
    """
    return _decode(msg, msg.shape[:], field, ndim, float_only, source)


def _decode(
    msg: pb.Array,
    shape: list[int],
    field: str,
    ndim: int | None,
    float_only: bool,
    source: Callable[[pb.Array], Any] | None,
) -> np.ndarray:
    """``decode`` of ``msg`` whose ``shape`` field the caller has read (``msg.shape[:]``: a
    list, made without the IndexError that ends iterating the repeated field, as
    ``tuple(msg.shape)`` does), its arguments positional."""
    dtype = msg.dtype
    np_dtype = _NUMPY_OF.get(dtype)
    if np_dtype is None:
        raise CodecError(f"{field}.dtype: expected one of {sorted(DTYPE_NAMES)}, got {dtype}")
    if float_only and dtype not in FLOAT_WIRE_TYPES:
        raise CodecError(
            f"{field}.dtype: expected float32, float16 or bfloat16, got {DTYPE_NAMES[dtype]}"
        )
    if ndim is not None and len(shape) != ndim:
        raise CodecError(
            f"{field}.shape: expected {ndim} dimensions, got {len(shape)} {list(shape)}"
        )
    if shape and min(shape) < 1:
        for i, d in enumerate(shape):
            if d < 1:
                raise CodecError(f"{field}.shape[{i}]: expected >= 1, got {d}")
    expected = math.prod(shape) * np_dtype.itemsize
    data = msg.data  # each read of a bytes field copies it: read once
    if not data and source is not None:
        data = source(msg)  # shared memory, frame data or staged chunks: no copy into msg
    if len(data) != expected:
        raise CodecError(
            f"{field}.data: expected {expected} bytes ({list(shape)} x {np_dtype.itemsize}), "
            f"got {len(data)}"
        )
    return _as_float32(np.frombuffer(data, np_dtype).reshape(shape), dtype)


def _as_float32(raw: np.ndarray, dtype: int) -> np.ndarray:
    """``raw`` of wire type ``dtype`` as ``decode`` returns it: half-precision types as
    float32 (a conversion), others as they are."""
    if dtype == pb.DTYPE_FLOAT16:
        return raw.astype(np.float32)
    if dtype == pb.DTYPE_BFLOAT16:
        return bfloat16_bits_to_float32(raw)
    return raw


def decode_rows(
    msg: pb.Array, field: str, width: int, source: Callable[[pb.Array], Any] | None = None
) -> np.ndarray:
    """Decode a float [n, width] block where n may be 0 (an absent/empty Array is 0 rows)."""
    shape = msg.shape[:]
    if not shape and not msg.data:
        return np.zeros((0, width), np.float32)
    return _decode(msg, shape, field, 2, True, source)


#: The checked header of an array (``_HEADERS``' values): NumPy dtype, shape (a tuple),
#: wire dtype, whether that is a float type, then where its bytes are: outside, whether
#: its slice is of shared memory (else of the staged chunks) and the slice's offset and
#: length; inline, None, what the serialized message holds before them (its dtype and
#: shape fields, the data field's tag and length) and their length.
_Header = tuple[np.dtype, tuple[int, ...], int, bool, bool | None, Any, int]

#: Headers of arrays that ``ArrayIO`` decoded and checked, by a serialized prefix of the
#: message: the whole message for one whose bytes are outside it (dtype, shape and one
#: slice), its dtype and shape for one whose bytes are inline (``_inline_key``). A decode
#: step sends the same few call after call, the bytes new. An array whose header is here
#: skips the reads of its fields and their checks. Cleared when full.
_HEADERS: dict[bytes, _Header] = {}
_HEADERS_KEPT = 4096


def _inline_key(head: bytes) -> bytes | None:
    """The dtype and shape fields that ``head``, a serialized Array, starts with (tags 1
    and 2, in order, each value short), or None."""
    if len(head) > 4 and head[0] == 0x08 and head[2] == 0x12 and head[3] < 0x80:
        return head[: 4 + head[3]]
    return None


def _keep(head: bytes, msg: pb.Array) -> None:
    """Keep the header of ``msg``, serialized as ``head``, just decoded (none for an array
    with both slices set: ``staging.source`` prefers the staged one only where the call
    has staged chunks; nor for one whose serialization ``_inline_key`` does not split)."""
    staged, shm = msg.HasField("staged"), msg.HasField("shm")
    dtype = msg.dtype
    head_of = (_NUMPY_OF[dtype], tuple(msg.shape), dtype, dtype in FLOAT_WIRE_TYPES)
    data = msg.data
    if data:
        key = _inline_key(head)
        if staged or shm or key is None or not head.endswith(data):
            return
        before = head[: len(head) - len(data)]  # with the data field's tag and length
        if before[len(key)] != 0x1A:
            return
        h: _Header = (*head_of, None, before, len(data))
    elif staged != shm:
        key = head
        where = msg.shm if shm else msg.staged
        h = (*head_of, shm, where.offset, where.length)
    else:
        return
    if len(_HEADERS) >= _HEADERS_KEPT:
        _HEADERS.clear()
    _HEADERS[key] = h


class ArrayIO:
    """Where one call's outside arrays are: ``source`` reads the bytes of an input array
    that is not inline, ``sink`` (a list) collects the result arrays the transport places
    itself. ``INLINE`` has neither: every array inside its message.

    A ``source`` from ``staging.source`` also reads a slice by its place (its ``read``):
    an array whose checked header ``_HEADERS`` holds is decoded from that, its message
    serialized once rather than its fields read and checked one by one (a decode call's
    array in about half the instructions). What is decoded, and every error, is the same."""

    __slots__ = ("read", "sink", "source")

    def __init__(
        self, source: Callable[[pb.Array], Any] | None = None, sink: list | None = None
    ) -> None:
        self.source, self.sink = source, sink
        self.read = getattr(source, "read", None)

    def _known(self, head: bytes, ndim: int | None, float_only: bool) -> np.ndarray | None:
        """The array serialized as ``head`` where ``_HEADERS`` holds its header, it passes
        this decode's rank and type checks and its bytes are there; else None."""
        h = _HEADERS.get(head)
        if h is None:
            key = _inline_key(head)
            h = _HEADERS.get(key) if key is not None else None
            # the same fields, and after them only the data field, of the same length
            if h is None or h[4] is not None or not head.startswith(h[5]):
                return None
            at = len(h[5])
            if len(head) != at + h[6]:
                return None
            data: Any = head
        else:
            data = self.read(h[4], h[5], h[6], h[2])  # type: ignore[misc]
            if data is None or len(data) != h[6]:
                return None
            at = 0
        if (ndim is not None and len(h[1]) != ndim) or (float_only and not h[3]):
            return None
        return _as_float32(np.frombuffer(data, h[0], -1, at).reshape(h[1]), h[2])

    def decode(
        self, msg: pb.Array, field: str, *, ndim: int | None = None, float_only: bool = True
    ) -> np.ndarray:
        if self.read is None:  # (no slice to read: no header kept)
            return _decode(msg, msg.shape[:], field, ndim, float_only, self.source)
        head = msg.SerializeToString()
        a = self._known(head, ndim, float_only)
        if a is None:
            a = _decode(msg, msg.shape[:], field, ndim, float_only, self.source)
            _keep(head, msg)
        return a

    def decode_rows(self, msg: pb.Array, field: str, width: int) -> np.ndarray:
        if self.read is None:
            return decode_rows(msg, field, width, self.source)
        head = msg.SerializeToString()
        a = self._known(head, 2, True) if head else None
        if a is None:
            a = decode_rows(msg, field, width, self.source)
            if len(a):
                _keep(head, msg)
        return a

    def encode(self, a: np.ndarray, dtype: int = pb.DTYPE_FLOAT32) -> pb.Array:
        return encode(a, dtype, self.sink)

    def encode_into(self, msg: pb.Array, a: np.ndarray, dtype: int = pb.DTYPE_FLOAT32) -> None:
        encode_into(msg, a, dtype, self.sink)


#: No outside arrays (unary gRPC): inputs inline, results inline.
INLINE = ArrayIO()


def _bytes(buf: bytes | memoryview | np.ndarray) -> bytes | memoryview:
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).data.cast("B")
    return buf


def content_hasher(fmt: int, in_features: int, out_features: int, group_size: int) -> Any:
    """The SHA-256 state ``content_hash`` starts from; feed it weights || scales in order
    (in any number of pieces) to hash a tensor as its bytes arrive."""
    h = hashlib.sha256(b"coliworker.tensor.v1\0")
    h.update(struct.pack("<4i", fmt, in_features, out_features, group_size))
    return h


def content_hash(
    fmt: int,
    in_features: int,
    out_features: int,
    group_size: int,
    weights: bytes | memoryview | np.ndarray,
    scales: bytes | memoryview | np.ndarray,
) -> bytes:
    """SHA-256 identifying a tensor's content (the device is not hashed: dedup is per device)."""
    h = content_hasher(fmt, in_features, out_features, group_size)
    h.update(_bytes(weights))
    h.update(_bytes(scales))
    return h.digest()


def chunks(*buffers: memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Slices of at most ``size`` bytes covering the buffers back to back (zero-copy)."""
    for buf in buffers:
        for off in range(0, len(buf), size):
            yield buf[off : off + size]
