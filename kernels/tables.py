"""Host side of the kernels' job tables: records packed straight into a caller's (pinned)
buffer with ``struct``, and the plan of an expert group's launches.

No CuPy here: the per-call host work of a GPU call is mostly this, so it is written to be
timed and tested on any machine. Residents are duck-typed: ``spec`` (an interned
``WeightSpec``: specs compare by identity), ``fmt``, ``out_features`` and ``ptrs`` (device
addresses of weights and scales).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# ``struct GemvJob`` (gemv.cu): w0 s0 w1 s1 x y (u64), rows out_rows x_stride y_stride (i32).
GEMV_JOB = struct.Struct("<6Q4i")
# ``struct MoeJob`` (gemv.cu): wg sg wu su wd sd x h y (u64), rows ie dout pad (i32).
MOE_JOB = struct.Struct("<9Q4i")
# ``struct KvDesc`` (attention.cu): latent rope (u64), len src (i32).
KV_DESC = struct.Struct("<2Q2i")
assert GEMV_JOB.size == 64 and MOE_JOB.size == 88 and KV_DESC.size == 24


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


def plan_group(experts: Sequence[tuple[Any, Any, Any]], rows: Sequence[int]) -> GroupPlan:
    """Experts whose gate and up share one spec and whose down has the same format are fused,
    one moe launch per (gate/up spec, down spec); the others run unfused (see backend_cupy)."""
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
                         _pad16(counter_bytes(n) + MOE_JOB.size * n))  # fmt: skip
    fused: dict[tuple[int, int], tuple[Any, Any, list[int]]] = {}
    unfused: list[int] = []
    for c, (g, u, d) in enumerate(experts):
        if g.spec is u.spec and d.fmt == g.fmt:
            fused.setdefault((id(g.spec), id(d.spec)), (g.spec, d.spec, []))[2].append(c)
        else:
            unfused.append(c)
    size = sum(_pad16(counter_bytes(len(cs)) + MOE_JOB.size * len(cs)) for *_, cs in fused.values())
    size += 3 * GEMV_JOB.size * len(unfused)
    return GroupPlan(list(fused.values()), unfused, rows, row_off, hid_off, size)


def write_group(
    buf: Any, off: int, plan: GroupPlan, experts: Sequence[tuple[Any, Any, Any]], d: int,
    dout: int, x_ptr: int, y_ptr: int, h_ptr: int, hu_ptr: int,
    x_at: Sequence[int] | None = None,
) -> list[tuple]:  # fmt: skip
    """Pack every table of a group into ``buf`` (writable bytes, uint8 NumPy array) at ``off``
    and return the launches that read them, with offsets relative to ``off``.

    x float32 [N, d] packed rows at x_ptr (or expert c's rows at ``x_at[c]``: a routed group
    whose experts each read consecutive token rows needs no packed copy), y [N, dout] at
    y_ptr, hidden [sum rows*ie] at h_ptr (and up's, for unfused experts, at hu_ptr).
    Launches: ("moe", gu, dn, offset, n, max_rows, max_ie, max_dout), ("gemv", spec, offset,
    n, max_rows, max_out) or ("silu_mul", floats): the unfused experts' h = silu(h) * hu over
    the whole hidden buffer (the fused experts' part is dead by then: their moe launches come
    first and consume it).
    """
    rows, row_off, hid_off = plan.rows, plan.row_off, plan.hid_off
    d4, o4 = 4 * d, 4 * dout
    xs = list(x_at) if x_at is not None else [x_ptr + r * d4 for r in row_off[:-1]]
    launches: list[tuple] = []
    pos = off
    pack = MOE_JOB.pack_into
    for gu, dn, cs in plan.fused:
        cb = counter_bytes(len(cs))
        buf[pos : pos + cb] = 0  # the moe counters start at zero
        p = pos + cb
        max_rows = max_ie = max_dout = 0
        for c in cs:
            g, u, dd = experts[c]
            r, ie, do = rows[c], g.out_features, dd.out_features
            pack(buf, p, *g.ptrs, *u.ptrs, *dd.ptrs, xs[c],
                 h_ptr + 4 * hid_off[c], y_ptr + row_off[c] * o4, r, ie, do, 0)  # fmt: skip
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
