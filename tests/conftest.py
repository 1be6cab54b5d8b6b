"""Shared fixtures: the backend under test, GPU detection, fresh random data.

GPU tests carry the ``gpu`` marker and are skipped here, with the reason, where no CUDA
device is usable; test bodies never skip themselves for that.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest


@functools.cache
def gpu_unusable_reason() -> str | None:
    """None when CuPy can run a kernel on device 0, else why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
        (cupy.arange(4) + 1).sum().item()
    except Exception as exc:
        return f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_unusable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    """Each backend by name; the cupy one only where a GPU is usable."""
    return str(request.param)


@pytest.fixture
def backend(backend_name: str):
    """A fresh backend instance serving device 0 (and a second virtual device for NumPy)."""
    from coliworker.server.backends import create_backend

    devices = (0, 1) if backend_name == "numpy" else (0,)
    b = create_backend(backend_name, devices=devices)
    yield b
    b.close()


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random data every run; the seed is printed on failure to reproduce it."""
    seed = int(os.environ.get("COLIWORKER_TEST_SEED", "0")) or int.from_bytes(
        os.urandom(4), "little"
    )
    print(f"random seed: {seed} (set COLIWORKER_TEST_SEED={seed} to reproduce)")
    return np.random.default_rng(seed)
