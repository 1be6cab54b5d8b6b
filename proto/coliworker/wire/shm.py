"""The same-host data plane: a shared-memory segment one client and one worker both map.

Life of a segment (the design the README's hot-path section describes):

1. The client creates ``<shm dir>/coliworker-<pid>-<token>`` with ``O_CREAT | O_EXCL``, mode
   0600, sizes it, and writes a 16-byte random nonce at offset 0.
2. It sends the name, size and nonce on its Session stream (``attach_shm``). The worker opens
   the file with ``O_NOFOLLOW`` and maps it only if it is a regular file owned by the
   worker's own uid with no group/other permission bits, and begins with the nonce (so a
   same-named file on another host is never mistaken for it).
3. Once the worker has answered, the client unlinks the name. The memory now lives exactly
   as long as the two mappings: the worker unmaps when the stream ends (client closed or
   died), the client when it closes or exits. Nothing is left in /dev/shm by a dead process.
4. A client killed between steps 1 and 3 leaves a file whose name carries its pid; the next
   client of the same uid removes such files whose process is gone (``sweep_stale``).

Arrays are placed in the segment by a first-fit allocator over 64-byte aligned blocks
(``Allocator``); the first ``HEADER_BYTES`` hold the nonce. Copies of ``PARALLEL_BYTES`` or
more in or out of a segment (``write``, ``read_array``) run on several threads: one thread
moves 6-10 GB/s on an H200 host, and a 50 MB activation batch is copied three times.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

HEADER_BYTES = 64
ALIGN = 64
NONCE_BYTES = 16
PREFIX = "coliworker-"
_NAME = re.compile(r"^coliworker-(\d+)-([0-9a-f]{16})$")

#: Copies of at least this many bytes run in slices on COPY_THREADS threads; smaller ones
#: (a decode call's arrays, doorbell messages) stay on the calling thread: no hand-off.
PARALLEL_BYTES = 4 << 20
COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
_SLICE_ALIGN = 64 << 10  # slice boundaries on whole pages (and cache lines)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def copy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (regions must not overlap).

    From ``PARALLEL_BYTES`` on, the calling thread copies the first slice and
    ``COPY_THREADS - 1`` pool threads the others (``ctypes.memmove`` releases the GIL);
    first touches of fresh destination pages fault in parallel too. The pool threads see
    addresses only: the caller keeps both buffers alive (and mapped) until this returns.
    """
    if n < PARALLEL_BYTES or COPY_THREADS == 1:
        ctypes.memmove(dst, src, n)
        return
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="shm-copy")
    step = -(-n // COPY_THREADS)
    step = -(-step // _SLICE_ALIGN) * _SLICE_ALIGN
    futures = [
        _pool.submit(ctypes.memmove, dst + i, src + i, min(step, n - i))
        for i in range(step, n, step)
    ]
    try:
        ctypes.memmove(dst, src, min(step, n))
    finally:
        for f in futures:
            f.result()


class ShmError(Exception):
    """Attaching failed; ``kind`` is "invalid", "not_found" or "permission"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def shm_dir() -> str:
    """Where segments live: /dev/shm (tmpfs) when present, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str | None = None) -> list[str]:
    """Remove this uid's segments whose creating process is gone; returns the names."""
    directory = directory or shm_dir()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        m = _NAME.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    return removed


class Segment:
    """A mapped segment. ``buf`` is a uint8 view of the whole mapping."""

    def __init__(self, mm: mmap.mmap, size: int, name: str, fd: int = -1, path: str = "") -> None:
        self.mm, self.size, self.name, self.fd, self.path = mm, size, name, fd, path
        self.buf = np.frombuffer(mm, np.uint8, count=size)
        self.address = self.buf.ctypes.data  # of byte 0; valid while mapped (0 after close)
        self._lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []

    @classmethod
    def create(cls, size: int, directory: str | None = None) -> Segment:
        """Client side: a new 0600 segment of ``size`` bytes (plus the header)."""
        directory = directory or shm_dir()
        sweep_stale(directory)
        size = HEADER_BYTES + _round(size)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask cannot widen it, but make it exact
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        seg = cls(mm, size, name, fd, path)
        seg.nonce = secrets.token_bytes(NONCE_BYTES)
        mm[:NONCE_BYTES] = seg.nonce
        return seg

    nonce: bytes = b""

    @classmethod
    def attach(cls, name: str, size: int, nonce: bytes, directory: str | None = None) -> Segment:
        """Worker side: map a client's segment after the ownership checks (module doc)."""
        if not _NAME.match(name):
            raise ShmError(
                "invalid", f"attach_shm.name: expected coliworker-<pid>-<16 hex>, got {name!r}"
            )
        if len(nonce) != NONCE_BYTES:
            raise ShmError(
                "invalid", f"attach_shm.nonce: expected {NONCE_BYTES} bytes, got {len(nonce)}"
            )
        if size <= HEADER_BYTES:
            raise ShmError("invalid", f"attach_shm.size: expected > {HEADER_BYTES}, got {size}")
        path = os.path.join(directory or shm_dir(), name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmError(
                "not_found",
                f"attach_shm.name: {path} does not exist here (is the worker on another host?)",
            ) from None
        except OSError as exc:
            raise ShmError("permission", f"attach_shm.name: cannot open {path}: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError("permission", f"attach_shm.name: {path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ShmError(
                    "permission",
                    f"attach_shm.name: {path} is owned by uid {st.st_uid}, expected the "
                    f"worker's uid {os.geteuid()}",
                )
            if st.st_mode & 0o077:
                raise ShmError(
                    "permission",
                    f"attach_shm.name: {path} has mode {stat.S_IMODE(st.st_mode):04o}, "
                    f"expected 0600 (no group/other access)",
                )
            if st.st_size < size:
                raise ShmError(
                    "invalid",
                    f"attach_shm.size: expected <= {st.st_size} (the file's size), got {size}",
                )
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mm[:NONCE_BYTES] != nonce:
            mm.close()
            raise ShmError(
                "permission", "attach_shm.nonce: the segment does not start with the nonce"
            )
        return cls(mm, size, name)

    def unlink(self) -> None:
        """Remove the name (client side, once attached); the mappings stay valid."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = ""

    def read(self, offset: int, length: int, field: str) -> bytes:
        """A copy of ``length`` bytes at ``offset``; ShmError("invalid") when out of range."""
        self._check(offset, length, field)
        with self._lock:
            if self.mm is None:
                raise ShmError("invalid", f"{field}: the segment is detached")
            return self.mm[offset : offset + length]

    def read_array(self, offset: int, length: int, field: str) -> np.ndarray:
        """A copy of ``length`` bytes at ``offset`` as a fresh, writable uint8 [length] array
        (large ones copied on several threads, see ``copy``); ShmError("invalid") when out of
        range."""
        self._check(offset, length, field)
        out = np.empty(length, np.uint8)
        with self._lock:
            if self.mm is None:
                raise ShmError("invalid", f"{field}: the segment is detached")
            copy(out.ctypes.data, self.address + offset, length)
        return out

    def view(self, offset: int, length: int, field: str) -> memoryview:
        """A read-only view of ``length`` bytes at ``offset`` (no copy; valid while mapped:
        an unmap waits for the last view, see ``close``)."""
        self._check(offset, length, field)
        with self._lock:
            if self.mm is None:
                raise ShmError("invalid", f"{field}: the segment is detached")
            return memoryview(self.mm)[offset : offset + length].toreadonly()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` (C-contiguous bytes) to ``offset``; large copies on several threads
        (``copy``). ShmError("invalid") when out of range or detached."""
        n = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        self._check(offset, n, "output_shm")
        src = np.frombuffer(data, np.uint8) if n >= PARALLEL_BYTES else None
        with self._lock:
            if self.mm is None:
                raise ShmError("invalid", "output_shm: the segment is detached")
            if src is None:
                self.mm[offset : offset + n] = data
            else:
                copy(self.address + offset, src.ctypes.data, n)

    def check(self, offset: int, length: int, field: str) -> None:
        """ShmError("invalid") naming ``field`` when the slice is outside the segment."""
        self._check(offset, length, field)

    def _check(self, offset: int, length: int, field: str) -> None:
        if offset < HEADER_BYTES or length < 0 or offset + length > self.size:
            raise ShmError(
                "invalid",
                f"{field}: expected a slice inside {HEADER_BYTES}..{self.size}, "
                f"got offset {offset} length {length}",
            )

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once when the segment closes, before it is unmapped (the worker's CUDA
        backend unregisters it there); at once when it is closed already. ``fn`` runs under
        the segment's lock: it must not call the segment's methods."""
        with self._lock:
            if self.mm is not None:
                self._on_close.append(fn)
                return
        fn()

    def close(self) -> None:
        """Unmap (and unlink, if still named); idempotent."""
        self.unlink()
        with self._lock:
            mm, self.mm = self.mm, None  # type: ignore[assignment]
            self.buf = None  # type: ignore[assignment]
            self.address = 0
            hooks, self._on_close = self._on_close, []
            for fn in hooks:
                try:
                    fn()
                except Exception:
                    log.exception("segment %s: a close hook failed", self.name)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still alive somewhere; unmapped when it is collected
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Allocator:
    """First-fit allocation of aligned blocks in ``[HEADER_BYTES, size)``; thread-safe."""

    def __init__(self, size: int) -> None:
        self._free: list[tuple[int, int]] = [(HEADER_BYTES, size - HEADER_BYTES)]
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """Offset of a block of at least ``n`` bytes, or None when none is free."""
        n = _round(max(n, 1))
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (off + n, length - n)
                    return off
        return None

    def free(self, offset: int, n: int) -> None:
        n = _round(max(n, 1))
        with self._lock:
            blocks = self._free
            lo, hi = 0, len(blocks)
            while lo < hi:
                mid = (lo + hi) // 2
                if blocks[mid][0] < offset:
                    lo = mid + 1
                else:
                    hi = mid
            blocks.insert(lo, (offset, n))
            # Coalesce with the neighbours.
            if lo + 1 < len(blocks) and blocks[lo][0] + blocks[lo][1] == blocks[lo + 1][0]:
                blocks[lo] = (blocks[lo][0], blocks[lo][1] + blocks[lo + 1][1])
                del blocks[lo + 1]
            if lo > 0 and blocks[lo - 1][0] + blocks[lo - 1][1] == blocks[lo][0]:
                blocks[lo - 1] = (blocks[lo - 1][0], blocks[lo - 1][1] + blocks[lo][1])
                del blocks[lo]

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)


__all__ = ["PARALLEL_BYTES", "Allocator", "Segment", "ShmError", "copy", "shm_dir", "sweep_stale"]
