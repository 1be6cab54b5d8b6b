"""``scripts/check-cuda`` (CI's nvcc build of every kernel, no GPU) instantiates every template
variant the host side can ask for: each name in the wrappers' variant tuples (``VARIANTS``,
``TC_VARIANTS``, ``WQ_VARIANTS``, ``PF_VARIANTS``, read over ``bench/host_python.py``'s
stand-in CuPy in a subprocess) is among the names check-cuda lists for its ``.cu`` file, or is
a kernel that is not a template (built with its file). The script lists them by hand (it
imports nothing from the package), so a form added to a wrapper and not to the script would
otherwise reach a GPU unbuilt."""

from __future__ import annotations

import os
import re
import textwrap

from _stand_in import ROOT, last_dict

from coliworker.kernels import sources

#: (module, its variant tuple, the .cu file the names are compiled from)
TUPLES = (
    ("attention", "VARIANTS", "attention.cu"),
    ("copy", "VARIANTS", "copy.cu"),
    ("matmul", "VARIANTS", "gemv.cu"),
    ("matmul", "TC_VARIANTS", "gemv_tc.cu"),
    ("matmul", "WQ_VARIANTS", "moe_wq.cu"),
    ("prefill_tc", "PF_VARIANTS", "prefill_tc.cu"),
    ("route", "VARIANTS", "route.cu"),
)

SCRIPT = textwrap.dedent(
    f"""
    import importlib
    from bench import host_python as hp
    hp._stub_cupy()
    out = {{}}
    for mod, attr, cu in {TUPLES!r}:
        m = importlib.import_module("coliworker.kernels." + mod)
        out.setdefault(cu, []).extend(getattr(m, attr))
    print(out)
    """
)


def _norm(name: str) -> str:
    return re.sub(r"\s+", "", name)


def _check_cuda_variants() -> dict[str, list[str]]:
    """check-cuda's ``variants`` dict, evaluated from its embedded Python."""
    text = open(os.path.join(ROOT, "scripts", "check-cuda")).read()
    body = text.split("variants = {", 1)[1].split("\nfor name in src:", 1)[0]
    ns: dict = {}
    exec("variants = {" + body, ns)  # noqa: S102 - the tree's own script
    return ns["variants"]


def test_every_wrapper_variant_is_built_by_check_cuda():
    wanted = last_dict(SCRIPT)
    built = {cu: {_norm(v) for v in names} for cu, names in _check_cuda_variants().items()}
    src = {cu: sources.source(cu) for cu in wanted}  # each with the headers it includes

    def is_built(cu: str, name: str) -> bool:
        if "<" not in name:  # not a template: compiled with its file where it is defined
            return re.search(rf"__global__[^;{{}}]*?\b{name}\s*\(", src[cu]) is not None
        return name in built.get(cu, set())

    missing = {}
    for cu, names in wanted.items():
        lost = sorted(n for n in set(map(_norm, names)) if not is_built(cu, n))
        if lost:
            missing[cu] = lost
    assert not missing, f"named by the wrappers, not built by scripts/check-cuda: {missing}"
    assert all(wanted.values()), wanted  # the tuples were found and are not empty
