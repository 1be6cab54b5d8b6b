"""An array decoded from outside its message (a shared-memory segment's view) keeps that
memory mapped for as long as the array lives: the segment's unmap waits for it
(``Segment.close`` catches the BufferError), so a call computing on it while its session
ends reads valid memory. An array that held only a pointer would be read after the unmap:
the worker dies of SIGSEGV (seen with ``np.ndarray(shape, dtype, buffer=view)``, whose base
is the mmap object itself, not an export of it)."""

from __future__ import annotations

import mmap
import subprocess
import sys

import numpy as np
import pytest

from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec


@pytest.mark.parametrize("dtype", [pb.DTYPE_FLOAT32, pb.DTYPE_INT32, pb.DTYPE_UINT8])
def test_a_decoded_view_holds_its_mapping(dtype):
    rng = np.random.default_rng()
    n = int(rng.integers(4, 64))
    mm = mmap.mmap(-1, 1 << 16)
    want = rng.standard_normal(n).astype(np.float32).view(np.uint8)
    mm[128 : 128 + want.size] = want.tobytes()
    msg = pb.Array(dtype=dtype, shape=[want.size // codec._NUMPY_OF[dtype].itemsize])
    a = codec.decode(
        msg, "x", float_only=False, source=lambda m: memoryview(mm)[128 : 128 + want.size]
    )
    with pytest.raises(BufferError):
        mm.close()  # the array's memory stays mapped while it lives
    assert np.array_equal(a.view(np.uint8), want)
    del a
    mm.close()  # then it goes


_CLOSED_UNDER = """
import numpy as np
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec
from coliworker.wire.shm import Segment

x = np.random.default_rng().standard_normal((3, 5)).astype(np.float32)
seg = Segment.create(1 << 16)
seg.write(4096, x.tobytes())
msg = pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[3, 5])
a = codec.decode(msg, "x", source=lambda m: seg.view(4096, x.nbytes, "x"))
seg.close()  # the session ended while a call still computes on a
assert np.array_equal(a, x)
"""


def test_a_segment_closed_under_a_decoded_view_stays_readable():
    """In a subprocess: a regression is a SIGSEGV, which must fail this test, not kill pytest."""
    p = subprocess.run([sys.executable, "-c", _CLOSED_UNDER], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, f"exit {p.returncode} (-11: SIGSEGV)\n{p.stderr[-2000:]}"
