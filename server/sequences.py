"""Resident MLA KV caches, one per (owner, kv_b handle, client sequence id).

Each ragged attention call carries, per sequence, ``start`` and the rows from ``start`` on:
``start`` below the resident length rolls the cache back first, above it is an error. Here the
caches are rolled back and given room (growth, budget, eviction); the rows go up with the
attention call itself, which claims them when it succeeds. When a device budget (or the device
itself) runs out, the least recently used sequences that the current call does not touch are
evicted; their next call with ``start > 0`` is told so with FAILED_PRECONDITION (never a silent
wrong answer) and can resend from ``start = 0``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from coliworker.server.backend import Backend, KVCache
from coliworker.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    OutOfDeviceMemory,
    ResourceExhausted,
)
from coliworker.server.quota import Quota
from coliworker.server.store import Budget, Handle

Key = tuple[str, int, int]  # (owner, kv_b handle id, sequence id)


@dataclass
class Sequence_:
    cache: KVCache
    device: int
    k: int
    r: int
    last_used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class RowsIn:
    """One sequence's part of a ragged call, decoded and shape-checked."""

    sequence_id: int
    start: int
    latent: np.ndarray  # float32 [n, K]
    rope: np.ndarray  # float32 [n, R]


class SequenceStore:
    def __init__(
        self,
        backend: Backend,
        budget: Budget,
        max_rows: int,
        on_evict: Callable[[int], None] | None = None,
        quota: Quota | None = None,
    ) -> None:
        self.backend = backend
        self.budget = budget
        self.quota = quota or Quota()  # per-owner bytes (quota.py)
        self.max_rows = max_rows
        self.on_evict = on_evict
        # One lock for cache mutation and the attention that reads the caches: an eviction
        # can never free a cache a running call is reading.
        self.lock = threading.RLock()
        self._seqs: dict[Key, Sequence_] = {}
        self._evicted: collections.OrderedDict[Key, None] = collections.OrderedDict()

    def prepare(self, kv_b: Handle, rows: Sequence[RowsIn], k: int, r: int) -> list[KVCache]:
        """Roll back each sequence to its ``start`` and make room for its rows; returns the
        caches in call order. The rows themselves travel in the attention call
        (``Backend.attention_ragged``'s ``rows``), which claims them only when it succeeds.

        Call with ``self.lock`` held and keep holding it while the attention reads them.
        Everything is validated before any cache changes.
        """
        keys = [(kv_b.owner, kv_b.id, s.sequence_id) for s in rows]
        plan: list[tuple[Key, RowsIn, Sequence_ | None]] = []
        need = 0
        for i, (key, s) in enumerate(zip(keys, rows, strict=True)):
            seq = self._seqs.get(key)
            if seq is not None and (seq.k, seq.r) != (k, r):
                raise InvalidArgument(
                    f"attention_ragged.sequences[{i}]: sequence {s.sequence_id} holds K={seq.k}, "
                    f"R={seq.r} rows, this call sends K={k}, R={r}"
                )
            resident = seq.cache.length if seq is not None else 0
            if s.start > resident:
                why = (
                    " (it was evicted under memory pressure; resend its rows from start 0)"
                    if seq is None and key in self._evicted
                    else ""
                )
                raise FailedPrecondition(
                    f"attention_ragged.sequences[{i}].start: expected <= {resident} (resident "
                    f"rows of sequence {s.sequence_id}), got {s.start}{why}"
                )
            total = s.start + len(s.latent)
            if total < 1:
                raise InvalidArgument(
                    f"attention_ragged.sequences[{i}]: sequence {s.sequence_id} would attend 0 "
                    f"rows (start 0 and no rows sent)"
                )
            if total > self.max_rows:
                raise ResourceExhausted(
                    f"attention_ragged.sequences[{i}]: sequence {s.sequence_id} would hold "
                    f"{total} rows, limit {self.max_rows} (--max-kv-rows)"
                )
            plan.append((key, s, seq))
            # Least new memory these rows can take (checked against the quota up front).
            need += max(0, 4 * total * (k + r) - (seq.cache.nbytes if seq is not None else 0))
        self.quota.check(kv_b.owner, need, "attention_ragged")

        device = kv_b.spec.device
        protected = set(keys)
        caches: list[KVCache] = []
        for key, s, seq in plan:
            if seq is None:
                seq = Sequence_(self.backend.new_kv(device, k, r), device, k, r)
                self._seqs[key] = seq
                self._evicted.pop(key, None)
            seq.last_used = time.monotonic()
            if s.start < seq.cache.length:
                seq.cache.truncate(s.start)
            if len(s.latent):
                self._reserve(seq, s, protected, key[0])
            caches.append(seq.cache)
        return caches

    def _reserve(self, seq: Sequence_, s: RowsIn, protected: set[Key], owner: str) -> None:
        """Room for the rows, charging the budget for growth and evicting LRU sequences if
        needed. No rows are claimed, so a refusal leaves nothing to undo."""
        while True:
            before = seq.cache.nbytes
            try:
                seq.cache.reserve(len(s.latent))
            except OutOfDeviceMemory:
                if self._evict_one(seq.device, protected):
                    continue
                raise
            break
        grown = seq.cache.nbytes - before
        while not self.budget.fits(seq.device, grown) and self._evict_one(seq.device, protected):
            pass
        self.budget.charge(seq.device, grown)
        if not self.budget.fits(seq.device, 0):
            raise ResourceExhausted(
                f"attention_ragged: sequence {s.sequence_id} needs {grown} more bytes of KV on "
                f"device {seq.device}, over its {self.budget.limit}-byte budget (--memory-limit) "
                f"with nothing left to evict"
            )
        if not self.quota.charge(owner, grown):
            raise ResourceExhausted(
                f"attention_ragged: sequence {s.sequence_id} needs {grown} more bytes of KV, "
                f"over the {self.quota.limit}-byte quota of its owner (--quota)"
            )

    def _evict_one(self, device: int, protected: set[Key]) -> bool:
        victims = [
            (q.last_used, key)
            for key, q in self._seqs.items()
            if q.device == device and key not in protected
        ]
        if not victims:
            return False
        _, key = min(victims)
        self._release(key)
        self._evicted[key] = None
        while len(self._evicted) > 65536:
            self._evicted.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(device)
        return True

    def _release(self, key: Key) -> int:
        seq = self._seqs.pop(key)
        nbytes = seq.cache.nbytes
        seq.cache.release()
        self.budget.release(seq.device, nbytes)
        self.quota.discharge(key[0], nbytes)
        return nbytes

    def free(self, owner: str, sequence_id: int, kv_b: int | None) -> tuple[int, int]:
        """Release a sequence's caches (all kv_b handles, or one); returns (count, bytes)."""
        with self.lock:
            keys = [
                k
                for k in self._seqs
                if k[0] == owner and k[2] == sequence_id and (kv_b is None or k[1] == kv_b)
            ]
            released = sum(self._release(k) for k in keys)
            for k in [k for k in self._evicted if k[0] == owner and k[2] == sequence_id]:
                self._evicted.pop(k, None)
            return len(keys), released

    def drop_handle(self, kv_b: Handle) -> None:
        """The kv_b handle went away: its caches go too."""
        with self.lock:
            for k in [k for k in self._seqs if k[1] == kv_b.id]:
                self._release(k)

    def lengths(self, kv_b: Handle, sequence_ids: Sequence[int]) -> list[int]:
        with self.lock:
            out = []
            for sid in sequence_ids:
                seq = self._seqs.get((kv_b.owner, kv_b.id, sid))
                out.append(seq.cache.length if seq else 0)
            return out

    def usage(self) -> dict[int, tuple[int, int]]:
        """device -> (sequences, bytes)."""
        with self.lock:
            out: dict[int, list[int]] = {}
            for q in self._seqs.values():
                v = out.setdefault(q.device, [0, 0])
                v[0] += 1
                v[1] += q.cache.nbytes
            return {d: (v[0], v[1]) for d, v in out.items()}
