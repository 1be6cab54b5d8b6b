"""Scripts run over ``bench/host_python.py``'s stand-in CuPy, each in a subprocess of its own
(the stand-in replaces the ``cupy`` modules of the process it runs in): the CPU tests of the
CuPy backend's host path (``test_arena_writes_cpu.py``, ``test_kept_calls_cpu.py``,
``test_wait_cpu.py``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, timeout: int = 300) -> str:
    """``script``'s standard output, run from the tree's root with the tree importable; the
    test fails with its output where it exits nonzero."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, ".dev"), ROOT]))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout


def last_dict(script: str, timeout: int = 300) -> dict:
    """The dict ``script`` printed last (its repr, read as a literal)."""
    return ast.literal_eval(run(script, timeout).strip().splitlines()[-1])


def need_compiled(compiled: str, monkeypatch) -> None:
    """Run the scripts with the compiled kept calls (``server/kept.c``) off ("0") or on ("1");
    on, the test is skipped where this host lacks the tools to build them (no C compiler or
    Python headers), and fails where the source does not compile."""
    monkeypatch.setenv("COLIWORKER_KEPT_C", compiled)
    if compiled == "1":
        from coliworker.server import kept

        try:
            kept.build()
        except RuntimeError as exc:
            if not kept.unbuildable(exc):
                raise
            pytest.skip(f"server/kept.c cannot be built here: {str(exc)[:300]}")
