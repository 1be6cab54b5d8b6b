"""The same-host data plane: a shared-memory segment one client and one worker both map.

A segment is a memfd, never a file in /dev/shm: a client could truncate a named file (or
leave it sparse on a full tmpfs) after the worker mapped it, and the worker's next touch of
a missing page would be SIGBUS, killing it for every owner. Life of a segment:

1. The client creates it (``Segment.create``): ``memfd_create(MFD_CLOEXEC |
   MFD_ALLOW_SEALING)``, mode 0600, sized, ``posix_fallocate``d over its whole size (no
   holes; ENOSPC/ENOMEM is ShmError("exhausted"), a ResourceExhausted for the caller), then
   sealed with ``SEALS`` (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), then mapped.
2. It sends ``attach_shm`` (size, no name) on its Session stream; the worker answers
   ``shm_ticket``: a random one-time ``TICKET_BYTES`` ticket of that stream, valid for
   ``expires_ms``, and the path of the worker's attach socket (``server/shm_socket.py``: a
   Unix socket in a 0700 directory of the worker's uid in /dev/shm).
3. The client connects to that socket and sends ``PASS_MAGIC`` + the ticket with the memfd
   as SCM_RIGHTS (``pass_fd``). The worker takes the peer's uid from SO_PEERCRED (another
   uid is refused, PERMISSION_DENIED, its descriptor never taken), finds the stream the
   ticket was given to (once; unknown or expired: FAILED_PRECONDITION), checks the memfd
   (``check_fd``: a regular file of the worker's uid on tmpfs, not hugetlbfs, sealed
   against shrinking but not writing, at least ``size`` bytes, all of them allocated), runs
   its own ``posix_fallocate`` (a failure: RESOURCE_EXHAUSTED naming the segment and the
   sizes), maps it and closes the descriptor. Its answer is one byte, a gRPC status code
   (0: the segment is attached to the stream), then the message; then it closes.
   Every refusal is such a status naming the field and both values; the worker carries on.

Why this cannot SIGBUS the worker: the seals cannot be removed, so the file never gets
smaller than what is mapped; every page exists when it is mapped; a memfd lives on the
kernel's internal tmpfs, which has no size limit (a full /dev/shm does not matter), so a
page the client punches out again (F_SEAL_WRITE would forbid that, but also the client's
own writes) is refilled with zeros on the next touch, charged to the memory cgroup like any
page, never ENOSPC. hugetlbfs memfds, which can fail such a refill, are refused.

The ticket travels over the (authenticated) stream, the descriptor only over the Unix
socket: knowing a ticket lets a process pass a segment *into* that stream if it runs as the
worker's uid on the worker's host, and gives nobody else's memory to anyone. The memory
lives exactly as long as the two mappings: the worker unmaps when the stream ends (client
closed or died), the client when it closes or exits. Nothing is named, so nothing is left
behind. Attaching by name (``attach_shm.name``, the protocol before memfds) is refused.

Arrays are placed in the segment by a first-fit allocator over 64-byte aligned blocks
(``Allocator``); the first ``HEADER_BYTES`` are reserved. Copies of ``PARALLEL_BYTES`` or
more in or out of a segment (``write``, ``read_array``) run on several threads: one thread
moves 6-10 GB/s on an H200 host, and a 50 MB activation batch is copied three times.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

HEADER_BYTES = 64
ALIGN = 64
PREFIX = "coliworker-"
_NAME = re.compile(r"^coliworker-(\d+)-([0-9a-f]{16})$")

# <linux/fcntl.h> (Python's fcntl has these names on Linux only; this module also loads
# where there is no shared memory, for the other transports)
F_ADD_SEALS, F_GET_SEALS = 1033, 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE, F_SEAL_FUTURE_WRITE = 1, 2, 4, 8, 16
#: Seals a client puts on its segment; the worker requires F_SEAL_SHRINK of them.
SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL
TMPFS_MAGIC = 0x01021994  # statfs.f_type of tmpfs / shmem (memfds live there)
HUGETLBFS_MAGIC = 0x958458F6
#: What a client sends on the attach socket: PASS_MAGIC + ticket, with the memfd attached.
PASS_MAGIC = b"CWSHMFD1"
TICKET_BYTES = 16
PASS_BYTES = len(PASS_MAGIC) + TICKET_BYTES
#: How long the worker waits for a connection's message, and a client for the answer.
PASS_TIMEOUT_S = 10.0

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
    """Attaching failed; ``kind`` is "invalid", "not_found", "permission" or "exhausted"
    (statuses in ``server/dispatch.py``)."""

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


def sweep_stale(directory: str | None = None, pattern: re.Pattern[str] = _NAME) -> list[str]:
    """Remove this uid's entries of ``directory`` (default the shm directory) whose names
    match ``pattern`` and whose creating process (the pattern's first group, a pid) is gone:
    files, or whole directories (a doorbell's FIFOs, an attach socket's); returns the names.
    The default pattern: segments a client of an earlier version left in /dev/shm."""
    directory = directory or shm_dir()
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        m = pattern.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if st.st_uid != uid:
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def worker_uid() -> int:
    """The uid a segment and an attach-socket peer must have: this process's own."""
    return os.geteuid()


def fs_type(fd: int) -> int:
    """``statfs.f_type`` of the file system ``fd`` is on (the first field of the Linux
    struct, a word)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # sizeof(struct statfs) is 120 on 64-bit Linux
    if libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def memfd_name(fd: int) -> str:
    """The name a memfd was created with (from /proc/self/fd), for messages and logs."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
    link = link.removeprefix("/memfd:").removesuffix(" (deleted)")
    return "".join(c if c.isprintable() else "?" for c in link[:80])


def check_fd(fd: int, size: int) -> str:
    """Worker side: ShmError naming the field and both values unless ``fd`` is a memfd the
    worker may map ``size`` bytes of without risking SIGBUS (module doc); its name."""
    import fcntl

    name = memfd_name(fd)
    if size <= HEADER_BYTES:
        raise ShmError("invalid", f"attach_shm.size: expected > {HEADER_BYTES}, got {size}")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ShmError(
            "invalid",
            f"attach_shm.fd: expected a memfd (a regular file), got file type "
            f"{stat.S_IFMT(st.st_mode):o} ({name})",
        )
    if st.st_uid != worker_uid():
        raise ShmError(
            "permission",
            f"attach_shm.fd: segment {name} is owned by uid {st.st_uid}, expected the "
            f"worker's uid {worker_uid()}",
        )
    kind = fs_type(fd)
    if kind != TMPFS_MAGIC:
        what = " (hugetlbfs)" if kind == HUGETLBFS_MAGIC else ""
        raise ShmError(
            "invalid",
            f"attach_shm.fd: segment {name}: expected a memfd on tmpfs (f_type "
            f"{TMPFS_MAGIC:#010x}), got f_type {kind:#010x}{what}",
        )
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        seals = 0  # a file that cannot be sealed
    if not seals & F_SEAL_SHRINK:
        raise ShmError(
            "invalid",
            f"attach_shm.fd: segment {name} is not sealed against shrinking: expected "
            f"F_SEAL_SHRINK ({F_SEAL_SHRINK:#x}) in its seals, got {seals:#x} (create "
            f"it with MFD_ALLOW_SEALING, then F_ADD_SEALS)",
        )
    if seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
        raise ShmError(
            "invalid",
            f"attach_shm.fd: segment {name} is sealed against writing: expected neither "
            f"F_SEAL_WRITE ({F_SEAL_WRITE:#x}) nor F_SEAL_FUTURE_WRITE "
            f"({F_SEAL_FUTURE_WRITE:#x}) in its seals, got {seals:#x} (the worker writes "
            f"results into it)",
        )
    if st.st_size < size:
        raise ShmError(
            "invalid",
            f"attach_shm.size: expected <= {st.st_size} (segment {name}'s size), got {size}",
        )
    allocated = st.st_blocks * 512
    if allocated < size:
        raise ShmError(
            "invalid",
            f"attach_shm.fd: segment {name}: expected all of its {size} bytes allocated, got "
            f"{allocated} (posix_fallocate it before passing it)",
        )
    return name


def pass_fd(path: str, ticket: bytes, fd: int, timeout: float = PASS_TIMEOUT_S) -> tuple[int, str]:
    """Client side, step 3 of the module doc: pass ``fd`` with ``ticket`` to the worker's
    attach socket at ``path``; its answer (gRPC status code value, message). OSError when
    the socket cannot be reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        socket.send_fds(sock, [PASS_MAGIC + ticket], [fd])
        answer = bytearray()
        while len(answer) < 1 << 16:
            piece = sock.recv(4096)
            if not piece:
                break
            answer += piece
    if not answer:
        return 14, f"shm socket {path}: closed without an answer"  # UNAVAILABLE
    return answer[0], bytes(answer[1:]).decode("utf-8", "replace")


class Segment:
    """A mapped segment. ``buf`` is a uint8 view of the whole mapping."""

    def __init__(self, mm: mmap.mmap, size: int, name: str, fd: int = -1) -> None:
        self.mm, self.size, self.name, self.fd = mm, size, name, fd
        self.buf = np.frombuffer(mm, np.uint8, count=size)
        self.address = self.buf.ctypes.data  # of byte 0; valid while mapped (0 after close)
        self._lock = threading.Lock()
        self._on_close: list[Callable[[], None]] = []

    @classmethod
    def create(cls, size: int) -> Segment:
        """Client side: a sealed, fully allocated memfd of ``size`` bytes (plus the header),
        mapped (steps 1 of the module doc). ShmError("exhausted") when the memory cannot be
        allocated (the memory cgroup, or overcommit)."""
        import fcntl

        if not hasattr(os, "memfd_create"):
            raise ShmError("not_found", "shm: this system has no memfd_create (Linux only)")
        sweep_stale()  # files a client of an earlier version left in /dev/shm
        size = segment_bytes(size)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)  # reachable only through /proc/<pid>/fd of this uid anyway
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ShmError(
                    "exhausted",
                    f"shm_bytes: cannot allocate a shared-memory segment of {size} bytes "
                    f"({os.strerror(exc.errno or 0)}); ask for a smaller one or use another "
                    f"transport",
                ) from None
            fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, size, name, fd)

    @classmethod
    def adopt(cls, fd: int, size: int) -> Segment:
        """Worker side: map ``size`` bytes of a memfd a client passed, after the checks of
        the module doc (``check_fd``, then this process's own ``posix_fallocate``). The
        descriptor is closed either way (the mapping keeps the memory)."""
        try:
            name = check_fd(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ShmError(
                    "exhausted",
                    f"attach_shm.size: segment {name}: cannot allocate its {size} bytes here "
                    f"({os.strerror(exc.errno or 0)}; {os.fstat(fd).st_blocks * 512} bytes "
                    f"allocated)",
                ) from None
            try:
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise ShmError(
                    "exhausted" if exc.errno == errno.ENOMEM else "invalid",
                    f"attach_shm.size: segment {name}: cannot map its {size} bytes here "
                    f"({os.strerror(exc.errno or 0)})",
                ) from None
        finally:
            os.close(fd)
        return cls(mm, size, name)

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
        """Unmap (and close the descriptor, client side); idempotent."""
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


def segment_bytes(size: int) -> int:
    """The size of a segment with room for ``size`` bytes of arrays (header, alignment)."""
    return HEADER_BYTES + _round(size)


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


__all__ = [
    "PARALLEL_BYTES",
    "PASS_MAGIC",
    "SEALS",
    "TICKET_BYTES",
    "Allocator",
    "Segment",
    "ShmError",
    "check_fd",
    "copy",
    "pass_fd",
    "segment_bytes",
    "shm_dir",
    "sweep_stale",
    "worker_uid",
]
