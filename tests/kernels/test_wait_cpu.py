"""How a call is waited for (``cupy_calls.wait``), on any machine, over ``bench/host_python.py``'s
stand-in CuPy in a subprocess: a stamped call returns once its D2H stamp is in (written here by
another thread, as the copy kernel writes it from the GPU) without the event's wait; a stamp
that never comes hands over to the event's wait after ``POLL_NS``; a call that is not stamped,
or ``POLL`` off, waits by its event at once; taking an arena clears the stamp its last call
left. The GPU side (the copy kernel's stamp after every output byte) is
``bench/graph_launch.py``'s stale count and ``test_graphs.py``'s bit-for-bit results."""

from __future__ import annotations

import textwrap

from _stand_in import last_dict

SCRIPT = textwrap.dedent(
    """
    import threading, time
    from bench import host_python as hp
    hp._stub_cupy()
    import cupy
    from coliworker.server import cupy_calls as cc

    cc.POLL = True  # the stand-in turns it off: here a thread writes the stamps
    cc.POLL_NS = 10**9
    synced = []
    cupy.cuda.runtime.eventSynchronize = lambda e: synced.append(e)
    pool = []
    a = cc.Arena(pool)
    out = {"fresh": int(a.stamps[3])}

    def stamp_later(delay):
        time.sleep(delay)
        a.stamps[3] = 123456789

    t = threading.Thread(target=stamp_later, args=(0.002,))
    t0 = time.perf_counter_ns()
    t.start()
    cc.wait(a, True, 7)
    out["stamped waited ms"] = (time.perf_counter_ns() - t0) / 1e6
    t.join()
    out["stamped event"] = list(synced)
    pool.append(a)
    a.take()
    out["taken"] = int(a.stamps[3])
    cc.POLL_NS = 3_000_000
    t0 = time.perf_counter_ns()
    cc.wait(a, True, 8)
    out["no stamp waited ms"] = (time.perf_counter_ns() - t0) / 1e6
    out["no stamp event"] = list(synced)
    synced.clear()
    a.stamps[3] = 1
    cc.wait(a, False, 9)
    cc.POLL = False
    cc.wait(a, True, 10)
    out["events"] = list(synced)
    print(repr(out))
    """
)


def test_wait_polls_the_stamp_then_the_event():
    out = last_dict(SCRIPT, timeout=120)
    assert out["fresh"] == 0
    assert out["stamped waited ms"] >= 2 and out["stamped event"] == []
    assert out["taken"] == 0
    assert out["no stamp waited ms"] >= 3 and out["no stamp event"] == [8]
    assert out["events"] == [9, 10]
