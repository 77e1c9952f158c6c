"""Rank-0 values keep their rank through every onnxruntime run sgdfuse makes (optimize's verification,
check, lower's verification): a step counter ``step_out = step + 1`` beside an update, or ``y = 2*x`` with
``x`` of shape [], is fed and compared as shape [], not [1]."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphs import make_model, momentum_sgd, scalar, value
from sgdfuse import runtime
from sgdfuse.lowering.lower import lower
from sgdfuse.lowering.verify import verify_lowering
from sgdfuse.verify import check_models
import sgdfuse


def _scale_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Mul", ["x", "two"], ["y"])], [value("x", TensorProto.FLOAT, [])], [value("y", TensorProto.FLOAT, [])], [scalar("two", 2.0)])


def test_a_rank0_feed_gives_a_rank0_output():
    session = runtime.make_session(_scale_model())
    out = runtime.run(session, {"x": np.array(3.0, np.float32)})
    assert out["y"].shape == () and out["y"] == np.float32(6.0)


def _with_step_counter() -> onnx.ModelProto:
    model = momentum_sgd()
    graph = model.graph
    graph.node.append(helper.make_node("Add", ["count", "one"], ["count_out"]))
    graph.input.append(value("count", TensorProto.FLOAT, []))
    graph.output.append(value("count_out", TensorProto.FLOAT, []))
    graph.initializer.append(scalar("one", 1.0))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_an_update_beside_a_rank0_step_counter_checks_and_lowers():
    original = _with_step_counter()
    fused = sgdfuse.optimize(original).model
    result = check_models(original, fused, steps=2)
    assert result.passed
    ge = lower(fused, soc="Ascend910B2")
    check = verify_lowering(fused, ge)
    assert check.passed, check
