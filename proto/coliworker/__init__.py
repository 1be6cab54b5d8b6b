"""coliworker: a remote GPU offload worker for CPU-first MoE inference engines.

The import root. ``coliworker.v1`` holds the generated wire contract,
``coliworker.server`` the worker, ``coliworker.client`` the Python client and
``coliworker.kernels`` the NumPy reference and the CUDA kernels.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
