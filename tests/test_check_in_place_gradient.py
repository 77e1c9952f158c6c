"""``check``'s in-place run allows for a gradient computed from the weights: each side computes it from its own.

In place, the original and the fused model each carry their own weights, which drift apart by rounding
(BFLOAT16 above all: the fused op rounds once per step, the original after every op). A gradient computed
from the weights (``g = 16·x·p``, ``g = 16·(x @ p)``, a stiff step) then differs between the two sides, and
the difference is fed through ``(1 - d)·g`` into the buffer and ``lr·(1 - d)·g`` into the weights. The bound
allowed for the drift of ``p`` and ``buf`` but not for that of ``g``, so ``check`` said a correct fused model
disagrees with its original (8 steps). Now the original's gradient is probed too and, in place only, the
bound adds ``|1 - d|·|Δg|`` (Nesterov's weights ``lr·(1 + |m·(1 - d)|)·|Δg|``). In lockstep both sides
compute the gradient from the same state, so a fused model whose gradient is computed otherwise still fails,
and where the gradient is fed or does not read the weights ``Δg`` is 0.

The fused models are sgdfuse's, and their being right is checked here from their SGD node (it reads the
original's gradient, weights and buffer, and the original's own BFLOAT16 constants), not from ``check``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from graphs import make_model, scalar, value
from sgdfuse.verify import check_models

BF16 = TensorProto.BFLOAT16
SHAPE = [8, 8]
STEPS = 8


def _stiff_step(form: str) -> onnx.ModelProto:
    """``g = (16·x)·p`` (``mul``) or ``(16·x) @ p`` (``matmul``); ``buf_out = 0.9·buf + g``; ``p_out = p - 0.1·buf_out``,
    every value BFLOAT16 (constants rounded to it)."""
    product = helper.make_node("Mul", ["p", "xs"], ["g"]) if form == "mul" else helper.make_node("MatMul", ["xs", "p"], ["g"])
    nodes = [
        helper.make_node("Mul", ["x", "c"], ["xs"]),
        product,
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    return make_model(
        nodes, [value("p", BF16, SHAPE), value("buf", BF16, SHAPE), value("x", BF16, SHAPE)],
        [value("p_out", BF16, SHAPE), value("buf_out", BF16, SHAPE)],
        [scalar("c", 16.0, BF16), scalar("m", 0.9, BF16), scalar("lr", 0.1, BF16)],
    )


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def _fused(original: onnx.ModelProto) -> onnx.ModelProto:
    fused = sgdfuse.optimize(original, verify=False).model
    (sgd,) = [node for node in fused.graph.node if node.op_type == "SGD"]
    # The SGD node reads p, g, lr, buf, m (its input order) with the original's own constants.
    assert [sgd.input[0], sgd.input[1], sgd.input[3]] == ["p", "g", "buf"]
    assert float(_constant(fused, sgd.input[2]).reshape(-1)[0]) == float(_constant(original, "lr"))
    assert float(_constant(fused, sgd.input[4]).reshape(-1)[0]) == float(_constant(original, "m"))
    assert {a.name: helper.get_attribute_value(a) for a in sgd.attribute} == {"dampening": 0.0, "nesterov": 0, "weight_decay": 0.0}
    return fused


def _edited(model: onnx.ModelProto, name: str, change) -> onnx.ModelProto:
    edited = onnx.ModelProto()
    edited.CopyFrom(model)
    for tensor in edited.graph.initializer:
        if tensor.name == name:
            tensor.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(tensor)), name))
            return edited
    raise AssertionError(f"no initializer {name}")


def _one_ulp_up(array: np.ndarray) -> np.ndarray:
    return (array.view(np.uint16) + np.uint16(1)).view(array.dtype)


@pytest.mark.parametrize("form", ["mul", "matmul"])
def test_check_passes_a_right_fused_model_whose_gradient_reads_the_weights_over_many_steps(form):
    original = _stiff_step(form)
    result = check_models(original, _fused(original), steps=STEPS)
    assert result.passed, [e["message"] for e in result.outputs + result.in_place if not e["passed"]]


@pytest.mark.parametrize("form", ["mul", "matmul"])
def test_check_still_fails_a_momentum_one_ulp_off_there(form):
    original = _stiff_step(form)
    fused = _fused(original)
    (sgd,) = [node for node in fused.graph.node if node.op_type == "SGD"]
    assert not check_models(original, _edited(fused, sgd.input[4], _one_ulp_up), steps=STEPS).passed


@pytest.mark.parametrize("form", ["mul", "matmul"])
def test_check_still_fails_a_fused_model_that_computes_its_gradient_otherwise(form):
    # The gradient keeps its name but is computed with 16 one ulp up: the lockstep run, where both sides
    # read the same weights, sees it (the in-place allowance for |Δg| is not given there).
    original = _stiff_step(form)
    assert not check_models(original, _edited(_fused(original), "c", _one_ulp_up), steps=STEPS).passed
