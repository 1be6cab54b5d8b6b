"""``coliworker top``: quantiles from bucket deltas, the rendered view, exit codes."""

from __future__ import annotations

import io
import math
import threading
from types import SimpleNamespace

import grpc
import pytest

from coliworker.server.backend import DeviceInfo, Phases
from coliworker.server.metrics import Metrics
from coliworker.tools.top import normalize_url, quantile, render, run_top, scrape


def test_quantile_interpolates_like_histogram_quantile() -> None:
    buckets = [(0.001, 0.0), (0.01, 50.0), (0.1, 100.0), (math.inf, 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.01)
    assert quantile(0.25, buckets) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * 0.98)
    assert quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    # Everything above the last finite bound: report that bound.
    assert quantile(0.99, [(1.0, 0.0), (math.inf, 10.0)]) == 1.0


def test_normalize_url() -> None:
    assert normalize_url("localhost:9400") == "http://localhost:9400/metrics"
    assert normalize_url("http://h:1") == "http://h:1/metrics"
    assert normalize_url("http://h:1/custom") == "http://h:1/custom"


def _worker_metrics() -> Metrics:
    m = Metrics("0.1.0", "numpy")
    entry = SimpleNamespace(
        device=0, tensors=3, tensor_bytes=5 << 20, handles=4, kv_sequences=1, kv_bytes=2 << 20
    )
    m.bind(residency=lambda: [entry], devices=lambda: [DeviceInfo(0, "cpu", 8 << 30, 6 << 30)])
    return m


def _traffic(m: Metrics, calls: int) -> None:
    for _ in range(calls):
        m.record_group(0, 8, 32, Phases(20_000, 400_000, 15_000))
        t = m._begin("ExpertGroup")
        m._end("ExpertGroup", t - 0.002, grpc.StatusCode.OK)
    t = m._begin("Matmul")
    m._end("Matmul", t - 0.0005, grpc.StatusCode.INVALID_ARGUMENT)


def test_render_rates_from_two_scrapes() -> None:
    m = _worker_metrics()
    port = m.serve("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = scrape(url)
        _traffic(m, 10)
        after = scrape(url)
    finally:
        m.stop()
    screen = render(after, before, 2.0, url)
    lines = {line.split()[0]: line.split() for line in screen.splitlines() if line.strip()}
    work, memory = [line.split() for line in screen.splitlines() if line.startswith("0 ")]
    # ExpertGroup: 10 calls in 2 s, no errors, ~2 ms each (the 2.5 ms bucket).
    group = lines["ExpertGroup"]
    assert group[1] == "5.0" and group[2] == "0.0%"
    assert group[3].endswith("ms") and 1.0 <= float(group[3][:-2]) <= 2.5
    assert lines["Matmul"][2] == "100.0%"
    assert work[1:4] == ["5.0", "40.0", "160.0"]  # groups/s, experts/s, rows/s
    assert work[4:7] == ["20us", "400us", "15us"]  # mean h2d, kernel, d2h per call
    assert memory[1:3] == ["5.0MiB", "2.0MiB"]  # resident, KV
    assert memory[3] == "-"  # no budget
    assert memory[4:6] == ["2.0GiB/8.0GiB", "host"]  # the NumPy backend's memory is RAM
    assert memory[6:8] == ["-", "-"]  # no NVML
    assert "v0.1.0 numpy" in screen
    assert max(len(line) for line in screen.splitlines()) <= 80, screen


def test_run_top_once_against_a_live_endpoint() -> None:
    m = _worker_metrics()
    port = m.serve("127.0.0.1", 0)
    stop = threading.Event()

    def load() -> None:
        while not stop.wait(0.01):
            _traffic(m, 1)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    out = io.StringIO()
    try:
        assert run_top(f"127.0.0.1:{port}", interval=0.3, once=True, out=out) == 0
    finally:
        stop.set()
        thread.join()
        m.stop()
    screen = out.getvalue()
    assert "\x1b[" not in screen  # once: no screen control codes
    assert "ExpertGroup" in screen and "groups/s" in screen


def test_unreachable_endpoint_exits_2(capsys) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_top(f"127.0.0.1:{port}", interval=0.1, once=True) == 2
    err = capsys.readouterr().err
    assert "coliworker top: cannot reach" in err and str(port) in err


def test_fit_cuts_lines_to_the_terminal() -> None:
    from coliworker.tools.top import _fit

    assert _fit("abcdef\nxy\n", 4) == "abcd\nxy\n"


def test_a_grpc_port_is_named_not_a_traceback(capsys) -> None:
    """An HTTP/2-only port (gRPC) drops an HTTP/1 request: say what the URL probably is."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert run_top(f"127.0.0.1:{port}", interval=0.1, once=True) == 2
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert "is it the gRPC port?" in err and "--metrics-port" in err, err


def test_q_quits_and_a_restarted_worker_is_picked_up_again() -> None:
    import os
    import time

    m = _worker_metrics()
    port = m.serve("127.0.0.1", 0)
    master, slave = os.openpty()
    out = io.StringIO()
    result: list[int] = []
    with os.fdopen(slave, "r") as keys:
        thread = threading.Thread(
            target=lambda: result.append(
                run_top(f"127.0.0.1:{port}", interval=0.05, out=out, keys=keys)
            )
        )
        thread.start()

        def wait_for(text: str, after: int = 0) -> int:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                at = out.getvalue().find(text, after)
                if at >= 0:
                    return at
                time.sleep(0.02)
            raise AssertionError(f"{text!r} never shown: {out.getvalue()[-500:]!r}")

        try:
            wait_for("groups/s")
            m.stop()  # the worker goes away ...
            gone = wait_for("waiting for the worker")
            m2 = _worker_metrics()
            assert m2.serve("127.0.0.1", port) == port  # ... and comes back on its port
            try:
                _traffic(m2, 3)
                wait_for("groups/s", after=gone)
                assert thread.is_alive()
                os.write(master, b"q")
                thread.join(timeout=20)
            finally:
                m2.stop()
        finally:
            os.write(master, b"q")
            thread.join(timeout=20)
            os.close(master)
    assert result == [0]
