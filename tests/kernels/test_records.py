"""``kernels/records.py`` against the C structs the kernels read: same fields, types, order.
No GPU needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coliworker.kernels import records

WHERE = {"GemvJob": "jobs.cuh", "MoeJob": "jobs.cuh", "KvDesc": "attention.cu"}


@pytest.mark.parametrize("rec", records.RECORDS, ids=lambda r: r.c_name)
def test_record_matches_its_c_struct(rec):
    text = (Path(records.__file__).parent / WHERE[rec.c_name]).read_text()
    structs = records.c_structs(text)
    assert structs[rec.c_name] == rec.c_fields()


@pytest.mark.parametrize("rec", records.RECORDS, ids=lambda r: r.c_name)
def test_struct_and_dtype_agree_on_every_byte(rec):
    rng = np.random.default_rng()
    vals = [
        int(rng.integers(0, 2**63)) if k == "u64" else int(rng.integers(-(2**31), 2**31))
        for _, k in rec.fields
    ]
    arr = np.zeros(1, rec.dtype)
    for (name, _), v in zip(rec.fields, vals, strict=True):
        arr[name] = v
    assert rec.pack(*vals) == arr.tobytes()


def test_c_structs_reads_grouped_declarations_and_skips_comments():
    src = """
    // struct Fake { int no; };
    struct A {
        unsigned long long p, q;  // two pointers
        /* int hidden; */
        int n;
    };
    """
    assert records.c_structs(src) == {
        "A": [("unsigned long long", "p"), ("unsigned long long", "q"), ("int", "n")]
    }


def test_a_changed_c_struct_is_caught():
    src = "struct KvDesc { unsigned long long latent, rope; int src; int len; };"
    assert records.c_structs(src)["KvDesc"] != records.KV_DESC.c_fields()
