"""Instructions per decode call on the worker's host path, this tree beside a baseline commit,
counted by callgrind: a figure that does not move with the machine's load (a 2-core VM's
timings of the same code vary by +-50%; its instruction counts do not).

Each tree runs ``bench/call_cost.py``'s steps (client build, worker parse, worker dispatch,
worker reply, client decode) for a routed expert group and a ragged attention call, with
the worker's metrics on in both (as deployed). The measured loop of one step runs inside a
``qsort`` comparator, and callgrind collects only inside ``qsort``
(``--collect-atstart=no --toggle-collect=*qsort*``), so the count is that loop's, nothing
of start-up or other threads. Needs valgrind.

    python bench/call_instructions.py --baseline 6a61809 [--steps "worker dispatch"]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("expert_group_routed", "expert_group", "attention_ragged")
STEPS = ("client build", "worker parse", "worker dispatch", "worker reply", "client decode",
         "worker frame", "worker frame (Python)")  # fmt: skip

# Run in the tree measured (cwd), with only its own bench/call_cost.py: every version of it
# calls _time(fn, n) once per step, in the order of the names its run() returns per kind.
DRIVER = r"""
import ctypes, dataclasses, os, sys
sys.path.insert(0, os.getcwd())
import coliworker.server.app as app
real = app.build_server
def build_server(config, *a, **k):  # metrics on, whatever this tree's bench says
    if config.metrics_port is None:
        config = dataclasses.replace(config, metrics_port=0)
    return real(config, *a, **k)
app.build_server = build_server
import bench.call_cost as cc
fns = []
def _time(fn, n):
    fns.append(fn)
    for _ in range(50):
        fn()
    return 0.0
cc._time = _time
result = cc.run(1)
kinds = list(result)
per_kind = len(fns) // len(kinds)
if os.environ["KIND"] not in result:
    sys.exit(f"no step {os.environ['STEP']!r} of {os.environ['KIND']!r} in this tree's bench")
names = list(result[os.environ["KIND"]])  # the steps in the order they were timed
if os.environ["STEP"] not in names:
    sys.exit(f"no step {os.environ['STEP']!r} in this tree's bench/call_cost.py")
fn = fns[kinds.index(os.environ["KIND"]) * per_kind + names.index(os.environ["STEP"])]
n = int(os.environ["CALLS"])
def measured(a, b):
    for _ in range(n):
        fn()
    return 0
cmp = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(measured)
ctypes.CDLL("libc.so.6").qsort((ctypes.c_int * 2)(2, 1), 2, 4, cmp)
"""


def export(rev: str, into: str) -> str:
    """``rev``'s tree under ``into``, importable (``scripts/devlink``)."""
    tree = os.path.join(into, rev)
    os.makedirs(tree)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    subprocess.run([os.path.join(tree, "scripts", "devlink")], cwd=tree, check=True)
    return tree


def count(tree: str, kind: str, step: str, calls: int, scratch: str) -> float | None:
    """Instructions per call of ``step`` of ``kind`` in ``tree`` (None: a tree whose
    bench/call_cost.py has no such step)."""
    tag = re.sub(r"\W+", "-", step)
    out = os.path.join(scratch, f"cg-{os.path.basename(tree)}-{kind}-{tag}.out")
    env = {**os.environ, "PYTHONPATH": f"{tree}/.dev:{tree}", "KIND": kind}
    env.update(STEP=step, CALLS=str(calls))
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=*qsort*",
           f"--callgrind-out-file={out}", sys.executable, "-c", DRIVER]  # fmt: skip
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if "no step" in p.stderr and p.returncode:
        return None
    found = re.findall(r"Collected : (\d+)", p.stderr)
    if p.returncode != 0 or not found:
        raise RuntimeError(f"callgrind of {kind} / {step} in {tree}:\n{p.stderr[-3000:]}")
    return int(found[-1]) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit to count beside this tree")
    p.add_argument("--steps", default="worker dispatch", help="comma-separated, or 'all'")
    # 2048: two of the usage journal's folds (server/usage.py, every JOURNAL = 1024 calls)
    # fall inside the count, as they do in a served stream of calls; 300 counted none.
    p.add_argument("--calls", type=int, default=2048)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    steps = STEPS if args.steps == "all" else tuple(s.strip() for s in args.steps.split(","))
    if not os.path.isdir(os.path.join(ROOT, ".dev")):
        subprocess.run([os.path.join(ROOT, "scripts", "devlink")], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"baseline": export(args.baseline, scratch), "this tree": ROOT}
        jobs = [(t, k, s) for t in trees for k in KINDS for s in steps]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futs = {
                j: pool.submit(count, trees[j[0]], j[1], j[2], args.calls, scratch) for j in jobs
            }
            ir = {j: f.result() for j, f in futs.items()}
    date, doc = harness.run_record("bench/call_instructions.py")
    base = args.baseline
    doc.update(baseline=base, calls=args.calls)
    doc["instructions_per_call"] = {f"{t} / {k} / {s}": v for (t, k, s), v in sorted(ir.items())}
    mc = doc["machine"]
    stem = harness.write_json(args.out, f"call-instructions-{date:%Y-%m-%d}-{mc['commit']}", doc)
    lines = [
        "# bench/call_instructions.py — instructions per decode call (callgrind)",
        "",
        f"- date: {doc['date']}; commit: {mc['commit']} beside baseline {base}",
        f"- machine: {mc['host']}, {mc['cpu']} x{mc['cpus']}, python {mc['python']}",
        f"- command: `{doc['command']}`; {args.calls} calls per count; worker metrics on",
        "",
        "| call | step | baseline k instr | this tree k instr | ratio |",
        "|---|---|---|---|---|",
    ]
    for k in KINDS:
        for s in steps:
            b, n = ir[("baseline", k, s)], ir[("this tree", k, s)]
            if b is None:  # (a step the baseline's bench does not have)
                lines.append(f"| {k} | {s} | - | {n / 1e3:.1f} | - |")
            else:
                lines.append(f"| {k} | {s} | {b / 1e3:.1f} | {n / 1e3:.1f} | {n / b:.3f} |")
    harness.write_md(stem, lines, show=True)


if __name__ == "__main__":
    main()
