"""Property-based fuzzing of the socket data plane's frame parser (``proto/FRAMES.md``), as
``test_fuzz.py`` fuzzes the gRPC surface: garbage before the HELLO, truncated frames, sizes
far past the limits (refused before any buffer is allocated), wrong lengths, odd and
duplicate request ids, unknown methods and frame types, CALL frames with random bodies for
every data-plane method (with ``staged`` slices pointing anywhere), garbage after a valid
HELLO or after a valid call. Every frame the worker sends back is a typed REPLY (or
WELCOME); a broken frame closes only its own connection; after each example a fresh
connection still gets Info and an exact matmul, and nothing resident changes
(``_frames.Plane``). Idle, slow and killed clients: ``test_frames_clients.py``."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from _frames import (
    ANSWER_S,
    EXHAUSTED,
    INFO,
    INVALID,
    MATMUL,
    MAX_FRAME,
    METHODS,
    PER_METHOD,
    SMALL,
    call_bytes,
    decode_matmul,
    exchange,
    hello_frame,
    matmul_bytes,
    matmul_parts,
    read_frame,
    recv_exact,
    rss,
    upload_header,
)
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz import message

from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, frames, staging

# -- garbage, truncation, sizes --------------------------------------------------------------


def test_garbage_before_hello(plane):
    @SMALL
    @given(
        st.one_of(
            st.binary(max_size=256),
            st.binary(max_size=64).map(lambda b: frames.MAGIC + b),
            st.tuples(st.sampled_from([1, 2, 3, 4, 0, 5, 255]), st.binary(max_size=64)).map(
                lambda t: frames.MAGIC + bytes([t[0]]) + t[1]
            ),
        ),
        st.booleans(),
    )
    def fuzz(garbage, then_hello):
        blob = garbage + (hello_frame() if then_hello else b"")
        out = exchange(plane, blob, after_hello=False)
        for i, (head, _, _) in enumerate(out):
            if head.status:  # the answer naming the problem is the connection's last
                assert i == len(out) - 1 and head.status in (INVALID, EXHAUSTED, 16)
        plane.healthy()

    fuzz()
    plane.check()


def test_truncated_frames(plane):
    """A HELLO, or a CALL after a valid HELLO, cut at any byte; or whole but with its body or
    data shorter than declared; then the connection is closed."""
    body, data = matmul_parts(plane)
    whole = matmul_bytes(plane, 7)
    hello = hello_frame()

    @SMALL
    @given(
        st.sampled_from(["hello", "call", "short_body", "short_data", "upload"]),
        st.integers(0, 1 << 16),
        st.integers(1, 1 << 20),
    )
    def fuzz(kind, cut, extra):
        if kind == "hello":
            exchange(plane, hello[: cut % len(hello)], after_hello=False)
        elif kind == "call":
            out = exchange(plane, whole[: cut % len(whole)])
            assert out == []  # nothing answered: the call never arrived whole
        elif kind == "short_body":  # body_bytes says more than comes
            head = frames.pack(frames.CALL, MATMUL, 7, 0, len(body) + 1 + extra % 4096, len(data))
            assert exchange(plane, head + body + data) == []
        elif kind == "short_data":  # data_bytes says more than comes
            head = frames.pack(frames.CALL, MATMUL, 7, 0, len(body), len(data) + extra)
            assert exchange(plane, head + body + data[: cut % (len(data) + 1)]) == []
        else:  # an upload frame whose data stops early
            up = upload_header(extra)
            hb = up.SerializeToString()
            method = calls.BY_KIND["upload"].method
            head = frames.pack(frames.CALL, method, 7, 0, len(hb), up.weight_bytes)
            exchange(plane, head + hb + os.urandom(cut % up.weight_bytes))
        plane.healthy()

    fuzz()
    plane.check()


@pytest.mark.parametrize(
    "body_bytes, data_bytes, text",
    [
        (frames.MAX_BODY_BYTES + 1, 0, "body_bytes"),
        (2**32 - 1, 0, "body_bytes"),
        (10, 1 << 40, "max-frame-bytes"),  # 1 TB of data
        (10, 2**64 - 1, "max-frame-bytes"),
        (10, MAX_FRAME, "max-frame-bytes"),  # body + data one past the limit
        (frames.MAX_BODY_BYTES, MAX_FRAME, "max-frame-bytes"),
    ],
)
def test_oversized_frames_refused_before_allocation(plane, body_bytes, data_bytes, text):
    before = rss()
    s = plane.hello()
    try:
        s.sendall(frames.pack(frames.CALL, MATMUL, 11, 0, body_bytes, data_bytes))
        head, body, _ = read_frame(s)  # answered at once: nothing more is sent
        assert head.type == frames.REPLY and head.status == EXHAUSTED, body
        assert head.request_id == 11 and text in body.decode()
        assert recv_exact(s, 1) is None  # then that connection (only) is closed
    finally:
        s.close()
    assert rss() - before < 64 << 20, "a refused size was allocated"
    plane.healthy()


def test_oversized_hello_refused_before_allocation(plane):
    before = rss()
    for body_bytes in (frames.MAX_HELLO_BYTES + 1, frames.MAX_BODY_BYTES, 2**32 - 1):
        s = plane.connect()
        try:
            s.sendall(frames.pack(frames.HELLO, 0, 0, 0, body_bytes, 0))
            head, _, _ = read_frame(s)
            assert head.status in (INVALID, EXHAUSTED)
            assert recv_exact(s, 1) is None
        finally:
            s.close()
    s = plane.connect()
    try:  # a HELLO with data
        s.sendall(frames.pack(frames.HELLO, 0, 0, 0, 0, 1 << 40))
        head, _, _ = read_frame(s)
        assert head.type == frames.WELCOME and head.status == INVALID
    finally:
        s.close()
    assert rss() - before < 64 << 20
    plane.healthy()


@pytest.mark.parametrize("mismatch", [False, True], ids=["too_big", "data_bytes_mismatch"])
def test_refused_upload_is_answered_at_once(plane, mismatch):
    """An Upload frame declaring 1 TB of data whose header the worker refuses: the REPLY
    comes before the data (which the client then need not send)."""
    before = rss()
    header = pb.UploadHeader(
        spec=pb.TensorSpec(fmt=0, in_features=1 << 18, out_features=1 << 20),
        content_hash=bytes(32),
        weight_bytes=1 << 40,
    )
    total = (1 << 40) + (1 if mismatch else 0)
    hb = header.SerializeToString()
    s = plane.hello()
    s.settimeout(ANSWER_S)  # answered at once: no REPLY within ANSWER_S is none at all
    try:
        s.sendall(frames.pack(frames.CALL, calls.BY_KIND["upload"].method, 12, 0, len(hb), total))
        s.sendall(hb)
        try:
            raw = s.recv(frames.HEADER_BYTES, socket.MSG_WAITALL)
        except TimeoutError:
            raw = b""
        assert len(raw) == frames.HEADER_BYTES, "no REPLY to a refused upload"
        head = frames.parse(raw)
        assert head.request_id == 12 and head.status in (INVALID, EXHAUSTED)
    finally:
        s.close()
    assert rss() - before < 64 << 20
    plane.healthy()


# -- wrong lengths, request ids, methods, frame types ----------------------------------------


def test_wrong_lengths(plane):
    """body_bytes / data_bytes smaller or larger than what follows (the bytes a wrong length
    leaves over are read as the next frame), then a valid Info."""
    body, data = matmul_parts(plane)

    @SMALL
    @given(st.integers(-len(body), 64), st.integers(-len(data), 256), st.booleans())
    def fuzz(db, dd, pad):
        nb, nd = len(body) + db, len(data) + dd
        tail = os.urandom(max(0, db) + max(0, dd)) if pad else b""
        blob = frames.pack(frames.CALL, MATMUL, 3, 0, nb, nd) + body + data + tail
        blob += call_bytes(INFO, 4, pb.InfoRequest())
        out = exchange(plane, blob)
        if db == 0 and dd == 0:
            assert [h.request_id for h, _, _ in out] == [3, 4]
            np.testing.assert_array_equal(decode_matmul(out[0][1], out[0][2]), plane.want)
        for head, _, _ in out:
            assert head.request_id in (0, 3, 4)
        plane.healthy()

    fuzz()
    plane.check()


def test_request_ids_any_and_duplicate(plane):
    """Pipelined calls with request ids drawn from a few values (0, 2^64-1, repeats): each
    call gets one REPLY carrying its id, and the matmuls are exact."""
    ids = st.sampled_from([0, 1, 1, 2**63, 2**64 - 1, 42])

    @SMALL
    @given(st.lists(st.tuples(ids, st.booleans()), min_size=1, max_size=8))
    def fuzz(plan):
        blob = b"".join(
            matmul_bytes(plane, rid) if mm else call_bytes(INFO, rid, pb.InfoRequest())
            for rid, mm in plan
        )
        out = exchange(plane, blob)
        assert sorted(h.request_id for h, _, _ in out) == sorted(r for r, _ in plan)
        assert all(h.status == 0 for h, _, _ in out)
        for head, body, data in out:
            if head.method == MATMUL:
                np.testing.assert_array_equal(decode_matmul(body, data), plane.want)
            else:
                assert head.method == INFO
        plane.healthy()

    fuzz()
    plane.check()


def test_unknown_methods_and_bad_headers(plane):
    """A CALL naming no data-plane method, a frame of another type or with flags or status
    set: one INVALID_ARGUMENT REPLY with the request id as read, and that connection ends."""
    not_methods = st.integers(0, 65535).filter(lambda m: m not in calls.DATA_PLANE)

    @SMALL
    @given(
        st.one_of(
            st.tuples(st.just("method"), not_methods),
            st.tuples(st.just("type"), st.sampled_from([0, 1, 2, 4, 5, 99, 255])),
            st.tuples(st.just("flags"), st.integers(1, 255)),
            st.tuples(st.just("status"), st.integers(1, 2**32 - 1)),
        ),
        st.integers(0, 2**64 - 1),
        st.binary(max_size=32),
    )
    def fuzz(bad, rid, body):
        what, v = bad
        method, type_, flags, status = INFO, frames.CALL, 0, 0
        if what == "method":
            method = v
        elif what == "type":
            type_ = v
        elif what == "flags":
            flags = v
        else:
            status = v
        head = frames.HEADER.pack(frames.MAGIC, type_, flags, method, rid, status, len(body), 0)
        out = exchange(plane, head + body + call_bytes(INFO, 5, pb.InfoRequest()))
        assert len(out) == 1, out
        head, msg, _ = out[0]
        assert head.status == INVALID and head.request_id == rid
        assert msg.decode().startswith("frame.")
        plane.healthy()

    fuzz()
    plane.check()


# -- random bodies for every data-plane method -----------------------------------------------


@st.composite
def staged_request(draw, call: calls.Call, handles: list[int]):
    """A random request of ``call`` and the frame data after it: arrays sometimes moved
    out of the message to ``staged`` slices inside, at the edge of, or past the data."""
    req = draw(message(call.request.DESCRIPTOR, handles))
    n = draw(st.sampled_from([0, 4, 64, 200, 1024, 4096]))
    data = draw(st.binary(min_size=n, max_size=n)) if n <= 64 else os.urandom(n)
    if call.streams_data:
        if draw(st.booleans()):  # make the header's sizes agree with the data
            req.weight_bytes, req.scale_bytes = n, 0
        return req, data
    mode = draw(st.sampled_from(["as drawn", "inside", "anywhere", "inline"]))
    for a in staging.iter_arrays(req):
        if mode == "as drawn":
            continue
        if mode == "inline":
            a.ClearField("staged")
            a.ClearField("shm")
            continue
        a.ClearField("data")
        a.ClearField("shm")
        if mode == "inside" and n:
            off = draw(st.integers(0, n))
            length = draw(st.integers(0, n - off))
        else:
            off = draw(st.sampled_from([0, n, n + 1, 2**32, 2**63, 2**64 - 1]))
            length = draw(st.sampled_from([0, 1, n, 2**32, 2**64 - 1 - off]))
        a.staged.offset, a.staged.length = off, length
    return req, data


@pytest.mark.parametrize("method", METHODS, ids=lambda m: calls.BY_METHOD[m].name)
def test_random_bodies_get_typed_replies(plane, method):
    call = calls.BY_METHOD[method]
    # Free/Update/FreeSequence with a resident handle would legitimately change state.
    destructive = call.name in ("Free", "Update", "FreeSequence")
    handles = [] if destructive else plane.resident.handles

    @PER_METHOD
    @given(staged_request(call, handles), st.integers(0, 2**64 - 1))
    def fuzz(drawn, rid):
        req, data = drawn
        blob = call_bytes(method, rid, req, data) + call_bytes(INFO, 2, pb.InfoRequest())
        out = exchange(plane, blob)
        # the format is intact: the call gets its REPLY and the connection goes on
        assert [(h.request_id, h.method) for h, _, _ in out] == [(rid, method), (2, INFO)]
        assert out[1][0].status == 0
        plane.healthy()

    fuzz()
    plane.check()


def test_random_garbage_bodies_get_typed_replies(plane):
    """Bodies of random bytes (mostly not a valid message) for every method."""

    @SMALL
    @given(st.sampled_from(METHODS), st.binary(max_size=256), st.binary(max_size=128))
    def fuzz(method, body, data):
        if calls.BY_METHOD[method].name in ("Free", "Update", "FreeSequence"):
            return  # a random body could name nothing resident anyway; keep it simple
        blob = frames.pack(frames.CALL, method, 9, 0, len(body), len(data)) + body + data
        out = exchange(plane, blob + call_bytes(INFO, 2, pb.InfoRequest()))
        assert [(h.request_id, h.method) for h, _, _ in out] == [(9, method), (2, INFO)]
        plane.healthy()

    fuzz()
    plane.check()


def test_garbage_after_a_valid_hello(plane):
    @SMALL
    @given(
        st.one_of(
            st.binary(min_size=1, max_size=512),
            st.binary(max_size=64).map(lambda b: frames.MAGIC + b),
            st.binary(max_size=24).map(lambda b: frames.MAGIC + bytes([frames.CALL, 0]) + b),
        )
    )
    def fuzz(garbage):
        exchange(plane, garbage)  # every answer typed (drain), then closed
        plane.healthy()

    fuzz()
    plane.check()


def test_random_bytes_after_a_valid_call(plane):
    @SMALL
    @given(st.binary(min_size=1, max_size=512))
    def fuzz(garbage):
        out = exchange(plane, matmul_bytes(plane, 1) + garbage)
        assert out, "the valid call got no REPLY"
        head, body, data = out[0]
        assert head.request_id == 1 and head.status == 0
        np.testing.assert_array_equal(decode_matmul(body, data), plane.want)
        plane.healthy()

    fuzz()
    plane.check()
