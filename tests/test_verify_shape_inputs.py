"""Verification slices compute the shapes they read: a learning rate expanded to the parameters' shape by a
computed shape, ``lr = Expand(lr0, Shape(p))`` (the ``Expand(x, Shape(y))`` form exporters write), fuses
with verification on, and a wrong plan of that graph is still refused.

Before, the slice was cut at ``Shape(p)`` and fed that INT64 value as an input of zeros, so ``Expand`` made an
empty tensor, the original slice failed to run, and the correct update was refused as verification-failed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs  # noqa: E402
import sgdfuse.api as api  # noqa: E402
from sgdfuse.passes.rewrite import Planner  # noqa: E402
from sgdfuse.reference import sgd as reference_sgd  # noqa: E402


def _expand_lr_model() -> onnx.ModelProto:
    """``buf_out = 0.9*buf + g; p_out = p - Expand(0.1, Shape(p))*buf_out`` on parameters [N, 3]."""
    nodes = [
        helper.make_node("Shape", ["p"], ["ps"]),
        helper.make_node("Expand", ["lr0", "ps"], ["lr"]),
        helper.make_node("Mul", ["buf", "mom"], ["mb"]),
        helper.make_node("Add", ["mb", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    shape = ["N", 3]
    inputs = [graphs.value(n, shape=shape) for n in ("p", "buf", "g")]
    outputs = [graphs.value("p_out", shape=shape), graphs.value("buf_out", shape=shape)]
    return graphs.make_model(nodes, inputs, outputs, [graphs.scalar("lr0", 0.1), graphs.scalar("mom", 0.9)])


def test_an_expanded_learning_rate_fuses_with_verification():
    model = _expand_lr_model()
    result = api.optimize(model)
    assert [(r.candidate, r.reason) for r in result.report.refused] == []
    assert [f.parameters_out for f in result.report.fused] == ["p_out"]
    assert result.report.fused[0].learning_rate == pytest.approx(0.1)
    assert all(u["passed"] for u in result.report.verification.updates)
    # The fused model's numbers are the operator contract's (sgdfuse.reference), not only the verifier's word.
    rng = np.random.default_rng(0)
    p, buf, g = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))
    import onnxruntime as ort

    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"p": p, "buf": buf, "g": g})))
    f32 = np.float32
    want_p, want_buf, _ = reference_sgd(p, g, np.array([0.1], f32), buf, np.array([0.9], f32), np.zeros_like(p))
    np.testing.assert_allclose(got["p_out"], want_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["buf_out"], want_buf, rtol=1e-6, atol=1e-7)


def test_a_wrong_learning_rate_is_still_refused_when_the_shape_is_computed(monkeypatch):
    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            name = plan.learning_rate_input
            off = [
                numpy_helper.from_array((numpy_helper.to_array(t).astype(np.float64) * (1 + 1e-4)).astype(np.float32), t.name)
                if t.name == name else t
                for t in plan.initializers
            ]
            assert off != plan.initializers
            return dataclasses.replace(plan, initializers=off)

    monkeypatch.setattr(api, "Planner", WrongPlanner)
    model = _expand_lr_model()
    result = api.optimize(model)
    assert result.report.fused == []
    assert [(r.candidate, r.reason) for r in result.report.refused] == [("p_out", "verification-failed")]
    assert result.model.SerializeToString() == model.SerializeToString()


def test_a_float_value_computed_from_the_slice_is_still_fed_not_computed():
    # Only integer and bool producers (shapes) are pulled into a slice: a FLOAT value the slice reads stays an
    # input fed made-up data, so the verifier keeps exploring values the graph would not give it.
    from sgdfuse.passes.index import build_index
    from sgdfuse.verify import _shape_producers

    nodes = [
        helper.make_node("Shape", ["p"], ["ps"]),
        helper.make_node("Mul", ["p", "mom"], ["q"]),
        helper.make_node("Expand", ["lr0", "ps"], ["lr"]),
        helper.make_node("Mul", ["p", "lr"], ["pl"]),
        helper.make_node("Add", ["q", "pl"], ["out"]),
    ]
    model = graphs.make_model(nodes, [graphs.value("p", shape=["N", 3])], [graphs.value("out", shape=["N", 3])],
                              [graphs.scalar("lr0", 0.1), graphs.scalar("mom", 0.9)])
    index = build_index(model)
    assert index.spec("ps").dtype == TensorProto.INT64
    assert _shape_producers(index, {2, 3, 4}) == {0}  # Shape(p) computed from the p the slice reads; Mul(p, mom) fed
    assert _shape_producers(index, {2}) == set()  # a slice that does not read p takes its shape as an input
