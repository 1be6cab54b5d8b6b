"""Receiving an upload stream: header checks, data chunks read without protobuf, and the
bytes hashed and copied onto the device block by block while the rest is still arriving.

Upload and Update take their messages unparsed (``RAW_METHODS``, registered so by app.py):
a data chunk is ``0x12 <varint n> <n bytes>``, and its bytes are copied once, from the
message gRPC hands over into a staging block, instead of by the parser, again by each read
of ``UploadChunk.data`` and again into a fresh 1 GB buffer whose first touch page-faults.
Anything else is parsed as a message.

Blocks of ``BLOCK_BYTES`` (host memory from ``Backend.staging``: page-locked for CuPy,
reused) go to a pipeline task that hashes each one and hands it to the placement (a copy
onto the device); both drop the GIL. Meanwhile the receiving thread fills the next block,
so an upload costs about max(receive, hash, copy) instead of their sum, and after the last
byte only the last block and the on-device layout remain.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from google.protobuf.message import DecodeError

from coliworker.kernels.qtensor import QTensor
from coliworker.server import validate
from coliworker.server.backend import Backend
from coliworker.server.errors import InvalidArgument, ResourceExhausted
from coliworker.server.store import Spec
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec

#: The RPCs whose request messages reach the handler as bytes.
RAW_METHODS = ("Upload", "Update")
#: Bytes per staging block, hashed and copied as one: a chunk (~0.9 ms of SHA-256, ~0.05 ms
#: of PCIe from pinned memory). What is left after a stream's last byte is about one block's
#: hash: with 4 MiB blocks, up to ~3.6 ms after each 6.3 MB expert tensor (H200 host: a set
#: of them at 1 stream took 13 ms per tensor, of which ~6 ms the bytes).
BLOCK_BYTES = 1 << 20
#: Blocks one upload may have filled and not yet hashed and placed.
BLOCKS_IN_FLIGHT = 8
#: Free blocks kept for later uploads (three streams in flight use 24).
BLOCKS_KEPT = 32

_DATA_TAG = 2 << 3 | 2  # UploadChunk.data: field 2, length-delimited


class Sink(Protocol):
    def write(self, offset: int, data: np.ndarray) -> None: ...


@dataclass(frozen=True)
class Header:
    """A checked UploadHeader: the spec is valid and the byte counts match it."""

    spec: Spec
    content_hash: bytes
    weight_bytes: int
    scale_bytes: int
    handle: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.scale_bytes


class Staging:
    """Reusable host blocks of ``BLOCK_BYTES`` from the backend (pinned memory is slow to
    allocate and fast to copy from; fresh pageable memory page-faults on first touch)."""

    def __init__(self, backend: Backend) -> None:
        self._make = backend.staging
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._make(BLOCK_BYTES)

    def give(self, blocks: list[np.ndarray]) -> None:
        with self._lock:
            self._free.extend(blocks[: max(0, BLOCKS_KEPT - len(self._free))])


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Threads running the pipelines, one task per upload for its whole stream. A pipeline
    waits only on its own receiver, so even more uploads than threads cannot deadlock."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(64, thread_name_prefix="upload-place")
    return _executor


class _Pipeline:
    """One upload's blocks, hashed and written to the sink in order on a pool thread."""

    def __init__(self, hasher: Any, sink: Sink, staging: Staging) -> None:
        self._hasher, self._sink, self._staging = hasher, sink, staging
        self._owned: list[np.ndarray] = []  # every block taken, given back at the end
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._todo: queue.SimpleQueue[tuple[np.ndarray, int, int] | None] = queue.SimpleQueue()
        self._task: Future[None] | None = None
        self._error: BaseException | None = None
        self._stop = False

    def block(self) -> np.ndarray:
        """A block to fill: a new one while fewer than BLOCKS_IN_FLIGHT are out, else the
        next one the pipeline is done with (waits: the stream outruns the hash)."""
        if len(self._owned) < BLOCKS_IN_FLIGHT:
            self._owned.append(self._staging.take())
            return self._owned[-1]
        return self._free.get()

    def put(self, block: np.ndarray, offset: int, n: int, last: bool) -> None:
        """Bytes ``[offset, offset + n)`` of the upload are ``block[:n]``."""
        if self._error is not None:
            raise self._error
        if self._task is None:
            if last:  # the whole upload fits one block: no thread hand-off
                self._step(block, offset, n)
                self._free.put(block)
                return
            self._task = _pool().submit(self._run)
        self._todo.put((block, offset, n))

    def _step(self, block: np.ndarray, offset: int, n: int) -> None:
        data = block[:n]
        self._hasher.update(data)
        self._sink.write(offset, data)

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            block, offset, n = item
            if self._error is None and not self._stop:
                try:
                    self._step(block, offset, n)
                except BaseException as exc:
                    self._error = exc
            self._free.put(block)

    def close(self) -> None:
        """Wait until every block is hashed and written; raise what the pipeline raised."""
        self._end()
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        """Stop (skipping blocks not begun), wait, give the blocks back; after this nothing
        writes to the sink any more."""
        self._stop = True
        self._end()
        blocks, self._owned = self._owned, []
        self._staging.give(blocks)

    def _end(self) -> None:
        if self._task is not None:
            self._todo.put(None)
            self._task.result()
            self._task = None


def _data_view(raw: bytes) -> memoryview | None:
    """The bytes of a serialized ``UploadChunk{data}`` where they lie in ``raw``, or None
    when ``raw`` is anything else (then it is parsed as a message)."""
    if len(raw) < 2 or raw[0] != _DATA_TAG:
        return None
    n = shift = 0
    i = 1
    while i < len(raw) and i <= 10:
        b = raw[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return memoryview(raw)[i:] if i + n == len(raw) else None
        shift += 7
    return None


def _message(msg: bytes | pb.UploadChunk, op: str, i: int) -> pb.UploadChunk:
    if not isinstance(msg, bytes):
        return msg
    try:
        return pb.UploadChunk.FromString(msg)
    except DecodeError:
        raise InvalidArgument(
            f"{op}: message {i}: the bytes are not a valid UploadChunk ({len(msg)} bytes)"
        ) from None


def _data(msg: bytes | memoryview | pb.UploadChunk, op: str, i: int) -> memoryview | bytes:
    if isinstance(msg, memoryview):  # a piece of a data-plane frame's data
        return msg
    if isinstance(msg, bytes):
        view = _data_view(msg)
        if view is not None:
            return view
    m = _message(msg, op, i)
    part = m.WhichOneof("part")
    if part != "data":
        what = "a header" if part == "header" else "an empty message"
        raise InvalidArgument(f"{op}: message {i}: expected a data chunk, got {what}")
    return m.data


def read_header(
    messages: Iterator[bytes | pb.UploadChunk],
    op: str,
    devices: tuple[int, ...],
    memory_limit: int,
) -> Header:
    """The first message, checked: a header whose spec is valid, whose byte counts match
    the spec, with a 32-byte hash, and (with ``memory_limit``) a size that can ever fit."""
    first = next(messages, None)
    m = None if first is None else _message(first, op, 0)
    if m is None or m.WhichOneof("part") != "header":
        what = "nothing" if m is None else "a data chunk"
        raise InvalidArgument(f"{op}: expected a header as the first message, got {what}")
    return check_header(m.header, op, devices, memory_limit)


def check_header(
    header: pb.UploadHeader, op: str, devices: tuple[int, ...], memory_limit: int
) -> Header:
    """``read_header``'s checks of one UploadHeader (a data-plane frame's body)."""
    spec = validate.spec(header.spec, devices, f"{op}.header.spec")
    wbytes, sbytes = validate.sizes(spec)
    if header.weight_bytes != wbytes:
        raise InvalidArgument(
            f"{op}.header.weight_bytes: expected {wbytes} ({spec.out_features} rows x "
            f"{wbytes // spec.out_features} bytes for fmt {spec.fmt}, in_features "
            f"{spec.in_features}), got {header.weight_bytes}"
        )
    if header.scale_bytes != sbytes:
        raise InvalidArgument(
            f"{op}.header.scale_bytes: expected {sbytes} ({sbytes // 4} float32 scales), "
            f"got {header.scale_bytes}"
        )
    if len(header.content_hash) != 32:
        raise InvalidArgument(
            f"{op}.header.content_hash: expected 32 bytes (SHA-256), got {len(header.content_hash)}"
        )
    if memory_limit and wbytes + sbytes > memory_limit:
        raise ResourceExhausted(
            f"{op}: tensor of {wbytes + sbytes} bytes exceeds the per-device budget of "
            f"{memory_limit} bytes (--memory-limit)"
        )
    return Header(spec, header.content_hash, wbytes, sbytes, header.handle)


def receive(
    messages: Iterator[bytes | pb.UploadChunk],
    header: Header,
    op: str,
    sink: Sink,
    staging: Staging,
) -> None:
    """Read the data chunks after ``header`` to the end of the stream: every byte goes to
    ``sink.write`` once, in order, and their SHA-256 must be the header's. Raises
    InvalidArgument naming the field; the sink may have been written to either way."""
    total = header.total
    s = header.spec
    hasher = codec.content_hasher(s.fmt, s.in_features, s.out_features, s.group_size)
    pipe = _Pipeline(hasher, sink, staging)
    try:
        got = 0
        block: np.ndarray | None = None
        base = filled = size = 0  # the block's offset in the upload, bytes in it, its size
        for i, msg in enumerate(messages, start=1):
            data = _data(msg, op, i)
            n = len(data)
            if got + n > total:
                raise InvalidArgument(
                    f"{op}: data: expected {total} bytes in all, got more "
                    f"({got + n} after message {i})"
                )
            src = np.frombuffer(data, np.uint8)
            pos = 0
            while pos < n:
                if block is None:
                    block = pipe.block()
                    base, filled = got + pos, 0
                    size = min(BLOCK_BYTES, total - base)
                k = min(n - pos, size - filled)
                block[filled : filled + k] = src[pos : pos + k]  # NumPy drops the GIL
                filled += k
                pos += k
                if filled == size:
                    pipe.put(block, base, size, last=base + size == total)
                    block = None
            got += n
        if got != total:
            raise InvalidArgument(f"{op}: data: expected {total} bytes, stream ended after {got}")
        pipe.close()
    finally:
        pipe.release()
    digest = hasher.digest()
    if digest != header.content_hash:
        raise InvalidArgument(
            f"{op}.header.content_hash: expected {digest.hex()} (SHA-256 of "
            f"the data received), got {header.content_hash.hex()}"
        )


class _Host:
    """A sink into one host buffer: weights || scales."""

    def __init__(self, total: int) -> None:
        self.buf = np.empty(total, np.uint8)

    def write(self, offset: int, data: np.ndarray) -> None:
        self.buf[offset : offset + len(data)] = data


def receive_host(
    messages: Iterator[bytes | pb.UploadChunk], header: Header, op: str, staging: Staging
) -> QTensor:
    """``receive`` into host memory: the tensor, for ``TensorStore.upload`` / ``update``."""
    host = _Host(header.total)
    receive(messages, header, op, host, staging)
    s, wb = header.spec, header.weight_bytes
    weights = host.buf[:wb]
    scales = np.frombuffer(host.buf, np.float32, count=header.scale_bytes // 4, offset=wb)
    return QTensor(s.fmt, s.in_features, s.out_features, s.group_size, weights, scales)


__all__ = [
    "BLOCK_BYTES",
    "RAW_METHODS",
    "Header",
    "Staging",
    "check_header",
    "read_header",
    "receive",
]
