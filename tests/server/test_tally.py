"""The hot-path tally (``server/tally.py``) exposes exactly what prometheus_client's own
Counter and Histogram would for the same updates: every sample line, value and bucket."""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from coliworker.server.metrics import PHASE_BUCKETS, RPC_BUCKETS
from coliworker.server.tally import Tally


def _pair(buckets):
    disable_created_metrics()  # as the worker's Metrics does: no *_created series
    ref, reg = CollectorRegistry(), CollectorRegistry()
    tally = Tally()
    reg.register(tally)
    fams = {
        "c": (
            Counter("t_calls", "Calls.", ["device"], registry=ref),
            tally.counter("t_calls", "Calls.", ["device"]),
        ),
        "h": (
            Histogram(
                "t_seconds", "Seconds.", ["call", "transport"], buckets=buckets, registry=ref
            ),
            tally.histogram("t_seconds", "Seconds.", ["call", "transport"], buckets),
        ),
    }
    return ref, reg, fams


def test_the_same_updates_give_the_same_exposition_as_prometheus_client():
    rng = np.random.default_rng()
    for buckets in (PHASE_BUCKETS, RPC_BUCKETS):
        ref, reg, fams = _pair(buckets)
        assert generate_latest(reg) == generate_latest(ref)  # no series yet: HELP / TYPE only
        edges = [*buckets, 0.0, -1.0, float("inf"), buckets[0] / 2, buckets[-1] * 3]
        for _ in range(2000):
            if rng.random() < 0.3:
                device = str(rng.integers(0, 3))
                amount = float(rng.choice([1, 2, 0.5, rng.random() * 100]))
                for c in fams["c"]:
                    c.labels(device).inc(amount)
            else:
                labels = (str(rng.choice(["expert_group", "attention_ragged"])),
                          str(rng.choice(["socket", "shm", "grpc"])))  # fmt: skip
                v = (
                    float(rng.choice(edges))
                    if rng.random() < 0.2
                    else float(10 ** rng.uniform(-6, 1.5))
                )
                for h in fams["h"]:
                    h.labels(*labels).observe(v)
        assert generate_latest(reg) == generate_latest(ref)


def test_updates_from_many_threads_are_all_counted():
    tally = Tally()
    reg = CollectorRegistry()
    reg.register(tally)
    c = tally.counter("t_calls", "Calls.", ["device"])
    h = tally.histogram("t_seconds", "Seconds.", ["call"], PHASE_BUCKETS)

    def work() -> None:
        for i in range(5000):
            c.labels(str(i % 2)).inc()
            h.labels("g").observe(1e-4)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert reg.get_sample_value("t_calls_total", {"device": "0"}) == 10000
    assert reg.get_sample_value("t_calls_total", {"device": "1"}) == 10000
    assert reg.get_sample_value("t_seconds_count", {"call": "g"}) == 20000
    assert reg.get_sample_value("t_seconds_bucket", {"call": "g", "le": "5e-05"}) == 0
    assert reg.get_sample_value("t_seconds_bucket", {"call": "g", "le": "0.0001"}) == 20000


def test_a_journal_gives_what_the_updates_one_by_one_give():
    """Entries applied later (``Journal``, ``observe_many``) read as the same updates made
    one by one: counts, buckets and the float sum, bit for bit, at any scrape, folded in
    pieces ahead of it or not."""
    from coliworker.server.tally import JOURNAL

    rng = np.random.default_rng()
    ref, reg, fams = _pair(PHASE_BUCKETS)
    (ref_c, c), (ref_h, h) = fams["c"], fams["h"]

    def apply(entries):
        by = {}
        for device, seconds in entries:
            by.setdefault(device, []).append(seconds)
        for device, secs in by.items():
            c.labels(device).inc(len(secs))
            h.labels(device, "socket").observe_many(np.array(secs))

    journal = _tally(reg).journal(apply)
    edges = [*PHASE_BUCKETS, 0.0, PHASE_BUCKETS[0] / 2, PHASE_BUCKETS[-1] * 3]
    for i in range(3 * JOURNAL + 17):
        device = str(rng.integers(0, 3))
        v = float(rng.choice(edges)) if rng.random() < 0.2 else float(10 ** rng.uniform(-6, 1))
        journal.record((device, v))
        ref_c.labels(device).inc()
        ref_h.labels(device, "socket").observe(v)
        if rng.random() < 0.002 or i == JOURNAL + 5:  # a scrape now and then: all so far
            assert generate_latest(reg) == generate_latest(ref)
        if rng.random() < 0.01:  # a piece folded ahead (the upkeep's), oldest first
            _tally(reg).fold(int(rng.integers(1, 40)))
    assert generate_latest(reg) == generate_latest(ref)


def _tally(reg):
    """The Tally registered in ``reg`` (by ``_pair``)."""
    return next(c for c in reg._collector_to_names if isinstance(c, Tally))
