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
(``Allocator``); the first ``HEADER_BYTES`` hold the nonce.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import tempfile
import threading

import numpy as np

HEADER_BYTES = 64
ALIGN = 64
NONCE_BYTES = 16
PREFIX = "coliworker-"
_NAME = re.compile(r"^coliworker-(\d+)-([0-9a-f]{16})$")


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
        self._lock = threading.Lock()

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

    def view(self, offset: int, length: int, field: str) -> memoryview:
        """A read-only view of ``length`` bytes at ``offset`` (no copy; valid while mapped:
        an unmap waits for the last view, see ``close``)."""
        self._check(offset, length, field)
        with self._lock:
            if self.mm is None:
                raise ShmError("invalid", f"{field}: the segment is detached")
            return memoryview(self.mm)[offset : offset + length].toreadonly()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self._check(offset, len(data), "output_shm")
        with self._lock:
            if self.mm is None:
                raise ShmError("invalid", "output_shm: the segment is detached")
            self.mm[offset : offset + len(data)] = data

    def check(self, offset: int, length: int, field: str) -> None:
        """ShmError("invalid") naming ``field`` when the slice is outside the segment."""
        self._check(offset, length, field)

    def _check(self, offset: int, length: int, field: str) -> None:
        if offset < HEADER_BYTES or offset + length > self.size:
            raise ShmError(
                "invalid",
                f"{field}: expected a slice inside {HEADER_BYTES}..{self.size}, "
                f"got offset {offset} length {length}",
            )

    def close(self) -> None:
        """Unmap (and unlink, if still named); idempotent."""
        self.unlink()
        with self._lock:
            mm, self.mm = self.mm, None  # type: ignore[assignment]
            self.buf = None  # type: ignore[assignment]
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


__all__ = ["Allocator", "Segment", "ShmError", "shm_dir", "sweep_stale"]
