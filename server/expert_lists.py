"""The expert lists of the expert group calls, resolved and checked against the resident
tensors and kept: ``ExpertLists._experts`` turns a request's ``experts`` into the resident
(gate, up, down) triples, their device and hidden size, through two per-servicer caches
keyed as ``server/fastpath.c`` keys them too (``_expert_run``): the whole list, and each
expert (a router's new list of known experts is answered triple by triple).

``ExpertLists`` is mixed into ``ComputeOps`` (``server/compute.py``), whose handlers call it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import Any

from coliworker.server import validate
from coliworker.server.config import Config
from coliworker.server.errors import InvalidArgument, ResourceExhausted
from coliworker.server.store import Handle, TensorStore
from coliworker.wire.codec import INLINE, ArrayIO

#: Validated expert lists kept per servicer (cleared when full).
_EXPERT_CACHE = 4096

#: Validated expert triples kept per servicer (cleared when full): enough for every expert
#: of a large MoE model (GLM-5.x: 256 per layer, some 19k in all) for a few owners, so that
#: decode, whose routers send a new list of 8 nearly every call, finds its triples here.
_TRIPLE_CACHE = 1 << 16


#: An expert's (gate, up, down) handle ids, read in C (``_experts``' key, one per expert).
_HANDLES = operator.attrgetter("gate", "up", "down")


def _expert_run(blob: bytes, n: int) -> int:
    """The length of each of the ``n`` serialized experts that ``blob``, a serialized
    expert group request, starts with (its field 1, which protobuf writes first, in
    order), where all are of one length (each a 0x0A tag, a one-byte length and the three
    handle ids: 32 bytes when every id has its top 7 bits set); else 0. Checked by two
    strided slices: where the first entry is ``size`` bytes and every ``size``-th byte
    from 0 is a tag and the next a length of ``size - 2``, each entry starts where the
    one before ends. Equal bytes are equal handle ids: an entry is the cache key of its
    triple, and the run that of the list."""
    if len(blob) < 2 or blob[1] >= 0x80:
        return 0
    size = blob[1] + 2
    end = size * n
    if blob[0:end:size] != b"\n" * n or blob[1:end:size] != bytes((size - 2,)) * n:
        return 0
    return size


class Experts(list):
    """The resident (gate, up, down) triples of a checked expert list, and their handle
    ids (``ids``: what the usage counts are kept by). Made as ``Experts()`` and ``ids`` set
    after: no Python ``__init__`` on the hot path (a third of its cost)."""

    __slots__ = ("ids",)
    ids: tuple


class ExpertLists:
    """Resolving and keeping expert lists (see the module docstring)."""

    config: Config
    store: TensorStore
    _expert_cache: dict[tuple, tuple[int, Experts, int, int]]
    # (owner, (gate, up, down) handle ids, or the expert's bytes in the request) -> (store
    # generation, resident triple, device, D, the handle ids)
    _triple_cache: dict[
        tuple[str, tuple[int, int, int] | bytes],
        tuple[int, tuple[Any, Any, Any], int, int, tuple[int, int, int]],
    ]

    _tensor: Callable[[int, str, str], Handle]  # (ComputeOps's: a handle of this owner)

    def _experts(
        self, request: Any, op: str, owner: str, io: ArrayIO = INLINE
    ) -> tuple[Experts, int, int]:
        """Resolve and check ``request.experts``; returns (resident triples, device, D).

        A list this owner sent before, while the store's generation has not moved (no
        handle freed or updated since), is answered from the list cache. Otherwise each
        triple is answered from the per-triple cache, or resolved and checked as its index
        of the list would be (``_triple``: the same errors), and the list is checked across
        its triples (one D, one device); where that fails, the whole list goes through
        ``_experts_checked`` for the error it has always raised. The generation is read
        before any lookup: a free racing with the lookups leaves what they made stale.

        A call whose arrays are outside it (``io.source``: the request holds no large
        bytes) finds its list and triples by their bytes in the request serialized
        (``_expert_run``: one C call, ~9k instructions for 8 experts, where reading the 24
        handle fields costs ~28k), and reads the fields of a triple only when its entry is
        not cached."""
        experts = request.experts
        n = len(experts)
        if not 1 <= n <= self.config.max_experts:
            raise (InvalidArgument if n == 0 else ResourceExhausted)(
                f"{op}.experts: expected 1..{self.config.max_experts} experts, got {n}"
            )
        blob = request.SerializeToString() if io.source is not None else b""
        size = _expert_run(blob, n)
        gud: list[tuple[int, int, int]] | None = None  # (read only for a triple not cached)
        if size:
            end = size * n
            key: tuple = (owner, blob[:end])  # (owner, the experts' bytes)
        else:
            gud = list(map(_HANDLES, experts[:]))  # [:]: one list, no iteration of the
            # repeated field to its IndexError; the list's key is flat (owner, g0, u0, d0,
            # g1, ...): one tuple to hash and keep, not one per expert
            key = (owner, *itertools.chain.from_iterable(gud))
        gen = self.store.generation
        hit = self._expert_cache.get(key)
        if hit is not None and hit[0] == gen:
            return hit[1], hit[2], hit[3]
        if gud is None:
            keys: list[tuple[str, tuple[int, int, int] | bytes]] = [
                (owner, blob[i : i + size]) for i in range(0, end, size)
            ]
        else:
            keys = [(owner, t) for t in gud]
        cache = self._triple_cache
        triples, dim, device, ids = Experts(), 0, 0, []
        for c, tk in enumerate(keys):
            th = cache.get(tk)
            if th is None or th[0] != gen:
                t = gud[c] if gud is not None else _HANDLES(experts[c])
                th = self._triple(t, c, op, owner, gen)
                if th is None:  # its gate, up and down on more than one device
                    return self._experts_checked(experts, key, gen, op, owner)
                if len(cache) >= _TRIPLE_CACHE:
                    cache.clear()
                cache[tk] = th
            if c == 0:
                device, dim = th[2], th[3]
            elif th[3] != dim or th[2] != device:
                return self._experts_checked(experts, key, gen, op, owner)
            triples.append(th[1])
            ids.append(th[4])
        # the handle ids, in request order, as the triples' cache entries hold them: the
        # same tuple objects call after call (the usage fold finds them by identity), and
        # none made by this call kept
        triples.ids = tuple(ids)
        if len(self._expert_cache) >= _EXPERT_CACHE:
            self._expert_cache.clear()
        self._expert_cache[key] = (gen, triples, device, dim)
        return triples, device, dim

    def _triple(
        self, ids: tuple[int, int, int], c: int, op: str, owner: str, gen: int
    ) -> tuple[int, tuple[Any, Any, Any], int, int, tuple[int, int, int]] | None:
        """``experts[c]`` (handle ids ``ids``) resolved and checked as ``_experts_checked``
        does it (the same errors): its per-triple cache entry (``gen``, resident triple,
        device, D, ``ids``), or None where its three tensors are not on one device."""
        f = f"{op}.experts[{c}]"
        g = self._tensor(ids[0], f"{f}.gate", owner)
        u = self._tensor(ids[1], f"{f}.up", owner)
        d = self._tensor(ids[2], f"{f}.down", owner)
        dim, _ = validate.mlp(g, u, d, f)
        device = g.spec.device
        if u.spec.device != device or d.spec.device != device:
            return None
        return gen, (g.data.resident, u.data.resident, d.data.resident), device, dim, ids

    def _experts_checked(
        self, experts, key: tuple, gen: int, op: str, owner: str
    ) -> tuple[Experts, int, int]:
        """``_experts`` without the per-triple cache: every handle looked up and every check
        made in turn, so an error is the first the list has, in its words (``key``: the
        list's cache key)."""
        triples, named, dim, ids = Experts(), [], None, []
        for c, e in enumerate(experts):
            f = f"{op}.experts[{c}]"
            t = _HANDLES(e)
            ids.append(t)
            g = self._tensor(t[0], f"{f}.gate", owner)
            u = self._tensor(t[1], f"{f}.up", owner)
            d = self._tensor(t[2], f"{f}.down", owner)
            dc, _ = validate.mlp(g, u, d, f)
            if dim is None:
                dim = dc
            elif dc != dim:
                raise InvalidArgument(
                    f"{f}.gate.in_features: expected {dim} (hidden size of experts[0]), got {dc}"
                )
            named += [(f"{f}.gate", g), (f"{f}.up", u), (f"{f}.down", d)]
            triples.append((g.data.resident, u.data.resident, d.data.resident))
        device = validate.same_device(named, op)
        assert dim is not None
        triples.ids = tuple(ids)
        if len(self._expert_cache) >= _EXPERT_CACHE:
            self._expert_cache.clear()
        self._expert_cache[key] = (gen, triples, device, dim)
        return triples, device, dim
