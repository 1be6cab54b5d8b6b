"""A real Prometheus scrapes a real worker with the job from deploy/prometheus.yml, and
every dashboard query evaluates against what it stored.

Needs the ``prometheus`` binary (Debian package ``prometheus``; .ci/run installs it);
skipped with that reason elsewhere.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
import yaml
from promql_names import DEPLOY

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus binary not on PATH (apt-get install prometheus)",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def query(base: str, expr: str) -> dict:
    return get_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def wait_for(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
            last = result
        except (urllib.error.URLError, OSError, ValueError) as err:
            last = err
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def worker():
    from coliworker.server.app import build_server
    from coliworker.server.config import Config

    server = build_server(
        Config(host="127.0.0.1", port=0, backend="numpy", devices=(0,), metrics_port=0)
    ).start()
    try:
        yield server
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def prometheus(worker, tmp_path_factory):
    """Prometheus with deploy/prometheus.yml's coliworker job, pointed at the test worker."""
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "coliworker"]
    for static in job["static_configs"]:
        static["targets"] = [f"127.0.0.1:{worker.metrics_port}"]
    config["scrape_configs"] = [job]
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "wb")  # closed in the finally below
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus ready", lambda: urllib.request.urlopen(f"{base}/-/ready").status)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def make_traffic(address: str, calls: int) -> None:
    from coliworker.client import WorkerClient

    rng = np.random.default_rng()
    d, i_e = 64, 96

    def dense(o: int, i: int):
        return rng.standard_normal((o, i)).astype(np.float32)

    with WorkerClient(address, timeout=30, progress=False) as client:
        experts = []
        for _ in range(2):
            g, u = (client.upload(dense(i_e, d), None, fmt=0, in_features=d,
                                  out_features=i_e) for _ in range(2))  # fmt: skip
            down = client.upload(dense(d, i_e), None, fmt=0, in_features=i_e, out_features=d)
            experts.append((g, u, down))
        rows = [3, 5]
        x = rng.standard_normal((sum(rows), d)).astype(np.float32)
        for _ in range(calls):
            y = client.expert_group(experts=experts, rows=rows, x=x)
            assert y.shape == x.shape


def scalar(result: dict) -> float:
    data = result["data"]["result"]
    return float(data[0]["value"][1]) if data else 0.0


def test_prometheus_scrapes_worker_and_dashboard_queries_evaluate(
    worker, prometheus, dashboard_exprs
) -> None:
    up = 'up{job="coliworker"}'
    wait_for("the worker target up", lambda: scalar(query(prometheus, up)) == 1.0)
    calls = 'sum(coliworker_group_calls_total{job="coliworker"})'
    before = scalar(query(prometheus, calls))
    make_traffic(worker.address, calls=5)
    after = wait_for(
        "coliworker_group_calls_total to move",
        lambda: (v := scalar(query(prometheus, calls))) >= before + 5 and v,
    )
    assert after >= before + 5
    wait_for(
        "grpc_server_handled_total for ExpertGroup",
        lambda: (
            scalar(query(prometheus, 'sum(grpc_server_handled_total{grpc_method="ExpertGroup"})'))
            >= 5
        ),
    )

    # Every dashboard query is valid PromQL and returns data for what was exercised.
    for expr in dashboard_exprs:
        if expr.startswith("label_values("):
            continue  # a Grafana variable query, not PromQL
        promql = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        result = query(prometheus, promql)
        assert result["status"] == "success", (expr, result)
    # The alert rules loaded and evaluate without errors against the live worker.
    rules = get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
    names = {r["name"]: r for g in rules for r in g["rules"]}
    assert {"ColiworkerDown", "ColiworkerMemoryNearBudget", "ColiworkerKVEvictions"} <= set(names)
    wait_for(
        "every rule evaluated once",
        lambda: all(
            r.get("lastEvaluation", "").startswith("20")
            for g in get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
            for r in g["rules"]
        ),
    )
    for g in get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]:
        for r in g["rules"]:
            assert r["health"] == "ok", r
    for expr in (
        "coliworker_group_experts_total",
        "coliworker_resident_bytes",
        'coliworker_device_memory_total_bytes{memory="host"}',
        "coliworker_memory_limit_bytes",
        "coliworker_build_info",
        'grpc_server_handled_total{grpc_service="coliworker.v1.Worker",grpc_type="unary"}',
        "process_resident_memory_bytes",
    ):
        assert query(prometheus, expr)["data"]["result"], expr
