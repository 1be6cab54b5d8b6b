"""Host memory as the worker may really use it: ``/proc/meminfo`` bounded by the memory
cgroup the process runs in (cgroup v2 ``memory.max``/``memory.current``, v1
``memory.limit_in_bytes``/``memory.usage_in_bytes``, each level up to the root).

In a container with a 1.5 GiB limit ``/proc/meminfo`` still shows the host's RAM, so a
budget read from it lets KV caches grow until the kernel's OOM killer ends the worker;
read from here they are refused with RESOURCE_EXHAUSTED first. ``CGROUP_ROOT`` and
``PROC_SELF_CGROUP`` are module variables so tests can point them at a fake tree.
"""

from __future__ import annotations

import os

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
PROC_MEMINFO = "/proc/meminfo"
_UNLIMITED = 1 << 62  # v1 reports "no limit" as a huge number (page-rounded 2^63 - 1)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def meminfo(key: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes, or None where there is no such file or field."""
    try:
        with open(PROC_MEMINFO) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    return int(rest.split()[0]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_paths() -> list[tuple[str, str]]:
    """(kind, directory) of this process's memory cgroup and each ancestor, innermost
    first; kind "v2" or "v1"."""
    try:
        with open(PROC_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: list[tuple[str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            kind, base = "v2", CGROUP_ROOT
        elif "memory" in controllers.split(","):
            kind, base = "v1", os.path.join(CGROUP_ROOT, "memory")
        else:
            continue
        rel = path.strip("/")
        while True:
            out.append((kind, os.path.join(base, rel) if rel else base))
            if not rel:
                break
            rel = os.path.dirname(rel)
    return out


def cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of the tightest memory cgroup level above this process, or
    None where no level sets a limit (or there is no cgroup file system)."""
    best: tuple[int, int] | None = None
    for kind, d in _cgroup_paths():
        names = ("memory.max", "memory.current")
        if kind == "v1":
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        limit = _read_int(os.path.join(d, names[0]))
        if limit is None:
            continue
        usage = _read_int(os.path.join(d, names[1])) or 0
        if best is None or limit - usage < best[0] - best[1]:
            best = (limit, usage)
    return best


def host_memory() -> tuple[int, int]:
    """(total, available) bytes the worker may use, read now: the smaller of the host's
    (``MemTotal``, ``MemAvailable``) and its memory cgroup's (limit, limit - usage)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    free = meminfo("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    cg = cgroup_memory()
    if cg is not None:
        limit, usage = cg
        total, free = min(total, limit), min(free, max(0, limit - usage))
    return int(total), int(free)


__all__ = ["cgroup_memory", "host_memory", "meminfo"]
