"""Security: bearer tokens, owner isolation, TLS and mutual TLS, exposure check, limits."""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np
import pytest
from _rel import (
    TOKENS,
    Mla,
    client,
    host_arrays,
    make_pki,
    random_tensor,
    rel_err,
    serve,
    token_env,
    upload,
)

from coliworker.client import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    WorkerClient,
)
from coliworker.client.security import TLS
from coliworker.kernels import reference as ref
from coliworker.server import config as cfg
from coliworker.server.auth import TokenTable, bare_token_owner, is_loopback
from coliworker.server.cli import build_parser
from coliworker.server.config import Config
from coliworker.server.health import probe
from coliworker.v1 import worker_pb2 as pb
from coliworker.v1 import worker_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server():
    srv = serve(tokens=token_env())
    yield srv
    srv.stop(grace=None)


# -- authentication --------------------------------------------------------------------------


def test_calls_without_a_valid_token_are_unauthenticated(server):
    for token in (None, "not-a-token-but-long-enough"):
        with WorkerClient(server.address, timeout=10, token=token) as w:
            with pytest.raises(Unauthenticated) as e:
                w.info()
            assert "bearer token" in e.value.message.lower()
            with pytest.raises(Unauthenticated):
                upload(w, random_tensor(np.random.default_rng(), 1, 8, 4))


def test_every_method_refuses_a_missing_token_before_reading_the_request(server):
    with grpc.insecure_channel(server.address) as ch:
        for m in pb.DESCRIPTOR.services_by_name["Worker"].methods:
            path = f"/coliworker.v1.Worker/{m.name}"
            with pytest.raises(grpc.RpcError) as e:
                if m.client_streaming:
                    call = ch.stream_stream if m.server_streaming else ch.stream_unary
                    reply = call(path)(iter([b"\xff\xff"]), timeout=5)
                else:
                    call = ch.unary_stream if m.server_streaming else ch.unary_unary
                    reply = call(path)(b"\xff\xff", timeout=5)
                if m.server_streaming:
                    list(reply)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, m.name


def test_health_stays_open_without_a_token(server):
    assert probe(server.address) == 0


def test_bearer_token_authenticates(server):
    with client(server, "alice") as w:
        assert w.info().backend == "numpy"


# -- isolation between owners -----------------------------------------------------------------


def test_an_owner_cannot_use_or_free_another_owners_tensor(server, rng):
    t = random_tensor(rng, 2, 16, 8)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    with client(server, "alice") as a, client(server, "bob") as b:
        ta = upload(a, t)
        for call in (lambda: b.matmul(ta.handle, x), lambda: b.free(ta.handle)):
            with pytest.raises(NotFound, match="unknown tensor handle"):
                call()
        with pytest.raises(NotFound):
            b.expert_mlp(ta.handle, ta.handle, ta.handle, x)
        assert rel_err(a.matmul(ta, x), ref.matmul(t, x)) < 1e-5
        a.free(ta)


def test_identical_uploads_are_shared_and_counted_per_owner(server, rng):
    t = random_tensor(rng, 1, 24, 8)
    x = rng.standard_normal((3, 24)).astype(np.float32)
    with client(server, "alice") as a, client(server, "bob") as b:
        ta = upload(a, t)
        tb = upload(b, t)
        assert tb.deduplicated and tb.handle != ta.handle
        assert a.free(ta) == 0  # bob still references the shared copy
        assert rel_err(b.matmul(tb, x), ref.matmul(t, x)) < 1e-5
        assert b.free(tb) == t.nbytes


def test_sequences_and_tickets_are_private_to_their_owner(server, rng):
    m = Mla()
    kv_b, o_proj = m.tensors(rng)
    lat, rop = m.rows(rng, 5)
    with client(server, "alice") as a, client(server, "bob") as b:
        ka, oa = upload(a, kv_b), upload(a, o_proj)
        kb, ob = upload(b, kv_b), upload(b, o_proj)  # same content, bob's own handles
        a.attention_ragged(ka, oa, m.q(rng, 1), sequences=[(7, 0, lat, rop)], **m.dims())
        assert b.free_sequence(7) == 0  # bob's sequence 7 is another sequence
        q = m.q(rng, 1)
        y = a.attention_ragged(ka, oa, q, sequences=[(7, 5, lat[:0], rop[:0])], **m.dims())
        assert rel_err(y, m.reference(kv_b, o_proj, q, [lat], [rop])) < 1e-5
        with pytest.raises(Exception) as e:  # bob has no rows of sequence 7
            b.attention_ragged(kb, ob, q, sequences=[(7, 5, lat[:0], rop[:0])], **m.dims())
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        gate = upload(a, random_tensor(rng, 2, 8, 6))
        up = upload(a, random_tensor(rng, 2, 8, 6))
        down = upload(a, random_tensor(rng, 2, 6, 8))
        fut = a.expert_group_async([(gate, up, down)], [2], rng.standard_normal((2, 8)))
        with pytest.raises(NotFound):
            b._call(b._stub.ExpertGroupTake, pb.ExpertGroupTakeRequest(ticket=fut.ticket))
        assert fut.result().shape == (2, 8)
        for t in (ka, oa, gate, up, down):
            a.free(t)
        for t in (kb, ob):
            b.free(t)


# -- token table and configuration --------------------------------------------------------------


def test_token_table_parses_named_and_bare_tokens(tmp_path):
    bare = "bare-token-0123456789abcdef"
    path = tmp_path / "tokens"
    path.write_text(f"# engines\nalice:{TOKENS['alice']}\n\n{bare}\n")
    table = TokenTable.from_config(Config(token_file=str(path), tokens=f"bob:{TOKENS['bob']}"))
    assert table is not None and len(table) == 3
    assert table.owner_of(TOKENS["alice"]) == "alice"
    assert table.owner_of(TOKENS["bob"]) == "bob"
    assert table.owner_of(bare) == bare_token_owner(bare) and bare not in bare_token_owner(bare)
    assert table.owner_of(TOKENS["alice"][:-1]) is None
    assert table.owner_from_metadata([("authorization", "Basic x")]) is None
    with pytest.raises(ValueError, match="at least 16 characters"):
        TokenTable.from_config(Config(tokens="alice:short"))
    with pytest.raises(ValueError, match="appears twice"):
        TokenTable.from_config(Config(tokens=f"a:{bare},a:{bare}x"))
    assert TokenTable.from_config(Config()) is None


def test_security_settings_come_from_flags_and_environment():
    args = build_parser().parse_args(
        ["serve", "--insecure", "--max-in-flight", "8", "--quota", "1G", "--drain-grace", "2"]
    )
    c = cfg.from_sources(
        args, {"COLIWORKER_TOKENS": "x" * 20, "COLIWORKER_TLS_CERT": "c"}, tls_key="k"
    )
    assert c.insecure and c.max_in_flight == 8 and c.quota == 1 << 30 and c.drain_grace == 2
    assert c.tokens == "x" * 20 and c.tls_cert == "c"
    with pytest.raises(ValueError, match="both or neither"):
        Config(tls_cert="c")
    with pytest.raises(ValueError, match="max_in_flight"):
        Config(max_in_flight=0)


def test_non_loopback_without_auth_refuses_to_start_unless_insecure(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with pytest.raises(ValueError, match="--insecure"):
        serve(host="0.0.0.0")
    with caplog.at_level(logging.WARNING):
        srv = serve(host="0.0.0.0", insecure=True)
    srv.stop(grace=None)
    assert "WITHOUT authentication" in caplog.text
    srv = serve(host="0.0.0.0", tokens=token_env())
    srv.stop(grace=None)


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def test_tls_and_token(pki):
    srv = serve(tokens=token_env(), tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    try:
        with client(srv, "alice", tls=TLS(ca=pki["ca_cert"])) as w:
            assert w.info().backend == "numpy"
        with client(srv, "alice") as plain, pytest.raises(Unavailable):
            plain.info()
        with WorkerClient(srv.address, timeout=10, tls=TLS(ca=pki["ca_cert"])) as anon:
            with pytest.raises(Unauthenticated):
                anon.info()
    finally:
        srv.stop(grace=None)


def test_mutual_tls_requires_a_client_certificate(pki):
    srv = serve(
        tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca_cert"]
    )
    try:
        mine = TLS(ca=pki["ca_cert"], cert=pki["client_cert"], key=pki["client_key"])
        with WorkerClient(srv.address, timeout=10, tls=mine) as w:
            assert w.info().backend == "numpy"
        with WorkerClient(srv.address, timeout=10, tls=TLS(ca=pki["ca_cert"])) as w:
            with pytest.raises(Unavailable):
                w.info()
    finally:
        srv.stop(grace=None)


# -- limits ------------------------------------------------------------------------------------


def test_quota_bounds_each_owner_and_counts_shared_content_once(rng):
    t1, t2 = random_tensor(rng, 1, 1000, 100), random_tensor(rng, 1, 1000, 100)
    srv = serve(tokens=token_env(), quota=int(1.5 * t1.nbytes))
    try:
        with client(srv, "alice") as a, client(srv, "bob") as b:
            h1 = upload(a, t1)
            again = upload(a, t1)  # the same content: charged once
            with pytest.raises(ResourceExhausted, match="quota"):
                upload(a, t2)
            hb = upload(b, t2)  # bob has his own quota
            before = a.stats()
            with pytest.raises(ResourceExhausted, match="quota"):
                upload(b, t1)
            assert [d.handles for d in a.stats()] == [d.handles for d in before]
            a.free(h1)
            a.free(again)
            upload(a, t2)  # room again
            b.free(hb)
    finally:
        srv.stop(grace=None)


def test_quota_bounds_kv_rows_and_keeps_resident_rows(rng):
    m = Mla(k=64, rope_dim=8)
    kv_b, o_proj = m.tensors(rng)
    srv = serve(tokens=token_env(), quota=kv_b.nbytes + o_proj.nbytes + 64 * 1024)
    try:
        with client(srv, "alice") as a:
            k, o = upload(a, kv_b), upload(a, o_proj)
            lat, rop = m.rows(rng, 20)
            a.attention_ragged(k, o, m.q(rng, 1), sequences=[(1, 0, lat, rop)], **m.dims())
            big_l, big_r = m.rows(rng, 400)
            with pytest.raises(ResourceExhausted, match="quota"):
                a.attention_ragged(k, o, m.q(rng, 1), sequences=[(1, 20, big_l, big_r)], **m.dims())
            q = m.q(rng, 1)
            y = a.attention_ragged(k, o, q, sequences=[(1, 20, lat[:0], rop[:0])], **m.dims())
            assert rel_err(y, m.reference(kv_b, o_proj, q, [lat], [rop])) < 1e-5
    finally:
        srv.stop(grace=None)


def test_header_claiming_a_huge_tensor_is_refused_before_any_allocation(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.WorkerStub(ch)
        i = o = (1 << 31) - 1
        header = pb.UploadHeader(
            spec=pb.TensorSpec(fmt=1, in_features=i, out_features=o),
            content_hash=b"\1" * 32,
            weight_bytes=i * o,
            scale_bytes=4 * o,
        )
        md = [("authorization", f"Bearer {TOKENS['alice']}")]
        with pytest.raises(grpc.RpcError) as e:
            stub.Upload(iter([pb.UploadChunk(header=header)]), timeout=10, metadata=md)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_max_message_bytes_is_enforced(rng):
    srv = serve(max_message_bytes=2 << 20)
    try:
        with WorkerClient(srv.address, timeout=20, progress=False) as w:
            t = random_tensor(rng, 0, 1024, 2048)  # 8 MiB: uploads in 1 MiB chunks
            h = upload(w, t)
            with pytest.raises(ResourceExhausted):
                w.matmul(h, rng.standard_normal((1024, 1024)).astype(np.float32))  # 4 MiB
            x = rng.standard_normal((2, 1024)).astype(np.float32)
            assert rel_err(w.matmul(h, x), ref.matmul(t, x)) < 1e-5
    finally:
        srv.stop(grace=None)


def test_calls_beyond_max_in_flight_are_resource_exhausted(rng):
    srv = serve(max_in_flight=2)
    release = threading.Event()
    t = random_tensor(rng, 1, 64, 8)
    weights, _ = host_arrays(t)

    def held_upload():
        header = pb.UploadHeader(
            spec=pb.TensorSpec(fmt=1, in_features=64, out_features=8),
            content_hash=b"\0" * 32,
            weight_bytes=weights.nbytes,
            scale_bytes=32,
        )
        yield pb.UploadChunk(header=header)
        release.wait(20)

    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.WorkerStub(ch)
            held: list = []
            with WorkerClient(srv.address, timeout=10) as w:
                refused = 0
                for _ in range(200):  # until two held calls are surely running
                    held = [f for f in held if not f.done()]
                    while len(held) < 2:  # a held call may itself meet the limit: retry it
                        held.append(stub.Upload.future(held_upload(), timeout=30))
                    threading.Event().wait(0.02)
                    try:
                        w.info()
                        refused = 0
                    except ResourceExhausted:
                        refused += 1
                        if refused == 3:
                            break
                assert refused == 3
                release.set()
                codes = []
                for f in held:
                    with pytest.raises(grpc.RpcError) as e:
                        f.result()
                    codes.append(e.value.code())
                assert grpc.StatusCode.INVALID_ARGUMENT in codes  # held, then read to the end
                assert w.info().backend == "numpy"
    finally:
        release.set()
        srv.stop(grace=None)


def test_bad_input_is_invalid_argument_with_the_field_named(server):
    with client(server, "alice") as w:
        with pytest.raises(InvalidArgument, match="free.handle"):
            w.free(0)
