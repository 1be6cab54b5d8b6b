"""``RecoveringSession``: the Session stream of a ``RecoveringClient``, restart-proof.

    with RecoveringClient(addr, retain=True) as w, w.session(shm=True, doorbell=True) as s:
        fut = s.expert_group_routed(experts, x, routes, weights)
        y = fut.result()            # the same result, even if the worker restarted meanwhile

It wraps an inner session of any transport (``open_session``: the gRPC stream, the socket
data plane, shared memory) and keeps each call until it is answered; the calls are
``SessionCalls``' own, submitted through ``_submit``, which it replays by kind.
When the stream or its doorbell channel ends (a killed worker, a cancelled stream), every
call in flight fails with that one error; the first ``result()`` or submit that meets it

1. lets the client recover: one ``info()`` waits for the worker (up to the client's
   ``recover_timeout``); if a new instance answers, the client re-uploads its tensors and
   marks its KV sequences for replay (``client/recovery.py``); without ``retain`` or
   ``loader`` those calls raise ``WorkerRestarted``, as the unary calls do,
2. opens a fresh inner Session with the same options (shared-memory segment and doorbell
   channel belong to one stream, so they are made anew),
3. sends the calls that were in flight again, in the order first submitted: ``TensorRef``
   handles were updated in place, raw handles go through the client's remap, and the first
   ragged call of each sequence carries the sequence's retained rows in front of its own.

The futures then resolve as if nothing happened. Every session call is idempotent (ragged
attention sends rows from ``start``), so a stream that ends while the same instance is up is
retried too, once per call. An error the worker answers for one request is raised by that
call's future and never retried. Arrays are copied at submit, so the engine may reuse its
buffers while a call is pending. Ragged calls record their rows in the client's KV history
when they are sent (the worker runs the calls on one kv_b in that order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from coliworker.client import errors
from coliworker.client.session import Session, open_session
from coliworker.client.session_calls import SessionCalls, SessionFuture

if TYPE_CHECKING:
    from coliworker.client.recovery import RecoveringClient

Send = Callable[[Session], SessionFuture]
Sent = tuple[Session, SessionFuture]


def _is_end(session: Session, err: BaseException | None) -> bool:
    """Whether ``err`` says that ``session``'s stream or doorbell channel ended: it is the
    error the session fails every pending and later call with, not one the worker answered."""
    bell = session._bell
    return err is not None and (err is session._broken or (bell is not None and err is bell.broken))


def _ended(sent: Sent) -> bool:
    session, fut = sent
    return fut.done() and _is_end(session, fut._error)


def _settled(sent: Sent) -> bool:
    """Answered: a result, or an error the worker (or the client) gave for this call."""
    return sent[1].done() and not _ended(sent)


class _Call:
    """One submitted call: how to send it, and the stream and future it was sent as."""

    __slots__ = ("send", "sent", "error", "retried")

    def __init__(self, send: Send, sent: Sent) -> None:
        self.send = send
        self.sent = sent  # replaced as a whole, so readers see a matching pair
        self.error: BaseException | None = None  # why recovery gave up on it
        self.retried = False  # sent again once after its stream ended on the same instance


class RecoveringFuture:
    """The pending result of one RecoveringSession call (SessionFuture's API)."""

    __slots__ = ("_session", "_call")

    def __init__(self, session: RecoveringSession, call: _Call) -> None:
        self._session, self._call = session, call

    @property
    def request_id(self) -> int:
        return self._call.sent[1].request_id

    @property
    def backend_ns(self) -> int:
        return self._call.sent[1].backend_ns

    @property
    def lengths(self) -> list[int]:
        return self._call.sent[1].lengths

    def done(self) -> bool:
        c = self._call
        return c.error is not None or _settled(c.sent)

    def result(self, timeout: float | None = None) -> Any:
        """The decoded result, recovering first if the stream ended. ``timeout`` bounds
        each wait for an answer (a recovery in between starts it again)."""
        c = self._call
        while True:
            if c.error is not None:
                raise c.error
            sent = c.sent
            try:
                return sent[1].result(timeout)
            except errors.WorkerError:
                if not _ended(sent):
                    raise
            self._session._recover(sent[0])


class RecoveringSession(SessionCalls):
    """A Session that survives worker restarts (use ``RecoveringClient.session()``; see the
    module docstring). Options are Session's; several threads may share it."""

    def __init__(self, client: RecoveringClient, **options: Any) -> None:
        self._client = client
        self._tls = threading.local()
        self.wire_dtype = client.wire_dtype
        self._options = options
        self._lock = threading.Lock()  # submits, and one recovery at a time
        self._calls: list[_Call] = []  # submitted and not yet answered, in submission order
        self._closed = False
        if client.instance_id is None:
            client.info()  # the instance the stream talks to, to tell a restart from a cancel
        self._inner, self._instance = open_session(client, **options), client.instance_id

    # -- lifecycle ------------------------------------------------------------------------

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the stream (in-flight calls complete first) and release shared memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inner.close(timeout)

    @property
    def shm(self) -> bool:
        return self._inner.shm

    @property
    def doorbell(self) -> bool:
        return self._inner.doorbell

    @property
    def transport(self) -> str:
        return self._inner.transport

    @property
    def timeout(self) -> float | None:
        return self._inner.timeout

    # -- submitting and recovering --------------------------------------------------------

    def _submit(
        self,
        kind: str,
        body: Any,
        decode: Any,
        out_bytes: int = 0,
        side: list[np.ndarray] | None = None,
    ) -> RecoveringFuture:
        """A call of ``SessionCalls`` (built once there), kept to send again: its arrays are
        copied now (the engine may reuse its buffers), and each send rewrites the handles
        of a dead instance to their re-uploaded copies (the client's remap)."""
        side = [np.array(a) for a in (self._take_side() if side is None else side)]
        client = self._client

        def send(s: Session) -> SessionFuture:
            b = type(body)()
            b.CopyFrom(body)
            if client._remap:
                client._rewrite(b)
            return s._submit(kind, b, decode, out_bytes, side=list(side))

        return self._send(send)

    def _send(self, send: Send) -> RecoveringFuture:
        while True:
            with self._lock:
                if self._closed:
                    raise errors.Cancelled("session is closed")
                session = self._inner
                try:
                    call = _Call(send, (session, send(session)))
                except errors.WorkerError as err:
                    if not _is_end(session, err):
                        raise
                else:
                    self._calls = [c for c in self._calls if not _settled(c.sent)]
                    self._calls.append(call)
                    return RecoveringFuture(self, call)
            self._recover(session)

    def _recover(self, dead: Session) -> None:
        """Replace the ended inner session ``dead`` (once, whichever thread gets here first)
        and send its calls in flight again; if that fails, they fail with the reason."""
        with self._lock:
            if self._inner is not dead:
                return  # another thread recovered
            try:
                if self._closed:
                    raise errors.Cancelled("session is closed")
                self._reopen()
            except BaseException as exc:
                for c in self._calls:
                    if c.error is None and not _settled(c.sent):
                        c.error = exc
                self._calls = []
                raise  # ``dead`` stays: the next call meets its end and tries again
            dead.close(1.0)  # its calls have failed: this only releases the stream

    def _reopen(self) -> None:
        client = self._client
        deadline = time.monotonic() + client.recover_timeout
        while True:
            client.info()  # waits for the worker; restores the client on a new instance
            restarted = client.instance_id != self._instance
            calls = [c for c in self._calls if c.error is None and not _settled(c.sent)]
            try:
                new = open_session(client, **self._options)
            except errors.Unavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(client.backoff)
                continue  # the worker went away again
            if self._resend(new, calls, restarted):
                self._inner, self._instance = new, client.instance_id
                self._calls = [c for c in self._calls if c.error is None]
                return
            new.close(1.0)
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"session to {client.address}: no stream lasted through the "
                    f"{client.recover_timeout:g} s of recover_timeout: fall back to the CPU path"
                )

    @staticmethod
    def _resend(new: Session, calls: list[_Call], restarted: bool) -> bool:
        """Send ``calls`` on ``new`` in order; False if ``new`` ended meanwhile."""
        for c in calls:
            if not restarted:
                if c.retried:
                    c.error = c.sent[1]._error  # ended twice on a live instance
                    continue
                c.retried = True
            try:
                c.sent = (new, c.send(new))
            except errors.WorkerError as err:
                if _is_end(new, err):
                    return False
                c.error = err
            except Exception as exc:  # e.g. a replayed history too large for the segment
                c.error = exc
        return True

    # -- calls ----------------------------------------------------------------------------

    def _handle(self, t: Any) -> Any:
        """A raw handle of a dead instance rewritten to its re-uploaded copy (TensorRef
        objects are updated in place)."""
        if t is None or hasattr(t, "handle"):
            return t
        return self._client._remap.get(int(t), int(t))

    # The other calls are SessionCalls' own, through ``_submit``; ragged attention also
    # keeps the client's KV history, so it builds its call at each send.

    def attention_ragged(
        self,
        kv_b: Any,
        o_proj: Any,
        q: np.ndarray,
        *,
        sequences: Sequence[tuple[int, int, np.ndarray, np.ndarray]],
        **dims: Any,
    ) -> RecoveringFuture:
        """Ragged MLA over resident KV (as ``Session.attention_ragged``), as a future; each
        sequence's rows go into the client's KV history, to replay after a restart."""
        c = self._client
        ref = c._ref_of(kv_b)
        q = np.array(q, np.float32)
        seqs = [
            (int(sid), int(start), np.array(lat, np.float32), np.array(rop, np.float32))
            for sid, start, lat, rop in sequences
        ]

        def send(s: Session) -> SessionFuture:
            sent = [c._with_history(ref, *seq) for seq in seqs]
            h = self._handle
            fut = s.attention_ragged(h(kv_b), h(o_proj), q, sequences=sent, **dims)
            c._record(ref, seqs)
            return fut

        return self._send(send)


__all__ = ["RecoveringFuture", "RecoveringSession"]
