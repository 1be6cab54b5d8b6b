"""The Grafana dashboard reads only metrics the worker exposes, and covers the issue's list."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from promql_names import metric_names

from coliworker.server.backend import DeviceInfo, Phases
from coliworker.server.metrics import Metrics


@pytest.fixture(scope="module")
def exposed() -> set[str]:
    """Sample names of a worker's /metrics after one of everything was recorded."""
    from coliworker.server.nvml import NvmlCollector

    m = Metrics("0.1.0", "numpy")
    entry = SimpleNamespace(
        device=0, tensors=1, tensor_bytes=2, handles=3, kv_sequences=4, kv_bytes=5
    )
    m.bind(residency=lambda: [entry], devices=lambda: [DeviceInfo(0, "cpu", 10, 5)])
    m.record_group(0, 2, 3, Phases(1000, 2000, 3000))
    m.record_upload(0, 100, deduplicated=True)
    m.record_eviction(0)
    m.record_session_request("expert_group", grpc.StatusCode.UNAVAILABLE, 0.01)
    m._begin("Info")
    m._end("Info", 0.0, grpc.StatusCode.OK)
    m.registry.register(NvmlCollector([0], nvml=_OneGpu(), pci_bus_id=str))
    names = set()
    for line in m.render().decode().splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{")[0].split(" ")[0])
    return names


class _OneGpu:
    """What NVML answers for one GPU (the CUDA image's collector; no GPU here)."""

    def __getattr__(self, name: str):
        values = {
            "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=50, memory=20),
            "nvmlDeviceGetHandleByPciBusId": "handle",
        }
        return lambda *args: values.get(name, 1)


def test_every_dashboard_metric_is_exposed(dashboard_exprs: list[str], exposed: set[str]) -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs))
    assert used, "no metric names found in the dashboard"
    assert used <= exposed, f"dashboard uses metrics the worker lacks: {sorted(used - exposed)}"


def test_dashboard_shows_what_the_issue_asks(dashboard_exprs: list[str]) -> None:
    text = "\n".join(dashboard_exprs)
    for needle in (
        "rate(grpc_server_handled_total",  # call rates per RPC
        "histogram_quantile(0.5, sum by (grpc_method, le)",  # p50 per RPC
        "histogram_quantile(0.99, sum by (grpc_method, le)",  # p99 per RPC
        "coliworker_group_calls_total",
        "coliworker_group_experts_total",
        "coliworker_group_rows_total",
        "coliworker_group_phase_seconds_sum",  # h2d / kernel / d2h
        "coliworker_resident_bytes",
        "coliworker_device_memory_used_bytes",
        "coliworker_device_memory_total_bytes",
        "coliworker_memory_limit_bytes",
        "coliworker_session_request_seconds_bucket",  # hot-path latency per call
        "sum by (call, transport, le)",  # ... and per transport (grpc, socket, shm)
        "coliworker_gpu_utilization_ratio",
        "coliworker_gpu_power_watts",
        "process_cpu_seconds_total",
        'grpc_type="unary"',  # stream durations are observed at their end: no p50 of them
        "coliworker_compute_errors_total",
        'grpc_code!="OK"',
    ):
        assert needle in text, needle


def test_dashboard_structure(dashboard: dict) -> None:
    assert dashboard["uid"] == "coliworker"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= names
