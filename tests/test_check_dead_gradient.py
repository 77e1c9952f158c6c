"""A gradient the random data never makes non-zero proves nothing about the gradient term of its update.

A whole model computes its gradients from what it is fed. ``g = Relu(x - 10)`` is zero for every x that
``check`` used to feed (standard normal), so the term ``(1 - d) * g`` never took part in a comparison and a
fused model reading ``-0.5 * g``, or ``2 * g``, passed ``check``. Now (docs/design.md, "Verification"):

- when an update's gradient was zero (or not finite) everywhere on every step, one more step feeds every
  input that is neither state nor a runtime coefficient wide-range values (``sgdfuse.verify.WIDE``), which
  brings ``Relu(x - 10)`` to life; elements that overflow there (FLOAT16) are left out, never failed;
- an update whose gradient is still zero everywhere (``Relu(x - 1e30)``: no FLOAT input of ``check``
  reaches 1e30) fails as never compared, naming its gradient, whatever its numbers;
- the same holds in ``optimize``'s own verification, whose slice computes the gradient when a guard of the
  update reads it (a loss-scaling skip ``Where(IsInf(ReduceSum(g)), p, p_new)``);
- a first step run again from a buffer the chain left at zero gets a random buffer, so a fused model that does
  not zero the buffer on the first step is seen.

The models are built here; the wrong fused models are made by editing the SGD node's gradient operand. Which
model is right comes from the formula (``sgdfuse.reference.sgd``, run below against onnxruntime on inputs that
make the gradient non-zero), not from the code under test.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphs import make_model, scalar, value
import sgdfuse
import sgdfuse.api as api
from sgdfuse.passes.rewrite import Planner
from sgdfuse.reference import sgd as reference_sgd
from sgdfuse.verify import check_models

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
SHAPE = [4, 3]
NEVER_COMPARED = "never compared"


def _relu_step(threshold: float, dtype: int = F32) -> onnx.ModelProto:
    """``g = Relu(x - threshold)``; ``buf_out = 0.9*buf + g``; ``p_out = p - 0.1*buf_out``; [4, 3] of ``dtype``."""
    nodes = [
        helper.make_node("Sub", ["x", "c"], ["shifted"]),
        helper.make_node("Relu", ["shifted"], ["g"]),
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    return make_model(
        nodes, [value("p", dtype, SHAPE), value("buf", dtype, SHAPE), value("x", dtype, SHAPE)],
        [value("p_out", dtype, SHAPE), value("buf_out", dtype, SHAPE)],
        [scalar("c", threshold, dtype), scalar("m", 0.9, dtype), scalar("lr", 0.1, dtype)],
    )


def _fused(original: onnx.ModelProto) -> onnx.ModelProto:
    fused = sgdfuse.optimize(original, verify=False).model
    assert sum(node.op_type == "SGD" for node in fused.graph.node) == 1
    return fused


def _reading_scaled_gradient(fused: onnx.ModelProto, factor: float) -> onnx.ModelProto:
    """``fused`` with its SGD node reading ``factor * gradient`` instead of its gradient."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(fused)
    nodes = list(wrong.graph.node)
    position, sgd = next((k, node) for k, node in enumerate(nodes) if node.op_type == "SGD")
    dtype = next(i.type.tensor_type.elem_type for i in wrong.graph.input if i.name == sgd.input[0])
    wrong.graph.initializer.append(numpy_helper.from_array(np.array(factor, dtype=helper.tensor_dtype_to_np_dtype(dtype)), "wrong_factor"))
    scaled = helper.make_node("Mul", [sgd.input[1], "wrong_factor"], ["wrong_gradient"])
    sgd.input[1] = "wrong_gradient"
    del wrong.graph.node[:]
    wrong.graph.node.extend(nodes[:position] + [scaled] + nodes[position:])
    return wrong


def _ort(model: onnx.ModelProto, feeds: dict) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _contract(p, buf, g, dtype) -> dict:
    """The contract's step for momentum 0.9, lr 0.1 (stat 0: not a first step)."""
    p_out, buf_out, _ = reference_sgd(p, g.astype(dtype), np.array([0.1], dtype), buf, np.array([0.9], dtype), np.zeros_like(p))
    return {"p_out": p_out, "buf_out": buf_out}


def _wide_feeds(dtype, x) -> dict:
    rng = np.random.default_rng(3)
    return {"p": rng.standard_normal(SHAPE).astype(dtype), "buf": rng.standard_normal(SHAPE).astype(dtype), "x": np.asarray(x, dtype=dtype)}


def _failed(result) -> dict[str, dict]:
    return {e["name"]: e for e in result.outputs + result.in_place if not e["passed"]}


# -- check: a gradient that wide inputs bring to life ----------------------------------------------------


def test_the_models_compute_the_formula_and_the_edited_one_does_not_where_the_gradient_lives():
    # The premise of the tests below, from the contract and onnxruntime: with x above 10 the right fused model
    # is the formula, and the edited one is not.
    original = _relu_step(10.0)
    fused = _fused(original)
    feeds = _wide_feeds(np.float32, np.linspace(11, 40, 12).reshape(SHAPE))
    want = _contract(feeds["p"], feeds["buf"], np.maximum(feeds["x"] - 10, 0), np.float32)
    for model in (original, fused):
        got = _ort(model, feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
    wrong = _ort(_reading_scaled_gradient(fused, -0.5), feeds)
    assert not np.allclose(wrong["buf_out"], want["buf_out"], rtol=1e-3)


@pytest.mark.parametrize("factor", [-0.5, 2.0])
def test_check_fails_a_fused_model_reading_a_scaled_gradient_that_normal_data_keeps_at_zero(factor):
    original = _relu_step(10.0)
    result = check_models(original, _reading_scaled_gradient(_fused(original), factor), steps=3)
    assert not result.passed
    failed = _failed(result)
    assert {"p_out", "buf_out"} <= set(failed)
    # Caught by a difference of numbers, on the wide step.
    assert all(failed[name]["max_abs_error"] > 0 and "(wide)" in failed[name]["message"] for name in ("p_out", "buf_out"))
    assert not set(result.uncompared) & {"p_out", "buf_out"}


def test_check_passes_the_right_fused_model_of_a_gradient_that_normal_data_keeps_at_zero():
    original = _relu_step(10.0)
    result = check_models(original, _fused(original), steps=3)
    assert result.passed, _failed(result)
    assert result.uncompared == []


def test_check_fails_as_never_compared_an_update_whose_gradient_no_input_brings_to_life():
    # Relu(x - 1e30): no FLOAT value check feeds reaches 1e30, so neither the right model nor a wrong one can
    # be told from the original; both fail, as never compared, and nothing of the right one differs.
    original = _relu_step(1e30)
    right = check_models(original, _fused(original), steps=3)
    assert not right.passed
    failed = _failed(right)
    assert set(failed) == {"p_out", "buf_out", "p", "buf"} == set(right.uncompared)
    assert all(e["max_abs_error"] == 0 for e in failed.values())
    for entry in failed.values():
        assert NEVER_COMPARED in entry["message"] and "the gradient g (computed from x)" in entry["message"], entry["message"]
    wrong = check_models(original, _reading_scaled_gradient(_fused(original), -0.5), steps=3)
    assert not wrong.passed
    assert all(NEVER_COMPARED in e["message"] and "wrong_gradient" in e["message"] for e in _failed(wrong).values())


def test_the_cli_says_never_compared_not_disagree(tmp_path):
    from typer.testing import CliRunner

    from sgdfuse.cli import app

    original = _relu_step(1e30)
    onnx.save(original, tmp_path / "original.onnx")
    onnx.save(_fused(original), tmp_path / "fused.onnx")
    result = CliRunner().invoke(app, ["check", str(tmp_path / "original.onnx"), str(tmp_path / "fused.onnx")], env={"COLUMNS": "250"})
    assert result.exit_code == 1
    assert "were never compared" in result.output and "disagree" not in result.output, result.output


# -- FLOAT16: wide values overflow -----------------------------------------------------------------------


def _float16_damped(scale: float) -> onnx.ModelProto:
    """PyTorch's step with dampening 0.25 in FLOAT16, the gradient computed in the graph: ``g = Relu(scale*(x -
    10))``; ``buf_out = 0.875*buf + 0.75*g``; ``p_out = p - 0.125*buf_out`` (coefficients exact in FLOAT16). Where
    ``g`` overflows to Inf the graph's buffer is Inf, while the op computes ``(0.875*buf + g) - 0.25*g``, which
    is Inf - Inf = NaN (the contract's formula)."""
    nodes = [
        helper.make_node("Sub", ["x", "c"], ["shifted"]),
        helper.make_node("Mul", ["shifted", "scale"], ["scaled"]),
        helper.make_node("Relu", ["scaled"], ["g"]),
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Mul", ["g", "one_minus_d"], ["gd"]),
        helper.make_node("Add", ["bm", "gd"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    return make_model(
        nodes, [value("p", F16, SHAPE), value("buf", F16, SHAPE), value("x", F16, SHAPE)],
        [value("p_out", F16, SHAPE), value("buf_out", F16, SHAPE)],
        [scalar("c", 10.0, F16), scalar("scale", scale, F16), scalar("m", 0.875, F16), scalar("one_minus_d", 0.75, F16),
         scalar("lr", 0.125, F16)],
    )


def test_a_float16_update_whose_wide_step_overflows_to_nan_on_one_side_still_passes():
    # The largest value of a FLOAT16 wide step lies in [2**(6 - 8/12), 2**6] = [40.3, 64] (sgdfuse.verify.wide_values):
    # 4096*(x - 10) is Inf there; the third largest, in [16, 25.4], gives a finite non-zero gradient.
    original = _float16_damped(4096.0)
    fused = _fused(original)
    # The premise, from onnxruntime and the contract: an infinite gradient gives Inf in the graph and NaN in
    # the op. Such elements are left out of the wide step, not failed.
    feeds = _wide_feeds(np.float16, np.full(SHAPE, 50.0))
    original_out, fused_out = _ort(original, feeds), _ort(fused, feeds)
    assert np.isinf(original_out["buf_out"]).all() and np.isnan(fused_out["buf_out"]).all()
    _, contract_buffer, _ = reference_sgd(feeds["p"], np.full(SHAPE, np.inf, np.float16), np.array([0.125], np.float16), feeds["buf"],
                                          np.array([0.875], np.float16), np.zeros(SHAPE, np.float16), dampening=0.25)
    assert np.isnan(contract_buffer).all()
    result = check_models(original, fused, steps=3)
    assert result.passed, _failed(result)


def test_a_float16_update_reading_a_doubled_gradient_is_caught_on_the_wide_step():
    original = _float16_damped(16.0)
    result = check_models(original, _reading_scaled_gradient(_fused(original), 2.0), steps=3)
    assert not result.passed
    failed = _failed(result)
    assert failed["buf_out"]["max_abs_error"] > 0 and "(wide)" in failed["buf_out"]["message"]


def test_a_float16_gradient_computed_in_float16_passes_and_a_wrong_one_is_caught():
    original = _relu_step(10.0, F16)
    fused = _fused(original)
    assert check_models(original, fused, steps=3).passed
    assert not check_models(original, _reading_scaled_gradient(fused, -0.5), steps=3).passed


# -- check: a first step from a buffer the chain left at zero --------------------------------------------


def _first_step_relu(threshold: float) -> onnx.ModelProto:
    """PyTorch's first step with an in-graph gradient: ``buf_out = first ? g : 0.9*buf + g``, ``g = Relu(x - c)``."""
    nodes = [
        helper.make_node("Sub", ["x", "c"], ["shifted"]),
        helper.make_node("Relu", ["shifted"], ["g"]),
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", "g"], ["buf_later"]),
        helper.make_node("Where", ["first", "g", "buf_later"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    inputs = [value("p", F32, SHAPE), value("buf", F32, SHAPE), value("x", F32, SHAPE), helper.make_tensor_value_info("first", TensorProto.BOOL, [])]
    return make_model(nodes, inputs, [value("p_out", F32, SHAPE), value("buf_out", F32, SHAPE)],
                      [scalar("c", threshold), scalar("m", 0.9), scalar("lr", 0.1)])


def _without_first_step_zeroing(fused: onnx.ModelProto) -> onnx.ModelProto:
    """``fused`` with the SGD node reading the buffer itself, not ``Where(first, 0, buf)``: on a first step it
    computes ``0.9*buf + g`` (the contract with stat 1) where PyTorch takes ``g``."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(fused)
    sgd = next(node for node in wrong.graph.node if node.op_type == "SGD")
    zeroing = next(node for node in wrong.graph.node if node.output[0] == sgd.input[3])
    assert zeroing.op_type == "Where" and zeroing.input[2] == "buf"
    sgd.input[3] = "buf"
    return wrong


def test_a_first_step_that_keeps_the_buffer_is_caught_when_the_chain_leaves_the_buffer_at_zero():
    original = _first_step_relu(10.0)
    fused = _fused(original)
    assert check_models(original, fused, steps=3).passed
    result = check_models(original, _without_first_step_zeroing(fused), steps=3)
    assert not result.passed
    failed = _failed(result)
    assert failed["buf_out"]["max_abs_error"] > 0 and "(restart)" in failed["buf_out"]["message"], failed["buf_out"]["message"]


# -- optimize: a gradient computed in the verified slice -------------------------------------------------


def _guarded_relu_step(threshold: float) -> onnx.ModelProto:
    """A loss-scaling skip on a gradient computed in the graph: ``g = Relu(x - c)``, ``found_inf =
    IsInf(ReduceSum(g))``, ``p_out = found_inf ? p : p - 0.1*(0.9*buf + g)``, ``buf_out`` likewise. The guard
    reads the gradient, so optimize's verification slice computes it from ``x``."""
    nodes = [
        helper.make_node("Sub", ["x", "c"], ["shifted"]),
        helper.make_node("Relu", ["shifted"], ["g"]),
        helper.make_node("ReduceSum", ["g"], ["g_sum"], keepdims=0),
        helper.make_node("IsInf", ["g_sum"], ["found_inf"]),
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", "g"], ["new_buf"]),
        helper.make_node("Mul", ["new_buf", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["new_p"]),
        helper.make_node("Where", ["found_inf", "p", "new_p"], ["p_out"]),
        helper.make_node("Where", ["found_inf", "buf", "new_buf"], ["buf_out"]),
    ]
    return make_model(
        nodes, [value("p", F32, SHAPE), value("buf", F32, SHAPE), value("x", F32, SHAPE)],
        [value("p_out", F32, SHAPE), value("buf_out", F32, SHAPE)],
        [scalar("c", threshold), scalar("m", 0.9), scalar("lr", 0.1)],
    )


class _ScaledGradientPlanner(Planner):
    """Plans whose SGD node reads ``-0.5 * gradient``."""

    def plan(self, match):
        plan = super().plan(match)
        gradient = plan.sgd_node.input[1]
        factor = numpy_helper.from_array(np.array(-0.5, dtype=np.float32), "wrong_factor")
        scaled = helper.make_node("Mul", [gradient, "wrong_factor"], ["wrong_gradient"])
        plan.sgd_node.input[1] = "wrong_gradient"
        return dataclasses.replace(plan, nodes=plan.nodes[:-1] + [scaled, plan.sgd_node], initializers=[*plan.initializers, factor])


class _OtherMomentumPlanner(Planner):
    """Plans whose SGD node reads momentum 0.8 where the graph's is 0.9."""

    def plan(self, match):
        plan = super().plan(match)
        initializers = [numpy_helper.from_array(np.array(0.8, dtype=np.float32).reshape(numpy_helper.to_array(t).shape), t.name)
                        if t.name == plan.momentum_input else t for t in plan.initializers]
        assert initializers != plan.initializers
        return dataclasses.replace(plan, initializers=initializers)


def test_optimize_fuses_the_guarded_update_whose_slice_computes_its_gradient():
    result = api.optimize(_guarded_relu_step(10.0))
    assert [f.guard for f in result.report.fused] == ["skipped where found_inf is true"]
    assert all(u["passed"] for u in result.report.verification.updates)


def test_optimize_refuses_a_plan_reading_a_scaled_gradient_that_its_slice_computes_as_zero(monkeypatch):
    monkeypatch.setattr(api, "Planner", _ScaledGradientPlanner)
    model = _guarded_relu_step(10.0)
    result = api.optimize(model)
    assert result.report.fused == []
    (refusal,) = result.report.refused
    assert refusal.reason == "verification-failed" and "(wide)" in refusal.detail, refusal.detail
    assert result.model.SerializeToString() == model.SerializeToString()


def test_optimize_refuses_as_never_compared_a_guarded_update_whose_gradient_no_input_brings_to_life():
    model = _guarded_relu_step(1e30)
    result = api.optimize(model)
    assert result.report.fused == []
    (refusal,) = result.report.refused
    assert refusal.reason == "verification-failed"
    assert NEVER_COMPARED in refusal.detail and "the gradient g (computed from x)" in refusal.detail, refusal.detail


def test_optimize_refuses_a_plan_with_another_momentum_when_its_slice_keeps_the_buffer_at_zero(monkeypatch):
    # A zero gradient from a zero buffer keeps the buffer at zero on every chained step: momentum * buffer is
    # compared only where a step feeds the buffer a value (the wide step and the restart do).
    monkeypatch.setattr(api, "Planner", _OtherMomentumPlanner)
    result = api.optimize(_guarded_relu_step(10.0))
    assert result.report.fused == []
    assert [r.reason for r in result.report.refused] == ["verification-failed"]
