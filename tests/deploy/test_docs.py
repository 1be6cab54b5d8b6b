"""The README and docs/ stay true: their links resolve, and the metrics table of
docs/deployment.md names every metric family the worker exposes (and no other)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import grpc
import pytest
from promql_names import ROOT

from coliworker.server.backend import DeviceInfo, Phases
from coliworker.server.metrics import Metrics

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages written together with a feature that is still landing; linked ahead of time.
PENDING = {ROOT / "docs" / "c-client.md"}
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_local_links_resolve(page) -> None:
    for target, _anchor in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        assert path.exists() or path in PENDING, f"{page.name}: {target}"


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) < 16_000, "keep the depth in docs/"
    for page in ("api", "formats", "transports", "deployment", "security", "performance"):
        assert f"docs/{page}.md" in text, page


def test_metrics_table_lists_every_exposed_family() -> None:
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
    m._end("Info", m._begin("Info"), grpc.StatusCode.OK)

    class OneGpu:
        def __getattr__(self, name):
            rates = SimpleNamespace(gpu=1, memory=1)
            return lambda *a: rates if name == "nvmlDeviceGetUtilizationRates" else 1

    m.registry.register(NvmlCollector([0], nvml=OneGpu(), pci_bus_id=str))
    exposed = set()
    for family in m.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        if name.startswith(("coliworker_", "grpc_server_")):
            exposed.add(name)
    text = (ROOT / "docs" / "deployment.md").read_text()
    table = text.split("## Metrics")[1].split("\n\n", 2)[2].split("\n\n")[0]
    documented = set(re.findall(r"^\| `((?:coliworker|grpc_server)_\w+)`", table, re.M))
    assert documented == exposed, (
        f"undocumented: {sorted(exposed - documented)}; gone: {sorted(documented - exposed)}"
    )
