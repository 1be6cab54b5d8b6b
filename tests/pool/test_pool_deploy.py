"""The pool's deployment files agree with each other and with the worker: the StatefulSet
names the headless Service, ports match, the PodDisruptionBudget selects the members; the
compose pool profile gives each member its own ports, the same inside and out (a client
reaches the data plane at the port the worker reports)."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
POOL = DEPLOY / "k8s" / "overlays" / "pool"


def load(name: str) -> dict:
    return yaml.safe_load((POOL / name).read_text())


def test_statefulset_headless_service_and_pdb() -> None:
    sts, svc, pdb = load("statefulset.yaml"), load("service.yaml"), load("pdb.yaml")
    kustomization = load("kustomization.yaml")
    assert sorted(kustomization["resources"]) == ["pdb.yaml", "service.yaml", "statefulset.yaml"]
    assert sts["kind"] == "StatefulSet" and svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"grpc": 50051, "data": 50052, "metrics": 9400}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["COLIWORKER_PORT"] == "50051" and env["COLIWORKER_DATA_PORT"] == "50052"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {p["grpc"]["port"] for p in (worker["readinessProbe"], worker["livenessProbe"])} == {
        50051
    }


def test_compose_pool_profile_members_own_their_ports() -> None:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    pool = {n: s for n, s in services.items() if "pool" in s.get("profiles", [])}
    assert sorted(pool) == ["pool-0", "pool-1"]
    seen: set[str] = set()
    for name, s in pool.items():
        env = s["environment"]
        inside = {
            env["COLIWORKER_PORT"],
            env["COLIWORKER_DATA_PORT"],
            env["COLIWORKER_METRICS_PORT"],
        }
        published = {p.split(":")[1] for p in s["ports"]}
        assert all(p.startswith("127.0.0.1:") for p in s["ports"])
        assert {p.split(":")[2] for p in s["ports"]} == inside == published, name
        assert not seen & published
        seen |= published
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and len(device["device_ids"]) == 1
