"""The worker's configuration: one frozen, validated ``Config`` built at the edge.

Every setting comes from a CLI flag or its ``COLIWORKER_*`` environment variable (the flag
wins). Nothing else in the worker reads ``os.environ``. ``SETTINGS`` below is the single
table the CLI, the environment parser and the README are written from.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"40G"``, ``"512MiB"``, ``"1.5g"``, ``"1048576"`` -> bytes (powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"expected a size like 40G or 512MiB, got {text!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * 1024 ** "_kmgt".index(unit)) if unit else int(number)


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> (0, 1); ids must be distinct and >= 0."""
    try:
        ids = tuple(int(p) for p in str(text).split(",") if p.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated device ids like 0,1, got {text!r}") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"expected distinct device ids >= 0 like 0,1, got {text!r}")
    return ids


def _parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


@dataclass(frozen=True)
class Config:
    """Validated worker settings (see ``SETTINGS`` for flags, variables and meanings)."""

    host: str = "127.0.0.1"
    port: int = 50051
    backend: str = "auto"
    devices: tuple[int, ...] = (0,)
    metrics_host: str = ""
    metrics_port: int | None = 9400  # None: no metrics endpoint; 0: any free port
    memory_limit: int = 0  # bytes per device for tensors + KV; 0: the device's memory
    log_level: str = "INFO"
    workers: int = 16
    max_message_bytes: int = 64 << 20
    max_experts: int = 64
    max_pending_tickets: int = 64
    max_sequences_per_call: int = 1024
    max_kv_rows: int = 1 << 20
    fail_after: int | None = None  # fault injection: compute calls fail after N successes
    unix_socket: str = ""
    # The socket data plane (dataplane.py): TCP port (None: off; 0: any free port), an
    # optional Unix socket, the largest non-upload frame, and the readers' poll time.
    data_port: int | None = -1  # -1: --port + 1 (a free port when --port is 0)
    data_unix_socket: str = ""
    max_frame_bytes: int = 1 << 30
    data_spin_us: int = 1000
    data_stall_timeout: float = 30.0
    data_idle_timeout: float = 600.0
    max_data_connections: int = 256
    # Security and limits (auth.py, limits.py).
    token_file: str = ""
    tokens: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    insecure: bool = False
    max_in_flight: int = 256
    quota: int = 0  # bytes per owner (token) for tensors + KV; 0: no quota
    drain_grace: float = 10.0
    # Per-owner limits on what streams hold (owners.py) and the stalled-stream timeout.
    max_sessions_per_owner: int = 4
    max_uploads_per_owner: int = 4
    max_staged_bytes_per_owner: int = 2 << 30
    idle_timeout: float = 60.0
    session_idle_timeout: float = 600.0

    @property
    def data_bind_port(self) -> int | None:
        """The TCP port the data plane binds (None: off; 0: any free port)."""
        if self.data_port == -1:
            return self.port + 1 if self.port else 0
        return self.data_port

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: expected 0..65535, got {self.metrics_port}")
        if self.backend not in ("auto", "numpy", "cupy"):
            raise ValueError(f"backend: expected one of auto, numpy, cupy, got {self.backend!r}")
        if not self.devices:
            raise ValueError("devices: expected at least one device id, got none")
        for name in (
            "workers",
            "max_message_bytes",
            "max_experts",
            "max_pending_tickets",
            "max_sequences_per_call",
            "max_kv_rows",
            "max_in_flight",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_experts > 64:
            raise ValueError(f"max_experts: expected <= 64, got {self.max_experts}")
        if self.memory_limit < 0:
            raise ValueError(f"memory_limit: expected >= 0, got {self.memory_limit}")
        if self.fail_after is not None and self.fail_after < 0:
            raise ValueError(f"fail_after: expected >= 0, got {self.fail_after}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert, tls_key: expected both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca: needs tls_cert and tls_key (mutual TLS is TLS)")
        if self.quota < 0:
            raise ValueError(f"quota: expected >= 0, got {self.quota}")
        if self.data_port is not None and not -1 <= self.data_port <= 65535:
            raise ValueError(f"data_port: expected 0..65535 or off, got {self.data_port}")
        if self.data_port and self.data_port == self.port:
            raise ValueError(f"data_port: expected a port other than port {self.port}")
        if not 1 << 20 <= self.max_frame_bytes <= 1 << 40:
            raise ValueError(f"max_frame_bytes: expected 1M..1T bytes, got {self.max_frame_bytes}")
        if self.data_idle_timeout < 0:
            raise ValueError(
                f"data_idle_timeout: expected >= 0 seconds, got {self.data_idle_timeout}"
            )
        if self.data_stall_timeout < 0:
            raise ValueError(
                f"data_stall_timeout: expected >= 0 seconds, got {self.data_stall_timeout}"
            )
        if not 0 <= self.data_spin_us <= 10_000:
            raise ValueError(f"data_spin_us: expected 0..10000, got {self.data_spin_us}")
        if self.max_data_connections < 1:
            raise ValueError(
                f"max_data_connections: expected >= 1, got {self.max_data_connections}"
            )
        if not 0 <= self.drain_grace <= 3600:
            raise ValueError(f"drain_grace: expected 0..3600 seconds, got {self.drain_grace}")
        for name in ("max_sessions_per_owner", "max_uploads_per_owner"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 (0: no limit), got {getattr(self, name)}")
        if self.max_staged_bytes_per_owner < 0:
            raise ValueError(
                f"max_staged_bytes_per_owner: expected >= 0, got {self.max_staged_bytes_per_owner}"
            )
        if not 0 <= self.idle_timeout <= 86400:
            raise ValueError(f"idle_timeout: expected 0..86400 seconds, got {self.idle_timeout}")
        if not 0 <= self.session_idle_timeout <= 86400:
            raise ValueError(
                f"session_idle_timeout: expected 0..86400 seconds, got {self.session_idle_timeout}"
            )


@dataclass(frozen=True)
class Setting:
    name: str  # Config field
    flag: str
    env: str
    parse: object  # callable str -> value
    help: str


def _metrics_port(text: str) -> int | None:
    port = int(text)
    return None if port == 0 else port


def _data_port(text: str) -> int | None:
    t = text.strip().lower()
    return None if t in ("off", "none", "") else int(t)


def _optional_int(text: str) -> int | None:
    return None if str(text).strip() == "" else int(text)


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "--host", "COLIWORKER_HOST", str, "address to listen on (default 127.0.0.1)"),
    Setting("port", "--port", "COLIWORKER_PORT", int, "gRPC port (default 50051; 0 picks one)"),
    Setting(
        "backend",
        "--backend",
        "COLIWORKER_BACKEND",
        str,
        "auto | numpy | cupy (default auto: cupy when a GPU is usable, else numpy)",
    ),
    Setting(
        "devices",
        "--devices",
        "COLIWORKER_DEVICES",
        parse_devices,
        "comma-separated device ids to serve (default 0)",
    ),
    Setting(
        "metrics_host",
        "--metrics-host",
        "COLIWORKER_METRICS_HOST",
        str,
        "address of the Prometheus endpoint (default: same as --host)",
    ),
    Setting(
        "metrics_port",
        "--metrics-port",
        "COLIWORKER_METRICS_PORT",
        _metrics_port,
        "Prometheus /metrics port (default 9400; 0 disables)",
    ),
    Setting(
        "memory_limit",
        "--memory-limit",
        "COLIWORKER_MEMORY_LIMIT",
        parse_bytes,
        "per-device budget for tensors and KV caches, e.g. 40G (default 0: all memory)",
    ),
    Setting(
        "log_level",
        "--log-level",
        "COLIWORKER_LOG_LEVEL",
        str.upper,
        "DEBUG | INFO | WARNING | ERROR (default INFO)",
    ),
    Setting(
        "workers", "--workers", "COLIWORKER_WORKERS", int, "threads serving requests (default 16)"
    ),
    Setting(
        "max_message_bytes",
        "--max-message-bytes",
        "COLIWORKER_MAX_MESSAGE_BYTES",
        parse_bytes,
        "largest gRPC message accepted (default 64MiB; uploads are chunked)",
    ),
    Setting(
        "max_experts",
        "--max-experts",
        "COLIWORKER_MAX_EXPERTS",
        int,
        "experts in one expert group call (default 64, at most 64)",
    ),
    Setting(
        "max_pending_tickets",
        "--max-pending-tickets",
        "COLIWORKER_MAX_PENDING_TICKETS",
        int,
        "async expert-group tickets one owner may hold outstanding at once (default 64)",
    ),
    Setting(
        "max_sequences_per_call",
        "--max-sequences-per-call",
        "COLIWORKER_MAX_SEQUENCES_PER_CALL",
        int,
        "sequences in one ragged attention call (default 1024)",
    ),
    Setting(
        "max_kv_rows",
        "--max-kv-rows",
        "COLIWORKER_MAX_KV_ROWS",
        int,
        "rows one KV sequence may hold (default 1048576)",
    ),
    Setting(
        "fail_after",
        "--fail-after",
        "COLIWORKER_FAIL_AFTER",
        _optional_int,
        "testing: compute calls fail (UNAVAILABLE) after N successes (default off)",
    ),
    Setting(
        "unix_socket",
        "--unix-socket",
        "COLIWORKER_UNIX_SOCKET",
        str,
        "also listen on this Unix domain socket path (default off)",
    ),
    Setting(
        "data_port",
        "--data-port",
        "COLIWORKER_DATA_PORT",
        _data_port,
        "TCP port of the socket data plane (the fast remote transport, proto/FRAMES.md), on "
        "--host; 0 picks a free port, 'off' disables it (default --port + 1: 50052)",
    ),
    Setting(
        "data_unix_socket",
        "--data-unix-socket",
        "COLIWORKER_DATA_UNIX_SOCKET",
        str,
        "also serve the data plane on this Unix domain socket path (same host; default off)",
    ),
    Setting(
        "max_frame_bytes",
        "--max-frame-bytes",
        "COLIWORKER_MAX_FRAME_BYTES",
        parse_bytes,
        "largest data-plane call (body + arrays), uploads excepted (default 1G)",
    ),
    Setting(
        "data_spin_us",
        "--data-spin-us",
        "COLIWORKER_DATA_SPIN_US",
        int,
        "how long a data-plane connection polls for the next call before it sleeps, 0..10000 "
        "us (polling saves ~20-60 us per call and costs a core meanwhile; default 1000)",
    ),
    Setting(
        "data_stall_timeout",
        "--data-stall-timeout",
        "COLIWORKER_DATA_STALL_TIMEOUT",
        float,
        "seconds a data-plane frame may go without a byte moving in its middle (a client that "
        "sent half a call, or stopped reading its reply) before the connection is closed; "
        "0: never (default 30)",
    ),
    Setting(
        "data_idle_timeout",
        "--data-idle-timeout",
        "COLIWORKER_DATA_IDLE_TIMEOUT",
        float,
        "seconds a data-plane connection may wait between calls before the worker closes it, "
        "giving back its thread (the Python session and the C client dial again); 0: never "
        "(default 600)",
    ),
    Setting(
        "max_data_connections",
        "--max-data-connections",
        "COLIWORKER_MAX_DATA_CONNECTIONS",
        int,
        "data-plane connections open at once, a thread each; more are refused (default 256)",
    ),
    Setting(
        "token_file",
        "--token-file",
        "COLIWORKER_TOKEN_FILE",
        str,
        "file of accepted bearer tokens, one 'name:token' (or bare token) per line; calls "
        "without one get UNAUTHENTICATED (health stays open) (default off)",
    ),
    Setting(
        "tokens",
        "--tokens",
        "COLIWORKER_TOKENS",
        str,
        "comma-separated 'name:token' (or bare) tokens, added to --token-file's; prefer the "
        "variable or the file, command lines are visible to other users (default off)",
    ),
    Setting("tls_cert", "--tls-cert", "COLIWORKER_TLS_CERT", str, "PEM server certificate (TLS)"),
    Setting("tls_key", "--tls-key", "COLIWORKER_TLS_KEY", str, "PEM private key of --tls-cert"),
    Setting(
        "tls_client_ca",
        "--tls-client-ca",
        "COLIWORKER_TLS_CLIENT_CA",
        str,
        "PEM CA bundle: clients must present a certificate it signed (mutual TLS)",
    ),
    Setting(
        "insecure",
        "--insecure",
        "COLIWORKER_INSECURE",
        _parse_bool,
        "allow a non-loopback --host without tokens or TLS (warns; default: refuse to start)",
    ),
    Setting(
        "max_in_flight",
        "--max-in-flight",
        "COLIWORKER_MAX_IN_FLIGHT",
        int,
        "calls accepted at once, queued ones included; more get RESOURCE_EXHAUSTED (default 256)",
    ),
    Setting(
        "quota",
        "--quota",
        "COLIWORKER_QUOTA",
        parse_bytes,
        "bytes each token (owner) may keep resident, tensors + KV, e.g. 20G (default 0: none)",
    ),
    Setting(
        "drain_grace",
        "--drain-grace",
        "COLIWORKER_DRAIN_GRACE",
        float,
        "on SIGTERM: seconds in-flight calls get to finish before exit (default 10)",
    ),
    Setting(
        "max_sessions_per_owner",
        "--max-sessions-per-owner",
        "COLIWORKER_MAX_SESSIONS_PER_OWNER",
        int,
        "Session streams one owner (token) may keep open, each holds a --workers thread "
        "(default 4; 0: no limit)",
    ),
    Setting(
        "max_uploads_per_owner",
        "--max-uploads-per-owner",
        "COLIWORKER_MAX_UPLOADS_PER_OWNER",
        int,
        "uploads/updates one owner may have in progress at once (default 4; 0: no limit)",
    ),
    Setting(
        "max_staged_bytes_per_owner",
        "--max-staged-bytes-per-owner",
        "COLIWORKER_MAX_STAGED_BYTES_PER_OWNER",
        parse_bytes,
        "host bytes one owner's requests may hold staged (update buffers, session chunks) "
        "(default 2G; 0: no limit)",
    ),
    Setting(
        "idle_timeout",
        "--idle-timeout",
        "COLIWORKER_IDLE_TIMEOUT",
        float,
        "seconds an upload/update stream may send nothing before it is cancelled (default 60; "
        "0: never)",
    ),
    Setting(
        "session_idle_timeout",
        "--session-idle-timeout",
        "COLIWORKER_SESSION_IDLE_TIMEOUT",
        float,
        "seconds a Session stream may go without a call (on the stream or its doorbell) "
        "before it ends with DEADLINE_EXCEEDED, giving back its thread and segment "
        "(default 600; 0: never)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting; unset flags stay None so the environment can fill them."""
    for s in SETTINGS:
        if s.parse is _parse_bool:  # a switch: "--insecure" alone means true
            parser.add_argument(
                s.flag, dest=s.name, default=None, nargs="?", const="true", help=s.help
            )
            continue
        parser.add_argument(s.flag, dest=s.name, default=None, help=s.help)


def from_sources(
    args: argparse.Namespace | None, environ: Mapping[str, str], **overrides: object
) -> Config:
    """Build a Config: flags override environment override defaults. Errors name the flag
    and the variable."""
    values: dict[str, object] = {}
    for s in SETTINGS:
        raw = getattr(args, s.name, None) if args is not None else None
        source = s.flag
        if raw is None and s.env in environ:
            raw, source = environ[s.env], s.env
        if raw is None:
            continue
        try:
            values[s.name] = s.parse(raw)  # type: ignore[operator]
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    values.update(overrides)
    known = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in values.items() if k in known})  # type: ignore[arg-type]


def settings_table() -> str:
    """The README's configuration table (markdown)."""
    rows = ["| flag | variable | meaning |", "|---|---|---|"]
    rows += [f"| `{s.flag}` | `{s.env}` | {s.help} |" for s in SETTINGS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_table())
