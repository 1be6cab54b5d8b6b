"""Compute kernels: the NumPy reference (the oracle) and the CUDA kernels with thin CuPy wrappers.

Every operation has one name in four places: ``kernels/<op>.cu``, the wrapper in
``kernels/<op>.py``, the reference in ``kernels/reference.py`` and ``tests/kernels/test_<op>.py``.
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
