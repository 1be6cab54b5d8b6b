"""The expert-group ops' host side (``expert_group``, ``expert_group_issue``,
``expert_group_routed``): the plan of a group's launches, its job tables packed straight into
the call's pinned buffer, its arena layout and its launches (kernels: ``moe``/``moe_tc``/
``moe_pf`` and ``gemv`` in gemv.cu, gemv_tc.cu (+ its .cuh), prefill_tc.cu; ``route_gather`` /
``route_combine`` in route.cu; reference: ``reference.expert_group``; tests:
``tests/kernels/test_expert_group.py``). The pipelined prefill path is
``kernels/expert_group_pipe.py``'s; its switches (``PIPELINE``, ``PIPE_BYTES``, ``PIPE_EDGE``)
are read from the environment here.

Experts whose gate and up share one spec (format, size, group size) and whose down has the
same format run in ONE persistent moe launch per (gate/up spec, down spec) combination: one
launch for a model's usual group. Any other expert (gate and up of different formats or group
sizes, say) runs unfused and still exact: gate and up as separate gemv jobs, silu times up
elementwise, then down as a gemv job. With ``matmul.STREAM`` on, a fused combination that
gemv_st serves (fmt 2, decode rows) runs as two streamed gemv launches instead of its moe
launch: gate and up together (dual jobs) into the hidden buffer, then down (``_streamed``).

With ``PIPELINE`` on (the default; ``COLIWORKER_PREFILL_PIPELINE=0`` turns it off),
prefill-sized groups (x of at least ``PIPE_BYTES``, every expert in the one fused launch) are
pipelined: runs of experts whose copies up, kernels and copies down overlap, to the same bits
as the one launch (``kernels/expert_group_pipe.py``, which ``issue`` imports only past its size
test). Smaller groups (decode) keep one H2D, the launches and one D2H, as a CUDA graph once
seen before.

The plan and the tables (``route_plan``, ``plan_group``, ``write_group``, and ``group_shape``
and ``patch``, which let other experts of one shape reuse a plan) need no CuPy: they are timed
and tested on any machine; the launches import CuPy when they are first built.
Residents are duck-typed: ``spec`` (an interned ``WeightSpec``: specs compare by identity),
``fmt``, ``out_features`` and ``ptrs`` (device addresses of weights and scales). ``call`` is
the backend's call context (``server/cupy_calls.py``: ``take``, ``reserve``, ``put``,
``send``, ``launch``, ``receive``, ``issue``, ``finish``, and ``new_replay`` / ``replay``: a
kept plan's graph launched without listing its work again).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coliworker.kernels.pinned import align, put_host
from coliworker.kernels.records import GEMV_JOB, MOE_JOB

#: Host plans an arena keeps (its ``plans``); past this it drops them all.
PLANS_PER_ARENA = 1024


#: Routed groups of at most this many (token, expert) pairs are planned in plain Python: at
#: decode (8 pairs) a dozen small NumPy calls cost several times more than the loop.
SMALL_ROUTES = 64


@dataclass
class RoutePlan:
    """A routed group as a packed one: the experts used (ascending), their packed row counts,
    the token of each packed row (``src``) and the packed row of each (token, slot) pair
    (``pos``, flat index t * K + j). Each expert's packed rows are its tokens in ascending
    order; ``x_rows[c]`` is the token the rows of used expert c start at when every expert's
    tokens are consecutive (always at one token: the tables then read x in place), else None."""

    used: list[int]
    rows: list[int]
    src: np.ndarray  # int32 [T * K]
    pos: np.ndarray  # int32 [T * K]
    x_rows: list[int] | None


def route_plan(routes: np.ndarray, n_experts: int, small: bool | None = None) -> RoutePlan:
    """Plan routes int [T, K] (indexes below ``n_experts``, already checked) as packed rows.
    ``small``: plain Python (True) or NumPy (False); None picks by size (``SMALL_ROUTES``)."""
    T, K = routes.shape
    n = T * K
    if small is None:
        small = n <= SMALL_ROUTES
    if small and T == 1:  # one token (decode): each expert used once, in ascending order
        flat = routes.ravel().tolist()
        used = sorted(set(flat))
        if len(used) == K:
            rank = {e: c for c, e in enumerate(used)}
            return RoutePlan(used, [1] * K, np.zeros(K, np.int32),
                             np.array([rank[e] for e in flat], np.int32), [0] * K)  # fmt: skip
    if small:
        flat = routes.ravel().tolist()
        counts = [0] * n_experts
        for e in flat:
            counts[e] += 1
        used = [e for e, c in enumerate(counts) if c]
        rows = [counts[e] for e in used]
        nxt = [0] * n_experts
        p = 0
        for e in used:
            nxt[e] = p
            p += counts[e]
        pos, src = [0] * n, [0] * n
        for i, e in enumerate(flat):  # flat order is token order: each expert's rows ascend
            q = nxt[e]
            nxt[e] = q + 1
            pos[i] = q
            src[q] = i // K
        x_rows: list[int] | None = []
        q = 0
        for c in rows:
            first = src[q]
            if c > 1 and src[q : q + c] != list(range(first, first + c)):
                x_rows = None
                break
            x_rows.append(first)  # type: ignore[union-attr]
            q += c
        return RoutePlan(used, rows, np.array(src, np.int32), np.array(pos, np.int32), x_rows)
    flat_a = np.ascontiguousarray(routes, np.int64).reshape(-1)
    order = np.argsort(flat_a, kind="stable")  # packed row p holds (t, j) = divmod(order[p], K)
    counts_a = np.bincount(flat_a, minlength=n_experts)
    used_a = np.flatnonzero(counts_a)
    rows_a = counts_a[used_a]
    src_a = (order // K).astype(np.int32)
    pos_a = np.empty(n, np.int32)
    pos_a[order] = np.arange(n, dtype=np.int32)
    starts = np.cumsum(rows_a) - rows_a
    step = np.diff(src_a) == 1
    step[starts[1:] - 1] = True
    x_rows = src_a[starts].tolist() if step.all() else None
    return RoutePlan(used_a.tolist(), rows_a.tolist(), src_a, pos_a, x_rows)


def counter_bytes(n_jobs: int) -> int:
    """Bytes of moe's int32 counters [1 + n_jobs] before its job table (16-byte aligned)."""
    return -(-4 * (1 + n_jobs) // 16) * 16


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass
class GroupPlan:
    """How an expert group runs: fused launches (gate/up spec, down spec, expert indices), the
    unfused experts, packed row and hidden offsets per expert (plus the totals) and the bytes
    of every table together."""

    fused: list[tuple[Any, Any, list[int]]]
    unfused: list[int]
    rows: list[int]
    row_off: list[int]
    hid_off: list[int]
    table_bytes: int

    @property
    def n_rows(self) -> int:
        return self.row_off[-1]

    @property
    def n_hid(self) -> int:
        return self.hid_off[-1]


def _fused_bytes(n: int) -> int:
    """Table bytes of n fused experts: one moe table (counters and records), or the two gemv
    tables of a streamed group (write_group), whichever is larger."""
    return _pad16(max(counter_bytes(n) + MOE_JOB.size * n, 2 * GEMV_JOB.size * n))


def plan_group(experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int]) -> GroupPlan:
    """Experts whose gate and up share one spec and whose down has the same format are fused,
    one moe launch per (gate/up spec, down spec); the others run unfused (module docstring)."""
    rows = [int(r) for r in rows]
    row_off = [0]
    hid_off = [0]
    for (g, _, _), r in zip(experts, rows, strict=True):
        row_off.append(row_off[-1] + r)
        hid_off.append(hid_off[-1] + r * g.out_features)
    g0, _, d0 = experts[0]
    gs, ds = g0.spec, d0.spec
    if ds.fmt == gs.fmt and all(
        g.spec is gs and u.spec is gs and d.spec is ds for g, u, d in experts
    ):  # the usual group: one launch
        n = len(experts)
        return GroupPlan([(gs, ds, list(range(n)))], [], rows, row_off, hid_off,
                         _fused_bytes(n))  # fmt: skip
    fused: dict[tuple[int, int], tuple[Any, Any, list[int]]] = {}
    unfused: list[int] = []
    for c, (g, u, d) in enumerate(experts):
        if g.spec is u.spec and d.fmt == g.fmt:
            fused.setdefault((id(g.spec), id(d.spec)), (g.spec, d.spec, []))[2].append(c)
        else:
            unfused.append(c)
    size = sum(_fused_bytes(len(cs)) for *_, cs in fused.values())
    size += 3 * GEMV_JOB.size * len(unfused)
    return GroupPlan(list(fused.values()), unfused, rows, row_off, hid_off, size)


def write_group(
    buf: Any, off: int, plan: GroupPlan, experts: Sequence[tuple[Any, Any, Any]], d: int,
    dout: int, x_ptr: int, y_ptr: int, h_ptr: int, hu_ptr: int,
    x_at: Sequence[int] | None = None, stream: Callable[[Any, Any, int], bool] | None = None,
    slots: list[tuple[int, int, tuple[int, ...]]] | None = None,
) -> list[tuple]:  # fmt: skip
    """Pack every table of a group into ``buf`` (writable bytes, uint8 NumPy array) at ``off``
    and return the launches that read them, with offsets relative to ``off``.

    ``slots`` (fused experts only): filled with where the tables hold the experts' own
    addresses, ``(offset from off, expert c, matrices)``: the ``ptrs`` of matrices
    (0 gate, 1 up, 2 down) of expert c lie there one after another. Everything else in the
    tables depends only on the experts' specs, widths and rows (``patch`` rewrites the
    addresses for other experts of that shape).

    x float32 [N, d] packed rows at x_ptr (or expert c's rows at ``x_at[c]``: a routed group
    whose experts each read consecutive token rows needs no packed copy), y [N, dout] at
    y_ptr, hidden [sum rows*ie] at h_ptr (and up's, for unfused experts, at hu_ptr).
    Launches: ("moe", gu, dn, offset, n, max_rows, max_ie, max_dout), ("gemv", spec, offset,
    n, max_rows, max_out[, dual]) or ("silu_mul", floats): the unfused experts' h = silu(h) *
    hu over the whole hidden buffer (the fused experts' part is dead by then: their moe
    launches come first and consume it). ``stream(gu, dn, max_rows)`` true (matmul's
    ``stream_eligible`` for both): the fused experts run as two streamed gemv launches
    instead of one moe launch, gate and up (dual) into the hidden buffer, then down.
    """
    rows, row_off, hid_off = plan.rows, plan.row_off, plan.hid_off
    d4, o4 = 4 * d, 4 * dout
    xs = list(x_at) if x_at is not None else [x_ptr + r * d4 for r in row_off[:-1]]
    launches: list[tuple] = []
    pos = off
    pack = MOE_JOB.pack_into
    for gu, dn, cs in plan.fused:
        if stream is not None and stream(gu, dn, max(rows[c] for c in cs)):
            pos = _write_streamed(buf, pos, off, gu, dn, cs, experts, rows, d, dout, xs,
                                  [h_ptr + 4 * hid_off[c] for c in cs],
                                  [y_ptr + row_off[c] * o4 for c in cs], launches,
                                  slots)  # fmt: skip
            continue
        cb = counter_bytes(len(cs))
        buf[pos : pos + cb] = 0  # the moe counters start at zero
        p = pos + cb
        max_rows = max_ie = max_dout = 0
        for c in cs:
            g, u, dd = experts[c]
            r, ie, do = rows[c], g.out_features, dd.out_features
            pack(buf, p, *g.ptrs, *u.ptrs, *dd.ptrs, xs[c],
                 h_ptr + 4 * hid_off[c], y_ptr + row_off[c] * o4, r, ie, do, 0)  # fmt: skip
            if slots is not None:
                slots.append((p - off, c, (0, 1, 2)))
            p += MOE_JOB.size
            max_rows, max_ie, max_dout = max(max_rows, r), max(max_ie, ie), max(max_dout, do)
        launches.append(("moe", gu, dn, pos - off, len(cs), max_rows, max_ie, max_dout))
        pos += _pad16(p - pos)
    if not plan.unfused:
        return launches
    first: dict[int, tuple[Any, list[tuple]]] = {}
    second: dict[int, tuple[Any, list[tuple]]] = {}
    for c in plan.unfused:
        g, u, dd = experts[c]
        r, ie = rows[c], g.out_features
        xp = xs[c]
        hg, hu = h_ptr + 4 * hid_off[c], hu_ptr + 4 * hid_off[c]
        first.setdefault(id(g.spec), (g.spec, []))[1].append((*g.ptrs, 0, 0, xp, hg, r, ie, d, ie))
        first.setdefault(id(u.spec), (u.spec, []))[1].append((*u.ptrs, 0, 0, xp, hu, r, ie, d, ie))
        second.setdefault(id(dd.spec), (dd.spec, []))[1].append(
            (*dd.ptrs, 0, 0, hg, y_ptr + row_off[c] * o4, r, dd.out_features, ie, dout)
        )
    for phase in (first, second):
        for spec, recs in phase.values():
            start = pos
            for rec in recs:
                GEMV_JOB.pack_into(buf, pos, *rec)
                pos += GEMV_JOB.size
            launches.append(("gemv", spec, start - off, len(recs), max(r[6] for r in recs),
                             max(r[7] for r in recs)))  # fmt: skip
        if phase is first:
            launches.append(("silu_mul", plan.n_hid))
    return launches


def _write_streamed(
    buf: Any, pos: int, off: int, gu: Any, dn: Any, cs: list[int],
    experts: Sequence[tuple[Any, Any, Any]], rows: list[int], d: int, dout: int,
    xs: list[int], hs: list[int], ys: list[int], launches: list[tuple],
    slots: list[tuple[int, int, tuple[int, ...]]] | None = None,
) -> int:  # fmt: skip
    """write_group's streamed fused experts cs: the gate+up table (one dual gemv job per
    expert: its x rows xs[c] -> its hidden rows at hs[i]) and the down table (hidden -> its y
    rows at ys[i]), their two launches appended (and the experts' address slots, as
    write_group's); returns the position after them."""
    pack = GEMV_JOB.pack_into
    start = pos
    max_rows = max_ie = max_dout = 0
    for c, hc in zip(cs, hs, strict=True):
        g, u, _ = experts[c]
        r, ie = rows[c], g.out_features
        pack(buf, pos, *g.ptrs, *u.ptrs, xs[c], hc, r, ie, d, ie)
        if slots is not None:
            slots.append((pos - off, c, (0, 1)))
        pos += GEMV_JOB.size
        max_rows, max_ie = max(max_rows, r), max(max_ie, ie)
    launches.append(("gemv", gu, start - off, len(cs), max_rows, max_ie, True))
    start = pos
    for c, hc, yc in zip(cs, hs, ys, strict=True):
        g, _, dd = experts[c]
        do = dd.out_features
        pack(buf, pos, *dd.ptrs, 0, 0, hc, yc, rows[c], do, g.out_features, dout)
        if slots is not None:
            slots.append((pos - off, c, (2,)))
        pos += GEMV_JOB.size
        max_dout = max(max_dout, do)
    launches.append(("gemv", dn, start - off, len(cs), max_rows, max_dout))
    return pos


_silu_mul: Any = None


def _silu() -> Any:
    """h = silu(g) * u elementwise (the unfused experts), a CuPy kernel built once."""
    global _silu_mul
    if _silu_mul is None:
        import cupy

        _silu_mul = cupy.ElementwiseKernel(
            "float32 g, float32 u", "float32 h", "h = g / (1.f + expf(-g)) * u", "coli_silu_mul"
        )
    return _silu_mul


def _launches(
    call: Any, launches: list[tuple], t_ptr: int, h_ptr: int, hu_ptr: int, n_sm: int
) -> list[tuple]:
    """(launch, arguments) of a group's kernels, in order, from ``write_group``'s list."""
    import cupy

    from coliworker.kernels.matmul import gemv_launch, moe_launch

    out: list[tuple] = []
    for ln in launches:
        if ln[0] == "moe":
            _, gu, dn, off, n, max_rows, max_ie, max_dout = ln
            go = moe_launch(gu, dn, n, max_rows, max_ie, max_dout, n_sm)
            if go is not None:
                ptr = t_ptr + off
                out.append((go, (np.uint64(ptr + counter_bytes(n)), np.uint64(ptr))))
        elif ln[0] == "gemv":
            _, spec, off, n, max_rows, max_out, *dual = ln
            go = gemv_launch(spec, n, max_rows, max_out, *dual)
            if go is not None:
                out.append((go, (np.uint64(t_ptr + off),)))
        else:
            k = ln[1]
            mem = cupy.cuda.UnownedMemory(h_ptr, hu_ptr - h_ptr + 4 * k, call.arena)
            hh = cupy.ndarray((k,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
            hu = cupy.ndarray((k,), cupy.float32, cupy.cuda.MemoryPointer(mem, hu_ptr - h_ptr))
            out.append((_silu(), (hh, hu, hh)))
    return out


def _streamed(gu: Any, dn: Any, max_rows: int) -> bool:
    """Whether a fused (gate/up spec, down spec) group runs as two streamed gemv launches
    (matmul.STREAM and both specs served by gemv_st) rather than one moe launch."""
    from coliworker.kernels import matmul as mm

    return mm.stream_eligible(gu, max_rows, True) and mm.stream_eligible(dn, max_rows)


#: The experts' addresses in a table slot, by matrices (write_group's ``slots``).
_ADDRS = {n: struct.Struct(f"<{2 * n}Q") for n in (1, 2, 3)}


_BYTES = {n: struct.Struct(f"{16 * n}s") for n in (1, 2, 3)}


def patch(buf: Any, off: int, slots: Sequence[tuple[int, int, tuple[int, ...]]],
          triples: Sequence[tuple[Any, tuple, bytes]]) -> None:  # fmt: skip
    """Tables that ``write_group`` packed at ``off`` of ``buf`` for experts of the same shape
    (specs, widths, rows) made those of the experts of ``triples`` (their ``_triple`` entries):
    their addresses written into ``slots`` (``write_group``'s), nothing else changes. A slot's
    matrices are consecutive (all three, gate and up, or down), so its bytes are one range of
    the triple's packed addresses."""
    bytes3 = _BYTES[3].pack_into
    for pos, c, ms in slots:
        b = triples[c][2]
        if len(ms) == 3:  # a moe record: all three (the usual slot)
            bytes3(buf, off + pos, b)
        else:
            _BYTES[len(ms)].pack_into(buf, off + pos, b[16 * ms[0] : 16 * ms[-1] + 16])


#: Triples whose shape and addresses ``_triple`` keeps (cleared when full): a model's experts.
TRIPLES_KEPT = 8192
_triples: dict[int, tuple[Any, tuple, bytes]] = {}


def _triple(t: tuple[Any, Any, Any]) -> tuple[Any, tuple, bytes]:
    """(t, its part of ``group_shape``, its six addresses packed): made once per triple (the
    worker resolves an expert list to the same triple objects every call; the entry holds
    the triple, so its id stays its own while the entry lives)."""
    e = _triples.get(id(t))
    if e is None or e[0] is not t:
        g, u, d = t
        if len(_triples) >= TRIPLES_KEPT:
            _triples.clear()
        e = _triples[id(t)] = (
            t,
            (id(g.spec), id(u.spec), id(d.spec), g.out_features, d.out_features),
            _ADDRS[3].pack(*g.ptrs, *u.ptrs, *d.ptrs),
        )
    return e


_modules: dict[str, Any] = {}


def _module(name: str) -> Any:
    """``coliworker.kernels.<name>`` (matmul, route: they import CuPy), imported on first use;
    a dictionary lookup per call after that, where an import statement costs a microsecond."""
    mod = _modules.get(name)
    if mod is None:
        import importlib

        mod = _modules[name] = importlib.import_module(f"coliworker.kernels.{name}")
    return mod


def group_shape(triples: Sequence[tuple[Any, tuple, bytes]]) -> tuple:
    """What a group's plan and tables depend on beside the experts' addresses, from the
    experts' ``_triple`` entries: each expert's gate, up and down specs (interned: by identity)
    and its hidden and output widths."""
    return tuple([t[1] for t in triples])


def prepare(
    call: Any, experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int], x: np.ndarray,
    n_sm: int, extra_in: int = 0, x_rows: Sequence[int] | None = None, extra_out: int = 0,
) -> tuple[Any, list[tuple], dict[str, int], Any]:  # fmt: skip
    """Plan a group, reserve its arena and write its inputs; returns the arena, the launches,
    the offsets and the plan's ``Replay`` (its kept graph; None where no plan is kept: unfused
    experts). Inputs: x float32 [T, D] at 0, the tables, ``extra_in`` more bytes at
    "extra", up to "in_end". Outputs: y float32 [N, dout] at "y", then ``extra_out`` more
    bytes at "out". Device scratch: hidden (and up's, for unfused experts), then, for a
    routed group that gathers (``x_rows`` None and ``extra_in``), the packed x float32
    [N, D] at "xp" that the tables read. ``x_rows[c]``: the token row expert c's
    (consecutive) rows start at; the tables then read x in place.

    Plans are kept in the arena twice (where every expert runs fused): by the experts
    themselves (the same experts and shapes: a later call copies the tables in whole) and by
    the group's shape (``group_shape``: other experts of the same specs, widths and rows, as
    a decode call's routed experts change from token to token: the tables are copied in and
    ``patch`` writes these experts' addresses into them). The launches and the layout are the
    shape's either way."""
    mm = _module("matmul")
    T, D = x.shape
    a = call.take()
    xr = None if x_rows is None else tuple(x_rows)
    settings = mm.settings()
    key = ("group", settings, *map(id, experts), *rows, T, D, extra_in, extra_out, xr)
    hit = a.plans.get(key)
    triples = None  # the experts' _triple entries, looked up once where a plan is not theirs
    if hit is None:
        triples = [_triple(t) for t in experts]
        skey = ("group shape", settings, group_shape(triples), *rows, T, D, extra_in,
                extra_out, xr)  # fmt: skip
        hit = a.plans.get(skey)
    if hit is not None:  # where: None for the same experts, else the address slots to patch
        _, end, out_end, t_off, table, where, calls, off, rep = hit
        a.reserve(end, out_end)
        call.put(0, x, 4 * T * D)
        a.host[t_off : t_off + len(table)] = table
        if where is not None:
            patch(a.host, t_off, where, triples)  # type: ignore[arg-type]
        return a, calls, off, rep
    plan = plan_group(experts, rows)
    N, dout = max(plan.n_rows, 1), experts[0][2].out_features
    t_off = align(4 * T * D)
    e_off = align(t_off + plan.table_bytes)
    in_end = e_off + extra_in
    y_off = align(in_end)
    o_off = align(y_off + 4 * N * dout)
    out_end = o_off + extra_out
    h_off = align(out_end)
    n_hid = max(plan.n_hid, 1)
    hu_off = align(h_off + 4 * n_hid)
    xp_off = align(hu_off + (4 * n_hid if plan.unfused else 0))
    packed = bool(extra_in) and x_rows is None
    end = xp_off + (4 * N * D if packed else 0)
    a = call.reserve(end, out_end)
    call.put(0, x, 4 * T * D)
    base = a.dptr
    x_at = None if x_rows is None else [base + 4 * D * r for r in x_rows]
    slots: list[tuple[int, int, tuple[int, ...]]] = []
    launches = write_group(a.host, t_off, plan, experts, D, dout,
                           base + (xp_off if packed else 0), base + y_off, base + h_off,
                           base + hu_off, x_at, _streamed, slots)  # fmt: skip
    calls = _launches(call, launches, base + t_off, base + h_off, base + hu_off, n_sm)
    off = {"extra": e_off, "in_end": in_end, "y": y_off, "out": o_off, "xp": xp_off}
    rep = None
    if not plan.unfused:  # (unfused experts' launches hold views of this call's arena)
        if len(a.plans) >= PLANS_PER_ARENA - 1:
            a.plans.clear()
        # The entry holds the triples: their ids in the key stay theirs while it lives. Both
        # entries list the same work (the same layout and launches): one kept graph.
        table = a.host[t_off : t_off + plan.table_bytes].copy()
        rep = call.new_replay()
        a.plans[key] = (list(experts), end, out_end, t_off, table, None, calls, off, rep)
        a.plans[skey] = (None, end, out_end, t_off, table, slots, calls, off, rep)
    return a, calls, off, rep


#: Groups whose x has at least this many bytes are pipelined (kernels/expert_group_pipe.py)
#: when every expert runs in the one fused launch: 16 MiB is 683 rows at D = 6144; decode
#: groups (a few rows, KBs) stay far below and keep the graph path. Below this the copies are
#: short enough that the launches and events of a pipeline cost more than the overlap wins.
PIPE_BYTES = 16 << 20
#: The pipelined path (the same bits as the one launch: test_expert_group_pipe.py and
#: test_backend_cupy.py in tests/kernels); COLIWORKER_PREFILL_PIPELINE=0 keeps the one launch
#: for every group.
PIPELINE = os.environ.get("COLIWORKER_PREFILL_PIPELINE", "1") != "0"


def _pipe_edge(text: str | None) -> float:
    """``PIPE_EDGE`` from COLIWORKER_PIPE_EDGE's text (None: unset, 0.5); a ValueError for
    anything but a number in (0, 1]."""
    if text is None:
        return 0.5
    try:
        edge = float(text)
    except ValueError:
        edge = float("nan")
    if not 0 < edge <= 1:  # nan too
        raise ValueError(f"COLIWORKER_PIPE_EDGE={text!r}: must be a number in (0, 1]")
    return edge


#: The first and the last pipelined run's rows as a share of a middle run's
#: (``expert_group_pipe.pipe_bounds``): nothing hides the first run's copy up or the last run's
#: kernel and copy down, so shorter edge runs shorten the pipeline's fill and drain, at the cost
#: of longer middle runs. 0.5: on the H200 (bench/results/prefill-edge-2026-12-01.md) the
#: 64 x 32 prefill group with x in a registered segment took 2.33-2.42 ms at 0.5 against
#: 2.69-2.74 ms with equal runs (1.0) and 2.46-2.50 ms at 0.25, the same bits at every share;
#: COLIWORKER_PIPE_EDGE sets it, in (0, 1]. Read here, at import, so that a bad value stops the
#: worker at its start (the pipe module is imported at the first prefill call only).
PIPE_EDGE = _pipe_edge(os.environ.get("COLIWORKER_PIPE_EDGE"))


def issue(
    call: Any, experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int], x: np.ndarray,
    n_sm: int,
) -> None:  # fmt: skip
    """An expert group's device work, issued; its result is ``call.finish()``'s. Pipelined
    where ``expert_group_pipe.pipe_plan`` says so (prefill), else one H2D, the launches and one
    D2H."""
    if PIPELINE and 4 * x.size >= PIPE_BYTES:
        from coliworker.kernels import expert_group_pipe as pipe  # prefill only, past the test

        pp = pipe.pipe_plan(experts, rows, x)
        if pp is not None:
            pipe.issue_pipelined(call, experts, pp, x, n_sm)
            return
    N = x.shape[0]
    dout = experts[0][2].out_features
    _, calls, off, rep = prepare(call, experts, rows, x, n_sm)
    if rep is not None and call.replay(rep):
        return
    call.send(off["in_end"])
    for go, args in calls:
        call.launch(go, *args)
    call.receive(off["y"], (N, dout))
    call.issue()


def routed(
    call: Any, experts: Sequence[tuple[Any, Any, Any]], x: np.ndarray, routes: np.ndarray,
    weights: np.ndarray, n_sm: int,
) -> Any:  # fmt: skip
    """A routed group: the used experts as a packed group, then each token's weighted sum of
    its experts' rows (route_combine), reading x in place where every expert's tokens are
    consecutive, else through a packed copy (route_gather)."""
    route = _module("route")
    T, K = routes.shape
    D = x.shape[1]
    n = T * K
    rp = route_plan(routes, len(experts))
    sel = [experts[e] for e in rp.used]
    d_out = experts[0][2].out_features
    extra = align(4 * n) * 2 + (0 if rp.x_rows is not None else 4 * n)  # pos, w (, src)
    a, calls, off, rep = prepare(call, sel, rp.rows, x, n_sm, extra, rp.x_rows, 4 * T * d_out)
    base, o0 = a.dptr, off["extra"]
    o1, o2 = o0 + align(4 * n), o0 + 2 * align(4 * n)
    put_host(a.host, o0, rp.pos, 4 * n, np.int32)
    put_host(a.host, o1, weights, 4 * n)
    if rp.x_rows is None:
        put_host(a.host, o2, rp.src, 4 * n, np.int32)
    if rep is not None and call.replay(rep):  # the same plan: the same work, as its graph
        return call.finish()
    combine = route.combine_launch(T, K, d_out)
    u64 = np.uint64
    call.send(off["in_end"])
    if rp.x_rows is None:
        call.launch(route.gather_launch(n, D), u64(base + off["xp"]), u64(base), u64(base + o2))
    for go, args in calls:
        call.launch(go, *args)
    call.launch(combine, u64(base + off["out"]), u64(base + off["y"]), u64(base + o0),
                u64(base + o1))  # fmt: skip
    call.receive(off["out"], (T, d_out))
    return call.finish()
