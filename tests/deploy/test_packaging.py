"""The package metadata agrees with what ships: the protobuf and grpcio ranges are the ones
the committed stubs accept, and the license is the one declared."""

from __future__ import annotations

import re
import sys

import pytest
from promql_names import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

STUBS = ROOT / "proto" / "coliworker" / "v1"


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def lower_bound(project: dict, name: str) -> tuple[int, ...]:
    (spec,) = [d for d in project["dependencies"] if re.match(rf"{name}\s*[<>=]", d)]
    m = re.search(r">=\s*([\d.]+)", spec)
    assert m, spec
    return tuple(int(p) for p in m.group(1).split("."))


def gencode_version() -> tuple[int, int, int]:
    """The protobuf version the committed worker_pb2.py was generated for (its guard)."""
    text = (STUBS / "worker_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", text)
    assert m, "worker_pb2.py has no runtime version guard"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def test_protobuf_lower_bound_is_the_stubs_gencode(project) -> None:
    assert lower_bound(project, "protobuf") == gencode_version()


def test_the_stub_guard_accepts_exactly_the_lower_bound(monkeypatch) -> None:
    """The lowest protobuf runtime the stubs accept, checked by their own guard (installing
    that protobuf into a venv is too slow for CI): the bound passes, one patch below fails."""
    from google.protobuf import runtime_version as rv

    major, minor, patch = gencode_version()
    domain = rv.Domain.PUBLIC
    for runtime, ok in (((major, minor, patch), True), ((major, minor, patch - 1), False)):
        monkeypatch.setattr(rv, "MAJOR", runtime[0])
        monkeypatch.setattr(rv, "MINOR", runtime[1])
        monkeypatch.setattr(rv, "PATCH", runtime[2])
        check = lambda: rv.ValidateProtobufRuntimeVersion(  # noqa: E731
            domain, major, minor, patch, "", "coliworker/v1/worker.proto"
        )
        if ok:
            check()
        else:
            with pytest.raises(rv.VersionError):
                check()


def test_grpcio_lower_bound_is_the_stubs_grpc_version(project) -> None:
    text = (STUBS / "worker_pb2_grpc.py").read_text()
    (generated,) = re.findall(r"GRPC_GENERATED_VERSION = '([\d.]+)'", text)
    assert lower_bound(project, "grpcio") == tuple(int(p) for p in generated.split("."))[:2]


def test_health_and_reflection_are_base_dependencies(project) -> None:
    names = {re.split(r"[<>=\[ ;]", d)[0] for d in project["dependencies"]}
    assert {"grpcio-health-checking", "grpcio-reflection"} <= names


def test_license(project) -> None:
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    manifest = (ROOT / "MANIFEST.in").read_text().split()
    for folder in ("tests", "examples", "deploy", "docs"):
        assert folder in manifest, folder
