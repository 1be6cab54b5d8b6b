"""Arrays that travel outside their message on a Session stream (both sides use this).

An ``Array`` may hold its bytes inline (``data``), in the chunks streamed ahead of its
message (``staged``) or in the session's shared-memory segment (``shm``). This module finds
the arrays of a message, moves large ones into chunks, and puts chunked or shared-memory
bytes back inline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from google.protobuf.message import Message

from coliworker.client.codec import CHUNK_BYTES
from coliworker.v1 import worker_pb2 as pb

#: Arrays larger than this leave the message and stream as chunks of CHUNK_BYTES.
STAGE_ABOVE = CHUNK_BYTES

_ARRAY = pb.Array.DESCRIPTOR.full_name


def iter_arrays(msg: Message) -> Iterator[pb.Array]:
    """Every ``Array`` set in ``msg``, at any depth (repeated fields included)."""
    for fd, value in msg.ListFields():
        sub = fd.message_type
        if sub is None:
            continue
        items = (value,) if isinstance(value, Message) else value
        if sub.full_name == _ARRAY:
            yield from items
        else:
            for item in items:
                yield from iter_arrays(item)


def stage(msg: Message, limit: int = STAGE_ABOVE) -> list[bytes | memoryview]:
    """Move every array of ``msg`` with more than ``limit`` bytes out of it; returns the
    pieces to send as chunks, in order (their concatenation is what ``staged`` points into)."""
    pieces: list[bytes | memoryview] = []
    offset = 0
    for a in iter_arrays(msg):
        data = a.data  # each read of a bytes field copies it: read once
        n = len(data)
        if n <= limit:
            continue
        view = memoryview(data)
        pieces += [view[i : i + CHUNK_BYTES] for i in range(0, n, CHUNK_BYTES)]
        a.staged.offset, a.staged.length = offset, n
        a.ClearField("data")
        offset += n
    return pieces


def resolve(
    msg: Message,
    staged: bytes | bytearray | None,
    shm_read: Callable[[int, int, str], bytes] | None,
    field: str,
) -> None:
    """Put staged / shared-memory bytes back into ``data`` (in place).

    Raises ValueError naming ``field`` when a slice points outside its buffer or at a
    buffer this stream does not have.
    """
    for a in iter_arrays(msg):
        if a.HasField("staged"):
            off, n = a.staged.offset, a.staged.length
            have = 0 if staged is None else len(staged)
            if off + n > have:
                raise ValueError(
                    f"{field}: staged slice {off}..{off + n} is past the {have} bytes "
                    f"of chunks received for this request"
                )
            a.data = bytes(memoryview(staged)[off : off + n])  # type: ignore[arg-type]
            a.ClearField("staged")
        elif a.HasField("shm"):
            if shm_read is None:
                raise ValueError(f"{field}: refers to shared memory, but none is attached")
            a.data = shm_read(a.shm.offset, a.shm.length, field)
            a.ClearField("shm")


__all__ = ["STAGE_ABOVE", "iter_arrays", "resolve", "stage"]
