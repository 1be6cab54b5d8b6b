"""``coliworker top``: a terminal view of a worker's /metrics endpoint.

Scrapes the endpoint every ``interval`` seconds and shows rates computed from the
difference of two scrapes: per RPC method calls/s, error ratio and p50/p99 latency
(estimated from histogram bucket deltas, as PromQL's histogram_quantile does), and per
device expert-group calls/experts/rows per second, mean phase times, resident and KV bytes
and device memory. Plain ANSI redraw; no curses. ``q`` (or Ctrl-C) quits; a worker that
goes away (a restart) is waited for and picked up again; lines are cut to the terminal's
width rather than wrapped.
"""

from __future__ import annotations

import http.client
import math
import os
import select
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from typing import TextIO

try:
    import termios
    import tty
except ImportError:  # pragma: no cover - not a POSIX terminal
    termios = None  # type: ignore[assignment]

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

_CLEAR = "\x1b[H\x1b[2J"


class ScrapeError(Exception):
    """The endpoint could not be reached or did not return the text format."""


def normalize_url(url: str) -> str:
    """Accept "host:port", "http://host:port" or a full URL; default the path to /metrics."""
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        rest += "/metrics"
    return f"{scheme}://{rest}"


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of the endpoint, keyed by (sample name, sorted labels)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode("utf-8")
    except (http.client.HTTPException, ConnectionResetError) as err:
        # An HTTP/2-only listener (the gRPC port) drops an HTTP/1 request.
        raise ScrapeError(
            f"{url} does not speak HTTP/1 ({type(err).__name__}); is it the gRPC port? "
            "/metrics is on the worker's --metrics-port (default 9400)"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise ScrapeError(f"cannot reach {url}: {reason}") from None
    except UnicodeDecodeError:
        raise ScrapeError(f"{url} did not return Prometheus metrics (not text)") from None
    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except (ValueError, TypeError, IndexError) as err:
        raise ScrapeError(f"{url} did not return Prometheus metrics: {err}") from None
    if not any(name == "coliworker_build_info" for name, _ in samples):
        raise ScrapeError(
            f"{url} serves metrics, but not a coliworker's (no coliworker_build_info)"
        )
    return samples


def _select(samples: Samples, name: str) -> Iterable[tuple[dict[str, str], float]]:
    for (n, labels), value in samples.items():
        if n == name:
            yield dict(labels), value


def _by(samples: Samples, name: str, key: str) -> dict[str, float]:
    """Sum of ``name`` grouped by label ``key``."""
    out: dict[str, float] = defaultdict(float)
    for labels, value in _select(samples, name):
        out[labels.get(key, "")] += value
    return out


def _delta(cur: dict[str, float], prev: dict[str, float]) -> dict[str, float]:
    # A counter that went down means the worker restarted: count from zero.
    return {k: (v - prev.get(k, 0.0)) if v >= prev.get(k, 0.0) else v for k, v in cur.items()}


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile over cumulative (upper bound, count) pairs, sorted by bound;
    None when there were no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # above the last finite bound: report that bound
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def _bucket_deltas(cur: Samples, prev: Samples, name: str, key: str) -> dict[str, list]:
    """Per value of label ``key``: cumulative (upper bound, count increase) pairs."""
    per: dict[str, dict[float, float]] = defaultdict(dict)
    for (n, labels), value in cur.items():
        if n != name + "_bucket":
            continue
        old = prev.get((n, labels), 0.0)
        d = dict(labels)
        group, le = d.get(key, ""), float(d["le"])
        per[group][le] = per[group].get(le, 0.0) + (value - old if value >= old else value)
    return {g: sorted(b.items()) for g, b in per.items()}


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f}us"
    if s < 1:
        return f"{s * 1e3:.1f}ms"
    return f"{s:.2f}s"


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def render(cur: Samples, prev: Samples, dt: float, url: str) -> str:
    """The screen for two scrapes ``dt`` seconds apart."""
    lines = [f"coliworker top  {url}  {dt:.1f}s  {time.strftime('%H:%M:%S')}"]
    for labels, _ in _select(cur, "coliworker_build_info"):
        lines[0] += f"  v{labels.get('version', '?')} {labels.get('backend', '?')}"

    handled = _delta(
        _by(cur, "grpc_server_handled_total", "grpc_method"),
        _by(prev, "grpc_server_handled_total", "grpc_method"),
    )
    errors: dict[str, float] = defaultdict(float)
    for labels, value in _select(cur, "grpc_server_handled_total"):
        if labels.get("grpc_code") != "OK":
            old = prev.get(("grpc_server_handled_total", tuple(sorted(labels.items()))), 0.0)
            errors[labels["grpc_method"]] += value - old if value >= old else value
    in_flight = _by(cur, "grpc_server_in_flight_requests", "grpc_method")
    latency = _bucket_deltas(cur, prev, "grpc_server_handling_seconds", "grpc_method")
    lines += ["", f"{'RPC':<20}{'calls/s':>10}{'errors':>9}{'p50':>10}{'p99':>10}{'active':>8}"]
    methods = sorted(set(handled) | set(in_flight), key=lambda m: (-handled.get(m, 0.0), m))
    for method in methods:
        n = handled.get(method, 0.0)
        ratio = f"{100 * errors.get(method, 0.0) / n:.1f}%" if n else "-"
        b = latency.get(method, [])
        lines.append(
            f"{method:<20}{n / dt:>10.1f}{ratio:>9}{_fmt_seconds(quantile(0.5, b)):>10}"
            f"{_fmt_seconds(quantile(0.99, b)):>10}{in_flight.get(method, 0.0):>8.0f}"
        )
    if not methods:
        lines.append("(no RPCs yet)")

    per_dev = {
        name: _delta(_by(cur, f"coliworker_group_{name}_total", "device"),
                     _by(prev, f"coliworker_group_{name}_total", "device"))
        for name in ("calls", "experts", "rows")
    }  # fmt: skip
    phase_sum: dict[tuple[str, str], float] = {}
    for labels, value in _select(cur, "coliworker_group_phase_seconds_sum"):
        k = (labels["device"], labels["phase"])
        old = prev.get(("coliworker_group_phase_seconds_sum", tuple(sorted(labels.items()))), 0)
        phase_sum[k] = value - old if value >= old else value
    gauges = {
        name: _by(cur, metric, "device")
        for name, metric in (
            ("resident", "coliworker_resident_bytes"),
            ("kv", "coliworker_kv_bytes"),
            ("budget", "coliworker_memory_limit_bytes"),
            ("used", "coliworker_device_memory_used_bytes"),
            ("total", "coliworker_device_memory_total_bytes"),
            ("util", "coliworker_gpu_utilization_ratio"),
            ("power", "coliworker_gpu_power_watts"),
        )
    }
    kind = {labels.get("device", ""): labels.get("memory", "")
            for labels, _ in _select(cur, "coliworker_device_memory_total_bytes")}  # fmt: skip
    devices = sorted(set().union(*per_dev.values(), *gauges.values()), key=lambda d: (len(d), d))
    # Two tables of at most 80 columns: work per device, then memory per device.
    lines += [
        "",
        f"{'dev':<5}{'groups/s':>10}{'experts/s':>11}{'rows/s':>10}"
        f"{'h2d':>9}{'kernel':>9}{'d2h':>9}",
    ]
    for d in devices:
        calls = per_dev["calls"].get(d, 0.0)
        mean = [
            _fmt_seconds(phase_sum.get((d, p), 0.0) / calls) if calls else "-"
            for p in ("h2d", "kernel", "d2h")
        ]
        lines.append(
            f"{d:<5}{calls / dt:>10.1f}{per_dev['experts'].get(d, 0.0) / dt:>11.1f}"
            f"{per_dev['rows'].get(d, 0.0) / dt:>10.1f}{mean[0]:>9}{mean[1]:>9}{mean[2]:>9}"
        )
    if not devices:
        lines.append("(no devices reported yet)")
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"{'dev':<5}{'resident':>10}{'kv':>10}{'budget':>10}{'memory used/total':>25}"
        f"{'busy':>7}{'power':>7}",
    ]
    for d in devices:
        budget = gauges["budget"].get(d)
        used, total = gauges["used"].get(d), gauges["total"].get(d)
        memory = f"{_fmt_bytes(used)}/{_fmt_bytes(total)} {kind.get(d, '')}".rstrip()
        util, power = gauges["util"].get(d), gauges["power"].get(d)
        lines.append(
            f"{d:<5}{_fmt_bytes(gauges['resident'].get(d)):>10}"
            f"{_fmt_bytes(gauges['kv'].get(d)):>10}"
            f"{_fmt_bytes(budget) if budget else '-':>10}{memory:>25}"
            f"{f'{100 * util:.0f}%' if util is not None else '-':>7}"
            f"{f'{power:.0f}W' if power is not None else '-':>7}"
        )
    return "\n".join(lines) + "\n"


class _Keys:
    """Single keys from an interactive terminal (cbreak mode while open); ``wait`` sleeps
    until the timeout or a key and returns the key ("" for none)."""

    def __init__(self, stream: TextIO) -> None:
        self.fd: int | None = None
        self._saved = None
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):
            return
        if termios is not None and os.isatty(fd):
            self.fd, self._saved = fd, termios.tcgetattr(fd)
            tty.setcbreak(fd)

    def wait(self, timeout: float) -> str:
        if self.fd is None:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return os.read(self.fd, 1).decode(errors="replace") if ready else ""

    def close(self) -> None:
        if self.fd is not None and self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self.fd = None


def _fit(screen: str, width: int) -> str:
    """Cut every line to ``width`` columns (a wrapped table is unreadable)."""
    return "\n".join(line[:width] for line in screen.split("\n"))


def run_top(
    url: str,
    interval: float = 1.0,
    once: bool = False,
    out: TextIO = sys.stdout,
    keys: TextIO | None = None,
) -> int:
    """Show the view until ``q`` or Ctrl-C (or one snapshot with ``once``). Returns the exit
    code: 0, or 2 when the endpoint cannot be reached at the start. Once running, an
    endpoint that goes away (the worker restarts) is retried every ``interval`` until it
    answers again. ``keys`` is the terminal to read ``q`` from (default: stdin)."""
    url = normalize_url(url)
    interval = max(interval, 0.05)
    try:
        prev, t_prev = scrape(url), time.monotonic()
    except ScrapeError as err:
        print(f"coliworker top: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    if once:
        time.sleep(interval)
        try:
            cur = scrape(url)
        except ScrapeError as err:
            print(f"coliworker top: {err}", file=sys.stderr)
            return 2
        out.write(render(cur, prev, time.monotonic() - t_prev, url))
        out.flush()
        return 0
    reader = _Keys(sys.stdin if keys is None else keys)
    try:
        while True:
            if reader.wait(interval).lower() == "q":
                return 0
            width = shutil.get_terminal_size((100, 40)).columns
            try:
                cur, t_cur = scrape(url), time.monotonic()
            except ScrapeError as err:
                out.write(_CLEAR + _fit(
                    f"coliworker top  {url}  {time.strftime('%H:%M:%S')}\n\n"
                    f"waiting for the worker: {err}\n(q quits)\n", width))  # fmt: skip
                out.flush()
                continue
            out.write(_CLEAR + _fit(render(cur, prev, t_cur - t_prev, url) + "(q quits)\n", width))
            out.flush()
            prev, t_prev = cur, t_cur
    except KeyboardInterrupt:
        return 0
    finally:
        reader.close()


__all__ = ["ScrapeError", "normalize_url", "quantile", "render", "run_top", "scrape"]
