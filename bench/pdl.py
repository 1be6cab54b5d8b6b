"""What a kernel boundary inside a call's CUDA graph costs, and how much of it programmatic
dependent launch (PDL) takes back, with plain streaming kernels shaped like the decode calls.

A decode call's graph is a chain: the inputs' copy kernel, one to five weight-streaming
kernels, the outputs' copy kernel (``server/cupy_calls.py``). Each kernel must wait for the one
before, but its weights never depend on it. Under PDL (``cuLaunchKernelEx`` with
programmatic stream serialization, captured into a programmatic graph edge) a kernel's blocks
may start before the one ahead has finished: they issue what does not depend on it (here the
first weight loads), then ``griddepcontrol.wait`` until it has finished and flushed.

Chains (bytes each kernel streams): ``expert`` copy in, 150 MB, copy out (decode 8x1);
``dense`` copy in, 19 MB, copy out; ``mla`` copy in, 2, 9.4, 1, 2 and 50 MB, copy out (the
ragged attention's absorb, flash, merge, value and o_proj). Each kernel folds in a value the
one before wrote, so the ordering is real. Variants: ``plain`` (no attribute; the waits are
no-ops), ``pdl`` (attribute, implicit trigger at each block's end), ``pdl+trigger`` (each
kernel triggers its dependents once it has passed its own wait), ``pdl+trigger+early`` (and
issues its first four loads per thread before the wait). Each variant: one graph, replayed
``--calls`` times behind a spin kernel, GPU us between events around the replay (median,
min); "sum of singles" is the chain's kernels each in a graph alone, summed.

    PYTHONPATH=.dev python bench/pdl.py [--calls 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import numpy as np

from bench.gpu_timing import SPIN_NS, spin_kernel

_SRC = r"""
__device__ __forceinline__ void dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void dep_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

extern "C" __global__ void pdl_copy(uint4 *dst, const uint4 *src, long long n16, int trig) {
    dep_wait();
    if (trig) dep_launch();
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += step)
        dst[i] = src[i];
    __threadfence_system();
}

extern "C" __global__ void __launch_bounds__(512)
pdl_read(const uint4 *__restrict__ w, unsigned long long n16, const unsigned *x, unsigned *y,
         int early, int trig) {
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 a = make_uint4(0, 0, 0, 0), b = a, c = a, d = a;
    const bool pre = early && i + 3 * step < n16;
    if (pre) {
        a = __ldcs(w + i); b = __ldcs(w + i + step);
        c = __ldcs(w + i + 2 * step); d = __ldcs(w + i + 3 * step);
    }
    dep_wait();
    if (trig) dep_launch();
    unsigned acc = x[threadIdx.x & 63];
    if (pre) {
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y
               ^ d.z ^ d.w;
        i += 4 * step;
    }
    for (; i + 3 * step < n16; i += 4 * step) {
        a = __ldcs(w + i); b = __ldcs(w + i + step);
        c = __ldcs(w + i + 2 * step); d = __ldcs(w + i + 3 * step);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y
               ^ d.z ^ d.w;
    }
    for (; i < n16; i += step) {
        a = __ldcs(w + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (threadIdx.x < 64) atomicXor(y + threadIdx.x, acc);
}
"""

CHAINS: dict[str, tuple[int, list[float], int]] = {
    "expert": (24576, [150e6], 24576),
    "dense": (24576, [19e6], 24576),
    "mla": (98304, [2.1e6, 9.4e6, 1.0e6, 2.1e6, 50e6], 24576),
}
VARIANTS = {  # (pdl attribute, trigger, early loads)
    "plain": (False, 0, 0),
    "pdl": (True, 0, 0),
    "pdl+trigger": (True, 1, 0),
    "pdl+trigger+early": (True, 1, 1),
}


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]  # fmt: skip


_U64, _I64, _I32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


class Bench:
    """The kernels, a stream and cuLaunchKernelEx; ``chain`` measures one chain."""

    def __init__(self, calls: int) -> None:
        import cupy

        from coliworker.kernels.launch import LaunchConfig  # CUlaunchConfig (imports CuPy)

        self.config = LaunchConfig
        self.cupy, self.calls = cupy, calls
        lx = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        lx.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        lx.restype = ctypes.c_int
        self.lx = lx
        mod = cupy.RawModule(code=_SRC, options=("-std=c++17",))
        self.kcopy, self.kread = mod.get_function("pdl_copy"), mod.get_function("pdl_read")
        self.sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.attr = _Attr(6, b"", 1, b"")  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self.keep: list = []
        self.spin = spin_kernel()
        self.ev = (cupy.cuda.Event(), cupy.cuda.Event())

    def launch(self, fn, grid: int, block: int, args: list, pdl: bool) -> None:
        vals = [t(v) for t, v in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        self.keep.extend([vals, params])
        cfg = self.config((grid, 1, 1), (block, 1, 1), 0, self.stream.ptr,
                      ctypes.addressof(self.attr) if pdl else None, 1 if pdl else 0)  # fmt: skip
        err = self.lx(ctypes.byref(cfg), ctypes.c_void_p(fn.kernel.ptr), params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx: CUDA error {err}")

    def issue(self, steps: list, variant: str) -> None:
        pdl, trig, early = VARIANTS[variant]
        for n, s in enumerate(steps):
            dep = pdl and n > 0
            if s[0] == "copy":
                _, dst, src, nb = s
                blocks = max(1, min(64, -(-nb // 16 // 256)))
                args = [(_U64, dst), (_U64, src), (_I64, nb // 16), (_I32, trig)]
                self.launch(self.kcopy, blocks, 256, args, dep)
            else:
                _, w, n16, src, y = s
                self.launch(self.kread, 4 * self.sms, 512,
                            [(_U64, w), (_U64, n16), (_U64, src), (_U64, y), (_I32, early),
                             (_I32, trig)], dep)  # fmt: skip

    def graph(self, steps: list, variant: str) -> int:
        rt = self.cupy.cuda.runtime
        rt.streamBeginCapture(self.stream.ptr, 2)
        try:
            self.issue(steps, variant)
        finally:
            g = rt.streamEndCapture(self.stream.ptr)
        ex = rt.graphInstantiate(g)
        rt.graphDestroy(g)
        return ex

    def time_graph(self, ex: int) -> tuple[float, float]:
        cupy, rt = self.cupy, self.cupy.cuda.runtime
        ev0, ev1 = self.ev
        us = []
        for k in range(self.calls + 10):
            with self.stream:
                self.spin((1,), (1,), (np.uint64(SPIN_NS),))
            ev0.record(self.stream)
            rt.graphLaunch(ex, self.stream.ptr)
            ev1.record(self.stream)
            ev1.synchronize()
            if k >= 10:
                us.append(cupy.cuda.get_elapsed_time(ev0, ev1) * 1e3)
        return float(np.median(us)), float(np.min(us))

    def chain(self, name: str, nin: int, sizes: list[float], nout: int) -> dict:
        import cupyx

        cupy, rt = self.cupy, self.cupy.cuda.runtime
        host_in = cupyx.empty_pinned((nin // 4,), np.uint32)
        host_in[:] = np.arange(host_in.size, dtype=np.uint32)
        host_out = cupyx.empty_pinned((nout // 4,), np.uint32)
        dev_in = cupy.zeros(nin // 4, cupy.uint32)
        ws = [cupy.ones(int(s) // 16 * 4, cupy.uint32) for s in sizes]
        ys = [cupy.zeros(max(64, nout // 4), cupy.uint32) for _ in sizes]
        steps: list[tuple] = [("copy", dev_in.data.ptr, host_in.ctypes.data, nin)]
        prev = dev_in.data.ptr
        for w, y in zip(ws, ys, strict=True):
            steps.append(("read", w.data.ptr, w.nbytes // 16, prev, y.data.ptr))
            prev = y.data.ptr
        steps.append(("copy", host_out.ctypes.data, prev, nout))
        singles = [self.graph([s], "plain") for s in steps]
        single_sum = sum(self.time_graph(ex)[0] for ex in singles)
        got = {}
        # plain and the fullest PDL form once more at the end, so that drift shows
        for v in (*VARIANTS, "plain", "pdl+trigger+early"):
            ex = self.graph(steps, v)
            got[v if v not in got else v + " (again)"] = self.time_graph(ex)
            rt.graphExecDestroy(ex)
        for ex in singles:
            rt.graphExecDestroy(ex)
        floor = sum(sizes) / 4.48e12 * 1e6
        print(f"== {name}: {len(steps)} kernels, {sum(sizes) / 1e6:.1f} MB (floor {floor:.1f} "
              f"us), sum of singles {single_sum:.1f} us", flush=True)  # fmt: skip
        for k, (m, n) in got.items():
            print(f"  {k:26s} median {m:7.1f} us  min {n:7.1f} us", flush=True)
        variants = {k: dict(median_us=m, min_us=n) for k, (m, n) in got.items()}
        return dict(chain=name, mbytes=sum(sizes) / 1e6, kernels=len(steps), floor_us=floor,
                    sum_of_singles_us=single_sum, variants=variants)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    b = Bench(a.calls)
    rows = [b.chain(name, *spec) for name, spec in CHAINS.items()]
    gpu = b.cupy.cuda.runtime.getDeviceProperties(0)["name"]
    gpu = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = dict(gpu=gpu, date=time.strftime("%Y-%m-%d"), calls=a.calls,
                    commit=os.environ.get("COLIWORKER_COMMIT", "unknown"),
                    command=f"PYTHONPATH=.dev python bench/pdl.py --calls {a.calls}")  # fmt: skip
        with open(os.path.join(a.out, "pdl.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
