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
    """The specs of ``model`` with shape inference run on the whole model whatever the declarations say."""
    with monkeypatch.context() as patch:
        patch.setattr(index_module, "_inference_adds_nothing", lambda *args: False)
        patch.setattr(index_module, "_inference_cone", lambda *args: None)
        return _specs(build_index(model))


def _inferred_node_counts(model: onnx.ModelProto, monkeypatch) -> list[int]:
    """How many nodes each model shape inference ran on while ``model`` was indexed held."""
    counts = []
    real = index_module._inferred_value_infos
    with monkeypatch.context() as patch:
        patch.setattr(index_module, "_inferred_value_infos", lambda m, *args: counts.append(len(m.graph.node)) or real(m, *args))
        build_index(model)
    return counts


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


def _chain(length: int, *, undeclared: set[str], shape: list = [2, 3]) -> onnx.ModelProto:
    """``length`` Relu nodes in a row behind a Shape → Gather → Reshape (a shape known only by data
    propagation), every value declared as onnx's inference types it except ``undeclared``."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Reshape", ["x", "shape"], ["r0"]),
    ]
    nodes += [helper.make_node("Relu", [f"r{k}"], [f"r{k + 1}"]) for k in range(length)]
    model = make_model(nodes, [value("x", TensorProto.FLOAT, shape)], [value(f"r{length}", TensorProto.FLOAT, shape)])
    model = _annotated(model)
    kept = [info for info in model.graph.value_info if info.name not in undeclared]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    return model


def test_inference_runs_on_the_cone_of_the_untyped_values_only(monkeypatch):
    model = _chain(40, undeclared={"r3"})
    # r3's cone: Shape, Reshape and the three Relu nodes up to r3
    assert _inferred_node_counts(model, monkeypatch) == [5]
    specs = _specs(build_index(model))
    assert specs["r3"] == ((2, 3), TensorProto.FLOAT)
    assert specs == _with_inference_forced(model, monkeypatch)


def test_a_symbol_declared_upstream_is_taken_from_the_cone(monkeypatch):
    # r2 is declared with the symbol whole-model inference made for Reshape's output: r3 inherits it.
    model = _chain(40, undeclared={"r3"}, shape=["N", 3])
    assert _inferred_node_counts(model, monkeypatch) == [5]
    assert _specs(build_index(model)) == _with_inference_forced(model, monkeypatch)


def test_a_symbol_inference_made_up_is_told_from_a_declared_one():
    # a made-up symbol's name depends on the whole run (numbered, chosen to miss every declared symbol), so
    # build_index infers such a cone again on the whole model
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [value("x", TensorProto.FLOAT, ["N", 3])], [value("y", TensorProto.FLOAT, ["N", 3])])
    propagated = [value("y", TensorProto.FLOAT, ["N", 3])]
    made_up = [value("y", TensorProto.FLOAT, ["unk__0", 3])]
    assert not index_module._generates_symbols(model, propagated)
    assert index_module._generates_symbols(model, made_up)


def test_a_symbolic_cone_gets_the_specs_of_whole_model_inference(monkeypatch):
    model = _chain(40, undeclared={"r0", "r7"}, shape=["N", 3])
    assert _specs(build_index(model)) == _with_inference_forced(model, monkeypatch)


def test_a_cone_of_more_than_half_the_graph_runs_inference_on_the_whole_model(monkeypatch):
    model = _chain(10, undeclared={"r9"})
    assert _inferred_node_counts(model, monkeypatch) == [12]
    assert _specs(build_index(model)) == _with_inference_forced(model, monkeypatch)


def test_the_data_propagated_upstream_of_a_cone_gives_the_same_shape():
    # Reshape's output shape comes from Shape's value (data propagation), and Shape's output is declared:
    # the cone still holds the Shape node, so the propagated value is there.
    model = _chain(40, undeclared={"r0"})
    assert build_index(model).spec("r0").shape == (2, 3)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(TESTDATA)) for p in TESTDATA.rglob("*.onnx")))
def test_cone_inference_gives_the_specs_of_whole_model_inference_on_testdata_and_fused_models(path, monkeypatch):
    import sgdfuse

    model = onnx.load(TESTDATA / path)
    fused = sgdfuse.optimize(model, verify=False).model
    for m in (model, fused):
        assert _specs(build_index(m)) == _with_inference_forced(m, monkeypatch)
