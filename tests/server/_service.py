"""What the worker's RPC tests (test_service.py, test_service_errors.py) share: experts and MLA
weights made and uploaded and a device's stats, beside the random tensors, their upload and the
error measure of tests/_tensors.py (re-exported here)."""

from __future__ import annotations

from _tensors import TOL, host_arrays, random_tensor, rel_err, upload

__all__ = ["TOL", "device_stats", "host_arrays", "make_expert", "mla", "random_tensor", "rel_err",
           "upload"]  # fmt: skip


def device_stats(w, device=0):
    return next(d for d in w.stats() if d.device == device)


def make_expert(w, rng, d, ie, fmts=(2, 2, 2), gs=0, device=0):
    g = random_tensor(rng, fmts[0], d, ie, gs if fmts[0] == 4 else 0)
    u = random_tensor(rng, fmts[1], d, ie, gs if fmts[1] == 4 else 0)
    dn = random_tensor(rng, fmts[2], ie, d, gs if fmts[2] == 4 else 0)
    hosts = (g, u, dn)
    return hosts, tuple(upload(w, t, device) for t in hosts)


def mla(w, rng, heads=3, q=8, r=4, v=6, k=10, d_out=7, fmt=2):
    kv_b = random_tensor(rng, fmt, k, heads * (q + v))
    o_proj = random_tensor(rng, 1, heads * v, d_out)
    return (kv_b, o_proj), (upload(w, kv_b), upload(w, o_proj)), dict(q_dim=q, rope_dim=r, v_dim=v)
