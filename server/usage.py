"""Per-tensor call and row counts: the placement data behind ``TensorUsage`` and the
``coliworker_tensor_top_*`` metrics.

    UsageCounts()
    ├── tensor / experts / routed     one compute call that read these handles (hot path;
    │                                 a group's totals are spread over its handles when read)
    ├── drop(handle)                  the handle was freed: its counts go with it
    ├── of(handles)                   (handle, device, calls, rows) of one owner's live handles
    └── top(n)                        per device, the n largest (calls, rows), any owner

Recording is one append to a journal (no lock, no counting on the call's thread); the
journals are folded into the counts under the lock when they are read, in pieces by the
worker's upkeep thread (``fold``), or by the recording call that finds one ``JOURNAL``
entries long. A fold counts tensor calls one by one, and all
its group calls in one NumPy pass whatever their expert lists (decode's routers send a new
list of 8 nearly every call): each call's rows per expert add up per (gate, up, down) triple
in a table of pending totals, which are spread over the triples' handles when the counts are
read. So the fold's cost per group call is a table lookup per expert, the same however many
lists or tensors came before; the table holds at most ``PENDING`` triples (a fold that finds
more spreads and empties it). Counts are kept per handle id (a handle belongs to one owner
and ids are random 63-bit numbers, never reused while live), so reading one owner's counts
is a lookup of its live handles. Memory is bounded: at most ``limit`` entries; when full,
entries of handles that are no longer live (a call that finished after its tensor was freed)
are pruned, and if none are, new handles go uncounted until some are freed (``untracked``
says how many of their calls were missed). An expert group counts one call per expert on
each of its gate, up and down tensors, with that expert's rows; a routed group the (token,
slot) pairs routed to the expert, and no call for an expert no token was routed to.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import operator
import threading
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

#: Entries kept at most (~150 bytes each): GLM-5.2 whole is ~58k expert tensors.
LIMIT = 1 << 18
#: Expert triples in the table of pending group totals, at most (~250 bytes each; a fold
#: that finds more spreads and empties it, and the next folds look them up anew): those of
#: as many tensors as the counts keep, so live experts keep their slots (GLM-5.x: ~19k).
PENDING = LIMIT // 3
#: Calls of one kind (tensor, expert group, routed group) recorded but not yet counted, at
#: most (the call that finds more folds them).
JOURNAL = 1024


#: A journal entry's device, expert list and values (group calls' rows or routes).
_DEVICE, _EXPERTS, _VALUES = (operator.itemgetter(i) for i in range(3))


def _take(journal: collections.deque, most: int | None = None) -> list:
    """The entries of ``journal`` (the oldest ``most`` of them), taken from it (call with the
    lock: only appends race)."""
    pop = journal.popleft
    n = len(journal) if most is None else min(len(journal), most)
    return [pop() for _ in range(n)]


class UsageCounts:
    """Calls and rows per handle id (see the module docstring). Thread-safe."""

    def __init__(
        self, live: Callable[[], Collection[int]] | None = None, limit: int = LIMIT
    ) -> None:
        self.limit = limit
        self._untracked = 0  # calls not counted because the table was full
        self._live = live  # the ids of the live handles, to prune with when full
        self._lock = threading.Lock()
        self._counts: dict[int, list[int]] = {}  # handle -> [device, calls, rows]
        # group totals not yet spread over their handles, by slot: each slot's (gate, up,
        # down) handle ids and device, the slot of each triple, and per slot the calls and
        # rows (int64, grown as slots are made)
        self._triples: list[tuple] = []
        self._devices: list[int] = []
        self._slot: dict[tuple, int] = {}
        self._calls = np.zeros(64, np.int64)
        self._rows = np.zeros(64, np.int64)
        # calls recorded, not yet counted, one journal per kind: appends and poplefts of a
        # deque are atomic, so recording takes no lock and a fold meanwhile loses nothing.
        # tensor: (device, rows, handles); grouped: (device, experts, rows per expert);
        # routed: (device, experts, routes as int32 bytes)
        self._tensors: collections.deque[tuple] = collections.deque()
        self._grouped: collections.deque[tuple] = collections.deque()
        self._routed: collections.deque[tuple] = collections.deque()

    # -- recording (the compute handlers) --------------------------------------------------

    def _add(self, handle: int, device: int, rows: int, calls: int = 1) -> None:
        """Count ``calls`` calls of ``rows`` rows in all on ``handle`` (call with the lock)."""
        c = self._counts.get(handle)
        if c is None:
            if len(self._counts) >= self.limit and not self._prune():
                self._untracked += calls
                return
            c = self._counts[handle] = [device, 0, 0]
        c[1] += calls
        c[2] += rows

    def _prune(self) -> bool:
        """Drop entries of handles no longer live; True if that made room."""
        if self._live is None:
            return False
        live = self._live()
        for h in [h for h in self._counts if h not in live]:
            del self._counts[h]
        return len(self._counts) < self.limit

    def tensor(self, device: int, rows: int, *handles: int) -> None:
        """One call (matmul, expert_mlp, attention) that applied ``handles`` to ``rows``
        rows; a handle of 0 (an absent o_proj) is skipped."""
        self._record(self._tensors, (device, rows, handles))

    def experts(self, device: int, experts: tuple, rows: Sequence[int] | np.ndarray) -> None:
        """One expert group: ``experts`` are its (gate, up, down) handle ids, ``rows[c]``
        the rows of expert c (an expert with 0 rows gets no call)."""
        self._record(self._grouped, (device, experts, rows))

    def routed(self, device: int, experts: tuple, routes: np.ndarray) -> None:
        """One routed group: expert c gets the (token, slot) pairs whose route is c
        (``routes``: int32; its bytes are kept until counted, the array may change)."""
        self._record(self._routed, (device, experts, routes.tobytes()))

    def _record(self, journal: collections.deque, entry: tuple) -> None:
        journal.append(entry)
        if len(journal) > JOURNAL:
            with self._lock:
                self._drain()

    @property
    def untracked(self) -> int:
        """Calls not counted because the table was full of live handles."""
        with self._lock:
            self._fold()
            return self._untracked

    def fold(self, most: int) -> int:
        """Count the oldest ``most`` calls of each journal (the rest stay for later); how
        many were counted (``server/upkeep.py`` folds the journals in such pieces between
        calls, so a recording call seldom finds one full)."""
        with self._lock:
            return self._drain(most)

    def _drain(self, most: int | None = None) -> int:
        """Count the journals' calls (the oldest ``most`` of each), call with the lock:
        tensor calls one by one, the group calls into the pending totals (``_add_groups``);
        how many were counted."""
        tensors = _take(self._tensors, most)
        for device, rows, handles in tensors:
            for h in handles:
                if h:
                    self._add(h, device, rows)
        routed, grouped = _take(self._routed, most), _take(self._grouped, most)
        if routed or grouped:
            self._add_groups(routed, grouped)
        return len(tensors) + len(routed) + len(grouped)

    def _add_groups(self, routed: list[tuple], grouped: list[tuple]) -> None:
        """Add group calls, routed ones first, to their triples' pending totals (call with
        the lock). Each (call, expert) is a position: its triple's slot, and its rows (of a
        routed call: the (token, slot) pairs routed there); a slot gets a call from each of
        its positions with rows, and their rows. Each distinct expert list (by identity: a
        list sent again is the handler's cached tuple) has its triples looked up once, all
        lists' in one pass; the rest is NumPy over all positions."""
        calls = routed + grouped
        lists = list(map(_EXPERTS, calls))
        keys = list(map(id, lists))
        distinct = dict(zip(keys, lists, strict=True))  # id -> list (calls keep them alive)
        k = np.fromiter(map(len, distinct.values()), np.int64, len(distinct))  # experts
        n = int(k.sum())
        if self._slot:
            triples = itertools.chain.from_iterable(distinct.values())
            slots = np.fromiter(map(self._slot.get, triples, itertools.repeat(-1)), np.int64, n)
        else:  # an empty table (the first fold, or one after emptying it): all are new
            slots = np.full(n, -1, np.int64)
        if n and slots.min() < 0:
            self._new_slots(calls, keys, distinct, k, slots)
        if len(distinct) < len(keys):  # lists sent more than once: gather each call's slots
            index = dict(zip(distinct, itertools.count()))
            d = np.fromiter(map(index.__getitem__, keys), np.int64, len(keys))
            first = np.cumsum(k) - k  # of each list in slots
            k = k[d]
            ends = np.cumsum(k)
            slots = slots[np.repeat(first[d] - (ends - k), k) + np.arange(ends[-1])]
        else:
            ends = np.cumsum(k)
        parts = []  # int64: the rows of each position
        nr = len(routed)
        if nr:
            starts = ends[:nr] - k[:nr]  # each routed call's first position
            values = list(map(_VALUES, routed))
            idx = np.repeat(starts, np.fromiter(map(len, values), np.int64, nr) >> 2)
            idx += np.frombuffer(b"".join(values), np.int32)
            parts.append(np.bincount(idx, minlength=int(ends[nr - 1])))
        if grouped:
            n = len(slots) - (int(ends[nr - 1]) if nr else 0)
            flat_rows = itertools.chain.from_iterable(map(_VALUES, grouped))
            parts.append(np.fromiter(flat_rows, np.int64, n))
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        np.add.at(self._calls, slots, (rows > 0).astype(np.int64))  # int64: its fast path
        np.add.at(self._rows, slots, rows)
        if len(self._triples) > PENDING:
            self._spread(empty=True)

    def _new_slots(
        self,
        calls: list[tuple],
        keys: list[int],
        distinct: dict[int, tuple],
        k: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        """Make slots for the triples whose ``slots`` are -1 (of ``distinct``'s lists, of
        ``k`` triples each, in order), and fill those in: one setdefault each, in C, gives
        the i-th missing triple number made + i, or its earlier position's; the first
        positions' numbers, renumbered made, made + 1, ..., are the new slots (call with
        the lock)."""
        made = len(self._triples)
        miss = np.flatnonzero(slots < 0)
        flat = list(itertools.chain.from_iterable(distinct.values()))
        missing = flat if len(miss) == len(flat) else list(map(flat.__getitem__, miss.tolist()))
        own = itertools.count(made)
        got = np.fromiter(map(self._slot.setdefault, missing, own), np.int64, len(missing))
        first = got == np.arange(made, made + len(missing))  # each new triple's first place
        slots[miss] = (np.cumsum(first) + (made - 1))[got - made]
        at = np.flatnonzero(first).tolist()
        new = list(map(missing.__getitem__, at))
        self._slot.update(zip(new, itertools.count(made)))
        self._triples += new
        device = dict(zip(keys, map(_DEVICE, calls), strict=True))  # of each list
        of_list = np.fromiter(map(device.__getitem__, distinct), np.int64, len(distinct))
        self._devices += np.repeat(of_list, k)[miss[at]].tolist()
        if len(self._calls) < len(self._triples):  # room for the new slots
            size = max(2 * len(self._calls), len(self._triples))
            for name in ("_calls", "_rows"):
                old = getattr(self, name)
                grown = np.zeros(size, np.int64)
                grown[: len(old)] = old
                setattr(self, name, grown)

    def _spread(self, empty: bool = False) -> None:
        """Add each pending triple's totals to its handles' counts, and zero them; with
        ``empty`` drop the slots too (call with the lock)."""
        n = len(self._triples)
        touched = np.flatnonzero(self._calls[:n])
        if len(touched):
            calls, rows = self._calls[touched].tolist(), self._rows[touched].tolist()
            self._calls[touched] = 0
            self._rows[touched] = 0
            triples, devices = self._triples, self._devices
            for i, c, r in zip(touched.tolist(), calls, rows, strict=True):
                device = devices[i]
                for h in triples[i]:
                    self._add(h, device, r, c)
        if empty:
            self._triples, self._devices, self._slot = [], [], {}

    def _fold(self) -> None:
        """Count the journals and spread the pending group totals over their handles (call
        with the lock)."""
        self._drain()
        self._spread()

    def drop(self, handle: int) -> None:
        """The handle was freed. (Its triples keep their pending slots, at zero: a call
        that finishes after the free counts it anew, as one recorded before it would.)"""
        with self._lock:
            self._fold()
            self._counts.pop(handle, None)

    # -- reading ---------------------------------------------------------------------------

    def of(self, handles: Iterable[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
        """(handle, device, calls, rows) of each (handle, device) given (live handles of
        one owner; a handle never called has zero counts), most called first."""
        with self._lock:
            self._fold()
            out = []
            for h, device in handles:
                c = self._counts.get(h)
                out.append((h, device, c[1], c[2]) if c else (h, device, 0, 0))
        out.sort(key=lambda t: (-t[2], -t[3], t[0]))
        return out

    def top(self, n: int) -> dict[int, list[tuple[int, int]]]:
        """device -> the ``n`` largest (calls, rows) of its tensors, any owner, largest
        first (what the metrics expose: bounded, and no handle ids)."""
        with self._lock:
            self._fold()
            by_device: dict[int, list[tuple[int, int]]] = {}
            for device, calls, rows in self._counts.values():
                by_device.setdefault(device, []).append((calls, rows))
        return {d: heapq.nlargest(n, v) for d, v in by_device.items()}

    def __len__(self) -> int:
        with self._lock:
            self._fold()
            return len(self._counts)


__all__ = ["LIMIT", "UsageCounts"]
