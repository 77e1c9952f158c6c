"""``check`` runs a fused model in onnxruntime, which runs the model's own ``ai.sgdfuse::SGD`` function body;
the device's SGD op computes the operator contract whatever that body says. A body edited by hand, with the
node's inputs or attributes changed to make up for it, gives the original's numbers in onnxruntime and other
numbers on the device: a user trial found check passing two such models (a learning rate doubled in the body
and halved on the node; a dampening written into the body while the node's attribute says another). check
must fail a body that is not the contract's. The expected numbers of the device are the contract's
(``sgdfuse.reference``), computed here independently of check.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import sgdfuse
from sgdfuse.fused_op import DOMAIN, OP_TYPE, read_sgd_attributes
from sgdfuse.reference import sgd as reference_sgd
from sgdfuse.verify import check_models

MODEL = "testdata/torch/sgd_dampening_dynamo.onnx"


@pytest.fixture(scope="module")
def pair():
    original = onnx.load(MODEL)
    return original, sgdfuse.optimize(original).model


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _lr_doubled_in_body_halved_on_node(fused: onnx.ModelProto) -> onnx.ModelProto:
    tampered = _copy(fused)
    for function in tampered.functions:
        if function.domain != DOMAIN or function.name != OP_TYPE:
            continue
        for node in function.node:
            node.input[:] = ["lr_x2" if name == "learning_rate" else name for name in node.input]
        function.node.insert(0, helper.make_node("Add", ["learning_rate", "learning_rate"], ["lr_x2"]))
    lr_inputs = {node.input[2] for node in tampered.graph.node if node.domain == DOMAIN and node.op_type == OP_TYPE}
    halved = 0
    for tensor in tampered.graph.initializer:
        if tensor.name in lr_inputs:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) / 2, tensor.name))
            halved += 1
    for node in tampered.graph.node:
        if node.op_type == "Constant" and node.output[0] in lr_inputs:
            value = node.attribute[0]
            value.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(value.t) / 2, value.t.name))
            halved += 1
    assert halved, "no learning-rate constant found to halve"
    return tampered


def test_the_fused_model_passes(pair):
    original, fused = pair
    assert check_models(original, fused, steps=3).passed


def test_a_body_edited_to_make_up_for_a_wrong_node_fails(pair):
    original, fused = pair
    tampered = _lr_doubled_in_body_halved_on_node(fused)
    # The premise: onnxruntime gives the original's numbers, the contract for the node's inputs does not.
    feeds = {}
    rng = np.random.default_rng(0)
    for value in original.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(run(tampered)[0], run(original)[0], rtol=1e-5, atol=1e-6)
    node = next(n for n in tampered.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE)
    constants = {t.name: numpy_helper.to_array(t) for t in tampered.graph.initializer}
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in tampered.graph.node if n.op_type == "Constant"})
    attributes = read_sgd_attributes(node)
    parameters, gradient, accum = (feeds[name] for name in (node.input[0], node.input[1], node.input[3]))
    device, _, _ = reference_sgd(
        parameters, gradient, constants[node.input[2]].reshape(1).astype(np.float32), accum,
        constants[node.input[4]].reshape(1).astype(np.float32), np.zeros_like(parameters),
        dampening=attributes.dampening, weight_decay=attributes.weight_decay, nesterov=attributes.nesterov,
    )
    position = [o.name for o in tampered.graph.output].index(node.output[0])
    assert np.max(np.abs(device - run(original)[position])) > 1e-3, "the tampered node must compute other numbers on the device"

    result = check_models(original, tampered, steps=3)
    assert not result.passed
    messages = " ".join(e.get("message", "") or "" for e in result.outputs + result.in_place) + " " + str(result)
    assert "not the operator contract's" in messages, messages


def test_a_doc_string_on_the_body_is_not_an_edit(pair):
    original, fused = pair
    documented = _copy(fused)
    for function in documented.functions:
        function.doc_string = "written by another tool"
    assert check_models(original, documented, steps=3).passed
