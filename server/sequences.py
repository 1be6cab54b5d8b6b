"""Resident MLA KV caches, one per (owner, kv_b handle, client sequence id).

Each ragged attention call carries, per sequence, ``start`` and the rows from ``start`` on:
``start`` below the resident length rolls the cache back first, above it is an error. Here the
caches are rolled back and given room (growth, budget, eviction); the rows go up with the
attention call itself, which claims them when it succeeds.

A refused call changes nothing: every check (shapes, starts, rows, the growth each cache
needs against the owner's quota and the device budget) runs before any cache is created,
grown, rolled back or evicted, and a cache created for the call is registered only once all
of them have room.

Owners never touch each other's caches. Calls on one (owner, kv_b) run one at a time
(``ordered``), calls on different ones run side by side. When the device budget (or the
device itself) runs out, the least recently used sequences *of the same owner* that no
running call uses are evicted; their next call with ``start > 0`` is told so with
FAILED_PRECONDITION (never a silent wrong answer) and can resend from ``start = 0``.
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


@dataclass(frozen=True)
class _KvB:
    """What ``ordered`` needs of a kv_b handle (owner and id), for a freed sequence."""

    owner: str
    id: int


@dataclass
class Sequence_:
    cache: KVCache
    device: int
    k: int
    r: int
    last_used: float = field(default_factory=time.monotonic)
    # The cache's exact ``growth`` (None where the backend's caches have none), looked up
    # once rather than on every call.
    growth: Callable[[int], int] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.growth = getattr(self.cache, "growth", None)


class _Turn:
    """The turn of one (owner, kv_b), and ``ordered``'s context for the calls in it.

    ``ordered`` counts a call in (``users``: the calls holding or waiting for the turn), the
    body of its ``with`` holds ``lock``, and the turn goes once no call is left in it. It keeps
    nothing of one call, so the calls of one (owner, kv_b) share it. A plain class on the hot
    path of every ragged call (a generator-based context manager costs about twice as much).
    Here, in ``ordered`` and in ``prepare`` the store's lock is taken with acquire / release
    in ``try``: the same as a ``with`` block in about half the instructions.
    """

    __slots__ = ("lock", "users", "store", "key")

    def __init__(self, store: SequenceStore) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.store = store
        self.key: tuple[str, int] = ("", 0)  # set by ``ordered``

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.lock.release()
        store = self.store
        store.lock.acquire()
        try:
            self.users -= 1
            if not self.users:
                del store._turns[self.key]
                # No call holds or waits for it and none can find it now: the next new turn
                # reuses it rather than making a _Turn and its lock per call.
                store._spare_turn = self
        finally:
            store.lock.release()


class RowsIn:
    """One sequence's part of a ragged call, decoded and shape-checked (a plain class with
    slots: made for every sequence of every call, it costs a third of a frozen dataclass)."""

    __slots__ = ("sequence_id", "start", "latent", "rope")

    def __init__(self, sequence_id: int, start: int, latent: np.ndarray, rope: np.ndarray) -> None:
        self.sequence_id = sequence_id
        self.start = start
        self.latent = latent  # float32 [n, K]
        self.rope = rope  # float32 [n, R]


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
        # The maps, budgets and cache growth (short); attention runs outside it, holding
        # its (owner, kv_b) turn, and an eviction never picks a cache whose turn is held.
        self.lock = threading.RLock()
        self._seqs: dict[Key, Sequence_] = {}
        self._evicted: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self._turns: dict[tuple[str, int], _Turn] = {}
        self._spare_turn: _Turn | None = None  # one freed turn, unlocked, for the next

    def ordered(self, kv_b: Handle | _KvB) -> _Turn:
        """The turn of (owner, kv_b) for the body of a ``with``: ragged calls on one kv_b of
        one owner run one at a time (each rolls back or appends its caches), others side by
        side. Hold it around ``prepare`` and the attention that reads the caches, and around
        ``drop_handle`` (a kv_b freed while a call on it runs waits for it). Call it only as
        the ``with``'s expression: it counts the call in the turn, the ``with`` ends it."""
        key = (kv_b.owner, kv_b.id)
        lock = self.lock
        lock.acquire()
        try:
            turn = self._turns.get(key)
            if turn is None:
                turn = self._spare_turn
                if turn is None:
                    turn = _Turn(self)
                else:
                    self._spare_turn = None
                turn.key = key
                self._turns[key] = turn
            turn.users += 1
        finally:
            lock.release()
        return turn

    def prepare(self, kv_b: Handle, rows: Sequence[RowsIn], k: int, r: int) -> list[KVCache]:
        """Roll back each sequence to its ``start`` and make room for its rows; returns the
        caches in call order. The rows themselves travel in the attention call
        (``Backend.attention_ragged``'s ``rows``), which claims them only when it succeeds.

        Call holding ``ordered(kv_b)`` and keep holding it while the attention reads them.
        Everything is checked and admitted before any cache changes: a refusal leaves every
        sequence, and the owner's and device's accounting, as they were.
        """
        lock = self.lock
        lock.acquire()
        try:
            caches = self._resident(kv_b, rows, k, r)
            return caches if caches is not None else self._prepare(kv_b, rows, k, r)
        finally:
            lock.release()

    def _resident(
        self, kv_b: Handle, rows: Sequence[RowsIn], k: int, r: int
    ) -> list[KVCache] | None:
        """``prepare``'s common case, a decode step: every sequence is resident with this
        call's K and R, ``start`` is within its rows, ``start`` + rows within --max-kv-rows,
        and its cache has room for them already (the backend's exact ``growth`` is 0). Then
        ``_prepare`` would create, grow and evict nothing, and of its checks only the owner's
        quota and the device's budget for 0 more bytes can refuse (either may be over its
        limit after a charge that went past it). Decides as ``_prepare`` does, with less
        work; returns None, having changed nothing, where any of that does not hold (or
        the device is over its budget: ``_admit`` evicts or refuses), for ``_prepare`` to
        decide. Call with the lock."""
        owner, kv_id, max_rows, seqs = kv_b.owner, kv_b.id, self.max_rows, self._seqs
        caches: list[KVCache] = []
        # (sequence, start) in call order: zip(strict=True) over rows would cost ~3k
        # instructions (a call with a keyword)
        hit: list[tuple[Sequence_, int]] = []
        for s in rows:
            seq = seqs.get((owner, kv_id, s.sequence_id))
            if seq is None or seq.k != k or seq.r != r:
                return None
            cache, start = seq.cache, s.start
            total = start + len(s.latent)
            if start > cache.length or total < 1 or total > max_rows:
                return None
            grow = seq.growth
            if grow is None or grow(total):
                return None
            caches.append(cache)
            hit.append((seq, start))
        # (Neither is called when unlimited, where it could not refuse.)
        if self.quota.limit:
            self.quota.check(owner, 0, "attention_ragged")  # the refusal _admit's gives
        if self.budget.limit and not self.budget.fits(kv_b.data.spec.device, 0):
            return None
        now = time.monotonic()
        for seq, start in hit:
            seq.last_used = now
            cache = seq.cache
            if start < cache.length:
                cache.truncate(start)
        return caches

    def _prepare(self, kv_b: Handle, rows: Sequence[RowsIn], k: int, r: int) -> list[KVCache]:
        """``prepare`` in general: new sequences, growth, eviction, and every refusal with
        its message. Call with the lock."""
        owner, device = kv_b.owner, kv_b.spec.device
        keys = [(owner, kv_b.id, s.sequence_id) for s in rows]
        plan: list[tuple[Key, RowsIn, Sequence_ | None, int]] = []
        for i, (key, s) in enumerate(zip(keys, rows, strict=True)):
            seq = self._seqs.get(key)
            if seq is not None and (seq.k, seq.r) != (k, r):
                raise InvalidArgument(
                    f"attention_ragged.sequences[{i}]: sequence {s.sequence_id} holds "
                    f"K={seq.k}, R={seq.r} rows, this call sends K={k}, R={r}"
                )
            resident = seq.cache.length if seq is not None else 0
            if s.start > resident:
                why = (
                    " (it was evicted under memory pressure; resend its rows from start 0)"
                    if seq is None and key in self._evicted
                    else ""
                )
                raise FailedPrecondition(
                    f"attention_ragged.sequences[{i}].start: expected <= {resident} "
                    f"(resident rows of sequence {s.sequence_id}), got {s.start}{why}"
                )
            total = s.start + len(s.latent)
            if total < 1:
                raise InvalidArgument(
                    f"attention_ragged.sequences[{i}]: sequence {s.sequence_id} would "
                    f"attend 0 rows (start 0 and no rows sent)"
                )
            if total > self.max_rows:
                raise ResourceExhausted(
                    f"attention_ragged.sequences[{i}]: sequence {s.sequence_id} would hold "
                    f"{total} rows, limit {self.max_rows} (--max-kv-rows)"
                )
            plan.append((key, s, seq, total))
        fresh = [
            self.backend.new_kv(device, k, r) if seq is None else None for _, _, seq, _ in plan
        ]
        try:
            caches = self._admit(kv_b, plan, fresh, k, r)
        except BaseException:
            for c in fresh:
                if c is not None:
                    self._drop_fresh(owner, device, c)
            raise
        now = time.monotonic()
        for (key, s, seq, _), cache in zip(plan, caches, strict=True):
            if seq is None:
                seq = Sequence_(cache, device, k, r)
                self._seqs[key] = seq
                self._evicted.pop(key, None)
            seq.last_used = now
            if s.start < cache.length:
                cache.truncate(s.start)
        return caches

    def _admit(
        self,
        kv_b: Handle,
        plan: list[tuple[Key, RowsIn, Sequence_ | None, int]],
        fresh: list[KVCache | None],
        k: int,
        r: int,
    ) -> list[KVCache]:
        """Room for every sequence of ``plan`` (existing caches, or ``fresh`` ones), admitted
        against the owner's quota and the device budget first (evicting the owner's own idle
        sequences only where that is enough). Grows the caches; rolls nothing back, so the
        caller releases ``fresh`` caches on an error (existing ones keep their capacity,
        charged, their rows untouched)."""
        owner, device = kv_b.owner, kv_b.spec.device
        caches: list[KVCache] = []
        known: list[bool] = []  # the backend said this cache needs no more bytes
        need = 0
        for (_, _s, seq, total), new in zip(plan, fresh, strict=True):
            cache = seq.cache if seq is not None else new
            assert cache is not None
            caches.append(cache)
            grow = getattr(cache, "growth", None)
            # Exact growth when the backend says it; else the least the rows can take.
            g = grow(total) if grow else max(0, 4 * total * (k + r) - cache.nbytes)
            known.append(grow is not None and g == 0)
            need += g
        self.quota.check(owner, need, "attention_ragged")
        protected = {key for key, _, _, _ in plan}
        if need and not self.budget.limit:
            self._check_free(owner, device, kv_b, protected, need)
        if not self.budget.fits(device, need):
            spare = sum(q.cache.nbytes for _, q in self._victims(owner, device, kv_b, protected))
            if not self.budget.fits(device, need - spare):
                raise ResourceExhausted(
                    f"attention_ragged: needs {need} more bytes of KV on device {device}, over "
                    f"its {self.budget.limit}-byte budget (--memory-limit) even after evicting "
                    f"this owner's {spare} bytes of idle sequences"
                )
            while not self.budget.fits(device, need) and self._evict_one(
                owner, device, kv_b, protected
            ):
                pass
        for (_, s, _, total), cache, room in zip(plan, caches, known, strict=True):
            if total > cache.length and not room:  # with room, reserve adds nothing
                self._grow(cache, total - cache.length, owner, device, kv_b, protected, s)
        return caches

    def _check_free(
        self, owner: str, device: int, kv_b: Handle, protected: set[Key], need: int
    ) -> None:
        """With no --memory-limit the device's free memory bounds growth (host memory within
        the process's cgroup for the NumPy backend: an allocation past it would be an OOM
        kill, not an error)."""
        free = next((d.free_memory_bytes for d in self.backend.devices() if d.id == device), None)
        if free is None or need <= free:
            return
        spare = sum(q.cache.nbytes for _, q in self._victims(owner, device, kv_b, protected))
        if need > free + spare:
            raise ResourceExhausted(
                f"attention_ragged: needs {need} more bytes of KV on device {device}, which has "
                f"{free} bytes free (with this owner's {spare} bytes of idle sequences)"
            )
        while need > free and self._evict_one(owner, device, kv_b, protected):
            free = next(d.free_memory_bytes for d in self.backend.devices() if d.id == device)

    def _grow(
        self,
        cache: KVCache,
        n: int,
        owner: str,
        device: int,
        kv_b: Handle,
        protected: set[Key],
        s: RowsIn,
    ) -> None:
        """``cache.reserve(n)`` (evicting the owner's idle sequences while the device is out
        of memory), charged to the budget and the quota."""
        while True:
            before = cache.nbytes
            try:
                cache.reserve(n)
            except OutOfDeviceMemory:
                if self._evict_one(owner, device, kv_b, protected):
                    continue
                raise
            break
        grown = cache.nbytes - before
        self.budget.charge(device, grown)
        if not self.quota.charge(owner, grown):  # only where growth was not known up front
            raise ResourceExhausted(
                f"attention_ragged: sequence {s.sequence_id} needs {grown} more bytes of KV, "
                f"over the {self.quota.limit}-byte quota of its owner (--quota)"
            )

    def _drop_fresh(self, owner: str, device: int, cache: KVCache) -> None:
        """A cache made for a refused call: its memory and charges go."""
        nbytes = cache.nbytes
        cache.release()
        if nbytes:
            self.budget.release(device, nbytes)
            self.quota.discharge(owner, nbytes)

    def _victims(
        self, owner: str, device: int, kv_b: Handle, protected: set[Key]
    ) -> list[tuple[Key, Sequence_]]:
        """The owner's sequences on ``device`` that may be evicted now: not in this call, and
        not on another kv_b whose turn a running call holds."""
        return [
            (key, q)
            for key, q in self._seqs.items()
            if key[0] == owner
            and q.device == device
            and key not in protected
            and (key[1] == kv_b.id or (owner, key[1]) not in self._turns)
        ]

    def _evict_one(self, owner: str, device: int, kv_b: Handle, protected: set[Key]) -> bool:
        victims = self._victims(owner, device, kv_b, protected)
        if not victims:
            return False
        key, _ = min(victims, key=lambda v: v[1].last_used)
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
        """Release a sequence's caches (all kv_b handles, or one), each once no call on its
        kv_b is running; returns (count, bytes)."""
        with self.lock:
            kv_bs = {
                k[1]
                for k in self._seqs
                if k[0] == owner and k[2] == sequence_id and (kv_b is None or k[1] == kv_b)
            }
            for k in [k for k in self._evicted if k[0] == owner and k[2] == sequence_id]:
                self._evicted.pop(k, None)
        count = released = 0
        for kb in sorted(kv_bs):
            with self.ordered(_KvB(owner, kb)):
                with self.lock:
                    key = (owner, kb, sequence_id)
                    if key in self._seqs:
                        count += 1
                        released += self._release(key)
        return count, released

    def drop_handle(self, kv_b: Handle) -> None:
        """The kv_b handle went away: its caches go too (hold ``ordered(kv_b)``)."""
        with self.lock:
            for k in [k for k in self._seqs if k[0] == kv_b.owner and k[1] == kv_b.id]:
                self._release(k)

    def lengths(self, kv_b: Handle, sequence_ids: Sequence[int]) -> list[int]:
        with self.lock:
            out = []
            for sid in sequence_ids:
                seq = self._seqs.get((kv_b.owner, kv_b.id, sid))
                out.append(seq.cache.length if seq else 0)
            return out

    def usage(self, owner: str | None = None) -> dict[int, tuple[int, int]]:
        """device -> (sequences, bytes): the worker's, or only ``owner``'s."""
        with self.lock:
            out: dict[int, list[int]] = {}
            for key, q in self._seqs.items():
                if owner is not None and key[0] != owner:
                    continue
                v = out.setdefault(q.device, [0, 0])
                v[0] += 1
                v[1] += q.cache.nbytes
            return {d: (v[0], v[1]) for d, v in out.items()}
