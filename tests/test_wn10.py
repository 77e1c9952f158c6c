"""wn10's hunt on this session's matcher changes (gradient scaling, new refusals, guarded readers): two
torch-SGD programs that are refused although they are momentum SGD, written as dynamo would export them.

The first (B's new buffer reads A's new weights with coefficient 1) was refused as ``state-stepped-twice`` and
fuses now; the second (B reads A's guarded weights) is a strict xfail until the matcher fuses it. Expected numbers are torch.optim.SGD's
documented formula in float64 numpy (``buf = m*buf + (1-d)*g``, ``p = p - lr*buf``), never the graphs'.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import sgdfuse
from hunt_graphs import F32, Exported
from sgdfuse.runtime import make_session, run

SHAPE = (4, 3)
M, LR = 0.9, 0.1


def _chained_coefficient_one(dampening: float, factor: float) -> onnx.ModelProto:
    """Update A (``p0, b0, g0``) then update B whose gradient is ``factor * p0_new``, both with ``dampening``;
    with ``(1 - d) * factor == 1`` B's buffer reads A's new weights with coefficient 1. Outputs p0', b0', p1', b1'."""
    b = Exported()
    p0, p1, b0, b1, g0 = (b.input(name, F32, SHAPE) for name in ("p0", "p1", "b0", "b1", "g0"))
    new_b0 = b.momentum(b0, g0, one_minus_d=1 - dampening)
    new_p0 = b.step(p0, new_b0)
    new_b1 = b.momentum(b1, b.op("Mul", [new_p0, b.const(factor)], "mul"), one_minus_d=1 - dampening)
    return b.model([(o, SHAPE) for o in (new_p0, new_b0, b.step(p1, new_b1), new_b1)])


def _reads_guarded_weights() -> onnx.ModelProto:
    """Two loss-scaled updates (dampening 0.25), both states of each guarded by ``Where(found_inf, old, new)``;
    B's gradient is ``2 * Where(found_inf, p0, p0_new)``, A's weights as the step leaves them. Outputs: the
    guarded p0', b0', p1', b1'."""
    b = Exported()
    p0, p1, b0, b1, g0 = (b.input(name, F32, SHAPE) for name in ("p0", "p1", "b0", "b1", "g0"))
    found_inf = b.input("found_inf", TensorProto.BOOL)
    guard = lambda old, new: b.op("Where", [found_inf, old, new], "where")  # noqa: E731
    new_b0 = b.momentum(b0, g0)
    out_p0, out_b0 = guard(p0, b.step(p0, new_b0)), guard(b0, new_b0)
    new_b1 = b.momentum(b1, b.op("Mul", [out_p0, b.const(2.0)], "mul"))
    return b.model([(o, SHAPE) for o in (out_p0, out_b0, guard(p1, b.step(p1, new_b1)), guard(b1, new_b1))])


def _run_steps(model: onnx.ModelProto, state: dict, feeds_per_step: list) -> list[dict]:
    session, names = make_session(model), [o.name for o in model.graph.output]
    results = []
    for feeds in feeds_per_step:
        got = run(session, {**state, **feeds})
        state = dict(zip(("p0", "b0", "p1", "b1"), (got[n] for n in names)))
        results.append(state)
    return results


@pytest.mark.parametrize("dampening, factor", [(0.5, 2.0), (0.0, 1.0)])
def test_a_chained_update_whose_gradient_term_reads_new_weights_with_coefficient_one_fuses(dampening, factor):
    # B's new buffer 0.9*b1 + (1-d)*k*p0_new holds p0_new with coefficient 1: it fuses as B's buffer, not as a
    # second step of p0 (state-stepped-twice refused both before).
    model = _chained_coefficient_one(dampening, factor)
    result = sgdfuse.optimize(model)
    assert sorted(f.parameters for f in result.report.fused) == ["p0", "p1"], result.report.refused
    assert result.report.verification.passed
    rng = np.random.default_rng(7)
    state = {k: rng.standard_normal(SHAPE).astype(np.float32) for k in ("p0", "b0", "p1", "b1")}
    steps = [{"g0": rng.standard_normal(SHAPE).astype(np.float32)} for _ in range(4)]
    want = {k: v.astype(np.float64) for k, v in state.items()}
    for feeds, got in zip(steps, _run_steps(result.model, state, steps)):
        want["b0"] = M * want["b0"] + (1 - dampening) * feeds["g0"]
        want["p0"] = want["p0"] - LR * want["b0"]
        want["b1"] = M * want["b1"] + (1 - dampening) * factor * want["p0"]
        want["p1"] = want["p1"] - LR * want["b1"]
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6, err_msg=key)


def test_the_refusal_of_a_guard_read_on_names_its_reader():
    # Until it fuses (the xfail below), the refusal says what stops it: the guarded weights feed B's Mul.
    # It said "not one boolean keeping the old state on one side", which the guard is.
    result = sgdfuse.optimize(_reads_guarded_weights(), verify=False)
    refusal = next(r for r in result.report.refused if r.reason == "guarded-update")
    assert "not one boolean" not in refusal.detail, refusal.detail
    assert "node_mul" in refusal.detail and "read by nothing but copies" in refusal.detail, refusal.detail


@pytest.mark.xfail(strict=True, reason="wn10: A is refused guarded-update: _guard takes a Where only on the final state, and B's Mul reads A's guarded weights")
def test_an_update_reading_a_guarded_updates_kept_weights_fuses_both():
    model = _reads_guarded_weights()
    result = sgdfuse.optimize(model)
    assert sorted(f.parameters for f in result.report.fused) == ["p0", "p1"], result.report.refused
    assert result.report.verification.passed
    rng = np.random.default_rng(8)
    state = {k: rng.standard_normal(SHAPE).astype(np.float32) for k in ("p0", "b0", "p1", "b1")}
    steps = [{"g0": rng.standard_normal(SHAPE).astype(np.float32), "found_inf": np.array(s % 3 == 1)} for s in range(4)]
    want = {k: v.astype(np.float64) for k, v in state.items()}
    for feeds, got in zip(steps, _run_steps(result.model, state, steps)):
        if not feeds["found_inf"]:  # GradScaler skips both updates on an overflow step
            want["b0"] = M * want["b0"] + 0.75 * feeds["g0"]
            want["p0"] = want["p0"] - LR * want["b0"]
            want["b1"] = M * want["b1"] + 0.75 * 2 * want["p0"]
            want["p1"] = want["p1"] - LR * want["b1"]
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6, err_msg=key)
