"""Which experts earn GPU memory: counts in, an assignment (and the moves to it) out.

    counts = placement.trace_counts(trace)                   # the engine's routing trace
    counts = placement.usage_counts(pool.tensor_usage(), experts)   # or the workers' counts
    plan = placement.assign(counts, budgets={0: 120 << 30, 1: 120 << 30}, sizes=18_900_000,
                            current=placement.current(experts))
    plan.hit_rate                                            # share of routed rows on a GPU
    pool.rebalance(plan, experts, load)                      # uploads first, then frees

Keys are whatever names an expert for the engine, e.g. ``(layer, expert)``. ``assign`` is
frequency-greedy: experts in order of their count (most routed first), each on the device
it is on if it still fits there, else on the device its ``affinity`` group (e.g. its layer,
so a layer's group call goes to one worker) already uses if it fits, else on the device
with the most room; what fits nowhere stays on the CPU (``None``). Hysteresis: an expert
that is on a GPU now ranks as if its count were ``1 + hysteresis`` times higher, so a
challenger must beat it by that factor to take its place and a stable trace moves nothing.
Experts never routed are not placed (they would cost memory and win nothing) unless they
are placed now and still fit.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coliworker.client import errors
from coliworker.client.uploads import UploadItem

Key = Hashable
#: Default hysteresis: a challenger needs 25% more routed rows than the expert it displaces.
HYSTERESIS = 0.25


@dataclass(frozen=True)
class Move:
    """One expert changes place: ``source`` / ``target`` are devices, None the CPU."""

    key: Key
    source: int | None
    target: int | None


@dataclass(frozen=True)
class Plan:
    """An assignment of every counted (or placed) expert, the moves from the current one,
    the expected share of routed rows that land on GPU experts, bytes used per device."""

    assignment: dict[Key, int | None]
    moves: tuple[Move, ...]
    hit_rate: float
    used: dict[int, int]

    def on(self, device: int) -> list[Key]:
        """The experts the plan puts on ``device``."""
        return [k for k, d in self.assignment.items() if d == device]


def assign(
    counts: Mapping[Key, float],
    budgets: Mapping[int, int] | Sequence[int],
    sizes: Mapping[Key, int] | int,
    *,
    current: Mapping[Key, int | None] | None = None,
    hysteresis: float = HYSTERESIS,
    affinity: Callable[[Key], Hashable] | None = None,
) -> Plan:
    """The placement of the module docstring. ``counts``: routed rows (or calls) per
    expert; ``budgets``: bytes per device (a sequence: device = index); ``sizes``: bytes of
    one expert (gate + up + down), per key or one for all; ``current``: where experts are
    now (missing: CPU)."""
    room = dict(enumerate(budgets)) if not isinstance(budgets, Mapping) else dict(budgets)
    for d, b in room.items():
        if b < 0:
            raise ValueError(f"assign.budgets[{d}]: expected >= 0 bytes, got {b}")
    if hysteresis < 0:
        raise ValueError(f"assign.hysteresis: expected >= 0, got {hysteresis}")
    current = dict(current or {})
    for k, at in current.items():
        if at is not None and at not in room:
            raise ValueError(
                f"assign.current[{k!r}]: device {at} has no budget (devices {sorted(room)})"
            )
    keys = list(dict.fromkeys([*counts, *current]))

    def size(k: Key) -> int:
        s = sizes if isinstance(sizes, int) else sizes.get(k)
        if s is None or s <= 0:
            raise ValueError(f"assign.sizes[{k!r}]: expected > 0 bytes, got {s}")
        return int(s)

    def score(k: Key) -> float:
        c = float(counts.get(k, 0))
        return c * (1.0 + hysteresis) if current.get(k) is not None else c

    order = sorted(range(len(keys)), key=lambda i: (-score(keys[i]), i))
    position = {keys[i]: n for n, i in enumerate(order)}  # 0: ranked first
    assignment: dict[Key, int | None] = {}
    used = dict.fromkeys(room, 0)
    # Room the experts placed now hold until their turn comes (so a newcomer ranked above
    # them does not take it and push them onto another GPU), lowest ranked first.
    reserved = dict.fromkeys(room, 0)
    holders: dict[int, list[Key]] = {d: [] for d in room}
    for i in reversed(order):
        k, at = keys[i], current.get(keys[i])
        if at is not None:
            reserved[at] += size(k)
            holders[at].append(k)
    group_device: dict[Hashable, int] = {}
    for i in order:
        k = keys[i]
        now = current.get(k)
        assignment[k] = None
        if now is not None and k in holders[now]:
            holders[now].remove(k)
            reserved[now] -= size(k)
            if used[now] + size(k) <= room[now]:
                assignment[k] = now
                used[now] += size(k)
                continue
        if not counts.get(k):
            continue
        s = size(k)

        def free(d: int) -> int:
            return room[d] - used[d] - reserved[d]

        fits = [d for d in room if free(d) >= s]
        if not fits:  # displace the lowest ranked holders of one device (ranked below k)
            made = _displace(room, used, reserved, holders, s, size, position)
            if made is None:
                continue
            fits = [made]
        group = affinity(k) if affinity is not None else None
        if group is not None and group_device.get(group) in fits:
            d = group_device[group]
        else:
            d = max(fits, key=lambda d: (free(d), -d))
        assignment[k] = d
        used[d] += s
        if group is not None:
            group_device.setdefault(group, d)
    moves = tuple(Move(k, current.get(k), d) for k, d in assignment.items() if current.get(k) != d)
    return Plan(assignment, moves, hit_rate(counts, assignment), used)


def _displace(
    room: dict[int, int],
    used: dict[int, int],
    reserved: dict[int, int],
    holders: dict[int, list[Key]],
    need: int,
    size: Callable[[Key], int],
    position: dict[Key, int],
) -> int | None:
    """Release the reservations of the fewest lowest-ranked holders on one device so that
    ``need`` bytes fit there, the device whose released holders rank lowest (so the
    experts ranked last go to the CPU and no other moves between GPUs); returns that
    device (None: no device can make the room)."""
    best: tuple[int, int, int] | None = None  # (holders released, -their positions, device)
    for d in room:
        free, n, rank = room[d] - used[d] - reserved[d], 0, 0
        for k in holders[d]:  # lowest ranked first
            if free >= need:
                break
            free, n, rank = free + size(k), n + 1, rank + position[k]
        if free >= need and (best is None or (n, -rank) < best[:2]):
            best = (n, -rank, d)
    if best is None:
        return None
    n, _, d = best
    for k in holders[d][:n]:
        reserved[d] -= size(k)
    del holders[d][:n]
    return d


def hit_rate(counts: Mapping[Key, float], assignment: Mapping[Key, int | None]) -> float:
    """The share of ``counts`` on experts ``assignment`` puts on a GPU."""
    total = float(sum(counts.values()))
    on = sum(float(c) for k, c in counts.items() if assignment.get(k) is not None)
    return on / total if total else 0.0


def trace_counts(trace: Iterable[tuple[Hashable, np.ndarray]]) -> Counter:
    """(layer, routes int [T, K] of expert ids) per step of a routing trace -> rows per
    (layer, expert)."""
    out: Counter = Counter()
    for layer, routes in trace:
        ids = np.asarray(routes).ravel()
        if ids.size:
            for e, n in enumerate(np.bincount(ids.astype(np.int64)).tolist()):
                if n:
                    out[(layer, e)] += n
    return out


def usage_counts(
    usage: Iterable[tuple[Any, int, int, int]], experts: Mapping[Key, Sequence[Any] | None]
) -> dict[Key, int]:
    """``WorkerPool.tensor_usage()`` rows (ref, device, calls, rows) -> rows per expert of
    ``experts`` (key -> its (gate, up, down) refs; the most of its three tensors)."""
    rows = {int(getattr(r, "handle", r)): n for r, _, _, n in usage}
    out = {}
    for k, refs in experts.items():
        if refs:
            out[k] = max(rows.get(int(getattr(t, "handle", t)), 0) for t in refs)
    return out


def current(experts: Mapping[Key, Sequence[Any] | None]) -> dict[Key, int | None]:
    """Where each expert of ``experts`` (key -> refs on the pool, or None) is now."""
    return {k: (int(refs[0].device) if refs else None) for k, refs in experts.items()}


def rebalance(
    pool: Any,
    plan: Plan,
    experts: MutableMapping[Key, Any],
    load: Callable[[Key], Sequence[UploadItem]],
    swap: Callable[[dict[Key, Any]], None] | None = None,
) -> dict[Key, Any]:
    """Carry out ``plan.moves`` on ``pool`` without a call ever naming a missing expert:

    1. every expert moving onto a GPU is uploaded there (``load(key)`` returns its upload
       items, gate, up, down; their ``device`` is replaced by the target), all in one
       ``upload_many`` (all or nothing: a failure leaves everything as it was),
    2. the new references are installed: ``swap(new)`` if given, else ``experts`` is
       updated in place (key -> tuple of PoolRefs, or None for the CPU),
    3. only then the old references are freed (a call still running on one holds it on
       the worker until it ends; a member that is down frees nothing, and restores it
       only if it recovers, freed then by the next rebalance).

    Returns the new references of the moved experts."""
    targets = [m for m in plan.moves if m.target is not None]
    items: list[UploadItem] = []
    spans: list[tuple[Key, int, int]] = []
    for m in targets:
        loaded = [dataclasses.replace(it, device=m.target) for it in load(m.key)]
        if not loaded:
            raise ValueError(f"rebalance.load({m.key!r}): expected upload items, got none")
        spans.append((m.key, len(items), len(items) + len(loaded)))
        items += loaded
    refs = pool.upload_many(items) if items else []
    new: dict[Key, Any] = {m.key: None for m in plan.moves}
    for k, a, b in spans:
        new[k] = tuple(refs[a:b])
    old = [experts.get(m.key) for m in plan.moves]
    if swap is not None:
        swap(new)
    else:
        experts.update(new)
    for refs_old in old:
        for r in refs_old or ():
            try:
                pool.free(r)
            except errors.Unavailable:
                pass
    return new


__all__ = [
    "HYSTERESIS",
    "Move",
    "Plan",
    "assign",
    "current",
    "hit_rate",
    "rebalance",
    "trace_counts",
    "usage_counts",
]
