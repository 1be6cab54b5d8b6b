"""An expert group's plans and job tables, no CuPy: the routed plan (``route_plan``: a routed
group as a packed one), the group plan (``plan_group``: fused launches, unfused experts, row and
hidden offsets), the tables packed into the call's pinned buffer (``write_group``) and, for a
plan reused by experts of the same shape, their addresses patched in (``triples_of``,
``group_shape``, ``TablePatch``). ``kernels/expert_group.py`` (the ops' host side) and
``kernels/expert_group_pipe.py`` (the pipelined prefill) build on them; they are timed and
tested on any machine (``tests/kernels/test_expert_group.py``). Residents are duck-typed:
``spec`` (an interned ``WeightSpec``: specs compare by identity), ``fmt``, ``out_features`` and
``ptrs`` (device addresses of weights and scales).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np

from coliworker.kernels.records import GEMV_JOB, MOE_JOB

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


_ZEROS: dict[int, np.ndarray] = {}


def _zeros(k: int) -> np.ndarray:
    """int32 zeros [k], read-only, made once per k (a one-token plan's ``src``)."""
    z = _ZEROS.get(k)
    if z is None:
        z = _ZEROS[k] = np.zeros(k, np.int32)
        z.flags.writeable = False
    return z


def route_plan(routes: np.ndarray, n_experts: int, small: bool | None = None) -> RoutePlan:
    """Plan routes int [T, K] (indexes below ``n_experts``, already checked) as packed rows.
    ``small``: plain Python (True) or NumPy (False); None picks by size (``SMALL_ROUTES``)."""
    T, K = routes.shape
    n = T * K
    if small is None:
        small = n <= SMALL_ROUTES
    if small and T == 1:  # one token (decode): each expert used once, in ascending order
        flat = routes.ravel().tolist()
        used = sorted(flat)
        if len(set(used)) == K:
            packed = np.array([used.index(e) for e in flat], np.int32)
            return RoutePlan(used, [1] * K, _zeros(K), packed, [0] * K)
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
    tables depends only on the experts' specs, widths and rows (``TablePatch`` rewrites the
    addresses for other experts of that shape).

    x float32 [N, d] packed rows at x_ptr (or expert c's rows at ``x_at[c]``: a routed group
    whose experts each read consecutive token rows needs no packed copy), y [N, dout] at
    y_ptr, hidden [sum rows*ie] at h_ptr (and up's, for unfused experts, at hu_ptr).
    Launches: ("moe", gu, dn, offset, n, max_rows, max_ie, max_dout), ("gemv", spec, offset,
    n, max_rows, max_out[, dual]) or ("silu_mul", floats): the unfused experts' h = silu(h) *
    hu over the whole hidden buffer (the fused experts' part is dead by then: their moe
    launches come first and consume it). ``stream(gu, dn, max_rows)`` true (gemv_stream's
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


#: The experts' addresses in a table slot, by matrices (write_group's ``slots``).
_ADDRS = {n: struct.Struct(f"<{2 * n}Q") for n in (1, 2, 3)}


class TablePatch:
    """A shape's tables as ``write_group`` packed them (``table``, from the table's start) and
    the slots that hold its experts' addresses (``write_group``'s ``slots``, relative to that
    start): ``fill`` makes the tables of other experts of the shape (same specs, widths, rows) in
    one join, the constant runs between the slots and these experts' packed addresses. A slot's
    matrices are consecutive (all three, gate and up, or down), so its bytes are one range of
    its triple's packed addresses."""

    __slots__ = ("parts", "cs", "cuts", "nbytes", "in_order")

    def __init__(self, table: bytes, slots: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
        parts: list[bytes | None] = []
        cs, cuts, at = [], [], 0
        for pos, c, ms in sorted(slots):
            if pos < at:
                raise ValueError(f"TablePatch: slot at {pos} overlaps the one ending at {at}")
            parts += [table[at:pos], None]
            cs.append(c)
            # None: the slot holds all three matrices (the usual moe record), the whole packing
            cuts.append(None if len(ms) == 3 else (16 * ms[0], 16 * ms[-1] + 16))
            at = pos + 16 * len(ms)
        parts.append(table[at:])
        self.parts = parts
        self.cs = cs
        self.cuts = cuts
        self.nbytes = len(table)
        # one whole slot per expert, in the experts' order (a one-token routed group's)
        self.in_order = cs == list(range(len(cs))) and all(cut is None for cut in cuts)

    def fill(self, triples: Sequence[tuple[Any, int, bytes]]) -> bytes:
        """The tables for the experts of ``triples`` (their ``triples_of`` entries)."""
        parts = self.parts[:]
        if self.in_order and len(triples) == len(self.cs):
            parts[1::2] = list(map(_ADDRESSES, triples))
        else:
            parts[1::2] = [triples[c][2] if cut is None else triples[c][2][cut[0] : cut[1]]
                           for c, cut in zip(self.cs, self.cuts, strict=True)]  # fmt: skip
        return b"".join(parts)  # type: ignore[arg-type]


#: Triples whose shape and addresses ``triples_of`` keeps (cleared when full): a model's experts.
TRIPLES_KEPT = 8192
_triples: dict[int, tuple[Any, int, bytes]] = {}
#: Each distinct expert shape (its gate, up and down specs by identity, hidden and output
#: widths) as a small number, in the order first seen: a group's shape key is a tuple of these,
#: cheap to hash on every call.
_shapes: dict[tuple, int] = {}


def _keep_triple(t: tuple[Any, Any, Any]) -> tuple[Any, int, bytes]:
    """Triple ``t``'s entry (``triples_of``), made and kept."""
    g, u, d = t
    if len(_triples) >= TRIPLES_KEPT:
        _triples.clear()
    shape = (id(g.spec), id(u.spec), id(d.spec), g.out_features, d.out_features)
    e = _triples[id(t)] = (
        t,
        _shapes.setdefault(shape, len(_shapes)),
        _ADDRS[3].pack(*g.ptrs, *u.ptrs, *d.ptrs),
    )
    return e


def triples_of(experts: Sequence[tuple[Any, Any, Any]]) -> list[tuple[Any, int, bytes]]:
    """Each of ``experts``' entry: (the triple, its part of ``group_shape``: its shape's
    number, its six addresses packed), made once per triple (the worker resolves an expert list
    to the same triple objects every call), looked up in one pass. An entry holds its triple, so
    while it is kept no other object has the id it is kept under: a hit is the triple's own
    entry."""
    out = list(map(_triples.get, map(id, experts)))
    if None in out:
        for i, e in enumerate(out):
            if e is None:
                out[i] = _keep_triple(experts[i])
    return out  # type: ignore[return-value]


_SHAPE, _ADDRESSES = itemgetter(1), itemgetter(2)  # of a triples_of entry


def group_shape(triples: Sequence[tuple[Any, int, bytes]]) -> tuple:
    """What a group's plan and tables depend on beside the experts' addresses, from the
    experts' ``triples_of`` entries: each expert's gate, up and down specs (interned: by identity)
    and its hidden and output widths, as the number ``_shapes`` gives them."""
    return tuple(map(_SHAPE, triples))
