"""The compiled kept decode calls (``server/kept.c``): built on first use with the host's C
compiler into a cache directory, loaded, and handed the Python objects they read; the CuPy
backend's ``_kept`` calls them in place of their Python twins.

    twins()  ->  Twins(routed_kept, routed, group_kept, group, run_kept, ragged,
                       matmul_kept, matmul, rerun) or None

``routed`` is ``expert_group.routed_kept`` followed by ``cupy_calls.rerun``; ``group`` is
``expert_group.group_kept``, ``ragged`` ``attention_call.run_kept`` and ``matmul``
``matmul.run_kept``, each followed by it; ``rerun`` is ``cupy_calls.rerun``. Each writes the
same bytes and returns the same result as its twins (``tests/kernels/test_arena_writes_cpu.py``
and ``test_kept_calls_cpu.py`` run both, ``tests/kernels/test_graphs.py`` on a GPU); the Python
stays the reference and the fallback: where the module cannot be built (no compiler, no Python
headers) the backend logs one warning and runs the Python.

``COLIWORKER_KEPT_C=0`` turns the compiled calls off. ``COLIWORKER_KEPT_CACHE`` names the
directory the built module is kept in (default ``$XDG_CACHE_HOME/coliworker`` or
``~/.cache/coliworker``); a build is keyed by the source's hash and the interpreter's ABI, so
a changed source or another Python builds afresh. ``python -m coliworker.server.kept`` builds
it ahead (the Docker image does, at build time) and prints where it lies.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

ENABLED = os.environ.get("COLIWORKER_KEPT_C", "1") != "0"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kept.c")

_lock = threading.Lock()
_built: list[ModuleType | None] = []  # [the module or None] once tried


def cache_dir() -> str:
    """Where built modules are kept (``COLIWORKER_KEPT_CACHE``, else the user's cache)."""
    d = os.environ.get("COLIWORKER_KEPT_CACHE")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "coliworker")


def build(
    out_dir: str | None = None,
    source: str = SOURCE,
    includes: tuple[str, ...] = (),
    salt: str = "",
) -> str:
    """Compile ``source`` (``kept.c``; ``fastpath.c`` too) for this interpreter where not
    built already; the module's path. ``includes`` are more header directories, ``salt``
    what else the build depends on (a library's version). The module is named for the
    source: ``_kept`` for ``kept.c``. Raises ``RuntimeError`` with the compiler's output
    where it fails."""
    with open(source, "rb") as f:
        src = f.read()
    tag = hashlib.sha256(src + sys.version.encode() + salt.encode()).hexdigest()[:16]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out_dir = out_dir or cache_dir()
    name = "_" + os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(out_dir, f"{name}-{tag}{suffix}")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out_dir)
    os.close(fd)
    # CFLAGS first: an -I there is searched before the interpreter's include directory
    cmd = [*cc, *shlex.split(os.environ.get("CFLAGS", "")), "-O2", "-shared", "-fPIC",
           "-std=c11", "-D_GNU_SOURCE", f"-I{include}", *(f"-I{d}" for d in includes),
           source, "-o", tmp]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode:
            hint = (
                ""
                if os.path.exists(os.path.join(include, "Python.h"))
                else f" (no Python.h in {include}: install the Python development headers)"
            )
            raise RuntimeError(f"{' '.join(cmd)} failed{hint}:\n{r.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: another process building at once loads either
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{' '.join(cmd)}: cannot run the compiler ({exc})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def unbuildable(exc: RuntimeError) -> bool:
    """Whether ``build``'s error says this host lacks the tools (no compiler to run, no Python
    headers), rather than that the source does not compile."""
    msg = str(exc)
    return "cannot run the compiler" in msg or "no Python.h" in msg


def load(path: str, name: str = "_kept") -> ModuleType:
    """The extension module ``name`` built at ``path``."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def once(slot: list, enabled: bool, make: Callable[[], ModuleType], what: str) -> ModuleType | None:
    """``make()``'s module, made once per process and kept in ``slot`` (a list, empty until
    tried); None where ``enabled`` is false or it fails (one warning: "``what`` unavailable,
    the Python runs them")."""
    if slot:
        return slot[0]
    with _lock:
        if slot:
            return slot[0]
        mod = None
        if enabled:
            try:
                mod = make()
                log.info("%s: %s", what, mod.__file__)
            except (RuntimeError, ImportError, OSError) as exc:
                log.warning("%s unavailable, the Python runs them: %s", what, exc)
                mod = None
        slot.append(mod)
        return mod


def module() -> ModuleType | None:
    """The built module, set up (once per process); None where it is switched off or cannot
    be built (one warning logged)."""

    def make() -> ModuleType:
        mod = load(build())
        mod.setup(_objects())
        return mod

    return once(_built, ENABLED, make, "compiled kept calls")


def _objects() -> dict[str, Any]:
    """What the compiled calls read (``kept.c``'s ``setup``)."""
    import cupy

    from coliworker.kernels import attention_call, expert_group, group_tables, matmul
    from coliworker.kernels.records import KV_DESC
    from coliworker.server import cupy_calls
    from coliworker.server.backend import Phases, Result

    return {
        "expert_group": expert_group,
        "cupy_calls": cupy_calls,
        "runtime": cupy.cuda.runtime,
        "settings": matmul.settings,
        "rerunnable": cupy_calls.rerunnable,
        "triples": group_tables._triples,
        "triples_of": group_tables.triples_of,
        "zeros_t": expert_group._ZEROS_T,
        "Result": Result,
        "Phases": Phases,
        "event_phases": cupy_calls._event_phases,
        "rerun_failed": cupy_calls.rerun_failed,
        "attention_key": attention_call._key,
        "attention_inputs": attention_call._inputs,
        "kv_desc_format": KV_DESC.format,
    }


class Twins(NamedTuple):
    """The compiled calls and the Python functions they stand in for: the backend runs
    ``routed`` where it is handed ``routed_kept`` itself, ``group`` for ``group_kept``,
    ``ragged`` for ``run_kept`` and ``matmul`` for ``matmul_kept`` (a stand-in put in their
    place runs as given, then ``rerun``)."""

    routed_kept: Any  # expert_group.routed_kept
    routed: Any  # ... then cupy_calls.rerun
    group_kept: Any  # expert_group.group_kept
    group: Any  # ... then cupy_calls.rerun
    run_kept: Any  # attention_call.run_kept
    ragged: Any  # ... then cupy_calls.rerun
    matmul_kept: Any  # matmul.run_kept
    matmul: Any  # ... then cupy_calls.rerun
    rerun: Any  # cupy_calls.rerun


def twins() -> Twins | None:
    """The built module's calls, or None (the Python runs them)."""
    mod = module()
    if mod is None:
        return None
    from coliworker.kernels import attention_call, expert_group
    from coliworker.kernels import matmul as mm

    return Twins(expert_group.routed_kept, mod.routed, expert_group.group_kept, mod.group,
                 attention_call.run_kept, mod.ragged, mm.run_kept, mod.matmul,
                 mod.rerun)  # fmt: skip


if __name__ == "__main__":
    print(build())
