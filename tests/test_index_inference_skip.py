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
        patch.setattr(index_module, "_inferred_value_infos", lambda *args: calls.append(1) or real(*args))
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
