"""The CUDA sources of ``kernels/`` as they are compiled: a file with its local
``#include "x.cuh"`` lines replaced by the headers' text (once each). No CuPy: the CPU tests
read the kernels' source through here too (``tests/kernels/test_*_cpu.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


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
