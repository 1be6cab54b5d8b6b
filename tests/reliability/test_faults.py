"""Faults: kill -9 and restart of the worker under a RecoveringClient, injected compute
faults, a client that vanishes mid-upload, and the SIGTERM drain."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from _rel import (
    DecodeLayer,
    WorkerProcess,
    host_arrays,
    random_tensor,
    rel_err,
    serve,
    stats_snapshot,
    upload,
)

from coliworker.client import ResourceExhausted, Unavailable, WorkerClient
from coliworker.client.errors import WorkerRestarted
from coliworker.client.recovery import RecoveringClient
from coliworker.client.uploads import UploadItem
from coliworker.kernels import reference as ref
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


class Model(DecodeLayer):
    """Three experts and one MLA layer with two sequences, tracked on the host."""

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__(rng, 3, (1, 2))

    def step(self, w) -> None:
        """One decode step: an expert group and a ragged attention call, checked."""
        rows = [1, 2, 1]
        x = self.rng.standard_normal((4, 16)).astype(np.float32)
        y = w.expert_group(self.refs, rows, x)
        assert rel_err(y, ref.expert_group(self.experts, rows, x)) < 1e-5
        q, seqs = self.next_rows()
        out = w.attention_ragged(self.kv_ref, self.o_ref, q, sequences=seqs, **self.mla.dims())
        assert rel_err(out, self.attention_reference(q)) < 1e-5


@pytest.mark.parametrize("means", ["retain", "loader"])
def test_kill_9_and_restart_is_invisible_to_the_engine(worker, rng, means):
    model = Model(rng)
    by_hash = {}

    def loader(r):
        return by_hash[r.content_hash]

    kw = {"retain": True} if means == "retain" else {"loader": loader}
    with RecoveringClient(worker.address, timeout=10, progress=False, **kw) as w:
        model.upload(w)
        for e, refs in zip(model.experts, model.refs, strict=True):
            for t, r in zip(e, refs, strict=True):
                by_hash[r.content_hash] = host_arrays(t)
        for t, r in ((model.kv_b, model.kv_ref), (model.o_proj, model.o_ref)):
            by_hash[r.content_hash] = host_arrays(t)
        for _ in range(3):
            model.step(w)
        first = w.instance_id
        x = rng.standard_normal((3, 16)).astype(np.float32)
        pending = w.expert_group_async(model.refs[:1], [3], x)
        worker.kill()
        worker.start()
        for _ in range(3):
            model.step(w)  # replays 3 KV rows per sequence, then appends
        assert w.restarts == 1 and w.instance_id != first
        assert rel_err(pending.result(), ref.expert_group(model.experts[:1], [3], x)) < 1e-5
        assert [s.handles for s in w.stats()][0] == 11  # 9 expert tensors + kv_b + o_proj


@pytest.mark.parametrize("means", ["retain", "loader"])
def test_a_set_uploaded_with_upload_many_is_restored_after_kill_9(worker, rng, means):
    """upload_many's references are tracked like upload's: after kill -9 and a restart the
    whole set (one item twice: one resident copy) is back and computes the same."""
    model = Model(rng)
    tensors = [t for e in model.experts for t in e]
    tensors.append(tensors[0])  # identical content: one copy, two references
    items = [
        UploadItem(
            *host_arrays(t), fmt=t.fmt, in_features=t.in_features, out_features=t.out_features
        )
        for t in tensors
    ]
    kept = {}
    kw = {"retain": True} if means == "retain" else {"loader": lambda r: kept[r.content_hash]}
    with RecoveringClient(worker.address, timeout=10, progress=False, **kw) as w:
        refs = w.upload_many(items)
        for t, r in zip(tensors, refs, strict=True):
            kept[r.content_hash] = host_arrays(t)
        triples = [tuple(refs[3 * c : 3 * c + 3]) for c in range(len(model.experts))]
        x = rng.standard_normal((4, 16)).astype(np.float32)
        want = ref.expert_group(model.experts, [1, 2, 1], x)
        assert rel_err(w.expert_group(triples, [1, 2, 1], x), want) < 1e-5
        first = w.instance_id
        worker.kill()
        worker.start()
        assert rel_err(w.expert_group(triples, [1, 2, 1], x), want) < 1e-5
        assert w.restarts == 1 and w.instance_id != first
        y = w.matmul(refs[-1], x)  # the duplicate item's reference survived too
        assert rel_err(y, ref.matmul(tensors[0], x)) < 1e-5
        assert [s.handles for s in w.stats()][0] == len(tensors)


def test_a_restore_the_new_worker_refuses_raises_its_error(worker, rng):
    """The restore's re-uploads run on upload_many's threads; they must expect the new
    instance there too, so its refusal (a smaller --memory-limit) reaches the caller as
    that error instead of being taken for yet another restart."""
    model = Model(rng)
    with RecoveringClient(worker.address, timeout=10, progress=False, retain=True) as w:
        model.upload(w)
        model.step(w)
        worker.kill()
        worker.args = ("--memory-limit", "1000")
        worker.start()
        with pytest.raises(ResourceExhausted, match=r"upload_many\.items\[\d+\].*memory-limit"):
            model.step(w)


def test_restart_while_calls_are_in_flight(worker, rng):
    model = Model(rng)
    errors: list[BaseException] = []
    with RecoveringClient(worker.address, timeout=10, progress=False, retain=True) as w:
        model.upload(w)
        t = random_tensor(rng, 1, 64, 32)
        h = upload(w, t)

        done = threading.Event()

        def hammer(seed: int) -> None:
            r = np.random.default_rng(seed)
            try:
                while not done.is_set():
                    x = r.standard_normal((2, 64)).astype(np.float32)
                    assert rel_err(w.matmul(h, x), ref.matmul(t, x)) < 1e-5
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        time.sleep(0.1)
        worker.kill()
        time.sleep(0.3)
        worker.start()
        time.sleep(0.5)
        done.set()
        for th in threads:
            th.join(60)
        assert not errors, errors[:3]
        assert w.restarts == 1
        model.step(w)


def test_without_means_a_restart_raises_worker_restarted(worker, rng):
    t = random_tensor(rng, 1, 16, 8)
    x = rng.standard_normal((1, 16)).astype(np.float32)
    with RecoveringClient(worker.address, timeout=10, progress=False) as w:
        h = upload(w, t)
        w.matmul(h, x)
        worker.kill()
        worker.start()
        with pytest.raises(WorkerRestarted, match="fall back to the CPU path") as e:
            w.matmul(h, x)
        assert isinstance(e.value, Unavailable)
        h = upload(w, t)  # the engine may re-upload and carry on
        assert rel_err(w.matmul(h, x), ref.matmul(t, x)) < 1e-5


def test_a_worker_that_stays_down_raises_unavailable_in_time(worker, rng):
    with RecoveringClient(worker.address, timeout=5, retain=True, recover_timeout=1.0) as w:
        h = upload(w, random_tensor(rng, 1, 16, 8))
        worker.kill()
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="CPU path"):
            w.matmul(h, rng.standard_normal((1, 16)).astype(np.float32))
        assert time.monotonic() - t0 < 5


def test_injected_compute_faults_are_typed_and_not_retried(rng):
    srv = serve(fail_after=2)
    try:
        t = random_tensor(rng, 2, 16, 8)
        x = rng.standard_normal((1, 16)).astype(np.float32)
        with RecoveringClient(srv.address, timeout=10, retain=True) as w:
            h = upload(w, t)
            w.matmul(h, x)
            w.matmul(h, x)
            before = stats_snapshot(w)
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="injected fault"):
                w.matmul(h, x)
            assert time.monotonic() - t0 < 1  # the worker said so: no retry, no wait
            assert w.restarts == 0 and stats_snapshot(w) == before
    finally:
        srv.stop(grace=None)


def test_a_client_that_disconnects_mid_upload_leaves_nothing_half_written(rng):
    srv = serve()
    t = random_tensor(rng, 1, 4096, 1024)  # 4 MiB: several chunks
    weights, scales = host_arrays(t)
    from coliworker.wire import codec

    digest = codec.content_hash(1, 4096, 1024, 0, weights, scales)
    sent = threading.Event()

    def partial():
        yield pb.UploadChunk(
            header=pb.UploadHeader(
                spec=pb.TensorSpec(fmt=1, in_features=4096, out_features=1024),
                content_hash=digest,
                weight_bytes=weights.nbytes,
                scale_bytes=scales.nbytes,
            )
        )
        yield pb.UploadChunk(data=weights.tobytes()[: 1 << 20])
        sent.set()
        time.sleep(30)

    try:
        with WorkerClient(srv.address, timeout=20, progress=False) as w:
            before = stats_snapshot(w)
            ch = grpc.insecure_channel(srv.address)
            f = pb_grpc.WorkerStub(ch).Upload.future(partial(), timeout=60)
            assert sent.wait(10)
            time.sleep(0.1)
            ch.close()  # the client goes away
            with pytest.raises(grpc.RpcError):
                f.result()
            time.sleep(0.2)
            assert stats_snapshot(w) == before
            assert not w._call(
                w._stub.Lookup, pb.LookupRequest(content_hash=digest, device=0)
            ).found
            h = upload(w, t)
            assert not h.deduplicated
            x = rng.standard_normal((1, 4096)).astype(np.float32)
            assert rel_err(w.matmul(h, x), ref.matmul(t, x)) < 1e-5
    finally:
        srv.stop(grace=None)


def test_sigterm_drains_in_flight_calls_then_exits(rng):
    p = WorkerProcess("--drain-grace", "5").start()
    try:
        t = random_tensor(rng, 1, 1024, 512)
        weights, scales = host_arrays(t)
        from coliworker.wire import codec

        digest = codec.content_hash(1, 1024, 512, 0, weights, scales)
        data = weights.tobytes() + scales.tobytes()

        def slow():
            yield pb.UploadChunk(
                header=pb.UploadHeader(
                    spec=pb.TensorSpec(fmt=1, in_features=1024, out_features=512),
                    content_hash=digest,
                    weight_bytes=weights.nbytes,
                    scale_bytes=scales.nbytes,
                )
            )
            for i in range(0, len(data), 64 << 10):
                time.sleep(0.1)
                yield pb.UploadChunk(data=data[i : i + (64 << 10)])

        ch = grpc.insecure_channel(p.address)
        f = pb_grpc.WorkerStub(ch).Upload.future(slow(), timeout=30)
        time.sleep(0.3)
        t0 = time.monotonic()
        p.terminate()
        time.sleep(0.2)
        assert not p.serving()
        with WorkerClient(p.address, timeout=2) as late, pytest.raises(Unavailable):
            late.info()
        resp = f.result()  # the call in flight finishes
        assert resp.tensor.nbytes == t.nbytes
        assert p.proc.wait(10) == 0
        assert time.monotonic() - t0 < 6
        ch.close()
    finally:
        p.stop()
