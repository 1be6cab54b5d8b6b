"""The deployment files agree with each other and with the worker: ports, names, variables,
probes, mounts. (Schemas are checked by scripts/check-deploy; this is the wiring.)"""

from __future__ import annotations

import re

import pytest
import yaml
from promql_names import DEPLOY, ROOT

SECURITY_VARS = {"COLIWORKER_TOKEN_FILE", "COLIWORKER_INSECURE"}  # the auth issue adds them
DATA_PLANE_VARS = {"COLIWORKER_DATA_PORT"}  # the socket data plane's setting


def load(path):
    return yaml.safe_load(path.read_text())


def load_all(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def known_env() -> set[str]:
    from coliworker.server.config import SETTINGS

    return {s.env for s in SETTINGS} | SECURITY_VARS | DATA_PLANE_VARS


def config_from(env: dict[str, str]):
    from coliworker.server.config import from_sources

    return from_sources(None, {k: str(v) for k, v in env.items()})


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(DEPLOY / "docker-compose.yml")


def test_compose_workers(compose: dict) -> None:
    services = compose["services"]
    gpu, cpu = services["worker-gpu"], services["worker-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert gpu["build"]["target"] == "cuda" and cpu["build"]["target"] == "cpu"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    for worker in (gpu, cpu):
        env = worker["environment"]
        assert set(env) <= known_env(), set(env) - known_env()
        config = config_from({k: v for k, v in env.items() if k not in SECURITY_VARS})
        assert (config.host, config.port, config.metrics_port) == ("0.0.0.0", 50051, 9400)
        published = {p.split(":")[-1].split("/")[0] for p in worker["ports"]}
        assert published == {"50051", env["COLIWORKER_DATA_PORT"], "9400"}
        # SIGKILL must not land mid-drain: Docker waits stop_grace_period after SIGTERM.
        grace = float(env["COLIWORKER_DRAIN_GRACE"])
        assert float(worker["stop_grace_period"].rstrip("s")) >= grace + 10
        assert env["COLIWORKER_INSECURE"] == "1"
        assert "worker" in worker["networks"]["default"]["aliases"]
        # Insecure by default: published on loopback only.
        assert all(p.startswith("127.0.0.1:") for p in worker["ports"]), worker["ports"]
        assert (ROOT / "deploy" / worker["build"]["context"] / "Dockerfile").is_file()
    # The default profile (deploy/.env) is the GPU worker.
    assert "COMPOSE_PROFILES=gpu" in (DEPLOY / ".env").read_text().splitlines()


def test_compose_insecure_default_is_loud() -> None:
    text = (DEPLOY / "docker-compose.yml").read_text()
    assert "SECURITY" in text and "openssl rand" in text


def test_compose_mounts_exist(compose: dict) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} missing"


def test_prometheus_scrapes_the_worker_metrics_port(compose: dict) -> None:
    prom = load(DEPLOY / "prometheus.yml")
    # The alert rules load from beside the config, where compose mounts them.
    assert prom["rule_files"] == ["alerts.yml"]
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "coliworker"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    port = compose["services"]["worker-cpu"]["environment"]["COLIWORKER_METRICS_PORT"]
    assert targets == [f"worker:{port}"]


def test_grafana_provisioning_matches_dashboard(dashboard: dict) -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    (source,) = load(prov / "datasources" / "prometheus.yml")["datasources"]
    assert source["url"] == "http://prometheus:9090"
    (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert var["current"]["value"] == source["uid"]
    (provider,) = load(prov / "dashboards" / "coliworker.yml")["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


@pytest.fixture(scope="module")
def k8s() -> dict:
    """Every manifest under deploy/k8s by (kind, path relative to deploy/k8s)."""
    docs = {}
    root = DEPLOY / "k8s"
    for path in sorted(root.rglob("*.yaml")):
        for doc in load_all(path):
            if "kind" in doc:
                docs[(doc["kind"], str(path.relative_to(root)))] = doc
    return docs


def test_k8s_deployment(k8s: dict) -> None:
    deployment = k8s[("Deployment", "base/deployment.yaml")]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) - {"CUPY_CACHE_DIR"} <= known_env()
    config = config_from({k: v for k, v in env.items() if k.startswith("COLIWORKER_")})
    assert config.port == ports["grpc"] and config.metrics_port == ports["metrics"]
    assert int(env["COLIWORKER_DATA_PORT"]) == ports["data"]
    # No memory budget pinned to one GPU model: admission checks the GPU's free memory.
    assert "COLIWORKER_MEMORY_LIMIT" not in env
    # preStop delay + drain fit in the grace period, so SIGKILL never lands mid-drain.
    (delay,) = [int(a) for a in container["lifecycle"]["preStop"]["exec"]["command"][1:]]
    assert (
        delay + float(env["COLIWORKER_DRAIN_GRACE"]) < pod["spec"]["terminationGracePeriodSeconds"]
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    assert container["readinessProbe"]["grpc"]["service"] == "coliworker.v1.Worker"
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == ports["metrics"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    # The token file lives in the mounted Secret of secret.example.yaml.
    secret = k8s[("Secret", "secret.example.yaml")]
    (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert (
        env["COLIWORKER_TOKEN_FILE"] == f"{mount['mountPath']}/{next(iter(secret['stringData']))}"
    )


def test_k8s_service_and_kustomization(k8s: dict) -> None:
    deployment = k8s[("Deployment", "base/deployment.yaml")]
    service = k8s[("Service", "base/service.yaml")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    names = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    names = {p["name"] for p in service["spec"]["ports"]}
    assert names == {"grpc", "data", "metrics"}
    for path, kustomization in [(p, d) for (k, p), d in k8s.items() if k == "Kustomization"]:
        here = (DEPLOY / "k8s" / path).parent
        for resource in kustomization.get("resources", []):
            assert (here / resource).exists(), f"{path}: {resource}"
        assert "secret.example.yaml" not in kustomization.get("resources", [])
    assert k8s[("Kustomization", "kustomization.yaml")]["resources"] == ["base"]
    pdb = k8s[("PodDisruptionBudget", "base/pdb.yaml")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "pdb.yaml" in k8s[("Kustomization", "base/kustomization.yaml")]["resources"]


def test_k8s_monitoring(k8s: dict) -> None:
    service = k8s[("Service", "base/service.yaml")]
    monitor = k8s[("ServiceMonitor", "monitoring/servicemonitor.yaml")]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] == "metrics"
    # The PrometheusRule holds exactly the rules of deploy/alerts.yml.
    rule = k8s[("PrometheusRule", "monitoring/prometheusrule.yaml")]
    assert rule["spec"]["groups"] == load(DEPLOY / "alerts.yml")["groups"]


def _overlay_patches(name: str) -> list:
    kustomization = load(DEPLOY / "k8s" / "overlays" / name / "kustomization.yaml")
    assert kustomization["resources"] == ["../../base"]
    patches = []
    for patch in kustomization.get("patches", []):
        text = (
            patch.get("patch") or (DEPLOY / "k8s" / "overlays" / name / patch["path"]).read_text()
        )
        patches.append(yaml.safe_load(text))
    return patches


def _container(patch: dict) -> dict:
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_overlays() -> None:
    cpu, untolerated = _overlay_patches("cpu")
    env = {e["name"]: e["value"] for e in _container(cpu)["env"]}
    assert env["COLIWORKER_BACKEND"] == "numpy"
    assert _container(cpu)["resources"]["limits"] == {"nvidia.com/gpu": None}  # removed
    assert untolerated == [{"op": "remove", "path": "/spec/template/spec/tolerations"}]
    (multi,) = _overlay_patches("multi-gpu")
    env = {e["name"]: e["value"] for e in _container(multi)["env"]}
    gpus = _container(multi)["resources"]["limits"]["nvidia.com/gpu"]
    assert len(env["COLIWORKER_DEVICES"].split(",")) == gpus
    assert _container(multi)["resources"]["requests"]["nvidia.com/gpu"] == gpus
    (tls,) = _overlay_patches("tls")
    container = _container(tls)
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = container["volumeMounts"]
    assert env["COLIWORKER_TLS_CERT"] == f"{mount['mountPath']}/tls.crt"
    assert env["COLIWORKER_TLS_KEY"] == f"{mount['mountPath']}/tls.key"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"] is None, probe  # kubelet's gRPC probe has no TLS
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["coliworker", "health"]
        assert f"--ca={mount['mountPath']}/ca.crt" in command
    assert "--service=coliworker.v1.Worker" in container["readinessProbe"]["exec"]["command"]


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M)
    assert stages == ["builder", "cpu", "cuda"]  # cuda last: the default target
    assert re.search(r"^EXPOSE 50051 50052 9400$", text, re.M)  # gRPC, data plane, metrics
    assert text.count("USER 10001") == 2
    assert text.count("python -m coliworker.tools.health") == 2
    assert 'ENTRYPOINT ["coliworker", "serve"]' in text
    cpu_stage = text.split("AS cpu")[1].split("\nFROM")[0]
    cpu_stage = "\n".join(line for line in cpu_stage.splitlines() if not line.startswith("#"))
    cuda_stage = text.split("AS cuda")[1]
    assert "[gpu" not in cpu_stage and "cupy" not in cpu_stage.lower()
    assert '"coliworker[gpu] @ file://' in cuda_stage
    # The wheel built in the image is installed by path, never looked up by name.
    assert "pip wheel" in text and "--find-links" not in text
    assert "pip install --no-cache-dir /wheels/coliworker-" in cpu_stage
    ignore = (ROOT / ".dockerignore").read_text().split()
    package_dirs = re.findall(r'"coliworker\.\w+" = "(\w+)"', (ROOT / "pyproject.toml").read_text())
    for needed in ("!pyproject.toml", "!LICENSE", "!proto/", *(f"!{d}/" for d in package_dirs)):
        assert needed in ignore, needed
        if needed.endswith("/"):
            assert f"COPY {needed[1:]} {needed[1:]}" in text, needed
