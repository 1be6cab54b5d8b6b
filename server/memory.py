"""Startup checks of ``--memory-limit`` against the devices the worker serves."""

from __future__ import annotations

from collections.abc import Sequence

from coliworker.server.backend import DeviceInfo


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def memory_limit_warnings(limit: int, devices: Sequence[DeviceInfo], memory: str) -> list[str]:
    """Why ``limit`` (bytes per device; 0: none) cannot hold on ``devices``: one line per
    device whose memory (``memory``: "GPU" or "host") is smaller than the budget, since
    such a budget never refuses anything and uploads fail at allocation instead."""
    if not limit:
        return []
    return [
        f"--memory-limit {_gib(limit)} is more than device {d.id}'s {memory} memory "
        f"({_gib(d.total_memory_bytes)}, {d.name}): the budget cannot be reached there and "
        f"uploads will fail when memory runs out; leave it unset (admission then checks the "
        f"device's free memory) or set it below {_gib(d.total_memory_bytes)}"
        for d in devices
        if limit > d.total_memory_bytes
    ]


__all__ = ["memory_limit_warnings"]
