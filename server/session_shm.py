"""A Session stream's shared memory: the ``attach_shm`` ticket, the sealed segment the
worker's attach socket hands over for it, and the doorbell channel that runs in that segment.

The steps are ``coliworker.wire.shm``'s: the stream answers ``attach_shm`` with a one-time
ticket (``ticket``); the client passes its memfd with the ticket on the attach socket
(``shm_socket.py``), whose thread gives the checked segment to the stream
(``attach_segment``); then ``attach_doorbell`` may open a doorbell channel in it
(``doorbell``, ``server/doorbell.py``). ``stream`` is a ``SessionStream``
(``session.py``): its lock, ``ended``, ``segment`` and ``doorbell``.
"""

from __future__ import annotations

from typing import Any

import grpc

from coliworker.server.dispatch import status_of
from coliworker.server.doorbell import Doorbell
from coliworker.server.shm_socket import TICKET_TTL_S
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire.shm import HEADER_BYTES, Segment, ShmError


def error(rid: int, code: grpc.StatusCode, message: str) -> pb.SessionResponse:
    """The Status answer of request ``rid``."""
    return pb.SessionResponse(request_id=rid, error=pb.Status(code=code.value[0], message=message))


def ticket(stream: Any, rid: int, msg: pb.ShmAttach) -> pb.SessionResponse:
    """Step 2 of ``coliworker.wire.shm``: a ticket to pass the memfd with."""
    if stream.segment is not None:
        return error(
            rid,
            grpc.StatusCode.FAILED_PRECONDITION,
            f"attach_shm: this stream already has segment {stream.segment.name}",
        )
    if msg.name:
        return error(
            rid,
            grpc.StatusCode.FAILED_PRECONDITION,
            f"attach_shm.name: expected empty (a sealed memfd passed over the worker's "
            f"attach socket), got {msg.name[:80]!r}: segments named in /dev/shm are "
            f"refused, a file its client can truncate could crash the worker (SIGBUS)",
        )
    if msg.size <= HEADER_BYTES:
        return error(
            rid,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"attach_shm.size: expected > {HEADER_BYTES}, got {msg.size}",
        )
    attach = stream.servicer.sessions.attach_socket
    try:
        if attach is None:
            raise ShmError("not_found", "attach_shm: this worker serves no shared memory")
        with stream.lock:
            if stream.ended:
                return error(rid, grpc.StatusCode.CANCELLED, "attach_shm: stream ended")
            ticket = attach.expect(stream, msg.size)
    except ShmError as exc:
        code, message = status_of(exc, "attach_shm")
        return error(rid, code, message)
    answer = pb.ShmTicket(ticket=ticket, socket=attach.path, expires_ms=int(TICKET_TTL_S * 1000))
    return pb.SessionResponse(request_id=rid, shm_ticket=answer)


def attach_segment(stream: Any, seg: Segment) -> tuple[int, str]:
    """Step 3 (the attach socket's thread): ``seg`` becomes this stream's segment; the
    answer for the socket (status code value, message)."""
    with stream.lock:
        if stream.ended:
            why = (grpc.StatusCode.CANCELLED, "attach_shm: the session stream ended")
        elif stream.segment is not None:
            why = (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"attach_shm: this stream already has segment {stream.segment.name}",
            )
        else:
            stream.segment = seg
            attach = getattr(stream.servicer.backend, "attach_segment", None)
            if attach is not None:  # the CUDA backend reads large inputs straight from it
                attach(seg)
            return 0, f"segment {seg.name} attached ({seg.size} bytes)"
    seg.close()
    return why[0].value[0], why[1]


def doorbell(stream: Any, rid: int, msg: pb.DoorbellAttach) -> pb.SessionResponse:
    seg = stream.segment
    if seg is None:
        return error(
            rid,
            grpc.StatusCode.FAILED_PRECONDITION,
            "attach_doorbell: attach a shared-memory segment first (attach_shm)",
        )
    if stream.doorbell is not None:
        return error(
            rid,
            grpc.StatusCode.FAILED_PRECONDITION,
            "attach_doorbell: this stream already has a doorbell channel",
        )
    try:
        bell = Doorbell(stream, seg, msg)
    except ShmError as exc:
        code, message = status_of(exc, "attach_doorbell")
        return error(rid, code, message)
    with stream.lock:
        if stream.ended:
            bell.close()
            return error(rid, grpc.StatusCode.CANCELLED, "attach_doorbell: stream ended")
        stream.doorbell = bell
    bell.start()
    return pb.SessionResponse(
        request_id=rid, doorbell_attached=pb.DoorbellAttached(slots=bell.slots)
    )
