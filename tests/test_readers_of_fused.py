"""An update whose gradient is computed from another update's *new* values (``g2 = 2*w1_new``) is fused or
refused with a reason, never dropped in silence.

Read through the first update's nodes, the second one's gradient mixes the first one's state; the matcher
dropped it as "a reader of a fused update" (the rule for ``delta = lr*buf_out``): the report said "refused 0"
and one SGD node was written where the graph holds two updates. After the rewrite the first update's new
values are an SGD node's outputs, which the second update's gradient reads like any computed value
(``sgd_match._solve_readers_of_fused``). The graphs are ``tests/hunt_graphs.py``'s :func:`reads_fused_update`;
the expected numbers come from numpy (``torch.optim.SGD``'s step, :func:`_reference`), never from sgdfuse.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import sgdfuse
from hunt_graphs import DAMPENING, LR, MOMENTUM, reads_fused_update
from sgdfuse.runtime import make_session, run
from sgdfuse.verify import check_models

SHAPE = (4, 3)
STEPS = 3


def _gradient_of(form: str, new_p: np.ndarray, new_b: np.ndarray) -> np.ndarray:
    """The next update's gradient as :func:`reads_fused_update`'s docstring defines it."""
    return {"twice_new_weights": 2 * new_p, "new_weights_times_c": 0.5 * new_p, "twice_new_buffer": 2 * new_b}[form]


def _reference(form: str, chain: int, state: dict, g0: np.ndarray, step: int) -> dict:
    """One step of ``chain`` ``torch.optim.SGD`` updates (momentum 0.9, dampening 0.25, lr 0.1; the first step
    ``buf = g``) in float64, update i + 1's gradient computed from update i's new values."""
    out, grad = {}, np.asarray(g0, np.float64)
    for i in range(chain):
        p, b = (np.asarray(state[f"{kind}{i}"], np.float64) for kind in "pb")
        new_b = grad.copy() if step == 0 else MOMENTUM * b + (1 - DAMPENING) * grad
        new_p = p - LR * new_b
        out[f"p{i}"], out[f"b{i}"] = new_p, new_b
        grad = _gradient_of(form, new_p, new_b)
    return out


def _chained(model: onnx.ModelProto, chain: int, state: dict, gradients: list) -> list[dict]:
    """``model`` run for ``len(gradients)`` steps; its outputs are (p_new, b_new) per update, fed back."""
    session = make_session(model)
    names = [o.name for o in model.graph.output]
    results = []
    for step, g0 in enumerate(gradients):
        got = run(session, {**state, "g0": g0, "step": np.array(step, np.int64)})
        state = {f"{kind}{i}": got[names[2 * i + j]] for i in range(chain) for j, kind in enumerate("pb")}
        results.append(state)
    return results


@pytest.mark.parametrize("form", ["twice_new_weights", "new_weights_times_c", "twice_new_buffer"])
@pytest.mark.parametrize("chain", [2, 3])
def test_an_update_whose_gradient_reads_another_updates_new_values_fuses_and_computes_torch_sgd(form, chain):
    model = reads_fused_update(form, chain=chain)
    result = sgdfuse.optimize(model)
    report = result.report
    assert not report.refused, report.refused
    assert sorted(f.parameters for f in report.fused) == [f"p{i}" for i in range(chain)], report.fused
    assert report.verification.passed and all(u["passed"] for u in report.verification.updates)
    assert sum(n.op_type == "SGD" for n in result.model.graph.node) == chain
    onnx.checker.check_model(result.model, full_check=True)  # also: every value defined before it is read
    rng = np.random.default_rng(3)
    state = {f"{kind}{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(chain) for kind in "pb"}
    gradients = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(STEPS)]
    expected, current = [], state
    for step, g0 in enumerate(gradients):
        current = _reference(form, chain, current, g0, step)
        expected.append(current)
    for which, m in (("original", model), ("fused", result.model)):
        for step, (got, want) in enumerate(zip(_chained(m, chain, state, gradients), expected)):
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6, err_msg=f"{which} {key} at step {step}")
    assert check_models(model, result.model).passed


def test_an_update_without_a_first_step_reading_new_weights_fuses():
    # The simpler form (no Where): the second buffer is 0.9*b1 + 0.75*(2*p0_new).
    model = reads_fused_update("twice_new_weights", first_step=False)
    result = sgdfuse.optimize(model)
    assert not result.report.refused and len(result.report.fused) == 2, result.report
    assert result.report.verification.passed
    assert check_models(model, result.model).passed


@pytest.mark.parametrize("form", ["twice_new_weights", "new_weights_plus_input"])
def test_a_reader_of_new_weights_that_is_not_momentum_sgd_is_refused_with_a_reason(form):
    # Decoupled weight decay on the second update (p1 - lr*buf - 0.01*p1), or a gradient 2*p0_new + h1 that
    # weighs two tensors differently: not the contract's update; it must be in the refusals, by name.
    model = reads_fused_update(form, decoupled_decay=form == "twice_new_weights")
    report = sgdfuse.inspect(model)
    assert [f.parameters for f in report.fused] == ["p0"], report.fused
    second = model.graph.output[2].name
    assert [r.candidate for r in report.refused] == [second], report.refused
    assert report.refused[0].reason in ("extra-term", "gradient-mixes-tensors", "computed-state") and report.refused[0].detail


def test_an_output_scaling_a_fused_updates_new_buffer_is_still_a_reader_not_a_refusal():
    # delta = lr*buf_new beside the update is no update of its own: solved again with the fused update's
    # outputs opaque, it is one leaf, so it stays out of the refusals (as before).
    from onnx import helper

    from graphs import momentum_sgd, value

    model = momentum_sgd(extra_nodes=[helper.make_node("Mul", ["buf_out", "lr"], ["delta"], name="delta")],
                         extra_outputs=[value("delta")])
    report = sgdfuse.inspect(model)
    assert len(report.fused) == 1 and not report.refused, report
