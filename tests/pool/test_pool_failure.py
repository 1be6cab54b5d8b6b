"""Partial failure: a member killed with kill -9 mid-run fails its devices fast and typed
(Unavailable) while the other members keep serving exact results; restarted, a plain pool
says its tensors are gone (WorkerRestarted), a recovering pool restores them and its KV
sequences and every result is exact again, on the unary calls and on a pool session."""

from __future__ import annotations

import time

import numpy as np
import pytest
from _rel import TOL, DecodeLayer, WorkerProcess, rel_err, running

from coliworker.client import Unavailable, WorkerPool, WorkerRestarted
from coliworker.kernels import reference as ref

SEQUENCES = (3, 5)


@pytest.fixture
def workers():
    yield from running([WorkerProcess() for _ in range(3)])


class Layer(DecodeLayer):
    """Four experts and an MLA layer on one pool device."""

    def __init__(self, rng, device: int) -> None:
        super().__init__(rng, 4, SEQUENCES)
        self.device = device

    def upload(self, pool) -> None:
        from test_pool_calls import item  # the same UploadItem builder

        flat = [t for e in self.experts for t in e] + [self.kv_b, self.o_proj]
        refs = pool.upload_many([item(t, self.device) for t in flat])
        self.refs = [tuple(refs[3 * c : 3 * c + 3]) for c in range(4)]
        self.kv_ref, self.o_ref = refs[12], refs[13]

    def step(self, client):
        """One decode step (routed group, ragged attention appending a row per sequence) on
        ``client`` (the pool, or a pool session); returns (result or future, reference)."""
        rng = self.rng
        x = rng.standard_normal((3, 16)).astype(np.float32)
        routes = np.stack([rng.choice(4, size=2, replace=False) for _ in range(3)])
        weights = rng.random((3, 2)).astype(np.float32)
        want = ref.expert_group_routed(self.experts, x, routes, weights)
        q, seqs = self.next_rows()
        y = client.expert_group_routed(self.refs, x, routes, weights)
        a = client.attention_ragged(self.kv_ref, self.o_ref, q, sequences=seqs, **self.mla.dims())
        return [(y, want), (a, self.attention_reference(q))]

    def undo(self) -> None:
        """Forget the last step's rows (it failed: the worker never kept them)."""
        for s in self.sequences:
            self.latent[s], self.rope[s] = self.latent[s][:-1], self.rope[s][:-1]


def exact(calls) -> None:
    for got, want in calls:
        y = got.result(30) if hasattr(got, "result") else got
        assert rel_err(y, want) < TOL


def until_up(step, layer):
    """``step()`` until the restarted member answers (its channel reconnects within ~1 s);
    what it raises then is raised."""
    for _ in range(100):
        try:
            return step()
        except WorkerRestarted:
            layer.undo()
            raise
        except Unavailable:
            layer.undo()
            time.sleep(0.05)
    raise AssertionError("the restarted member never answered")


def test_kill_9_fails_its_devices_fast_others_serve_plain_pool_says_restarted(workers, rng):
    layers = [Layer(rng, d) for d in range(3)]
    with WorkerPool([p.address for p in workers], timeout=10, probe_interval=0.0) as pool:
        for layer in layers:
            layer.upload(pool)
        with pool.session(transport="socket") as s:
            for _ in range(2):
                for layer in layers:
                    exact(layer.step(pool))
                    exact(layer.step(s))
            workers[1].kill()
            for client in (pool, s, pool, s):  # the first finds it down, the rest are refused
                with pytest.raises(Unavailable):
                    exact(layers[1].step(client))
                layers[1].undo()
                for d in (0, 2):
                    exact(layers[d].step(client))
            assert not pool.up(1) and pool.up(0) and pool.up(2)
            assert [st.device for st in pool.stats()] == [0, 2]  # the dead member skipped
            workers[1].start()
            with pytest.raises(WorkerRestarted, match="worker 1 .* restarted"):
                until_up(lambda: layers[1].step(pool), layers[1])
            assert pool.up(1)
            fresh = Layer(rng, 1)
            fresh.upload(pool)  # a plain pool serves again what is uploaded again
            for _ in range(2):
                exact(fresh.step(pool))
                exact(fresh.step(s))
                exact(layers[0].step(s))


@pytest.mark.parametrize("transport", ["grpc", "socket"])
def test_recovering_pool_restores_the_member_exactly(workers, rng, transport):
    layers = [Layer(rng, d) for d in range(3)]
    addresses = [p.address for p in workers]
    with WorkerPool(addresses, timeout=10, retain=True, probe_interval=0.0) as pool:
        for layer in layers:
            layer.upload(pool)
        with pool.session(transport=transport) as s:
            for layer in layers:
                exact(layer.step(s))
            workers[2].kill()
            with pytest.raises(Unavailable):
                exact(layers[2].step(s))
            layers[2].undo()
            with pytest.raises(Unavailable):
                exact(layers[2].step(pool))
            layers[2].undo()
            exact(layers[0].step(s))
            exact(layers[1].step(pool))
            workers[2].start()
            exact(until_up(lambda: layers[2].step(pool), layers[2]))
            for _ in range(3):  # restored: tensors re-uploaded, KV history replayed
                for layer in layers:
                    exact(layer.step(pool))
                    exact(layer.step(s))
        assert pool.members[2].client.restarts == 1
