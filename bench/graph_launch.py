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
    PYTHONPATH=.dev python bench/graph_launch.py --copies [--calls 500] [--out DIR]

``--copies`` instead sweeps one copy alone in a graph (launch + wait, and its span on the GPU
from the copy kernel's stamps), host -> device and back, over sizes from a decode call's 24 KB
to the 1 MiB limit of ``kernels/copy.py``: the copy engine against the copy kernel at its
block count (``copy.blocks``) and at fixed counts, each checked to the byte. With ``--out``
it writes the table and JSON there (``harness``).

Prints a table; writes nothing else (a diagnostic beside bench/host_profile.py).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np


def _captured(rt, s, issue, warm: int) -> tuple[int, int]:
    """``issue()``'s work on stream ``s`` captured as a graph: (graph, its exec), launched
    ``warm`` times and waited for."""
    rt.streamBeginCapture(s.ptr, 2)
    issue()
    g = rt.streamEndCapture(s.ptr)
    ex = rt.graphInstantiate(g)
    for _ in range(warm):
        rt.graphLaunch(ex, s.ptr)
    s.synchronize()
    return g, ex


def _wait_rows(rt, s, capture, event: int, stamp_out, dev, host, calls: int) -> list[tuple]:
    """A stamped call's graph (``capture(kernels, events)`` on stream ``s``: the inputs' stamped
    copy kernel, ``kernels`` kernels adding 1 to dev[0], the outputs' stamped copy kernel, then
    one event or none) launched and waited for four ways, alternated call by call: the
    stream's synchronize, the event's (``Call``'s wait before the stamp poll), and a spin on
    the D2H copy's last stamp in pinned memory (``stamp_out[3]``, reset before each launch),
    with the event still in the graph (``cupy_calls.wait``) and without it. Each poll then
    checks that host[0] holds this launch's value (every output byte is fenced before the
    stamp): stale counts those that did not. Rows: (kernels, stream, event, poll, poll with no
    event us, stale)."""
    sp = s.ptr
    out = []
    hows = ("stream", "event", "poll", "poll, no event")
    for kernels in (1, 5):
        graphs = [_captured(rt, s, lambda k=kernels, e=e: capture(k, e), 20) for e in (1, 0)]
        want = float(dev[0].get())
        times: dict[str, list[int]] = {h: [] for h in hows}
        stale = 0
        for i in range(len(hows) * calls):
            how = hows[i % len(hows)]
            ex = graphs[how == "poll, no event"][1]
            stamp_out[3] = 0
            t0 = time.perf_counter_ns()
            rt.graphLaunch(ex, sp)
            if how == "stream":
                s.synchronize()
            elif how == "event":
                rt.eventSynchronize(event)
            else:
                while not stamp_out[3]:
                    pass
            times[how].append(time.perf_counter_ns() - t0)
            want += kernels
            if how.startswith("poll") and host[0] != want:
                stale += 1
            s.synchronize()
        for g, ex in graphs:
            rt.graphExecDestroy(ex)
            rt.graphDestroy(g)
        out.append((kernels, *(float(np.median(times[h])) / 1e3 for h in hows), stale))
    return out


COPY_SIZES = (24 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
COPY_BLOCKS = (8, 32, 64, 132, 264)


def copy_sweep(calls: int, out: str | None) -> None:
    """``--copies``: one copy alone in a graph, by size, direction and how (module docstring)."""
    import cupy
    import cupyx

    from coliworker.kernels import copy as ck
    from coliworker.kernels._module import get_function
    from coliworker.kernels.launch import Launch

    rt = cupy.cuda.runtime
    s = cupy.cuda.Stream(non_blocking=True)
    sp = s.ptr
    top = max(COPY_SIZES)
    dev = cupy.zeros(top, cupy.uint8)
    host = cupyx.empty_pinned((top,), np.uint8)
    stamp_dev = cupy.asarray(np.array([np.iinfo(np.uint64).max, 0, 0], np.uint64))
    stamp_out = cupyx.empty_pinned((2,), np.uint64)
    stamp = (np.uint64(stamp_dev.data.ptr), np.uint64(stamp_out.ctypes.data))
    fn = get_function("copy.cu", "coli_copy", ck.VARIANTS)
    rng = np.random.default_rng()
    rows = []

    def timed(issue, stamped: bool) -> tuple[float, float]:
        g, ex = _captured(rt, s, issue, 20)
        total, span = [], []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            rt.graphLaunch(ex, sp)
            s.synchronize()
            total.append(time.perf_counter_ns() - t0)
            if stamped:
                span.append(int(stamp_out[1]) - int(stamp_out[0]))
        rt.graphExecDestroy(ex)
        rt.graphDestroy(g)
        return float(np.median(total)) / 1e3, (float(np.median(span)) / 1e3 if span else 0.0)

    with s:
        for n in COPY_SIZES:
            for name, kind, dst, src in (("H2D", 1, dev.data.ptr, host.ctypes.data),
                                         ("D2H", 2, host.ctypes.data, dev.data.ptr)):  # fmt: skip
                row = {"bytes": n, "direction": name}
                row["engine"] = timed(
                    lambda d=dst, s_=src, m=n, k=kind: rt.memcpyAsync(d, s_, m, k, sp), False
                )[0]
                policy = ck.blocks(n)
                row["policy blocks"] = policy
                for b in sorted({policy, *COPY_BLOCKS}):
                    go = Launch(fn, (b,), (256,), (np.int64(n),), 0)
                    want = rng.integers(0, 256, n, dtype=np.uint8)
                    if kind == 1:
                        host[:n] = want
                    else:
                        dev[:n] = cupy.asarray(want)
                    s.synchronize()
                    t, span = timed(
                        lambda g=go, d=dst, s_=src: g(np.uint64(d), np.uint64(s_), *stamp), True
                    )
                    got = cupy.asnumpy(dev[:n]) if kind == 1 else host[:n].copy()
                    assert np.array_equal(got, want), f"copy kernel {name} {n} B x {b} blocks"
                    row[f"x{b}"] = (t, span)
                rows.append(row)
    head = ["engine", "kernel, blocks by policy", *(f"kernel x{b}" for b in COPY_BLOCKS)]
    lines = [f"One copy alone in a graph: launch + wait, us, medians of {calls}; in brackets the",
             "copy kernel's own span on the GPU (first block's start to last block's end).", "",
             "| size | dir | " + " | ".join(head) + " |",
             "|---|---|" + "---|" * len(head)]  # fmt: skip
    for r in rows:
        pb = r["policy blocks"]
        cells = [f"{r['engine']:.1f}"] + [
            f"{r[f'x{b}'][0]:.1f} ({r[f'x{b}'][1]:.1f})" + (f", x{b}" if i == 0 else "")
            for i, b in enumerate((pb, *COPY_BLOCKS))
        ]
        lines.append(f"| {r['bytes'] >> 10} KiB | {r['direction']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if out:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from bench import harness

        date, doc = harness.run_record("bench/graph_launch.py")
        doc.update(calls=calls, rows=rows)
        stem = harness.write_json(out, f"copy-sweep-{date:%Y-%m-%d}-{doc['machine']['commit']}",
                                  doc)  # fmt: skip
        with open(stem + ".md", "w") as f:
            f.write("\n".join([f"# copy sweep, {doc['machine'].get('gpu', '')}, {doc['date']}",
                                f"command: `{doc['command']}`", "", *lines, ""]))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=24576, help="bytes each copy moves")
    p.add_argument("--copies", action="store_true", help="the copy sweep (module docstring)")
    p.add_argument("--out", default=None, help="with --copies: write results here")
    a = p.parse_args()
    if a.copies:
        copy_sweep(min(a.calls, 500), a.out)
        return
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
            g, ex = _captured(rt, s, lambda e=events, c=copies, k=kernels: work(e, c, k, True), 50)
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
        waits = _wait_rows(rt, s, lambda k_, e_: work(e_, "stamped", k_, True), ev[3].ptr,
                           stamp_out, dev, host, a.calls)  # fmt: skip
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
    print()
    print("A stamped call's graph (copy kernels stamping the phases, one event after all, or none")
    print("in the last column), waited for four ways: us, medians; stale = polls that saw the")
    print("stamp before the output's bytes")
    print("| kernels | launch + stream sync | launch + event sync | launch + stamp poll "
          "| the same, no event node | stale |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for kernels, st, ev_, poll, bare, stale in waits:
        print(f"| {kernels} | {st:.1f} | {ev_:.1f} | {poll:.1f} | {bare:.1f} | {stale} |")


if __name__ == "__main__":
    main()
