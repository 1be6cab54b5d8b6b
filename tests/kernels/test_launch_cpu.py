"""Programmatic dependent launch (``kernels/launch.py``, ``PDL``) as ``kernels/graphs.play``
issues a call's work, on any machine: over ``bench/host_python.py``'s stand-in CuPy, in a
subprocess (the stand-in replaces the ``cupy`` modules of the process it runs in).

With PDL on, a prepared launch that follows a kernel launch goes out as a dependent one; one
that is first, or follows a copy or an event, goes out plain; with PDL off every launch is
plain. A work list issued with PDL on and off is two graphs, not one replayed under the other
setting. Where the driver has no ``cuLaunchKernelEx`` (as here), a dependent launch is a plain
one. The GPU side (the same bits with PDL on and off) is ``test_graphs.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.argv = ["x"]
    from bench import host_python as hp
    hp._stub_cupy()
    from coliworker.kernels import graphs, launch
    from coliworker.kernels.graphs import COPY, LAUNCH, MARK

    issued = []

    class Rec(launch.Launch):  # a prepared launch that records how it went out
        def __init__(self, name):
            self.name = name
        def __call__(self, *a):
            issued.append((self.name, "plain", a))
        def dependent(self, *a):
            issued.append((self.name, "dependent", a))

    def cupy_kernel(*a):  # a launch that is no prepared one (a CuPy kernel's call)
        issued.append(("cupy", "plain", a))

    L = {n: Rec(n) for n in ("h2d", "k1", "k2", "k3", "after_copy", "k4", "d2h")}
    work = [(MARK, 0), (LAUNCH, L["h2d"], (1, 2)), (LAUNCH, L["k1"], (3,)),
            (LAUNCH, L["k2"], ()), (LAUNCH, cupy_kernel, (4,)), (LAUNCH, L["k3"], ()),
            (COPY, 16, 32, 64, 1), (LAUNCH, L["after_copy"], ()), (MARK, 1),
            (LAUNCH, L["k4"], ()), (LAUNCH, L["d2h"], (5, 6)), (MARK, 3)]
    events = [11, 12, 13, 14]

    launch.PDL = True
    graphs.play(work, events, 7)
    on = list(issued)
    issued.clear()
    launch.PDL = False
    graphs.play(work, events, 7)
    off = list(issued)
    print("ON", on)
    print("OFF", off)

    # one list, PDL off then on: captured under each, two graphs
    graphs._record_fn = lambda *a: 0
    g = graphs.Graphs()
    launch.PDL = False
    got_off = [g.run(work, events, 7, True) for _ in range(3)]
    launch.PDL = True
    got_on = [g.run(work, events, 7, True) for _ in range(3)]
    print("GRAPHS", got_off[1] is got_off[2] is not None, got_on[1] is got_on[2] is not None,
          got_on[2] is not got_off[2])

    # no cuLaunchKernelEx here: a real Launch's dependent() is its plain launch
    calls = []
    class Fn:
        def __call__(self, grid, block, args, shared_mem=0):
            calls.append((grid, block, args, shared_mem))
    launch.RAW = False
    real = launch.Launch(Fn(), (3,), (128,), (9,), 64)
    real.dependent(1, 2)
    print("FALLBACK", calls == [((3,), (128,), (1, 2, 9), 64)])
    """
)


def _run() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, ".dev"), ROOT]))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.stdout.splitlines()}


def test_pdl_marks_launches_that_follow_a_kernel():
    got = _run()
    on = eval(got["ON"])  # noqa: S307 - our own subprocess's repr of plain tuples
    assert [(n, how) for n, how, _ in on] == [
        ("h2d", "plain"),  # first, after an event
        ("k1", "dependent"),
        ("k2", "dependent"),
        ("cupy", "plain"),  # no prepared launch: no PDL
        ("k3", "dependent"),  # after a kernel, whatever launched it
        ("after_copy", "plain"),
        ("k4", "plain"),  # after an event
        ("d2h", "dependent"),
    ]
    assert [a for _, _, a in on] == [(1, 2), (3,), (), (4,), (), (), (), (5, 6)]
    off = eval(got["OFF"])  # noqa: S307
    assert [how for _, how, _ in off] == ["plain"] * 8
    assert got["GRAPHS"] == "True True True"
    assert got["FALLBACK"] == "True"
