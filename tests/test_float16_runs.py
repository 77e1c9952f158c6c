"""FLOAT16 graphs run as ONNX defines them: each op rounds its own result to FLOAT16.

onnxruntime's CPU provider computes a chain of FLOAT16 ops in FLOAT and rounds once at its end, so the
"original" side of every FLOAT16 comparison was not the graph's numbers (a public hunt's finding after
microsoft/onnxruntime#15977: a PyTorch FLOAT16 SGD step whose buffer overflows gives inf weights in eager
PyTorch and in ONNX's reference evaluator, finite ones in onnxruntime). ``sgdfuse.runtime.make_session``
widens FLOAT16 ops through explicit casts (``sgdfuse.lift.float16_through_float``). The expected numbers here
are numpy's FLOAT16 arithmetic, which rounds after each operation, and ONNX's reference evaluator.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from sgdfuse.runtime import make_session, run

H = TensorProto.FLOAT16


def _chain() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("Add", ["ab", "c"], ["abc"]),
        helper.make_node("Mul", ["abc", "d"], ["abcd"]),
        helper.make_node("Sub", ["abcd", "e"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(n, H, [64]) for n in "abcde"], [helper.make_tensor_value_info("y", H, [64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: (rng.standard_normal(64) * scale).astype(np.float16) for n in "abcde"}


def test_onnxruntime_alone_rounds_the_chain_once_the_premise():
    # If a later onnxruntime rounds per op itself, this fails and the widening is no longer needed.
    model, feeds = _chain(), _feeds()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    plain = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    per_op = (feeds["a"] * feeds["b"] + feeds["c"]) * feeds["d"] - feeds["e"]
    assert np.sum(plain != per_op) > 0


@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: products beyond FLOAT16's range overflow to inf midway
def test_sgdfuse_sessions_round_each_float16_op(scale):
    model, feeds = _chain(), _feeds(scale)
    got = run(make_session(model), feeds)["y"]
    with np.errstate(over="ignore", invalid="ignore"):
        per_op = (feeds["a"] * feeds["b"] + feeds["c"]) * feeds["d"] - feeds["e"]
    np.testing.assert_array_equal(got, per_op)
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])
    if scale > 1:
        assert np.isinf(per_op).any()


def test_a_model_without_float16_is_run_as_it_is(monkeypatch):
    import sgdfuse.lift as lift

    monkeypatch.setattr(lift, "float16_through_float", lambda *a, **k: pytest.fail("the transform ran for a FLOAT model"))
    model = _chain()
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT
    feeds = {k: v.astype(np.float32) for k, v in _feeds().items()}
    run(make_session(model), feeds)
