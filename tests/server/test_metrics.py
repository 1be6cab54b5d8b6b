"""Metrics: recorders move their series, the collector reads its callbacks at scrape time,
the interceptor counts every handler kind with the status the client saw."""

from __future__ import annotations

import random
import urllib.request
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from coliworker.server.backend import DeviceInfo, Phases
from coliworker.server.metrics import Metrics

# Every series family the worker exposes (sample names as they appear in /metrics).
EXPECTED = [
    "coliworker_build_info",
    "coliworker_group_calls_total",
    "coliworker_group_experts_total",
    "coliworker_group_rows_total",
    "coliworker_group_phase_seconds_bucket",
    "coliworker_upload_bytes_total",
    "coliworker_upload_dedup_hits_total",
    "coliworker_kv_evictions_total",
    "coliworker_compute_errors_total",
    "coliworker_session_requests_total",
    "coliworker_session_request_seconds_bucket",
    "coliworker_resident_tensors",
    "coliworker_resident_bytes",
    "coliworker_resident_handles",
    "coliworker_kv_sequences",
    "coliworker_kv_bytes",
    "coliworker_device_memory_used_bytes",
    "coliworker_device_memory_total_bytes",
    "coliworker_memory_limit_bytes",
    "grpc_server_started_total",
    "grpc_server_handled_total",
    "grpc_server_handling_seconds_bucket",
    "grpc_server_in_flight_requests",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "python_info",
    "python_gc_collections_total",
]


def residency_entry(device: int, **values: int) -> SimpleNamespace:
    fields = ("tensors", "tensor_bytes", "handles", "kv_sequences", "kv_bytes")
    return SimpleNamespace(device=device, **{f: values.get(f, 0) for f in fields})


def value(m: Metrics, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(
        s.value
        for family in m.registry.collect()
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_record_group_moves_counters_and_phase_histograms() -> None:
    m = Metrics("0.1.0", "numpy")
    experts, rows = random.randint(1, 64), random.randint(1, 4096)
    m.record_group(1, experts, rows, Phases(h2d_ns=30_000, kernel_ns=2_000_000, d2h_ns=7))
    m.record_group(1, 2, 3, Phases())
    assert value(m, "coliworker_group_calls_total", device="1") == 2
    assert value(m, "coliworker_group_experts_total", device="1") == experts + 2
    assert value(m, "coliworker_group_rows_total", device="1") == rows + 3
    kernel = {"device": "1", "phase": "kernel"}
    assert value(m, "coliworker_group_phase_seconds_count", **kernel) == 2
    assert value(m, "coliworker_group_phase_seconds_sum", **kernel) == pytest.approx(2e-3)
    # 30 us lands in the 50 us bucket, not the 25 us one.
    h2d = {"device": "1", "phase": "h2d"}
    assert value(m, "coliworker_group_phase_seconds_bucket", le="2.5e-05", **h2d) == 1
    assert value(m, "coliworker_group_phase_seconds_bucket", le="5e-05", **h2d) == 2
    assert value(m, "coliworker_group_calls_total", device="0") == 0


def test_upload_eviction_and_error_counters() -> None:
    m = Metrics("0.1.0", "numpy")
    m.record_upload(0, 1000, deduplicated=False)
    m.record_upload(0, 500, deduplicated=True)
    m.record_eviction(0)
    m.record_compute_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
    m.record_compute_error(3)  # INVALID_ARGUMENT by number, as Session Status carries it
    m.record_session_request("expert_group", grpc.StatusCode.OK, 0.001)
    m.record_session_request("matmul", grpc.StatusCode.NOT_FOUND, 0.002)
    assert value(m, "coliworker_upload_bytes_total", device="0") == 1500
    assert value(m, "coliworker_upload_dedup_hits_total", device="0") == 1
    assert value(m, "coliworker_kv_evictions_total", device="0") == 1
    assert value(m, "coliworker_compute_errors_total", code="RESOURCE_EXHAUSTED") == 1
    assert value(m, "coliworker_compute_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(m, "coliworker_compute_errors_total", code="NOT_FOUND") == 1
    assert value(m, "coliworker_session_requests_total", call="expert_group", code="OK") == 1
    assert value(m, "coliworker_session_request_seconds_count", call="matmul") == 1


def test_collector_reads_callbacks_at_every_scrape() -> None:
    m = Metrics("0.1.0", "numpy")
    state = {"bytes": 123}
    m.bind(
        residency=lambda: [
            residency_entry(0, tensors=2, tensor_bytes=state["bytes"], handles=3),
            residency_entry(1, kv_sequences=4, kv_bytes=4096),
        ],
        devices=lambda: [DeviceInfo(0, "cpu", 1000, 250), DeviceInfo(1, "cpu", 2000, 2000)],
    )
    assert value(m, "coliworker_resident_bytes", device="0") == 123
    assert value(m, "coliworker_resident_tensors", device="0") == 2
    assert value(m, "coliworker_resident_handles", device="0") == 3
    assert value(m, "coliworker_kv_sequences", device="1") == 4
    assert value(m, "coliworker_kv_bytes", device="1") == 4096
    assert value(m, "coliworker_device_memory_used_bytes", device="0", memory="host") == 750
    assert value(m, "coliworker_device_memory_total_bytes", device="1", memory="host") == 2000
    assert value(m, "coliworker_memory_limit_bytes", device="1") == 0  # none bound: no budget
    m.bind(memory_limit=1500)
    assert value(m, "coliworker_memory_limit_bytes", device="1") == 1500
    state["bytes"] = 456
    assert value(m, "coliworker_resident_bytes", device="0") == 456


def test_failing_callback_does_not_fail_the_scrape() -> None:
    m = Metrics("0.1.0", "numpy")

    def broken() -> list:
        raise RuntimeError("store is gone")

    m.bind(residency=broken, devices=lambda: [DeviceInfo(0, "cpu", 10, 4)])
    text = m.render().decode()
    assert 'coliworker_device_memory_used_bytes{device="0",memory="host"} 6.0' in text


def test_render_lists_every_metric_and_build_info() -> None:
    m = Metrics("9.9.9", "cupy")
    m.bind(residency=lambda: [residency_entry(0)], devices=lambda: [DeviceInfo(0, "x", 1, 1)])
    m.record_group(0, 1, 1, Phases(1, 1, 1))
    m.record_upload(0, 1, True)
    m.record_eviction(0)
    m.record_session_request("matmul", grpc.StatusCode.INTERNAL, 0.1)
    m.interceptor()  # grpc_server_* exist once a call went through; see below
    rpc = ("unary", "coliworker.v1.Worker", "Info")
    m.rpc_started.labels(*rpc).inc()
    m.rpc_handled.labels(*rpc, "OK").inc()
    m.rpc_seconds.labels(*rpc).observe(0.001)
    m.rpc_in_flight.labels(*rpc).set(0)
    text = m.render().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert set(EXPECTED) <= names, sorted(set(EXPECTED) - names)
    assert 'coliworker_build_info{backend="cupy",version="9.9.9"} 1.0' in text
    assert 'coliworker_device_memory_total_bytes{device="0",memory="gpu"} 1.0' in text
    assert "_created" not in text


def test_registries_are_independent() -> None:
    a, b = Metrics("1", "numpy"), Metrics("1", "numpy")
    a.record_eviction(0)
    assert value(a, "coliworker_kv_evictions_total", device="0") == 1
    assert value(b, "coliworker_kv_evictions_total", device="0") == 0


def test_serve_on_port_zero_returns_the_bound_port() -> None:
    m = Metrics("0.1.0", "numpy")
    port = m.serve("127.0.0.1", 0)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        assert "coliworker_build_info" in body
    finally:
        m.stop()


# -- interceptor --------------------------------------------------------------------------

SERVICE = "coliworker.v1.Worker"


def _unary_ok(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request[::-1]


def _unary_abort(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "matmul.x: expected 4 columns, got 3")
    raise AssertionError("unreachable")


def _unary_raise(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise RuntimeError("boom")


def _unary_set_code(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("tensor 7: not found")
    return b""


def _upload(requests, context: grpc.ServicerContext) -> bytes:
    return str(sum(len(r) for r in requests)).encode()


def _session(requests, context: grpc.ServicerContext):
    for r in requests:
        if r == b"stop":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many tickets")
        yield r


def _server_stream(request: bytes, context: grpc.ServicerContext):
    for i in range(int(request)):
        yield str(i).encode()


HANDLERS = {
    "Info": grpc.unary_unary_rpc_method_handler(_unary_ok),
    "Matmul": grpc.unary_unary_rpc_method_handler(_unary_abort),
    "ExpertGroup": grpc.unary_unary_rpc_method_handler(_unary_raise),
    "Free": grpc.unary_unary_rpc_method_handler(_unary_set_code),
    "Upload": grpc.stream_unary_rpc_method_handler(_upload),
    "Session": grpc.stream_stream_rpc_method_handler(_session),
    "Watch": grpc.unary_stream_rpc_method_handler(_server_stream),
}


@pytest.fixture
def served():
    m = Metrics("0.1.0", "numpy")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[m.interceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, HANDLERS)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield m, channel
    finally:
        channel.close()
        server.stop(None)


def _path(method: str) -> str:
    return f"/{SERVICE}/{method}"


def handled(m: Metrics, method: str, code: str) -> float:
    return value(m, "grpc_server_handled_total", grpc_method=method, grpc_code=code)


def test_interceptor_unary_codes(served) -> None:
    m, channel = served
    assert channel.unary_unary(_path("Info"))(b"abc", timeout=5) == b"cba"
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(_path("Matmul"))(b"x", timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(_path("ExpertGroup"))(b"x", timeout=5)
    assert err.value.code() is grpc.StatusCode.UNKNOWN
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(_path("Free"))(b"x", timeout=5)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND

    assert handled(m, "Info", "OK") == 1
    assert handled(m, "Matmul", "INVALID_ARGUMENT") == 1
    assert handled(m, "ExpertGroup", "UNKNOWN") == 1
    assert handled(m, "Free", "NOT_FOUND") == 1
    for method in ("Info", "Matmul", "ExpertGroup", "Free"):
        assert value(m, "grpc_server_started_total", grpc_method=method) == 1
        assert value(m, "grpc_server_in_flight_requests", grpc_method=method) == 0
        assert value(m, "grpc_server_handling_seconds_count", grpc_method=method) == 1
    # Compute methods also count in compute errors; Free is not a compute method.
    assert value(m, "coliworker_compute_errors_total", code="INVALID_ARGUMENT") == 1
    assert value(m, "coliworker_compute_errors_total", code="UNKNOWN") == 1
    assert value(m, "coliworker_compute_errors_total", code="NOT_FOUND") == 0


def ended(m: Metrics, *methods: str) -> None:
    """Wait (30 s at most, however loaded the machine) until no call of ``methods`` is in
    flight: a request-streaming call that ends normally is counted when grpc ends it, which
    can be just after its client has its last response."""
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(value(m, "grpc_server_in_flight_requests", grpc_method=x) == 0 for x in methods):
            return
        time.sleep(0.01)


def test_interceptor_streams(served) -> None:
    m, channel = served
    chunks = [bytes(random.randint(1, 100)) for _ in range(5)]
    reply = channel.stream_unary(_path("Upload"))(iter(chunks), timeout=5)
    assert int(reply) == sum(map(len, chunks))
    assert list(channel.stream_stream(_path("Session"))(iter([b"a", b"b"]), timeout=5)) == [
        b"a",
        b"b",
    ]
    with pytest.raises(grpc.RpcError) as err:
        list(channel.stream_stream(_path("Session"))(iter([b"a", b"stop", b"c"]), timeout=5))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(list(channel.unary_stream(_path("Watch"))(b"3", timeout=5))) == 3

    ended(m, "Upload", "Session")
    assert handled(m, "Upload", "OK") == 1
    assert handled(m, "Session", "OK") == 1
    assert handled(m, "Session", "RESOURCE_EXHAUSTED") == 1
    assert handled(m, "Watch", "OK") == 1
    assert value(m, "grpc_server_started_total", grpc_method="Session") == 2
    assert value(m, "grpc_server_in_flight_requests", grpc_method="Session") == 0
    assert value(m, "grpc_server_handling_seconds_count", grpc_method="Upload") == 1
    # go-grpc-prometheus's labels: the full service name and the kind of RPC.
    for method, kind in (
        ("Upload", "client_stream"),
        ("Session", "bidi_stream"),
        ("Watch", "server_stream"),
    ):
        labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": kind}
        assert value(m, "grpc_server_started_total", **labels) >= 1, method


def test_interceptor_labels_unary_calls_like_go_grpc_prometheus(served) -> None:
    m, channel = served
    channel.unary_unary(_path("Info"))(b"abc", timeout=5)
    labels = {"grpc_service": SERVICE, "grpc_method": "Info", "grpc_type": "unary"}
    assert value(m, "grpc_server_handled_total", grpc_code="OK", **labels) == 1
    assert value(m, "grpc_server_handling_seconds_count", **labels) == 1


def test_a_busy_metrics_port_is_named() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics endpoint 127.0.0.1:{port}: .*--metrics-port"):
            Metrics("0.1.0", "numpy").serve("127.0.0.1", port)


class FakeNvml:
    """The calls of nvidia-ml-py that server/nvml.py makes, for one GPU."""

    def __init__(self) -> None:
        self.bus_ids: list[str] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:
        self.bus_ids.append(bus_id)
        return f"handle:{bus_id}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 512_250  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: str) -> int:
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        return 9_000_000  # millijoules

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        return 61


def test_nvml_gauges_follow_the_cuda_device_by_pci_bus_id() -> None:
    from coliworker.server.nvml import NvmlCollector

    m, nvml = Metrics("0.1.0", "cupy"), FakeNvml()
    collector = NvmlCollector([1], nvml=nvml, pci_bus_id=lambda d: f"0000:{d:02x}:00.0")
    m.registry.register(collector)
    assert nvml.bus_ids == ["0000:01:00.0"]
    assert value(m, "coliworker_gpu_utilization_ratio", device="1") == pytest.approx(0.87)
    assert value(m, "coliworker_gpu_memory_bandwidth_utilization_ratio", device="1") == 0.41
    assert value(m, "coliworker_gpu_power_watts", device="1") == pytest.approx(512.25)
    assert value(m, "coliworker_gpu_power_limit_watts", device="1") == 700
    assert value(m, "coliworker_gpu_energy_joules_total", device="1") == 9000
    assert value(m, "coliworker_gpu_temperature_celsius", device="1") == 61


def test_nvml_without_a_driver_exports_nothing(caplog) -> None:
    from coliworker.server.nvml import NvmlCollector

    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    collector = NvmlCollector([0], nvml=NoDriver(), pci_bus_id=str)
    assert list(collector.collect()) == []
    assert "NVML Shared Library Not Found" in caplog.text


def test_interceptor_counts_a_cancelled_stream(served) -> None:
    # A cancel that grpc first surfaces as the end of the requests (the handler then returns
    # normally) still counts as CANCELLED: the interceptor settles the code at the call's end.
    import threading

    m, channel = served
    gate = threading.Event()

    def requests():
        yield b"a"
        gate.wait(60)

    call = channel.stream_stream(_path("Session"))(requests(), timeout=60)
    assert next(call) == b"a"
    call.cancel()
    ended(m, "Session")
    # The requests end only now: ended before the cancel reached the worker, they would
    # end the stream normally (OK), which a loaded machine showed once.
    gate.set()
    assert value(m, "grpc_server_in_flight_requests", grpc_method="Session") == 0
    assert handled(m, "Session", "CANCELLED") == 1


def test_group_and_session_records_read_as_their_updates_made_one_by_one() -> None:
    """record_group and record_session_request defer their updates (journals, tally.py):
    every read sees each call recorded before it, with the sums of one update per call."""
    from coliworker.server.tally import JOURNAL

    m = Metrics("0.1.0", "numpy")
    rng = random.Random()
    calls: dict[int, list] = {}
    seconds: dict[tuple[str, str], list[float]] = {}  # every call's, failed ones too
    ok: dict[tuple[str, str], int] = {}
    failed = 0
    for i in range(2 * JOURNAL + 31):
        device = rng.randrange(3)
        experts, rows = rng.randint(1, 64), rng.randint(1, 4096)
        ph = Phases(rng.randrange(10**7), rng.randrange(10**9), rng.randrange(10**6))
        m.record_group(device, experts, rows, ph)
        calls.setdefault(device, []).append((experts, rows, ph))
        kind, transport = rng.choice(["expert_group_routed", "attention_ragged"]), "socket"
        s = rng.random() / 100
        if rng.random() < 0.05:
            m.record_session_request(kind, grpc.StatusCode.NOT_FOUND, s, transport)
            failed += 1
        else:
            m.record_session_request(kind, grpc.StatusCode.OK, s, transport)
            ok[(kind, transport)] = ok.get((kind, transport), 0) + 1
        seconds.setdefault((kind, transport), []).append(s)
        if i % 700 == 0 or i == JOURNAL + 3:
            for device, got in calls.items():
                d = str(device)
                assert value(m, "coliworker_group_calls_total", device=d) == len(got)
                assert value(m, "coliworker_group_rows_total", device=d) == sum(
                    r for _, r, _ in got
                )
                total = 0.0
                for _, _, ph in got:  # the float sum of one observe per call, in order
                    total += ph.kernel_ns / 1e9
                kernel = {"device": d, "phase": "kernel"}
                assert value(m, "coliworker_group_phase_seconds_sum", **kernel) == total
                assert value(m, "coliworker_group_phase_seconds_count", **kernel) == len(got)
            for (kind, transport), secs in seconds.items():
                labels = {"call": kind, "transport": transport}
                n = value(m, "coliworker_session_requests_total", code="OK", **labels)
                assert n == ok.get((kind, transport), 0)
                total = 0.0
                for s in secs:
                    total += s
                assert value(m, "coliworker_session_request_seconds_sum", **labels) == total
            assert value(m, "coliworker_compute_errors_total", code="NOT_FOUND") == failed
