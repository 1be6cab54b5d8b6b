"""What one CUDA graph launch costs from Python on this machine, by what the graph holds.

The CuPy backend replays each call's device work as a graph (kernels/graphs.py): the
copies between the arena's pinned and device halves, the kernels, and four timing events (or,
where both copies are copy kernels that stamp the phases, one event after all).
This bench takes that apart with a trivial kernel (so the GPU time is near zero): the host
time of ``cudaGraphLaunch`` alone and of launch + wait, for graphs of a kernel alone, with
the event-record nodes, with the two copies (copy engine, or the copy kernel of
``kernels/copy.py``), with both, with five kernels, and the same work issued directly
(runtime calls one by one), medians of ``--calls``.

    PYTHONPATH=.dev python bench/graph_launch.py [--calls 2000] [--bytes 24576]

Prints a table; writes nothing (a diagnostic beside bench/host_profile.py).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=24576, help="bytes each copy moves")
    a = p.parse_args()
    import cupy
    import cupyx

    rt = cupy.cuda.runtime
    lib = ctypes.CDLL("libcuda.so.1")
    rec = lib.cuEventRecordWithFlags
    rec.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
    s = cupy.cuda.Stream(non_blocking=True)
    sp = s.ptr
    dev = cupy.zeros(a.bytes // 4, cupy.float32)
    host = cupyx.empty_pinned((a.bytes // 4,), np.float32)
    ev = [cupy.cuda.Event() for _ in range(4)]
    host[:] = np.arange(host.size, dtype=np.float32)
    k = cupy.RawKernel(
        'extern "C" __global__ void inc(float *x) { if (threadIdx.x == 0) x[0] += 1.f; }', "inc"
    )
    n = a.bytes

    def kern(times: int = 1) -> None:
        for _ in range(times):
            k((1,), (32,), (dev,))

    def mark(i: int, capturing: bool) -> None:
        if capturing:
            rec(ev[i].ptr, sp, 1)
        else:
            rt.eventRecord(ev[i].ptr, sp)

    from coliworker.kernels.copy import copy_launch

    copy_k = copy_launch(n)
    hp, dp = np.uint64(host.ctypes.data), np.uint64(dev.data.ptr)
    none = (np.uint64(0), np.uint64(0))  # a copy kernel's stamp arguments: none
    # stamped copies (server/cupy_calls.py's decode calls): two CopyStamp records, their out
    stamp_dev = cupy.asarray(np.array([np.iinfo(np.uint64).max, 0, 0] * 2, np.uint64))
    stamp_out = cupyx.empty_pinned((4,), np.uint64)
    up = (np.uint64(stamp_dev.data.ptr), np.uint64(stamp_out.ctypes.data))
    down = (np.uint64(stamp_dev.data.ptr + 24), np.uint64(stamp_out.ctypes.data + 16))

    def work(events: int, copies: str, kernels: int, capturing: bool) -> None:
        """events: 4 (the phases framed by events) or 1 (one after all: stamped copies)."""
        if events == 4:
            mark(0, capturing)
        if copies == "engine":
            rt.memcpyAsync(dev.data.ptr, host.ctypes.data, n, 1, sp)
        elif copies:
            copy_k(dp, hp, *(up if copies == "stamped" else none))
        if events == 4:
            mark(1, capturing)
        kern(kernels)
        if events == 4:
            mark(2, capturing)
        if copies == "engine":
            rt.memcpyAsync(host.ctypes.data, dev.data.ptr, n, 2, sp)
        elif copies:
            copy_k(hp, dp, *(down if copies == "stamped" else none))
        if events:
            mark(3, capturing)

    variants = [
        ("kernel", 0, "", 1),
        ("kernel + 4 events", 4, "", 1),
        ("kernel + 2 copies", 0, "engine", 1),
        ("kernel + 2 copies + 4 events (a call, copy engine)", 4, "engine", 1),
        ("5 kernels + 2 copies + 4 events (attention, copy engine)", 4, "engine", 5),
        ("kernel + 2 copy kernels", 0, "kernel", 1),
        ("kernel + 2 copy kernels + 4 events (a call, before)", 4, "kernel", 1),
        ("5 kernels + 2 copy kernels + 4 events (attention, before)", 4, "kernel", 5),
        ("kernel + 2 stamped copy kernels + 1 event (a call, now)", 1, "stamped", 1),
        ("5 kernels + 2 stamped copy kernels + 1 event (attention, now)", 1, "stamped", 5),
    ]
    rows = []
    with s:
        kern()
        s.synchronize()
        for name, events, copies, kernels in variants:
            rt.streamBeginCapture(sp, 2)
            work(events, copies, kernels, True)
            g = rt.streamEndCapture(sp)
            ex = rt.graphInstantiate(g)
            for _ in range(50):
                rt.graphLaunch(ex, sp)
            s.synchronize()
            launch, total = [], []
            for _ in range(a.calls):
                t0 = time.perf_counter_ns()
                rt.graphLaunch(ex, sp)
                t1 = time.perf_counter_ns()
                s.synchronize()
                t2 = time.perf_counter_ns()
                launch.append(t1 - t0)
                total.append(t2 - t0)
            direct_issue, direct_total = [], []
            for _ in range(a.calls):
                t0 = time.perf_counter_ns()
                work(events, copies, kernels, False)
                t1 = time.perf_counter_ns()
                s.synchronize()
                t2 = time.perf_counter_ns()
                direct_issue.append(t1 - t0)
                direct_total.append(t2 - t0)
            rt.graphExecDestroy(ex)
            rt.graphDestroy(g)
            rows.append(
                (
                    name,
                    *(
                        float(np.median(v)) / 1e3
                        for v in (launch, total, direct_issue, direct_total)
                    ),
                )  # fmt: skip
            )
    back = host.copy()
    host[:] = 0
    copy_k(hp, dp, *none)
    s.synchronize()
    assert np.array_equal(host, cupy.asnumpy(dev)), "copy kernel: device -> host differs"
    del back
    print(f"copies of {n} bytes, medians of {a.calls}, us")
    print("| graph holds | graphLaunch | launch + wait | direct issue | direct issue + wait |")
    print("|---|---|---|---|---|")
    for name, gl, gt, di, dt in rows:
        print(f"| {name} | {gl:.1f} | {gt:.1f} | {di:.1f} | {dt:.1f} |")


if __name__ == "__main__":
    main()
