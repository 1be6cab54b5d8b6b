"""How long a worker's decode calls wait for its upkeep (``server/upkeep.py``): Python's garbage
collections and the journals' folds (metrics, usage counts), with the upkeep off, freezing
only, and freezing and folding ahead, side by side in one run.

Each form runs in a process of its own (the switches are read at import): a NumPy worker
with ``--experts`` experts uploaded (the tracked objects that a model's tensors add; GLM-5.2
has 78 x 256), whose routed expert-group dispatch (``bench/call_cost.py``'s, compute
stubbed, metrics on, a different 8 experts each call) runs ``--calls`` times, each followed by
``--wait-us`` of sleep with the GIL released (where a GPU worker waits for its kernels; 0:
back to back). Per form: each dispatch's time (median, p99, p99.9, the longest), the calls
over 1 and 5 ms, and the collections by generation (count, longest), read with
``gc.callbacks``.

    python bench/call_pauses.py [--experts 3000] [--calls 100000] [--wait-us 100]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

#: form -> (COLIWORKER_GC_FREEZE, COLIWORKER_FOLD_AHEAD)
FORMS = {"upkeep off": ("0", "0"), "freezing": ("1", "0"), "freezing, folds ahead": ("1", "1")}


def measure(experts: int, calls: int, wait_us: float) -> dict:
    """This process's form (see the module docstring)."""
    from bench import call_cost

    srv, w, steps = call_cost.build(experts)
    dispatch = steps["expert_group_routed"]["worker dispatch"]
    for _ in range(2000):
        dispatch()
    ns = np.empty(calls, np.int64)
    gens: dict[int, list[int]] = collections.defaultdict(list)
    began = [0]

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter_ns()
        else:
            gens[info["generation"]].append(time.perf_counter_ns() - began[0])

    tracked = len(gc.get_objects()) + gc.get_freeze_count()  # (frozen ones too)
    gc.callbacks.append(seen)
    clock, sleep, wait = time.perf_counter_ns, time.sleep, wait_us / 1e6
    for i in range(calls):
        t0 = clock()
        dispatch()
        ns[i] = clock() - t0
        if wait:
            sleep(wait)
    gc.callbacks.remove(seen)
    settles = srv.upkeep.settles
    w.close()
    srv.stop(0)
    us = ns / 1e3
    return {
        "tracked objects": tracked,
        "median us": float(np.median(us)),
        "p99 us": float(np.percentile(us, 99)),
        "p99.9 us": float(np.percentile(us, 99.9)),
        "longest ms": float(us.max() / 1e3),
        "calls over 1 ms": int((us > 1000).sum()),
        "calls over 5 ms": int((us > 5000).sum()),
        "settles": settles,
        "collections": {
            str(g): {"count": len(v), "longest ms": max(v) / 1e6, "total ms": sum(v) / 1e6}
            for g, v in sorted(gens.items())
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=3000)
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--wait-us", type=float, default=100.0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    p.add_argument("--form", help=argparse.SUPPRESS)  # (a form's own process)
    args = p.parse_args()
    if args.form is not None:
        print(json.dumps(measure(args.experts, args.calls, args.wait_us)))
        return
    result = {}
    for form, (freeze, fold) in FORMS.items():
        env = {**os.environ, "COLIWORKER_GC_FREEZE": freeze, "COLIWORKER_FOLD_AHEAD": fold}
        cmd = [sys.executable, os.path.abspath(__file__), "--form", form,
               "--experts", str(args.experts), "--calls", str(args.calls),
               "--wait-us", str(args.wait_us)]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            raise SystemExit(f"{form}: rc {out.returncode}\n{out.stderr[-3000:]}")
        result[form] = json.loads(out.stdout.strip().splitlines()[-1])
        print(form, json.dumps(result[form]), flush=True)
    date, doc = harness.run_record("bench/call_pauses.py")
    doc.update(experts=args.experts, calls=args.calls, wait_us=args.wait_us, forms=result)
    mc = doc["machine"]
    stem = harness.write_json(args.out, f"call-pauses-{date:%Y-%m-%d}-{mc['commit']}", doc)
    rows = [
        ("objects tracked (frozen or not)", lambda r: f"{r['tracked objects']}"),
        ("median us", lambda r: f"{r['median us']:.1f}"),
        ("p99 us", lambda r: f"{r['p99 us']:.1f}"),
        ("p99.9 us", lambda r: f"{r['p99.9 us']:.1f}"),
        ("longest call ms", lambda r: f"{r['longest ms']:.1f}"),
        ("calls over 1 ms", lambda r: f"{r['calls over 1 ms']}"),
        ("calls over 5 ms", lambda r: f"{r['calls over 5 ms']}"),
        ("settles", lambda r: f"{r['settles']}"),
    ]
    for g in ("0", "1", "2"):
        rows.append((f"gen {g} collections: count / longest ms",
                     lambda r, g=g: "{count} / {longest ms:.1f}".format(
                         **r["collections"].get(g, {"count": 0, "longest ms": 0.0}))))  # fmt: skip
    lines = [
        "# bench/call_pauses.py — decode calls waiting for the worker's upkeep",
        "",
        f"- date: {doc['date']}; commit: {mc['commit']}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, python {mc['python']}",
        f"- command: `{doc['command']}`; {args.experts} experts uploaded, {args.calls} routed "
        f"dispatches (compute stubbed), each followed by {args.wait_us:g} us of sleep (the GIL "
        "released), each form in its own process",
        "",
        "| | " + " | ".join(result) + " |",
        "|---|" + "---|" * len(result),
    ]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in result.values()) + " |")
    harness.write_md(stem, lines, show=True)


if __name__ == "__main__":
    main()
