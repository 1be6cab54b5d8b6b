"""Compute kernels: the NumPy reference (the oracle) and the CUDA kernels with thin CuPy wrappers.

Every operation has one name in its host side ``kernels/<op>.py`` (plan, job tables, arena
layout, launches: ``matmul``, ``expert_group``, ``attention``), the reference in
``kernels/reference.py`` and ``tests/kernels/test_<op>.py``; its kernels are the ``.cu`` files
the host side names. The records the host writes for the kernels are defined once in
``kernels/records.py``; CUDA graph replay of a call's device work is ``kernels/graphs.py``.
"""

from coliworker.kernels.qtensor import (
    FORMAT_NAMES,
    MAX_FORMAT,
    QTensor,
    row_bytes,
    scale_count,
    scale_shape,
)

__all__ = ["FORMAT_NAMES", "MAX_FORMAT", "QTensor", "row_bytes", "scale_count", "scale_shape"]
