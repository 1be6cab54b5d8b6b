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
elementwise, then down as a gemv job. With ``gemv_stream.STREAM`` on, a fused combination that
gemv_st serves (fmt 2, decode rows) runs as two streamed gemv launches instead of its moe
launch: gate and up together (dual jobs) into the hidden buffer, then down (``_streamed``).

With ``PIPELINE`` on (the default; ``COLIWORKER_PREFILL_PIPELINE=0`` turns it off),
prefill-sized groups (x of at least ``PIPE_BYTES``, every expert in the one fused launch) are
pipelined: runs of experts whose copies up, kernels and copies down overlap, to the same bits
as the one launch (``kernels/expert_group_pipe.py``, which ``issue`` imports only past its size
test). Smaller groups (decode) keep one H2D, the launches and one D2H, as a CUDA graph once
seen before.

The plans and the tables (``route_plan``, ``plan_group``, ``write_group``, and ``group_shape``
and ``TablePatch``, which let other experts of one shape reuse a plan) are
``kernels/group_tables.py``'s and need no CuPy; the launches import CuPy when they are first
built. Residents are duck-typed: ``spec`` (an interned ``WeightSpec``: specs compare by identity),
``fmt``, ``out_features`` and ``ptrs`` (device addresses of weights and scales). ``call`` is
the backend's call context (``server/cupy_calls.py``: ``take``, ``reserve``, ``put``,
``send``, ``launch``, ``receive``, ``issue``, ``finish``, and ``new_replay`` / ``replay``: a
kept plan's graph launched without listing its work again).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from coliworker.kernels.group_tables import (
    TablePatch,
    counter_bytes,
    group_shape,
    plan_group,
    route_plan,
    triples_of,
    write_group,
)
from coliworker.kernels.pinned import align, at

#: Host plans an arena keeps (its ``plans``); past this it drops them all.
PLANS_PER_ARENA = 1024


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
    (gemv_stream.STREAM and both specs served by gemv_st) rather than one moe launch."""
    from coliworker.kernels import gemv_stream as st

    return st.stream_eligible(gu, max_rows, True) and st.stream_eligible(dn, max_rows)


_modules: dict[str, Any] = {}


def _module(name: str) -> Any:
    """``coliworker.kernels.<name>`` (matmul, route: they import CuPy), imported on first use;
    a dictionary lookup per call after that, where an import statement costs a microsecond."""
    mod = _modules.get(name)
    if mod is None:
        import importlib

        mod = _modules[name] = importlib.import_module(f"coliworker.kernels.{name}")
    return mod


def _kept_plan(
    a: Any, experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int], T: int, D: int,
    extra_in: int, extra_out: int, xr: tuple[int, ...] | None,
) -> tuple[Any, Any, tuple, tuple | None]:  # fmt: skip
    """The plan arena ``a`` keeps for this group (``prepare``'s docstring): by the experts
    themselves, else by the group's shape. Returns (the plan or None, the experts' triples_of
    entries where the shape was looked up or None, the experts' key, the shape's key or None)."""
    settings = _module("matmul").settings()
    key = ("group", settings, *map(id, experts), *rows, T, D, extra_in, extra_out, xr)
    hit = a.plans.get(key)
    if hit is not None:
        return hit, None, key, None
    triples = triples_of(experts)
    skey = ("group shape", settings, group_shape(triples), *rows, T, D, extra_in, extra_out, xr)
    return a.plans.get(skey), triples, key, skey


def _kept_tables(a: Any, last: Any, hit: tuple, triples: Any) -> None:
    """Kept plan ``hit``'s tables in arena ``a``'s host half, ``last`` being the plan whose
    constant bytes the arena held when its call took it (``Arena.keep``): the plan's own (its
    experts') tables stay where its last call left them, or are copied in where another plan's
    bytes lie; a shape's are written whole, made for these experts (``triples``) in one join
    (``TablePatch.fill``: the shape's constant bytes and these experts' addresses)."""
    _, _, _, t_off, table, where, _, _, _ = hit
    if where is None:  # the tables as made: in place where this plan's call left them
        if not a.keep(last, hit):
            a.hmv[t_off : t_off + len(table)] = table
    else:  # other experts (the arena's last plan stays unknown: take() forgot it)
        a.hmv[t_off : t_off + where.nbytes] = where.fill(triples)


def prepare(
    call: Any, experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int], x: np.ndarray,
    n_sm: int, extra_in: int = 0, x_rows: Sequence[int] | None = None, extra_out: int = 0,
) -> tuple[Any, list[tuple], dict[str, Any], Any]:  # fmt: skip
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
    a decode call's routed experts change from token to token: the tables are written whole,
    the shape's constant bytes joined with these experts' addresses, ``TablePatch``). The
    launches and the layout are the shape's either way."""
    T, D = x.shape
    a = call.take()
    xr = None if x_rows is None else tuple(x_rows)
    hit, triples, key, skey = _kept_plan(a, experts, rows, T, D, extra_in, extra_out, xr)
    if hit is not None:
        # (a kept plan's arena is the size it was made for: it forgets its plans when it grows)
        off = hit[7]
        call.put(0, x, 4 * T * D, off["xv"])
        _kept_tables(a, call.last, hit, triples)
        return a, hit[6], off, hit[8]
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
    off = {
        "extra": e_off,
        "in_end": in_end,
        "y": y_off,
        "out": o_off,
        "xp": xp_off,
        "xv": at(a.host, 0, (T, D)),
    }  # (x's view)
    rep = None
    if not plan.unfused:  # (unfused experts' launches hold views of this call's arena)
        if len(a.plans) >= PLANS_PER_ARENA - 1:
            a.plans.clear()
        # The entry holds the triples: their ids in the key stay theirs while it lives. Both
        # entries list the same work (the same layout and launches): one kept graph.
        table = a.host[t_off : t_off + plan.table_bytes].tobytes()
        rep = call.new_replay()
        a.plans[key] = (list(experts), end, out_end, t_off, table, None, calls, off, rep)
        a.plans[skey] = (None, end, out_end, t_off, table, TablePatch(table, slots), calls,
                         off, rep)  # fmt: skip
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


def group_kept(
    pool: list, experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int], x: np.ndarray,
    ready: Any,
) -> tuple[Any, Any] | None:  # fmt: skip
    """An expert group below the pipelined size (a decode step's, as a seed-ABI engine sends its
    router's experts) whose plan the thread's free arena on top of ``pool`` keeps with its graph
    ready to launch and its output's view made (``ready(rep)``, ``cupy_calls.rerunnable``): that
    arena taken from the pool (``Arena.take``) with the call's inputs written as ``issue``
    writes them (x, the tables: the same bytes), and the plan's ``Replay``, which the backend
    launches without a ``Call`` (``cupy_calls.rerun``). None where there is no such plan,
    nothing taken or written: the call goes through ``issue``."""
    if PIPELINE and 4 * x.size >= PIPE_BYTES:
        return None
    T, D = x.shape
    a = pool[-1]
    hit, triples, _, _ = _kept_plan(a, experts, rows, T, D, 0, 0, None)
    if hit is None:
        return None
    rep = hit[8]
    if rep is None or not ready(rep):
        return None
    last = a.take()
    hit[7]["xv"][...] = x
    _kept_tables(a, last, hit, triples)
    return a, rep


#: One-token routed groups (decode) run their experts in route order (``_one_token``); off:
#: every routed group goes through ``route_plan`` (experts ascending), the reference the tests
#: compare to the bit.
ROUTE_ORDER = True
_ONES = {k: [1] * k for k in range(1, 257)}  # a one-token group's rows, made once per K
_ZEROS_T = {k: (0,) * k for k in range(1, 257)}  # ... and the token row its experts read
_ARANGE = {k: np.arange(k, dtype=np.int32) for k in range(1, 257)}  # ... and its pos
for _a in _ARANGE.values():
    _a.flags.writeable = False


def _one_token(routes: np.ndarray) -> list[int] | None:
    """A one-token group's experts in route order where its K routes name K other experts
    (a router's top-k): slot j is packed row j, reading the token's row, and pos is 0..K-1.
    Each expert's output row is computed as it is in ascending order (one row per expert,
    the same launches; route_combine sums the slots in route order either way), so this
    gives ``route_plan``'s bits without its sort and rank lookups. None: plan it with
    ``route_plan`` (a repeated expert, K past the prepared lists, or ROUTE_ORDER off)."""
    if not ROUTE_ORDER:
        return None
    flat = routes.tolist()[0]
    if len(set(flat)) != len(flat) or len(flat) not in _ONES:
        return None
    return flat


def routed_kept(
    pool: list, experts: Sequence[tuple[Any, Any, Any]], x: np.ndarray, routes: np.ndarray,
    weights: np.ndarray, ready: Any,
) -> tuple[Any, Any] | None:  # fmt: skip
    """A one-token routed call (``_one_token``: K other experts) whose plan the thread's free
    arena on top of ``pool`` keeps with its graph ready to launch and its output's view made
    (``ready(rep)``, ``cupy_calls.rerunnable``): that arena taken from the pool (``Arena.take``)
    with the call's inputs written as ``routed`` writes them (x, the tables, pos, w: the same
    bytes), and the plan's ``Replay``, which the backend launches without a ``Call``
    (``cupy_calls.rerun``). None where there is no such plan, nothing taken or written: the call
    goes through ``routed``."""
    if routes.shape[0] != 1:
        return None
    one = _one_token(routes)
    if one is None:
        return None
    K = len(one)
    sel = itemgetter(*one)(experts) if K > 1 else (experts[one[0]],)
    a = pool[-1]
    an = align(4 * K)
    hit, triples, _, _ = _kept_plan(a, sel, _ONES[K], 1, x.shape[1], 2 * an,
                                    4 * experts[0][2].out_features, _ZEROS_T[K])  # fmt: skip
    if hit is None:
        return None
    off, rep = hit[7], hit[8]
    views = off.get("routes")
    if rep is None or views is None or not ready(rep):
        return None
    last = a.take()
    off["xv"][...] = x
    _kept_tables(a, last, hit, triples)
    views[0][...] = _ARANGE[K]
    views[1][...] = weights
    return a, rep


def routed(
    call: Any, experts: Sequence[tuple[Any, Any, Any]], x: np.ndarray, routes: np.ndarray,
    weights: np.ndarray, n_sm: int,
) -> Any:  # fmt: skip
    """A routed group: the used experts as a packed group, then each token's weighted sum of
    its experts' rows (route_combine), reading x in place where every expert's tokens are
    consecutive, else through a packed copy (route_gather)."""
    T, K = routes.shape
    D = x.shape[1]
    n = T * K
    one = _one_token(routes) if T == 1 else None
    if one is not None:  # one token, K other experts: each slot a packed row, in route order
        sel = itemgetter(*one)(experts) if K > 1 else (experts[one[0]],)  # experts[e] for e
        rows, x_rows, pos, src = _ONES[K], _ZEROS_T[K], _ARANGE[K], None
    else:
        rp = route_plan(routes, len(experts))
        sel = [experts[e] for e in rp.used]
        rows, x_rows, pos, src = rp.rows, rp.x_rows, rp.pos, rp.src
    d_out = experts[0][2].out_features
    an = align(4 * n)  # pos, w (, src)
    extra = an * 2 + (0 if x_rows is not None else 4 * n)
    a, calls, off, rep = prepare(call, sel, rows, x, n_sm, extra, x_rows, 4 * T * d_out)
    o0 = off["extra"]
    views = off.get("routes")
    if views is None:  # pos, w and src in the arena (kept with the plan's layout)
        h = a.host
        views = off["routes"] = (at(h, o0, (n,), np.int32), at(h, o0 + an, (T, K)),
                                 at(h, o0 + 2 * an, (n,), np.int32))  # fmt: skip
    views[0][...] = pos
    views[1][...] = weights
    if x_rows is None:
        views[2][...] = src
    if rep is not None and call.replay(rep):  # the same plan: the same work, as its graph
        return call.finish()
    route = _module("route")
    combine = route.combine_launch(T, K, d_out)
    base, o1, o2 = a.dptr, o0 + an, o0 + 2 * an
    u64 = np.uint64
    call.send(off["in_end"])
    if x_rows is None:
        call.launch(route.gather_launch(n, D), u64(base + off["xp"]), u64(base), u64(base + o2))
    for go, args in calls:
        call.launch(go, *args)
    call.launch(combine, u64(base + off["out"]), u64(base + off["y"]), u64(base + o0),
                u64(base + o1))  # fmt: skip
    call.receive(off["out"], (T, d_out))
    return call.finish()
