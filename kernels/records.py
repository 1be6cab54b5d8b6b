"""The binary records the host writes for the kernels, each layout defined here once.

A ``Record`` is the ``struct.Struct`` the host packs with (``pack_into`` straight into a
call's pinned buffer), the NumPy dtype of the same bytes (for tables built as arrays, and
tests) and the field list of its C struct. The C structs (``struct GemvJob`` and ``struct
MoeJob`` in ``jobs.cuh``, ``struct KvDesc`` in ``attention.cu``) are written by hand next to
the kernels that read them; ``tests/kernels/test_records.py`` parses them and fails when
their fields, types or order differ from these.
"""

from __future__ import annotations

import re
import struct

import numpy as np

#: Field types: (struct code, NumPy type, C type).
TYPES = {
    "u64": ("Q", "<u8", "unsigned long long"),
    "i32": ("i", "<i4", "int"),
}


class Record(struct.Struct):
    """One C struct's layout: little-endian, naturally aligned, no padding."""

    def __init__(self, c_name: str, fields: str) -> None:
        """``fields``: groups "a b c: u64; d e: i32" in declaration order."""
        parsed: list[tuple[str, str]] = []
        for group in fields.split(";"):
            names, kind = group.split(":")
            parsed += [(n, kind.strip()) for n in names.split()]
        super().__init__("<" + "".join(TYPES[k][0] for _, k in parsed))
        self.c_name = c_name
        self.fields = tuple(parsed)
        self.dtype = np.dtype([(n, TYPES[k][1]) for n, k in parsed])
        assert self.dtype.itemsize == self.size

    def c_fields(self) -> list[tuple[str, str]]:
        """(C type, field name) of each field, in order."""
        return [(TYPES[k][2], n) for n, k in self.fields]


# gemv.cu / gemv_tc.cu / prefill_tc.cu: one y = x @ W^T job (w1, s1 unused: a 64-byte record).
GEMV_JOB = Record("GemvJob", "w0 s0 w1 s1 x y: u64; rows out_rows x_stride y_stride: i32")
# moe / moe_tc / moe_pf: one expert of a group (gate, up, down; x, hidden, y).
MOE_JOB = Record("MoeJob", "wg sg wu su wd sd x h y: u64; rows ie dout pad: i32")
# attention.cu: one query row's KV cache (and where its new rows lie in the call's upload).
KV_DESC = Record("KvDesc", "latent rope: u64; len src: i32")
RECORDS = (GEMV_JOB, MOE_JOB, KV_DESC)
assert GEMV_JOB.size == 64 and MOE_JOB.size == 88 and KV_DESC.size == 24

_STRUCT = re.compile(r"struct\s+(\w+)\s*\{(.*?)\};", re.S)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DECL = re.compile(r"^\s*(unsigned long long|int)\s+([^;]+);", re.M)


def c_structs(source: str) -> dict[str, list[tuple[str, str]]]:
    """The plain structs of a CUDA source: name -> [(C type, field name)] in order (fields
    declared as ``type a, b, c;`` count one by one; comments ignored)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, body in _STRUCT.findall(_COMMENT.sub("", source)):
        fields: list[tuple[str, str]] = []
        for ctype, names in _DECL.findall(body):
            fields += [(ctype, n.strip()) for n in names.split(",")]
        out[name] = fields
    return out
