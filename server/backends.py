"""The explicit table of backends, and ``auto`` selection at startup."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from coliworker.server.backend import Backend

log = logging.getLogger(__name__)

# name -> "module:class"; imported only when chosen, so NumPy-only hosts never import CuPy.
BACKENDS: dict[str, str] = {
    "numpy": "coliworker.server.backend_numpy:NumpyBackend",
    "cupy": "coliworker.server.backend_cupy:CupyBackend",
}


def gpu_available() -> str | None:
    """None when CuPy sees at least one usable CUDA device, else the reason it does not."""
    try:
        import cupy
    except Exception as exc:
        return f"CuPy is not importable: {exc}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:
        return f"CUDA is not usable: {exc}"
    return None


def resolve_backend_name(name: str) -> str:
    """Map ``auto`` to ``cupy`` when a GPU is usable, else ``numpy`` (and log which and why)."""
    if name != "auto":
        if name not in BACKENDS:
            valid = ", ".join(["auto", *BACKENDS])
            raise ValueError(f"backend: expected one of {valid}, got {name!r}")
        return name
    reason = gpu_available()
    if reason is None:
        log.info("backend auto: a CUDA device is usable, using cupy")
        return "cupy"
    log.info("backend auto: %s; using numpy", reason)
    return "numpy"


def create_backend(name: str, *, devices: Sequence[int] = (0,)) -> Backend:
    """Instantiate backend ``name`` (``auto`` allowed) serving ``devices``."""
    resolved = resolve_backend_name(name)
    module_name, _, class_name = BACKENDS[resolved].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: Backend = cls(devices=tuple(devices))
    return backend
