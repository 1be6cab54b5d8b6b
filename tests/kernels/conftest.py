"""Fixtures of the kernel tests: the CuPy backend, the kernel paths switched off, and the
kernels' pure host functions on a machine without CuPy."""

from __future__ import annotations

import importlib
import sys
import types

import pytest


@pytest.fixture
def cupy_backend():
    from coliworker.server.backend_cupy import CupyBackend

    b = CupyBackend((0,))
    yield b
    b.close()


@pytest.fixture
def no_tensor_cores():
    from coliworker.kernels import matmul

    matmul.TENSOR_CORES = False
    yield
    matmul.TENSOR_CORES = True


@pytest.fixture
def host_module(monkeypatch):
    """``load(name)``: ``coliworker.kernels.<name>`` for its pure host functions, importable
    where CuPy is absent (a stand-in module for the import; the kernel modules imported
    through it are dropped afterwards)."""
    before = set(sys.modules)
    try:
        import cupy  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    yield lambda name: importlib.import_module(f"coliworker.kernels.{name}")
    for name in set(sys.modules) - before:
        if name.startswith("coliworker.kernels"):
            del sys.modules[name]
