"""Counters and histograms for the hot path: plain numbers updated under a small lock per
series, exposed at scrape time (a prometheus_client ``Collector``) with exactly the names,
labels, buckets and values that prometheus_client's own ``Counter`` and ``Histogram`` give.

    Tally()                                      register it in a registry once
    ├── counter(name, help, labels)              -> family; family.labels(*values).inc(n)
    ├── histogram(name, help, labels, buckets)   -> family; family.labels(*values).observe(v)
    └── journal(apply)                           -> journal; journal.record(entry)

prometheus_client takes a lock per ``inc`` and walks the buckets in Python per ``observe``;
here an observation is one ``bisect`` and one lock (about half the instructions for an
expert-group call's six updates, counted with callgrind). Series appear once their labels
are first used, as there.

A journal defers a call's updates: ``record`` appends one entry (a tuple of the call's
values) to a deque, atomic without a lock, and ``apply(entries)`` makes their updates
later, in the order recorded, series by series (``observe_many``: one lock per series for
the lot): when the tally is collected (every scrape reads every update recorded before it)
or by the call that finds ``JOURNAL`` entries waiting, or, in pieces, by the worker's
upkeep thread (``fold``) before that. The values read are the same as
those of the updates made one by one: counts are added in full, and a histogram's sum adds
each observation in turn. An expert group call's eight updates cost about a sixth as much.
"""

from __future__ import annotations

import collections
import operator
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: Entries a journal holds at most before the recording call applies them.
JOURNAL = 1024


class CounterSeries:
    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        lock = self._lock  # acquire / release in try: about half the instructions of a with
        lock.acquire()
        try:
            self.value += amount
        finally:
            lock.release()


class HistogramSeries:
    __slots__ = ("_bounds", "_edges", "_lock", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds  # upper bounds, +Inf last
        self._edges = np.array(bounds)  # the same, for observe_many
        self._lock = threading.Lock()
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        i = bisect_left(self._bounds, amount)  # the first bound >= amount: le is inclusive
        lock = self._lock
        lock.acquire()
        try:
            self.counts[i] += 1
            self.sum += amount
        finally:
            lock.release()

    def observe_many(self, amounts: np.ndarray) -> None:
        """``observe`` each of ``amounts`` (float64), under one acquisition of the lock: the
        buckets by ``searchsorted`` (``bisect_left``'s), the sum by ``cumsum`` from the sum
        so far (one addition after another, in order: the float sum ``observe`` makes)."""
        add = np.bincount(np.searchsorted(self._edges, amounts), minlength=len(self.counts))
        total = np.empty(len(amounts) + 1)
        total[1:] = amounts
        with self._lock:
            self.counts = list(map(operator.add, self.counts, add.tolist()))
            total[0] = self.sum
            self.sum = float(np.cumsum(total)[-1])


class Journal:
    """Updates recorded now and made later, in order (see the module docstring)."""

    __slots__ = ("_apply", "_entries", "_lock")

    def __init__(self, apply: Callable[[list[Any]], None]) -> None:
        self._apply = apply
        self._entries: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()

    def record(self, entry: Any) -> None:
        entries = self._entries
        entries.append(entry)
        if len(entries) > JOURNAL:
            self.flush()

    def flush(self, most: int | None = None) -> int:
        """Make the updates of every entry recorded so far (with ``most``, of the oldest
        ``most`` of them); how many were made. Under the lock: a reader that flushes waits
        for a flush under way, and then sees its updates."""
        with self._lock:
            entries = self._entries
            n = len(entries) if most is None else min(len(entries), most)
            if n:
                pop = entries.popleft  # (appends may race: take what is there now)
                self._apply([pop() for _ in range(n)])
            return n


class Family:
    """One metric of the tally: its series by label values."""

    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float] | None
    ) -> None:
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self.bounds: tuple[float, ...] | None = None
        if buckets is not None:
            bounds = [float(b) for b in buckets]
            if bounds[-1] != float("inf"):
                bounds.append(float("inf"))
            self.bounds = tuple(bounds)
        self._lock = threading.Lock()
        self.series: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        if len(values) != len(self.labelnames):
            raise ValueError(
                f"{self.name}: expected {len(self.labelnames)} label values "
                f"({', '.join(self.labelnames)}), got {len(values)}"
            )
        key = tuple(str(v) for v in values)
        s = self.series.get(key)
        if s is None:
            with self._lock:
                s = self.series.get(key)
                if s is None:
                    s = CounterSeries() if self.bounds is None else HistogramSeries(self.bounds)
                    self.series[key] = s
        return s

    def collect(self) -> Any:
        with self._lock:
            items = list(self.series.items())
        if self.bounds is None:
            counter = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, s in items:
                counter.add_metric(list(values), s.value)
            return counter
        hist = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, s in items:
            with s._lock:
                counts, total = list(s.counts), s.sum
            cumulative, buckets = 0, []
            for bound, n in zip(self.bounds, counts, strict=True):
                cumulative += n
                buckets.append((floatToGoString(bound), float(cumulative)))
            hist.add_metric(list(values), buckets, total)
        return hist


class Tally(Collector):
    """The hot-path metrics of one registry (see the module docstring)."""

    def __init__(self) -> None:
        self._families: list[Family] = []
        self._journals: list[Journal] = []

    def counter(self, name: str, doc: str, labelnames: Sequence[str]) -> Family:
        """A counter; ``name`` without ``_total`` (the samples get it, as prometheus_client's)."""
        return self._add(Family(name.removesuffix("_total"), doc, labelnames, None))

    def histogram(
        self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> Family:
        return self._add(Family(name, doc, labelnames, buckets))

    def journal(self, apply: Callable[[list[Any]], None]) -> Journal:
        """A journal whose entries ``apply`` turns into updates of this tally's series."""
        journal = Journal(apply)
        self._journals.append(journal)
        return journal

    def _add(self, family: Family) -> Family:
        self._families.append(family)
        return family

    def flush(self) -> None:
        """Make every update recorded in the journals so far."""
        for journal in self._journals:
            journal.flush()

    def fold(self, most: int) -> int:
        """Make the updates of the oldest ``most`` entries of each journal (in order: the
        rest stay for a later fold); how many were made (``server/upkeep.py`` folds the
        journals in such pieces between calls, so a recording call seldom finds one full)."""
        return sum(journal.flush(most) for journal in self._journals)

    def collect(self) -> Iterator[Any]:
        self.flush()
        for family in self._families:
            yield family.collect()


__all__ = ["JOURNAL", "CounterSeries", "Family", "HistogramSeries", "Journal", "Tally"]
