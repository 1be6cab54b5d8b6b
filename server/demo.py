"""A small GLM-style decode loop offloaded to a worker, checked against NumPy.

Random weights, GLM-5.x structure cut down: each layer is MLA attention over a
worker-resident ragged KV cache (two sequences decoded together) followed by a routed MoE
(top-k of E int4 experts, one expert group call per layer). The same loop runs locally on
the float64 reference; the two must agree to float32 rounding. Halfway through, one
sequence rolls back a token and re-decodes it, as a speculative-decoding engine would.
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


def decode(model: Model, be: Backend, x0: np.ndarray, tokens: int) -> np.ndarray:
    """Decode two sequences for ``tokens`` steps; at step tokens//2 sequence 2 rolls back."""
    m = model.dims
    x = x0.copy()
    pos = [0, 0]
    outs = []
    for step in range(tokens):
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


def run_demo(
    address: str,
    layers: int = 3,
    tokens: int = 6,
    seed: int | None = None,
    **client_options: object,
) -> int:
    """Run the loop against the worker at ``address``; 0 when it matches NumPy.
    ``client_options`` go to WorkerClient (token=, tls=)."""
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = np.random.default_rng(seed)
    model = Model(rng, Dims(), layers)
    x0 = rng.standard_normal((2, model.dims.d)).astype(np.float32)
    try:
        with WorkerClient(address, timeout=60, progress=False, **client_options) as w:  # type: ignore[arg-type]
            info = w.info()
            print(f"worker {address}: coliworker {info.version}, backend {info.backend}")
            t0 = time.perf_counter()
            remote = Backend(model, w)
            t1 = time.perf_counter()
            got = decode(model, remote, x0, tokens)
            t2 = time.perf_counter()
            remote.close()
    except WorkerError as exc:
        print(f"demo: {address}: {exc}", file=sys.stderr)
        return 1
    want = decode(model, Backend(model, None), x0, tokens)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    calls = tokens * layers * 3
    print(
        f"seed {seed}: {layers} layers x {tokens} tokens x 2 sequences; uploaded "
        f"{layers * (3 * model.dims.experts + 2)} tensors in {t1 - t0:.2f} s; decoded with "
        f"{calls} offloaded calls in {t2 - t1:.2f} s ({(t2 - t1) / calls * 1e3:.2f} ms/call)"
    )
    ok = err < 1e-4
    print(
        f"max relative difference from the local NumPy loop: {err:.2e} "
        f"({'OK' if ok else 'MISMATCH'})"
    )
    return 0 if ok else 1
