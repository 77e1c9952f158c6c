"""A size at which the original slice itself cannot run is skipped (noted), not a failure of the fused update.

``verify_plans`` runs a slice with symbolic dimensions at every size of :data:`sgdfuse.verify.SIZES`. The
original below reshapes its gradient to a fixed ``[3, 4]``, which is the identity at N = 3 and impossible
at N = 1 (4 elements); the fused op reads the gradient as it is and runs at both. onnxruntime refusing the
original's Reshape at N = 1 says nothing about the rewrite, so that size is skipped and the update passes
on N = 3, where both run. The same plan with a wrong momentum fails there (the control that N = 3 is
compared). Before, a run error of the original slice was taken for the fused side's (its side is named
"original slice", and "original" was looked for), so the update failed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.linear import Poly  # noqa: E402
from sgdfuse.passes.rewrite import Planner  # noqa: E402
from sgdfuse.passes.sgd_match import Match  # noqa: E402
from sgdfuse.verify import verify_plans  # noqa: E402

F32 = TensorProto.FLOAT
SHAPE = ("N", 4)


def _reshaping_model() -> onnx.ModelProto:
    """``buf_out = 0.9*buf + Reshape(g, [3, 4])``, ``p_out = p - 0.1*buf_out``, parameters ``[N, 4]``."""
    nodes = [
        helper.make_node("Reshape", ["g", "fixed"], ["g_fixed"]),
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g_fixed"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    initializers = [numpy_helper.from_array(np.array([3, 4], dtype=np.int64), "fixed"), graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)]
    return graphs.make_model(nodes, [graphs.value(n, shape=SHAPE) for n in ("p", "g", "buf")],
                             [graphs.value("p_out", shape=SHAPE), graphs.value("buf_out", shape=SHAPE)], initializers)


def _plan(model: onnx.ModelProto):
    index = build_index(model)
    match = Match(
        parameters="p", gradient="g", accum="buf", parameters_out="p_out", accum_out="buf_out",
        learning_rate=Poly.const(0.1), momentum=Poly.const(0.9), dampening=0.0, weight_decay=0.0,
        nesterov=False, maximize=False, dtype=F32, shape=SHAPE, nodes=set(range(len(model.graph.node))),
        parameter_equation="", accum_equation="", first_step=None,
    )
    return index, Planner(index).plan(match)


def test_a_size_the_original_slice_cannot_run_is_skipped_and_noted():
    model = _reshaping_model()
    index, plan = _plan(model)
    (check,) = verify_plans(model, index, [plan])
    assert check.passed, check.message
    assert check.runs and all("size 3" in run for run in check.runs)
    assert "size 1" in check.note and "original" in check.note and "skipped" in check.note


def test_the_size_both_sides_run_is_still_compared():
    model = _reshaping_model()
    index, plan = _plan(model)
    wrong = [numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(1.01), t.name) if t.name == plan.momentum_input else t
             for t in plan.initializers]
    assert wrong != plan.initializers
    (check,) = verify_plans(model, index, [dataclasses.replace(plan, initializers=wrong)])
    assert not check.passed
