"""The seed's own benchmark (``bench_seed.py``, its functions unchanged) on its GLM-5.2 decode
rows only: what one decode call costs a seed-ABI engine, through any library with the seed's
symbols (the seed's in-process one, or ``libcoliworker_cuda.so`` to a worker). The full
``bench_seed.py`` run also uploads three 1.2 GB prefill groups; this keeps a GPU session's
run to seconds. Writes the rows as ``bench_seed.py`` writes them (``SEEDBENCH_JSON``'s
format), so ``bench/seed_side_by_side.py`` puts two runs in one table.

    python bench/seed_decode.py .seed/bench_seed.py LIB.so --out rows.json [--rows 8x1,S1 T4096]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

GLM = (6144, 2048)
MLA = (64, 192, 64, 256, 512)  # H, Q, R, V, K


def rows(bs) -> dict:
    """Row name -> a call of ``bench_seed``'s own function for it (its names, as it runs them)."""
    d, i = GLM
    return {
        "glm52 decode 8x1 w4 dual": lambda: bs.bench_group("glm52 decode 8x1 w4 dual", d, i, 8, 1),
        "glm52 decode 8x4 w4 dual": lambda: bs.bench_group("glm52 decode 8x4 w4 dual", d, i, 8, 4),
        "glm52 decode 8x1 g4 gs128": lambda: bs.bench_group(
            "glm52 decode 8x1 g4 gs128", d, i, 8, 1, fmt=4, gs=128
        ),
        "glm52 dense S=1 6144x6144 int4": lambda: bs.bench_matmul(
            "glm52 dense S=1 6144x6144 int4", 1, d, d
        ),
        "mla ragged H64 S1 T4096": lambda: bs.bench_ragged(
            "mla ragged H64 S1 T4096", *MLA, 4096, 1, d
        ),
        "mla ragged H64 S8 T4096": lambda: bs.bench_ragged(
            "mla ragged H64 S8 T4096", *MLA, 4096, 8, d
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_seed", help="the seed's bench_seed.py")
    p.add_argument("lib", help="a library with the seed's symbols")
    p.add_argument("--out", required=True, help="the rows as JSON (SEEDBENCH_JSON's format)")
    p.add_argument("--rows", default="", help="comma-separated substrings (default: all)")
    a = p.parse_args()
    sys.argv = [a.bench_seed, a.lib]  # (bench_seed.py loads and initializes sys.argv[1])
    spec = importlib.util.spec_from_file_location("bench_seed", a.bench_seed)
    assert spec is not None and spec.loader is not None
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    for name, run in rows(bs).items():
        if not a.rows or any(w in name for w in a.rows.split(",")):
            run()
    with open(a.out, "w") as f:
        json.dump(bs.results, f, indent=1)


if __name__ == "__main__":
    main()
