"""Per-tensor call and row counts: the placement data behind ``TensorUsage`` and the
``coliworker_tensor_top_*`` metrics.

    UsageCounts()
    ├── tensor / experts / routed     one compute call that read these handles (hot path;
    │                                 a group's totals are spread over its handles when read)
    ├── drop(handle)                  the handle was freed: its counts go with it
    ├── of(handles)                   (handle, device, calls, rows) of one owner's live handles
    └── top(n)                        per device, the n largest (calls, rows), any owner

Recording is one append to a journal (no lock, no counting on the call's thread); the
journal is folded into the counts under the lock when they are read, or by the recording
call that finds it ``JOURNAL`` entries long. Counts are kept per handle id (a handle
belongs to one owner and ids are random 63-bit numbers, never reused while live), so
reading one owner's counts is a lookup of its live handles. Memory is bounded: at most
``limit`` entries; when full, entries of handles that are no longer live (a call that
finished after its tensor was freed) are pruned, and if none are, new handles go uncounted
until some are freed (``untracked`` says how many calls were missed). An expert group
counts one call per expert on each of its gate, up and down tensors, with that expert's
rows; a routed group the (token, slot) pairs routed to the expert, and no call for an
expert no token was routed to.
"""

from __future__ import annotations

import collections
import heapq
import threading
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

#: Entries kept at most (~150 bytes each): GLM-5.2 whole is ~58k expert tensors.
LIMIT = 1 << 18
#: Distinct expert lists whose totals wait to be spread over their handles.
PENDING = 4096
#: Calls recorded but not yet counted, at most (the call that finds more folds them).
JOURNAL = 1024

_TENSOR, _EXPERTS, _ROUTED = 0, 1, 2


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
        # expert groups not yet spread over their handles: (expert handle triples) ->
        # [device, calls per expert, rows per expert]; folded into _counts when read
        self._pending: dict[tuple, list] = {}
        # calls recorded, not yet counted: appends and poplefts of a deque are atomic, so
        # recording takes no lock and a fold running meanwhile loses nothing
        self._journal: collections.deque[tuple] = collections.deque()

    # -- recording (the compute handlers) --------------------------------------------------

    def _add(self, handle: int, device: int, rows: int, calls: int = 1) -> None:
        """Count ``calls`` calls of ``rows`` rows in all on ``handle`` (call with the lock)."""
        c = self._counts.get(handle)
        if c is None:
            if len(self._counts) >= self.limit and not self._prune():
                self._untracked += 1
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
        self._record((_TENSOR, device, rows, handles))

    def experts(self, device: int, experts: tuple, rows: Sequence[int] | np.ndarray) -> None:
        """One expert group: ``experts`` are its (gate, up, down) handle ids, ``rows[c]``
        the rows of expert c (an expert with 0 rows gets no call)."""
        self._record((_EXPERTS, device, experts, rows))

    def routed(self, device: int, experts: tuple, routes: np.ndarray) -> None:
        """One routed group: expert c gets the (token, slot) pairs whose route is c
        (``routes``: int32; its bytes are kept until counted, the array may change)."""
        self._record((_ROUTED, device, experts, routes.tobytes()))

    def _record(self, entry: tuple) -> None:
        self._journal.append(entry)
        if len(self._journal) > JOURNAL:
            with self._lock:
                self._drain()

    @property
    def untracked(self) -> int:
        """Calls not counted because the table was full of live handles."""
        with self._lock:
            self._drain()
            return self._untracked

    def _drain(self) -> None:
        """Count the journal's calls (call with the lock). Tensor calls are counted one by
        one; the group calls of one expert list are counted together, in one NumPy pass
        over all their routes or rows: per call and expert the rows (routed: the (token,
        slot) pairs routed there), then per expert the calls with rows and the rows."""
        journal = self._journal
        groups: dict[tuple, tuple[int, list[bytes], list]] = {}  # experts -> its calls
        while journal:
            try:
                kind, device, a, b = journal.popleft()
            except IndexError:  # another thread emptied it meanwhile
                break
            if kind == _TENSOR:
                for h in b:
                    if h:
                        self._add(h, device, a)
                continue
            g = groups.get(a)
            if g is None:
                g = groups[a] = (device, [], [])
            (g[1] if kind == _ROUTED else g[2]).append(b)
        for experts, (device, routed, rows) in groups.items():
            k = len(experts)
            per_call = []  # int64 [calls, k]: rows of each call on each expert
            if routed:
                lens = np.fromiter((len(r) >> 2 for r in routed), np.int64, len(routed))
                idx = np.repeat(np.arange(len(routed), dtype=np.int64) * k, lens)
                idx += np.frombuffer(b"".join(routed), np.int32)
                per_call.append(np.bincount(idx, minlength=len(routed) * k).reshape(-1, k))
            if rows:
                per_call.append(np.asarray(rows, np.int64).reshape(-1, k))
            m = per_call[0] if len(per_call) == 1 else np.concatenate(per_call)
            calls = np.count_nonzero(m, axis=0).tolist()
            totals = m.sum(axis=0).tolist()
            p = self._pending.get(experts)
            if p is None:
                if len(self._pending) >= PENDING:
                    self._fold_pending()
                p = self._pending[experts] = [device, [0] * k, [0] * k]
            pc, pt = p[1], p[2]
            for c in range(k):
                pc[c] += calls[c]
                pt[c] += totals[c]

    def _fold(self) -> None:
        """Count the journal and spread the pending group totals over their handles (call
        with the lock)."""
        self._drain()
        self._fold_pending()

    def _fold_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for experts, (device, calls, rows) in pending.items():
            for triple, c, r in zip(experts, calls, rows, strict=True):
                if not c:
                    continue
                for h in triple:
                    self._add(h, device, r, c)

    def drop(self, handle: int) -> None:
        """The handle was freed."""
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
            self._drain()
            return len(self._counts)


__all__ = ["LIMIT", "UsageCounts"]
