"""Every call kind through a pool of three worker processes equals the same call on one
worker (NumPy backend: bit for bit), on the unary calls and on every session transport;
devices are numbered across members in order; a call mixing workers is refused."""

from __future__ import annotations

import numpy as np
import pytest
from _rel import Mla, WorkerProcess, random_tensor, running, upload

from coliworker.client import InvalidArgument, NotFound, PoolRef, WorkerClient, WorkerPool
from coliworker.client.uploads import UploadItem
from coliworker.kernels.qtensor import scale_shape

SEQ = 41


@pytest.fixture(scope="module")
def workers():
    """Worker 1 serves two devices: pool devices 0 | 1, 2 | 3."""
    yield from running([WorkerProcess(), WorkerProcess("--devices", "0,1"), WorkerProcess()])


def item(t, device: int) -> UploadItem:
    shape = scale_shape(t.fmt, t.in_features, t.out_features, t.group_size)
    return UploadItem(
        t.weights.reshape(t.out_features, -1),
        t.scales.reshape(shape) if shape else None,
        fmt=t.fmt,
        in_features=t.in_features,
        out_features=t.out_features,
        group_size=t.group_size,
        device=device,
    )


class Model:
    """One matmul tensor, three experts and an MLA layer: random, uploaded to a device."""

    def __init__(self, rng) -> None:
        self.rng = rng
        self.t = random_tensor(rng, 2, 16, 8)
        self.experts = [
            (random_tensor(rng, 2, 16, 12), random_tensor(rng, 2, 16, 12),
             random_tensor(rng, 2, 12, 16))
            for _ in range(3)
        ]  # fmt: skip
        self.mla = Mla()
        self.kv_b, self.o_proj = self.mla.tensors(rng)

    def tensors(self):
        return [self.t, *[t for e in self.experts for t in e], self.kv_b, self.o_proj]

    def place(self, refs):
        t, rest = refs[0], refs[1:]
        experts = [tuple(rest[3 * c : 3 * c + 3]) for c in range(3)]
        return t, experts, rest[9], rest[10]


def run_all(client, refs, inputs, session=None):
    """Every call kind once, in the same order: the unary calls, then the six on a session."""
    t, experts, kv, o = refs
    x, rows, routes, weights, q1, lat, rop, q2, m = inputs
    out = [
        client.matmul(t, x),
        client.expert_mlp(*experts[0], x),
        client.expert_group(experts, rows, x),
        client.expert_group_async(experts[:2], rows[:2], x[: sum(rows[:2])]).result(),
        client.expert_group_routed(experts, x, routes, weights),
        client.attention(kv, q1, lat, rop, o_proj=o, **m.dims()),
        client.attention(kv, q1, lat, rop, **m.dims()),
        client.attention_ragged(kv, o, q2, sequences=[(SEQ, 0, lat, rop)], **m.dims()),
        client.attention_ragged(kv, o, q2, sequences=[(SEQ, 3, lat[:1], rop[:1])], **m.dims()),
    ]
    assert client.free_sequence(SEQ, kv) > 0
    if session is not None:
        s = session
        futs = [
            s.matmul(t, x),
            s.expert_mlp(*experts[1], x),
            s.expert_group(experts, rows, x),
            s.expert_group_routed(experts, x, routes, weights),
            s.attention(kv, q1, lat, rop, o_proj=o, **m.dims()),
            s.attention_ragged(kv, o, q2, sequences=[(SEQ, 0, lat, rop)], **m.dims()),
        ]
        out += [f.result(30) for f in futs]
        out.append(s.attention_ragged_sync(kv, o, q2, sequences=[(SEQ, 3, lat[:0], rop[:0])],
                                           **m.dims()))  # fmt: skip
        assert client.free_sequence(SEQ) > 0
    return out


def inputs(rng, m: Mla):
    x = rng.standard_normal((6, 16)).astype(np.float32)
    routes = np.stack([rng.choice(3, size=2, replace=False) for _ in range(6)]).astype(np.int32)
    weights = rng.random((6, 2)).astype(np.float32)
    lat, rop = m.rows(rng, 3)
    return x, [1, 2, 3], routes, weights, m.q(rng, 3), lat, rop, m.q(rng, 1), m


def test_devices_are_numbered_across_members_in_order(workers) -> None:
    with WorkerPool([p.address for p in workers]) as pool:
        assert pool.device_count == 4
        assert [pool.device_of(d) for d in range(4)] == [(0, 0), (1, 0), (1, 1), (2, 0)]
        info = pool.info()
        assert [d.id for d in info.devices] == [0, 1, 2, 3]
        assert len(info.instance_id.split(",")) == 3
        with pytest.raises(InvalidArgument, match=r"upload.device: expected 0..3 .*got 4"):
            upload(pool, random_tensor(np.random.default_rng(), 2, 16, 8), device=4)


@pytest.mark.parametrize("device", [0, 2, 3])
@pytest.mark.parametrize("transport", ["grpc", "socket", "auto"])
def test_every_call_through_the_pool_equals_one_worker(workers, rng, device, transport) -> None:
    model = Model(rng)
    ins = inputs(rng, model.mla)
    with WorkerClient(workers[0].address, progress=False) as single:
        want = run_all(single, model.place([upload(single, t) for t in model.tensors()]), ins,
                       single.session(transport=transport))  # fmt: skip
    with WorkerPool([p.address for p in workers]) as pool:
        refs = pool.upload_many([item(t, device) for t in model.tensors()])
        assert all(isinstance(r, PoolRef) and r.device == device for r in refs)
        with pool.session(transport=transport) as s:
            got = run_all(pool, model.place(refs), ins, s)
        mine = [u for u in pool.tensor_usage() if isinstance(u[0], PoolRef)]  # not single's
        assert {r.handle: calls for r, _, calls, _ in mine}[refs[0].handle] == 2  # unary, session
        assert {d for _, d, _, _ in mine} == {device}
        for r in refs:
            pool.free(r)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"call {k}"


def test_a_call_mixing_workers_is_refused_naming_both(workers, rng) -> None:
    model = Model(rng)
    with WorkerPool([p.address for p in workers]) as pool:
        e0 = [pool.upload_many([item(t, 0) for t in model.experts[0]])]
        e3 = [pool.upload_many([item(t, 3) for t in model.experts[1]])]
        x = rng.standard_normal((2, 16)).astype(np.float32)
        with pytest.raises(InvalidArgument) as info:
            pool.expert_group([*e0, *e3], [1, 1], x)
        msg = info.value.message
        assert "expert_group.experts[1].gate" in msg and "experts[0].gate" in msg
        assert "worker 0" in msg and "worker 2" in msg and "device 3" in msg
        with pool.session(transport="socket") as s, pytest.raises(InvalidArgument):
            s.expert_group([*e0, *e3], [1, 1], x)
        # two devices of one worker: the worker itself refuses (as for one client)
        e1 = pool.upload_many([item(t, 1) for t in model.experts[2]])
        e2 = pool.upload_many([item(t, 2) for t in model.experts[2]])
        with pytest.raises(InvalidArgument):
            pool.expert_mlp(e1[0], e2[1], e1[2], x)
        with pytest.raises(NotFound, match="matmul.handle: unknown tensor handle 12345"):
            pool.matmul(12345, x)
        assert np.array_equal(pool.matmul(e1[0].handle, x), pool.matmul(e1[0], x))


def test_upload_many_is_all_or_nothing_with_the_pool_index(workers, rng) -> None:
    model = Model(rng)
    with WorkerPool([p.address for p in workers]) as pool:
        items = [item(t, d) for t, d in zip(model.tensors()[:4], [0, 3, 3, 1], strict=True)]
        bad = item(model.tensors()[4], 3)
        bad = UploadItem(bad.weights[:-1], bad.scales, fmt=bad.fmt, in_features=bad.in_features,
                         out_features=bad.out_features, device=3)  # fmt: skip
        before = [(s.device, s.handles) for s in pool.stats()]
        with pytest.raises(InvalidArgument) as info:
            pool.upload_many([*items, bad])
        assert "upload_many.items[4]" in info.value.message and info.value.index == 4
        assert [(s.device, s.handles) for s in pool.stats()] == before
