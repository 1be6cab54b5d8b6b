"""Fixtures of the kernel tests: the CuPy backend, and the kernel paths switched off."""

from __future__ import annotations

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
