"""Client side of the worker's security: TLS / mutual TLS channels and bearer tokens.

    WorkerClient(address, token="...", tls=TLS(ca="ca.pem"))                   # TLS + token
    WorkerClient(address, tls=TLS(ca="ca.pem", cert="me.pem", key="me.key"))  # mutual TLS

The token travels as ``authorization: Bearer <token>`` metadata on every call, added by a
channel interceptor, so every stub method (the Session stream included) carries it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import grpc

AUTH_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class TLS:
    """TLS settings of a client channel. Each PEM field is a path or the PEM bytes.

    ca: roots that signed the worker's certificate (None: the system's roots).
    cert, key: this client's certificate and key, for mutual TLS (both or neither).
    server_name: the name to check the worker's certificate against when it differs from
    the host in the address (e.g. connecting by IP to a certificate issued for a name).
    """

    ca: str | bytes | None = None
    cert: str | bytes | None = None
    key: str | bytes | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS.cert, TLS.key: expected both (mutual TLS) or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca),
            private_key=_pem(self.key),
            certificate_chain=_pem(self.cert),
        )


def _pem(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTH_METADATA_KEY, f"Bearer {token}")

    def _details(self, d: Any) -> _Details:
        metadata = list(d.metadata or ()) + [self._pair]
        return _Details(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def make_channel(
    address: str,
    options: list[tuple[str, Any]],
    *,
    tls: TLS | bool | None = None,
    token: str | None = None,
) -> grpc.Channel:
    """A channel to ``address``: plaintext, or TLS (``tls=True``: system roots), with the
    bearer ``token`` on every call when given."""
    if tls:
        t = tls if isinstance(tls, TLS) else TLS()
        opts = list(options)
        if t.server_name:
            opts.append(("grpc.ssl_target_name_override", t.server_name))
        channel = grpc.secure_channel(address, t.credentials(), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


__all__ = ["TLS", "make_channel"]
