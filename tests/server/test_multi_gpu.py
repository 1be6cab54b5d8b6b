"""A worker serving two CUDA devices (``--devices 0,1``, CuPy backend), through a real server.

Residency, compute, KV sequences and statistics are per device: the same content uploaded to
both devices is two copies that answer with the same bits, a call never mixes devices, and
calls on both devices at once from several threads stay correct. Needs two GPUs: the module
is skipped, with the reason, on fewer.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
from test_service import make_expert, random_tensor, rel_err, upload

from coliworker.client import InvalidArgument, WorkerClient
from coliworker.kernels import reference as ref
from coliworker.server.app import build_server
from coliworker.server.config import Config

TOL = 1e-4  # CuPy kernels vs the float64 reference (fp32 activations)


@functools.cache
def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(scope="module")
def server():
    srv = build_server(
        Config(host="127.0.0.1", port=0, backend="cupy", devices=(0, 1), metrics_port=None)
    ).start()
    yield srv
    srv.stop(grace=None)


@pytest.fixture
def w(server):
    with WorkerClient(server.address, timeout=120, progress=False) as client:
        yield client


def test_info_lists_both_devices(w):
    info = w.info()
    assert info.backend == "cupy"
    assert [d.id for d in info.devices] == [0, 1]
    assert all(d.total_memory_bytes > 0 and d.name for d in info.devices)


def test_same_content_on_both_devices_gives_the_same_bits(w, rng):
    t = random_tensor(rng, 2, 6144, 512)
    a, b = upload(w, t, 0), upload(w, t, 1)
    assert a.handle != b.handle and a.content_hash == b.content_hash
    x = rng.standard_normal((3, 6144)).astype(np.float32)
    ya, yb = w.matmul(a, x), w.matmul(b, x)
    assert rel_err(ya, ref.matmul(t, x)) < TOL
    np.testing.assert_array_equal(ya, yb)
    per_device = {s.device: s for s in w.stats()}
    assert per_device[0].tensors >= 1 and per_device[1].tensors >= 1
    w.free(a)
    np.testing.assert_array_equal(w.matmul(b, x), yb)  # device 1's copy is its own
    w.free(b)


def test_expert_groups_on_each_device(w, rng):
    for device in (0, 1):
        experts = [make_expert(w, rng, 256, 64, device=device) for _ in range(6)]
        hosts = [h for h, _ in experts]
        handles = [e for _, e in experts]
        x = rng.standard_normal((5, 256)).astype(np.float32)
        routes = rng.integers(0, 6, (5, 3)).astype(np.int32)
        weights = rng.random((5, 3)).astype(np.float32)
        got = w.expert_group_routed(handles, x, routes, weights)
        assert rel_err(got, ref.expert_group_routed(hosts, x, routes, weights)) < TOL
        y = w.expert_group(handles[:2], [2, 3], x)
        assert rel_err(y, ref.expert_group(hosts[:2], [2, 3], x)) < TOL


def test_mixed_devices_are_refused_and_nothing_is_lost(w, rng):
    h0, e0 = make_expert(w, rng, 64, 32, device=0)
    h1, e1 = make_expert(w, rng, 64, 32, device=1)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(InvalidArgument, match="different devices"):
        w.expert_group([e0, e1], [1, 1], x)
    assert rel_err(w.expert_group([e1], [2], x), ref.expert_group([h1], [2], x)) < TOL
    assert rel_err(w.expert_group([e0], [2], x), ref.expert_group([h0], [2], x)) < TOL


def test_kv_sequences_live_on_their_kv_b_device(w, rng):
    h, q_dim, r, v, k, d_out = 4, 16, 8, 16, 32, 48
    att = dict(q_dim=q_dim, rope_dim=r, v_dim=v, scale=0.2)
    for device in (0, 1):
        kv_b = random_tensor(rng, 2, k, h * (q_dim + v))
        o_proj = random_tensor(rng, 2, h * v, d_out)
        kh, oh = upload(w, kv_b, device), upload(w, o_proj, device)
        lat = [rng.standard_normal((n, k)).astype(np.float32) for n in (5, 9)]
        rope = [rng.standard_normal((n, r)).astype(np.float32) for n in (5, 9)]
        q = rng.standard_normal((2, h, q_dim + r)).astype(np.float32)
        seqs = [(10 + device, 0, lat[0], rope[0]), (20 + device, 0, lat[1], rope[1])]
        got = w.attention_ragged(kh, oh, q, sequences=seqs, **att)
        assert w.last_call.lengths == [5, 9]
        want = ref.attention_ragged(kv_b, o_proj, q, lat, rope, q_dim, r, v, 0.2)
        assert rel_err(got, want) < TOL
        assert {s.device: s.kv_sequences for s in w.stats()}[device] >= 2


def test_threads_on_both_devices_at_once(server, rng):
    t0, t1 = random_tensor(rng, 4, 1024, 768, 64), random_tensor(rng, 2, 1024, 768)
    xs = [rng.standard_normal((4, 1024)).astype(np.float32) for _ in range(8)]
    with WorkerClient(server.address, timeout=120, progress=False) as c:
        handles = [upload(c, t0, 0), upload(c, t1, 1)]
    wants = [[ref.matmul(t, x) for x in xs] for t in (t0, t1)]
    errors: list[str] = []

    def run(device: int) -> None:
        with WorkerClient(server.address, timeout=120, progress=False) as c:
            for _ in range(10):
                for x, want in zip(xs, wants[device], strict=True):
                    err = rel_err(c.matmul(handles[device], x), want)
                    if err >= TOL:
                        errors.append(f"device {device}: rel err {err}")

    threads = [threading.Thread(target=run, args=(d,)) for d in (0, 1, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
