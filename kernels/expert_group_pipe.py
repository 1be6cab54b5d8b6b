"""The expert group's pipelined prefill path (``issue_pipelined``) and its plan
(``pipe_bounds``, ``pipe_pieces``, ``pipe_plan``, ``pipe_tables``), for ``kernels/expert_group.py``
whose ``issue`` imports this module only for a group of x at least ``expert_group.PIPE_BYTES``
(tests: ``tests/kernels/test_expert_group_pipe.py``).

With ``expert_group.PIPELINE`` on (the default; ``COLIWORKER_PREFILL_PIPELINE=0`` turns it off),
prefill-sized groups (x of at least ``PIPE_BYTES``, every expert in the one fused launch) are
pipelined: the experts are cut into ``PIPE_LAUNCHES`` runs of about equal rows, each run's rows
go up in ``PIPE_PIECES`` pieces on the arena's up stream, each as soon as the copy threads have
put it into pinned memory (``kernels/pinned.py``), each run's launch waits for its last piece,
and its outputs go down on the arena's down stream as soon as it ends; the copies in, the copies
up, the kernels and the copies down of different runs overlap. Nothing hides the first run's
copy up or the last run's kernel and copy down, so those two runs may get
``expert_group.PIPE_EDGE`` times a middle run's rows (``COLIWORKER_PIPE_EDGE``; 0.5, as
measured fastest on the H200; 1.0 is equal runs). Each run's launch is the whole group's
launch (same kernel, tile sizes and grid bounds from the whole group's maximum rows and widths)
over fewer jobs, and each job is the same record: every expert's rows compute exactly as in the
one launch, to the bit (``tests/kernels/test_expert_group_pipe.py``). Direct launches only
(never a graph: the arena of such a call is freed after it anyway).

The plan and the tables (``kernels/group_tables.py``) need no CuPy: they are timed and tested
on any machine; the launches import CuPy when they are first issued. What this module reads of
expert_group (``PIPE_BYTES``, ``PIPE_EDGE``) it reads there at each call, as ``eg.NAME``: a
value a test or bench/host_profile.py sets on expert_group is the one used.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from coliworker.kernels import expert_group as eg
from coliworker.kernels import group_tables as gt
from coliworker.kernels.pinned import align

#: Kernel launches of a pipelined group: its experts cut into this many runs of about equal
#: rows (at most one per expert). Only the last run's kernels and copy down are not hidden
#: behind the copies in; more runs make that tail shorter but each launch ends in a partly
#: idle wave.
PIPE_LAUNCHES = 4
#: Pieces per run: each run's input rows go up in this many copies (by rows, any cut), each as
#: soon as its copy into pinned memory is done, so the copy up follows the copy in closely.
PIPE_PIECES = 2


def pipe_bounds(rows: Sequence[int], launches: int, edge: float = 1.0) -> list[int]:
    """Expert boundaries [0, ..., len(rows)] cutting a group into at most ``launches`` runs of
    consecutive experts, in rows as edge : 1 : ... : 1 : edge (the first and the last run
    ``edge`` times a middle one; equal runs at 1.0): run k ends at the first expert where the
    rows so far reach the shares of runs 0..k of all rows. Every run has at least one row
    (zero-row experts join a neighbour). The targets are compared in Python integers (a float
    ``edge`` is exactly p / q), so edge 1.0 cuts exactly at (k + 1) / launches of all rows."""
    n, total = len(rows), int(sum(rows))
    p, q = edge.as_integer_ratio() if launches > 1 else (1, 1)
    # Shares in 1 / q of a middle run: p, q, ..., q, p. Run k - 1 ends where acc reaches
    # total * (shares of runs 0..k-1) / whole, compared as acc * whole >= targets[k - 1].
    whole = 2 * p + (launches - 2) * q
    targets = [(p + (k - 1) * q) * total for k in range(1, launches)]
    bounds = [0]
    acc, k = 0, 1
    for c, r in enumerate(rows):
        acc += int(r)  # (NumPy integers would overflow against a fine edge's q)
        if k < launches and acc * whole >= targets[k - 1] and 0 < acc < total and c + 1 < n:
            bounds.append(c + 1)
            while k < launches and acc * whole >= targets[k - 1]:
                k += 1
    bounds.append(n)
    return bounds


def pipe_pieces(row_off: Sequence[int], bounds: Sequence[int], pieces: int) -> list[tuple]:
    """(run, first row, end row) of every piece of input, in order: each run's rows cut into
    ``pieces`` copies of about equal rows (fewer where it has fewer rows)."""
    out = []
    for k, (c0, c1) in enumerate(pairwise(bounds)):
        r0, r1 = row_off[c0], row_off[c1]
        cuts = sorted({r0 + (r1 - r0) * j // pieces for j in range(pieces)} | {r1})
        out += [(k, p0, p1) for p0, p1 in pairwise(cuts)]
    return out


def pipe_plan(experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int], x: Any) -> Any:
    """(the group's plan, its run bounds, each run's plan) where the group is pipelined (x of
    ``PIPE_BYTES`` or more, its rows; one fused launch; two runs at least), else None."""
    if x.ndim != 2 or 4 * x.size < eg.PIPE_BYTES or len(rows) < 2 or x.shape[0] != sum(rows):
        return None
    plan = gt.plan_group(experts, rows)
    if len(plan.fused) != 1 or plan.unfused:
        return None
    bounds = pipe_bounds(plan.rows, PIPE_LAUNCHES, eg.PIPE_EDGE)
    if len(bounds) < 3:
        return None
    subs = [gt.plan_group(experts[c0:c1], plan.rows[c0:c1]) for c0, c1 in pairwise(bounds)]
    return plan, bounds, subs


def pipe_tables(
    buf: Any, off: int, plan: gt.GroupPlan, bounds: Sequence[int], subs: Sequence[gt.GroupPlan],
    experts: Sequence[tuple[Any, Any, Any]], d: int, dout: int, x_ptr: int, y_ptr: int,
    h_ptr: int,
) -> list[tuple]:  # fmt: skip
    """Each run's table (``write_group`` of its experts, one after another from ``off``, with
    the pointers of the whole group: x rows, y rows and hidden where the one table has them);
    returns each run's ("moe", ...) launch with offsets relative to ``off`` and the WHOLE
    group's max rows, ie and dout (the one launch's kernel and tiles)."""
    _, _, cs = plan.fused[0]
    max_rows = max(plan.rows[c] for c in cs)
    max_ie = max(experts[c][0].out_features for c in cs)
    max_dout = max(experts[c][2].out_features for c in cs)
    ro, ho = plan.row_off, plan.hid_off
    out = []
    pos = off
    for (c0, c1), sub in zip(pairwise(bounds), subs, strict=True):
        xs = [x_ptr + 4 * d * ro[c] for c in range(c0, c1)]
        (ln,) = gt.write_group(buf, pos, sub, experts[c0:c1], d, dout, 0, y_ptr + 4 * dout * ro[c0],
                            h_ptr + 4 * ho[c0], 0, xs)  # fmt: skip
        _, gu, dn, rel, n = ln[:5]
        out.append(("moe", gu, dn, pos - off + rel, n, max_rows, max_ie, max_dout))
        pos += sub.table_bytes
    return out


H2D, D2H = 1, 2  # cudaMemcpyKind


def issue_pipelined(
    call: Any, experts: Sequence[tuple[Any, Any, Any]], pp: Any, x: np.ndarray, n_sm: int
) -> None:
    """A prefill-sized group's device work, pipelined (module docstring), issued on the
    arena's copy streams and the call's stream; ``pp``: ``pipe_plan``'s. Its result is
    ``call.finish()``'s, whose phases are then the sums of the busy spans: h2d, from before
    to after each piece's copy up on the up stream (the tables go with the first); kernel,
    from each run's launch start (once its input is up) to its end; d2h, each run's copy
    down. Waits between them (for the copy threads, or for the stage before) are in none, and
    the three overlap: the call takes less than their sum."""
    import cupy

    from coliworker.kernels.matmul import moe_launch
    from coliworker.kernels.pinned import copy_async

    plan, bounds, subs = pp
    T, D = x.shape
    N, dout = plan.n_rows, experts[0][2].out_features
    d4, o4 = 4 * D, 4 * dout
    t_off = align(d4 * T)
    in_end = t_off + sum(s.table_bytes for s in subs)
    y_off = align(in_end)
    out_end = y_off + o4 * N
    h_off = align(out_end)
    end = h_off + 4 * max(plan.n_hid, 1)
    a = call.reserve(end, out_end)
    xb = np.ascontiguousarray(x, np.float32)  # (x itself, the usual case)
    pieces = pipe_pieces(plan.row_off, bounds, PIPE_PIECES)
    direct = call.backend._registered(xb.ctypes.data, d4 * T)
    host, hptr, dptr = a.host, a.hptr, a.dptr
    if direct:  # in a registered segment: up from where it lies
        src, copies = xb.ctypes.data, None
    else:  # every piece's copy into pinned memory started now, in order
        src, raw = hptr, xb.reshape(-1).view(np.uint8)
        copies = [copy_async(host[p0 * d4 : p1 * d4], raw[p0 * d4 : p1 * d4])
                  for _, p0, p1 in pieces]  # fmt: skip
    launches = pipe_tables(host, t_off, plan, bounds, subs, experts, D, dout, dptr,
                           dptr + y_off, dptr + h_off)  # fmt: skip
    gos = []
    for _, gu, dn, rel, n, max_rows, max_ie, max_dout in launches:
        tp = dptr + t_off + rel
        go = moe_launch(gu, dn, n, max_rows, max_ie, max_dout, n_sm)
        gos.append((go, (np.uint64(tp + gt.counter_bytes(n)), np.uint64(tp))))
    up_s, down_s = a.streams()
    up, down, comp = up_s.ptr, down_s.ptr, call.stream.ptr
    ev = a.pipe_events(2 * len(pieces) + 4 * len(launches))
    rt = cupy.cuda.runtime
    record, wait, copy = rt.eventRecord, rt.streamWaitEvent, rt.memcpyAsync
    h2d: list[tuple[int, int]] = []
    kern: list[tuple[int, int]] = []
    d2h: list[tuple[int, int]] = []
    e = i = 0
    ro = plan.row_off
    for k, (go, args) in enumerate(gos):
        while i < len(pieces) and pieces[i][0] == k:
            _, p0, p1 = pieces[i]
            if copies is not None:
                for f in copies[i]:
                    f.result()
            s0, s1 = ev[e], ev[e + 1]
            e += 2
            record(s0, up)
            if i == 0:  # the tables (the moe counters zero) before any launch
                copy(dptr + t_off, hptr + t_off, in_end - t_off, H2D, up)
            copy(dptr + p0 * d4, src + p0 * d4, (p1 - p0) * d4, H2D, up)
            record(s1, up)
            h2d.append((s0, s1))
            i += 1
        k0, k1, d0, d1 = ev[e : e + 4]
        e += 4
        wait(comp, h2d[-1][1], 0)
        record(k0, comp)
        if go is not None:
            go(*args)
        record(k1, comp)
        kern.append((k0, k1))
        wait(down, k1, 0)
        record(d0, down)
        r0, r1 = ro[bounds[k]], ro[bounds[k + 1]]
        copy(hptr + y_off + r0 * o4, dptr + y_off + r0 * o4, (r1 - r0) * o4, D2H, down)
        record(d1, down)
        d2h.append((d0, d1))
    call.spans = (h2d, kern, d2h)
    call.done = d2h[-1][1]  # after every copy down, every launch and every copy up
    call.out = (y_off, o4 * N, (N, dout))
