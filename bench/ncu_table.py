"""The counters table of a results file from ncu's CSV: one row per kernel and grid.

Reads what ``ncu --csv --page details`` prints (with the SpeedOfLight, Occupancy,
WarpStateStats and LaunchStats sections; ncu's own ``==PROF==`` lines and the profiled
program's output before the header are skipped) and prints a markdown table: kernel (its
template arguments kept, its parameter list dropped), grid, cluster size, launches, then the
median over those launches of the time, DRAM throughput and achieved occupancy (% of peak)
and warp cycles per issued instruction, and the stall that ncu's WarpStateStats rule names
(where it names one). Launches keep their first-seen order, so a profile that runs the old
path and then the new one reads top to bottom.

    ncu --clock-control none -k regex:mla_ --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --csv --page details \\
        python bench/mla_launches.py --profile --seqs 1,8 --calls 1 > $OUT/ncu.csv
    python bench/ncu_table.py $OUT/ncu.csv [--each]
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: (column, ncu metric name, scale to the column's unit by the metric's unit)
COLUMNS = (
    ("time us", "Duration"),
    ("DRAM % of peak", "DRAM Throughput"),
    ("achieved occupancy %", "Achieved Occupancy"),
    ("warp cycles per issued instruction", "Warp Cycles Per Issued Instruction"),
)
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
_STALL = re.compile(r"spends ([\d.]+) cycles being stalled ([^.]*?)\.")
_SHARE = re.compile(r"([\d.]+)% of the total average of ([\d.]+) cycles")


@dataclass
class Launch:
    """One profiled launch: its kernel, grid and the metrics ncu gave for it."""

    kernel: str
    grid: str
    metrics: dict[str, float] = field(default_factory=dict)
    cluster: str = "-"
    stall: str = ""


def kernel_name(demangled: str) -> str:
    """``void moe_tc<2, 1>(const MoeJob *, ...)`` -> ``moe_tc<2, 1>``."""
    name = demangled.removeprefix("void ").strip()
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i].strip()
    return name


def _number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return None


def _stall(rule: str) -> str:
    """The stall a WarpStateStats rule names: "<reason>: <cycles> of <total> cycles"."""
    m = _STALL.search(rule)
    if not m:
        return ""
    share = _SHARE.search(rule)
    total = f" of {share.group(2)}" if share else ""
    return f"{m.group(2).strip()}: {m.group(1)}{total} cycles"


def read(text: str) -> list[Launch]:
    """The launches of an ``ncu --csv --page details`` report, in profile order."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith('"ID",'))
    except StopIteration:
        raise ValueError('no ncu CSV header ("ID",...) in the input') from None
    rows = csv.DictReader(io.StringIO("\n".join(x for x in lines[start:] if x.startswith('"'))))
    launches: dict[str, Launch] = {}
    for r in rows:
        ln = launches.get(r["ID"])
        if ln is None:
            ln = launches[r["ID"]] = Launch(kernel_name(r["Kernel Name"]), r["Grid Size"])
        name, value, unit = r["Metric Name"], r["Metric Value"], r["Metric Unit"]
        if name == "Cluster Size" and value not in ("", "0"):
            ln.cluster = value
        elif name:
            v = _number(value)
            if v is not None:
                ln.metrics[name] = v * _TO_US[unit] if name == "Duration" else v
        if r["Section Name"] == "WarpStateStats" and r["Rule Description"] and not ln.stall:
            ln.stall = _stall(r["Rule Description"])
    return list(launches.values())


def table(launches: list[Launch], each: bool = False) -> str:
    """Markdown: one row per (kernel, grid, cluster) with medians (``each``: per launch)."""
    groups: dict[tuple, list[Launch]] = {}
    for i, ln in enumerate(launches):
        groups.setdefault((i,) if each else (ln.kernel, ln.grid, ln.cluster), []).append(ln)
    head = ["kernel", "grid", "cluster", "launches", *(c for c, _ in COLUMNS), "stall ncu names"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in groups.values():
        first = group[0]
        cells = [f"`{first.kernel}`", first.grid, first.cluster, str(len(group))]
        for _, metric in COLUMNS:
            vals = [g.metrics[metric] for g in group if metric in g.metrics]
            cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
        cells.append(next((g.stall for g in group if g.stall), "") or "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path, help="ncu --csv --page details output ('-': stdin)")
    ap.add_argument("--each", action="store_true", help="a row per launch, no medians")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if str(args.csv) == "-" else args.csv.read_text()
    print(table(read(text), args.each))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
