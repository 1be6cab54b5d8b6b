"""``coliworker demo``: no false alarms on a correct worker, a wrong one caught.

The demo used to compare two free-running decode loops, whose feedback amplified a 1-ulp
difference past its threshold on about one seed in eight (seed 2728839884 among them). It
now checks every offloaded call against the reference on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from coliworker.client import WorkerClient
from coliworker.server.app import build_server
from coliworker.server.backend import Result
from coliworker.server.backend_numpy import NumpyBackend
from coliworker.server.config import Config
from coliworker.tools.demo import TOLERANCE, run_checked, run_demo


def serve(backend=None):
    return build_server(Config(port=0, backend="numpy", metrics_port=None), backend).start()


@pytest.fixture(scope="module")
def worker():
    srv = serve()
    try:
        yield srv
    finally:
        srv.stop(None)


def test_no_false_alarm_in_50_seeded_runs(worker) -> None:
    # One layer keeps the test short (uploads dominate); the six tokens of feedback that
    # amplified the old false alarms are all there. The default three layers: the next test.
    seeds = [2728839884, *range(1, 50)]  # the seed that used to fail, then 49 more
    worst = []
    with WorkerClient(worker.address, timeout=60, progress=False) as w:
        for seed in seeds:
            outcome, _ = run_checked(w, layers=1, tokens=6, seed=seed)
            assert outcome.checks == 6 * 2  # an attention and a MoE per layer and token
            worst.append(outcome.worst)
    failed = [(s, e) for s, e in zip(seeds, worst, strict=True) if e >= TOLERANCE]
    assert not failed, f"false alarms (seed, worst relative difference): {failed}"
    assert max(worst) < TOLERANCE / 100, max(worst)  # float32 rounding, far below the bar


def test_the_seed_that_used_to_fail_passes_the_default_demo(worker, capsys) -> None:
    assert run_demo(worker.address, seed=2728839884) == 0
    out = capsys.readouterr().out
    assert "seed 2728839884: 3 layers x 6 tokens" in out and "(OK)" in out


class Perturbed(NumpyBackend):
    """The NumPy backend with one deliberate error in one operation."""

    def __init__(self, op: str, relative: float) -> None:
        super().__init__(devices=(0,))
        self.op, self.relative = op, relative

    def _perturb(self, result: Result) -> Result:
        out = np.array(result.out, dtype=np.float32, copy=True)
        flat = out.reshape(-1)
        k = int(np.argmax(np.abs(flat)))
        flat[k] += self.relative * abs(flat[k])  # one element, off by `relative`
        return Result(out, result.phases, result.wall_ns)

    def expert_group(self, *args, **kwargs) -> Result:
        result = super().expert_group(*args, **kwargs)
        return self._perturb(result) if self.op == "expert_group" else result

    def attention_ragged(self, *args, **kwargs) -> Result:
        result = super().attention_ragged(*args, **kwargs)
        return self._perturb(result) if self.op == "attention_ragged" else result


@pytest.mark.parametrize("op,what", [("expert_group", "MoE"), ("attention_ragged", "attention")])
def test_a_perturbed_backend_is_caught(op, what, capsys) -> None:
    srv = serve(Perturbed(op, relative=10 * TOLERANCE))
    try:
        assert run_demo(srv.address, layers=2, tokens=4, seed=7) == 1
    finally:
        srv.stop(None)
    out = capsys.readouterr().out
    assert "MISMATCH" in out and what in out, out
    # The reported difference is the perturbation (an element off by 1e-3 of itself).
    reported = float(out.split("worst relative difference ")[1].split()[0])
    assert 0.5 * 10 * TOLERANCE <= reported <= 2 * 10 * TOLERANCE, out


def test_a_correct_backend_wrapped_the_same_way_passes(capsys) -> None:
    srv = serve(Perturbed("expert_group", relative=0.0))  # the wrapper alone changes nothing
    try:
        assert run_demo(srv.address, layers=2, tokens=4, seed=7) == 0
    finally:
        srv.stop(None)
    assert "(OK)" in capsys.readouterr().out
