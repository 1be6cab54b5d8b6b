"""The decode calls of kept plans made without a ``Call`` (``expert_group.routed_kept``,
``attention_call.run_kept``, ``expert_group.group_kept``, ``cupy_calls.rerun``), on any
machine: the CuPy backend's host path over ``bench/host_python.py``'s stand-in CuPy, in a
subprocess (the stand-in replaces the ``cupy`` modules of the process it runs in). Which calls
take that path (a plan's third call on, with graphs on, on the current device) and which do not
(graphs off, another device current, a repeated expert, several tokens); a launch that fails:
the error reaches the caller, the stream is waited for, the arena is not given back, and the
next call is made afresh; a group call's output lent (``lend``: the arena's own view, no
copy). The bytes such calls write are ``test_arena_writes_cpu.py``'s; the
GPU side is ``test_graphs.py``'s."""

from __future__ import annotations

import textwrap

import pytest
from _stand_in import last_dict, need_compiled

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.argv = ["x"]
    from bench import host_python as hp
    hp._stub_cupy()
    import cupy
    from coliworker.kernels import attention_call, expert_group, graphs, matmul
    from coliworker.server.backend_cupy import CupyBackend

    graphs._record_fn = lambda *a: 0
    g = hp.GLM
    b = CupyBackend((0,))
    pool = [(hp.Resident(2, g["D"], g["I"]), hp.Resident(2, g["D"], g["I"]),
             hp.Resident(2, g["I"], g["D"])) for _ in range(16)]
    kv_b = hp.Resident(2, g["K"], g["H"] * (g["Q"] + g["V"]))
    o_proj = hp.Resident(2, g["H"] * g["V"], g["D"])
    cache = hp.KV(g["K"], g["R"], 4096)
    r = np.random.default_rng()
    fast = []

    def counted(name, fn):
        def kept(*a, **k):
            got = fn(*a, **k)
            fast.append((name, got is not None))
            return got
        return kept

    for mod, name in ((expert_group, "routed_kept"), (attention_call, "run_kept"),
                      (expert_group, "group_kept"), (matmul, "run_kept")):
        setattr(mod, name, counted(name, getattr(mod, name)))
    if b._compiled is not None:  # server/kept.c: its calls counted in place of the Python
        c = b._compiled
        b._compiled = c._replace(routed_kept=expert_group.routed_kept,
                                 routed=counted("routed_kept", c.routed),
                                 group_kept=expert_group.group_kept,
                                 group=counted("group_kept", c.group),
                                 run_kept=attention_call.run_kept,
                                 ragged=counted("run_kept", c.ragged),
                                 matmul_kept=matmul.run_kept,
                                 matmul=counted("run_kept", c.matmul))
    print("compiled", b._compiled is not None)

    def routed(routes=None, tokens=1):
        routes = r.permutation(8)[:8].astype(np.int32).reshape(1, 8) if routes is None else routes
        routes = np.repeat(routes, tokens, axis=0)
        x = r.standard_normal((tokens, g["D"])).astype(np.float32)
        w = r.random((tokens, routes.shape[1])).astype(np.float32)
        return b.expert_group_routed(pool[:8], x, routes, w)

    def attend():
        cache.length = 4096
        q = r.standard_normal((1, g["H"], g["Q"] + g["R"])).astype(np.float32)
        return b.attention_ragged(kv_b, o_proj, q, [cache], g["Q"], g["R"], g["V"], 1 / 16)

    def taken(fn, n):
        fast.clear()
        for _ in range(n):
            fn()
        return [ok for _, ok in fast]

    def group():  # a seed-ABI engine's decode step: its router's 8 experts, the row for each
        x = np.repeat(r.standard_normal((1, g["D"])).astype(np.float32), 8, axis=0)
        return b.expert_group(pool[8 * int(r.integers(0, 2)):][:8], [1] * 8, x)

    dense = hp.Resident(2, g["D"], g["D"])

    def mm():
        return b.matmul(dense, r.standard_normal((1, g["D"])).astype(np.float32))

    out = {}
    out["routed"] = taken(routed, 5)
    out["matmul"] = taken(mm, 5)
    out["attention"] = taken(attend, 5)
    out["group"] = taken(group, 5)
    # lend: a kept group call's out is the arena's own view (the next call's output lands
    # there too); without, a copy of its own
    def group_lent():
        x = np.repeat(r.standard_normal((1, g["D"])).astype(np.float32), 8, axis=0)
        return b.expert_group(pool[:8], [1] * 8, x, True)
    lent, lent2, own = group_lent(), group_lent(), group()
    out["lent"] = [not lent.out.flags.owndata, bool(np.shares_memory(lent.out, lent2.out)),
                   bool(own.out.flags.owndata), not np.shares_memory(own.out, lent2.out),
                   lent.out.shape == own.out.shape == (8, g["D"])]
    graphs.ENABLED = False
    out["graphs off"] = taken(routed, 2) + taken(attend, 2)
    graphs.ENABLED = True
    real_get = cupy.cuda.runtime.getDevice
    cupy.cuda.runtime.getDevice = lambda: 1  # another device current: through a Call
    out["other device"] = taken(routed, 2) + taken(attend, 2)
    cupy.cuda.runtime.getDevice = real_get
    repeated = np.array([[0, 1, 1, 2]], np.int32)
    out["repeated expert"] = taken(lambda: routed(repeated), 4)
    out["two tokens"] = taken(lambda: routed(tokens=2), 4)

    # a launch that fails on the path without a Call (its plan kept again first: the calls of
    # two tokens grew the arena, which then forgot its plans)
    out["again"] = taken(routed, 3)
    real_launch = cupy.cuda.runtime.graphLaunch
    synced = []
    def failing(*a):
        raise RuntimeError("launch failed")
    cupy.cuda.runtime.graphLaunch = failing
    stream, free = b._thread(0)
    before = list(free)
    real_sync = type(stream).synchronize
    type(stream).synchronize = lambda self: synced.append(1)
    try:
        routed()
        out["raised"] = False
    except RuntimeError as exc:
        out["raised"] = str(exc) == "launch failed"
    type(stream).synchronize = real_sync
    cupy.cuda.runtime.graphLaunch = real_launch
    out["waited"] = bool(synced)
    out["arena dropped"] = len(free) == len(before) - 1 and before[-1] not in free
    res = routed()
    out["next call"] = res.out.shape == (1, g["D"])
    out["compiled"] = b._compiled is not None
    print(repr(out))
    """
)


@pytest.mark.parametrize("compiled", ["0", "1"], ids=["python", "compiled"])
def test_which_calls_are_made_without_a_call_and_a_failed_launch(compiled, monkeypatch):
    """Both with the Python kept calls and with their compiled twins (``server/kept.c``)."""
    need_compiled(compiled, monkeypatch)
    out = last_dict(SCRIPT)
    assert out["compiled"] == (compiled == "1")
    # direct (the first call may find no arena at all), captured, then without a Call
    assert out["routed"][-3:] == [True, True, True] and not any(out["routed"][:-3])
    assert out["attention"][-3:] == [True, True, True] and not any(out["attention"][:-3])
    assert out["group"][-3:] == [True, True, True] and not any(out["group"][:-3])
    assert out["lent"] == [True] * 5
    assert out["matmul"][-3:] == [True, True, True] and not any(out["matmul"][:-3])
    assert not any(out["graphs off"])
    assert out["other device"] == []  # not even looked for
    assert not any(out["repeated expert"]) and not any(out["two tokens"])
    assert out["again"][-1]
    assert out["raised"] and out["waited"] and out["arena dropped"] and out["next call"]
