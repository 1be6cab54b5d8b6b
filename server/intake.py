"""Upload and Update end to end: the owner's limits first, then the bytes.

Every buffer an upload causes is admitted before it exists (``docs/security.md``):

- the stream counts as one of its owner's uploads in progress from its first message
  (``OwnerLimits.upload``, ``--max-uploads-per-owner``), header read included;
- content already resident with the same spec is only *verified*: its bytes are hashed
  block by block through the shared staging blocks and dropped, while a handle the call
  took at the header (charged to the owner's quota then, so a refusal costs nothing) keeps
  that copy alive. No host buffer of the claimed size is ever made for it;
- new content is admitted against the owner's quota, the device budget or free memory
  (``admission.check_upload``) before its device memory is allocated and filled in place;
- an Update of new content needs a host copy (the old content stays readable until the
  swap): it is admitted like an upload and counted in the owner's staged bytes
  (``--max-staged-bytes-per-owner``) for as long as it exists.

``put`` and ``replace`` take the servicer (store, quota, budget, backend, staging, owners
and its header, handle and ticket helpers), so every transport's Upload/Update handler is a
call to one of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from coliworker.server import upload
from coliworker.server.admission import check_upload
from coliworker.server.backend import Phases
from coliworker.server.errors import InvalidArgument
from coliworker.server.store import Handle


class _Discard:
    """A sink for bytes that are only hashed (their content is resident already)."""

    def write(self, offset: int, data: np.ndarray) -> None:
        pass


_DISCARD = _Discard()


def put(
    s: Any, header_msg: Any, messages: Iterator[Any], owner: str
) -> tuple[Handle, bool, Phases, upload.Header]:
    """An Upload: (handle, deduplicated, phases, header)."""
    with s.owners.upload(owner, "upload"):
        header: upload.Header = s._header(header_msg, messages, "upload")
        spec, digest = header.spec, header.content_hash
        held = s.store.acquire_same(digest, spec, owner, "upload")
        if held is not None:
            try:
                upload.receive(messages, header, "upload", _DISCARD, s.staging)
            except BaseException:
                s.store.free(held)
                raise
            return held, True, Phases(), header
        check_upload(s.quota, s.budget, s.backend, spec.device, header.total, owner, "upload")
        incoming = s.store.begin_upload(spec, digest, header.total, owner)
        try:
            upload.receive(messages, header, "upload", incoming, s.staging)
            handle, dedup, phases = incoming.commit()
        finally:
            incoming.abort()  # a no-op once committed
        return handle, dedup, phases, header


def replace(
    s: Any, header_msg: Any, messages: Iterator[Any], owner: str
) -> tuple[Handle, Phases, upload.Header]:
    """An Update: (handle, phases, header). The handle is checked before any byte is read."""
    with s.owners.upload(owner, "update"):
        header: upload.Header = s._header(header_msg, messages, "update")
        spec = header.spec
        handle = s._tensor(header.handle, "update.header.handle", owner)
        if handle.spec != spec:
            raise InvalidArgument(
                f"update.header.spec: expected {handle.spec} (the handle's spec), got {spec}"
            )
        held = s.store.acquire_same(header.content_hash, spec, owner, "update")
        try:
            if held is not None:
                upload.receive(messages, header, "update", _DISCARD, s.staging)
                s._settle_tickets(handle)
                return handle, s.store.update(handle, header.content_hash, None), header
            check_upload(s.quota, s.budget, s.backend, spec.device, header.total, owner, "update")
            with s.owners.staged(owner, header.total, "update"):
                tensor = upload.receive_host(messages, header, "update", s.staging)
                s._settle_tickets(handle)
                return handle, s.store.update(handle, header.content_hash, tensor), header
        finally:
            if held is not None:
                s.store.free(held)


__all__ = ["put", "replace"]
