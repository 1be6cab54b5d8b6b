"""The calls of ``service Worker`` as one table, read from the compiled contract.

Every transport (unary gRPC, the Session stream, the socket data plane, the shared-memory
doorbell) names a call by one ``Call`` entry: its ``Method`` number on the data plane, its
RPC name on gRPC, its snake-case ``kind`` (the Session oneof field and the worker's handler
name) and its request and response messages. Upload and Update travel on the data plane as
an ``UploadHeader`` body followed by the bytes (``request``), on gRPC as a stream of
``UploadChunk`` messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coliworker.v1 import worker_pb2 as pb


@dataclass(frozen=True)
class Call:
    method: int  # coliworker.v1.Method value (frame header ``method``)
    name: str  # RPC name, e.g. "ExpertGroupRouted"
    kind: str  # snake case, e.g. "expert_group_routed"
    request: type  # the body of a CALL frame
    response: type  # the body of its REPLY
    streams_data: bool = False  # Upload / Update: the frame's data is the tensor's bytes


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _table() -> tuple[Call, ...]:
    service = pb.DESCRIPTOR.services_by_name["Worker"]
    out = []
    for m in service.methods:
        kind = _snake(m.name)
        method = pb.Method.Value("METHOD_" + kind.upper())
        streams = m.name in ("Upload", "Update")
        request = pb.UploadHeader if streams else _class(m.input_type.name)
        out.append(Call(method, m.name, kind, request, _class(m.output_type.name), streams))
    return tuple(out)


def _class(name: str) -> type:
    return getattr(pb, name)


CALLS = _table()
BY_METHOD = {c.method: c for c in CALLS}
BY_KIND = {c.kind: c for c in CALLS}
BY_NAME = {c.name: c for c in CALLS}
#: Calls the data plane carries (Session is gRPC only).
DATA_PLANE = frozenset(c.method for c in CALLS if c.name != "Session")
#: The compute calls a Session stream multiplexes (its request oneof fields).
SESSION_KINDS = (
    "matmul",
    "expert_group",
    "expert_group_routed",
    "attention",
    "attention_ragged",
    "expert_mlp",
)

__all__ = ["BY_KIND", "BY_METHOD", "BY_NAME", "CALLS", "DATA_PLANE", "SESSION_KINDS", "Call"]
