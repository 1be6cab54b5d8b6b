"""Arrays that travel outside their message on a Session stream (both sides use this).

An ``Array`` may hold its bytes inline (``data``), in the chunks streamed ahead of its
message (``staged``) or in the session's shared-memory segment (``shm``). This module finds
the arrays of a message, cuts large bytes into chunks (``pieces``), puts staged bytes back
inline for unary gRPC (``inline``), checks the slices of chunked or shared-memory arrays
(``check``), and hands their bytes to ``codec.decode`` without copying them into the message
(``source``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from coliworker.v1 import worker_pb2 as pb
from coliworker.wire.codec import CHUNK_BYTES

#: Arrays larger than this leave the message and stream as chunks of CHUNK_BYTES.
STAGE_ABOVE = CHUNK_BYTES

_ARRAY = pb.Array.DESCRIPTOR.full_name

# message full name -> ((field name, is an Array, repeated), ...) for the fields that are
# or contain Arrays: walking only those skips the experts lists and scalars of a call.
_PLANS: dict[str, tuple[tuple[str, bool, bool], ...]] = {}


def _plan(desc: Descriptor) -> tuple[tuple[str, bool, bool], ...]:
    plan = _PLANS.get(desc.full_name)
    if plan is None:
        _PLANS[desc.full_name] = ()  # a message type that contains itself
        out = []
        for fd in desc.fields:
            sub = fd.message_type
            if sub is None:
                continue
            rep = fd.is_repeated
            if sub.full_name == _ARRAY:
                out.append((fd.name, True, rep))
            elif _plan(sub):
                out.append((fd.name, False, rep))
        plan = _PLANS[desc.full_name] = tuple(out)
    return plan


def iter_arrays(msg: Message) -> Iterator[pb.Array]:
    """Every ``Array`` set in ``msg``, at any depth (repeated fields included)."""
    for name, is_array, rep in _plan(msg.DESCRIPTOR):
        if rep:
            items = getattr(msg, name)
        elif msg.HasField(name):
            items = (getattr(msg, name),)
        else:
            continue
        if is_array:
            yield from items
        else:
            for item in items:
                yield from iter_arrays(item)


def pieces(view: memoryview) -> list[memoryview]:
    """``view`` cut into chunks of CHUNK_BYTES (views, not copies)."""
    return [view[i : i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES)]


def inline(msg: Message, side: list[Any]) -> None:
    """Put the bytes of ``msg``'s staged arrays (``staged.offset`` indexing ``side``, as
    ``codec.encode`` with a sink leaves them) back into their ``data`` (unary gRPC)."""
    for a in iter_arrays(msg):
        if a.HasField("staged") and not a.data:
            a.data = memoryview(side[a.staged.offset]).cast("B").tobytes()
            a.ClearField("staged")


def check(
    msg: Message,
    staged: bytes | bytearray | None,
    shm_check: Callable[[int, int, str], None] | None,
    field: str,
) -> bool:
    """Check the slices of ``msg``'s chunked / shared-memory arrays; returns whether it has
    any (then decode it with ``source`` bound).

    Raises ValueError naming ``field`` when a slice points outside its buffer or at a
    buffer this stream does not have (``shm_check`` raises for shared memory).
    """
    external = False
    for a in iter_arrays(msg):
        if a.HasField("staged"):
            off, n = a.staged.offset, a.staged.length
            have = 0 if staged is None else len(staged)
            if off + n > have:
                raise ValueError(
                    f"{field}: staged slice {off}..{off + n} is past the {have} bytes "
                    f"of chunks received for this request"
                )
            external = True
        elif a.HasField("shm"):
            if shm_check is None:
                raise ValueError(f"{field}: refers to shared memory, but none is attached")
            shm_check(a.shm.offset, a.shm.length, field)
            external = True
    return external


def source(
    staged: bytes | bytearray | None,
    shm_read: Callable[[int, int, str], Any] | None,
    field: str,
    shm_view: Callable[[int, int, str], Any] | None = None,
) -> Callable[[pb.Array], Any]:
    """What ``codec.decode`` reads an outside array's bytes from (slices already checked):
    a view of the staged chunks; for shared memory, a read-only view of the segment for
    float32 arrays when ``shm_view`` is given (the worker: the region is the client's
    until the call is answered), else one copy (``shm_read``). Integer arrays (routes) are
    always copied: they index memory once checked, so they must not change after the check.
    """
    view = memoryview(staged) if staged is not None else None

    def get(a: pb.Array) -> Any:
        if view is not None:
            # staged present is what HasField("staged") asks; a slice of nonzero length
            # says so without the call (an absent one reads as 0), so HasField only asks
            # about an empty or absent slice
            staged = a.staged  # (each read of a message field makes its wrapper: read once)
            n = staged.length
            if n or a.HasField("staged"):
                off = staged.offset
                return view[off : off + n]
        if a.HasField("shm"):
            if shm_view is not None and a.dtype == pb.DTYPE_FLOAT32:
                return shm_view(a.shm.offset, a.shm.length, field)
            if shm_read is not None:
                return shm_read(a.shm.offset, a.shm.length, field)
        return b""

    def read(shm: bool, offset: int, length: int, dtype: int) -> Any:
        """What ``get`` returns for an array of wire type ``dtype`` whose only slice is
        ``offset``, ``length`` (of shared memory when ``shm``, else of the staged chunks),
        or None where ``get`` would find no bytes (``codec.ArrayIO`` reads a known array's
        bytes by its place: its fields unread)."""
        if not shm:
            return view[offset : offset + length] if view is not None else None
        if shm_view is not None and dtype == pb.DTYPE_FLOAT32:
            return shm_view(offset, length, field)
        if shm_read is not None:
            return shm_read(offset, length, field)
        return None

    get.read = read  # type: ignore[attr-defined]
    return get


__all__ = ["STAGE_ABOVE", "check", "inline", "iter_arrays", "pieces", "source"]
