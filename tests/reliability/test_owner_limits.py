"""Hardening (issue 16), what one owner's load may cost another: sessions and stalled uploads
that hold threads, upload headers and KV growth past the memory limits, refused calls that
change state, calls racing a free or an update, tickets, eviction and ragged ordering per
owner. One test per finding, each reproducing the attack against an in-process worker (NumPy
backend, loopback) and asserting the outcome, never a duration. Authentication, signals,
result types and what an owner learns: ``test_hardening.py``."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from _rel import (
    TOKENS,
    Mla,
    client,
    host_arrays,
    random_tensor,
    rel_err,
    serve,
    token_env,
    upload,
    wait_until,
)

from coliworker.client import (
    DeadlineExceeded,
    ResourceExhausted,
    Unavailable,
    WorkerClient,
)
from coliworker.kernels import reference as ref
from coliworker.server.app import build_server
from coliworker.server.backend_numpy import NumpyBackend
from coliworker.server.config import Config
from coliworker.server.health import probe
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc

# -- 2: one owner's sessions and stalled uploads --------------------------------------------


def _header(t, content_hash: bytes | None = None, handle: int = 0) -> pb.UploadChunk:
    import hashlib  # noqa: F401  (the digest below is the client's own content hash)

    from coliworker.wire.codec import content_hash as digest_of

    weights, scales = host_arrays(t)
    digest = content_hash or digest_of(
        t.fmt, t.in_features, t.out_features, t.group_size, weights, scales
    )
    return pb.UploadChunk(
        header=pb.UploadHeader(
            spec=pb.TensorSpec(fmt=t.fmt, in_features=t.in_features, out_features=t.out_features),
            content_hash=digest,
            weight_bytes=t.weights.nbytes,
            scale_bytes=t.scales.nbytes,
            handle=handle,
        )
    )


def _stalled(first: pb.UploadChunk, release: threading.Event):
    yield first
    release.wait(60)


def _silent(release: threading.Event):
    """A request stream that sends nothing until ``release``."""
    release.wait(60)
    yield from ()


def md(who: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[who]}")]


def test_one_owners_sessions_and_stalled_uploads_leave_the_others_answering(rng):
    srv = serve(
        tokens=token_env(),
        workers=12,  # 8 threads for streams, 4 for one owner
        max_sessions_per_owner=2,
        max_uploads_per_owner=2,
        idle_timeout=0.5,
    )
    release = threading.Event()
    t = random_tensor(rng, 1, 64, 8)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            sessions = [stub.Session(_stalled(pb.SessionRequest(), release), metadata=md("bob"))]
            sessions.append(
                stub.Session(_stalled(pb.SessionRequest(), release), metadata=md("bob"))
            )
            assert wait_until(lambda: srv.servicer.owners.held("bob")[0] == 2)
            with pytest.raises(grpc.RpcError) as e:
                next(stub.Session(iter([pb.SessionRequest()]), metadata=md("bob"), timeout=10))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-sessions-per-owner" in e.value.details()
            uploads = [
                stub.Upload.future(_stalled(_header(t), release), metadata=md("bob"), timeout=60)
                for _ in range(2)
            ]
            assert wait_until(lambda: srv.servicer.owners.held("bob")[1] == 2)
            with pytest.raises(grpc.RpcError) as e:
                stub.Upload(_stalled(_header(t), release), metadata=md("bob"), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with client(srv, "alice") as a:  # another owner: calls, uploads, health answer
                for _ in range(3):
                    assert a.info().backend == "numpy"
                    assert probe(srv.address) == 0
                a.free(upload(a, t))
            for f in uploads:  # the stalled uploads end on their own (--idle-timeout)
                with pytest.raises(grpc.RpcError) as e:
                    f.result(timeout=30)
                assert e.value.code() == grpc.StatusCode.CANCELLED
            assert wait_until(lambda: srv.servicer.owners.held("bob")[1] == 0)
            with client(srv, "bob") as b:
                b.free(upload(b, t))
            release.set()
            for s in sessions:
                s.cancel()
    finally:
        release.set()
        srv.stop(grace=None)


def test_idle_session_streams_end_with_deadline_exceeded_and_running_calls_are_not_cut(rng):
    """--session-idle-timeout: a Session with no call for the timeout ends with
    DEADLINE_EXCEEDED naming the limit, giving back its owner's session slot and its segment;
    calls through its doorbell count as calls, and a call still running is never cut."""
    timeout = 1.0  # long enough for a loaded 2-core VM between a session's steps
    srv, gate = _gated(
        tokens=token_env(), session_idle_timeout=timeout, max_sessions_per_owner=1, workers=8
    )
    gate.go.set()
    t = random_tensor(rng, 0, 64, 32)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    want = ref.matmul(t, x)
    try:
        with client(srv, "bob") as b, grpc.insecure_channel(srv.address) as ch:
            h = upload(b, t)
            silent = threading.Event()
            raw = pb_grpc.WorkerStub(ch).Session(_silent(silent), metadata=md("alice"), timeout=60)
            with pytest.raises(grpc.RpcError) as e:  # any client: the status says why
                next(raw)
            silent.set()
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert f"--session-idle-timeout {timeout:g}" in e.value.details()
            s = b.session(transport="grpc")
            assert rel_err(s.matmul_sync(h, x), want) < 1e-5
            assert wait_until(lambda: srv.servicer.sessions.streams() == 0)
            with pytest.raises(DeadlineExceeded, match="no call for 1 s"):
                s.matmul_sync(h, x)
            s.close()
            with b.session(transport="shm") as s:  # the owner's one slot is free again
                assert s.transport == "shm"
                end = time.monotonic() + 3 * timeout
                while time.monotonic() < end:  # doorbell calls: the stream itself is silent
                    assert rel_err(s.matmul_sync(h, x), want) < 1e-5
                assert srv.servicer.sessions.streams() == 1
                gate.go.clear()
                gate.entered.clear()
                slow = s.matmul(h, x)  # runs for 3 timeouts
                assert gate.entered.wait(20)
                time.sleep(3 * timeout)
                assert srv.servicer.sessions.streams() == 1
                gate.go.set()
                assert rel_err(slow.result(20), want) < 1e-5
                assert wait_until(lambda: srv.servicer.sessions.streams() == 0)
                assert srv.servicer.sessions.attached_segments() == []
                with pytest.raises(Unavailable, match="session-idle-timeout"):
                    s.matmul_sync(h, x)
            with b.session(transport="grpc") as s:
                assert rel_err(s.matmul_sync(h, x), want) < 1e-5
    finally:
        gate.go.set()
        srv.stop(grace=None)


# -- 3(a): an upload header costs nothing before admission ----------------------------------


def test_upload_headers_of_resident_content_allocate_nothing_before_admission(rng):
    srv = serve(tokens=token_env(), quota=1 << 20, max_staged_bytes_per_owner=32 << 10)
    t = random_tensor(rng, 1, 256, 256)  # 64 KiB, resident
    try:
        with client(srv, "alice") as a, grpc.insecure_channel(srv.address) as ch:
            h = upload(a, t)
            stub = pb_grpc.WorkerStub(ch)
            resident = h.content_hash if hasattr(h, "content_hash") else None
            resident = resident or srv.servicer.store.get(h.handle, "x", "alice").data.content_hash
            for fmt, n in ((1, 1 << 14), (1, 1 << 18)):  # 256 MiB and 64 GiB claims
                big = random_tensor(rng, fmt, 8, 8)
                header = _header(big, resident)
                header.header.spec.in_features = header.header.spec.out_features = n
                header.header.weight_bytes, header.header.scale_bytes = n * n, 4 * n
                for call, extra in ((stub.Upload, 0), (stub.Update, h.handle)):
                    header.header.handle = extra
                    md_ = md("alice") if extra else md("bob")
                    with pytest.raises(grpc.RpcError) as e:
                        call(iter([header]), metadata=md_, timeout=20)
                    # refused before any buffer: over the quota / free memory, or (update)
                    # not the handle's spec
                    want = grpc.StatusCode.INVALID_ARGUMENT if extra else ""
                    assert e.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, want)
            assert srv.servicer.owners.held("bob") == (0, 0, 0)
            with pytest.raises(ResourceExhausted, match="--max-staged-bytes-per-owner"):
                a.update(h, *host_arrays(random_tensor(rng, 1, 256, 256)))  # a 64 KiB host copy
            assert (
                rel_err(
                    a.matmul(h, np.eye(256, dtype=np.float32)[:2]),
                    ref.matmul(t, np.eye(256, dtype=np.float32)[:2]),
                )
                < 1e-5
            )
            with client(srv, "bob") as b:  # the same bytes: verified, shared, charged to bob
                hb = upload(b, t)
                assert hb.deduplicated and srv.servicer.quota.used("bob") == t.nbytes
    finally:
        srv.stop(grace=None)


# -- 5: budgets honour the memory cgroup ------------------------------------------------------


def _fake_cgroup(tmp_path, monkeypatch, v1: bool, limit: int, usage: int) -> None:
    from coliworker.server import hostmem

    root = tmp_path / "cg"
    d = root / ("memory/worker" if v1 else "worker")
    d.mkdir(parents=True)
    names = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if v1
        else ("memory.max", "memory.current")
    )
    (d / names[0]).write_text(f"{limit}\n")
    (d / names[1]).write_text(f"{usage}\n")
    (root / ("memory" if v1 else "")).mkdir(exist_ok=True)
    top = root / "memory" if v1 else root
    (top / names[0]).write_text("9223372036854771712\n" if v1 else "max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/worker\n" if v1 else "0::/worker\n")
    monkeypatch.setattr(hostmem, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(hostmem, "PROC_SELF_CGROUP", str(proc))


@pytest.mark.parametrize("v1", [False, True])
def test_host_memory_is_bounded_by_the_memory_cgroup(tmp_path, monkeypatch, v1):
    from coliworker.server import hostmem

    _fake_cgroup(tmp_path, monkeypatch, v1, limit=1536 << 20, usage=1000 << 20)
    assert hostmem.cgroup_memory() == (1536 << 20, 1000 << 20)
    total, free = hostmem.host_memory()
    assert total <= 1536 << 20 and free <= 536 << 20


def test_kv_growth_past_the_cgroup_is_refused_not_oom_killed(tmp_path, monkeypatch, rng):
    srv = serve()
    m = Mla()
    kv_b, o_proj = m.tensors(rng)
    try:
        with WorkerClient(srv.address, timeout=20, progress=False) as w:
            k, o = upload(w, kv_b), upload(w, o_proj)
            lat, rop = m.rows(rng, 4)
            w.attention_ragged(k, o, m.q(rng, 1), sequences=[(1, 0, lat, rop)], **m.dims())
            _fake_cgroup(tmp_path, monkeypatch, False, limit=64 << 20, usage=63 << 20)
            big_l, big_r = m.rows(rng, 100_000)  # ~8 MB of KV, 1 MiB left in the cgroup
            with pytest.raises(ResourceExhausted, match="free"):
                w.attention_ragged(k, o, m.q(rng, 1), sequences=[(1, 4, big_l, big_r)], **m.dims())
            q = m.q(rng, 1)
            y = w.attention_ragged(k, o, q, sequences=[(1, 4, lat[:0], rop[:0])], **m.dims())
            assert rel_err(y, m.reference(kv_b, o_proj, q, [lat], [rop])) < 1e-5
    finally:
        srv.stop(grace=None)


# -- 6: a refused ragged call changes nothing -------------------------------------------------


def test_a_refused_ragged_call_changes_no_sequence_and_no_accounting(rng):
    m = Mla()
    kv_b, o_proj = m.tensors(rng)
    seq_bytes = 64 * (m.k + m.rope_dim) * 4  # one page of KV (NumPy backend)
    srv = serve(tokens=token_env(), quota=kv_b.nbytes + o_proj.nbytes + seq_bytes + 1000)
    try:
        with client(srv, "alice") as a:
            k, o = upload(a, kv_b), upload(a, o_proj)
            lat, rop = m.rows(rng, 10)
            a.attention_ragged(k, o, m.q(rng, 1), sequences=[(1, 0, lat, rop)], **m.dims())
            used = srv.servicer.quota.used("alice")
            l1, r1 = m.rows(rng, 1)
            with pytest.raises(ResourceExhausted, match="quota"):
                a.attention_ragged(
                    k, o, m.q(rng, 2), sequences=[(1, 5, l1, r1), (2, 0, l1, r1)], **m.dims()
                )
            assert srv.servicer.quota.used("alice") == used
            assert srv.servicer.sequences.lengths(
                srv.servicer.store.get(k.handle, "k", "alice"), [1, 2]
            ) == [10, 0]
            q = m.q(rng, 1)
            y = a.attention_ragged(k, o, q, sequences=[(1, 10, lat[:0], rop[:0])], **m.dims())
            assert rel_err(y, m.reference(kv_b, o_proj, q, [lat], [rop])) < 1e-5
            assert a.free_sequence(2) == 0
    finally:
        srv.stop(grace=None)


# -- 7: a call holds what it uses -------------------------------------------------------------


MARK = 1234.5


class _Gate(NumpyBackend):
    """Blocks matmul and attention_ragged (before they read anything) until ``go`` is set."""

    def __init__(self, devices=(0, 1)) -> None:
        super().__init__(devices)
        self.entered = threading.Event()
        self.go = threading.Event()
        self.gated = "alice"

    def matmul(self, w, x):
        self.entered.set()
        assert self.go.wait(30)
        return super().matmul(w, x)

    def attention_ragged(self, kv_b, o_proj, q, *args, **kw):
        if q.flat[0] == MARK:  # only the call the test marks
            self.entered.set()
            assert self.go.wait(30)
        return super().attention_ragged(kv_b, o_proj, q, *args, **kw)


def _gated(**cfg):
    values = dict(host="127.0.0.1", port=0, backend="numpy", devices=(0, 1), metrics_port=None)
    values.update(cfg)
    backend = _Gate()
    return build_server(Config(**values), backend).start(), backend


def test_a_tensor_freed_or_updated_during_a_call_is_read_whole_by_that_call(rng):
    srv, gate = _gated()
    t, t2 = random_tensor(rng, 1, 64, 48), random_tensor(rng, 1, 64, 48)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    try:
        with WorkerClient(srv.address, timeout=30, progress=False) as w:
            h = upload(w, t)
            out: list = []
            call = threading.Thread(target=lambda: out.append(w.matmul(h, x)))
            call.start()
            assert gate.entered.wait(20)
            assert w.free(h) == t.nbytes  # released for the client; the call still reads it
            gate.go.set()
            call.join(30)
            assert rel_err(out[0], ref.matmul(t, x)) < 1e-5
            assert wait_until(lambda: srv.servicer.budget.used[0] == 0)
            gate.go.clear()
            gate.entered.clear()
            h = upload(w, t)
            out.clear()
            call = threading.Thread(target=lambda: out.append(w.matmul(h, x)))
            call.start()
            assert gate.entered.wait(20)
            upd = threading.Thread(target=lambda: w.update(h, *host_arrays(t2)))
            upd.start()
            assert wait_until(lambda: srv.servicer.store._writers == 1)  # waits for the call
            gate.go.set()
            call.join(30)
            upd.join(30)
            assert rel_err(out[0], ref.matmul(t, x)) < 1e-5  # the content the call began with
            assert rel_err(w.matmul(h, x), ref.matmul(t2, x)) < 1e-5
    finally:
        gate.go.set()
        srv.stop(grace=None)


# -- 8: owners do not interfere ---------------------------------------------------------------


def test_tickets_eviction_and_ragged_ordering_are_per_owner(rng):
    m = Mla()
    kv_b, o_proj = m.tensors(rng)
    seq_bytes = 64 * (m.k + m.rope_dim) * 4
    limit = 2 * (kv_b.nbytes + o_proj.nbytes) + 3 * seq_bytes + 1000
    srv, gate = _gated(tokens=token_env(), max_pending_tickets=2, memory_limit=limit)
    gate.go.set()
    try:
        with client(srv, "alice") as a, client(srv, "bob") as b:
            ex = [tuple(upload(a, random_tensor(rng, 2, *io)) for io in ((8, 6), (8, 6), (6, 8)))]
            fa = [a.expert_group_async(ex, [2], rng.standard_normal((2, 8))) for _ in range(2)]
            exb = [tuple(upload(b, random_tensor(rng, 2, *io)) for io in ((8, 6), (8, 6), (6, 8)))]
            fb = b.expert_group_async(exb, [1], rng.standard_normal((1, 8)))  # alice holds 2
            assert fb.result().shape == (1, 8) and all(f.result().shape == (2, 8) for f in fa)
            ka, oa, kb, ob = upload(a, kv_b), upload(a, o_proj), upload(b, kv_b), upload(b, o_proj)
            lat, rop = m.rows(rng, 3)
            a.attention_ragged(ka, oa, m.q(rng, 1), sequences=[(1, 0, lat, rop)], **m.dims())
            a.attention_ragged(ka, oa, m.q(rng, 1), sequences=[(2, 0, lat, rop)], **m.dims())
            b.attention_ragged(kb, ob, m.q(rng, 1), sequences=[(1, 0, lat, rop)], **m.dims())
            with pytest.raises(ResourceExhausted):  # only his own may go, and it is in this call
                b.attention_ragged(
                    kb,
                    ob,
                    m.q(rng, 2),
                    sequences=[(1, 3, lat[:0], rop[:0]), (2, 0, lat, rop)],
                    **m.dims(),
                )
            q = m.q(rng, 2)
            seqs = [(1, 3, lat[:0], rop[:0]), (2, 3, lat[:0], rop[:0])]
            y = a.attention_ragged(ka, oa, q, sequences=seqs, **m.dims())  # none evicted
            assert rel_err(y, m.reference(kv_b, o_proj, q, [lat, lat], [rop, rop])) < 1e-5
            # a ragged call of alice's that is stuck does not hold bob's back
            gate.go.clear()
            gate.entered.clear()
            marked = m.q(rng, 1)
            marked.flat[0] = MARK
            stuck = threading.Thread(
                target=lambda: a.attention_ragged(
                    ka, oa, marked, sequences=[(1, 3, lat[:0], rop[:0])], **m.dims()
                )
            )
            stuck.start()
            assert gate.entered.wait(20)
            out: list = []
            ungated = threading.Thread(
                target=lambda: out.append(
                    b.attention_ragged(
                        kb, ob, q[:1], sequences=[(1, 3, lat[:0], rop[:0])], **m.dims()
                    )
                ),
            )
            ungated.start()
            ungated.join(20)
            assert out and rel_err(out[0], m.reference(kv_b, o_proj, q[:1], [lat], [rop])) < 1e-5
            gate.go.set()
            stuck.join(20)
    finally:
        gate.go.set()
        srv.stop(grace=None)
