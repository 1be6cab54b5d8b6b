"""Shared by the tests that run a kernel's CUDA source on the CPU (test_attention_cpu.py,
test_attention_flash_cpu.py, test_gemv_stream_cpu.py, test_prefill_tc_cpu.py): the source
without its inline PTX, and the g++ build and run of a shim (which includes ``fibers.h`` and
the stripped source as ``kernel.inc``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
HERE = Path(__file__).resolve().parent


def without_ptx(src: str, helpers: tuple[str, ...]) -> str:
    """``src`` with the device functions named in ``helpers`` cut (the shim defines them) and
    every other asm statement dropped; ``extern __shared__ float4 smem4[]`` made the fiber's
    block memory."""
    for name in helpers:
        m = re.search(
            r"(?:template <[^>]*> )?__device__ __forceinline__ [\w ]+ " + name + r"\(", src
        )
        assert m, name
        depth, k = 0, src.index("{", m.start())
        while True:
            depth += {"{": 1, "}": -1}.get(src[k], 0)
            if depth == 0:
                break
            k += 1
        src = src[: m.start()] + src[k + 1 :]
    src = re.sub(r"asm(?:\s+volatile)?\((?:[^;]|;(?!\s*\n))*?\);", ";", src, flags=re.S)
    assert "asm" not in src
    return src.replace("extern __shared__ float4 smem4[];", "float4 *smem4 = cur_smem();")


def build_and_run(tmp: Path, shim: str, kernel: str, timeout: int) -> None:
    """Compile ``shim`` (``kernel`` as kernel.inc beside it) with g++ and run it: both must
    succeed (the program's output in the assertion message)."""
    (tmp / "kernel.inc").write_text(kernel)
    (tmp / "emu.cpp").write_text(shim)
    exe = tmp / "emu"
    cmd = ["g++", "-std=c++20", "-O2", "-w", f"-I{KERNELS}", f"-I{HERE}", "-o", str(exe)]
    cc = subprocess.run([*cmd, str(tmp / "emu.cpp")], capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
