"""What a call leaves in its arena's pinned host half (the bytes its H2D copy sends: inputs,
job tables, KV descriptors), on any machine: the CuPy backend's host path over
``bench/host_python.py``'s stand-in CuPy, in a subprocess (the stand-in replaces the ``cupy``
modules of the process it runs in).

A kept plan skips rewriting its constant bytes (job tables, a routed shape's tables before
the new experts' addresses are patched in) where its own last call left them (``Arena.keep``,
through ``Call.kept`` or, for a routed group, ragged attention or expert group call of a kept
plan made without a ``Call``, ``expert_group.routed_kept``, ``attention_call.run_kept`` and
``expert_group.group_kept``; the routed one and the rerun compiled where ``server/kept.c`` is
built: both are run), and those calls must leave it as the same calls made through a ``Call``
do.
Interleaved calls of every decode op (matmul of two weights, routed groups whose experts
change, the same experts again, an expert group, ragged attention) must leave the arena byte
for byte as the same calls do with every plan's constant bytes written on every call.
"""

from __future__ import annotations

import textwrap

import pytest
from _stand_in import need_compiled, run

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.argv = ["x"]
    from bench import host_python as hp
    hp._stub_cupy()
    import cupyx
    cupyx.empty_pinned = lambda shape, dtype: np.zeros(shape, dtype)  # no stale bytes
    from coliworker.kernels import graphs
    from coliworker.server.backend_cupy import CupyBackend
    from coliworker.kernels import attention_call, expert_group, matmul
    from coliworker.server.cupy_calls import Arena

    n_fast = [0, 0, 0, 0]  # routed, ragged attention, group and matmul calls without a Call
    FAST = [(expert_group, "routed_kept"), (attention_call, "run_kept"),
            (expert_group, "group_kept"), (matmul, "run_kept")]

    def counted(i, fn):
        def kept(*a, **k):
            got = fn(*a, **k)
            n_fast[i] += got is not None
            return got
        return kept

    for i, (mod, name) in enumerate(FAST):
        setattr(mod, name, counted(i, getattr(mod, name)))

    graphs._record_fn = lambda *a: 0
    g = hp.GLM
    b = CupyBackend((0,))
    if b._compiled is not None:  # server/kept.c: its calls counted in place of the Python
        c = b._compiled
        b._compiled = c._replace(routed_kept=expert_group.routed_kept,
                                 routed=counted(0, c.routed),
                                 group_kept=expert_group.group_kept,
                                 group=counted(2, c.group),
                                 run_kept=attention_call.run_kept,
                                 ragged=counted(1, c.ragged),
                                 matmul_kept=matmul.run_kept,
                                 matmul=counted(3, c.matmul))
    print("compiled", b._compiled is not None)
    pool = [(hp.Resident(2, g["D"], g["I"]), hp.Resident(2, g["D"], g["I"]),
             hp.Resident(2, g["I"], g["D"])) for _ in range(24)]
    dense = [hp.Resident(2, 6144, 6144), hp.Resident(2, 2048, 6144)]
    kv_b = hp.Resident(2, g["K"], g["H"] * (g["Q"] + g["V"]))
    o_proj = hp.Resident(2, g["H"] * g["V"], g["D"])
    cache = hp.KV(g["K"], g["R"], 4096)

    def calls(n, seed):
        # the same sequence of calls and inputs, fresh random, for both runs
        r = np.random.default_rng(seed)
        out = []
        for i in range(n):
            kind = r.integers(0, 5)
            if kind == 0:
                w = dense[r.integers(0, 2)]
                x = r.standard_normal((1, w.in_features)).astype(np.float32)
                out.append(lambda w=w, x=x: b.matmul(w, x))
            elif kind in (1, 2):  # routed: 8 of the pool (kind 2: always the first 8)
                sel = list(range(8)) if kind == 2 else list(r.permutation(24)[:8])
                ex = [pool[e] for e in sel]
                x = r.standard_normal((1, g["D"])).astype(np.float32)
                routes = r.permutation(8).astype(np.int32).reshape(1, 8)
                wts = r.random((1, 8)).astype(np.float32)
                out.append(lambda ex=ex, x=x, ro=routes, w=wts: b.expert_group_routed(ex, x, ro, w))
            elif kind == 3:
                ex = [pool[e] for e in r.permutation(24)[:4]]
                x = r.standard_normal((4, g["D"])).astype(np.float32)
                out.append(lambda ex=ex, x=x: b.expert_group(ex, [1] * 4, x))
            else:
                q = r.standard_normal((1, g["H"], g["Q"] + g["R"])).astype(np.float32)
                lat = r.standard_normal((1, g["K"])).astype(np.float32)
                rope = r.standard_normal((1, g["R"])).astype(np.float32)
                def att(q=q, lat=lat, rope=rope):
                    cache.length = 4096
                    return b.attention_ragged(kv_b, o_proj, q, [cache], g["Q"], g["R"],
                                              g["V"], 1 / 16, rows=[(lat, rope)])
                out.append(att)
        return out

    def run(seed):
        # the arena at its largest already (addresses in the tables stay the same): forgotten,
        # its host half zeroed, then the calls
        (a,) = b._arenas(0)
        a.forget()
        a.host[...] = 0
        seen = []
        for fn in calls(200, seed):
            fn()
            (a,) = b._arenas(0)  # one thread, one call at a time: one arena
            seen.append(a.host.copy())
        return seen

    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    print("seed", seed)
    for fn in calls(200, seed):  # the arena grows to its largest
        fn()
    kept = run(seed)
    # every call through a Call: no call of a kept plan made without one
    fast = [getattr(mod, name) for mod, name in FAST]
    for mod, name in FAST:
        setattr(mod, name, lambda *a, **k: None)
    calls_only = run(seed)
    for (mod, name), fn in zip(FAST, fast):
        setattr(mod, name, fn)
    Arena.keep = lambda self, last, plan: setattr(self, "last", plan)  # (None: write them)
    anew = run(seed)

    def differ(one, other):
        return [i for i, (x, y) in enumerate(zip(one, other)) if x.shape != y.shape
                or not np.array_equal(x, y)]

    bad = differ(kept, anew) + differ(kept, calls_only)
    print("calls", len(kept), "fast", n_fast, "differ", bad[:10])
    sys.exit(1 if bad or not all(n_fast) else 0)
    """
)


@pytest.mark.parametrize("compiled", ["0", "1"], ids=["python", "compiled"])
def test_kept_plans_leave_the_arena_as_fresh_plans_do(compiled, monkeypatch):
    """Both with the Python kept calls and with their compiled twins (``server/kept.c``)."""
    need_compiled(compiled, monkeypatch)
    out = run(SCRIPT)
    assert f"compiled {compiled == '1'}" in out
    assert "differ []" in out


ROUTE_ORDER_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.argv = ["x"]
    from bench import host_python as hp
    hp._stub_cupy()
    import cupyx
    cupyx.empty_pinned = lambda shape, dtype: np.zeros(shape, dtype)
    from coliworker.kernels import expert_group, graphs
    from coliworker.kernels.group_tables import counter_bytes
    from coliworker.kernels.records import MOE_JOB
    from coliworker.server.backend_cupy import CupyBackend

    graphs._record_fn = lambda *a: 0
    D, I = 256, 64
    b = CupyBackend((0,))
    pool = [(hp.Resident(2, D, I), hp.Resident(2, D, I), hp.Resident(2, I, D))
            for _ in range(16)]
    r = np.random.default_rng(int(sys.argv[-1]) if len(sys.argv) > 1 else None)
    for i in range(6):
        k = int(r.integers(1, 9))
        routes = r.permutation(16)[:k].astype(np.int32).reshape(1, k)
        x = r.standard_normal((1, D)).astype(np.float32)
        w = r.random((1, k)).astype(np.float32)
        b.expert_group_routed(pool, x, routes, w)
        (a,) = b._arenas(0)
        # the plan of k experts of this shape (its layout; the tables patched for these)
        (plan,) = [v for key, v in a.plans.items() if key[0] == "group shape"
                   and len(key[2]) == k]
        t_off, off = plan[3], plan[7]
        n = counter_bytes(k)
        recs = np.frombuffer(a.host[t_off + n : t_off + n + k * MOE_JOB.size], MOE_JOB.dtype)
        names = ("wg", "sg", "wu", "su", "wd", "sd")
        for j, e in enumerate(routes[0]):  # slot j: expert routes[j], packed row j
            g, u, dn = pool[e]
            want = (*g.ptrs, *u.ptrs, *dn.ptrs)
            got = tuple(int(recs[j][f]) for f in names)
            assert got == want, (i, j, got, want)
            assert int(recs[j]["x"]) == a.dptr, (i, j)  # the token's row, read in place
            assert int(recs[j]["y"]) == a.dptr + off["y"] + 4 * D * j, (i, j)
            assert int(recs[j]["rows"]) == 1
        pos, wv, _ = off["routes"]
        assert np.array_equal(pos, np.arange(k)), (i, pos)
        assert np.array_equal(wv, w), i
    print("route order ok")
    """
)


def test_one_token_routes_run_their_experts_in_route_order():
    """A one-token routed group of K other experts (expert_group._one_token): job record j
    holds the addresses of expert routes[j] and writes packed row j, every record reads the
    token's row in place, and pos is 0..K-1 (route_combine then sums the slots in route order,
    as it does for route_plan's ascending experts: the GPU tests compare the two to the bit)."""
    assert "route order ok" in run(ROUTE_ORDER_SCRIPT)
