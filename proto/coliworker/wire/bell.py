"""The doorbell carrier: data-plane frames in shared-memory slots, rung through FIFOs.

A doorbell channel (``client/doorbell.py`` has its life cycle) has ``slots`` request slots
of ``slot_bytes`` in the session's segment, then as many response slots. A slot holds

    offset 0   u64 output_offset   request slots: the segment region the result arrays
    offset 8   u64 output_length   may be written to (0, 0: none); response slots: 0, 0
    offset 16  one frame (proto/FRAMES.md): header, body, data

Request frames are CALLs, response frames REPLYs, as on a socket. An Array may hold its
bytes in the frame's data (``staged``, within the slot) or anywhere in the segment
(``shm``); the worker puts result arrays in the output region when they fit, else in the
reply frame's data, else answers RESOURCE_EXHAUSTED. The slot's index, one byte on the
``request`` FIFO, rings the worker; one byte on ``response`` answers.
"""

from __future__ import annotations

import struct

from coliworker.wire import frames

PREFIX = struct.Struct("<QQ")
PREFIX_BYTES = PREFIX.size  # 16
#: First byte of a slot's frame.
FRAME_AT = PREFIX_BYTES
REQUEST, RESPONSE = "request", "response"


def room(slot_bytes: int) -> int:
    """Bytes a slot's frame may take (header, body and data)."""
    return slot_bytes - PREFIX_BYTES


def frame_bytes(head: frames.Header) -> int:
    return frames.HEADER_BYTES + head.body_bytes + head.data_bytes


__all__ = ["FRAME_AT", "PREFIX", "PREFIX_BYTES", "REQUEST", "RESPONSE", "frame_bytes", "room"]
