"""bench/ncu_table.py on a real ncu report (H200, 2026-12-01: mla_launches --profile, the old
MLA kernels at one sequence and two launches of mla_flash_c): the figures it prints are the
report's own, read here from its rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import ncu_table  # noqa: E402

REPORT = Path(__file__).with_name("ncu-mla-2026-12-01.csv")


def test_kernel_names_keep_template_arguments_and_drop_parameters():
    assert ncu_table.kernel_name("void moe_tc<2, 1>(const MoeJob *, int *, int)") == "moe_tc<2, 1>"
    assert ncu_table.kernel_name("mla_merge(float *, const float *, int)") == "mla_merge"
    assert ncu_table.kernel_name("void f<A<(int)1>, 2>(int (*)[3])") == "f<A<(int)1>, 2>"


def test_launches_and_their_metrics_as_in_the_report():
    launches = ncu_table.read(REPORT.read_text())
    # report IDs 1, 4, 9, 10, 11 in that order
    assert [ln.kernel for ln in launches] == [
        "mla_flash_c<32, 8>", "mla_flash_c<32, 8>", "mla_absorb<2>", "mla_flash<32>", "mla_merge",
    ]  # fmt: skip
    flash_c, _, absorb, flash, merge = launches
    assert flash_c.grid == "(120, 1, 1)" and flash_c.cluster == "8" and absorb.cluster == "-"
    assert flash_c.metrics["Duration"] == pytest.approx(36.288)  # "36,288" ns, in us
    assert absorb.metrics["Duration"] == pytest.approx(14.24)
    assert absorb.metrics["DRAM Throughput"] == 9.41
    assert merge.metrics["Achieved Occupancy"] == 11.75
    assert "L1TEX" in merge.stall and merge.stall.endswith(": 27.7 of 32.0 cycles")
    assert "instruction queue" in flash.stall


def test_table_medians_over_a_kernels_launches():
    md = ncu_table.table(ncu_table.read(REPORT.read_text())).splitlines()
    assert len(md) == 2 + 4  # header, rule, 4 kernels (two launches of mla_flash_c share one)
    row = md[2].split(" | ")
    assert row[0] == "| `mla_flash_c<32, 8>`" and row[3] == "2"
    assert row[4] == "36.4"  # median of 36.288 and 36.480
    each = ncu_table.table(ncu_table.read(REPORT.read_text()), each=True).splitlines()
    assert len(each) == 2 + 5
