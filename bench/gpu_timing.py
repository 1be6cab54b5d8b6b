"""What the single-kernel GPU benches share (``gemv_splitk.py``, ``moe_tc.py``): the H200's
measured read rate and L2 size, random quantized tensors, the row-wise error against a
reference, and the timing of one launch between CUDA events with a spin kernel ahead of it
(the GPU busy, so the launch's own host cost does not show).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

READ_BW = 4.48e12  # measured streaming read of the H200, bytes/s
L2 = 60e6
SPIN_NS = 30_000  # the spin kernel ahead of each timed launch

_SPIN = r"""
extern "C" __global__ void coli_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


# The machine's limit at a kernel's own size: a plain streaming read of the same bytes in one
# launch (16-byte loads, four in flight per thread, 4 blocks of 512 per SM), timed as the kernel
# is. The buffers (each a multiple of 16 bytes) are read one after another, each by the whole
# grid: ptrs[j] and n16[j] (its 16-byte words) for j < nbuf.
_READ = r"""
extern "C" __global__ void __launch_bounds__(512)
coli_read(const unsigned long long *__restrict__ ptrs, const unsigned long long *__restrict__ n16s,
          int nbuf, unsigned int *sink) {
    unsigned int acc = 0;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (int j = 0; j < nbuf; ++j) {
        const uint4 *__restrict__ p = reinterpret_cast<const uint4 *>(ptrs[j]);
        const unsigned long long n16 = n16s[j];
        unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + 3 * step < n16; i += 4 * step) {
            const uint4 a = __ldcs(p + i), b = __ldcs(p + i + step);
            const uint4 c = __ldcs(p + i + 2 * step), d = __ldcs(p + i + 3 * step);
            acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x
                   ^ d.y ^ d.z ^ d.w;
        }
        for (; i < n16; i += step) {
            const uint4 a = __ldcs(p + i);
            acc ^= a.x ^ a.y ^ a.z ^ a.w;
        }
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // never in practice; keeps the loads
}
"""


def read_launcher(bufs: list, sm_count: int = 132):
    """``launch(k)``: one streaming read of all of ``bufs[k % len(bufs)]`` (a list of CuPy
    arrays, each read whole, each a multiple of 16 bytes) in one launch, for ``time_launch``."""
    import cupy

    kern = cupy.RawKernel(_READ, "coli_read")
    sink = cupy.zeros(1, cupy.uint32)
    tables = [
        (
            cupy.asarray(np.array([a.data.ptr for a in bs], np.uint64)),
            cupy.asarray(np.array([a.nbytes // 16 for a in bs], np.uint64)),
            np.int32(len(bs)),
        )
        for bs in bufs
    ]

    def launch(k: int) -> None:
        ptrs, n16s, n = tables[k % len(tables)]
        kern((4 * sm_count,), (512,), (ptrs, n16s, n, sink))

    return launch


def spin_kernel():
    """A one-thread kernel that runs ``SPIN_NS`` ns (CuPy, compiled on first use)."""
    import cupy

    return cupy.RawKernel(_SPIN, "coli_spin")


def make_tensor(rng, fmt, o, i, gs):
    """A random quantized tensor [o, i] of format ``fmt`` (group size ``gs``)."""
    from coliworker.kernels.qtensor import QTensor, row_bytes, scale_count

    w = rng.integers(0, 256, size=o * row_bytes(fmt, i), dtype=np.uint8)
    s = (rng.random(scale_count(fmt, i, o, gs)) * 0.02 + 0.001).astype(np.float32)
    return QTensor(fmt, i, o, gs, w, s)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    """Max over rows (the last axis's) of max|y - ref| / max|ref|."""
    num = np.abs(y - ref).max(axis=-1)
    den = np.maximum(np.abs(ref).max(axis=-1), 1e-30)
    return float(np.nan_to_num(num / den, nan=np.inf).max())


def time_launch(
    launch: Callable[[int], None],
    spin,
    iters: int,
    warmup: int,
    before: Callable[[int], None] | None = None,
) -> dict:
    """Median, min and p90 us of ``launch(k)`` between two events, ``warmup`` + ``iters``
    times, each behind the spin kernel; ``before(k)`` runs first, outside the timing."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    arg = (np.uint64(SPIN_NS),)
    ms = []
    for k in range(warmup + iters):
        if before is not None:
            before(k)
        spin((1,), (1,), arg)
        start.record()
        launch(k)
        stop.record()
        stop.synchronize()
        if k >= warmup:
            ms.append(cupy.cuda.get_elapsed_time(start, stop))
    us = np.array(ms) * 1e3
    return dict(
        median_us=float(np.median(us)),
        min_us=float(us.min()),
        p90_us=float(np.percentile(us, 90)),
    )


def us(p: dict) -> str:
    """A path's median us for a table ("error" where it failed)."""
    return "error" if "error" in p else f"{p['median_us']:.1f}"
