"""How the compiled kept decode calls (``server/kept.c``) are built and loaded
(``server/kept.py``), on any machine: the build keyed and reused, a failing compiler reported
with its command, the switch, and the Python kept calls taking over where the module cannot be
had. What the compiled calls write is ``tests/kernels/test_arena_writes_cpu.py``'s and
``test_kept_calls_cpu.py``'s (each run both ways)."""

from __future__ import annotations

import logging
import os

import pytest

from coliworker.server import kept


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty build cache, and the module not yet tried in this process."""
    monkeypatch.setenv("COLIWORKER_KEPT_CACHE", str(tmp_path))
    monkeypatch.setattr(kept, "_built", [])
    return tmp_path


def test_a_failing_compiler_is_reported_with_its_command(fresh, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match=r"false .*kept\.c .*failed") as err:
        kept.build()
    assert os.listdir(fresh) == []  # no half-built module left behind
    assert not kept.unbuildable(err.value) or "no Python.h" in str(err.value)


def test_a_missing_compiler_is_told_apart_from_a_compile_error(fresh, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(RuntimeError, match="cannot run the compiler") as err:
        kept.build()
    assert kept.unbuildable(err.value)


def test_where_it_cannot_be_built_the_python_runs_the_calls(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(kept, "ENABLED", True)
    with caplog.at_level(logging.WARNING, logger="coliworker.server.kept"):
        assert kept.module() is None
        assert kept.twins() is None
        assert kept.module() is None  # tried once per process
    (rec,) = caplog.records
    assert "the Python runs them" in rec.getMessage()


def test_switched_off_nothing_is_built(fresh, monkeypatch):
    monkeypatch.setattr(kept, "ENABLED", False)
    assert kept.twins() is None
    assert os.listdir(fresh) == []


def test_a_build_is_kept_and_loads(fresh):
    try:
        path = kept.build()
    except RuntimeError as exc:  # a compile error fails here; missing tools skip
        if not kept.unbuildable(exc):
            raise
        pytest.skip(f"server/kept.c cannot be built here: {str(exc)[:300]}")
    assert os.path.dirname(path) == str(fresh)
    mtime = os.stat(path).st_mtime_ns
    assert kept.build() == path and os.stat(path).st_mtime_ns == mtime  # not built again
    mod = kept.load(path)
    for name in ("setup", "routed", "group", "ragged", "matmul", "rerun"):
        assert callable(getattr(mod, name)), name
    with pytest.raises(KeyError, match="missing"):
        mod.setup({})
    with pytest.raises(TypeError, match=r"kept\.routed\("):
        mod.routed(1, 2)
