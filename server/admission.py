"""Upload admission: a tensor's bytes are admitted against every limit before any buffer
for them exists (the owner's quota, the device budget or the device's free memory)."""

from __future__ import annotations

from typing import Any

from coliworker.server.errors import ResourceExhausted
from coliworker.server.quota import Quota


def check_upload(
    quota: Quota, budget: Any, backend: Any, device: int, nbytes: int, owner: str, op: str
) -> None:
    """Refuse an upload of ``nbytes`` before its receive buffer is allocated: over the
    owner's quota, over the device budget, or (with no budget set) over the device's free
    memory. A header claiming a huge tensor therefore costs the worker nothing."""
    quota.check(owner, nbytes, op)
    if budget.limit:
        if not budget.fits(device, nbytes):
            raise ResourceExhausted(
                f"{op}: tensor of {nbytes} bytes does not fit device {device}'s budget of "
                f"{budget.limit} bytes (--memory-limit)"
            )
        return
    free = next((d.free_memory_bytes for d in backend.devices() if d.id == device), None)
    if free is not None and nbytes > free:
        raise ResourceExhausted(
            f"{op}: tensor of {nbytes} bytes exceeds device {device}'s free memory ({free} bytes)"
        )


__all__ = ["check_upload"]
