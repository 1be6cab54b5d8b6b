"""Compile the ``kernels/*.cu`` files with CuPy (NVRTC) on first use, cached per device.

Each source file becomes one ``cupy.RawModule`` per device holding every template variant the
wrappers use (``name_expressions``), so a process pays one NVRTC compile per file (CuPy also
keeps the binary in its on-disk cache across processes). ``#include "x.cuh"`` lines are
inlined here so that CuPy's cache key, the source text, changes whenever a header does.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import cupy

KERNEL_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)

_lock = threading.Lock()
_modules: dict[tuple[int, str], cupy.RawModule] = {}
_functions: dict[tuple[int, str, str], cupy.RawKernel] = {}


def source(name: str) -> str:
    """The text of ``kernels/<name>`` with its local includes inlined (once each)."""
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (KERNEL_DIR / fname).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def get_function(file: str, name: str, variants: tuple[str, ...], shared_bytes: int = 0):
    """Kernel ``name`` (one of ``variants``) of ``kernels/<file>`` for the current device.

    ``shared_bytes`` raises the kernel's dynamic shared-memory limit when above the default
    48 KiB (Hopper allows up to 227 KiB per block once asked).
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
            fn.max_dynamic_shared_size_bytes = 160 * 1024
            _functions[key] = fn
    return fn
