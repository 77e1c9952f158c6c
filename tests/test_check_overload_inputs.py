"""``check`` runs a fused node's specialised body (its ``overload``) in onnxruntime, and that body assumes facts
about the node's inputs (``stat`` +0 everywhere, a constant non-zero ``momentum``) that the device op does not:
it reads them. A fused model feeding such a body other inputs computes one thing in onnxruntime and another on
the device, so check must fail it rather than pass the numbers (a stat of 1 passed check, and the lowered graph
then skipped dampening: a fresh trial's finding). The expected behaviour is the operator contract's (docs/contract.md:
stat 1 means "first step", so dampening is not applied)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import sgdfuse
from sgdfuse.fused_op import DOMAIN, OP_TYPE
from sgdfuse.verify import check_models

MODEL = "testdata/torch/sgd_dampening_dynamo.onnx"


@pytest.fixture(scope="module")
def pair():
    original = onnx.load(MODEL)
    return original, sgdfuse.optimize(original).model


def _edited(fused: onnx.ModelProto, edit) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    edit(copy)
    return copy


def test_the_fused_model_passes(pair):
    original, fused = pair
    assert all(n.overload.endswith("stat0") for n in fused.graph.node if n.op_type == OP_TYPE)
    assert check_models(original, fused, steps=3).passed


def test_a_stat_of_one_fed_to_a_stat0_body_fails(pair):
    original, fused = pair

    def stat_one(model):
        stats = {n.input[5] for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE}
        for node in model.graph.node:
            if node.op_type == "ConstantOfShape" and node.output[0] in stats:
                for attribute in node.attribute:
                    if attribute.name == "value":
                        attribute.t.CopyFrom(numpy_helper.from_array(np.ones(1, np.float32), "value"))

    result = check_models(original, _edited(fused, stat_one), steps=3)
    assert not result.passed
    assert any("assumes stat is +0" in entry["message"] for entry in result.outputs if not entry["passed"])


def test_a_zero_momentum_fed_to_an_mconst_body_fails(pair):
    original, fused = pair
    node = next(n for n in fused.graph.node if n.op_type == OP_TYPE)
    assert "_mconst_" in node.overload

    def momentum_zero(model):
        sgd = next(n for n in model.graph.node if n.op_type == OP_TYPE)
        tensor = next(t for t in model.graph.initializer if t.name == sgd.input[4])
        tensor.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(tensor)), tensor.name))

    result = check_models(original, _edited(fused, momentum_zero), steps=3)
    assert not result.passed
