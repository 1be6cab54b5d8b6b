"""Prometheus metrics of one worker process: expert-group work, RPCs, residency, memory.

    Metrics(version, backend)           one registry per instance (tests build several)
    ├── record_group / record_upload / record_eviction / record_session_request /
    │   record_compute_error             called by the servicer and the store
    ├── interceptor()                   grpc.ServerInterceptor: grpc_server_* per method
    ├── bind(residency=, devices=)      callbacks read at scrape time (a custom collector)
    ├── bind_usage(top)                 the most called tensors per device (usage.py)
    └── serve(host, port) / render()    the /metrics HTTP endpoint, or the text for tests

Names follow the Prometheus conventions (base units: seconds and bytes; ``_total`` on
counters). The ``grpc_server_*`` family has go-grpc-prometheus's names and labels
(``grpc_type``, ``grpc_service``, ``grpc_method`` short as "Matmul", ``grpc_code``), so
stock dashboards and alerts written for it work; what differs: no
``grpc_server_msg_received_total`` / ``msg_sent_total``, our own histogram buckets, and an
extra ``grpc_server_in_flight_requests`` gauge. The registry also carries the standard
``process_*`` and ``python_*`` collectors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from coliworker.server.backend import DeviceInfo, Phases
from coliworker.server.tally import Journal, Tally

_OK = grpc.StatusCode.OK

log = logging.getLogger(__name__)

# One expert-group phase on an H200 takes ~10 us (a small H2D copy) to ~1 s (a cold prefill
# group); 1-2.5-5 steps keep the p99 estimate within a factor of 2.5 everywhere.
PHASE_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
# Whole RPCs: ~50 us (Info, a cached Lookup) to ~10 s (a multi-GiB upload).
RPC_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# Unary RPCs whose failures also count in coliworker_compute_errors_total. Calls on the
# Session stream report per-request errors through Metrics.record_compute_error instead.
COMPUTE_METHODS = frozenset(
    {
        "Matmul",
        "ExpertMlp",
        "ExpertGroup",
        "ExpertGroupRouted",
        "ExpertGroupIssue",
        "ExpertGroupTake",
        "Attention",
        "AttentionRagged",
    }
)

WORKER_SERVICE = "coliworker.v1.Worker"

ResidencyFn = Callable[[], Sequence[Any]]
TopFn = Callable[[int], dict[int, list[tuple[int, int]]]]
#: Tensors per device in coliworker_tensor_top_*: bounded cardinality (rank labels, no ids).
TOP_TENSORS = 10
DevicesFn = Callable[[], Sequence[DeviceInfo]]

# (metric name, attribute of a residency entry, help text)
_RESIDENCY = (
    ("coliworker_resident_tensors", "tensors", "Distinct resident weight tensors (after dedup)."),
    ("coliworker_resident_bytes", "tensor_bytes", "Bytes of the resident weight tensors."),
    ("coliworker_resident_handles", "handles", "Live tensor handles (dedup references)."),
    ("coliworker_kv_sequences", "kv_sequences", "Resident KV sequence caches."),
    ("coliworker_kv_bytes", "kv_bytes", "Bytes allocated to KV caches (capacity)."),
)


def _code_name(code: grpc.StatusCode | int | str) -> str:
    """The label value for a status: "OK", "INVALID_ARGUMENT", ..."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
        return "UNKNOWN"
    return str(code).upper()


class _StateCollector(Collector):
    """Residency and device memory, read from the worker's callbacks at scrape time."""

    def __init__(self, memory: str) -> None:
        self.residency: ResidencyFn | None = None
        self.devices: DevicesFn | None = None
        self.memory = memory  # what a device's memory is: "gpu", or "host" (NumPy backend)
        self.memory_limit = 0  # --memory-limit, bytes per device (0: none)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = [GaugeMetricFamily(n, h, labels=["device"]) for n, _, h in _RESIDENCY]
        used = GaugeMetricFamily(
            "coliworker_device_memory_used_bytes",
            "Memory in use on the device (total minus free, all processes); memory=gpu is "
            "the GPU's, memory=host the machine's RAM (the NumPy backend's devices).",
            labels=["device", "memory"],
        )
        total = GaugeMetricFamily(
            "coliworker_device_memory_total_bytes",
            "Memory of the device (memory: gpu or host, as for _used_bytes).",
            labels=["device", "memory"],
        )
        limit = GaugeMetricFamily(
            "coliworker_memory_limit_bytes",
            "Budget for resident tensors and KV caches per device (--memory-limit; 0: none).",
            labels=["device"],
        )
        # A failing callback must not fail the scrape: log it and report what we have.
        try:
            for entry in self.residency() if self.residency else ():
                device = str(entry.device)
                for family, (_, attr, _) in zip(families, _RESIDENCY, strict=True):
                    family.add_metric([device], float(getattr(entry, attr)))
        except Exception:
            log.exception("metrics: residency callback failed")
        try:
            for info in self.devices() if self.devices else ():
                labels = [str(info.id), self.memory]
                used.add_metric(labels, float(info.total_memory_bytes - info.free_memory_bytes))
                total.add_metric(labels, float(info.total_memory_bytes))
                limit.add_metric([str(info.id)], float(self.memory_limit))
        except Exception:
            log.exception("metrics: devices callback failed")
        yield from families
        yield used
        yield total
        yield limit


class _TopCollector(Collector):
    """The most called tensors per device (``server/usage.py``), by rank 1..TOP_TENSORS:
    how concentrated routing is, which is what placement acts on (handle ids stay out:
    they are per owner and unbounded; ``TensorUsage`` names them to their owner)."""

    def __init__(self, top: TopFn) -> None:
        self.top = top

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["device", "rank"]
        calls = GaugeMetricFamily(
            "coliworker_tensor_top_calls",
            "Compute calls of the rank-th most called resident tensor of the device.",
            labels=labels,
        )
        rows = GaugeMetricFamily(
            "coliworker_tensor_top_rows",
            "Activation rows of the rank-th most called resident tensor of the device.",
            labels=labels,
        )
        try:
            for device, ranked in sorted(self.top(TOP_TENSORS).items()):
                for rank, (c, r) in enumerate(ranked, 1):
                    calls.add_metric([str(device), str(rank)], float(c))
                    rows.add_metric([str(device), str(rank)], float(r))
        except Exception:
            log.exception("metrics: tensor usage callback failed")
        yield calls
        yield rows


class Metrics:
    """Every metric of one worker, in its own registry unless one is given."""

    def __init__(
        self, version: str, backend: str, registry: CollectorRegistry | None = None
    ) -> None:
        # The *_created series double the series count and no dashboard reads them. The
        # switch is process-wide; the worker's process holds no other registry that wants them.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        if registry is None:  # process_* (CPU, memory, fds) and python_* (GC, version)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                r.register(collector)
        dev = ["device"]
        # The families every hot-path call updates live in a Tally (server/tally.py): the same
        # exposition as prometheus_client's Counter / Histogram at a fraction of the cost.
        hot = self.tally = Tally()
        r.register(hot)
        self.group_calls = hot.counter(
            "coliworker_group_calls", "Expert group calls (sync, async, routed).", dev
        )
        self.group_experts = hot.counter(
            "coliworker_group_experts", "Experts computed in expert group calls.", dev
        )
        self.group_rows = hot.counter(
            "coliworker_group_rows", "Activation rows computed in expert group calls.", dev
        )
        self.group_phase = hot.histogram(
            "coliworker_group_phase_seconds",
            "Time of one expert group call in one phase (h2d, kernel, d2h).",
            ["device", "phase"],
            PHASE_BUCKETS,
        )
        self.upload_bytes = Counter(
            "coliworker_upload_bytes", "Tensor bytes received by Upload and Update.", dev,
            registry=r,
        )  # fmt: skip
        self.upload_dedup_hits = Counter(
            "coliworker_upload_dedup_hits",
            "Uploads and acquiring lookups served by content already resident.",
            dev,
            registry=r,
        )
        self.kv_evictions = Counter(
            "coliworker_kv_evictions", "KV sequence caches evicted to make room.", dev, registry=r
        )
        self.compute_errors = hot.counter(
            "coliworker_compute_errors",
            "Failed compute calls (unary and Session requests) by status code.",
            ["code"],
        )
        self.session_requests = hot.counter(
            "coliworker_session_requests",
            "Calls on the hot-path transports (transport: grpc = Session stream, socket = "
            "data plane, shm = doorbell), by call and status code.",
            ["call", "code", "transport"],
        )
        self.session_seconds = hot.histogram(
            "coliworker_session_request_seconds",
            "Time from receiving a hot-path call to queueing its answer, by transport.",
            ["call", "transport"],
            RPC_BUCKETS,
        )
        rpc = ["grpc_type", "grpc_service", "grpc_method"]  # go-grpc-prometheus's labels
        self.rpc_started = Counter(
            "grpc_server_started", "RPCs started on the server.", rpc, registry=r
        )
        self.rpc_handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            [*rpc, "grpc_code"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its last response (a stream: when it ends).",
            rpc,
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.rpc_in_flight = Gauge(
            "grpc_server_in_flight_requests", "RPCs being handled now.", rpc, registry=r
        )
        build = Gauge(
            "coliworker_build_info", "Worker version and backend (always 1).",
            ["version", "backend"], registry=r,
        )  # fmt: skip
        build.labels(version=version, backend=backend).set(1)
        self._state = _StateCollector("host" if backend == "numpy" else "gpu")
        r.register(self._state)
        self._http: Any = None
        # Labelled children by label values: ``labels()`` builds and looks up its key under a
        # lock on every call (~0.65 us each, six per expert group); these are looked up once.
        self._children: dict[tuple, Any] = {}
        # Expert group calls and hot-path calls, recorded as journal entries (tally.py)
        self._groups = hot.journal(self._apply_groups)
        self._calls: dict[tuple[str, str], Journal] = {}  # (call, transport) -> its calls

    # -- callbacks and recorders -------------------------------------------------------

    def bind(
        self,
        residency: ResidencyFn | None = None,
        devices: DevicesFn | None = None,
        memory_limit: int | None = None,
        gpus: Sequence[int] | None = None,
    ) -> None:
        """Set the scrape-time sources. ``residency()`` returns objects with ``device``,
        ``tensors``, ``tensor_bytes``, ``handles``, ``kv_sequences`` and ``kv_bytes``
        (a DeviceStats-like view per device); ``devices()`` returns backend DeviceInfo;
        ``memory_limit`` is the per-device budget; ``gpus`` the CUDA devices whose
        utilisation and power NVML reports (``server/nvml.py``)."""
        if residency is not None:
            self._state.residency = residency
        if devices is not None:
            self._state.devices = devices
        if memory_limit is not None:
            self._state.memory_limit = memory_limit
        if gpus:
            from coliworker.server.nvml import NvmlCollector

            self.registry.register(NvmlCollector(gpus))

    def bind_usage(self, top: TopFn) -> None:
        """Expose ``top(n)`` (device -> the n largest (calls, rows) of its tensors) as
        coliworker_tensor_top_calls / _rows."""
        self.registry.register(_TopCollector(top))

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def record_group(self, device: int, experts: int, rows: int, phases: Phases) -> None:
        """One finished expert group call (ExpertGroup, Routed, Issue/Take, Session): one
        journal entry, its six updates made when read (``_apply_groups``)."""
        self._groups.record((device, experts, rows, phases.h2d_ns, phases.kernel_ns, phases.d2h_ns))

    def _apply_groups(self, entries: list[tuple]) -> None:
        """The updates of ``record_group``'s entries, device by device, from one float64
        table (a whole number below 2**53 exactly, and Python's int / float converts the
        int to a float before dividing, as the table's seconds are made)."""
        n = len(entries)
        table = np.fromiter(itertools.chain.from_iterable(entries), np.float64, 6 * n)
        table = table.reshape(n, 6)  # device, experts, rows, then the phases' ns
        devices = table[:, 0]
        each = sorted(set(devices.tolist()))
        for d in each:
            mine = table if len(each) == 1 else table[devices == d]
            device = int(d)
            key = ("group", device)
            c = self._children.get(key)
            if c is None:
                d = str(device)
                c = self._children[key] = (
                    self.group_calls.labels(d),
                    self.group_experts.labels(d),
                    self.group_rows.labels(d),
                    self.group_phase.labels(d, "h2d"),
                    self.group_phase.labels(d, "kernel"),
                    self.group_phase.labels(d, "d2h"),
                )
            calls, n_experts, n_rows, h2d, kernel, d2h = c
            # whole numbers: their float sum is exact whatever the grouping
            calls.inc(len(mine))
            n_experts.inc(float(mine[:, 1].sum()))
            n_rows.inc(float(mine[:, 2].sum()))
            seconds = mine[:, 3:] / 1e9
            h2d.observe_many(seconds[:, 0])
            kernel.observe_many(seconds[:, 1])
            d2h.observe_many(seconds[:, 2])

    def record_upload(self, device: int, nbytes: int, deduplicated: bool) -> None:
        """One Upload or Update that received ``nbytes`` (weights + scales)."""
        self.upload_bytes.labels(str(device)).inc(nbytes)
        if deduplicated:
            self.upload_dedup_hits.labels(str(device)).inc()

    def record_eviction(self, device: int) -> None:
        """One KV sequence cache evicted from ``device``."""
        self.kv_evictions.labels(str(device)).inc()

    def record_compute_error(self, code: grpc.StatusCode | int | str) -> None:
        """One failed compute request that the interceptor does not see (a Session request)."""
        self.compute_errors.labels(_code_name(code)).inc()

    def record_session_request(
        self, call: str, code: grpc.StatusCode | int | str, seconds: float, transport: str = "grpc"
    ) -> None:
        """One hot-path call: ``call`` is its kind ("expert_group"), ``transport`` grpc
        (Session stream), socket (data plane) or shm (doorbell). A non-OK code also counts
        as a compute error. One entry in the journal of its (call, transport), counted when
        read (``_apply_calls``): its seconds, or (seconds, code) for a call not OK."""
        journal = self._calls.get((call, transport))
        if journal is None:  # (two threads may make one each: both are flushed)
            journal = self._calls[(call, transport)] = self.tally.journal(
                functools.partial(self._apply_calls, call, transport)
            )
        journal.record(seconds if code is _OK else (seconds, code))

    def _apply_calls(self, call: str, transport: str, entries: list) -> None:
        """The updates of (call, transport)'s calls that ``entries`` record, in order."""
        failed = [e for e in entries if type(e) is tuple]
        if failed:
            seconds = [e[0] if type(e) is tuple else e for e in entries]
            for _, code in failed:
                name = _code_name(code)
                self._child(self.session_requests, call, name, transport).inc()
                if name != "OK":
                    self.compute_errors.labels(name).inc()
        else:
            seconds = entries
        if len(failed) < len(entries):
            ok = self._child(self.session_requests, call, "OK", transport)
            ok.inc(len(entries) - len(failed))
        observed = self._child(self.session_seconds, call, transport)
        observed.observe_many(np.fromiter(seconds, np.float64, len(seconds)))

    # -- exposition --------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format, as /metrics serves it."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint on a daemon thread; port 0 picks a free port.
        Returns the bound port."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                f"metrics endpoint {host}:{port}: {exc.strerror or exc} "
                "(--metrics-port / COLIWORKER_METRICS_PORT; 0 turns it off)"
            ) from None
        self._http = server
        return int(server.server_port)

    def stop(self) -> None:
        """Close the /metrics endpoint, if ``serve`` started one."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def interceptor(self) -> grpc.ServerInterceptor:
        """A server interceptor that records grpc_server_* for every RPC of the server."""
        return _MetricsInterceptor(self)

    # -- used by the interceptor -------------------------------------------------------

    def _begin(self, method: str, service: str = WORKER_SERVICE, kind: str = "unary") -> float:
        self._child(self.rpc_started, kind, service, method).inc()
        self._child(self.rpc_in_flight, kind, service, method).inc()
        return time.perf_counter()

    def _end(
        self,
        method: str,
        started: float,
        code: grpc.StatusCode,
        service: str = WORKER_SERVICE,
        kind: str = "unary",
    ) -> None:
        self._child(self.rpc_seconds, kind, service, method).observe(time.perf_counter() - started)
        self._child(self.rpc_handled, kind, service, method, code.name).inc()
        if code is not grpc.StatusCode.OK and method in COMPUTE_METHODS:
            self.compute_errors.labels(code.name).inc()
        # last: whoever sees the call no longer in flight also sees it counted as handled
        self._child(self.rpc_in_flight, kind, service, method).dec()


def _status(context: grpc.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    """The status the client sees: the one set on the context (set_code, abort); else, for a
    call that is no longer active, DEADLINE_EXCEEDED or CANCELLED; else ``default`` (OK on
    return, UNKNOWN for an exception, as grpc itself does)."""
    try:
        code = context.code()  # type: ignore[attr-defined]
    except Exception:  # a context without code() (grpc < 1.38)
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if not context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return default


def _settled(context: grpc.ServicerContext, code: grpc.StatusCode) -> grpc.StatusCode:
    """The status of a call that has ended: CANCELLED where grpc saw the client cancel (its
    server context keeps the client side's state as ``_state.client``, "cancelled" once a
    cancel has come), else ``code``; where a grpc keeps no such state, ``code``."""
    client = getattr(getattr(context, "_state", None), "client", None)
    return grpc.StatusCode.CANCELLED if client == "cancelled" else code


def _finish(
    m: Metrics,
    context: grpc.ServicerContext,
    method: str,
    started: float,
    code: grpc.StatusCode,
    service: str,
    kind: str,
) -> None:
    """Record a call's end. A request-streaming call whose handler returned normally is
    recorded when the call ends (``add_callback``): a cancel that reaches grpc while the
    handler waits for its next request can surface as the end of the requests (the request
    iterator stops) before grpc marks the call cancelled, so only the call's end settles
    whether the client saw OK or CANCELLED."""
    if code is grpc.StatusCode.OK and kind in ("client_stream", "bidi_stream"):

        def settle() -> None:
            m._end(method, started, _settled(context, code), service, kind)

        if context.add_callback(settle):
            return
        code = _settled(context, code)  # the call has already ended
    m._end(method, started, code, service, kind)


class _MetricsInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        full = handler_call_details.method  # type: ignore[attr-defined]
        service, _, method = full.lstrip("/").rpartition("/")
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(service, method, "unary", handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(service, method, "client_stream", handler.stream_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(service, method, "server_stream", handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(service, method, "bidi_stream", handler.stream_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler

    def _unary(
        self, service: str, method: str, kind: str, behavior: Callable[..., Any]
    ) -> Callable[..., Any]:
        m = self._m

        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            started = m._begin(method, service, kind)
            code = grpc.StatusCode.UNKNOWN
            try:
                response = behavior(request, context)
                code = _status(context, grpc.StatusCode.OK)
                return response
            except BaseException:
                code = _status(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                _finish(m, context, method, started, code, service, kind)

        return wrapped

    def _streaming(
        self, service: str, method: str, kind: str, behavior: Callable[..., Any]
    ) -> Callable[..., Any]:
        m = self._m

        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterable[Any]:
            started = m._begin(method, service, kind)
            code = grpc.StatusCode.UNKNOWN
            try:
                yield from behavior(request, context)
                code = _status(context, grpc.StatusCode.OK)
            except GeneratorExit:
                # grpc dropped the response iterator: the client cancelled or went away.
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = _status(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                _finish(m, context, method, started, code, service, kind)

        return wrapped


__all__ = ["COMPUTE_METHODS", "PHASE_BUCKETS", "RPC_BUCKETS", "WORKER_SERVICE", "Metrics"]
