"""One-time tickets that authenticate a data-plane connection (``DataTicket``).

A client that holds a bearer token over gRPC (or mutual TLS) but should not send it again
on the data port asks for a ticket and sends it in its HELLO. A ticket is 32 random bytes,
bound to the owner that asked, valid once and for ``TTL_MS``; each owner has at most
``PER_OWNER`` unused tickets (the oldest goes first), so no owner can exhaust another's.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time

TTL_MS = 30_000
PER_OWNER = 16


class DataTickets:
    def __init__(self, ttl_ms: int = TTL_MS, per_owner: int = PER_OWNER) -> None:
        self.ttl_ms, self.per_owner = ttl_ms, per_owner
        self._lock = threading.Lock()
        self._by_owner: dict[str, dict[bytes, float]] = {}  # owner -> ticket -> expiry

    def issue(self, owner: str) -> bytes:
        ticket = secrets.token_bytes(32)
        now = time.monotonic()
        with self._lock:
            mine = self._by_owner.setdefault(owner, {})
            for t, expiry in list(mine.items()):
                if expiry <= now:
                    del mine[t]
            while len(mine) >= self.per_owner:
                del mine[next(iter(mine))]  # insertion order: the oldest
            mine[ticket] = now + self.ttl_ms / 1000
        return ticket

    def redeem(self, ticket: bytes) -> str | None:
        """The owner of ``ticket`` if it is valid (it is used up), else None."""
        if len(ticket) != 32:
            return None
        now = time.monotonic()
        with self._lock:
            for owner, mine in self._by_owner.items():
                for t in mine:
                    if hmac.compare_digest(t, ticket):
                        expiry = mine.pop(t)
                        return owner if expiry > now else None
        return None


__all__ = ["DataTickets"]
