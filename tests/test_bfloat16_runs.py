"""BFLOAT16 models run in onnxruntime's CPU provider, which has no BFLOAT16 kernel for ``Mul``, ``Add``, ``Sub``,
``Neg``, ``Where`` or ``Expand``: ``sgdfuse.runtime.make_session`` computes those ops in FLOAT between Casts
(``sgdfuse.lift.bfloat16_through_float``). The expected numbers are BFLOAT16 arithmetic written out here bit by
bit (round to nearest even from the exact result), independent of numpy's and ml_dtypes' own BFLOAT16 code; the
update computed wholly in BFLOAT16 then fuses with verification on, and a wrong fused model still fails."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.lift import bfloat16_through_float
from sgdfuse.runtime import make_session, run
from sgdfuse.verify import check_models

BF16 = ml_dtypes.bfloat16


def _round_to_bfloat16(exact: np.ndarray) -> np.ndarray:
    """Round FLOAT64 values that FLOAT holds exactly to BFLOAT16, to nearest even, on the bits."""
    single = exact.astype(np.float32)
    assert np.array_equal(single.astype(np.float64), exact), "the test's exact results must fit FLOAT"
    bits = single.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(BF16)


def _bf16(values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    assert np.array_equal(array.astype(BF16).astype(np.float64), array), "inputs must be BFLOAT16 values"
    return array.astype(BF16)


def _info(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.BFLOAT16, shape)


def test_the_ops_onnxruntime_lacks_give_bfloat16_arithmetic_bit_for_bit():
    # out = Where(a < b, a*b + a, -(a - b)) expanded to [2, 3]; every exact result fits FLOAT (8-bit significands).
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("Add", ["ab", "a"], ["s"]),
        helper.make_node("Sub", ["a", "b"], ["d"]),
        helper.make_node("Neg", ["d"], ["nd"]),
        helper.make_node("Cast", ["a"], ["af"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT),
        helper.make_node("Less", ["af", "bf"], ["c"]),
        helper.make_node("Where", ["c", "s", "nd"], ["w"]),
        helper.make_node("Expand", ["w", "shape"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "bf16", [_info("a", [3]), _info("b", [3])], [_info("out", [2, 3])],
                              [numpy_helper.from_array(np.array([2, 3], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    a = _bf16([1.0078125, 3.5, -0.3359375])
    b = _bf16([1.9921875, -2.25, 0.01171875])
    got = run(make_session(model), {"a": a, "b": b})["out"]
    ea, eb = a.astype(np.float64), b.astype(np.float64)
    ab = _round_to_bfloat16(ea * eb).astype(np.float64)
    s = _round_to_bfloat16(ab + ea).astype(np.float64)
    nd = -_round_to_bfloat16(ea - eb).astype(np.float64)
    want = np.broadcast_to(np.where(ea < eb, s, nd), (2, 3)).astype(BF16)
    assert got.dtype == BF16
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_only_the_named_ops_with_bfloat16_values_are_widened():
    nodes = [helper.make_node("Mul", ["a", "a"], ["m"]), helper.make_node("Mul", ["f", "f"], ["g"])]
    graph = helper.make_graph(nodes, "g", [_info("a", [2]), helper.make_tensor_value_info("f", TensorProto.FLOAT, [2])],
                              [_info("m", [2]), helper.make_tensor_value_info("g", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    widened, changed = bfloat16_through_float(model, {"Mul"})
    assert changed and [n.op_type for n in widened.graph.node] == ["Cast", "Mul", "Cast", "Mul"]
    unchanged, changed = bfloat16_through_float(model, {"Add"})
    assert not changed and [n.op_type for n in unchanged.graph.node] == ["Mul", "Mul"]
    assert [o.name for o in widened.graph.output] == ["m", "g"]
    assert model.graph.node[0].output[0] == "m"  # the input is not modified


def _pure_bfloat16_step() -> onnx.ModelProto:
    # buf_out = 0.875*buf + g; p_out = p - 0.125*buf_out, every op in BFLOAT16.
    def constant(name, value):
        return numpy_helper.from_array(np.array(value, dtype=BF16), name)

    nodes = [helper.make_node("Mul", ["buf", "m"], ["mb"]), helper.make_node("Add", ["mb", "g"], ["buf_out"]),
             helper.make_node("Mul", ["buf_out", "lr"], ["step"]), helper.make_node("Sub", ["p", "step"], ["p_out"])]
    graph = helper.make_graph(nodes, "bf16_step", [_info("p", [4, 3]), _info("g", [4, 3]), _info("buf", [4, 3])],
                              [_info("p_out", [4, 3]), _info("buf_out", [4, 3])], [constant("m", 0.875), constant("lr", 0.125)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_an_update_wholly_in_bfloat16_fuses_with_verification_and_checks():
    original = _pure_bfloat16_step()
    result = sgdfuse.optimize(original)
    assert [f.parameters for f in result.report.fused] == ["p"], result.report.refused
    assert all(u["passed"] for u in result.report.verification.updates)
    assert check_models(original, result.model, steps=3).passed


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_a_wrong_bfloat16_fused_model_still_fails_the_check(factor):
    original = _pure_bfloat16_step()
    fused = sgdfuse.optimize(original).model
    wrong = onnx.ModelProto()
    wrong.CopyFrom(fused)
    tensor = next(t for t in wrong.graph.initializer if t.name.startswith("sgdfuse/learning_rate"))
    value = numpy_helper.to_array(tensor).astype(np.float64) * factor
    tensor.CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(tensor).dtype), tensor.name))
    assert not check_models(original, wrong, steps=3).passed


def _reference(model: onnx.ModelProto, feeds: dict) -> dict:
    # ONNX's reference evaluator on ml_dtypes' BFLOAT16 arrays: another implementation of the same arithmetic.
    from onnx.reference import ReferenceEvaluator

    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds)))


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            feeds[value.name] = rng.standard_normal(dims).astype(np.float32).astype(BF16)
        else:
            feeds[value.name] = np.array(1, np.int64)
    return feeds


def _same_bits(model: onnx.ModelProto, *, ulps: int = 0) -> None:
    feeds = _feeds(model)
    ours = run(make_session(model), feeds)
    theirs = _reference(model, feeds)
    for name, want in theirs.items():
        have, want = np.asarray(ours[name]), np.asarray(want)
        assert have.dtype == want.dtype
        if want.dtype == BF16:
            spacing = np.abs(want.astype(np.float64)) * 2.0 ** -7 + 2.0 ** -133
            assert np.all(np.abs(have.astype(np.float64) - want.astype(np.float64)) <= ulps * spacing), name
        else:
            assert np.array_equal(have, want), name


def test_bfloat16_inside_an_if_branch_and_a_local_function_is_widened():
    then_branch = helper.make_graph([helper.make_node("Identity", ["g"], ["t"])], "then", [], [_info("t", [4])])
    else_branch = helper.make_graph([helper.make_node("Mul", ["b", "g"], ["e0"]), helper.make_node("Add", ["e0", "g"], ["e"])],
                                    "else", [], [_info("e", [4])])
    nodes = [helper.make_node("Equal", ["step", "zero"], ["first"]),
             helper.make_node("If", ["first"], ["out"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("Scale", ["out", "b"], ["scaled"], domain="local")]
    function = helper.make_function("local", "Scale", ["a", "s"], ["y"], [helper.make_node("Mul", ["a", "s"], ["y"])],
                                    [helper.make_opsetid("", 18)])
    graph = helper.make_graph(nodes, "g", [_info("g", [4]), _info("b", [4]), helper.make_tensor_value_info("step", TensorProto.INT64, [])],
                              [_info("scaled", [4])], [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)], functions=[function])
    _same_bits(model)


@pytest.mark.parametrize("op, opset, ulps", [("Relu", 18, 0), ("LessOrEqual", 18, 0), ("Softmax", 18, 2)])
def test_ops_onnxruntime_expands_through_function_bodies_are_widened(op, opset, ulps):
    # onnxruntime's error names the body's op (Max, Less, ReduceMax), which is no node of the graph.
    if op == "LessOrEqual":
        nodes = [helper.make_node("LessOrEqual", ["a", "b"], ["c"]), helper.make_node("Where", ["c", "a", "b"], ["out"])]
    elif op == "Softmax":
        nodes = [helper.make_node("Softmax", ["a"], ["s"], axis=-1), helper.make_node("Mul", ["s", "b"], ["out"])]
    else:
        nodes = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Mul", ["r", "b"], ["out"])]
    graph = helper.make_graph(nodes, "g", [_info("a", [2, 5]), _info("b", [2, 5])], [_info("out", [2, 5])])
    _same_bits(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), ulps=ulps)


def test_bfloat16_made_only_by_constant_nodes_is_widened():
    value = numpy_helper.from_array(np.array([0.5, 1.5, -2.0], dtype=BF16), "value")
    nodes = [helper.make_node("Constant", [], ["k"], value=value), helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("Mul", ["xb", "k"], ["m"]), helper.make_node("Cast", ["m"], ["out"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = run(make_session(model), {"x": np.array([1.0, 3.0, 0.25], np.float32)})["out"]
    assert got.tolist() == [0.5, 4.5, -0.5]


def test_a_kernel_missing_for_another_type_is_not_widened(monkeypatch):
    # A lifted (DOUBLE) model onnxruntime lacks a kernel for: the BFLOAT16 transform (inference over the whole
    # model) must not run for it; lowering's verification makes many such sessions.
    import sgdfuse.lift as lift

    monkeypatch.setattr(lift, "bfloat16_through_float", lambda *a, **k: pytest.fail("the transform ran for a DOUBLE model"))
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 1, 3, 3]),
                                           helper.make_tensor_value_info("w", TensorProto.DOUBLE, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 1, 2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(Exception, match="Conv"):
        make_session(model)
