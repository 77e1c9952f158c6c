"""The output guard at the cost of what changed (sgdfuse.passes.output_check, docs/design.md "Performance").

``optimize`` never returns a model that ``onnx.checker`` (full check) rejects because of sgdfuse. The guard
proves that from the rewritten parts when it can; these tests feed it broken rewrites (a new node no
schema knows, an attribute of the wrong type, a node that changes an updated value's type, a new value typed
otherwise than the output declares it, a read of a value that is gone), most of them plans changed after the
planner replayed them from a valid first plan, and check that each is caught and refused, that a valid rewrite
is accepted without the whole-model check, and that an input which already fails the checker is still
optimised. ``onnx.checker`` itself is the oracle.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from google.protobuf import unknown_fields
from onnx import helper, numpy_helper

import sgdfuse
import sgdfuse.api as api
from sgdfuse.errors import InvalidOutputError
from sgdfuse.fused_op import is_sgd_node
from sgdfuse.passes.index import build_index
from sgdfuse.passes.linear import Normaliser
from sgdfuse.passes.output_check import unproven
from sgdfuse.passes.rewrite import Planner, apply_plans
from sgdfuse.passes.sgd_match import find_updates
from graphs import F32, make_model, momentum_sgd, scalar, value

D64 = onnx.TensorProto.DOUBLE


def updates(count: int, *, shapeless_output: bool = False) -> onnx.ModelProto:
    """``count`` momentum-SGD updates alike up to names: ``b{k}_out = 0.9*b{k} + g{k}``,
    ``p{k}_out = p{k} - 0.1*b{k}_out``. ``shapeless_output`` adds a graph output declared without a
    shape, which the full checker rejects (onnxruntime runs such models)."""
    nodes, inputs, outputs = [], [], []
    for k in range(count):
        p, g, b = f"p{k}", f"g{k}", f"b{k}"
        nodes += [
            helper.make_node("Mul", [b, "m"], [f"{b}_scaled"]),
            helper.make_node("Add", [f"{b}_scaled", g], [f"{b}_out"]),
            helper.make_node("Mul", [f"{b}_out", "lr"], [f"{p}_step"]),
            helper.make_node("Sub", [p, f"{p}_step"], [f"{p}_out"]),
        ]
        inputs += [value(p), value(g), value(b)]
        outputs += [value(f"{p}_out"), value(f"{b}_out")]
    model = make_model(nodes, inputs, outputs, [scalar("m", 0.9), scalar("lr", 0.1)])
    if shapeless_output:
        model.graph.node.append(helper.make_node("Neg", ["p0_out"], ["watch"]))
        model.graph.output.append(helper.make_tensor_value_info("watch", F32, None))
    return model


def rewrite(model: onnx.ModelProto):
    """(output, index, plans) of fusing every update of ``model``, as ``optimize`` does without verifying."""
    index = build_index(model)
    matches, _ = find_updates(index, Normaliser(index))
    planner = Planner(index, 18)
    plans = [planner.plan(match) for match in matches]
    return apply_plans(model, index, plans), index, plans


def full_check_error(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        return str(error)
    return None


def break_last_plan(monkeypatch, change) -> None:
    """Make ``optimize``'s planner apply ``change`` to the nodes of the last plan it makes."""
    real = Planner.plan
    made = []

    def plan(self, match):
        result = real(self, match)
        made.append(result)
        if match.parameters_out == "p2_out":
            change(result.nodes)
        return result

    monkeypatch.setattr(Planner, "plan", plan)


def test_a_valid_rewrite_is_accepted_without_the_whole_model_check(monkeypatch):
    def whole_model_check(model):
        raise AssertionError("the whole output model was checked")

    monkeypatch.setattr(api, "_checker_error", whole_model_check)
    result = sgdfuse.optimize(updates(3), verify=False)
    assert len(result.report.fused) == 3
    assert full_check_error(result.model) is None


def test_the_rewrite_of_a_valid_model_is_proven():
    model = momentum_sgd()
    output, index, plans = rewrite(model)
    assert plans and unproven(output, model, index, plans) is None
    assert full_check_error(output) is None


def test_a_new_node_no_schema_knows_is_caught_in_a_plan_shaped_like_valid_ones(monkeypatch):
    # The first two plans are fine and alike; only the third has the broken node: it must not pass for
    # one of them.
    def unknown_op(nodes):
        helper_node = next(n for n in nodes if not is_sgd_node(n))
        helper_node.op_type = "NoSuchOp"

    break_last_plan(monkeypatch, unknown_op)
    with pytest.raises(InvalidOutputError, match="onnx.checker"):
        sgdfuse.optimize(updates(3), verify=False)


def test_a_new_node_whose_attribute_alone_differs_is_caught(monkeypatch):
    # The third plan's SGD node is its class's own only through the bytes of one attribute (nesterov typed
    # FLOAT, which the checker rejects): the first two plans must not vouch for it.
    def float_nesterov(nodes):
        sgd = next(n for n in nodes if is_sgd_node(n))
        attribute = next(a for a in sgd.attribute if a.name == "nesterov")
        attribute.type = onnx.AttributeProto.FLOAT
        attribute.f = 1.0

    break_last_plan(monkeypatch, float_nesterov)
    with pytest.raises(InvalidOutputError, match="onnx.checker"):
        sgdfuse.optimize(updates(3), verify=False)


def test_a_new_value_typed_otherwise_than_the_output_declares_it_is_caught(monkeypatch):
    # The rewrite declares stat's type (FLOAT of the parameters' shape); a plan whose stat comes out DOUBLE
    # breaks strict shape inference in the output, though every value it replaces keeps its type.
    def double_stat(nodes):
        fill = next(n for n in nodes if n.op_type == "ConstantOfShape")
        fill.attribute[0].t.CopyFrom(numpy_helper.from_array(np.zeros((1,), np.float64), name="value"))

    break_last_plan(monkeypatch, double_stat)
    with pytest.raises(InvalidOutputError, match="onnx.checker"):
        sgdfuse.optimize(updates(3), verify=False)


def test_a_declaration_of_a_new_value_that_inference_contradicts_is_caught():
    model = updates(3)
    output, index, plans = rewrite(model)
    stat = next(n for n in output.graph.node if is_sgd_node(n) and n.name.startswith("sgdfuse/p2_out")).input[5]
    declared = [info for info in output.graph.value_info if info.name == stat]
    assert len(declared) == 1
    declared[0].type.tensor_type.elem_type = D64
    reason = unproven(output, model, index, plans)
    assert reason is not None and "differs" in reason
    assert full_check_error(output) is not None


def test_the_guard_names_the_broken_new_node():
    model = updates(3)
    output, index, plans = rewrite(model)
    bad = next(n for n in output.graph.node if not is_sgd_node(n) and n.name.startswith("sgdfuse/p2_out"))
    bad.op_type = "NoSuchOp"
    reason = unproven(output, model, index, plans)
    assert reason is not None and "NoSuchOp" in reason
    assert full_check_error(output) is not None  # the oracle agrees the model is invalid


def test_a_rewrite_that_changes_an_updated_values_type_is_refused(monkeypatch):
    def to_double(nodes):
        sgd = next(n for n in nodes if is_sgd_node(n))
        sgd.output[0] = "p2_out_float"
        nodes.append(helper.make_node("Cast", ["p2_out_float"], ["p2_out"], to=D64, name="sgdfuse/p2_out/to_double"))

    break_last_plan(monkeypatch, to_double)
    with pytest.raises(InvalidOutputError, match="onnx.checker"):
        sgdfuse.optimize(updates(3), verify=False)


def test_a_read_of_a_value_nothing_defines_is_caught():
    model = updates(2)
    output, index, plans = rewrite(model)
    sgd = next(n for n in output.graph.node if is_sgd_node(n))
    sgd.input[2] = "nowhere"
    reason = unproven(output, model, index, plans)
    assert reason is not None and "nowhere" in reason
    assert full_check_error(output) is not None


def test_a_value_defined_twice_is_caught():
    model = updates(2)
    output, index, plans = rewrite(model)
    output.graph.node.append(helper.make_node("Identity", ["p0"], ["p1_out"]))
    reason = unproven(output, model, index, plans)
    assert reason is not None and "p1_out" in reason
    assert full_check_error(output) is not None


def test_an_input_that_already_fails_the_checker_is_optimised_not_refused():
    model = updates(2, shapeless_output=True)
    before = full_check_error(model)
    assert before is not None
    result = sgdfuse.optimize(model, verify=False)
    assert len(result.report.fused) == 2
    after = full_check_error(result.model)
    assert after is not None and after.splitlines()[0] == before.splitlines()[0]


def test_fields_this_onnx_does_not_know_are_kept():
    model = momentum_sgd()
    unknown = b"\x98\x06\x05"  # field 99, varint 5: no such field in ModelProto or GraphProto
    graph = onnx.GraphProto.FromString(model.graph.SerializeToString() + unknown)
    model.graph.CopyFrom(graph)
    model = onnx.ModelProto.FromString(model.SerializeToString() + unknown)
    result = sgdfuse.optimize(model, verify=False)
    assert len(result.report.fused) == 1
    assert len(unknown_fields.UnknownFieldSet(result.model)) == 1
    assert len(unknown_fields.UnknownFieldSet(result.model.graph)) == 1


def _reference_class_key(summary, outer_names, declared, index, new_initializers):
    """The class key as documented in ``_class_key``, every value read keyed through ``_read_key`` (the
    reference its inlined case for large typed values must equal)."""
    from sgdfuse.passes.output_check import _read_key

    nodes, names, places, outputs = summary
    key = [nodes]
    named = list(zip(places, names, outputs))
    named += [(places[names.index(n)], n, outputs[names.index(n)]) if n in names else (n, n, False) for n in outer_names]
    for place, name, produced in named:
        if produced:
            if name in index.producer:
                spec = index.specs[name]
                key.append(("replaced", place, spec.dtype, spec.shape))
            if name in declared:
                key.append(("declared", place, declared[name]))
            continue
        typed = _read_key(name, index, new_initializers)
        if isinstance(typed, str):
            return typed
        key.append((place, typed))
    return tuple(key)


def mixed_updates() -> onnx.ModelProto:
    """Updates whose values read are large (32 elements: the inlined case), small (4: through ``_read_key``),
    of a symbolic shape, and a learning rate that is a scalar graph input."""
    nodes, inputs, outputs = [], [], []
    for k, (shape, lr) in enumerate([([32], "lr"), ([4], "lr"), (["n"], "lr"), ([32], "lr_in"), ([2, 16], "lr_in")]):
        p, g, b = f"p{k}", f"g{k}", f"b{k}"
        nodes += [
            helper.make_node("Mul", [b, "m"], [f"{b}_scaled"]),
            helper.make_node("Add", [f"{b}_scaled", g], [f"{b}_out"]),
            helper.make_node("Mul", [f"{b}_out", lr], [f"{p}_step"]),
            helper.make_node("Sub", [p, f"{p}_step"], [f"{p}_out"]),
        ]
        inputs += [value(p, shape=shape), value(g, shape=shape), value(b, shape=shape)]
        outputs += [value(f"{p}_out", shape=shape), value(f"{b}_out", shape=shape)]
    inputs.append(value("lr_in", shape=[]))
    return make_model(nodes, inputs, outputs, [scalar("m", 0.9), scalar("lr", 0.1)])


def test_the_class_key_keys_every_read_as_read_key_does(monkeypatch):
    import sgdfuse.passes.output_check as output_check

    real = output_check._class_key
    compared = []

    def checked(summary, outer_names, declared, index, new_initializers, read_keys):
        key = real(summary, outer_names, declared, index, new_initializers, read_keys)
        assert key == _reference_class_key(summary, outer_names, declared, index, new_initializers)
        compared.append(key)
        return key

    monkeypatch.setattr(output_check, "_class_key", checked)
    model = mixed_updates()
    output, index, plans = rewrite(model)
    assert len(plans) == 5
    assert unproven(output, model, index, plans) is None
    assert len(compared) == 5
    # Every kind of read occurs: large typed values (the inlined case), small and symbolic ones, initializers.
    reads = [part[1] for key in compared for part in key[1:] if type(part[0]) is int]
    assert ("typed", F32, (32,)) in reads and ("typed", F32, (4,)) in reads and ("typed", F32, ("n",)) in reads
    assert ("typed", F32, ()) in reads and ("typed", F32, (2, 16)) in reads
