"""The frame format as documented (proto/FRAMES.md) is the one the code writes and reads:
the golden examples, the header layout table and the Method table are checked here."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import calls, codec, frames

DOC = pathlib.Path(__file__).resolve().parents[2] / "proto" / "FRAMES.md"


def goldens() -> dict[str, bytes]:
    out = {}
    text = DOC.read_text()
    for m in re.finditer(r"<!-- golden:([\w-]+) -->\n((?:    [0-9a-f ]+\n)+)", text):
        out[m.group(1)] = bytes.fromhex(m.group(2).replace(" ", "").replace("\n", ""))
    return out


def built() -> dict[str, bytes]:
    def join(bufs):
        return b"".join(bytes(b) for b in bufs)

    hello = pb.DataHello(version=1, token="t0k").SerializeToString()
    side: list = []
    x = np.array([[1.0, -2.0]], np.float32)
    req = pb.MatmulRequest(handle=3, x=codec.encode(x, pb.DTYPE_FLOAT32, side))
    pieces, n = frames.place(req, side)
    call = join(frames.frame(frames.CALL, 7, 5, req.SerializeToString(), pieces, n))
    side = []
    y = np.array([[5.0]], np.float32)
    resp = pb.MatmulResponse(y=codec.encode(y, pb.DTYPE_FLOAT32, side), backend_ns=1000)
    pieces, n = frames.place(resp, side)
    reply = join(frames.frame(frames.REPLY, 7, 5, resp.SerializeToString(), pieces, n))
    error = join(frames.error_frame(7, 5, 5, "matmul.handle: unknown handle 3"))
    return {
        "hello": join(frames.frame(frames.HELLO, 0, 0, hello)),
        "matmul": call,
        "matmul-reply": reply,
        "error": error,
    }


def test_goldens_are_what_the_code_writes():
    doc, code = goldens(), built()
    assert set(doc) == set(code)
    for name in code:
        assert doc[name].hex() == code[name].hex(), name


@pytest.mark.parametrize("name", ["hello", "matmul", "matmul-reply", "error"])
def test_goldens_parse_back(name):
    raw = goldens()[name]
    head = frames.parse(raw)
    assert len(raw) == frames.HEADER_BYTES + head.body_bytes + head.data_bytes
    body = raw[frames.HEADER_BYTES : frames.HEADER_BYTES + head.body_bytes]
    data = raw[frames.HEADER_BYTES + head.body_bytes :]
    if name == "matmul":
        req = pb.MatmulRequest.FromString(body)
        got = codec.decode(req.x, "x", source=lambda a: data[a.staged.offset :][: a.staged.length])
        np.testing.assert_array_equal(got, [[1.0, -2.0]])
    if name == "error":
        assert head.status == 5 and body.decode() == "matmul.handle: unknown handle 3"


def test_header_table_matches_the_struct():
    """The header table's offsets and sizes are the struct's."""
    rows = re.findall(r"^\| (\d+) \| (\d) \| `(\w+)` \|", DOC.read_text(), re.M)
    offsets = [(int(o), int(n), name) for o, n, name in rows]
    assert [name for *_, name in offsets] == [
        "magic",
        "type",
        "flags",
        "method",
        "request_id",
        "status",
        "body_bytes",
        "data_bytes",
    ]
    fmt_sizes = [4, 1, 1, 2, 8, 4, 4, 8]
    assert [n for _, n, _ in offsets] == fmt_sizes
    assert [o for o, _, _ in offsets] == [sum(fmt_sizes[:i]) for i in range(len(fmt_sizes))]
    assert frames.HEADER.size == sum(fmt_sizes) == 32


def test_method_table_matches_the_contract():
    """Every RPC of service Worker has METHOD_<NAME> in enum Method, the doc's table lists
    each data-plane call with its number and messages, and no enum value is left over."""
    service = pb.DESCRIPTOR.services_by_name["Worker"]
    names = [m.name for m in service.methods]
    enum_values = {v.name: v.number for v in pb.Method.DESCRIPTOR.values}
    assert set(enum_values) == {"METHOD_UNSPECIFIED"} | {
        "METHOD_" + calls.BY_NAME[n].kind.upper() for n in names
    }
    table = re.findall(r"^\| (\d+) \| (\w+) \| (\w+)[^|]*\| (\w+) \|$", DOC.read_text(), re.M)
    documented = {name: (int(num), req, resp) for num, name, req, resp in table}
    for c in calls.CALLS:
        if c.name == "Session":
            assert c.name not in documented
            continue
        assert documented[c.name] == (c.method, c.request.__name__, c.response.__name__)
