"""A small GLM-style decode loop offloaded to a worker, every offloaded call checked.

Random weights, GLM-5.x structure cut down: each layer is MLA attention over a
worker-resident ragged KV cache (two sequences decoded together) followed by a routed MoE
(top-k of E int4 experts, one expert group call per token and layer). Halfway through, one
sequence rolls back a token and re-decodes it, as a speculative-decoding engine would.

The loop runs on the worker's results. Every offloaded call is also computed locally on the
float64 reference from the same inputs (the reference's KV caches hold the same rows), and
each result must agree to float32 rounding. Comparing the two loops end to end instead
would compare chaos: six tokens of feedback (normalisation, top-k routing) amplify a 1-ulp
difference of one call's input to ~1e-3 on some seeds, so a correct worker would fail, and
a small real error could hide below that noise. Per call there is no amplification: a
correct worker differs by ~1e-7 relative, the check fails at 1e-4.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from coliworker.client import WorkerClient, WorkerError
from coliworker.kernels import reference as ref
from coliworker.kernels.qtensor import QTensor, row_bytes


@dataclass(frozen=True)
class Dims:
    d: int = 256  # hidden
    ie: int = 128  # expert intermediate
    experts: int = 16
    top_k: int = 4
    heads: int = 4
    q: int = 32  # qk_nope
    r: int = 16  # qk_rope
    v: int = 32
    k: int = 64  # kv_lora


def _int4(rng: np.random.Generator, i: int, o: int) -> QTensor:
    w = rng.integers(0, 256, size=o * row_bytes(2, i), dtype=np.uint8)
    s = (rng.random(o) * 0.5 / np.sqrt(i) + 0.01).astype(np.float32)
    return QTensor(2, i, o, 0, w, s)


def _grouped(rng: np.random.Generator, i: int, o: int, gs: int) -> QTensor:
    w = rng.integers(0, 256, size=o * row_bytes(4, i), dtype=np.uint8)
    s = (rng.random(o * -(-i // gs)) * 0.5 / np.sqrt(i) + 0.01).astype(np.float32)
    return QTensor(4, i, o, gs, w, s)


class Model:
    def __init__(self, rng: np.random.Generator, dims: Dims, layers: int) -> None:
        m = dims
        self.dims = m
        self.layers = []
        for _ in range(layers):
            self.layers.append(
                {
                    "wq": (rng.standard_normal((m.d, m.heads * (m.q + m.r))) / np.sqrt(m.d)),
                    "wkv": (rng.standard_normal((m.d, m.k + m.r)) / np.sqrt(m.d)),
                    "router": rng.standard_normal((m.d, m.experts)),
                    "kv_b": _grouped(rng, m.k, m.heads * (m.q + m.v), 16),
                    "o_proj": _int4(rng, m.heads * m.v, m.d),
                    "experts": [
                        (_int4(rng, m.d, m.ie), _int4(rng, m.d, m.ie), _int4(rng, m.ie, m.d))
                        for _ in range(m.experts)
                    ],
                }
            )


def _norm(x: np.ndarray) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)


def _route(x: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    logits = x @ router
    idx = np.argsort(-logits, axis=-1)[:, :top_k]
    w = np.take_along_axis(logits, idx, axis=-1)
    w = np.exp(w - w.max(axis=-1, keepdims=True))
    return idx, (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)


class Backend:
    """The loop's compute: either the worker or the local reference."""

    def __init__(self, model: Model, worker: WorkerClient | None) -> None:
        self.model, self.w = model, worker
        self.kv: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.handles: list[dict] = []
        if worker is None:
            return

        def up(t: QTensor):
            return worker.upload(
                t.weights,
                t.scales,
                fmt=t.fmt,
                in_features=t.in_features,
                out_features=t.out_features,
                group_size=t.group_size,
            )

        for layer in model.layers:
            self.handles.append(
                {
                    "kv_b": up(layer["kv_b"]),
                    "o_proj": up(layer["o_proj"]),
                    "experts": [tuple(up(t) for t in e) for e in layer["experts"]],
                }
            )

    def attention(self, li: int, q: np.ndarray, seqs: list[tuple[int, int, np.ndarray]]):
        m, layer = self.model.dims, self.model.layers[li]
        scale = 1 / np.sqrt(m.q + m.r)
        if self.w is not None:
            h = self.handles[li]
            return self.w.attention_ragged(
                h["kv_b"],
                h["o_proj"],
                q,
                sequences=[
                    (sid, pos, row[None, : m.k], row[None, m.k :]) for sid, pos, row in seqs
                ],
                q_dim=m.q,
                rope_dim=m.r,
                v_dim=m.v,
                scale=scale,
            )
        lats, ropes = [], []
        for sid, pos, row in seqs:
            lat, rop = self.kv.get((li, sid), (np.zeros((0, m.k)), np.zeros((0, m.r))))
            lat = np.vstack([lat[:pos], row[None, : m.k]])
            rop = np.vstack([rop[:pos], row[None, m.k :]])
            self.kv[(li, sid)] = (lat, rop)
            lats.append(lat.astype(np.float32))
            ropes.append(rop.astype(np.float32))
        return ref.attention_ragged(
            layer["kv_b"],
            layer["o_proj"],
            q,
            lats,
            ropes,
            q_dim=m.q,
            rope_dim=m.r,
            v_dim=m.v,
            scale=scale,
        )

    def moe(self, li: int, x: np.ndarray) -> np.ndarray:
        m, layer = self.model.dims, self.model.layers[li]
        idx, wts = _route(x, layer["router"], m.top_k)
        out = np.zeros_like(x)
        for t in range(x.shape[0]):  # one expert group per token, as the engine does
            rows = np.repeat(x[t : t + 1], m.top_k, axis=0)
            if self.w is not None:
                y = self.w.expert_group(
                    experts=[self.handles[li]["experts"][e] for e in idx[t]],
                    rows=[1] * m.top_k,
                    x=rows,
                )
            else:
                y = ref.expert_group([layer["experts"][e] for e in idx[t]], [1] * m.top_k, rows)
            out[t] = (wts[t][:, None] * y).sum(axis=0)
        return out

    def close(self) -> None:
        if self.w is None:
            return
        for h in self.handles:
            for t in [h["kv_b"], h["o_proj"], *[x for e in h["experts"] for x in e]]:
                self.w.free(t)
        for sid in (1, 2):
            self.w.free_sequence(sid)


TOLERANCE = 1e-4  # per call, max |worker - reference| / max |reference|


class Checked:
    """The worker's loop, each call also run on the reference with the same inputs.
    Keeps the worst relative difference seen and the call it came from."""

    def __init__(self, remote: Backend, reference: Backend) -> None:
        self.remote, self.reference = remote, reference
        self.checks = 0  # results compared: one attention and one MoE per layer and step
        self.worst, self.worst_call = 0.0, ""
        self.step = 0

    def _check(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        self.checks += 1
        scale = float(np.max(np.abs(want)))
        err = float(np.max(np.abs(got.astype(np.float64) - want)))
        rel = err / scale if scale > 0 else err
        if not np.all(np.isfinite(got)):
            rel = float("inf")
        if rel > self.worst or not self.worst_call:
            self.worst, self.worst_call = rel, f"step {self.step}, {what}"

    def attention(self, li: int, q: np.ndarray, seqs: list[tuple[int, int, np.ndarray]]):
        got = self.remote.attention(li, q, seqs)
        self._check(f"layer {li} attention", got, self.reference.attention(li, q, seqs))
        return got

    def moe(self, li: int, x: np.ndarray) -> np.ndarray:
        got = self.remote.moe(li, x)
        self._check(f"layer {li} MoE", got, self.reference.moe(li, x))
        return got


def decode(model: Model, be: Backend | Checked, x0: np.ndarray, tokens: int) -> np.ndarray:
    """Decode two sequences for ``tokens`` steps; at step tokens//2 sequence 2 rolls back."""
    m = model.dims
    x = x0.copy()
    pos = [0, 0]
    outs = []
    for step in range(tokens):
        if isinstance(be, Checked):
            be.step = step
        if step == tokens // 2 and step > 0:
            pos[1] -= 1  # sequence 2 rejects its last token and decodes the position again
        h = x
        for li, layer in enumerate(model.layers):
            hn = _norm(h)
            q = (hn @ layer["wq"]).reshape(2, m.heads, m.q + m.r).astype(np.float32)
            kv = (hn @ layer["wkv"]).astype(np.float32)
            h = h + be.attention(li, q, [(1, pos[0], kv[0]), (2, pos[1], kv[1])])
            h = h + be.moe(li, _norm(h))
        pos = [p + 1 for p in pos]
        outs.append(h)
        x = _norm(h)
    return np.stack(outs)


@dataclass
class Outcome:
    """What one demo run found: the worst per-call difference and where."""

    seed: int
    checks: int
    worst: float
    worst_call: str

    @property
    def ok(self) -> bool:
        return self.worst < TOLERANCE


def run_checked(
    worker: WorkerClient, layers: int = 3, tokens: int = 6, seed: int | None = None
) -> tuple[Outcome, dict[str, float]]:
    """Run the loop on ``worker``, every call checked against the reference. Returns the
    outcome and timings (upload_s, decode_s: the offloaded loop with its checks)."""
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = np.random.default_rng(seed)
    model = Model(rng, Dims(), layers)
    x0 = rng.standard_normal((2, model.dims.d)).astype(np.float32)
    t0 = time.perf_counter()
    remote = Backend(model, worker)
    t1 = time.perf_counter()
    try:
        checked = Checked(remote, Backend(model, None))
        decode(model, checked, x0, tokens)
        t2 = time.perf_counter()
    finally:
        remote.close()
    outcome = Outcome(seed, checked.checks, checked.worst, checked.worst_call)
    return outcome, {"upload_s": t1 - t0, "decode_s": t2 - t1}


def run_demo(
    address: str,
    layers: int = 3,
    tokens: int = 6,
    seed: int | None = None,
    **client_options: object,
) -> int:
    """Run the loop against the worker at ``address``; 0 when every call matches NumPy.
    ``client_options`` go to WorkerClient (token=, tls=)."""
    try:
        with WorkerClient(address, timeout=60, progress=False, **client_options) as w:  # type: ignore[arg-type]
            info = w.info()
            print(f"worker {address}: coliworker {info.version}, backend {info.backend}")
            outcome, t = run_checked(w, layers=layers, tokens=tokens, seed=seed)
    except WorkerError as exc:
        print(f"demo: {address}: {exc}", file=sys.stderr)
        return 1
    offloaded = tokens * (layers * (2 + 1))  # per layer: 2 expert groups + 1 attention
    print(
        f"seed {outcome.seed}: {layers} layers x {tokens} tokens x 2 sequences; uploaded "
        f"{layers * (3 * Dims().experts + 2)} tensors in {t['upload_s']:.2f} s; decoded with "
        f"{offloaded} offloaded calls in {t['decode_s']:.2f} s (with the local checks)"
    )
    verdict = "OK" if outcome.ok else f"MISMATCH (tolerance {TOLERANCE:.0e})"
    print(
        f"every offloaded result checked against NumPy on the same inputs: worst relative "
        f"difference {outcome.worst:.2e} at {outcome.worst_call} ({verdict})"
    )
    return 0 if outcome.ok else 1
