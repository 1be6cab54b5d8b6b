"""Where each call of a ``WorkerPool`` runs: which of its arguments are tensors, routed by
``WorkerPool._route`` (every tensor of a call on one member, or the call is refused naming
both) and ``_experts`` (expert lists, their routing kept), and the call's arguments as that
member's. ``WorkerPool``'s calls (``on_client``: on the member's client) and
``PoolSession``'s (``on_session``: on the member's session) both route through ``ROUTES``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: route(pool, *args, **kwargs) -> (member, args, kwargs) for the member's own call
Route = Callable[..., tuple[Any, tuple, dict]]


def _matmul(pool: Any, t: Any, x: Any) -> tuple[Any, tuple, dict]:
    m, (h,) = pool._route("matmul", [("handle", t)])
    return m, (h, x), {}


def _expert_mlp(pool: Any, gate: Any, up: Any, down: Any, x: Any) -> tuple[Any, tuple, dict]:
    m, (g, u, d) = pool._route("expert_mlp", [("gate", gate), ("up", up), ("down", down)])
    return m, (g, u, d, x), {}


def _group(op: str) -> Route:
    """An expert group (packed, routed or issued): its first argument is the expert list."""

    def route(pool: Any, experts: Any, *rest: Any, **kw: Any) -> tuple[Any, tuple, dict]:
        m, e = pool._experts(op, experts)
        return m, (e, *rest), kw

    return route


def _attention(
    pool: Any, kv_b: Any, q: Any, latent: Any, rope: Any, *, o_proj: Any = None, **dims: Any
) -> tuple[Any, tuple, dict]:
    m, (k, o) = pool._route("attention", [("kv_b", kv_b), ("o_proj", o_proj)])
    return m, (k, q, latent, rope), {"o_proj": o, **dims}


def _attention_ragged(
    pool: Any, kv_b: Any, o_proj: Any, q: Any, **kw: Any
) -> tuple[Any, tuple, dict]:
    m, (k, o) = pool._route("attention_ragged", [("kv_b", kv_b), ("o_proj", o_proj)])
    return m, (k, o, q), kw


ROUTES: dict[str, Route] = {
    "matmul": _matmul,
    "expert_mlp": _expert_mlp,
    "expert_group": _group("expert_group"),
    "expert_group_async": _group("expert_group"),
    "expert_group_routed": _group("expert_group_routed"),
    "attention": _attention,
    "attention_ragged": _attention_ragged,
}


def on_client(name: str) -> Any:
    """``WorkerPool``'s call ``name``: routed, then ``WorkerClient.<name>`` on that member
    (``WorkerPool._run``: a failure tells the pool the member may be down)."""
    route = ROUTES[name]

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        m, a, k = route(self, *args, **kwargs)
        return self._run(m, lambda: getattr(m.client, name)(*a, **k))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``WorkerClient.{name}`` on the member that holds the call's tensors."
    return method


def on_session(name: str) -> Any:
    """``PoolSession``'s call ``name``: routed as the pool routes it, then sent on that
    member's session (``PoolSession._go``)."""
    route = ROUTES[name]

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        m, a, k = route(self._pool, *args, **kwargs)
        return self._go(m, lambda s: getattr(s, name)(*a, **k))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``Session.{name}`` on the member that holds the call's tensors."
    return method


__all__ = ["ROUTES", "Route", "on_client", "on_session"]
