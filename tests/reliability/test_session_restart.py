"""Restarts under a RecoveringClient's Session stream: kill -9 and restart of the worker with
calls in flight on a plain, a shared-memory and a doorbell session; the session keeps going,
every result checked against the float64 reference, KV history replayed, nothing leaked."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from _rel import TOL, DecodeLayer, random_tensor, rel_err, serve, upload

from coliworker.client import InvalidArgument, Unavailable, WorkerRestarted
from coliworker.client.recovery import RecoveringClient
from coliworker.kernels import reference as ref
from coliworker.wire.shm import shm_dir

pytestmark = pytest.mark.slow

MODES = {
    "stream": {"transport": "grpc"},
    "socket": {"transport": "socket"},
    "shm": {"shm": True, "shm_bytes": 4 << 20},
    "doorbell": {"shm": True, "shm_bytes": 4 << 20, "doorbell": True},
}
SEQUENCES = (7, 9)


def leftovers() -> list[str]:
    """This process's shared-memory segments and doorbell directories still named."""
    return [n for n in os.listdir(shm_dir()) if n.startswith(f"coliworker-{os.getpid()}-")]


class Layer(DecodeLayer):
    """Four experts and one MLA layer with two sequences whose rows the host keeps."""

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__(rng, 4, SEQUENCES)

    def step(self, s) -> list[tuple[object, np.ndarray]]:
        """Submit one decode step (a routed expert group, a ragged attention call appending
        a row to each sequence); returns (future, reference result) pairs."""
        rng = self.rng
        x = rng.standard_normal((3, 16)).astype(np.float32)
        routes = np.stack([rng.choice(4, size=2, replace=False) for _ in range(3)])
        weights = rng.random((3, 2)).astype(np.float32)
        want = ref.expert_group_routed(self.experts, x, routes, weights)
        calls = [(s.expert_group_routed(self.refs, x, routes, weights), want)]
        q, seqs = self.next_rows()
        fut = s.attention_ragged(self.kv_ref, self.o_ref, q, sequences=seqs, **self.mla.dims())
        calls.append((fut, self.attention_reference(q)))
        return calls


def check(calls) -> None:
    for fut, want in calls:
        assert rel_err(fut.result(30), want) < TOL


@pytest.mark.parametrize("mode", list(MODES))
def test_kill_9_with_calls_in_flight_is_invisible_to_the_session(worker, rng, mode):
    layer = Layer(rng)
    with RecoveringClient(worker.address, timeout=10, progress=False, retain=True) as w:
        layer.upload(w)
        with w.session(**MODES[mode]) as s:
            for _ in range(3):
                check(layer.step(s))
            first = w.instance_id
            worker.proc.send_signal(signal.SIGSTOP)  # the calls below stay in flight
            pending = layer.step(s) + layer.step(s)  # 4: a doorbell channel's every slot
            worker.kill()
            restart = threading.Thread(target=worker.start)
            restart.start()
            check(pending)  # sent again on a new stream once the worker is back; KV replayed
            restart.join(60)
            assert not restart.is_alive()
            for _ in range(3):
                check(layer.step(s))
            assert s.shm == ("shm" in MODES[mode]) and s.doorbell == (mode == "doorbell")
            assert w.restarts == 1 and w.instance_id != first
        assert [d.kv_sequences for d in w.stats()][0] == len(SEQUENCES)
    assert not leftovers()


@pytest.mark.parametrize("mode", ["shm", "doorbell"])
def test_threads_sharing_a_session_across_a_restart(worker, rng, mode):
    layer = Layer(rng)
    t = random_tensor(rng, 1, 64, 32)
    failures: list[BaseException] = []
    with RecoveringClient(worker.address, timeout=10, progress=False, retain=True) as w:
        layer.upload(w)
        h = upload(w, t)
        stop = threading.Event()
        with w.session(**MODES[mode]) as s:

            def hammer(seed: int) -> None:
                r = np.random.default_rng(seed)
                try:
                    while not stop.is_set():
                        x = r.standard_normal((2, 64)).astype(np.float32)
                        assert rel_err(s.matmul(h.handle, x).result(30), ref.matmul(t, x)) < TOL
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)

            threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            check(layer.step(s))
            worker.kill()
            worker.start()
            check(layer.step(s))
            stop.set()
            for th in threads:
                th.join(60)
            assert not failures, failures[:3]
            assert w.restarts == 1
    assert not leftovers()


@pytest.mark.parametrize("mode", ["stream", "doorbell"])
def test_without_means_the_session_raises_worker_restarted(worker, rng, mode):
    t = random_tensor(rng, 1, 16, 8)
    x = rng.standard_normal((1, 16)).astype(np.float32)
    with RecoveringClient(worker.address, timeout=10, progress=False) as w:
        h = upload(w, t)
        with w.session(**MODES[mode]) as s:
            s.matmul_sync(h, x)
            worker.kill()
            worker.start()
            with pytest.raises(WorkerRestarted, match="fall back to the CPU path") as e:
                s.matmul_sync(h, x)
            assert isinstance(e.value, Unavailable)
            h = upload(w, t)  # the engine may re-upload and carry on, on the same session
            assert rel_err(s.matmul_sync(h, x), ref.matmul(t, x)) < TOL
    assert not leftovers()


@pytest.mark.parametrize("mode", list(MODES))
def test_errors_the_worker_answers_are_raised_not_retried(rng, mode):
    srv = serve(fail_after=3)
    try:
        t = random_tensor(rng, 2, 16, 8)
        x = rng.standard_normal((2, 16)).astype(np.float32)
        with RecoveringClient(srv.address, timeout=10, retain=True) as w:
            h = upload(w, t)
            with w.session(**MODES[mode]) as s:
                inner = s._inner
                with pytest.raises(InvalidArgument, match="16"):
                    s.matmul_sync(h, x[:, :12])
                for _ in range(3):
                    assert rel_err(s.matmul_sync(h, x), ref.matmul(t, x)) < TOL
                with pytest.raises(Unavailable, match="injected fault"):
                    s.matmul_sync(h, x)
                assert s._inner is inner and w.restarts == 0  # the same stream, no retry
    finally:
        srv.stop(grace=None)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stream_that_ends_on_a_live_worker_is_retried_on_a_new_one(rng, mode):
    srv = serve()
    try:
        layer = Layer(rng)
        with RecoveringClient(srv.address, timeout=10, retain=True) as w:
            layer.upload(w)
            with w.session(**MODES[mode]) as s:
                check(layer.step(s))
                inner = s._inner
                pending = layer.step(s)
                # the stream (or connection) ends; the worker instance stays
                inner._io.shutdown() if mode == "socket" else inner._call.cancel()
                # Let the session see the end first: a doorbell channel otherwise keeps
                # answering until the worker closes its end, and the step may finish there.
                # (A socket session has no reader thread: it sees the end on its next read.)
                deadline = time.monotonic() + 10
                while mode != "socket" and inner._broken is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                check(pending + layer.step(s))
                assert s._inner is not inner and w.restarts == 0
    finally:
        srv.stop(grace=None)
    assert not leftovers()


def test_a_worker_that_stays_down_raises_unavailable_then_the_session_resumes(worker, rng):
    t = random_tensor(rng, 1, 16, 8)
    x = rng.standard_normal((1, 16)).astype(np.float32)
    with RecoveringClient(
        worker.address, timeout=5, progress=False, retain=True, recover_timeout=1.0
    ) as w:
        h = upload(w, t)
        with w.session(**MODES["doorbell"]) as s:
            s.matmul_sync(h, x)
            worker.kill()
            with pytest.raises(Unavailable, match="CPU path"):
                s.matmul_sync(h, x)
            # The channel now retries its connection up to 1 s apart (_RECONNECT): give the
            # recovery more than that once the worker is back.
            w.recover_timeout = 10.0
            worker.start()  # the next call recovers
            assert rel_err(s.matmul_sync(h, x), ref.matmul(t, x)) < TOL
            assert w.restarts == 1
    assert not leftovers()
