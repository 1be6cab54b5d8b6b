"""The element types a result may be returned in (``output_dtype``).

Results are float32 from every backend; a client may ask for them as float16 or bfloat16
(half the bytes). Integer types are refused: converting a float result to INT32 or UINT8
silently wraps or truncates (-6.77 would come back as 250), and a value outside the enum
is a client error, not an internal one. Checked where each response is encoded.
"""

from __future__ import annotations

from coliworker.server.errors import InvalidArgument
from coliworker.v1 import worker_pb2 as pb

#: DType values a result may be encoded in, by name (UNSPECIFIED: the input's type).
RESULT_DTYPES = {
    pb.DTYPE_FLOAT32: "FLOAT32",
    pb.DTYPE_FLOAT16: "FLOAT16",
    pb.DTYPE_BFLOAT16: "BFLOAT16",
}


def output_dtype(value: int, fallback: int = 0, field: str = "output_dtype") -> int:
    """``value`` checked as a result type, or ``fallback`` (the input's type) when it is
    UNSPECIFIED; raises InvalidArgument naming ``field`` and both values otherwise."""
    chosen = value or fallback
    if chosen not in RESULT_DTYPES:
        names = ", ".join(f"{n} ({v})" for v, n in RESULT_DTYPES.items())
        what = pb.DType.Name(chosen) if chosen in pb.DType.values() else "not a DType"
        raise InvalidArgument(
            f"{field}: expected UNSPECIFIED (0) or a float result type, {names}; got "
            f"{chosen} ({what})"
        )
    return chosen


__all__ = ["RESULT_DTYPES", "output_dtype"]
