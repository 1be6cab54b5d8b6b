"""The placement helper's properties (budgets respected, the most frequent experts placed
first, no thrashing on a stable trace, affinity, hit rate), rebalance on a pool (uploads
before frees: every call between sees a resident expert), and a pool named by one DNS name
re-resolved when a member fails."""

from __future__ import annotations

import numpy as np
import pytest
from _rel import TOL, WorkerProcess, random_tensor, rel_err, running
from test_pool_calls import item

from coliworker.client import Unavailable, WorkerPool, placement
from coliworker.kernels import reference as ref

SIZE = 100


def zipf(rng, layers: int, experts: int) -> dict:
    """Routed rows per (layer, expert): a Zipf-like popularity, shuffled per layer."""
    w = 1000.0 / np.arange(1, experts + 1) ** 1.1
    out = {}
    for layer in range(layers):
        for e, c in enumerate(rng.permutation(w)):
            out[(layer, e)] = float(c)
    return out


def test_budgets_are_respected_and_the_most_frequent_go_first(rng) -> None:
    counts = zipf(rng, 4, 32)
    budgets = {0: 10 * SIZE, 1: 7 * SIZE + 50, 2: 0}
    plan = placement.assign(counts, budgets, SIZE)
    for d, b in budgets.items():
        assert plan.used[d] <= b and plan.used[d] == SIZE * len(plan.on(d))
    placed = {k for k, d in plan.assignment.items() if d is not None}
    assert len(placed) == 17
    ranked = sorted(counts, key=lambda k: -counts[k])
    assert placed == set(ranked[:17])
    assert plan.hit_rate == pytest.approx(sum(counts[k] for k in placed) / sum(counts.values()))
    assert plan.hit_rate == placement.hit_rate(counts, plan.assignment)


def test_sizes_per_expert_and_unrouted_experts_stay_on_the_cpu() -> None:
    counts = {"a": 10, "b": 9, "c": 0}
    plan = placement.assign(counts, [150], {"a": 100, "b": 100, "c": 10})
    assert plan.assignment == {"a": 0, "b": None, "c": None} and plan.hit_rate == 10 / 19
    with pytest.raises(ValueError, match=r"assign.budgets\[0\]: expected >= 0 bytes, got -1"):
        placement.assign(counts, [-1], 1)


def test_no_thrashing_on_a_stable_trace(rng) -> None:
    counts = zipf(rng, 3, 16)
    plan = placement.assign(counts, [8 * SIZE, 8 * SIZE], SIZE)
    again = placement.assign(counts, [8 * SIZE, 8 * SIZE], SIZE, current=plan.assignment)
    assert again.moves == () and again.assignment == plan.assignment
    for _ in range(5):  # the same distribution sampled again: noise within the hysteresis
        noisy = {k: c * rng.uniform(0.9, 1.1) for k, c in counts.items()}
        step = placement.assign(noisy, [8 * SIZE, 8 * SIZE], SIZE, current=plan.assignment)
        assert step.moves == ()
    shifted = dict(counts)
    cold = min((k for k, d in plan.assignment.items() if d is None), key=counts.get)
    shifted[cold] = 10 * max(counts.values())  # a real shift moves what it must, only that
    step = placement.assign(shifted, [8 * SIZE, 8 * SIZE], SIZE, current=plan.assignment)
    assert [m.key for m in step.moves if m.target is not None] == [cold]
    assert len(step.moves) == 2


def test_affinity_keeps_a_layer_on_one_device() -> None:
    counts = {(l, e): 10.0 - e for l in range(2) for e in range(4)}  # noqa: E741
    plan = placement.assign(counts, [4 * SIZE, 4 * SIZE], SIZE, affinity=lambda k: k[0])
    assert {plan.assignment[(0, e)] for e in range(4)} != {
        plan.assignment[(1, e)] for e in range(4)
    }
    assert all(len({plan.assignment[(l, e)] for e in range(4)}) == 1 for l in range(2))  # noqa: E741


def test_trace_counts() -> None:
    got = placement.trace_counts([(0, np.array([[1, 2], [2, 3]])), (1, np.array([[0, 2]]))])
    assert got == {(0, 1): 1, (0, 2): 2, (0, 3): 1, (1, 0): 1, (1, 2): 1}


@pytest.fixture
def two():
    yield from running([WorkerProcess(), WorkerProcess()])


def test_rebalance_moves_experts_uploads_before_frees(two, rng) -> None:
    weights = {k: tuple(random_tensor(rng, 2, i, o) for i, o in ((16, 12), (16, 12), (12, 16)))
               for k in range(6)}  # fmt: skip
    with WorkerPool([p.address for p in two]) as pool:
        experts: dict = {k: None for k in weights}
        for k in (0, 1):  # where the engine put them at first
            experts[k] = tuple(pool.upload_many([item(t, 0) for t in weights[k]]))
        seen = []

        def load(k):
            return [item(t, 0) for t in weights[k]]

        def swap(new):  # between the uploads and the frees: old and new are both resident
            for k, refs in new.items():
                if refs is not None:
                    seen.append(pool.stats()[refs[0].device].tensors)
                old = experts[k]
                experts[k] = refs
                if old is not None:
                    x = rng.standard_normal((2, 16)).astype(np.float32)
                    pool.expert_group([old], [2], x)  # still answers: not freed yet

        counts = placement.usage_counts(pool.tensor_usage(), experts)
        assert counts == {0: 0, 1: 0}
        counts = {0: 1.0, 1: 2.0, 2: 50.0, 3: 40.0, 4: 30.0, 5: 0.0}
        plan = placement.assign(counts, [2 * 3 * 128, 2 * 3 * 128], 3 * 128,
                                current=placement.current(experts))  # fmt: skip
        assert {m.key for m in plan.moves} >= {2, 3}
        pool.rebalance(plan, experts, load, swap)
        assert placement.current(experts) == plan.assignment
        for k, refs in experts.items():
            if refs is None:
                continue
            x = rng.standard_normal((3, 16)).astype(np.float32)
            want = ref.expert_group([weights[k]], [3], x)
            assert rel_err(pool.expert_group([refs], [3], x), want) < TOL
        resident = sum(s.tensors for s in pool.stats())
        assert resident == 3 * sum(1 for r in experts.values() if r is not None)
        assert seen  # swap ran while the new copies were resident


def test_one_dns_name_is_resolved_and_again_when_a_member_fails(two, rng) -> None:
    extra = WorkerProcess().start()
    try:
        answer = [two[0].address, two[1].address]
        resolver_calls = []

        def resolver(name):
            resolver_calls.append(name)
            return list(answer)

        pool = WorkerPool("coliworker.test:50051", resolver=resolver, probe_interval=0.0)
        with pool:
            assert pool.device_count == 2 and resolver_calls == ["coliworker.test:50051"]
            t = random_tensor(rng, 2, 16, 8)
            a = pool.upload_many([item(t, 1)])[0]
            two[1].kill()
            answer[1] = extra.address  # the pod came back under another address
            x = rng.standard_normal((2, 16)).astype(np.float32)
            with pytest.raises(Unavailable):
                pool.matmul(a, x)  # down (or restarted: its tensors are gone)
            assert pool.members[1].address == extra.address and len(resolver_calls) >= 2
            b = pool.upload_many([item(t, 1)])[0]
            assert rel_err(pool.matmul(b, x), ref.matmul(t, x)) < TOL
    finally:
        extra.stop()


def test_resolve_orders_addresses() -> None:
    got = placement_resolve("localhost:50051")
    assert got and all(a.endswith(":50051") for a in got)


def placement_resolve(name):
    from coliworker.client.pool import resolve

    return resolve(name)
