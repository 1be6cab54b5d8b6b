"""The sessions' shared-memory segments as the CuPy backend sees them: registered with CUDA
(page-locked) on the first large input, so the device reads inputs straight from them
(``kernels/calls.py``, ``Call.put``), and unregistered before they are unmapped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import cupy

if TYPE_CHECKING:
    from coliworker.wire.shm import Segment

log = logging.getLogger(__name__)

UNREGISTERED, REGISTERED, FAILED, GONE = range(4)  # HostSegment.state
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device


class HostSegment:
    """A shared-memory segment a session maps, and whether CUDA has it registered."""

    __slots__ = ("name", "address", "size", "state")

    def __init__(self, name: str, address: int, size: int) -> None:
        self.name, self.address, self.size = name, address, size
        self.state = UNREGISTERED


def _register(m: HostSegment) -> int:
    """cudaHostRegister the segment; REGISTERED, or FAILED (logged) when CUDA refuses."""
    try:
        cupy.cuda.runtime.hostRegister(m.address, m.size, _HOST_REGISTER_PORTABLE)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        log.info("segment %s: cudaHostRegister failed, inputs are copied: %s", m.name, exc)
        return FAILED
    return REGISTERED


class HostSegments:
    """The sessions' shared-memory segments on this worker.

    A session's segment holds the client's inputs; read through a view (no copy), a large
    one would still be copied into the pinned arena before it goes up. Registered with CUDA
    (page-locked), the device reads it directly. Registration pins every page of the
    segment, so it waits for the first large input: a decode-only session pins nothing.
    Iterating gives the segments attached now."""

    def __init__(self, devices: tuple[int, ...]) -> None:
        self._devices = devices
        self._list: list[HostSegment] = []
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[HostSegment]:
        with self._lock:
            return iter(list(self._list))

    def attach(self, seg: Segment) -> None:
        """A session mapped ``seg`` (``server/session.py``); it is unregistered before it is
        unmapped (``Segment.on_close``)."""
        m = HostSegment(seg.name, seg.address, seg.size)
        with self._lock:
            self._list.append(m)
        seg.on_close(lambda: self._detach(m))

    def registered(self, ptr: int, n: int) -> bool:
        """Whether [ptr, ptr + n) lies in a registered segment (registering it on first use;
        a segment CUDA refuses stays unregistered and its inputs are copied)."""
        for m in self._list:
            if m.address <= ptr and ptr + n <= m.address + m.size:
                if m.state == UNREGISTERED:
                    with self._lock:
                        if m.state == UNREGISTERED:
                            m.state = _register(m)
                return m.state == REGISTERED
        return False

    def _detach(self, m: HostSegment) -> None:
        with self._lock:
            if m in self._list:
                self._list.remove(m)
            state, m.state = m.state, GONE
        if state != REGISTERED:
            return
        # Copies issued from it may still run: let every device finish them first. A call
        # that found it registered and copies later reads pageable memory (still mapped:
        # its view holds the mapping, see Segment.close), which CUDA stages itself.
        for d in self._devices:
            with cupy.cuda.Device(d):
                cupy.cuda.runtime.deviceSynchronize()
        try:
            cupy.cuda.runtime.hostUnregister(m.address)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            log.warning("segment %s: cudaHostUnregister failed: %s", m.name, exc)
