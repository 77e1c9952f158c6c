"""``check`` proves nothing where both models give NaN: NaN matches NaN, so an output that is NaN everywhere
on the random inputs must fail as "nothing compared", and inputs read where only non-negative values are
defined (a frozen BatchNormalization's running variance) are fed |x| so that real models compare numbers.

The frozen-BatchNorm CNN step is committed testdata (testdata/steps/cnn_frozen.onnx); the wrong fused model is
made here by multiplying its learning rate by 10.
"""

from __future__ import annotations

import numpy as np
import pytest
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphs import make_model, scalar, value
import sgdfuse
from sgdfuse.verify import check_models

FROZEN = "testdata/steps/cnn_frozen.onnx"


def _learning_rate_times(model: onnx.ModelProto, factor: float) -> onnx.ModelProto:
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    tensor = next(t for t in wrong.graph.initializer if t.name.startswith("sgdfuse/learning_rate"))
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), tensor.name))
    return wrong


def test_a_frozen_batchnorm_step_compares_numbers_and_catches_a_wrong_learning_rate():
    original = onnx.load(FROZEN)
    fused = sgdfuse.optimize(original).model
    right = check_models(original, fused, steps=3)
    assert right.passed, [e for e in right.outputs if not e["passed"]]
    wrong = check_models(original, _learning_rate_times(fused, 10.0), steps=3)
    assert not wrong.passed
    assert any(e["max_abs_error"] > 0 for e in wrong.outputs if not e["passed"])


def test_an_update_that_is_nan_everywhere_is_not_called_agreeing():
    # g = log(-|x| - 1) is NaN for every x: both models' new buffers and weights are NaN on every step.
    nodes = [
        helper.make_node("Abs", ["x"], ["ax"]),
        helper.make_node("Neg", ["ax"], ["nax"]),
        helper.make_node("Sub", ["nax", "one"], ["below"]),
        helper.make_node("Log", ["below"], ["g"]),
        helper.make_node("Mul", ["buf", "m"], ["scaled"]),
        helper.make_node("Add", ["scaled", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    original = make_model(nodes, [value("x"), value("p"), value("buf")], [value("p_out"), value("buf_out")],
                          [scalar("one", 1.0), scalar("m", 0.9), scalar("lr", 0.1)])
    fused = sgdfuse.optimize(original, verify=False).model
    assert any(n.op_type == "SGD" for n in fused.graph.node)
    result = check_models(original, fused, steps=2)
    assert not result.passed
    failed = {e["name"]: e["message"] for e in result.outputs if not e["passed"]}
    assert set(failed) == {"p_out", "buf_out"}
    assert all("no finite value" in message for message in failed.values())


def _dead_gradient_step() -> onnx.ModelProto:
    """A training step whose gradient is computed in the graph and is zero on any data (a dead ReLU:
    Relu(-|x|)): buf_out = 0.9*buf + g, p_out = p - 0.1*buf_out, FLOAT [4, 3]."""
    shape = [4, 3]
    nodes = [
        helper.make_node("Abs", ["x"], ["x_abs"]),
        helper.make_node("Neg", ["x_abs"], ["x_neg"]),
        helper.make_node("Relu", ["x_neg"], ["g"]),
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    return make_model(
        nodes,
        [value("p", TensorProto.FLOAT, shape), value("buf", TensorProto.FLOAT, shape), value("x", TensorProto.FLOAT, shape)],
        [value("p_out", TensorProto.FLOAT, shape), value("buf_out", TensorProto.FLOAT, shape)],
        [scalar("m", 0.9, TensorProto.FLOAT), scalar("lr", 0.1, TensorProto.FLOAT)],
    )


def test_a_wrong_momentum_is_caught_when_the_graph_gradient_is_zero_on_the_fed_data():
    # From zero state a zero gradient keeps the buffer zero at every chained step, so momentum * accum is never
    # compared unless a step feeds the buffer a value (verify.RANDOM_STATE): a fused model reading another
    # momentum passed check on the bench's dead forward-chain updates (a fresh trial's finding).
    # Relu(-|x|) is zero for every x, so the gradient term itself is never compared: the right fused model is not
    # called agreeing either, but nothing of it differs (tests/test_check_dead_gradient.py).
    original = _dead_gradient_step()
    fused = sgdfuse.optimize(original).model
    assert sum(node.op_type == "SGD" for node in fused.graph.node) == 1
    right = check_models(original, fused, steps=3)
    failed = [e for e in right.outputs + right.in_place if not e["passed"]]
    assert {e["name"] for e in failed} == {"p_out", "buf_out", "p", "buf"} == set(right.uncompared)
    assert all(e["max_abs_error"] == 0 for e in failed)
    assert all("never compared" in e["message"] for e in failed)
    wrong = onnx.ModelProto()
    wrong.CopyFrom(fused)
    tensor = next(t for t in wrong.graph.initializer if t.name.startswith("sgdfuse/momentum"))
    tensor.CopyFrom(numpy_helper.from_array(np.full_like(numpy_helper.to_array(tensor), 0.8), tensor.name))
    result = check_models(original, wrong, steps=3)
    assert not result.passed
    assert any(e["max_abs_error"] > 0 for e in result.outputs + result.in_place if not e["passed"])


def _normalised_gradient_step(dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    # g = x / sqrt(sum(x*x)): NaN when x is all zero (check's zero-gradient step), so the parameters are NaN on
    # both sides from then on; the buffers stay finite (weight decay 0), and momentum is compared on them.
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["xx"]),
        helper.make_node("ReduceSum", ["xx"], ["s"], keepdims=1),
        helper.make_node("Sqrt", ["s"], ["n"]),
        helper.make_node("Div", ["x", "n"], ["g"]),
        helper.make_node("Mul", ["buf", "m"], ["scaled"]),
        helper.make_node("Add", ["scaled", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    return make_model(nodes, [value("x"), value("p"), value("buf")], [value("p_out"), value("buf_out")],
                      [scalar("m", 0.9), scalar("lr", 0.1)])


@pytest.mark.parametrize("role, wrong", [("momentum", 0.5), ("learning_rate", 0.3)])
def test_nan_parameters_do_not_make_the_bound_infinite(role, wrong):
    original = _normalised_gradient_step()
    fused = sgdfuse.optimize(original).model
    assert check_models(original, fused, steps=3).passed
    edited = onnx.ModelProto()
    edited.CopyFrom(fused)
    sgd = next(n for n in edited.graph.node if n.op_type == "SGD")
    name = sgd.input[{"learning_rate": 2, "momentum": 4}[role]]
    tensor = next(t for t in edited.graph.initializer if t.name == name)
    tensor.CopyFrom(numpy_helper.from_array(np.full(numpy_helper.to_array(tensor).shape, wrong, np.float32), name))
    assert not check_models(original, edited, steps=3).passed
