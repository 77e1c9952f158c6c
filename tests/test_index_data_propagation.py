"""Shape inference runs without data propagation only where propagation cannot change what it infers
(``sgdfuse.passes.index._needs_data_propagation``): a shape operand computed by an op that propagates data
(``Shape``, ``Concat``, ...), a subgraph, a local function, or an op inferred through its function body keeps
it on. The expected shapes come from onnx's own ``infer_shapes`` with ``data_prop=True``."""

from __future__ import annotations

import glob

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
import numpy as np

from sgdfuse.passes import index as index_module
from sgdfuse.passes.index import build_index


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _needs(model: onnx.ModelProto) -> bool:
    nodes = index_module._node_facts(model)
    producer, _, _, subgraph_nodes, _ = index_module._sweep_nodes(model.graph, nodes)
    return index_module._needs_data_propagation(model, nodes, producer, subgraph_nodes)


def _onnx_inferred_shape(model: onnx.ModelProto, name: str):
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    info = next(v for v in inferred.graph.value_info if v.name == name)
    return index_module.tensor_type_of(info.type)[0]


def test_a_shape_computed_by_shape_ops_keeps_propagation_and_its_static_shape():
    # Reshape(y, Shape(x)): only data propagation gives the reshaped value its dims (2, 3).
    model = _model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["y", "s"], ["r"]),
         helper.make_node("Relu", ["r"], ["out"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]), helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    assert _onnx_inferred_shape(model, "r") == (2, 3)
    without = onnx.shape_inference.infer_shapes(model, data_prop=False)
    assert index_module.tensor_type_of(next(v for v in without.graph.value_info if v.name == "r").type)[0] != (2, 3)
    assert _needs(model)
    assert build_index(model).specs["r"].shape == (2, 3)


def test_a_constant_shape_operand_needs_no_propagation_and_infers_the_same():
    shape = helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array([2, 3], np.int64)))
    model = _model(
        [shape, helper.make_node("Reshape", ["y", "s"], ["r"]), helper.make_node("Relu", ["r"], ["out"]),
         helper.make_node("Reshape", ["y", "t"], ["r2"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None), helper.make_tensor_value_info("r2", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([6], np.int64), "t")],
    )
    assert not _needs(model)
    index = build_index(model)
    assert index.specs["r"].shape == _onnx_inferred_shape(model, "r") == (2, 3)


@pytest.mark.parametrize(
    "node, opset",
    [
        (helper.make_node("GreaterOrEqual", ["a", "b"], ["out"]), 12),  # inferred through its function body
        (helper.make_node("NoSuchOp", ["a", "b"], ["out"]), 17),  # an op onnx does not know
    ],
)
def test_ops_inferred_through_a_body_or_unknown_keep_propagation(node, opset):
    model = _model([node], [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("a", "b")],
                   [helper.make_tensor_value_info("out", TensorProto.BOOL, None)], opset=opset)
    assert _needs(model)


def test_a_subgraph_keeps_propagation():
    body = helper.make_graph([helper.make_node("Identity", ["a"], ["o"])], "body", [], [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    model = _model(
        [helper.make_node("If", ["c"], ["out"], then_branch=body, else_branch=body)],
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    assert _needs(model)


def _calling(body_nodes, function_inputs, caller_inputs, caller_nodes=()):
    function = helper.make_function("local", "F", function_inputs, ["y"], body_nodes, [helper.make_opsetid("", 17)])
    model = _model([*caller_nodes, helper.make_node("F", caller_inputs, ["out"], domain="local")],
                   [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]), helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 2])],
                   [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.functions.append(function)
    return model


def test_a_local_function_is_read_by_the_same_rule():
    # An elementwise body: nothing reads a propagated value, and inference gives the same bytes either way.
    plain = _calling([helper.make_node("Neg", ["x"], ["y"])], ["x"], ["a"])
    assert not _needs(plain)
    data = plain.SerializeToString()
    assert onnx.shape_inference.C.infer_shapes(data, False, False, True) == onnx.shape_inference.C.infer_shapes(data, False, False, False)
    # Reshape(x, Shape(s)) inside the body, and a shape operand that is a formal input (the caller's
    # Shape(b) bound to it): both read propagated values.
    inside = _calling([helper.make_node("Shape", ["s"], ["shape"]), helper.make_node("Reshape", ["x", "shape"], ["y"])], ["x", "s"], ["b", "a"])
    assert _needs(inside)
    bound = _calling([helper.make_node("Reshape", ["x", "shape"], ["y"])], ["x", "shape"], ["b", "sa"], [helper.make_node("Shape", ["a"], ["sa"])])
    assert _needs(bound)


@pytest.mark.parametrize("path", sorted(glob.glob("testdata/**/*.onnx", recursive=True)))
def test_where_propagation_is_left_off_onnx_infers_the_same_bytes(path):
    model = onnx.load(path, load_external_data=False)
    if _needs(model):
        return  # inference runs as before, with propagation
    data = index_module._stripped(model).SerializeToString()
    with_propagation = onnx.shape_inference.C.infer_shapes(data, False, False, True)
    without = onnx.shape_inference.C.infer_shapes(data, False, False, False)
    assert with_propagation == without


def test_fused_testdata_models_where_propagation_is_left_off_infer_the_same_bytes():
    # The fused models (SGD function bodies called from the graph) are what `lower` and `check` index.
    import sgdfuse

    compared = 0
    for path in sorted(glob.glob("testdata/torch/*.onnx") + glob.glob("testdata/steps/*.onnx")):
        fused = sgdfuse.optimize(path, verify=False).model
        if _needs(fused):
            continue
        data = index_module._stripped(fused).SerializeToString()
        assert onnx.shape_inference.C.infer_shapes(data, False, False, True) == onnx.shape_inference.C.infer_shapes(data, False, False, False), path
        compared += 1
    assert compared >= 10


@pytest.mark.parametrize("version", [2**31, 2**40])
def test_an_opset_version_beyond_int32_is_an_unknown_schema_not_a_crash(version):
    model = _model([helper.make_node("Neg", ["a"], ["out"])], [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model.opset_import[0].version = version
    assert _needs(model)
    build_index(model)  # inference may fail on such a model; the index is still built
