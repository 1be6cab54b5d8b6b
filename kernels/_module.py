"""Compile the ``kernels/*.cu`` files with CuPy (NVRTC) on first use, cached per device.

Each source file becomes one ``cupy.RawModule`` per device holding every template variant the
wrappers use (``name_expressions``), so a process pays one NVRTC compile per file (CuPy also
keeps the binary in its on-disk cache across processes). ``#include "x.cuh"`` lines are
inlined (``sources.source``) so that CuPy's cache key, the source text, changes whenever a
header does.
"""

from __future__ import annotations

import threading

import cupy

from coliworker.kernels.sources import source

_lock = threading.Lock()
_modules: dict[tuple[int, str], cupy.RawModule] = {}
_functions: dict[tuple[int, str, str], cupy.RawKernel] = {}
_limits: dict[tuple[int, str, str], int] = {}  # each function's dynamic shared memory limit
#: The dynamic shared memory limit every kernel gets (more where get_function is asked).
DEFAULT_SHARED = 160 * 1024


def get_function(file: str, name: str, variants: tuple[str, ...], shared_bytes: int = 0):
    """Kernel ``name`` (one of ``variants``) of ``kernels/<file>`` for the current device.

    ``shared_bytes`` raises the kernel's dynamic shared-memory limit when above
    ``DEFAULT_SHARED`` (Hopper allows up to 227 KiB per block once asked; CUDA's own default is
    48 KiB).
    """
    dev = cupy.cuda.Device().id
    key = (dev, file, name)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            mod = _modules.get((dev, file))
            if mod is None:
                mod = cupy.RawModule(
                    code=source(file),
                    options=("-std=c++17",),
                    name_expressions=list(variants),
                )
                _modules[(dev, file)] = mod
            fn = mod.get_function(name)
            fn.max_dynamic_shared_size_bytes = _limits[key] = max(DEFAULT_SHARED, shared_bytes)
            _functions[key] = fn
    elif shared_bytes > _limits[key]:
        with _lock:
            if shared_bytes > _limits[key]:
                fn.max_dynamic_shared_size_bytes = _limits[key] = shared_bytes
    return fn
