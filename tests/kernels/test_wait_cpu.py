"""How a call ends and is waited for (``cupy_calls.wait``, ``Call.receive``), on any machine,
over ``bench/host_python.py``'s stand-in CuPy in a subprocess: a polled call (both copies
stamped, ``POLL`` on) lists no event after its D2H copy, returns once its D2H stamp is in
(written here by another thread, as the copy kernel writes it from the GPU) with no event or
stream wait, and hands over to the stream's synchronize after ``POLL_NS`` when no stamp comes;
with ``POLL`` off the work ends with its event again and is waited for by it; taking an arena
clears the stamp its last call left. The GPU side (the copy kernel's stamp after every output
byte) is ``bench/graph_launch.py``'s stale count and ``test_graphs.py``'s bit-for-bit
results."""

from __future__ import annotations

import textwrap

from _stand_in import last_dict

SCRIPT = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    from bench import host_python as hp
    hp._stub_cupy()
    import cupy
    from coliworker.kernels import graphs
    from coliworker.server import cupy_calls as cc
    from coliworker.server.backend_cupy import CupyBackend

    synced = []
    cupy.cuda.runtime.eventSynchronize = lambda e: synced.append(("event", e))

    class Stream:
        def synchronize(self):
            synced.append(("stream",))

    stream = Stream()
    pool = []
    a = cc.Arena(pool)
    out = {"fresh": int(a.stamps[3])}
    cc.POLL_NS = 10**9

    def stamp_later(delay):
        time.sleep(delay)
        a.stamps[3] = 123456789

    t = threading.Thread(target=stamp_later, args=(0.002,))
    t0 = time.perf_counter_ns()
    t.start()
    cc.wait(a, True, 7, stream)
    out["stamped waited ms"] = (time.perf_counter_ns() - t0) / 1e6
    t.join()
    out["stamped waits"] = list(synced)
    pool.append(a)
    a.take()
    out["taken"] = int(a.stamps[3])
    cc.POLL_NS = 3_000_000
    t0 = time.perf_counter_ns()
    cc.wait(a, True, 8, stream)
    out["no stamp waited ms"] = (time.perf_counter_ns() - t0) / 1e6
    out["no stamp waits"] = list(synced)
    synced.clear()
    a.stamps[3] = 1
    cc.wait(a, False, 9, stream)
    out["not polled"] = list(synced)

    # what a routed decode call lists last, POLL on and off (each listed on its first call)
    graphs._record_fn = lambda *a: 0
    g = hp.GLM
    b = CupyBackend((0,))
    experts = [(hp.Resident(2, g["D"], g["I"]), hp.Resident(2, g["D"], g["I"]),
                hp.Resident(2, g["I"], g["D"])) for _ in range(8)]
    x = np.ones((1, g["D"]), np.float32)
    routes = np.arange(8, dtype=np.int32).reshape(1, 8)
    w = np.ones((1, 8), np.float32)
    listed = []
    run = graphs.Graphs.run
    def spy(self, work, *args):
        listed.append(work[-1])
        return run(self, work, *args)
    graphs.Graphs.run = spy
    cc.POLL_NS = 0  # no GPU writes the stand-in's stamps
    for poll in (True, False, True):
        cc.POLL = poll
        listed.clear()
        synced.clear()
        b.expert_group_routed(experts, x, routes, w)
        out[f"last listed, poll {poll}"] = listed[0][0] == graphs.MARK
        out[f"waits, poll {poll}"] = [s[0] for s in synced]
    print(repr(out))
    """
)


def test_wait_polls_the_stamp_then_the_stream():
    out = last_dict(SCRIPT, timeout=120)
    assert out["fresh"] == 0
    assert out["stamped waited ms"] >= 2 and out["stamped waits"] == []
    assert out["taken"] == 0
    assert out["no stamp waited ms"] >= 3 and out["no stamp waits"] == [("stream",)]
    assert out["not polled"] == [("event", 9)]
    # polled: the D2H copy ends the work, no event listed or waited for; else the event
    assert out["last listed, poll True"] is False and out["waits, poll True"] == []
    assert out["last listed, poll False"] is True and out["waits, poll False"] == ["event"]
