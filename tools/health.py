"""A grpc.health.v1 probe that needs no package beyond grpcio: it speaks the health
protocol with hand-encoded bytes, so a container HEALTHCHECK works on any image that has
the worker.

    coliworker health [--address HOST:PORT]                # exit 0 when SERVING
    python -m coliworker.tools.health 127.0.0.1:50051 [SERVICE]
"""

from __future__ import annotations

import sys
from typing import Any

import grpc

_CHECK = "/grpc.health.v1.Health/Check"
_SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING


def probe(address: str, service: str = "", timeout: float = 3.0, tls: Any = None) -> int:
    """Ask grpc.health.v1 Check at ``address``: 0 when SERVING, 1 otherwise (unreachable,
    NOT_SERVING, unknown service). Prints one line saying which."""
    # HealthCheckRequest{service=1: string}; HealthCheckResponse{status=1: enum}.
    raw = service.encode()
    request = (b"\x0a" + _varint(len(raw)) + raw) if raw else b""
    try:
        if tls is None:
            channel = grpc.insecure_channel(address)
        else:
            name = getattr(tls, "server_name", None)
            options = [("grpc.ssl_target_name_override", name)] if name else []
            channel = grpc.secure_channel(address, tls.credentials(), options=options)
        with channel:
            check = channel.unary_unary(_CHECK)
            reply = check(request, timeout=timeout)
    except grpc.RpcError as err:
        print(f"health {address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = _read_status(reply)
    name = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status)
    print(f"health {address} {service or '(server)'}: {name or status}")
    return 0 if status == _SERVING else 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_status(reply: bytes) -> int:
    """Field 1 (varint) of a HealthCheckResponse; proto3 omits it when 0 (UNKNOWN)."""
    if len(reply) >= 2 and reply[0] == 0x08:
        return reply[1] & 0x7F
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m coliworker.tools.health HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return probe(args[0], args[1] if len(args) == 2 else "")


__all__ = ["main", "probe"]

if __name__ == "__main__":
    raise SystemExit(main())
