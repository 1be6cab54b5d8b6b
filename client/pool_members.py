"""The members of a ``WorkerPool`` (``client/pool.py``): ``PoolRef``, one member's state,
and resolving one DNS name to the members' addresses."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable
from typing import Any

from coliworker.client.worker import TensorRef, WorkerClient, WorkerInfo

RECOVERY_OPTIONS = ("retain", "loader", "retries", "backoff", "max_backoff", "recover_timeout")
#: How long a member that failed is refused before a call probes it again, s.
PROBE_INTERVAL = 1.0
#: A probe's Info deadline, s: a worker that is up answers in milliseconds.
PROBE_TIMEOUT = 0.5
Resolver = Callable[[str], list[str]]
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class PoolRef(TensorRef):
    """A tensor of the pool: ``device`` is the pool's device id; ``handle``,
    ``content_hash`` and ``nbytes`` are those of the member's own reference (``inner``),
    which a recovering member re-points in place after a restart."""

    def __init__(self, inner: TensorRef, device: int, member: int, epoch: int) -> None:
        self.__dict__.update(inner=inner, member=member, epoch=epoch)
        self.fmt, self.in_features, self.out_features = (
            inner.fmt,
            inner.in_features,
            inner.out_features,
        )
        self.group_size, self.deduplicated = inner.group_size, inner.deduplicated
        self.__dict__["device"] = device

    handle = property(lambda self: self.inner.handle)  # type: ignore[assignment]
    content_hash = property(lambda self: self.inner.content_hash)  # type: ignore[assignment]
    nbytes = property(lambda self: self.inner.nbytes)  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PoolRef(handle={self.handle}, device={self.device}, worker={self.member})"

    __hash__ = object.__hash__
    __eq__ = object.__eq__  # type: ignore[assignment]


class _Member:
    """One worker of the pool: its client, devices, and whether it answers."""

    def __init__(self, index: int, address: str, client: WorkerClient, base: int) -> None:
        self.index, self.address, self.client, self.base = index, address, client, base
        self.local: tuple[int, ...] = ()  # the worker's device ids, in its order
        self.info: WorkerInfo | None = None
        self.down_since: float | None = None
        self.last_try = 0.0
        self.instance: str | None = None
        self.epoch = 0  # bumped when a plain member restarted: older PoolRefs are gone
        self.generation = 0  # bumped when re-pointed at a new address: sessions reopen
        self.revived = 0  # bumped when it answers again after being down
        self.lock = threading.Lock()

    @property
    def devices(self) -> range:
        return range(self.base, self.base + len(self.local))

    def name(self) -> str:
        d = self.devices
        span = f"device {d.start}" if len(d) == 1 else f"devices {d.start}..{d.stop - 1}"
        return f"worker {self.index} ({self.address}, {span})"


def resolve(name: str) -> list[str]:
    """``host:port`` -> one ``host:port`` per address the name resolves to, in a stable
    order: by reverse-DNS name where there is one (a StatefulSet's pods are
    ``coliworker-0.coliworker...``, ``-1``, ...: ordinal order, and the name survives a
    rescheduled pod's new IP), else by address."""
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"WorkerPool.addresses: expected 'host:port', got {name!r}")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    ips = sorted({str(i[4][0]) for i in infos})
    named = []
    for ip in ips:
        try:
            ptr = socket.gethostbyaddr(ip)[0]
        except OSError:
            ptr = ""
        shown = ptr if ptr and ptr not in ("localhost",) else ip
        shown = f"[{shown}]" if ":" in shown else shown
        named.append((_natural(ptr or ip), f"{shown}:{port}"))
    return [a for _, a in sorted(named)]


def _natural(s: str) -> list[Any]:
    """Sort key: 'pod-10' after 'pod-9'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


__all__ = ["PROBE_INTERVAL", "PROBE_TIMEOUT", "RECONNECT", "RECOVERY_OPTIONS", "PoolRef", "resolve"]
