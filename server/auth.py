"""Bearer-token authentication, TLS credentials and the exposure check.

Tokens come from a file (``--token-file``, one per line) or the environment
(``COLIWORKER_TOKENS``, comma-separated), in either form:

    alice:3f9c...e1        a named token: its calls act as owner "alice"
    3f9c...e1              a bare token: its owner is "token-" + the first 8 hex digits of
                           its SHA-256 (stable across restarts, never the token itself)

Blank lines and lines starting with ``#`` are skipped. The owner name keys every handle,
KV sequence and ticket the calls create (``WorkerServicer.owner``), so one token's client can
neither read nor free another's. Clients send ``authorization: Bearer <token>`` metadata.

Presented tokens are hashed with SHA-256 and compared to every stored digest with
``hmac.compare_digest``: the time taken does not depend on where a guess differs, nor on
which token (if any) it matched. The grpc.health.v1 service stays open, so load balancers
and container probes need no token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]+")
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class _Entry:
    name: str
    digest: bytes


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def bare_token_owner(token: str) -> str:
    """The owner name of a token given without a name."""
    return "token-" + _digest(token).hex()[:8]


class TokenTable:
    """Accepted tokens and the owner name each one authenticates as."""

    def __init__(self, entries: Iterable[tuple[str, str]]) -> None:
        self._entries: list[_Entry] = []
        names: set[str] = set()
        for name, token in entries:
            if len(token) < 16:
                raise ValueError(
                    f"token of owner {name!r}: expected at least 16 characters, got {len(token)}"
                )
            if name in names:
                raise ValueError(f"token owner {name!r}: appears twice (owner names are unique)")
            names.add(name)
            self._entries.append(_Entry(name, _digest(token)))

    @staticmethod
    def parse(text: str, source: str, sep: str = "\n") -> list[tuple[str, str]]:
        """(owner, token) pairs from ``text``: entries split at ``sep`` (lines of a token
        file, commas of COLIWORKER_TOKENS). An entry that is not exactly ``name:token`` or a
        bare token (names of ``[A-Za-z0-9._@-]``, tokens of ``[A-Za-z0-9._~+/=-]``, nothing
        else on the line) is an error naming ``source`` and the entry, never the token."""
        entries = []
        for i, raw in enumerate(text.split(sep), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, colon, token = line.partition(":")
            if not colon:
                name, token = bare_token_owner(line), line
            name, token = name.strip(), token.strip()
            where = f"{source}: entry {i}"
            unit = "line" if sep == "\n" else "comma-separated entry"
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"{where}: expected an owner name of letters, digits and ._@- before ':'"
                )
            if not _TOKEN.fullmatch(token):
                raise ValueError(
                    f"{where}: expected 'name:token' or a bare token, the token of letters, "
                    f"digits and ._~+/=- only (one per {unit})"
                )
            entries.append((name, token))
        return entries

    @classmethod
    def from_config(cls, config: Config) -> TokenTable | None:
        """The table of ``config`` (token file and/or tokens); None when both are unset."""
        if not config.token_file and not config.tokens:
            return None
        entries: list[tuple[str, str]] = []
        if config.token_file:
            entries += cls.parse(_read(config.token_file, "--token-file").decode(), "--token-file")
        if config.tokens:
            entries += cls.parse(config.tokens, "COLIWORKER_TOKENS", sep=",")
        if not entries:
            raise ValueError("--token-file/COLIWORKER_TOKENS: expected at least one token, got 0")
        try:
            return cls(entries)
        except ValueError as exc:
            raise ValueError(f"--token-file/COLIWORKER_TOKENS: {exc}") from None

    def __len__(self) -> int:
        return len(self._entries)

    def owner_of(self, token: str) -> str | None:
        """The owner ``token`` authenticates as, or None. Compares against every entry."""
        presented = _digest(token)
        found = None
        for e in self._entries:
            if hmac.compare_digest(presented, e.digest):
                found = e.name
        return found

    def owner_of_token(self, token: str) -> str | None:
        """``owner_of`` by its transport-neutral name (the data plane's HELLO carries the
        token itself, not gRPC metadata)."""
        return self.owner_of(token)

    def owner_from_metadata(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                if isinstance(value, bytes):
                    return None
                scheme, _, token = value.partition(" ")
                if scheme.lower() != "bearer" or not token:
                    return None
                return self.owner_of(token.strip())
        return None


def _streaming_of_methods() -> dict[str, tuple[bool, bool]]:
    """'/coliworker.v1.Worker/Upload' -> (client streaming, server streaming)."""
    service = pb.DESCRIPTOR.services_by_name["Worker"]
    return {
        f"/{service.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
        for m in service.methods
    }


_STREAMING = _streaming_of_methods()


def _deny(message: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return behavior


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call without a valid bearer token (UNAUTHENTICATED), before the
    request is read; the health service stays open."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_SERVICES):
            return continuation(details)
        metadata = details.invocation_metadata  # type: ignore[attr-defined]
        if self.table.owner_from_metadata(metadata) is not None:
            return continuation(details)
        has = any(k == AUTH_METADATA_KEY for k, _ in metadata or ())
        why = (
            "invalid bearer token"
            if has
            else "missing bearer token ('authorization: Bearer <token>' metadata)"
        )
        deny = _deny(f"{method}: {why}")
        # Answer with the method's own kind so the request (stream) is never deserialized;
        # the kind comes from the proto, not from ``continuation``, so the interceptors after
        # this one (the in-flight count) never see a refused call.
        streams = _STREAMING.get(method, (False, False))
        if streams == (False, False):
            return grpc.unary_unary_rpc_method_handler(deny)
        if streams == (True, False):
            return grpc.stream_unary_rpc_method_handler(deny)
        if streams == (False, True):
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.stream_stream_rpc_method_handler(deny)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS credentials from --tls-cert/--tls-key (and --tls-client-ca for mutual TLS)."""
    if not config.tls_cert:
        return None
    ca = _read(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key, "--tls-key"), _read(config.tls_cert, "--tls-cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: assume it is reachable from elsewhere


def check_exposure(config: Config, authenticated: bool) -> None:
    """Refuse to listen beyond loopback without client authentication (tokens, or mutual
    TLS: --tls-client-ca), unless --insecure. TLS alone encrypts but lets anyone in."""
    if is_loopback(config.host) or authenticated or config.tls_client_ca:
        return
    if not config.insecure:
        tls = " (TLS alone authenticates no client)" if config.tls_cert else ""
        raise ValueError(
            f"--host {config.host}: refusing to serve a non-loopback address without client "
            f"authentication{tls}; set --token-file/COLIWORKER_TOKENS and/or --tls-client-ca "
            f"(mutual TLS), or pass --insecure to serve anyone who can reach the port"
        )
    log.warning(
        "serving %s:%d WITHOUT authentication (--insecure; no tokens, no client "
        "certificates): anyone who can reach the port can upload, compute and free",
        config.host,
        config.port,
    )


__all__ = [
    "AUTH_METADATA_KEY",
    "AuthInterceptor",
    "TokenTable",
    "bare_token_owner",
    "check_exposure",
    "is_loopback",
    "server_credentials",
]
