"""The compute calls' logic: validate a request against the resident tensors, run it on the
backend, encode the response.

``ComputeOps`` is mixed into ``WorkerServicer``; each method takes the request message and
the caller's owner name and returns the response message, raising ``WorkerError``
subclasses. The unary handlers, the Session stream and the same-host doorbell all call these
methods, so a request is checked and answered the same way on every path. The expert groups'
lists are resolved by ``ExpertLists`` (``server/expert_lists.py``); the ``*_checked`` methods
run a call ``server/fastpath.c`` read and checked, through the same tails (``_group_run``,
``_routed_run``, ``_ragged_run``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from coliworker.server import validate
from coliworker.server.backend import Backend, Result
from coliworker.server.config import Config
from coliworker.server.dtypes import output_dtype
from coliworker.server.errors import InvalidArgument, ResourceExhausted, Unavailable
from coliworker.server.expert_lists import ExpertLists, Experts
from coliworker.server.sequences import RowsIn, SequenceStore
from coliworker.server.store import Handle, TensorStore, held
from coliworker.server.usage import UsageCounts
from coliworker.v1 import worker_pb2 as pb
from coliworker.wire import codec
from coliworker.wire.codec import INLINE, ArrayIO

#: Resolved (kv_b, o_proj) handle pairs of ragged attention kept per servicer (cleared when
#: full).
_ATTENTION_CACHE = 4096

#: The o_proj field of each op that takes one (a literal, not an f-string per call).
_O_PROJ_FIELD = {"attention": "attention.o_proj", "attention_ragged": "attention_ragged.o_proj"}


def _sequence_fields(i: int) -> tuple[str, str, str]:
    """The names of ``attention_ragged.sequences[i]`` and of its latent and rope fields."""
    f = f"attention_ragged.sequences[{i}]"
    return f, f"{f}.latent", f"{f}.rope"


#: ``_sequence_fields`` of the first sequences, built once: the codec takes the field names
#: on every call (it names them only on an error).
_PREBUILT = 64
_SEQUENCE_FIELDS = tuple(_sequence_fields(i) for i in range(_PREBUILT))


def _bounds(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a small integer array (one pass for decode sizes)."""
    if a.size <= 64:
        flat = a.ravel().tolist()
        return min(flat), max(flat)
    return int(a.min()), int(a.max())


class ComputeOps(ExpertLists):
    """Per-op request handling shared by every transport (see the module docstring)."""

    config: Config
    backend: Backend
    store: TensorStore
    sequences: SequenceStore
    tensor_counts: UsageCounts  # per-tensor calls and rows (TensorUsage, usage.py)
    hooks: Any
    _lock: threading.Lock
    _compute_calls: int
    _attention_cache: dict[tuple[str, int, int], tuple[int, Handle, Handle | None, Any]]

    def _tensor(self, handle: int, field: str, owner: str) -> Handle:
        raise NotImplementedError

    def _begin_compute(self, op: str) -> None:
        """Fault injection (--fail-after) for tests of the engine's CPU fallback."""
        limit = self.config.fail_after
        if limit is None:
            return
        with self._lock:
            n = self._compute_calls
            self._compute_calls += 1
        if n >= limit:
            raise Unavailable(
                f"{op}: compute failed (injected fault after {limit} calls, "
                f"--fail-after); fall back to the CPU path"
            )

    @staticmethod
    def _timed(fn: Callable[..., Result], *args: Any) -> Result:
        """Call the backend and record the call's wall time (what backend_ns reports)."""
        t0 = time.perf_counter_ns()
        r = fn(*args)
        r.wall_ns = time.perf_counter_ns() - t0
        return r

    @staticmethod
    def _out(result: Result, out_dtype: int, in_dtype: int, io: ArrayIO) -> pb.Array:
        return io.encode(result.out, output_dtype(out_dtype, in_dtype))

    @held
    def matmul(
        self, request: pb.MatmulRequest, owner: str, io: ArrayIO = INLINE
    ) -> pb.MatmulResponse:
        w = self._tensor(request.handle, "matmul.handle", owner)
        x = validate.array(request.x, "matmul.x", 2, io)
        validate.columns(x, w.spec.in_features, "matmul.x", "tensor in_features")
        self._begin_compute("matmul")
        r = self._timed(self.backend.matmul, w.data.resident, x)
        self.tensor_counts.tensor(w.spec.device, x.shape[0], w.id)
        return pb.MatmulResponse(
            y=self._out(r, request.output_dtype, request.x.dtype, io), backend_ns=r.backend_ns
        )

    @held
    def expert_mlp(
        self, request: pb.ExpertMlpRequest, owner: str, io: ArrayIO = INLINE
    ) -> pb.ExpertMlpResponse:
        g = self._tensor(request.gate, "expert_mlp.gate", owner)
        u = self._tensor(request.up, "expert_mlp.up", owner)
        d = self._tensor(request.down, "expert_mlp.down", owner)
        validate.same_device(
            [("expert_mlp.gate", g), ("expert_mlp.up", u), ("expert_mlp.down", d)], "expert_mlp"
        )
        dim, _ = validate.mlp(g, u, d, "expert_mlp")
        x = validate.array(request.x, "expert_mlp.x", 2, io)
        validate.columns(x, dim, "expert_mlp.x", "gate in_features")
        self._begin_compute("expert_mlp")
        r = self._timed(
            self.backend.expert_mlp, g.data.resident, u.data.resident, d.data.resident, x
        )
        self.tensor_counts.tensor(g.spec.device, x.shape[0], g.id, u.id, d.id)
        return pb.ExpertMlpResponse(
            y=self._out(r, request.output_dtype, request.x.dtype, io), backend_ns=r.backend_ns
        )

    def _group_args(
        self, request: pb.ExpertGroupRequest, op: str, owner: str, io: ArrayIO = INLINE
    ):
        triples, device, dim = self._experts(request, op, owner, io)
        rows = list(request.rows)
        if len(rows) != len(triples):
            raise InvalidArgument(
                f"{op}.rows: expected {len(triples)} entries (one per expert), got {len(rows)}"
            )
        for c, r in enumerate(rows):
            if r < 1:
                raise InvalidArgument(f"{op}.rows[{c}]: expected >= 1, got {r}")
        x = validate.array(request.x, f"{op}.x", 2, io)
        if x.shape[0] != sum(rows):
            raise InvalidArgument(
                f"{op}.x: expected {sum(rows)} rows (sum of rows), got {x.shape[0]}"
            )
        validate.columns(x, dim, f"{op}.x", "experts' in_features")
        return triples, rows, x, device

    def _group_done(self, r: Result, device: int, experts: int, rows: int) -> None:
        """An expert group call's statistics recorded (the store's and the metrics')."""
        p = r.phases
        self.store.record_group(device, experts, rows, p)
        self.hooks.record_group(device, experts, rows, p)

    @staticmethod
    def _group_response(r: Result, out_dtype: int, io: ArrayIO) -> pb.ExpertGroupResponse:
        p = r.phases
        resp = pb.ExpertGroupResponse()  # field by field: no message argument to copy
        io.encode_into(resp.y, r.out, output_dtype(out_dtype))
        resp.backend_ns = r.backend_ns
        resp.h2d_ns = p.h2d_ns
        resp.kernel_ns = p.kernel_ns
        resp.d2h_ns = p.d2h_ns
        return resp

    @held
    def expert_group(
        self, request: pb.ExpertGroupRequest, owner: str, io: ArrayIO = INLINE
    ) -> pb.ExpertGroupResponse:
        triples, rows, x, device = self._group_args(request, "expert_group", owner, io)
        r = self._group_run(triples, device, rows, x)
        return self._group_response(r, request.output_dtype or request.x.dtype, io)

    def _group_run(
        self, triples: Experts, device: int, rows: list[int], x: np.ndarray, lend: bool = False
    ) -> Result:
        """A checked expert group call run: the backend's call (``lend``: its result may be
        lent, ``Backend.expert_group``), its usage counts and records."""
        self._begin_compute("expert_group")
        r = self._timed(self.backend.expert_group, triples, rows, x, lend)
        self.tensor_counts.experts(device, triples.ids, rows)
        self._group_done(r, device, len(triples), sum(rows))
        return r

    def expert_group_checked(self, request: tuple, owner: str, io: ArrayIO = INLINE) -> Result:
        """``expert_group`` of a call ``server/fastpath.c`` read and checked: ``request`` is
        its (triples, device, rows, x); the backend's Result, its out lent (the transport
        answers with it before this thread's next call). The caller holds the store
        (``FastCalls.run``) from before the lookups."""
        triples, device, rows, x = request
        return self._group_run(triples, device, rows, x, lend=True)

    @held
    def expert_group_routed(
        self, request: pb.ExpertGroupRoutedRequest, owner: str, io: ArrayIO = INLINE
    ) -> pb.ExpertGroupResponse:
        # A decode step's host path: the field names are literals (no f-string per call) and
        # each shape is read once.
        op = "expert_group_routed"
        triples, device, dim = self._experts(request, op, owner, io)
        x = validate.array(request.x, "expert_group_routed.x", 2, io)
        rows = x.shape[0]
        if x.shape[1] != dim:
            validate.columns(x, dim, "expert_group_routed.x", "experts' in_features")
        try:
            routes = io.decode(request.routes, "expert_group_routed.routes", ndim=2,
                               float_only=False)  # fmt: skip
        except codec.CodecError as exc:
            raise InvalidArgument(str(exc)) from None
        if routes.dtype != np.int32:
            raise InvalidArgument(f"{op}.routes.dtype: expected int32, got {routes.dtype}")
        weights = validate.array(request.weights, "expert_group_routed.weights", 2, io)
        shape = routes.shape
        if shape[0] != rows:
            raise InvalidArgument(
                f"{op}.routes: expected {rows} rows (one per token of x), got {shape[0]}"
            )
        if weights.shape != shape:
            raise InvalidArgument(
                f"{op}.weights: expected shape {list(shape)} (routes), got {list(weights.shape)}"
            )
        n = len(triples)
        lo, hi = _bounds(routes)
        if lo < 0 or hi >= n:
            bad = np.argwhere((routes < 0) | (routes >= n))
            t, j = (int(v) for v in bad[0])
            raise InvalidArgument(
                f"{op}.routes[{t}, {j}]: expected 0..{n - 1} "
                f"(an index into experts), got {int(routes[t, j])}"
            )
        r = self._routed_run(triples, device, x, routes, weights)
        return self._group_response(r, request.output_dtype or request.x.dtype, io)

    def _routed_run(
        self, triples: Experts, device: int, x: np.ndarray, routes: np.ndarray, weights: Any
    ) -> Result:
        """A checked routed call run: the backend's call, its usage counts and records."""
        self._begin_compute("expert_group_routed")
        r = self._timed(self.backend.expert_group_routed, triples, x, routes, weights)
        self.tensor_counts.routed(device, triples.ids, routes)
        self._group_done(r, device, len(triples), int(routes.size))
        return r

    def expert_group_routed_checked(
        self, request: tuple, owner: str, io: ArrayIO = INLINE
    ) -> Result:
        """``expert_group_routed`` of a call ``server/fastpath.c`` read and checked:
        ``request`` is its (triples, device, x, routes, weights); the backend's Result.
        The caller holds the store (``FastCalls.run``) from before the lookups."""
        triples, device, x, routes, weights = request
        return self._routed_run(triples, device, x, routes, weights)

    @held
    def attention(
        self, request: pb.AttentionRequest, owner: str, io: ArrayIO = INLINE
    ) -> pb.AttentionResponse:
        op = "attention"
        kv_b = self._tensor(request.kv_b, f"{op}.kv_b", owner)
        q = validate.array(request.q, f"{op}.q", 3, io)
        heads, k = validate.attention_dims(
            kv_b, q, request.q_dim, request.rope_dim, request.v_dim, request.scale, op
        )
        latent = validate.array(request.latent, f"{op}.latent", 2, io)
        rope = validate.array(request.rope, f"{op}.rope", 2, io)
        validate.columns(latent, k, f"{op}.latent", "kv_b in_features")
        validate.columns(rope, request.rope_dim, f"{op}.rope", "rope_dim")
        if rope.shape[0] != latent.shape[0]:
            raise InvalidArgument(
                f"{op}.rope: expected {latent.shape[0]} rows (latent rows), got {rope.shape[0]}"
            )
        if latent.shape[0] < q.shape[0]:
            raise InvalidArgument(
                f"{op}.latent: expected >= {q.shape[0]} rows (one per query "
                f"row, causal), got {latent.shape[0]}"
            )
        proj = self._o_proj(request.o_proj, kv_b, heads, request.v_dim, op, owner)
        self._begin_compute(op)
        r = self._timed(
            self.backend.attention,
            kv_b.data.resident,
            proj.data.resident if proj is not None else None,
            q,
            latent,
            rope,
            request.q_dim,
            request.rope_dim,
            request.v_dim,
            request.scale,
        )
        self.tensor_counts.tensor(kv_b.spec.device, q.shape[0], kv_b.id, request.o_proj)
        return pb.AttentionResponse(
            out=self._out(r, request.output_dtype, request.q.dtype, io), backend_ns=r.backend_ns
        )

    def _o_proj(
        self, handle: int, kv_b: Handle, heads: int, v_dim: int, op: str, owner: str
    ) -> Handle | None:
        """The o_proj handle of a call (None for 0), checked against its kv_b."""
        if handle == 0:
            return None
        proj = self.store.get(handle, _O_PROJ_FIELD[op], owner)
        spec = proj.data.spec
        # validate.same_device's and validate.o_proj's checks, made here: those calls (which
        # build field names and lists) only to raise their errors.
        if spec.device != kv_b.data.spec.device:
            validate.same_device([(f"{op}.kv_b", kv_b), (f"{op}.o_proj", proj)], op)
        if spec.in_features != heads * v_dim:
            validate.o_proj(proj, heads, v_dim, op)
        return proj

    @held
    def attention_ragged(
        self, request: pb.AttentionRaggedRequest, owner: str, io: ArrayIO = INLINE
    ) -> pb.AttentionRaggedResponse:
        # The per-call host path of every decode step: fields are read once, field names
        # come prebuilt (_SEQUENCE_FIELDS) or are built on the error path only, and a check
        # whose message validate builds is made here and calls validate only when it fails.
        op = "attention_ragged"
        kv_id, o_proj = request.kv_b, request.o_proj
        # kv_b and o_proj as an earlier call of this owner resolved them and checked them
        # against each other, while the store's generation has not moved since (no handle
        # freed or updated): its lookups are skipped. The generation is read before the
        # lookups of a miss, so a free racing with them leaves the entry stale.
        gen = self.store.generation
        key = (owner, kv_id, o_proj)
        hit = self._attention_cache.get(key)
        if hit is not None and hit[0] == gen:
            _, kv_b, proj_h, proj = hit
        else:
            hit = None
            kv_b = self._tensor(kv_id, "attention_ragged.kv_b", owner)
        q_msg = request.q
        q = validate.array(q_msg, "attention_ragged.q", 3, io)
        q_dim, rope_dim, v_dim = request.q_dim, request.rope_dim, request.v_dim
        scale = request.scale
        heads, k = validate.attention_dims(kv_b, q, q_dim, rope_dim, v_dim, scale, op)
        # a list of the repeated field: iterating the field itself runs the sequence
        # protocol out to an IndexError (~1.5k instructions), slicing it does not
        sequences = request.sequences[:]
        n, q_rows = len(sequences), q.shape[0]
        if n != q_rows:
            raise InvalidArgument(f"{op}.sequences: expected {q_rows} (one per q row), got {n}")
        limit = self.config.max_sequences_per_call
        if n > limit:
            raise ResourceExhausted(f"{op}.sequences: expected at most {limit}, got {n}")
        rows: list[RowsIn] = []
        new_rows: list[tuple[np.ndarray, np.ndarray]] = []  # (latent, rope) per sequence
        seen: dict[int, int] = {}
        for i, s in enumerate(sequences):
            f, f_latent, f_rope = _SEQUENCE_FIELDS[i] if i < _PREBUILT else _sequence_fields(i)
            sid, start = s.sequence_id, s.start
            if sid in seen:
                raise InvalidArgument(
                    f"{f}.sequence_id: {sid} already appears in sequences[{seen[sid]}]"
                )
            seen[sid] = i
            if start < 0:
                raise InvalidArgument(f"{f}.start: expected >= 0, got {start}")
            try:
                lat = io.decode_rows(s.latent, f_latent, k)
                rop = io.decode_rows(s.rope, f_rope, rope_dim)
            except codec.CodecError as exc:
                raise InvalidArgument(str(exc)) from None
            if lat.shape[-1] != k:
                validate.columns(lat, k, f_latent, "kv_b in_features")
            if rop.shape[-1] != rope_dim:
                validate.columns(rop, rope_dim, f_rope, "rope_dim")
            if len(rop) != len(lat):
                raise InvalidArgument(
                    f"{f}.rope: expected {len(lat)} rows (latent rows), got {len(rop)}"
                )
            rows.append(RowsIn(sid, start, lat, rop))
            new_rows.append((lat, rop))
        if hit is None:  # looked up and checked as the cache's entry was
            proj_h = self._o_proj(o_proj, kv_b, heads, v_dim, op, owner)
            proj = proj_h.data.resident if proj_h is not None else None
            cache = self._attention_cache
            if len(cache) >= _ATTENTION_CACHE:
                cache.clear()
            cache[key] = (gen, kv_b, proj_h, proj)
        elif proj_h is not None and proj_h.data.spec.in_features != heads * v_dim:
            validate.o_proj(proj_h, heads, v_dim, op)  # (the device was checked with it)
        r, lengths = self._ragged_run(
            kv_b, proj, q, rows, new_rows, k, q_dim, rope_dim, v_dim, scale, o_proj
        )
        # the fields set one by one, the result encoded in place (codec.encode_into): the
        # same message as keyword arguments give, in about half the instructions
        resp = pb.AttentionRaggedResponse()
        resp.backend_ns = r.wall_ns or r.backend_ns  # r.backend_ns without its property call
        resp.lengths.extend(lengths)
        io.encode_into(resp.out, r.out, output_dtype(request.output_dtype, q_msg.dtype))
        return resp

    def _ragged_run(
        self,
        kv_b: Handle,
        proj: Any,
        q: np.ndarray,
        rows: list[RowsIn],
        new_rows: list[tuple[np.ndarray, np.ndarray]],
        k: int,
        q_dim: int,
        rope_dim: int,
        v_dim: int,
        scale: float,
        o_proj: int,
    ) -> tuple[Result, list[int]]:
        """A checked ragged call run: its sequences' caches grown or rolled back, the
        backend's call, its usage counts; (the Result, each cache's length after it)."""
        if self.config.fail_after is not None:  # (the call only where it can inject a fault)
            self._begin_compute("attention_ragged")
        seqs = self.sequences
        with seqs.ordered(kv_b):  # calls on one (owner, kv_b) in turn
            t0 = time.perf_counter_ns()  # the KV growth is backend work too
            caches = seqs.prepare(kv_b, rows, k, rope_dim)
            r = self.backend.attention_ragged(
                kv_b.data.resident,
                proj,
                q,
                caches,
                q_dim,
                rope_dim,
                v_dim,
                scale,
                rows=new_rows,
            )
            r.wall_ns = time.perf_counter_ns() - t0
            lengths = []  # (a loop: a comprehension is one function call more)
            for c in caches:
                lengths.append(c.length)
        self.tensor_counts.tensor(kv_b.data.spec.device, q.shape[0], kv_b.id, o_proj)
        return r, lengths

    def attention_ragged_checked(
        self, request: tuple, owner: str, io: ArrayIO = INLINE
    ) -> tuple[Result, list[int]]:
        """``attention_ragged`` of a call ``server/fastpath.c`` read and checked: ``request``
        is its (kv_b, o_proj handle, o_proj resident, q, rows, new rows, K, q_dim, rope_dim,
        v_dim, scale, o_proj id); (the Result, the caches' lengths). The caller holds the
        store (``FastCalls.run``) from before the lookups."""
        kv_b, _, proj, q, rows, new_rows, k, q_dim, rope_dim, v_dim, scale, o_proj = request
        return self._ragged_run(
            kv_b, proj, q, rows, new_rows, k, q_dim, rope_dim, v_dim, scale, o_proj
        )
