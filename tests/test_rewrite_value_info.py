"""The rewrite declares a ``value_info`` for the values it adds whose type is certain (``stat``, ``stat_out``,
a BFLOAT16 update's ``stat_float``), so that indexing a fused model
(``sgdfuse lower``) need not run shape inference over it. Each declared type must be exactly the one ONNX
shape inference gives that value in the fused model without the declaration, and the fused model must pass
the checker's full check."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

import sgdfuse
from graphs import make_model, scalar, value

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"
MODELS = sorted(str(p.relative_to(TESTDATA)) for p in TESTDATA.rglob("*.onnx"))


def _declared_against_inferred(source: onnx.ModelProto, fused: onnx.ModelProto) -> list[str]:
    """The names of the value infos ``fused`` declares and ``source`` did not; asserts each equals the type
    onnx's shape inference gives it in ``fused`` with those declarations removed."""
    before = {info.name for info in source.graph.value_info}
    added = [info for info in fused.graph.value_info if info.name not in before]
    bare = onnx.ModelProto()
    bare.CopyFrom(fused)
    del bare.graph.value_info[:]
    bare.graph.value_info.extend(info for info in fused.graph.value_info if info.name in before)
    inferred = onnx.shape_inference.infer_shapes(bare, check_type=False, strict_mode=False, data_prop=True)
    types = {info.name: info.type for info in inferred.graph.value_info}
    for info in added:
        assert info.name in types, f"{info.name} is declared but inference gives it no type"
        assert info.type == types[info.name], (info.name, info.type, types[info.name])
    return [info.name for info in added]


@pytest.mark.parametrize("path", MODELS)
def test_declared_types_of_added_values_are_what_shape_inference_gives(path):
    source = onnx.load(TESTDATA / path)
    result = sgdfuse.optimize(source, verify=False)
    added = _declared_against_inferred(source, result.model)
    if result.report.fused:
        onnx.checker.check_model(result.model, full_check=True)
    else:
        assert added == []


def _update(dtype: int, shape: list, maximize: bool) -> onnx.ModelProto:
    """buf_out = 0.9*buf + g (g negated first when ``maximize``), p_out = p - 0.1*buf_out, in ``dtype``."""
    nodes = []
    gradient = "g"
    if maximize:
        nodes.append(helper.make_node("Neg", ["g"], ["g_neg"]))
        gradient = "g_neg"
    nodes += [
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", gradient], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    return make_model(
        nodes,
        [value("p", dtype, shape), value("g", dtype, shape), value("buf", dtype, shape)],
        [value("p_out", dtype, shape), value("buf_out", dtype, shape)],
        [scalar("m", 0.9, dtype), scalar("lr", 0.1, dtype)],
    )


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16])
@pytest.mark.parametrize("shape", [[4, 3], [5], ["N", 3], [None, 3]], ids=["static", "1d", "symbolic", "unknown"])
@pytest.mark.parametrize("maximize", [False, True], ids=["plain", "maximize"])
def test_declared_types_per_dtype_and_shape_kind(dtype, shape, maximize):
    source = _update(dtype, shape, maximize)
    result = sgdfuse.optimize(source, verify=False)
    assert len(result.report.fused) == 1
    added = set(_declared_against_inferred(source, result.model))
    onnx.checker.check_model(result.model, full_check=True)
    sgd = next(node for node in result.model.graph.node if node.op_type == "SGD")
    if all(isinstance(d, int) for d in shape):
        # static parameters: stat and stat_out declared, so the index of the fused model needs no inference
        assert {sgd.input[5], sgd.output[2]} <= added
        assert sgd.input[1] not in added  # a negated gradient is typed by inference (below)
    else:
        assert added == set()


def test_a_gradient_declared_otherwise_as_a_graph_output_gets_no_declared_type_for_its_negation():
    # g is the graph input [4, 3] and also a pass-through graph output declared [4, K]: onnx's inference reads
    # g with the output's declaration, so Neg(g) is [4, K] there, while the index takes the input's [4, 3].
    # Declaring [4, 3] for the negated gradient made `lower` take a dynamic shape for static (a fresh-trial
    # finding); every declared type must be inference's.
    source = _update(TensorProto.FLOAT, [4, 3], maximize=True)
    source.graph.output.append(value("g", TensorProto.FLOAT, [4, "K"]))
    onnx.checker.check_model(source, full_check=True)
    result = sgdfuse.optimize(source, verify=False)
    assert len(result.report.fused) == 1
    _declared_against_inferred(source, result.model)
