"""Kernel source variants for the kernel benches (``--variant``): a knob of a kernel (a
``#define``, a constexpr) tried without editing the tree. ``parse`` reads
"LABEL=OLD=>NEW[;OLD=>NEW...]"; ``build_with`` makes later launches use kernels built from the
file's text (its headers inlined) with each OLD replaced by NEW: the text the compiler is
handed is patched (CuPy's compile cache is keyed by it) and the modules and launches already
made are dropped. A pair "@MODULE.NAME=>VALUE" sets ``coliworker.kernels.MODULE.NAME`` to the
integer VALUE instead (a host constant that must agree with the kernel's, such as
matmul.TC_RG beside gemv_tc.cu's TC_RG).
"""

from __future__ import annotations

import importlib


def parse(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``--variant``'s "LABEL=OLD=>NEW[;OLD=>NEW...]" as (label, [(old, new), ...])."""
    label, _, rest = text.partition("=")
    subs = [tuple(p.split("=>", 1)) for p in rest.split(";") if p]
    if not label or not subs or any(len(p) != 2 for p in subs):
        raise SystemExit(f"--variant {text!r}: expected LABEL=OLD=>NEW[;OLD=>NEW...]")
    return label, subs  # type: ignore[return-value]


def build_with(subs: list[tuple[str, str]], file: str) -> None:
    """Later launches use ``kernels/<file>`` built with each (old, new) of ``subs`` replaced
    (each old must occur in the file's text, its headers inlined)."""
    from coliworker.kernels import _module, launch, sources

    def patched(name: str, _src=sources.source) -> str:
        text = _src(name)
        if name != file:
            return text
        for old, new in subs:
            if old not in text:
                raise SystemExit(f"--variant: {old!r} is not in {name}'s source")
            text = text.replace(old, new)
        return text

    for old, new in subs:
        if old.startswith("@"):
            mod, _, name = old[1:].rpartition(".")
            m = importlib.import_module(f"coliworker.kernels.{mod}")
            if not hasattr(m, name):
                raise SystemExit(f"--variant: coliworker.kernels.{mod} has no {name}")
            setattr(m, name, int(new))
    subs = [(o, n) for o, n in subs if not o.startswith("@")]
    _module.source = patched
    _module._modules.clear()
    _module._functions.clear()
    launch._launches.clear()
