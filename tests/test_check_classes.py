"""``sgdfuse check`` (``sgdfuse.verify.check_models``) on a model of many updates: both models are cut into
independent groups of outputs, and from ``CLASS_MIN_PLANS`` groups on one member per class of groups equal up
to value names is run (plus a seeded sample); a wrong fused update is still caught wherever it is.

The models are built here: N momentum-SGD updates ``buf' = 0.9*buf + g; p' = p - lr*buf'`` over [2, 3]
tensors, each with its own names, all reading one learning rate computed in the graph from a fed ``lr``
(``Neg`` then ``Neg``: a node shared by every update, which must not make one group of them). The fused model
comes from ``sgdfuse.optimize``; the wrong ones are made here by editing one SGD node of it, never the first
of its class. The parts ``sgdfuse lower`` runs onnxruntime on (``independent_models``) are compared with one
session of the whole model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs  # noqa: E402
import sgdfuse.api as api  # noqa: E402
from sgdfuse.fused_op import Specialisation, function_opset, is_sgd_node, read_sgd_attributes, sgd_functions_for  # noqa: E402
from sgdfuse.verify import CLASS_MIN_PLANS, check_models  # noqa: E402

N = 80
WRONG = 57  # not the first update, so never the first member of the class


def _updates(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Neg", ["lr"], ["neg_lr"]), helper.make_node("Neg", ["neg_lr"], ["lr_used"])]
    inputs = [graphs.value("lr", shape=[])]
    outputs = []
    for i in range(n):
        nodes += [
            helper.make_node("Mul", [f"buf{i}", "m"], [f"scaled{i}"]),
            helper.make_node("Add", [f"scaled{i}", f"g{i}"], [f"buf{i}_out"]),
            helper.make_node("Mul", [f"buf{i}_out", "lr_used"], [f"step{i}"]),
            helper.make_node("Sub", [f"p{i}", f"step{i}"], [f"p{i}_out"]),
        ]
        inputs += [graphs.value(f"p{i}"), graphs.value(f"g{i}"), graphs.value(f"buf{i}")]
        outputs += [graphs.value(f"p{i}_out"), graphs.value(f"buf{i}_out")]
    return graphs.make_model(nodes, inputs, outputs, [graphs.scalar("m", 0.9)])


@pytest.fixture(scope="module")
def models() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original = _updates(N)
    fused = api.optimize(original, verify=False).model
    assert sum(is_sgd_node(node) for node in fused.graph.node) == N
    return original, fused


def _sgd_node(model: onnx.ModelProto, parameters: str) -> onnx.NodeProto:
    return next(node for node in model.graph.node if is_sgd_node(node) and node.input[0] == parameters)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def _with_dampening(node: onnx.NodeProto, value: float) -> onnx.NodeProto:
    """``node`` with its dampening attribute set to ``value`` (in place)."""
    kept = [a for a in node.attribute if a.name != "dampening"]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute("dampening", value)])
    return node


def _failed(result) -> set[str]:
    return {entry["name"] for entry in result.outputs + result.in_place if not entry["passed"]}


def test_a_correct_fusion_passes_with_one_run_per_class(models):
    original, fused = models
    result = check_models(original, fused, steps=3)
    assert result.passed, _failed(result)
    assert result.groups == N  # one group per update: the shared learning-rate nodes are copied, not joined
    assert N >= CLASS_MIN_PLANS and result.groups_run < result.groups
    shared = [entry for entry in result.outputs + result.in_place if entry["verified_as"]]
    assert len(shared) == 2 * 2 * (result.groups - result.groups_run)  # two outputs and two states per update


def test_one_update_with_another_momentum_is_caught(models):
    """The numbers differ: the wrong SGD node reads a momentum of 0.8 where the original multiplies by 0.9."""
    original, fused = models
    wrong = _copy(fused)
    node = _sgd_node(wrong, f"p{WRONG}")
    wrong.graph.initializer.append(numpy_helper.from_array(np.array(0.8, np.float32), "wrong_momentum"))
    node.input[4] = "wrong_momentum"
    result = check_models(original, wrong, steps=3)
    assert not result.passed
    assert _failed(result) == {f"p{WRONG}_out", f"buf{WRONG}_out", f"p{WRONG}", f"buf{WRONG}"}


def test_one_update_with_a_dampening_its_body_computes_is_caught(models):
    """Dampening 1e-3 on one node, with the specialised body that applies it (so onnxruntime computes
    another buffer than the original's)."""
    original, fused = models
    wrong = _copy(fused)
    node = _with_dampening(_sgd_node(wrong, f"p{WRONG}"), 1e-3)
    node.overload = node.overload.replace("nodamp", "damp")
    Specialisation.from_overload(node.overload).check(read_sgd_attributes(node), subject="test")
    known = {function.overload for function in wrong.functions}
    wrong.functions.extend(f for f in sgd_functions_for([node], function_opset(wrong)) if f.overload not in known)
    result = check_models(original, wrong, steps=3)
    assert not result.passed
    assert _failed(result) == {f"p{WRONG}_out", f"buf{WRONG}_out", f"p{WRONG}", f"buf{WRONG}"}


def test_one_update_whose_body_ignores_its_dampening_is_caught(models):
    """Dampening 1e-3 on one node whose specialised body assumes 0: onnxruntime computes the original's
    numbers, the device (reading the attribute) would not."""
    original, fused = models
    wrong = _copy(fused)
    _with_dampening(_sgd_node(wrong, f"p{WRONG}"), 1e-3)
    result = check_models(original, wrong, steps=3)
    assert not result.passed
    assert _failed(result) == {f"p{WRONG}_out", f"buf{WRONG}_out", f"p{WRONG}", f"buf{WRONG}"}
    message = next(entry["message"] for entry in result.outputs if entry["name"] == f"p{WRONG}_out")
    assert "overload" in message


def test_one_update_writing_another_buffer_in_place_is_caught(models):
    """The wrong node reads the momentum buffer of its neighbour: its group joins the neighbour's, and the
    class of the joined group is its own."""
    original, fused = models
    wrong = _copy(fused)
    node = _sgd_node(wrong, f"p{WRONG}")
    node.input[3] = f"buf{WRONG + 1}"
    result = check_models(original, wrong, steps=3)
    assert not result.passed
    assert f"p{WRONG}_out" in _failed(result)


def test_independent_models_compute_every_output_as_the_whole_model_does(models):
    """``sgdfuse lower`` runs onnxruntime on these parts: together they must give every output of the model,
    once, bit for bit what one session of the whole model gives (run here with onnxruntime directly)."""
    import onnxruntime as ort

    from sgdfuse.verify import independent_models

    original, _ = models
    parts = independent_models(original, max_nodes=40)
    assert len(parts) > 1
    computed = [o.name for part in parts for o in part.graph.output]
    assert sorted(computed) == sorted(o.name for o in original.graph.output)
    feeds = graphs.random_feeds(original, seed=3)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    whole = ort.InferenceSession(original.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, feeds)))
    for part in parts:
        session = ort.InferenceSession(part.SerializeToString(), options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        values = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
        for name, value in zip(names, values):
            assert value.tobytes() == expected[name].tobytes(), name
