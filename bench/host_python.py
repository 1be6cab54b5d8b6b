"""The CuPy backend's per-call Python, with the GPU stubbed out: what a decode call costs the
host beside its device work, measurable on any machine.

A stand-in ``cupy`` module (runtime calls that return at once, device arrays that are host
arrays, kernels that are never compiled) lets the real host path run: ``Call``, the ops' plans,
tables and arenas (``kernels/expert_group.py``, ``kernels/attention_call.py``,
``kernels/matmul.py``), graph capture and replay (``kernels/graphs.py``). Each row makes the
same calls as ``bench/host_profile.py`` at GLM-5.2 shapes, and prints the median host time per
call (no GPU wait in it: there is no GPU) beside the runtime calls it made. Timings on a shared
VM move by tens of percent, so the results file counts instructions per call as well
(callgrind, collecting only inside the measured loop as ``bench/call_instructions.py`` does;
needs valgrind; ``--no-instructions`` skips it).

    python bench/host_python.py --baseline SHA [--calls 2000] [--out bench/results]

``--cold`` times each row again with an 8 MB copy before every call: the host path from caches
that other work has turned over, as inside a worker (bench/decode_backend.py ``--gaps`` shows
the same on a GPU host).

``--cache-model`` instead runs each row under callgrind's cache model, each call alone after
the same copy: the lines of code and of data it fetches past a 2 MB level, and callgrind's
cycle estimate (what a cold call costs beside its instructions; needs valgrind).

``--baseline SHA`` runs the same rows in an exported tree of that commit, in the same run;
without it, the rows of this tree are timed and printed, no file written.

The kept decode calls run compiled where ``server/kept.c`` builds here (``server/kept.py``);
``COLIWORKER_KEPT_C=0`` in the environment times their Python twins instead.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM = dict(D=6144, I=2048, H=64, Q=192, R=64, V=256, K=512)
CALLS: dict[str, int] = {}  # runtime calls made, by name


def _stub_cupy() -> None:
    """Install stand-ins for cupy, cupyx and cupy_backends in sys.modules. Their GPU writes no
    copy stamps, so calls wait by their event (COLIWORKER_POLL=0, ``cupy_calls.wait``)."""
    os.environ["COLIWORKER_POLL"] = "0"
    addr = itertools.count(1 << 40, 1 << 24)

    def counted(name, ret=None):
        def fn(*a, **k):
            CALLS[name] = CALLS.get(name, 0) + 1
            return ret() if callable(ret) else ret

        return fn

    rt = types.SimpleNamespace(
        getDevice=lambda: 0, setDevice=counted("setDevice"), getDeviceCount=lambda: 1,
        graphLaunch=counted("graphLaunch"), eventSynchronize=counted("eventSynchronize"),
        eventElapsedTime=lambda a, b: 0.001, memcpyAsync=counted("memcpyAsync"),
        eventRecord=counted("eventRecord"), streamBeginCapture=counted("streamBeginCapture"),
        streamEndCapture=counted("streamEndCapture", lambda: next(addr)),
        graphInstantiate=counted("graphInstantiate", lambda: next(addr)),
        graphDestroy=lambda g: None, graphExecDestroy=lambda g: None,
        getDeviceProperties=lambda d: {"multiProcessorCount": 132, "name": b"stub"},
        memGetInfo=lambda: (1 << 40, 1 << 40), CUDARuntimeError=RuntimeError,
    )  # fmt: skip

    class DevArray:
        def __init__(self, shape, dtype=np.uint8):
            self.a = np.empty(shape, dtype)
            self.nbytes = self.a.nbytes
            self.data = types.SimpleNamespace(ptr=next(addr))
            self.shape, self.dtype = self.a.shape, self.a.dtype

    class Context:  # streams and devices as context managers that do nothing
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

        def synchronize(self):
            pass

    class Stream(Context):
        def __init__(self, non_blocking=False):
            self.ptr = next(addr)

    class Event:
        def __init__(self, *a, **k):
            self.ptr = next(addr)

    class Device(Context):
        def __init__(self, d=0):
            self.id = d
            self.attributes = {"MultiProcessorCount": 132}

    class RawModule:
        def __init__(self, **k):
            pass

        def get_function(self, name):
            return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=next(addr)),
                                         max_dynamic_shared_size_bytes=0, num_regs=80,
                                         preferred_shared_memory_carveout=100)  # fmt: skip

    stream = Stream()
    cuda = types.SimpleNamespace(
        runtime=rt, Stream=Stream, Event=Event, Device=Device,
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
        get_current_stream=lambda: stream,
    )  # fmt: skip
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    cupy.ndarray = DevArray
    cupy.uint8, cupy.float32 = np.uint8, np.float32
    cupy.empty = lambda shape, dtype=np.uint8: DevArray(shape, dtype)
    cupy.asarray = lambda a: DevArray(np.shape(a), np.asarray(a).dtype)
    cupy.RawModule = RawModule
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype: np.empty(shape, dtype)
    driver = types.ModuleType("cupy_backends.cuda.api.driver")
    driver.launchKernel = counted("launchKernel")
    for name, mod in (("cupy", cupy), ("cupyx", cupyx), ("cupy_backends", types.ModuleType("b")),
                      ("cupy_backends.cuda", types.ModuleType("c")),
                      ("cupy_backends.cuda.api", types.ModuleType("d")),
                      ("cupy_backends.cuda.api.driver", driver)):  # fmt: skip
        sys.modules[name] = mod
    sys.modules["cupy_backends.cuda.api"].driver = driver


class Resident:
    """A resident weight as the host path sees it (spec, widths, device addresses)."""

    _next = itertools.count(1 << 44, 1 << 26)

    def __init__(self, fmt: int, i: int, o: int) -> None:
        from coliworker.kernels.layout import Layout
        from coliworker.kernels.matmul import WeightSpec

        self.device, self.fmt, self.in_features, self.out_features = 0, fmt, i, o
        self.group_size = 0
        self.layout = Layout.of(fmt, i, 0)
        self.spec = WeightSpec.of(fmt, i, 0)
        self.ptrs = (next(self._next), next(self._next))

    def row_ptrs(self, row: int) -> tuple[int, int]:
        return self.ptrs[0] + row * self.layout.ld, self.ptrs[1] + row * 4


class KV:
    def __init__(self, k: int, r: int, t: int) -> None:
        self.latent = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1 << 45))
        self.rope = types.SimpleNamespace(data=types.SimpleNamespace(ptr=1 << 46))
        self.length, self.k, self.r = t, k, r

    def reserve(self, n: int) -> None:
        pass


#: The rows, in order (``make_rows``' keys).
ROWS = (
    "expert_group 8x1",
    "routed 1 token, 8 of 8",
    "routed 1 token, new 8 of 64",
    "expert_group 8x1, new 8 of 64",
    "matmul S=1 6144^2",
    "attention_ragged 1 seq",
)


def make_rows() -> dict:
    """The rows' calls, by name, on a CuPy backend over the stand-in (``_stub_cupy``)."""
    _stub_cupy()
    sys.path.insert(0, os.getcwd())
    from coliworker.kernels import graphs
    from coliworker.server.backend_cupy import CupyBackend

    graphs._record_fn = lambda *a: 0  # event-record nodes: capture works
    g = GLM
    rng = np.random.default_rng(0)
    b = CupyBackend((0,))
    pool = [(Resident(2, g["D"], g["I"]), Resident(2, g["D"], g["I"]),
             Resident(2, g["I"], g["D"])) for _ in range(64)]  # fmt: skip
    x1 = rng.standard_normal((1, g["D"])).astype(np.float32)
    x8 = np.repeat(x1, 8, axis=0)
    routes = np.arange(8, dtype=np.int32).reshape(1, 8)
    wts = rng.random((1, 8)).astype(np.float32)
    dense = Resident(2, 6144, 6144)
    kv_b = Resident(2, g["K"], g["H"] * (g["Q"] + g["V"]))
    o_proj = Resident(2, g["H"] * g["V"], g["D"])
    q = rng.standard_normal((1, g["H"], g["Q"] + g["R"])).astype(np.float32)
    cache = KV(g["K"], g["R"], 4096)
    lat = rng.standard_normal((1, g["K"])).astype(np.float32)
    rope = rng.standard_normal((1, g["R"])).astype(np.float32)
    ring = itertools.cycle(range(8))
    ring2 = itertools.cycle(range(8))
    rows = {
        "expert_group 8x1": lambda: b.expert_group(pool[:8], [1] * 8, x8),
        "routed 1 token, 8 of 8": lambda: b.expert_group_routed(pool[:8], x1, routes, wts),
        "routed 1 token, new 8 of 64": lambda: b.expert_group_routed(
            pool[8 * next(ring) :][:8], x1, routes, wts
        ),
        # a decode step as a seed-ABI engine sends it: its router's 8 experts as a group,
        # the token's row once per expert
        "expert_group 8x1, new 8 of 64": lambda: b.expert_group(
            pool[8 * next(ring2) :][:8], [1] * 8, x8
        ),
        "matmul S=1 6144^2": lambda: b.matmul(dense, x1),
        "attention_ragged 1 seq": lambda: attend(),
    }
    assert tuple(rows) == ROWS, (tuple(rows), ROWS)

    def attend():
        # A decode token's 78 layers share T (the cache length): one T per call here, as
        # within a token; each call appends its row (reserve / advance are the stand-in's).
        cache.length = 4096
        return b.attention_ragged(
            kv_b, o_proj, q, [cache], g["Q"], g["R"], g["V"], 1 / 16, rows=[(lat, rope)]
        )

    return rows


#: Bytes copied before each call of a ``--cold`` timing: more than the L2 of the host CPUs
#: measured here, so each call starts with caches another workload has turned over.
COLD_BYTES = 8 << 20


def time_rows(calls: int, cold: bool = False) -> dict[str, float]:
    """Median host us per call of each row, in this process; ``cold``: each call after a
    ``COLD_BYTES`` copy (as inside a worker, whose transport and dispatch run between any
    two backend calls)."""
    out = {}
    src, dst = bytearray(COLD_BYTES), bytearray(COLD_BYTES)
    for name, fn in make_rows().items():
        for _ in range(50):
            fn()
        ts = []
        for _ in range(calls):
            if cold:
                dst[:] = src
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        out[name] = statistics.median(ts) / 1e3
    return out


def count_loop(row: str, calls: int) -> None:
    """``calls`` calls of ``row`` inside a qsort comparator (what callgrind collects)."""
    fn = make_rows()[row]
    for _ in range(50):
        fn()

    def measured(a, b):
        for _ in range(calls):
            fn()
        return 0

    cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(measured)
    ctypes.CDLL("libc.so.6").qsort((ctypes.c_int * 2)(2, 1), 2, 4, cmp)


def cold_loop(row: str, calls: int) -> None:
    """``calls`` calls of ``row``, each alone inside a qsort comparator (what callgrind
    collects) after a ``COLD_BYTES`` copy outside it (``--cache-model``)."""
    fn = make_rows()[row]
    for _ in range(50):
        fn()
    src, dst = bytearray(COLD_BYTES), bytearray(COLD_BYTES)

    def measured(a, b):
        fn()
        return 0

    cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(measured)
    qsort, pair = ctypes.CDLL("libc.so.6").qsort, (ctypes.c_int * 2)(2, 1)
    for _ in range(calls):
        dst[:] = src
        qsort(pair, 2, 4, cmp)


#: callgrind's cache model for ``--cache-model``: L1 as on the hosts measured here, and a
#: last level of 2 MB (a core's L2: what a cold call refetches from farther away).
CACHES = ["--I1=32768,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"]


def cache_model(tree: str, row: str, calls: int, scratch: str) -> dict[str, float]:
    """Per call of ``row`` from turned-over caches (``cold_loop``): instructions, the lines of
    code and of data read it fetches past the 2 MB level, and callgrind's cycle estimate
    (Ir + 10 x L1 misses + 100 x last-level misses)."""
    out = os.path.join(scratch, "cg-cache.out")
    vg = ["valgrind", "--tool=callgrind", "--cache-sim=yes", *CACHES, "--collect-atstart=no",
          "--toggle-collect=*qsort*", f"--callgrind-out-file={out}"]  # fmt: skip
    _child(tree, "--cold-count", row, "--calls", str(calls), valgrind=vg)
    with open(out) as f:
        text = f.read()
    events = re.findall(r"^events: (.*)$", text, re.M)[-1].split()
    totals = [int(v) for v in re.findall(r"^summary: (.*)$", text, re.M)[-1].split()]
    ev = {e: t / calls for e, t in zip(events, totals, strict=True)}
    l1 = ev["I1mr"] + ev["D1mr"] + ev["D1mw"]
    ll = ev["ILmr"] + ev["DLmr"] + ev["DLmw"]
    return {"instructions": ev["Ir"], "code lines": ev["ILmr"], "data lines read": ev["DLmr"],
            "estimate": ev["Ir"] + 10 * l1 + 100 * ll}  # fmt: skip


def _child(tree: str, *args: str, valgrind: list[str] | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=f"{tree}/.dev:{tree}")
    cmd = [*(valgrind or []), sys.executable, os.path.abspath(__file__), "--child", *args]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    return r.stderr if valgrind else r.stdout


def instructions(tree: str, row: str, calls: int, scratch: str) -> float:
    out = os.path.join(scratch, "cg.out")
    vg = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=*qsort*",
          f"--callgrind-out-file={out}"]  # fmt: skip
    err = _child(tree, "--count", row, "--calls", str(calls), valgrind=vg)
    return int(re.findall(r"Collected : (\d+)", err)[-1]) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--baseline", default=None, help="a commit to run beside this tree")
    p.add_argument("--no-instructions", action="store_true", help="timings only")
    p.add_argument(
        "--cold",
        action="store_true",
        help="also time each row with an 8 MB copy before every call (caches turned over)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument(
        "--cache-model",
        action="store_true",
        help="callgrind's cache model per row from turned-over caches instead of timings: code"
        " and data lines fetched past a 2 MB level, and its cycle estimate; prints, writes nothing",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--count", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cold-count", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        if a.cold_count:
            cold_loop(a.cold_count, a.calls)
        elif a.count:
            count_loop(a.count, a.calls)
        else:
            print(repr(time_rows(a.calls, a.cold)))
        return
    sys.path.insert(0, ROOT)
    from bench import harness
    from bench.call_instructions import export

    subprocess.run([os.path.join(ROOT, "scripts/devlink")], check=True)
    if a.cache_model:
        with tempfile.TemporaryDirectory() as scratch:
            trees = {"this tree": ROOT}
            if a.baseline:
                trees = {"baseline": export(a.baseline, scratch), **trees}
            print("| row | tree | k instr | code lines | data lines read | k cycles (estimate) |")
            print("|---|---|---|---|---|---|")
            for r in ROWS:
                for n, t in trees.items():
                    m = cache_model(t, r, min(a.calls, 100), scratch)
                    print(f"| {r} | {n} | {m['instructions'] / 1e3:.1f} | {m['code lines']:.0f} "
                          f"| {m['data lines read']:.0f} | {m['estimate'] / 1e3:.1f} |",
                          flush=True)  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": ROOT}
        if a.baseline:
            trees = {"baseline": export(a.baseline, scratch), **trees}
        us = {n: eval(_child(t, "--calls", str(a.calls)).strip().splitlines()[-1])  # noqa: S307
              for n, t in trees.items()}  # fmt: skip
        if a.cold:
            for n, t in list(trees.items()):
                out = _child(t, "--calls", str(min(a.calls, 500)), "--cold")
                us[f"{n}, cold"] = eval(out.strip().splitlines()[-1])  # noqa: S307
        rows = list(us["this tree"])
        ir: dict[str, dict[str, float]] = {n: {} for n in trees}
        if a.baseline and not a.no_instructions:
            for n, t in trees.items():
                for r in rows:
                    ir[n][r] = instructions(t, r, max(a.calls // 4, 100), scratch)
    names = list(trees)
    timed = list(us)  # each tree, then (--cold) each tree's cold timing
    cols = [f"{n} us" for n in timed] + [f"{n} k instr" for n in names if ir[n]]
    lines = ["| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        vals = [f"{us[n][r]:.1f}" for n in timed] + [f"{ir[n][r] / 1e3:.1f}" for n in names
                                                      if ir[n]]  # fmt: skip
        lines.append(f"| {r} | " + " | ".join(vals) + " |")
    print("\n".join(lines))
    if not a.baseline:
        return
    date, doc = harness.run_record("bench/host_python.py")
    doc.update(baseline=a.baseline, calls=a.calls, host_us=us, instructions_per_call=ir)
    mc = doc["machine"]
    stem = harness.write_json(a.out, f"host-python-{date:%Y-%m-%d}-{mc['commit']}", doc)
    with open(stem + ".md", "w") as f:
        f.write("\n".join([
            "# bench/host_python.py: the CuPy backend's per-call Python, GPU stubbed out",
            "",
            f"- date: {doc['date']}; commit {mc['commit']} beside baseline {a.baseline}",
            f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, python {mc['python']}",
            f"- command: `{doc['command']}`; median us of {a.calls} calls"
            + (f" (cold: of {min(a.calls, 500)}, each after an 8 MB copy)" if a.cold else "")
            + ("" if a.no_instructions else
               "; instructions per call (callgrind) over a quarter as many"),
            "", *lines, ""]))  # fmt: skip
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
