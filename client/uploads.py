"""Uploading a set of tensors in one pipeline (``WorkerClient.upload_many``).

A tensor's SHA-256 must be known before its first byte is sent (the worker is asked first
whether it holds the content), and SHA-256 is sequential: one 1 GB tensor costs its hash
and then its stream. A set of tensors overlaps them:

    hash threads      hash items 0, 1, 2, ... in parallel (hashlib drops the GIL)
    stream threads    (3 by default) take items in order: wait for the item's hash, probe
                      (Lookup with acquire), stream it unless the worker holds it already

so while item i streams, item i+1 is hashed, and with several streams in flight the worker
hashes and places one tensor while the next arrives, and the round trips of one item's
probe and response hide behind the others' bytes (H200 host, 171 tensors of 6.3 MB: 1, 2,
3 streams took 2.22, 1.23, 1.04 s). Identical items of one set are sent
once: a later one waits for the first, then takes a reference to it.

All or nothing: when an item fails, no further item is started, every reference the call
took is released again, and the error is raised with ``upload_many.items[k]: `` in front of
its message and ``index`` = k.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from coliworker.client.errors import InvalidArgument, WorkerError
from coliworker.kernels.qtensor import MAX_FORMAT, row_bytes, scale_count
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec

if TYPE_CHECKING:
    from coliworker.client.worker import TensorRef, WorkerClient


class _Progress:
    """A one-line progress bar on stderr when it is a terminal (or when forced)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._lock = threading.Lock()  # several streams of one set advance it

    def advance(self, n: int) -> None:
        with self._lock:
            self._advance(n)

    def _advance(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = self.done / self.total if self.total else 1.0
            rate = self.done / max(now - self.t0, 1e-9) / 1e6
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.label} [{bar:<30}] {frac:6.1%} "
                f"{self.done / 1e6:8.1f}/{self.total / 1e6:.1f} MB {rate:7.1f} MB/s"
            )
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass(frozen=True)
class UploadItem:
    """One tensor of a set upload; the arguments of ``WorkerClient.upload``.

    weights: the documented layout (uint8 [O, row_bytes] or any array with those bytes;
    float32 [O, I] for fmt 0). scales: float32 [O] or [O, ceil(I/group_size)]; None for
    fmt 0.
    """

    weights: np.ndarray
    scales: np.ndarray | None
    fmt: int
    in_features: int
    out_features: int
    group_size: int = 0
    device: int = 0


@dataclass
class _Job:
    """An item ready to go: its spec, bytes and (future) content hash."""

    spec: pb.TensorSpec
    w: memoryview
    s: memoryview
    digest: Future[bytes]
    done: threading.Event

    @property
    def nbytes(self) -> int:
        return len(self.w) + len(self.s)


def _check(item: UploadItem, w: memoryview, s: memoryview, k: int) -> None:
    """The checks the worker would make on sizes, before any byte is sent."""
    field = f"upload_many.items[{k}]"
    if not 0 <= item.fmt <= MAX_FORMAT:
        raise InvalidArgument(f"{field}.fmt: expected 0..{MAX_FORMAT}, got {item.fmt}")
    for name in ("in_features", "out_features"):
        if getattr(item, name) < 1:
            raise InvalidArgument(f"{field}.{name}: expected >= 1, got {getattr(item, name)}")
    if (item.fmt == 4) != (item.group_size > 0) or item.group_size < 0:
        want = ">= 1 for fmt 4" if item.fmt == 4 else f"0 for fmt {item.fmt}"
        raise InvalidArgument(f"{field}.group_size: expected {want}, got {item.group_size}")
    wbytes = row_bytes(item.fmt, item.in_features) * item.out_features
    if len(w) != wbytes:
        raise InvalidArgument(
            f"{field}.weights: expected {wbytes} bytes ({item.out_features} rows x "
            f"{wbytes // item.out_features} bytes for fmt {item.fmt}, in_features "
            f"{item.in_features}), got {len(w)}"
        )
    nscales = scale_count(item.fmt, item.in_features, item.out_features, item.group_size)
    if len(s) != 4 * nscales:
        raise InvalidArgument(
            f"{field}.scales: expected {nscales} float32 values, got {len(s) // 4}"
        )


def _named(exc: BaseException, k: int) -> BaseException:
    """``exc`` (the same object: callers may match its type) naming item ``k``."""
    prefix = f"upload_many.items[{k}]"
    if isinstance(exc, WorkerError) and not exc.message.startswith(prefix):
        exc.message = f"{prefix}: {exc.message}"
        exc.args = (exc.message,)
    exc.index = k  # type: ignore[attr-defined]
    return exc


def upload_many(
    client: WorkerClient,
    items: Iterable[UploadItem],
    *,
    streams: int = 3,
    hash_threads: int = 4,
    bar: _Progress,
) -> list[TensorRef]:
    """See ``WorkerClient.upload_many``."""
    from coliworker.client.worker import TensorRef

    if streams < 1:
        raise ValueError(f"upload_many.streams: expected >= 1, got {streams}")
    if hash_threads < 1:
        raise ValueError(f"upload_many.hash_threads: expected >= 1, got {hash_threads}")
    prepared = []
    for k, item in enumerate(items):
        w, s = client._payload(item.weights, item.scales)
        try:
            _check(item, w, s, k)
        except InvalidArgument as exc:
            raise _named(exc, k) from None
        prepared.append((item, w, s))
    bar.total = sum(len(w) + len(s) for _, w, s in prepared)
    refs: list[TensorRef | None] = [None] * len(prepared)
    if not prepared:
        return []
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    first_of: dict[tuple[int, bytes], int] = {}
    registered = 0  # items [0, registered) are in first_of
    following = iter(range(len(prepared)))

    def first_index(k: int) -> int:
        """The earliest item with item k's content. Items register in index order (their
        hashes may finish in any order), so the first of a content is the lowest index."""
        nonlocal registered
        with lock:
            while registered <= k:
                job = jobs[registered]
                if job.digest.exception() is None:  # a failed hash fails its own item
                    first_of.setdefault((job.spec.device, job.digest.result()), registered)
                registered += 1
            return first_of[(jobs[k].spec.device, jobs[k].digest.result())]

    def probe(job: _Job) -> TensorRef | None:
        hit = client._call(
            client._stub.Lookup,
            pb.LookupRequest(
                content_hash=job.digest.result(), device=job.spec.device, acquire=True
            ),
        )
        return TensorRef._from(hit.tensor, deduplicated=True) if hit.found else None

    def send(k: int, job: _Job) -> TensorRef:
        digest = job.digest.result()
        first = first_index(k)
        if first != k:  # the same content earlier in the set: a reference once it is there
            jobs[first].done.wait()
            if refs[first] is None:
                raise WorkerError(f"the same content as items[{first}], which failed")
            ref = probe(job)
            if ref is None:
                raise WorkerError(f"items[{first}] (the same content) is no longer resident")
            bar.advance(job.nbytes)
            return ref
        ref = probe(job)
        if ref is not None:
            bar.advance(job.nbytes)
            return ref
        r = client._stream(client._stub.Upload, job.spec, digest, job.w, job.s, 0, bar)
        return TensorRef._from(r.tensor, r.deduplicated)

    def sender() -> None:
        while True:
            with lock:
                if errors:
                    return
                k = next(following, None)
            if k is None:
                return
            job = jobs[k]
            try:
                refs[k] = send(k, job)
            except BaseException as exc:
                with lock:
                    errors[k] = exc
            finally:
                job.done.set()

    with ThreadPoolExecutor(hash_threads, thread_name_prefix="upload-hash") as hashing:
        jobs: list[_Job] = []
        for item, w, s in prepared:
            digest = hashing.submit(
                codec.content_hash,
                item.fmt,
                item.in_features,
                item.out_features,
                item.group_size,
                w,
                s,
            )
            spec = pb.TensorSpec(
                fmt=item.fmt,
                in_features=item.in_features,
                out_features=item.out_features,
                group_size=item.group_size,
                device=item.device,
            )
            jobs.append(_Job(spec, w, s, digest, threading.Event()))
        # each stream thread runs in a copy of the caller's context (a RecoveringClient's
        # recovery marks its re-uploads there)
        threads = [
            threading.Thread(
                target=contextvars.copy_context().run,
                args=(sender,),
                name=f"upload-stream-{i}",
                daemon=True,
            )
            for i in range(min(streams, len(jobs)))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            for job in jobs:
                job.digest.cancel()
    if errors:
        for ref in refs:
            if ref is not None:
                try:
                    client.free(ref)
                except Exception:
                    pass  # the error below matters; a dead worker holds nothing anyway
        k = min(errors)
        raise _named(errors[k], k)
    return [ref for ref in refs if ref is not None]  # all of them


__all__ = ["UploadItem", "upload_many"]
