"""The wire: everything both ends of a connection must agree on, imported by client and
worker alike.

- ``calls``: the RPCs of ``service Worker`` as one table (method number, names, request and
  response messages), so every transport moves the same calls.
- ``codec``: NumPy arrays <-> ``coliworker.v1.Array``, content hashes, chunking.
- ``staging``: arrays whose bytes travel outside their message (frame data, chunks, shm).
- ``frames``: the data plane's frame format (``proto/FRAMES.md``) and socket I/O.
- ``shm``: the shared-memory segment and its allocator.
- ``bell``: the doorbell channel's files and slot layout (frames in shared memory).
"""
