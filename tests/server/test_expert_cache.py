"""The expert groups' validation caches (server/expert_lists.py ``_experts``): a list sent again
is answered from the list cache, a new list of known experts from the per-triple cache, and
neither changes a result or an error: freed handles, other owners, mixed hidden sizes and
devices are refused in the words of the uncached checks (``_experts_checked``)."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import grpc
import numpy as np
import pytest
from _service import TOL, make_expert, random_tensor, rel_err, upload

from coliworker.client import NotFound, requests
from coliworker.kernels import reference as ref
from coliworker.server.errors import WorkerError
from coliworker.server.store import Spec
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec, staging

OP = "expert_group_routed"
D, IE = 16, 8

#: The ArrayIO the calls of a test get: INLINE (unary gRPC), or one with a staging source
#: (a Session or socket call), whose lists and triples are keyed by the request's bytes
IO = {"io": codec.INLINE}


@pytest.fixture(autouse=True, params=["inline", "outside"])
def _io(request):
    IO["io"] = (
        codec.INLINE if request.param == "inline" else codec.ArrayIO(staging.source(b"", None, OP))
    )
    yield
    IO["io"] = codec.INLINE


def inline(msg, a, field, ndim):  # the unary client's encoder: every array in its message
    codec.encode_into(msg, a)


def routed(server, hs, x, routes, weights, owner=""):
    req = requests.expert_group_routed(inline, hs, x, routes, weights)
    return server.servicer.dispatch.run(calls.BY_KIND[OP], req, owner, IO["io"])


def group(server, hs, rows, x, owner=""):
    req = requests.expert_group(inline, hs, rows, x)
    return server.servicer.dispatch.run(calls.BY_KIND["expert_group"], req, owner, IO["io"])


def routed_args(rng, n, tokens=3, k=2):
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    routes = rng.integers(0, n, size=(tokens, k)).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    return x, routes, weights


def uncached(server, hs, owner=""):
    """The message (or None) of the uncached checks of the routed list ``hs``."""
    msg = pb.ExpertGroupRoutedRequest()
    for g, u, d in hs:
        msg.experts.add(gate=g.handle, up=u.handle, down=d.handle)
    key = (owner, *[(e.gate, e.up, e.down) for e in msg.experts])
    svc = server.servicer
    try:
        svc._experts_checked(msg.experts, key, svc.store.generation, OP, owner)
    except WorkerError as exc:
        return str(exc)
    return None


def refused(out, code, message):
    assert not out.ok
    assert out.code == code
    assert out.message == message


@pytest.fixture
def pool(w, rng):
    """12 experts of one shape, mixed formats: (host tensors, handles) each."""
    fmts = ((2, 2, 2), (4, 4, 4), (0, 1, 3), (2, 4, 2))
    experts = [make_expert(w, rng, D, IE, fmts=fmts[i % 4], gs=4) for i in range(12)]
    yield experts
    for _, hs in experts:
        for h in hs:
            try:
                w.free(h)
            except NotFound:  # freed by the test
                pass


def test_changing_subsets_match_the_reference(server, rng, pool, monkeypatch):
    """Random subsets of 3-8 of a pool, in random order (sometimes one expert twice), on
    both expert-group calls: every result is the reference's, first sight or not."""
    svc = server.servicer
    for i in range(40):
        n = int(rng.integers(3, 9))
        pick = list(rng.choice(len(pool), n, replace=False))
        if i % 7 == 3:
            pick[-1] = pick[0]  # a list may name one expert twice
        hosts = [pool[j][0] for j in pick]
        hs = [pool[j][1] for j in pick]
        x, routes, weights = routed_args(rng, n)
        out = routed(server, hs, x, routes, weights)
        assert out.ok, out.message
        want = ref.expert_group_routed(hosts, x, routes, weights)
        assert rel_err(codec.decode(out.response.y, "y"), want) < TOL
        rows = [int(r) for r in rng.integers(1, 3, size=n)]
        xg = rng.standard_normal((sum(rows), D)).astype(np.float32)
        out = group(server, hs, rows, xg)
        assert out.ok, out.message
        assert rel_err(codec.decode(out.response.y, "y"), ref.expert_group(hosts, rows, xg)) < TOL
        if i % 10 == 4:  # also with both caches empty (the first call of a worker)
            svc._expert_cache.clear()
            svc._triple_cache.clear()
    # a new list of known experts is answered without one handle lookup
    hs = [e[1] for e in pool]
    assert routed(server, hs, *routed_args(rng, 12)).ok
    looked = count_lookups(svc.store, monkeypatch)
    sub = [hs[j] for j in (11, 3, 7, 0, 5, 9, 1, 8)]
    out = routed(server, sub, *routed_args(rng, 8))
    assert out.ok and (looked == [] or not one_length(hs))
    gen = svc.store.generation
    kept = [(k[0], v[4]) for k, v in svc._triple_cache.items() if v[0] == gen]
    for g, u, d in hs:  # each triple kept, under its owner, at this generation (by its
        # ids, by its bytes, or both where some list of it had an id of fewer bytes)
        assert 1 <= kept.count(("", (g.handle, u.handle, d.handle))) <= 2


def one_length(hs) -> bool:
    """Whether triples ``hs`` are found by one key in every call: by their ids (INLINE), or
    by their bytes in the request when every id has as many varint bytes (9: its top 7 of
    63 bits not all 0); a list of some shorter is keyed by ids, missing triples kept by
    bytes (rare: a list of 8 experts has one in about 6)."""
    return IO["io"] is codec.INLINE or all(h.handle >> 56 for e in hs for h in e)


def triples_kept(server) -> dict:
    """(owner, (gate, up, down) ids) -> the triple cache's entry, whatever its key (the
    ids, or the expert's bytes in the request)."""
    return {(k[0], v[4]): v for k, v in server.servicer._triple_cache.items()}


def count_lookups(store, monkeypatch) -> list[int]:
    """The handle ids ``store.get`` is asked for from now on (in the list returned)."""
    real, looked = store.get, []

    def get(handle_id, field, owner=""):
        looked.append(handle_id)
        return real(handle_id, field, owner)

    monkeypatch.setattr(store, "get", get)
    return looked


def test_freed_tensor_of_a_cached_triple_is_not_found(server, w, rng, pool):
    hs = [e[1] for e in pool]
    x, routes, weights = routed_args(rng, 8)
    for sub in (hs[:8], hs[4:]):  # every triple cached, and both lists
        assert routed(server, sub, x, routes, weights).ok
    w.free(hs[5][1])
    for sub, c in ((hs[:8], 5), (hs[4:], 1), (hs[9:2:-1], 4)):  # known lists and a new one
        out = routed(server, sub, x, routes, weights)
        want = f"{OP}.experts[{c}].up: unknown tensor handle {hs[5][1].handle}"
        refused(out, grpc.StatusCode.NOT_FOUND, want)
        assert uncached(server, sub) == want
    # the other triples still work, in a list seen before and in a new one
    for pick in ((4, 6, 7, 8, 9, 10, 11), (11, 0, 6, 2)):
        sub = [hs[j] for j in pick]
        xs, rs, ws = routed_args(rng, len(pick))
        out = routed(server, sub, xs, rs, ws)
        assert out.ok, out.message
        want = ref.expert_group_routed([pool[j][0] for j in pick], xs, rs, ws)
        assert rel_err(codec.decode(out.response.y, "y"), want) < TOL


def test_other_owner_is_refused_cached_triples(server, rng, pool):
    hs = [e[1] for e in pool]
    x, routes, weights = routed_args(rng, 6)
    for owner in ("", "", "someone else", ""):
        for sub in (hs[:6], hs[6:]):
            out = routed(server, sub, x, routes, weights, owner)
            if owner:
                want = f"{OP}.experts[0].gate: unknown tensor handle {sub[0][0].handle}"
                refused(out, grpc.StatusCode.NOT_FOUND, want)
                assert uncached(server, sub, owner) == want
            else:
                assert out.ok, out.message
    # with an expert of its own first (cached under it): refused at the first of this owner's
    other = "someone else"
    hosts, store_handles, theirs = upload_as(server, rng, other)
    out = routed(server, [theirs], x, routes % 1, weights, other)
    assert out.ok, out.message
    want = ref.expert_group_routed([hosts], x, routes % 1, weights)
    assert rel_err(codec.decode(out.response.y, "y"), want) < TOL
    for sub, c in (([theirs, *hs[:3]], 1), ([theirs, theirs, hs[7]], 2)):
        out = routed(server, sub, x, routes % len(sub), weights, other)
        want = f"{OP}.experts[{c}].gate: unknown tensor handle {sub[c][0].handle}"
        refused(out, grpc.StatusCode.NOT_FOUND, want)
        assert uncached(server, sub, other) == want
    # this owner's triples were never kept under the other owner, nor theirs under this one
    keys = triples_kept(server)
    assert (other, tuple(h.handle for h in theirs)) in keys
    assert ("", tuple(h.handle for h in theirs)) not in keys
    assert not any(k[0] == other and k[1] == tuple(h.handle for h in hs[0]) for k in keys)
    out = routed(server, [hs[0], theirs], x, routes % 2, weights)  # and the other way round
    want = f"{OP}.experts[1].gate: unknown tensor handle {theirs[0].handle}"
    refused(out, grpc.StatusCode.NOT_FOUND, want)
    for h in store_handles:
        server.servicer.store.free(h)


class TensorRef(NamedTuple):
    handle: int


def upload_as(server, rng, owner):
    """An expert of ``owner``, uploaded straight into the store (the client's owner is "")."""
    store = server.servicer.store
    hosts = (
        random_tensor(rng, 2, D, IE),
        random_tensor(rng, 2, D, IE),
        random_tensor(rng, 2, IE, D),
    )
    handles = []
    for t in hosts:
        spec = Spec(t.fmt, t.in_features, t.out_features, t.group_size, 0)
        digest = hashlib.sha256(t.weights.tobytes() + t.scales.tobytes()).digest()
        handles.append(store.upload(spec, digest, t, owner)[0])
    return hosts, tuple(handles), tuple(TensorRef(h.id) for h in handles)


def test_mixed_hidden_sizes_and_devices_keep_their_messages(server, w, rng, pool):
    hs = [e[1] for e in pool]
    _, wide = make_expert(w, rng, 24, IE)  # another hidden size
    _, far = make_expert(w, rng, D, IE, device=1)  # another device
    g0 = upload(w, random_tensor(rng, 2, D, IE))
    u1 = upload(w, random_tensor(rng, 2, D, IE), device=1)
    d0 = upload(w, random_tensor(rng, 2, IE, D))
    split = (g0, u1, d0)  # one triple on two devices
    x, routes, weights = routed_args(rng, 4)
    assert routed(server, [wide], rng.standard_normal((1, 24)).astype(np.float32),
                  np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)).ok  # fmt: skip
    assert routed(server, [far], x, routes % 1, weights).ok
    for e in (wide, far):
        assert (
            triples_kept(server)[("", tuple(h.handle for h in e))][0]
            == server.servicer.store.generation
        )
    f = f"{OP}.experts"
    cases = [
        ([hs[0], hs[1], wide, hs[2]], f"{f}[2].gate.in_features: expected 16 (hidden size of "
         "experts[0]), got 24"),
        ([wide, hs[0]], f"{f}[1].gate.in_features: expected 24 (hidden size of experts[0]), "
         "got 16"),
        ([hs[0], far, hs[1]], f"{OP}: tensors on different devices: {f}[0].gate is on device "
         f"0, {f}[1].gate on device 1"),
        ([far, hs[0]], f"{OP}: tensors on different devices: {f}[0].gate is on device 1, "
         f"{f}[1].gate on device 0"),
        ([hs[0], split, hs[1]], f"{OP}: tensors on different devices: {f}[0].gate is on "
         f"device 0, {f}[1].up on device 1"),
        ([split, hs[0]], f"{OP}: tensors on different devices: {f}[0].gate is on device 0, "
         f"{f}[0].up on device 1"),
        # the first error of the list wins, as without the caches: a hidden size before a
        # device, and a later index's unknown handle before the devices (checked last)
        ([hs[0], far, wide], f"{f}[2].gate.in_features: expected 16 (hidden size of "
         "experts[0]), got 24"),
    ]  # fmt: skip
    for sub, want in cases:
        for _ in range(2):  # first sight and seen before
            out = routed(server, sub, x, routes % len(sub), weights)
            refused(out, grpc.StatusCode.INVALID_ARGUMENT, want)
            assert uncached(server, sub) == want
    w.free(hs[1][2])
    sub = [hs[0], far, hs[1]]
    want = f"{f}[2].down: unknown tensor handle {hs[1][2].handle}"
    refused(routed(server, sub, x, routes % 3, weights), grpc.StatusCode.NOT_FOUND, want)
    assert uncached(server, sub) == want
    for h in (*wide, *far, *split):
        w.free(h)


def test_free_racing_with_the_lookups_leaves_the_entries_stale(server, rng, pool, monkeypatch):
    """The generation is read before the lookups: a free (here: its generation bump) during
    them leaves what they made stale, so the next call looks the handles up again."""
    svc = server.servicer
    store = svc.store
    hs = [e[1] for e in pool]
    x, routes, weights = routed_args(rng, 5)
    svc._expert_cache.clear()
    svc._triple_cache.clear()
    real = store.get
    looked: list[int] = []

    def get(handle_id, field, owner=""):
        looked.append(handle_id)
        if len(looked) == 1:
            store.generation += 1
        return real(handle_id, field, owner)

    monkeypatch.setattr(store, "get", get)
    assert routed(server, hs[:5], x, routes, weights).ok
    assert len(looked) == 15
    assert routed(server, hs[:5], x, routes, weights).ok  # stale: looked up again
    assert len(looked) == 30
    assert routed(server, hs[:5], x, routes, weights).ok  # then from the list cache
    assert routed(server, hs[1:6], x, routes, weights).ok  # and a new list from the triples'
    assert len(looked) == 33 or not one_length(hs[:6])


def test_expert_run_finds_only_experts_of_one_length():
    """``_expert_run``: a list whose serialized experts are all one length gives that
    length, and its entries are the experts in order; one with an expert shorter than
    another (a handle id of fewer varint bytes) gives 0, the list then read field by
    field."""
    from coliworker.server.expert_lists import _expert_run

    rng = np.random.default_rng()
    for _ in range(200):
        n = int(rng.integers(1, 9))
        ids = [int(v) for v in rng.integers(1 << 56, 1 << 63, 3 * n, dtype=np.uint64)]
        short = rng.random() < 0.5
        if short:
            ids[int(rng.integers(len(ids)))] = int(rng.integers(1, 1 << 56))
        msg = pb.ExpertGroupRoutedRequest()
        for c in range(n):
            msg.experts.add(gate=ids[3 * c], up=ids[3 * c + 1], down=ids[3 * c + 2])
        msg.x.staged.offset, msg.x.staged.length = 10, 20
        blob = msg.SerializeToString()
        size = _expert_run(blob, n)
        lengths = {e.ByteSize() + 2 for e in msg.experts}  # tag, length, the ids
        assert size == (lengths.pop() if len(lengths) == 1 else 0)
        assert size == 32 or short
        if size:
            for c in range(n):
                e = pb.Expert.FromString(blob[c * size + 2 : (c + 1) * size])
                assert (e.gate, e.up, e.down) == tuple(ids[3 * c : 3 * c + 3])
            assert blob[n * size] != 0x0A  # the next field
