"""Counters and histograms for the hot path: plain numbers updated under a small lock per
series, exposed at scrape time (a prometheus_client ``Collector``) with exactly the names,
labels, buckets and values that prometheus_client's own ``Counter`` and ``Histogram`` give.

    Tally()                                      register it in a registry once
    ├── counter(name, help, labels)              -> family; family.labels(*values).inc(n)
    └── histogram(name, help, labels, buckets)   -> family; family.labels(*values).observe(v)

prometheus_client takes a lock per ``inc`` and walks the buckets in Python per ``observe``;
here an observation is one ``bisect`` and one lock (about half the instructions for an
expert-group call's six updates, counted with callgrind). Series appear once their labels
are first used, as there.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


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
    __slots__ = ("_bounds", "_lock", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds  # upper bounds, +Inf last
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

    def counter(self, name: str, doc: str, labelnames: Sequence[str]) -> Family:
        """A counter; ``name`` without ``_total`` (the samples get it, as prometheus_client's)."""
        return self._add(Family(name.removesuffix("_total"), doc, labelnames, None))

    def histogram(
        self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> Family:
        return self._add(Family(name, doc, labelnames, buckets))

    def _add(self, family: Family) -> Family:
        self._families.append(family)
        return family

    def collect(self) -> Iterator[Any]:
        for family in self._families:
            yield family.collect()


__all__ = ["CounterSeries", "Family", "HistogramSeries", "Tally"]
