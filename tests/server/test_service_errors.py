"""Bad input to every RPC of a real worker (NumPy backend, devices 0 and 1): a typed error
naming the field and both values, and nothing resident changes (the ``resident`` fixture
re-checks a tensor's results and the worker's stats after each rejected call)."""

from __future__ import annotations

import numpy as np
import pytest
from _service import device_stats, make_expert, mla, random_tensor, upload

from coliworker.client import InvalidArgument, NotFound, ResourceExhausted
from coliworker.kernels.qtensor import row_bytes
from coliworker.v1 import worker_pb2 as pb

# -- bad input: typed errors naming the field, nothing resident changes -------------------


@pytest.fixture
def resident(w, rng):
    """A tensor whose results are re-checked after each rejected call."""
    t = random_tensor(rng, 2, 16, 4)
    h = upload(w, t)
    x = rng.standard_normal((2, 16)).astype(np.float32)
    y = w.matmul(h, x)
    before = w.stats()
    yield h
    np.testing.assert_array_equal(w.matmul(h, x), y)
    after = w.stats()
    assert [(d.tensors, d.tensor_bytes, d.handles) for d in after] == [
        (d.tensors, d.tensor_bytes, d.handles) for d in before
    ]
    w.free(h)


def raw_upload(w, header, chunks):
    msgs = [pb.UploadChunk(header=header)] + [pb.UploadChunk(data=c) for c in chunks]
    return w._call(w._stub.Upload, iter(msgs))


def header(fmt=2, i=8, o=2, gs=0, device=0, wbytes=None, sbytes=None, digest=b"\0" * 32):
    spec = pb.TensorSpec(fmt=fmt, in_features=i, out_features=o, group_size=gs, device=device)
    valid = 0 <= fmt <= 4 and i > 0 and o > 0
    wb = row_bytes(fmt, i) * o if wbytes is None and valid else (wbytes or 0)
    sb = 4 * max(o, 0) if sbytes is None else sbytes
    return pb.UploadHeader(spec=spec, content_hash=digest, weight_bytes=wb, scale_bytes=sb)


@pytest.mark.parametrize(
    "hdr,match",
    [
        (header(fmt=5), r"upload.header.spec.fmt: expected 0..4, got 5"),
        (header(fmt=-1), r"spec.fmt: expected 0..4, got -1"),
        (header(i=0), r"spec.in_features: expected >= 1, got 0"),
        (header(o=-3), r"spec.out_features: expected >= 1, got -3"),
        (header(fmt=4, gs=0), r"spec.group_size: expected >= 1 for fmt 4"),
        (header(fmt=2, gs=64), r"spec.group_size: expected 0 for fmt 2"),
        (header(device=7), r"spec.device: expected one of 0, 1, got 7"),
        (header(wbytes=7), r"header.weight_bytes: expected 8 .*got 7"),
        (header(sbytes=4), r"header.scale_bytes: expected 8 .*got 4"),
        (header(digest=b"short"), r"header.content_hash: expected 32 bytes"),
    ],
)
def test_bad_upload_headers(w, resident, hdr, match):
    with pytest.raises(InvalidArgument, match=match):
        raw_upload(w, hdr, [b"\0" * 16])


def test_bad_upload_data(w, resident):
    with pytest.raises(InvalidArgument, match=r"expected 16 bytes, stream ended after 10"):
        raw_upload(w, header(), [b"\1" * 10])
    with pytest.raises(InvalidArgument, match=r"expected 16 bytes in all, got more"):
        raw_upload(w, header(), [b"\1" * 10, b"\1" * 10])
    with pytest.raises(InvalidArgument, match=r"content_hash: expected [0-9a-f]{64}"):
        raw_upload(w, header(), [b"\1" * 16])
    with pytest.raises(InvalidArgument, match="expected a header as the first message"):
        w._call(w._stub.Upload, iter([pb.UploadChunk(data=b"x")]))


def test_bad_compute_requests(w, rng, resident):
    x = np.ones((2, 16), np.float32)
    with pytest.raises(InvalidArgument, match=r"matmul.x: expected 16 columns .*got 15"):
        w.matmul(resident, np.ones((2, 15), np.float32))
    bad = pb.MatmulRequest(
        handle=resident.handle, x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[2, 16], data=b"\0" * 100)
    )
    with pytest.raises(InvalidArgument, match=r"matmul.x.data: expected 128 bytes .*got 100"):
        w._call(w._stub.Matmul, bad)
    bad = pb.MatmulRequest(
        handle=resident.handle, x=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[0, 16], data=b"")
    )
    with pytest.raises(InvalidArgument, match=r"matmul.x.shape\[0\]: expected >= 1, got 0"):
        w._call(w._stub.Matmul, bad)
    bad = pb.MatmulRequest(
        handle=resident.handle, x=pb.Array(dtype=pb.DTYPE_INT32, shape=[2, 16], data=b"\0" * 128)
    )
    with pytest.raises(InvalidArgument, match=r"matmul.x.dtype: expected float32"):
        w._call(w._stub.Matmul, bad)
    with pytest.raises(InvalidArgument, match="expected a tensor handle, got 0"):
        w.matmul(0, x)
    _, e = make_expert(w, rng, 16, 8)
    _, e1 = make_expert(w, rng, 16, 8, device=1)
    with pytest.raises(InvalidArgument, match=r"expert_group.rows: expected 1 entries"):
        w.expert_group(experts=[e], rows=[1, 1], x=x)
    with pytest.raises(InvalidArgument, match=r"expert_group.rows\[0\]: expected >= 1, got 0"):
        w.expert_group(experts=[e], rows=[0], x=x)
    with pytest.raises(InvalidArgument, match=r"expert_group.x: expected 3 rows"):
        w.expert_group(experts=[e], rows=[3], x=x)
    with pytest.raises(InvalidArgument, match="different devices: expert_group.experts"):
        w.expert_group(experts=[e, e1], rows=[1, 1], x=x)
    with pytest.raises(ResourceExhausted, match=r"expected 1..64 experts, got 65"):
        w.expert_group(experts=[e] * 65, rows=[1] * 65, x=np.ones((65, 16), np.float32))
    with pytest.raises(InvalidArgument, match=r"expert_group.experts: expected 1..64 experts"):
        w.expert_group(experts=[], rows=[], x=x)
    with pytest.raises(InvalidArgument, match=r"expert_mlp.down.in_features: expected 8"):
        w.expert_mlp(e[0], e[1], resident, x)
    with pytest.raises(InvalidArgument, match=r"routes\[1, 0\]: expected 0..0"):
        w.expert_group_routed([e], x, np.array([[0], [3]]), np.ones((2, 1), np.float32))
    with pytest.raises(NotFound, match="ticket"):
        w._call(w._stub.ExpertGroupTake, pb.ExpertGroupTakeRequest(ticket=999999))
    for h in (*e, *e1):
        w.free(h)


def test_bad_attention_requests(w, rng, resident):
    (kv_b, _), (hk, ho), dims = mla(w, rng)
    q = rng.standard_normal((2, 3, 12)).astype(np.float32)
    lat = rng.standard_normal((4, 10)).astype(np.float32)
    rope = rng.standard_normal((4, 4)).astype(np.float32)
    with pytest.raises(InvalidArgument, match=r"attention.q: expected 13 values per head"):
        w.attention(hk, q, lat, rope, q_dim=9, rope_dim=4, v_dim=6, scale=0.1)
    with pytest.raises(InvalidArgument, match=r"attention.kv_b: expected 54 out_features"):
        w.attention(hk, q, lat, rope, q_dim=8, rope_dim=4, v_dim=10, scale=0.1)
    with pytest.raises(InvalidArgument, match=r"attention.latent: expected 10 columns"):
        w.attention(hk, q, lat[:, :9], rope, scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"attention.latent: expected >= 2 rows"):
        w.attention(hk, q, lat[:1], rope[:1], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"attention.o_proj: expected 18 in_features"):
        w.attention(hk, q, lat, rope, scale=0.1, o_proj=resident, **dims)
    with pytest.raises(InvalidArgument, match=r"attention.v_dim: expected >= 1, got 0"):
        w.attention(hk, q, lat, rope, q_dim=8, rope_dim=4, v_dim=0, scale=0.1)
    seq = (1, 0, lat[:2], rope[:2])
    with pytest.raises(InvalidArgument, match=r"sequence_id: 1 already appears"):
        w.attention_ragged(hk, ho, q, sequences=[seq, seq], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"attention_ragged.sequences: expected 2"):
        w.attention_ragged(hk, ho, q, sequences=[seq], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"sequences\[1\].rope: expected 2 rows"):
        w.attention_ragged(hk, ho, q, sequences=[seq, (2, 0, lat[:2], rope[:1])], scale=0.1, **dims)
    with pytest.raises(InvalidArgument, match=r"would attend 0 rows"):
        w.attention_ragged(hk, ho, q, sequences=[seq, (2, 0, lat[:0], rope[:0])], scale=0.1, **dims)
    assert device_stats(w).kv_sequences == 0  # nothing was created by rejected calls
    w.free(hk)
    w.free(ho)
