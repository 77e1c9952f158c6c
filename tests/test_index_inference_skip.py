"""``build_index`` skips ONNX shape inference only when inference could not change a spec: every node output
and every declared value info already has a declared shape (or is an initializer) and there is no subgraph.
The specs must then be exactly those a run with inference gives, and inference must still run as soon as
one value lacks a declared shape."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from sgdfuse.passes import index as index_module
from sgdfuse.passes.index import build_index
from graphs import make_model, momentum_sgd, value

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"


def _specs(index) -> dict:
    return {name: (spec.shape, spec.dtype) for name, spec in index.specs.items()}


def _with_inference_forced(model: onnx.ModelProto, monkeypatch) -> dict:
    """The specs of ``model`` with shape inference run whatever the declarations say."""
    with monkeypatch.context() as patch:
        patch.setattr(index_module, "_inference_adds_nothing", lambda *args: False)
        return _specs(build_index(model))


def _inference_runs(model: onnx.ModelProto, monkeypatch) -> bool:
    calls = []
    real = index_module._inferred_value_infos
    with monkeypatch.context() as patch:
        patch.setattr(index_module, "_inferred_value_infos", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
        build_index(model)
    return bool(calls)


def _annotated(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every value's type declared, as onnx's own shape inference gives it."""
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize(
    "path",
    [
        "steps/resnet_small.onnx",
        "steps/gpt_tiny.onnx",
        "steps/mlp_amp.onnx",
        "torch/sgd_multi_dynamo.onnx",
        "jax/jax_mlp_momentum_lr0.05.onnx",
    ],
)
def test_a_fully_declared_export_skips_inference_and_gets_the_same_specs(path, monkeypatch):
    model = onnx.load(TESTDATA / path)
    assert not _inference_runs(model, monkeypatch)
    assert _specs(build_index(model)) == _with_inference_forced(model, monkeypatch)


def test_a_graph_annotated_by_onnx_inference_skips_it_with_the_same_specs(monkeypatch):
    model = _annotated(momentum_sgd())
    assert not _inference_runs(model, monkeypatch)
    assert _specs(build_index(model)) == _with_inference_forced(model, monkeypatch)


def test_one_undeclared_node_output_makes_inference_run_and_type_it(monkeypatch):
    model = _annotated(momentum_sgd())
    dropped = model.graph.value_info[0].name
    del model.graph.value_info[0]
    assert _inference_runs(model, monkeypatch)
    index = build_index(model)
    assert index.spec(dropped).shape == (2, 3) and index.spec(dropped).dtype == TensorProto.FLOAT


def test_a_declared_value_without_a_shape_makes_inference_run_and_shape_it(monkeypatch):
    model = _annotated(momentum_sgd())
    info = model.graph.value_info[0]
    info.type.tensor_type.ClearField("shape")
    assert _inference_runs(model, monkeypatch)
    assert build_index(model).spec(info.name).shape == (2, 3)


def test_a_graph_output_declared_without_a_shape_makes_inference_run(monkeypatch):
    model = _annotated(momentum_sgd())
    model.graph.output[0].type.tensor_type.ClearField("shape")
    assert _inference_runs(model, monkeypatch)
    assert _specs(build_index(model)) == _with_inference_forced(model, monkeypatch)


def test_a_subgraph_makes_inference_run(monkeypatch):
    branch = helper.make_graph([helper.make_node("Identity", ["a"], ["y"])], "branch", [], [value("y")])
    nodes = [helper.make_node("If", ["cond"], ["out"], then_branch=branch, else_branch=branch)]
    model = make_model(nodes, [value("cond", TensorProto.BOOL, []), value("a")], [value("out")])
    model = _annotated(model)
    assert _inference_runs(model, monkeypatch)
    assert build_index(model).spec("y").shape == (2, 3)


def _untyped_gradient(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (testdata's multi-update dynamo export) with the gradient ``grad_v`` read through an
    ``Identity`` whose output no declaration types: the index can know ``grad_v_id`` only from inference."""
    graph = model.graph
    for node in graph.node:
        if "grad_v" in node.input:
            node.input[list(node.input).index("grad_v")] = "grad_v_id"
    graph.node.insert(0, helper.make_node("Identity", ["grad_v"], ["grad_v_id"], name="gid"))
    return model


def _whole_model_inference(model: onnx.ModelProto) -> dict:
    """value name -> (shape, dtype) as onnx's own inference of the whole model gives it ({} when it fails)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # onnx raises InferenceError (and others) for graph-level conflicts
        return {}
    found = {}
    for info in inferred.graph.value_info:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None for d in tensor.shape.dim)
            found[info.name] = (shape, tensor.elem_type)
    return found


def test_a_graph_output_declaring_an_input_more_precisely_types_its_readers_as_whole_model_inference_does():
    # grad_v is the graph input [2, K] and also a pass-through graph output declared [2, 5]: onnx's inference
    # of the whole model types grad_v's readers with the output's declaration. A run over a part of the graph
    # that leaves the output out gives [2, K] (found by a fresh-trial search; the update was then refused).
    model = _untyped_gradient(onnx.load(TESTDATA / "torch" / "sgd_multi_dynamo.onnx"))
    graph = model.graph
    gradient = next(i for i in graph.input if i.name == "grad_v")
    gradient.type.tensor_type.shape.dim[1].Clear()
    gradient.type.tensor_type.shape.dim[1].dim_param = "K"
    graph.output.append(helper.make_tensor_value_info("grad_v", TensorProto.FLOAT, [2, 5]))
    expected = _whole_model_inference(model)["grad_v_id"]
    spec = build_index(model).spec("grad_v_id")
    assert (tuple(spec.shape), spec.dtype) == expected


def test_a_declaration_that_makes_whole_model_inference_fail_leaves_untyped_values_untyped():
    # A stale value info (rank 1) for a rank-0 learning-rate initializer that no untyped value depends on:
    # onnx's inference of the whole model fails, so no inferred type exists for grad_v_id, and the index must
    # not have one either (a run over the untyped values' cone alone succeeded and typed it).
    model = _untyped_gradient(onnx.load(TESTDATA / "torch" / "sgd_multi_dynamo.onnx"))
    lr = next(t for t in model.graph.initializer if t.name == "val_2")
    assert list(lr.dims) == []
    model.graph.value_info.append(helper.make_tensor_value_info("val_2", lr.data_type, [1]))
    assert _whole_model_inference(model) == {}
    spec = build_index(model).spec("grad_v_id")
    assert spec.shape is None
