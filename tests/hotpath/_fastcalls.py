"""What the tests of the decode calls' compiled path (``server/fastpath.c``) share: workers
with and without it, resident experts and attention tensors, the frames a socket session
sends, a count of the calls it ran (and of those it should run: ``in_c``), and random
corruptions of a body."""

from __future__ import annotations

import numpy as np
import pytest
from _hotpath import ATT, D_OUT, I_E, D, H, K, Model, Q, V, int4_tensor, upload

from coliworker.client import WorkerClient
from coliworker.server import fastpath
from coliworker.server.app import build_server
from coliworker.server.config import Config
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec, frames

needs_c = pytest.mark.skipif(
    fastpath.module() is None, reason="server/fastpath.c cannot be built on this host"
)


def worker(fast: bool):
    """A started NumPy worker, with its compiled path (``fast``) or without."""
    srv = build_server(Config(backend="numpy", port=0, metrics_port=None)).start()
    if not fast:
        srv.servicer.fastcalls = None
    assert (srv.servicer.fastcalls is not None) == fast
    return srv


def experts_model(w: WorkerClient, rng, n: int = 6) -> Model:
    """``n`` random int4 experts uploaded to ``w`` (``Model.experts`` and ``tensors``)."""
    tensors = [
        (int4_tensor(rng, D, I_E), int4_tensor(rng, D, I_E), int4_tensor(rng, I_E, D))
        for _ in range(n)
    ]
    experts = [tuple(upload(w, t) for t in triple) for triple in tensors]
    return Model(experts, tensors, None, None, None, None, None, None)


def attention_model(w: WorkerClient, rng) -> tuple:
    """A random kv_b and o_proj uploaded to ``w``: (kv_b, o_proj, their QTensors)."""
    kv_b_t = int4_tensor(rng, K, H * (Q + V))
    o_proj_t = int4_tensor(rng, H * V, D_OUT)
    return upload(w, kv_b_t), upload(w, o_proj_t), kv_b_t, o_proj_t


def counted(srv, name: str = "expert_group_routed_checked") -> list[int]:
    """How many calls the compiled path ran (its handler ``name`` wrapped)."""
    seen = [0]
    s = srv.servicer
    real = getattr(s, name)

    def wrapped(request, owner, io=None):
        seen[0] += 1
        return real(request, owner, io)

    setattr(s, name, wrapped)
    return seen


def both_paths(transport: str, handler: str, seed: int, make_calls, send):
    """The same expert group calls through a worker with the compiled path and one without,
    over ``transport`` ("socket" or "doorbell"): ``make_calls(model)`` makes them once (each a
    tuple whose first item lists the experts it names, by index into the model), ``send(s,
    experts, *rest)`` makes one on a session. Returns (model, calls, in C: how many the
    compiled path should run, ``in_c``, and for the compiled path and then the Python: the
    results, the usage counts, the group statistics without their times, and how many calls
    ``handler`` ran)."""
    calls = model = expected = None
    got = []
    for fast in (True, False):
        srv = worker(fast)
        seen = counted(srv, handler)
        try:
            with WorkerClient(srv.address, progress=False) as w:
                model = experts_model(w, np.random.default_rng(seed))
                if calls is None:
                    calls = make_calls(model)
                kw = {"shm": True, "doorbell": True} if transport == "doorbell" else {
                    "transport": "socket"}  # fmt: skip
                with w.session(**kw) as s:
                    ys = [send(s, [model.experts[j] for j in c[0]], *c[1:]) for c in calls]
                stats = [(d.device, d.group.calls, d.group.experts, d.group.rows)
                         for d in w.stats()]  # fmt: skip
                got.append((ys, srv.servicer.tensor_counts.top(100), stats, seen[0]))
                if fast:
                    expected = in_c(model, [c[0] for c in calls])
        finally:
            srv.stop(0)
    return model, calls, expected, got[0], got[1]


def in_c(model: Model, picks: list[list[int]]) -> int:
    """How many of the expert group or routed calls naming ``picks`` of ``model``'s experts
    (each with an array outside its message) the compiled path runs: those whose list, or
    each of whose experts, the caches hold under the call's key. The worker keys an expert
    by its bytes in the request where every expert of the call has as many (random handle
    ids are 8-10 byte varints), else by its ids; the Python path caches the list and each
    expert, the C the list."""
    lists: set = set()
    triples: set = set()
    n = 0
    for pick in picks:
        sizes = {
            pb.Expert(gate=g.handle, up=u.handle, down=d.handle).ByteSize()
            for g, u, d in (model.experts[j] for j in pick)
        }
        form = "bytes" if len(sizes) == 1 else "ids"
        if (form, tuple(pick)) in lists or all((form, j) in triples for j in pick):
            n += 1
        else:
            triples.update((form, j) for j in pick)
        lists.add((form, tuple(pick)))
    return n


def _data(msg, side: list) -> np.ndarray:
    """``msg``'s staged arrays (``side``) placed as a frame's data (``frames.place``)."""
    pieces, _ = frames.place(msg, side)
    return np.frombuffer(b"".join(bytes(memoryview(p).cast("B")) for p in pieces), np.uint8)


def routed_frame(model: Model, x, routes, weights, out_dtype: int = 0):
    """A routed call's body message and data as a socket session sends them (x staged)."""
    side: list = []
    msg = pb.ExpertGroupRoutedRequest()
    for g, u, d in model.experts:
        msg.experts.add(gate=g.handle, up=u.handle, down=d.handle)
    codec.encode_into(msg.x, x, pb.DTYPE_FLOAT32, side)
    codec.encode_into(msg.routes, routes, pb.DTYPE_INT32)
    codec.encode_into(msg.weights, weights, pb.DTYPE_FLOAT32)
    msg.output_dtype = out_dtype
    return msg, _data(msg, side)


def group_frame(experts, rows, x, out_dtype: int = 0):
    """An expert group call's body message and data as a socket session (or the C client)
    sends them: ``experts`` (gate, up, down) refs, ``rows`` per expert, x staged."""
    side: list = []
    msg = pb.ExpertGroupRequest(rows=rows, output_dtype=out_dtype)
    for g, u, d in experts:
        msg.experts.add(gate=g.handle, up=u.handle, down=d.handle)
    codec.encode_into(msg.x, x, pb.DTYPE_FLOAT32, side)
    return msg, _data(msg, side)


def ragged_frame(kv_b, proj, q, sequences):
    """A ragged call's body message and data: q and each latent staged, each rope inline;
    ``sequences`` (id, start, latent, rope), latent and rope None for a sequence that sends
    no rows."""
    side: list = []
    msg = pb.AttentionRaggedRequest(kv_b=kv_b.handle, o_proj=proj.handle, **ATT)
    codec.encode_into(msg.q, q, pb.DTYPE_FLOAT32, side)
    for sid, start, lat, rope in sequences:
        a = msg.sequences.add(sequence_id=sid, start=start)
        if lat is not None:
            codec.encode_into(a.latent, lat, pb.DTYPE_FLOAT32, side)
            codec.encode_into(a.rope, rope, pb.DTYPE_FLOAT32)
    return msg, _data(msg, side)


def check_x_in_shm(args, variant, x: np.ndarray, at: int, kind: str, index: int) -> None:
    """A call whose x lies in the session's segment (at ``at``) instead of the frame: ``args``
    (the reader, on a message and ``shm_view``) reads none without a segment, reads x there
    through the segment's ``view`` (asked once, for ``kind``) as a read-only array (item
    ``index`` of what it returns), and none where the view raises (outside the segment)."""
    shm = variant(
        lambda m: (
            m.x.ClearField("staged"),
            setattr(m.x.shm, "offset", at),
            setattr(m.x.shm, "length", x.nbytes),
        )
    )
    assert args(shm) is None, "shm slice, no segment"
    asked = []

    def view(offset, length, field):
        asked.append((offset, length, field))
        return memoryview(x.tobytes()).toreadonly()

    got = args(shm, shm_view=view)
    assert got is not None and asked == [(at, x.nbytes, kind)]
    np.testing.assert_array_equal(got[index], x)
    assert not got[index].flags.writeable

    def outside(offset, length, field):
        raise ValueError("outside")

    assert args(shm, shm_view=outside) is None


def mutants(rng, body: bytes, n: int):
    """``n`` random corruptions of ``body``: bytes changed, cut out, put in, or the end cut."""
    for _ in range(n):
        b = bytearray(body)
        for _ in range(int(rng.integers(1, 4))):
            op, at = int(rng.integers(0, 4)), int(rng.integers(0, len(b) + 1))
            if op == 0 and at < len(b):
                b[at] = int(rng.integers(0, 256))
            elif op == 1:
                del b[at : at + int(rng.integers(1, 8))]
            elif op == 2:
                b[at:at] = rng.integers(0, 256, int(rng.integers(1, 6))).astype(np.uint8).tobytes()
            else:
                del b[at:]
        yield bytes(b)
