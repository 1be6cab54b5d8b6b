"""The decode calls' compiled path on the worker (``server/fastpath.c``): an expert group
(the seed ABI's decode call, as the C client sends it), routed expert group or ragged
attention call read from its data-plane frame and answered with no protobuf message on
either side. The socket data plane and the shared-memory doorbell hand it each
such frame first.

    FastCalls.of(servicer).run(method, body, data, owner, transport, shm_view)
        -> Outcome | None

``run`` returns None for every call the C does not read (another type than float32, an
integer array in shared memory, tensors the servicer has not resolved for this owner and
store generation, anything the Python would refuse): the transport then runs the frame as
before, through ``ComputeOps.expert_group`` / ``expert_group_routed`` / ``attention_ragged``,
which stay the reference and the one author of every error. A call it reads runs the same
backend call, KV cache growth, usage counts and records (``ComputeOps._group_run`` /
``_routed_run`` / ``_ragged_run``; the group's result lent, ``Backend.expert_group``: the
transport answers with it before its thread's next call) through the one dispatch
(``Dispatch.run``: its status mapping and session metric), and answers a ``FastReply`` whose
``body`` is the response protobuf would serialize, to the byte
(tests/hotpath/test_fastpath_group.py, test_fastpath_routed.py and test_fastpath_ragged.py
run both paths on the same calls).

The module is built like ``server/kept.c`` (``kept.build``: the host's C compiler, keyed by
the source, the interpreter and NumPy's version, into ``COLIWORKER_KEPT_CACHE``); where it
cannot be built the worker logs one warning and every call takes the Python.
``COLIWORKER_FASTPATH=0`` switches it off. ``python -m coliworker.server.fastpath`` builds it
ahead and prints where it lies.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

import numpy as np

from coliworker.server import kept
from coliworker.server.dispatch import Outcome
from coliworker.server.sequences import RowsIn
from coliworker.wire import calls

log = logging.getLogger(__name__)

ENABLED = os.environ.get("COLIWORKER_FASTPATH", "1") != "0"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastpath.c")
GROUP = calls.BY_KIND["expert_group"]
ROUTED = calls.BY_KIND["expert_group_routed"]
RAGGED = calls.BY_KIND["attention_ragged"]

_built: list[ModuleType | None] = []  # [the module or None] once tried


def build(out_dir: str | None = None) -> str:
    """Compile ``fastpath.c`` where not built already (``kept.build``); the module's path."""
    return kept.build(out_dir, SOURCE, (np.get_include(),), f"numpy {np.__version__}")


def module() -> ModuleType | None:
    """The built module, set up (once per process); None where it is switched off or cannot
    be built (one warning logged)."""

    def make() -> ModuleType:
        from coliworker.server.expert_lists import _EXPERT_CACHE, Experts

        mod = kept.load(build(), "_fastpath")
        mod.setup(Experts, _EXPERT_CACHE)
        return mod

    return kept.once(_built, ENABLED, make, "compiled frame path")


class FastReply:
    """A call's result before its reply is placed: ``y`` its float32 array (what
    ``codec.encode_into`` puts in the sink), ``body(shm, offset)`` the serialized response
    whose array lies at ``offset`` of the frame's data or, with ``shm``, of the segment
    (``write(shape, nbytes, *fields, shm, offset)``: ``group_reply`` or ``ragged_reply``)."""

    __slots__ = ("_fields", "_write", "y")

    def __init__(self, out: Any, write: Any, *fields: Any) -> None:
        self.y = np.ascontiguousarray(np.asarray(out), np.float32)
        self._write, self._fields = write, fields

    def body(self, shm: bool, offset: int) -> bytes:
        y = self.y
        return self._write(y.shape, y.nbytes, *self._fields, shm, offset)

    def staged(self) -> tuple[bytes, list[memoryview], int]:
        """The reply's body, data pieces and data length with ``y`` the frame's data, as
        ``frames.place`` lays out a response's one array (at offset 0)."""
        y = self.y.data.cast("B")
        return self.body(False, 0), [y] if len(y) else [], len(y)


class FastCalls:
    """The compiled path of one servicer's decode calls: ``run`` for the methods in
    ``METHODS``."""

    METHODS = frozenset((GROUP.method, ROUTED.method, RAGGED.method))

    def __init__(self, servicer: Any, mod: ModuleType) -> None:
        self.servicer = servicer
        self.mod = mod

    @classmethod
    def of(cls, servicer: Any) -> FastCalls | None:
        """The servicer's compiled path, or None: switched off, not built, or a worker that
        injects faults (--fail-after counts calls in the Python path)."""
        if servicer.config.fail_after is not None:
            return None
        mod = module()
        return cls(servicer, mod) if mod is not None else None

    def run(
        self,
        method: int,
        body: Any,
        data: Any,
        owner: str,
        transport: str,
        shm_view: Any = None,
    ) -> Outcome | None:
        """The frame (``body``, ``data``; ``shm_view`` the session segment's ``view`` where
        it has one) of a call in ``METHODS`` run, or None: the Python's to run.

        The store is held (``begin_call``) from before the C looks the call's tensors up
        in the servicer's caches until the call is answered, as ``store.held`` holds it
        around a handler: a free racing with the lookup moves the generation first, or
        waits for the call."""
        s, mod = self.servicer, self.mod
        store = s.store
        epoch = store.begin_call()
        try:
            if method != RAGGED.method:  # an expert group, routed or not: one reader's args
                call, read, handler = (
                    (ROUTED, mod.routed_args, s.expert_group_routed_checked)
                    if method == ROUTED.method
                    else (GROUP, mod.group_args, s.expert_group_checked)
                )
                args = read(body, data, owner, s._expert_cache, s._triple_cache, store.generation,
                            s.config.max_experts, shm_view)  # fmt: skip
            else:
                call, handler = RAGGED, s.attention_ragged_checked
                args = mod.ragged_args(body, data, owner, s._attention_cache, store.generation,
                                       s.config.max_sequences_per_call, shm_view,
                                       RowsIn)  # fmt: skip
            if args is None:
                return None
            out = s.dispatch.run(call, args, owner, transport=transport, handler=handler)
            if out.ok:
                out.response = self._reply(call, out.response)
            return out
        finally:
            store.end_call(epoch)

    def _reply(self, call: Any, result: Any) -> FastReply:
        """The handler's result as a ``FastReply``: an expert group or routed call's
        ``Result``, or a ragged call's (``Result``, the caches' lengths)."""
        if call is not RAGGED:
            p = result.phases
            return FastReply(result.out, self.mod.group_reply, result.backend_ns, p.h2d_ns,
                             p.kernel_ns, p.d2h_ns)  # fmt: skip
        r, lengths = result
        return FastReply(r.out, self.mod.ragged_reply, lengths, r.backend_ns)


if __name__ == "__main__":
    print(build())
