"""The expert group's pipelined prefill path (kernels/expert_group_pipe.py): against the
one-launch path to the bit and against the float64 reference (GPU), and, on any machine, its
runs (pipe_bounds against a definition in exact fractions, PIPE_EDGE from the environment), its
pieces and tables against the one table, and issue_pipelined's copies, launches and events on
simulated streams (``_Sim``). The one-launch path: tests/kernels/test_expert_group.py."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from bisect import bisect_left
from fractions import Fraction
from itertools import accumulate
from types import SimpleNamespace

import numpy as np
import pytest
from _kern import Res, Spec, place_experts, rel_err

from coliworker.kernels import expert_group as eg
from coliworker.kernels import expert_group_pipe as pipe
from coliworker.kernels import group_tables as gt
from coliworker.kernels import reference

# Uneven rows per expert, 1100 in all: x is 1100 x 4096 float32 = 17.2 MiB, over PIPE_BYTES.
PIPE_ROWS = [200, 3, 97, 150, 1, 64, 33, 180, 71, 5, 120, 176]
PIPE_D, PIPE_IE = 4096, 256
PF_TOL = 1e-4  # the prefill kernel's bound (tests/kernels/test_prefill_tc.py)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture
def pipelined_calls(monkeypatch):
    """How many calls took the pipelined path (issue_pipelined), counted as they run."""
    seen = []
    real = pipe.issue_pipelined

    def spy(*args, **kw):
        seen.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(pipe, "issue_pipelined", spy)
    monkeypatch.setattr(eg, "PIPELINE", True)  # whatever COLIWORKER_PREFILL_PIPELINE says
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64), (1, 0)])
@pytest.mark.parametrize("launches,pieces", [(4, 2), (3, 1), (12, 3)])
def test_pipelined_group_is_bit_identical_to_one_launch(
    cupy_backend, rng, monkeypatch, pipelined_calls, fmt, gs, launches, pieces
):
    # fmt 2 and 4/64 take the tensor-core prefill kernel (moe_pf), fmt 1 the fp32 moe.
    b = cupy_backend
    host, dev = place_experts(b, rng, len(PIPE_ROWS), PIPE_D, PIPE_IE, fmt, gs)
    monkeypatch.setattr(pipe, "PIPE_LAUNCHES", launches)
    monkeypatch.setattr(pipe, "PIPE_PIECES", pieces)
    limit = eg.PIPE_BYTES
    for _ in range(2):  # fresh data each time; the second call reuses the arena's streams
        x = rng.standard_normal((sum(PIPE_ROWS), PIPE_D)).astype(np.float32)
        assert 4 * x.size >= eg.PIPE_BYTES
        n = len(pipelined_calls)
        got = b.expert_group(dev, PIPE_ROWS, x)
        assert len(pipelined_calls) == n + 1
        monkeypatch.setattr(eg, "PIPE_BYTES", 1 << 62)  # the one-launch path
        want = b.expert_group(dev, PIPE_ROWS, x)
        monkeypatch.setattr(eg, "PIPE_BYTES", limit)
        assert len(pipelined_calls) == n + 1
        assert got.out.shape == want.out.shape == (sum(PIPE_ROWS), PIPE_D)
        assert np.array_equal(_bits(got.out), _bits(want.out))
        p = got.phases
        assert p.h2d_ns > 0 and p.kernel_ns > 0 and p.d2h_ns > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,gs", [(2, 0), (4, 64)])
def test_pipelined_group_against_reference(cupy_backend, rng, pipelined_calls, fmt, gs):
    b = cupy_backend
    host, dev = place_experts(b, rng, len(PIPE_ROWS), PIPE_D, PIPE_IE, fmt, gs)
    x = rng.standard_normal((sum(PIPE_ROWS), PIPE_D)).astype(np.float32)
    res = b.expert_group(dev, PIPE_ROWS, x)
    assert pipelined_calls
    assert rel_err(res.out, reference.expert_group(host, PIPE_ROWS, x)) < PF_TOL
    # several in flight (each its own arena and copy streams), then a sync call between
    p1 = b.expert_group_issue(dev, PIPE_ROWS, x)
    p2 = b.expert_group_issue(dev, PIPE_ROWS, -x)
    mid = b.expert_group(dev, PIPE_ROWS, 2 * x)
    assert np.array_equal(_bits(p1.result().out), _bits(res.out))
    assert np.array_equal(_bits(p2.result().out), _bits(b.expert_group(dev, PIPE_ROWS, -x).out))
    assert rel_err(mid.out, reference.expert_group(host, PIPE_ROWS, 2 * x)) < PF_TOL


def _bounds_by_definition(rows: list[int], launches: int, edge: float) -> list[int]:
    """pipe_bounds written out in exact fractions: the k-th cut is the first expert count whose
    rows reach the k-th cumulative target (shares edge, 1, ..., 1, edge of all rows), kept
    where it leaves rows on both sides; repeated cuts are one."""
    share = [Fraction(1)] * launches
    if launches > 1:
        share[0] = share[-1] = Fraction(edge)
    cum = list(accumulate(share))
    prefix = list(accumulate((int(r) for r in rows), initial=0))  # ascending
    total = prefix[-1]
    cuts = set()
    for k in range(1, launches):
        j = bisect_left(prefix, total * cum[k - 1] / cum[-1], lo=1)  # first prefix >= target
        if 0 < prefix[j] < total:
            cuts.add(j)
    return [0, *sorted(cuts), len(rows)]


@pytest.mark.parametrize("edge", [1.0, 0.5, 0.25, 0.3])
def test_pipe_bounds_cut_by_rows(edge):
    rng = np.random.default_rng()
    cases = [PIPE_ROWS, [32] * 64, [1] * 3, [5, 0, 0, 7], [0, 0, 9, 1], [9, 0, 0], [1, 1000]]
    cases += [[0] * 5, [0], [3]]
    cases += [list(rng.integers(0, 50, rng.integers(1, 80))) for _ in range(200)]
    cases += [[int(r) * (rng.random() < 0.4) for r in rng.integers(1, 9, 40)] for _ in range(50)]
    for rows in cases:
        for launches in (1, 2, 3, 4, 8, 100):
            bounds = pipe.pipe_bounds(rows, launches, edge)
            assert bounds == _bounds_by_definition(rows, launches, edge), (rows, launches)
            assert bounds[0] == 0 and bounds[-1] == len(rows)
            assert all(a < c for a, c in zip(bounds, bounds[1:], strict=False))
            assert len(bounds) - 1 <= max(1, min(launches, len(rows)))
            if sum(rows):
                assert all(sum(rows[a:c]) > 0 for a, c in zip(bounds, bounds[1:], strict=False))
            if edge == 1.0:  # the default argument is equal runs
                assert pipe.pipe_bounds(rows, launches) == bounds
    if edge == 1.0:
        assert pipe.pipe_bounds([32] * 64, 4) == [0, 16, 32, 48, 64]
        assert pipe.pipe_bounds([32] * 64, 8) == list(range(0, 65, 8))
    if edge == 0.5:  # rows as 0.5 : 1 : 1 : 0.5, each cut at the first expert past its target
        assert pipe.pipe_bounds([32] * 64, 4, edge) == [0, 11, 32, 54, 64]
        assert pipe.pipe_bounds([32] * 64, 2, edge) == [0, 32, 64]  # two edges: equal still


@pytest.mark.parametrize("edge", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("launches", [3, 4, 8])
def test_pipe_bounds_edge_runs_are_shorter(edge, launches):
    """With many small experts (a cut overshoots its target by less than one expert) every
    target gets its own cut, the first and the last run are no larger than any middle one, and
    each run is its share of the rows to within the largest expert."""
    rng = np.random.default_rng()
    whole = 2 * edge + launches - 2
    for _ in range(50):
        rows = [int(r) for r in rng.integers(0, 9, rng.integers(200, 400))]
        bounds = pipe.pipe_bounds(rows, launches, edge)
        run = [sum(rows[a:c]) for a, c in zip(bounds, bounds[1:], strict=False)]
        assert len(run) == launches and all(run)
        assert max(run[0], run[-1]) <= min(run[1:-1])
        share = [edge] + [1.0] * (launches - 2) + [edge]
        for r, sh in zip(run, share, strict=True):
            assert abs(r - sum(rows) * sh / whole) < max(rows)


def test_pipe_edge_from_the_environment():
    assert eg._pipe_edge(None) == 0.5  # unset: the measured default
    assert eg._pipe_edge("0.5") == 0.5 and eg._pipe_edge("1") == 1.0
    for bad in ("0", "-0.5", "1.5", "nan", "inf", "", "half"):
        with pytest.raises(ValueError, match=f"COLIWORKER_PIPE_EDGE={bad!r}"):
            eg._pipe_edge(bad)
    # at import, as the worker reads it
    code = "from coliworker.kernels import expert_group as eg; print(eg.PIPE_EDGE)"
    for text, ok in (("0.25", True), ("2", False)):
        env = {**os.environ, "COLIWORKER_PIPE_EDGE": text}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if ok:
            assert r.returncode == 0 and r.stdout.strip() == text, r.stderr
        else:
            assert r.returncode != 0 and "COLIWORKER_PIPE_EDGE='2'" in r.stderr


def test_pipe_pieces_cover_each_run():
    rows = PIPE_ROWS
    off = np.concatenate([[0], np.cumsum(rows)]).tolist()
    for launches in (2, 4, 12):
        bounds = pipe.pipe_bounds(rows, launches)
        for n in (1, 2, 3, 500):
            pieces = pipe.pipe_pieces(off, bounds, n)
            assert pieces[0][1] == 0 and pieces[-1][2] == sum(rows)
            for (k0, _, e0), (k1, s1, _) in zip(pieces, pieces[1:], strict=False):
                assert e0 == s1 and k1 in (k0, k0 + 1)
            for k in range(len(bounds) - 1):
                mine = [(s, e) for kk, s, e in pieces if kk == k]
                assert mine[0][0] == off[bounds[k]] and mine[-1][1] == off[bounds[k + 1]]
                assert len(mine) == min(n, off[bounds[k + 1]] - off[bounds[k]])
                assert all(e > s for s, e in mine)


def _records(buf: np.ndarray, off: int, n: int) -> np.ndarray:
    p = off + gt.counter_bytes(n)
    assert not buf[off:p].any()  # the counters start at zero
    return buf[p : p + gt.MOE_JOB.size * n].copy()


@pytest.mark.parametrize("edge", [1.0, 0.5])
@pytest.mark.parametrize("launches", [2, 3, 4, 12])
def test_pipe_tables_hold_the_one_tables_jobs(monkeypatch, launches, edge):
    """Every run's job records are the one table's, byte for byte (same pointers), and every
    run's launch has the one launch's maxima (so the same kernel and tiles)."""
    gs, ds = Spec(2), Spec(2)
    d, ie, dout = 4096, 256, 4096
    experts = [(Res(gs, ie, 1 << 20 | c << 8), Res(gs, ie, 2 << 20 | c << 8),
                Res(ds, dout, 3 << 20 | c << 8)) for c in range(len(PIPE_ROWS))]  # fmt: skip
    x = np.zeros((sum(PIPE_ROWS), d), np.float32)
    monkeypatch.setattr(pipe, "PIPE_LAUNCHES", launches)
    monkeypatch.setattr(eg, "PIPE_EDGE", edge)
    pp = pipe.pipe_plan(experts, PIPE_ROWS, x)
    assert pp is not None
    plan, bounds, subs = pp
    assert bounds == pipe.pipe_bounds(PIPE_ROWS, launches, edge)
    assert 2 <= len(bounds) - 1 <= launches
    one = np.full(plan.table_bytes + 64, 0xAB, np.uint8)
    (ln,) = gt.write_group(one, 16, plan, experts, d, dout, 0x10000, 0x20000, 0x30000, 0)
    buf = np.full(sum(s.table_bytes for s in subs) + 64, 0xAB, np.uint8)
    runs = pipe.pipe_tables(buf, 16, plan, bounds, subs, experts, d, dout, 0x10000, 0x20000,
                          0x30000)  # fmt: skip
    assert len(runs) == len(bounds) - 1
    got = np.concatenate([_records(buf, 16 + r[3], r[4]) for r in runs])
    assert np.array_equal(got, _records(one, 16 + ln[3], ln[4]))
    assert sum(r[4] for r in runs) == ln[4] == len(PIPE_ROWS)
    assert all(r[:3] == ln[:3] and r[5:] == ln[5:] for r in runs)
    # not pipelined: small, one expert, rows that are not x's, unfused experts
    assert pipe.pipe_plan(experts, PIPE_ROWS, x[:100]) is None
    assert pipe.pipe_plan(experts[:1], [1100], x) is None
    odd = [(experts[0][0], experts[0][1], Res(Spec(1), dout, 0))] + experts[1:]
    assert pipe.pipe_plan(odd, PIPE_ROWS, x) is None
    monkeypatch.setattr(eg, "PIPE_BYTES", 1 << 62)
    assert pipe.pipe_plan(experts, PIPE_ROWS, x) is None


class _Sim:
    """CUDA streams and events as issue_pipelined uses them, on host memory: every stream's
    work is queued and run at the end in a random order that keeps each stream's order and
    its event waits (a wait sees the event's records made before it, as in CUDA), so a
    missing dependency shows as a wrong result. Copies up read their source when issued (the
    earliest a DMA can): a copy up issued before its copy into pinned memory was done reads
    what is not there yet."""

    def __init__(self, rng: np.random.Generator, eager: bool) -> None:
        self.rng = rng
        self.eager = eager  # run the first stream made (the kernels') whenever it can
        self.queues: dict[int, list[tuple]] = {}
        self.records: dict[int, int] = {}  # event: records issued
        self.fired: dict[int, int] = {}  # event: records done

    def stream(self) -> int:
        s = len(self.queues) + 1
        self.queues[s] = []
        return s

    # cupy.cuda.runtime, the calls issue_pipelined makes
    def eventRecord(self, ev: int, s: int) -> None:
        self.records[ev] = self.records.get(ev, 0) + 1
        self.queues[s].append(("record", ev))

    def streamWaitEvent(self, s: int, ev: int, flags: int) -> None:
        self.queues[s].append(("wait", ev, self.records.get(ev, 0)))

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, s: int) -> None:
        assert kind in (pipe.H2D, pipe.D2H)
        data = ctypes.string_at(src, n) if kind == pipe.H2D else None
        self.queues[s].append(("copy", dst, src, n, data))

    def run(self, until: int | None = None) -> None:
        """Run the queued work (to the end, or until event ``until`` has fired: a sync)."""
        while any(self.queues.values()):
            if until is not None and self.fired.get(until, 0) >= self.records[until]:
                return
            ready = [s for s, q in self.queues.items() if q and self._ready(q[0])]
            assert ready, "the streams wait on each other: deadlock"
            pick = ready[0] if self.eager else ready[self.rng.integers(len(ready))]
            op = self.queues[pick].pop(0)
            if op[0] == "record":
                self.fired[op[1]] = self.fired.get(op[1], 0) + 1
            elif op[0] == "copy":
                _, dst, src, n, data = op
                ctypes.memmove(dst, data if data is not None else src, n)
            elif op[0] == "kernel":
                op[1]()

    def _ready(self, op: tuple) -> bool:
        return op[0] != "wait" or self.fired.get(op[1], 0) >= op[2]


def _sim_kernel(d: int):
    """A fake moe launch: each job's y = x[:, :dout] * 2 + its expert (from its gate
    pointer), read through the job table; its counters must be zero."""

    def moe_launch(gu, dn, n, max_rows, max_ie, max_dout, n_sm):
        def go(jobs, ctr):
            def run():
                assert not any(ctypes.string_at(int(ctr), 4 * (1 + n)))
                for j in range(n):
                    f = gt.MOE_JOB.unpack(ctypes.string_at(int(jobs) + j * gt.MOE_JOB.size,
                                                           gt.MOE_JOB.size))  # fmt: skip
                    wg, x, y, rows, dout = f[0], f[6], f[8], f[9], f[11]
                    xs = np.frombuffer(ctypes.string_at(x, 4 * rows * d), np.float32)
                    ys = xs.reshape(rows, d)[:, :dout] * 2 + ((wg >> 8) & 0xFF)
                    ctypes.memmove(y, np.ascontiguousarray(ys, np.float32).ctypes.data, ys.nbytes)

            sim.queues[comp].append(("kernel", run))

        return go

    return moe_launch


sim: _Sim
comp: int


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("launches,pieces", [(4, 2), (3, 1), (12, 3), (2, 500)])
@pytest.mark.parametrize("edge", [1.0, 0.5])
def test_pipelined_issue_on_simulated_streams(monkeypatch, edge, direct, launches, pieces, eager):
    """issue_pipelined's copies, launches and events without a GPU (``_Sim``): every output
    row is its expert's, whatever order the streams' work runs in (random, or the kernels as
    early as their waits let them)."""
    global sim, comp
    rng = np.random.default_rng()
    d, ie, dout = 64, 40, 48
    sim = _Sim(rng, eager)
    comp = sim.stream()
    up, down = sim.stream(), sim.stream()
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=sim)))
    fake_mm = SimpleNamespace(moe_launch=_sim_kernel(d))
    monkeypatch.setitem(sys.modules, "coliworker.kernels.matmul", fake_mm)
    monkeypatch.setattr(eg, "PIPELINE", True)
    monkeypatch.setattr(eg, "PIPE_BYTES", 64 << 10)
    monkeypatch.setattr(pipe, "PIPE_LAUNCHES", launches)
    monkeypatch.setattr(pipe, "PIPE_PIECES", pieces)
    monkeypatch.setattr(eg, "PIPE_EDGE", edge)
    gs, ds = Spec(2), Spec(2)
    experts = [(Res(gs, ie, 1 << 20 | c << 8), Res(gs, ie, 2 << 20 | c << 8),
                Res(ds, dout, 3 << 20 | c << 8)) for c in range(len(PIPE_ROWS))]  # fmt: skip
    x = rng.standard_normal((sum(PIPE_ROWS), d)).astype(np.float32)
    keep = []

    def reserve(dev_bytes, host_bytes):
        a = SimpleNamespace(dev=np.full(dev_bytes, 0xFF, np.uint8),
                            host=np.full(host_bytes, 0xFF, np.uint8))  # fmt: skip
        a.dptr, a.hptr = a.dev.ctypes.data, a.host.ctypes.data
        a.streams = lambda: (SimpleNamespace(ptr=up), SimpleNamespace(ptr=down))
        a.pipe_events = lambda n: list(range(100, 100 + n))
        keep.append(a)
        return a

    call = SimpleNamespace(backend=SimpleNamespace(_registered=lambda p, n: direct),
                           stream=SimpleNamespace(ptr=comp), reserve=reserve)  # fmt: skip
    eg.issue(call, experts, PIPE_ROWS, x, 132)
    assert hasattr(call, "spans"), "not pipelined"
    sim.run(until=call.done)  # finish's wait
    (a,) = keep
    off, n, shape = call.out
    y = a.host[off : off + n].view(np.float32).reshape(shape).copy()
    sim.run()
    ro = np.concatenate([[0], np.cumsum(PIPE_ROWS)])
    want = np.concatenate([x[ro[c] : ro[c + 1], :dout] * 2 + c for c in range(len(PIPE_ROWS))])
    assert np.array_equal(y, want)
    h2d, kern, d2h = call.spans
    assert len(kern) == len(d2h) == len(pipe.pipe_bounds(PIPE_ROWS, launches, edge)) - 1
    assert len(h2d) >= len(kern) and call.done == d2h[-1][1]
    assert all(sim.fired.get(e) == 1 for ph in call.spans for s in ph for e in s)
