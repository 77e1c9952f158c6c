"""Shape inference runs on the model without its labels (``sgdfuse.passes.value_scan.inference_bytes``): node
names, doc strings and metadata, which inference never reads. The stripped bytes must be the model with exactly
those fields cleared (protobuf's own ``ClearField`` is the reference), and inference must type every value as it
does on the whole model."""

from __future__ import annotations

import glob

import onnx
import pytest
from onnx import TensorProto, helper

from sgdfuse.passes.scan import ScanError
from sgdfuse.passes.value_scan import inference_bytes, native_available



@pytest.fixture(autouse=True)
def _scanner_builds() -> None:
    # Fail, not skip, when the scanner cannot be built: a skip would hide a broken build.
    assert native_available(), "SGDFUSE_NATIVE_SCAN=0 turns the stripper these tests check off"

MODELS = sorted(glob.glob("testdata/**/*.onnx", recursive=True))


def _cleared(model: onnx.ModelProto) -> onnx.ModelProto:
    expected = onnx.ModelProto()
    expected.CopyFrom(model)
    for field in ("doc_string", "metadata_props"):
        expected.ClearField(field)
        expected.graph.ClearField(field)
    for node in expected.graph.node:
        for field in ("name", "doc_string", "metadata_props"):
            node.ClearField(field)
    return expected


def _labelled() -> onnx.ModelProto:
    body = helper.make_graph([helper.make_node("Identity", ["a"], ["o"], name="inner", doc_string="kept")], "body", [],
                             [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    nodes = [
        helper.make_node("Mul", ["a", "a"], ["m"], name="mul_1", doc_string="a stack trace"),
        helper.make_node("If", ["c"], ["out"], name="if_1", then_branch=body, else_branch=body),
    ]
    onnx.helper.set_metadata_props(nodes[0], {"pkg.torch.onnx.stack_trace": "File x.py, line 1"})
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                           helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], doc_string="graph doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], doc_string="model doc")
    onnx.helper.set_model_props(model, {"author": "x"})
    return model


def test_the_stripped_bytes_are_the_model_with_its_labels_cleared_and_subgraphs_whole():
    model = _labelled()
    stripped = onnx.ModelProto.FromString(inference_bytes(model.SerializeToString()))
    assert stripped == _cleared(model)
    assert stripped.graph.node[1].attribute[0].g.node[0].name == "inner"  # subgraphs are copied as they are


def test_a_graph_given_twice_is_merged_as_protobuf_merges_it():
    model = _labelled()
    second = onnx.ModelProto()
    second.graph.node.add().CopyFrom(helper.make_node("Neg", ["m"], ["n"], name="neg"))
    data = model.SerializeToString() + second.SerializeToString()
    assert onnx.ModelProto.FromString(inference_bytes(data)) == _cleared(onnx.ModelProto.FromString(data))


def test_malformed_bytes_are_a_scan_error():
    data = _labelled().SerializeToString()
    with pytest.raises(ScanError):
        inference_bytes(data[:-3])


@pytest.mark.parametrize("path", MODELS)
def test_inference_types_every_value_as_on_the_whole_model(path):
    model = onnx.load(path, load_external_data=False)
    data = model.SerializeToString()
    assert onnx.ModelProto.FromString(inference_bytes(data)) == _cleared(model)
    whole = onnx.load_from_string(onnx.shape_inference.C.infer_shapes(data, False, False, True))
    stripped = onnx.load_from_string(onnx.shape_inference.C.infer_shapes(inference_bytes(data), False, False, True))
    assert [v.SerializeToString() for v in whole.graph.value_info] == [v.SerializeToString() for v in stripped.graph.value_info]
    assert [v.SerializeToString() for v in whole.graph.output] == [v.SerializeToString() for v in stripped.graph.output]
