"""The client end of a doorbell channel: hot calls without a gRPC round trip per call.

A doorbell channel belongs to a Session with a shared-memory segment attached (same host
only); gRPC stays the control plane (attach, ownership, lifetime). Life of a channel:

1. ``Channel.create`` makes ``<shm dir>/coliworker-<pid>-<16 hex>.bell`` (``mkdir``, mode
   0700) with two FIFOs in it, ``request`` and ``response`` (mode 0600), and opens the read
   end of ``response``. The slot area (``slots`` request slots of ``slot_bytes``, then as
   many response slots) is a block of the segment.
2. The Session sends ``attach_doorbell`` on its stream; the worker checks that directory
   and FIFOs are its own uid's with no group/other bits, opens its ends (read ``request``,
   write ``response``) and starts the channel's thread.
3. ``connect`` opens the write end of ``request`` and removes the FIFOs and the directory:
   from then on only the four open descriptors remain, so nothing is left behind when
   either side dies; a dead peer reads as end of file (or EPIPE on a write), and every
   pending call then fails with Unavailable. A client killed between 1 and 3 leaves a
   directory named with its pid; the next channel of that uid removes it (``sweep_stale``).

Per call (``submit``): the call goes into the next request slot as a data-plane CALL frame
behind the slot's output-region prefix (``coliworker.wire.bell``; its arrays are already in
the segment) and the slot's index is written to ``request`` as one byte. The worker runs
calls one at a time in ring order and answers each in the matching response slot plus one
byte on ``response``. Up to ``slots`` calls may be outstanding; responses come back in
order. There is no reader thread: whichever thread waits for a result (``wait``) reads the
response FIFO itself and completes every call answered so far (a synchronous call wakes in
the thread that made it).
"""

from __future__ import annotations

import collections
import math
import os
import re
import secrets
import select
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from coliworker.client import errors
from coliworker.client.session_calls import read_until
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import bell, frames, shm
from coliworker.wire.shm import Segment, shm_dir

#: Calls one channel may have outstanding (request slots, and as many response slots).
SLOTS = 4
#: Bytes per slot: the prefix and the frame (arrays live elsewhere in the segment).
SLOT_BYTES = 64 << 10
#: How long a thread waiting for an answer polls before it sleeps, us. A sleeping thread
#: takes ~20 us to wake (the FIFO wake-up plus the idle CPU's); polling covers a decode
#: call's backend time (0.1-0.25 ms on an H200) at the cost of the waiting thread's core.
SPIN_US = 250
#: The same for the worker's channel thread waiting for the next call after an answer: a
#: thread that slept runs its next call on a cold core (H200 host, CuPy: a routed decode group
#: 0.60 ms end to end with 100 us, 0.50 ms with 1000 us; bench/results/rpc-*-cupy.md).
WORKER_SPIN_US = 1000
REQUEST, RESPONSE = bell.REQUEST, bell.RESPONSE
_DIR = re.compile(r"^coliworker-(\d+)-[0-9a-f]{16}\.bell$")

# on_done(response bytes, None) or on_done(None, error): called once per call
OnDone = Callable[[bytes | None, BaseException | None], None]


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove this uid's channel directories whose creating process is gone."""
    return shm.sweep_stale(directory, _DIR)


class Channel:
    """One doorbell channel (see the module docstring). Thread-safe."""

    def __init__(
        self,
        segment: Segment,
        offset: int,
        slots: int,
        slot_bytes: int,
        path: str,
        resp_fd: int,
        spin_us: int = 0,
        worker_spin_us: int = 0,
    ) -> None:
        self.segment = segment
        self.offset, self.slots, self.slot_bytes = offset, slots, slot_bytes
        self.path = path  # the private directory until connect() removes it
        self.name = os.path.basename(path)
        self._resp = resp_fd  # read end of "response", non-blocking
        self._req = -1  # write end of "request" (after connect)
        self._wake_r, self._wake_w = os.pipe()  # wakes a waiter when the channel fails
        os.set_blocking(self._wake_r, False)
        self._poll = select.poll()
        self._poll.register(self._resp, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._submit_lock = threading.Lock()  # slot writes and rings in one order
        self._reading = threading.Lock()  # one thread reads "response" at a time
        self._lock = threading.Lock()  # pending, broken
        self._pending: collections.deque[tuple[Any, OnDone, int]] = collections.deque()
        self._next = 0  # slot of the next request
        self._broken: errors.WorkerError | None = None
        self._fds_closed = False
        self.spin_ns = spin_us * 1000
        self.worker_spin_us = worker_spin_us
        #: Called (no lock held) when the worker's end is found closed, before the channel
        #: fails: its owner may fail it first with the reason (the session waits, bounded,
        #: for its stream's last status: an idle timeout, a drain), which then wins.
        self.on_closed: Callable[[], None] | None = None

    # -- setting up -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        segment: Segment,
        offset: int,
        slots: int = SLOTS,
        slot_bytes: int = SLOT_BYTES,
        directory: str | None = None,
        spin_us: int = SPIN_US,
        worker_spin_us: int = WORKER_SPIN_US,
    ) -> Channel:
        """The private directory, its FIFOs, and the read end of ``response``.
        ``spin_us``: how long a waiting thread polls for the answer before it sleeps;
        ``worker_spin_us``: the same for the worker's thread waiting for the next call."""
        directory = directory or shm_dir()
        sweep_stale(directory)
        path = os.path.join(directory, f"coliworker-{os.getpid()}-{secrets.token_hex(8)}.bell")
        os.mkdir(path, 0o700)  # fails if it exists: the name is ours alone
        try:
            os.chmod(path, 0o700)  # the umask cannot widen it, but make it exact
            for name in (REQUEST, RESPONSE):
                fifo = os.path.join(path, name)
                os.mkfifo(fifo, 0o600)
                os.chmod(fifo, 0o600)
            # Non-blocking: opening a FIFO's read end must not wait for a writer.
            resp = os.open(os.path.join(path, RESPONSE), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(segment, offset, slots, slot_bytes, path, resp, spin_us, worker_spin_us)

    def attach_message(self) -> pb.DoorbellAttach:
        return pb.DoorbellAttach(
            directory=self.name,
            slots_offset=self.offset,
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            worker_spin_us=self.worker_spin_us,
        )

    def connect(self) -> None:
        """After the worker's answer: open the write end of ``request``, remove the names."""
        try:
            self._req = os.open(
                os.path.join(self.path, REQUEST), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError as exc:  # ENXIO: the worker's read end is not open
            raise errors.Unavailable(f"doorbell: cannot open the request FIFO: {exc}") from None
        finally:
            self._remove()
        # A ring is one byte into a pipe that holds at least 4096: it never blocks.
        os.set_blocking(self._req, True)

    def _remove(self) -> None:
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = ""

    # -- calls ------------------------------------------------------------------------------

    def submit(self, message: bytes, fut: Any, on_done: OnDone) -> None:
        """Write ``message`` (a slot's contents: output-region prefix and CALL frame) into
        the next request slot and ring. ``on_done`` runs once, with the REPLY frame's bytes
        or an error. Raises the channel's error (nothing was sent) when it is broken,
        ResourceExhausted when the message does not fit a slot."""
        n = len(message)
        if n > self.slot_bytes:
            raise errors.ResourceExhausted(
                f"doorbell: request frame of {n - bell.PREFIX_BYTES} bytes does not fit a "
                f"slot ({bell.room(self.slot_bytes)} bytes)"
            )
        with self._submit_lock:
            while True:
                with self._lock:
                    if self._broken is not None:
                        raise self._broken
                    if len(self._pending) < self.slots:
                        break
                    oldest = self._pending[0][0]
                self._pump_for(oldest, None)  # the ring is full: finish the oldest call
            slot = self._next
            off = self.offset + slot * self.slot_bytes
            self.segment.write(off, message)
            with self._lock:
                self._pending.append((fut, on_done, slot))
            try:
                os.write(self._req, bytes((slot,)))
            except OSError as exc:  # EPIPE: the worker's end is closed
                self._closed_by_worker(f"doorbell: the worker closed the channel ({exc})")
                return
            self._next = (slot + 1) % self.slots

    def wait(self, fut: Any, timeout: float | None) -> None:
        """Return once ``fut`` is done (or ``timeout`` seconds passed), reading responses
        on this thread as they arrive."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pump_for(fut, deadline)

    def _pump_for(self, fut: Any, deadline: float | None) -> None:
        read_until(fut, deadline, self._reading, self._pump)

    def _pump(self, deadline: float | None) -> bool:
        """Read what the worker has answered (waiting until ``deadline``) and complete
        those calls. False on timeout. Call with ``_reading`` held."""
        if self._fds_closed:
            return True
        data = self._spin(deadline) if self.spin_ns else None
        if data is None:
            left = None if deadline is None else deadline - time.monotonic()
            events = self._poll.poll(None if left is None else max(0, math.ceil(left * 1e3)))
            if not events:
                return False
            if any(fd == self._wake_r for fd, _ in events):
                return True  # failed (the futures are already set)
            try:
                data = os.read(self._resp, 64)
            except BlockingIOError:
                return True
        if not data:  # end of file: the worker's end is closed
            self._closed_by_worker("doorbell: the worker closed the channel")
            return True
        for slot in data:
            with self._lock:
                if not self._pending:
                    break
                _, on_done, expect = self._pending.popleft()
            if slot != expect:
                on_done(None, errors.Unavailable(f"doorbell: answer for slot {slot}, not {expect}"))
                self.fail(errors.Unavailable("doorbell: the worker answered out of order"))
                return True
            off = self.offset + (self.slots + slot) * self.slot_bytes
            try:
                at = off + bell.FRAME_AT
                head = frames.parse(self.segment.read(at, frames.HEADER_BYTES, "doorbell"))
                n = bell.frame_bytes(head)
                if n > bell.room(self.slot_bytes):
                    raise errors.InternalError(f"doorbell: response slot {slot} holds {n} bytes")
                body = self.segment.read(at, n, "doorbell")
            except Exception as exc:
                on_done(None, errors.Unavailable(f"doorbell: {exc}"))
                continue
            on_done(body, None)
        return True

    def _spin(self, deadline: float | None) -> bytes | None:
        """Poll for an answer without sleeping for ``spin_ns`` (a sleeping thread takes
        ~20 us to wake); None when none came. Each read releases the GIL."""
        end = time.perf_counter_ns() + self.spin_ns
        while self._broken is None:
            try:
                return os.read(self._resp, 64)
            except BlockingIOError:
                if time.perf_counter_ns() >= end:
                    return None
        return None

    # -- failure and close ------------------------------------------------------------------

    def _closed_by_worker(self, message: str) -> None:
        """The worker closed its end: fail with its reason where the owner has it, else
        with ``message``."""
        if self.on_closed is not None and self._broken is None:
            self.on_closed()
        self.fail(errors.Unavailable(message))

    def fail(self, err: errors.WorkerError) -> None:
        """Fail every pending call (and later submits) with ``err``; wake a waiter."""
        with self._lock:
            if self._broken is None:
                self._broken = err
            err = self._broken
            pending, self._pending = self._pending, collections.deque()
            if not self._fds_closed:
                try:
                    os.write(self._wake_w, b"\0")
                except OSError:
                    pass
        for _, on_done, _ in pending:
            on_done(None, err)

    @property
    def broken(self) -> errors.WorkerError | None:
        return self._broken

    def close(self, timeout: float | None = 10.0) -> None:
        """Let pending calls finish (up to ``timeout`` s), then close this end: the worker
        reads end of file and its thread exits."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                last = self._pending[-1][0] if self._pending else None
            if last is None or self._broken is not None:
                break
            self._pump_for(last, deadline)
            if deadline is not None and time.monotonic() >= deadline:
                break
        self.fail(errors.Cancelled("session is closed"))
        self._remove()
        got = self._reading.acquire(timeout=1.0)  # a waiter woken by fail() lets go
        try:
            with self._lock:
                if self._fds_closed:
                    return
                self._fds_closed = True
            for fd in (self._req, self._resp, self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
        finally:
            if got:
                self._reading.release()


__all__ = ["SLOTS", "SLOT_BYTES", "SPIN_US", "WORKER_SPIN_US", "Channel", "sweep_stale"]
