"""The MLA attention ops' host side (``attention``, ``attention_ragged``; reference
``reference.attention`` / ``reference.attention_ragged``; tests ``tests/kernels/test_attention.py``
and ``test_arena_writes_cpu.py``): ``run`` chains every launch of a call in its arena (``call``:
the backend's call context, ``server/cupy_calls.py``) -- absorb (which also writes a ragged
call's new cache rows), attend (+ merge), the value projection (+ o_proj) as gemv jobs -- with
the call shape's plan (launches, arena layout, gemv jobs, views of its inputs, the kept graph)
kept in the arena. The launches and the switches that pick them are ``kernels/attention.py``'s
(read there on every call, so a switch set at run time counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from coliworker.kernels import attention as att
from coliworker.kernels import matmul as mm
from coliworker.kernels.expert_group import PLANS_PER_ARENA
from coliworker.kernels.matmul import gemv_launch
from coliworker.kernels.pinned import align, at, stack_into
from coliworker.kernels.records import GEMV_JOB, KV_DESC

_jobs_cache: dict[tuple, bytes] = {}


def head_jobs(kv_b: Any, q_dim: int, v_dim: int, s: int, heads: int,
               cl: int, ctx: int) -> bytes:  # fmt: skip
    """The value projection's GemvJob records, one per head (cached: with a reused arena
    the same call shape gives the same bytes)."""
    w0, s0 = kv_b.row_ptrs(q_dim)
    k = kv_b.in_features
    key = (w0, s0, q_dim, v_dim, s, heads, cl, ctx)
    b = _jobs_cache.get(key)
    if b is None:
        h = np.arange(heads, dtype=np.uint64)
        t = np.zeros(heads, GEMV_JOB.dtype)
        t["w0"] = w0 + h * ((q_dim + v_dim) * kv_b.layout.ld)
        t["s0"] = s0 + h * ((q_dim + v_dim) * kv_b.layout.ngp * 4 if kv_b.fmt else 0)
        t["x"] = cl + h * (4 * s * k)
        t["y"] = ctx + h * (4 * v_dim)
        t["rows"], t["out_rows"] = s, v_dim
        t["x_stride"], t["y_stride"] = k, heads * v_dim
        if len(_jobs_cache) > 256:
            _jobs_cache.clear()
        b = _jobs_cache[key] = t.tobytes()
    return b


def _key(
    kv_b: Any, o_proj: Any | None, q: np.ndarray, batch: bool, t_max: int, q_dim: int,
    rope_dim: int, v_dim: int, scale: float, latents: Sequence[np.ndarray], n_sm: int,
) -> tuple[tuple, int, int, bool]:  # fmt: skip
    """A call's plan key in its arena, with what the plan is made from: (key, nsplit, the rows
    uploaded, flash)."""
    S, H = q.shape[0], q.shape[1]
    K, R = kv_b.in_features, rope_dim
    flash = att.flash_ok(K, R)
    if flash:
        nsplit = att.flash_splits(S, H, t_max, n_sm, K, R)
    else:
        nsplit = att.attend_splits(S, H, K, R, t_max, n_sm)
    n_up = sum(map(len, latents))
    key = ("attention", id(kv_b), id(o_proj), S, H, q_dim, R, v_dim, scale, n_up, nsplit,
           batch, flash, mm.settings(), att.ABSORB_W, att.FL_CLUSTER, att.FL_F16,
           att.FL_KP, att.QSPLIT_FUSED, att.MERGE_ZG)  # fmt: skip
    return key, nsplit, n_up, flash


def _inputs(
    a: Any, last: Any, plan: tuple, S: int, caches: Sequence[Any] | None, fresh: Sequence[int],
    latents: Sequence[np.ndarray], ropes: Sequence[np.ndarray], n_up: int,
) -> None:  # fmt: skip
    """A call's inputs but q into arena ``a``'s host half, by its kept ``plan``: the new cache
    rows, the KvDescs, and the gemv jobs where the arena does not hold them already (``last``:
    the plan whose constant bytes it held when the call took it, ``Arena.keep``; ``S``: the
    call's sequences)."""
    d_off, j_off, l_off, r_off, jobs, (_, _, lv, rv) = (plan[3], plan[4], plan[5], plan[6],
                                                         plan[11], plan[14])  # fmt: skip
    host = a.hmv  # (struct writes into a memoryview: Arena.hmv)
    if n_up:
        stack_into(lv, latents)
        stack_into(rv, ropes)
    if caches is not None:
        p, src = d_off, 0
        for i, c in enumerate(caches):  # (fresh has as many: the backend checks)
            n = fresh[i]
            if c.latent is not None:
                KV_DESC.pack_into(host, p, c.latent.data.ptr, c.rope.data.ptr, c.length + n,
                                  src)  # fmt: skip
            else:
                KV_DESC.pack_into(host, p, 0, 0, 0, src)
            p += KV_DESC.size
            src += n
    else:  # batch attention: the kernels read its cache rows in the upload
        base = a.dptr
        for s in range(S):
            KV_DESC.pack_into(host, d_off + KV_DESC.size * s, base + l_off, base + r_off,
                              n_up - S + 1 + s, 0)  # fmt: skip
    if not a.keep(last, plan):
        host[j_off : j_off + len(jobs)] = jobs


def run(
    call: Any,
    kv_b: Any,
    o_proj: Any | None,
    q: np.ndarray,
    caches: Sequence[Any] | None,
    fresh: Sequence[int],
    t_max: int,
    q_dim: int,
    rope_dim: int,
    v_dim: int,
    scale: float,
    latents: Sequence[np.ndarray],
    ropes: Sequence[np.ndarray],
    n_sm: int,
) -> Any:
    """Absorb (which also writes a ragged call's new cache rows), attend (+ merge), value
    projection (+ o_proj). ``latents`` / ``ropes``: the rows to upload, stacked in order
    (batch attention: its whole cache; ragged: ``fresh[s]`` new rows of ``caches[s]``, which
    have room for them). Arena inputs: q, the KvDescs, the gemv jobs, the rows; output: ctx
    float32 [S, H*V] or o_proj's [S, D_out]; scratch: qfull, cl, ctx (with o_proj), pm, pl,
    pacc, and the split q rows qs, qe (with mla_flash_h). The plan (launches, layout, gemv jobs)
    is kept per arena and call shape."""
    S, H = q.shape[0], q.shape[1]
    key, nsplit, n_up, flash = _key(kv_b, o_proj, q, caches is None, t_max, q_dim, rope_dim,
                                    v_dim, scale, latents, n_sm)  # fmt: skip
    a = call.take()
    plan = a.plans.get(key)
    if plan is None:  # _plan sizes the arena first: a reallocated arena forgets its plans
        plan = _plan(call, kv_b, o_proj, S, H, q_dim, rope_dim, v_dim, scale, n_up, nsplit,
                     flash, caches is None)  # fmt: skip
        if len(a.plans) >= PLANS_PER_ARENA:
            a.plans.clear()
        a.plans[key] = plan
    # (a kept plan's arena is the size it was made for: it forgets its plans when it grows)
    in_end, out_off, dout, launches, rep = plan[7], plan[8], plan[9], plan[12], plan[13]
    call.put(0, q, 4 * q.size, plan[14][0])
    _inputs(a, call.last, plan, S, caches, fresh, latents, ropes, n_up)
    if call.replay(rep):  # the same plan: the same work, as its graph
        return call.finish()
    call.send(in_end)
    call.launch_all(launches)
    call.receive(out_off, (S, dout) if o_proj is not None else (S, H, v_dim))
    return call.finish()


def run_kept(
    pool: list, kv_b: Any, o_proj: Any | None, q: np.ndarray, caches: Sequence[Any],
    fresh: Sequence[int], t_max: int, q_dim: int, rope_dim: int, v_dim: int, scale: float,
    latents: Sequence[np.ndarray], ropes: Sequence[np.ndarray], n_sm: int, ready: Any,
) -> tuple[Any, Any] | None:  # fmt: skip
    """A ragged call whose plan the thread's free arena on top of ``pool`` keeps with its graph
    ready to launch and its output's view made (``ready(rep)``, ``cupy_calls.rerunnable``): that
    arena taken from the pool (``Arena.take``) with the call's inputs written as ``run`` writes
    them (the same bytes), and the plan's ``Replay``, which the backend launches without a
    ``Call`` (``cupy_calls.rerun``). None where there is no such plan, nothing taken or
    written: the call goes through ``run``."""
    key, _, n_up, _ = _key(kv_b, o_proj, q, False, t_max, q_dim, rope_dim, v_dim, scale,
                           latents, n_sm)  # fmt: skip
    a = pool[-1]
    plan = a.plans.get(key)
    if plan is None:
        return None
    rep = plan[13]
    if not ready(rep):
        return None
    last = a.take()
    plan[14][0][...] = q
    _inputs(a, last, plan, q.shape[0], caches, fresh, latents, ropes, n_up)
    return a, rep


def _launch_args(kv_b: Any, base: int, scratch: Sequence[int], d_off: int, j_off: int,
                 l_off: int, r_off: int, scatter: int, H: int, flash: bool, f16: bool,
                 launches: tuple) -> list[tuple]:  # fmt: skip
    """The call's launches with their arguments, (launch, args) in order: absorb (which writes
    a ragged call's ``scatter`` new rows into their caches, and where ``qsplit_fused`` the q
    rows split for mla_flash_h), mla_qsplit (``split``: the q rows split for mla_flash_h,
    ``f16``, by a launch of their own), attend, merge, the value projection and o_proj where
    the plan has them. Every argument is an address in the arena (``base``) or in kv_b, or a
    count in the plan's key, so a plan makes them once."""
    absorb, split, attend, merge, value, proj = launches
    u64 = np.uint64
    qfull, cl, _, pm, pl, pacc, qs, qe = (u64(base + o) for o in scratch)
    desc = u64(base + d_off)
    args = (qfull, qs, qe, u64(base), u64(kv_b.ptrs[0]), u64(kv_b.ptrs[1]), desc,
            u64(base + l_off), u64(base + r_off), np.int32(scatter))  # fmt: skip
    out: list[tuple] = [(absorb, args)]
    if split is not None:  # mla_flash_h's q rows, split once
        out.append((split, (qs, qe, qfull)))
    if f16:
        out.append((attend, (pm, pl, pacc, qs, desc, cl, qe)))
    elif flash:
        out.append((attend, (pm, pl, pacc, qfull, desc, cl)))
    else:
        out.append((attend, (pm, pl, pacc, qfull, desc)))
    if merge is not None:
        out.append((merge, (cl, pm, pl, pacc)))
    if value is not None:
        out.append((value, (u64(base + j_off),)))
    if proj is not None:
        out.append((proj, (u64(base + j_off + 64 * H),)))
    return out


def _plan(
    call: Any, kv_b: Any, o_proj: Any | None, S: int, H: int,
    q_dim: int, R: int, V: int, scale: float, n_up: int, nsplit: int, flash: bool,
    batch: bool,
) -> tuple:  # fmt: skip
    """The launches with their arguments, arena layout and gemv job bytes of one attention
    call shape in the call's arena (``run``; ``batch``: batch attention, whose kernels read
    the cache rows in the upload, else ragged, whose absorb scatters the ``n_up`` new rows);
    the plan holds kv_b and o_proj: the ids in its key stay theirs while it lives."""
    K = kv_b.in_features
    n_jobs = H + (o_proj is not None)
    absorb = att.absorb_launch(kv_b.spec, S, H, q_dim, R, V)
    split = None
    f16 = flash and att.flash_f16(K, R)  # the q rows split: by the absorb or by mla_qsplit
    if flash:
        attend, merge = att.flash_launch(S, H, K, R, scale, nsplit)
        if not att.qsplit_fused(kv_b.spec, R):
            split = att.qsplit_launch(S, H, K, R)
    else:
        attend, merge = att.attend_launch(S, H, K, R, scale, nsplit)
    value = gemv_launch(kv_b.spec, H, S, V)
    proj = gemv_launch(o_proj.spec, 1, S, o_proj.out_features) if o_proj else None
    dout = o_proj.out_features if o_proj is not None else H * V
    d_off = align(4 * S * H * (q_dim + R))
    j_off = align(d_off + KV_DESC.size * S)
    l_off = align(j_off + 64 * n_jobs)
    r_off = align(l_off + 4 * n_up * K)
    in_end = r_off + 4 * n_up * R
    out_off = align(in_end)
    sizes = [4 * S * H * (K + R), 4 * H * S * K, 4 * S * H * V if o_proj else 0,
             4 * S * H * nsplit, 4 * S * H * nsplit, 4 * S * H * nsplit * K,
             4 * S * H * att.krp16(K, R) if f16 else 0, 8 * S * H if f16 else 0]  # fmt: skip
    scratch = [align(out_off + 4 * S * dout)]
    for n in sizes[:-1]:
        scratch.append(align(scratch[-1] + n))
    dev_end, host_end = scratch[-1] + sizes[-1], out_off + 4 * S * dout
    a = call.reserve(dev_end, host_end)  # the job pointers below are this arena's
    base = a.dptr
    cl = base + scratch[1]
    ctx = base + (scratch[2] if o_proj is not None else out_off)
    jobs = bytearray(head_jobs(kv_b, q_dim, V, S, H, cl, ctx))
    if o_proj is not None:
        jobs += GEMV_JOB.pack(*o_proj.ptrs, 0, 0, ctx, base + out_off, S,
                              o_proj.out_features, H * V, o_proj.out_features)  # fmt: skip
    launches = _launch_args(kv_b, base, scratch, d_off, j_off, l_off, r_off,
                            0 if batch else n_up, H, flash, f16,
                            (absorb, split, attend, merge, value, proj))  # fmt: skip
    host = a.host  # the inputs' views: q, the new cache rows (latent, rope)
    views = (at(host, 0, (S, H, q_dim + R)), None, at(host, l_off, (n_up, K)),
             at(host, r_off, (n_up, R)))  # fmt: skip
    return ((kv_b, o_proj), dev_end, host_end, d_off, j_off, l_off, r_off, in_end, out_off,
            dout, scratch, bytes(jobs), launches,
            call.new_replay(), views)  # fmt: skip
