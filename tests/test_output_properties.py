"""Properties of the model ``sgdfuse.optimize`` writes, on every real export in ``testdata/torch``.

The rewrite replaces the fused updates and nothing else (docs/design.md: existing graph input and output
names are kept, and a pass never mutates its input):

- graph inputs and outputs keep their names, order and types;
- every original node that is not part of a fused update is still there, byte for byte, in its order; the
  nodes that went are update nodes (their outputs are gone or now come from an SGD node, and none of them
  feeds an output other than the fused ones); in the full training steps the whole forward and backward
  pass survives;
- initializers the updates do not read are kept byte for byte; model metadata and opset imports are kept
  (``ai.sgdfuse`` added);
- the pass is idempotent and deterministic, does not mutate its input, and ``OptimizeResult.save`` round-trips.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import onnx
import pytest

import sgdfuse.api as api

TESTDATA = Path(__file__).resolve().parent.parent / "testdata" / "torch"
ENTRIES = json.loads((TESTDATA / "manifest.json").read_text())["models"]
ALL = [pytest.param(e, id=e["file"][: -len(".onnx")]) for e in ENTRIES]
MLP = [pytest.param(e, id=e["file"][: -len(".onnx")]) for e in ENTRIES if e["file"].startswith("mlp_train_step")]

# What an update sub-graph is written with (testdata/README.md, "Op types in the update sub-graphs").
UPDATE_OP_TYPES = {"Add", "Sub", "Mul", "Div", "Neg", "Identity", "Constant", "Cast", "CastLike", "Reshape", "Gather", "Squeeze"}
# The full training step's update math is only these; everything else (MatMul, Gemm, ReduceSum, Reshape,
# Transpose, Relu, Where, ...) is forward or backward pass and must survive.
MLP_UPDATE_OP_TYPES = {"Add", "Mul", "Identity", "Constant", "CastLike"}


def _load(entry: dict) -> onnx.ModelProto:
    return onnx.load(TESTDATA / entry["file"])


@functools.lru_cache(maxsize=None)
def _result(file: str) -> api.OptimizeResult:
    # One optimisation per model for the tests that only read the output.
    return api.optimize(TESTDATA / file)


def _fused(file: str) -> onnx.ModelProto:
    return _result(file).model


def _update_outputs(entry: dict) -> set[str]:
    names = set()
    for u in entry["updates"]:
        if u["momentum_buffer"] is not None:
            names |= {u["parameter_out"], u["momentum_buffer_out"]}
    return names


def _split_nodes(original: onnx.ModelProto, fused: onnx.ModelProto) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """(kept, removed): original nodes that appear unchanged in ``fused``, and the others."""
    present = {n.SerializeToString() for n in fused.graph.node}
    kept = [n for n in original.graph.node if n.SerializeToString() in present]
    removed = [n for n in original.graph.node if n.SerializeToString() not in present]
    return kept, removed


def _ancestors(model: onnx.ModelProto, roots: set[str]) -> set[int]:
    """Indices of the nodes that (transitively) compute any of ``roots``."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output if o}
    seen: set[int] = set()
    stack = [producer[r] for r in roots if r in producer]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(producer[name] for name in model.graph.node[i].input if name in producer)
    return seen


@pytest.mark.parametrize("entry", ALL)
def test_graph_inputs_and_outputs_keep_names_order_and_types(entry):
    original = _load(entry)
    fused = _fused(entry["file"])
    assert [i.SerializeToString() for i in fused.graph.input] == [i.SerializeToString() for i in original.graph.input]
    assert [o.SerializeToString() for o in fused.graph.output] == [o.SerializeToString() for o in original.graph.output]
    assert [i.name for i in fused.graph.input] == entry["inputs"]
    assert [o.name for o in fused.graph.output] == entry["outputs"]


@pytest.mark.parametrize("entry", ALL)
def test_nodes_outside_the_fused_updates_are_kept_unchanged_and_in_order(entry):
    original = _load(entry)
    fused = _fused(entry["file"])
    kept, removed = _split_nodes(original, fused)

    # Kept nodes keep their relative order.
    position = {n.SerializeToString(): i for i, n in enumerate(fused.graph.node)}
    positions = [position[n.SerializeToString()] for n in kept]
    assert positions == sorted(positions)

    # A node that went was part of an update: each of its outputs is gone from the fused graph, or is a
    # fused update's output now computed by an SGD node.
    produced_by_sgd = {o for n in fused.graph.node if n.domain == "ai.sgdfuse" for o in n.output}
    read_or_produced = {name for n in fused.graph.node for name in (*n.input, *n.output)}
    read_or_produced |= {o.name for o in fused.graph.output}
    update_outputs = _update_outputs(entry)
    for node in removed:
        assert node.op_type in UPDATE_OP_TYPES, node
        for name in node.output:
            assert name not in read_or_produced or (name in update_outputs and name in produced_by_sgd), (node.name, name)


@pytest.mark.parametrize("entry", ALL)
def test_no_removed_node_computes_an_output_other_than_the_fused_updates(entry):
    original = _load(entry)
    fused = _fused(entry["file"])
    _, removed = _split_nodes(original, fused)
    others = {o.name for o in original.graph.output} - _update_outputs(entry)
    needed = {original.graph.node[i].SerializeToString() for i in _ancestors(original, others)}
    assert not [n.name for n in removed if n.SerializeToString() in needed]


@pytest.mark.parametrize("entry", MLP)
def test_full_training_step_keeps_its_forward_and_backward_pass(entry):
    original = _load(entry)
    fused = _fused(entry["file"])
    _, removed = _split_nodes(original, fused)
    assert {n.op_type for n in removed} <= MLP_UPDATE_OP_TYPES
    # Everything that computes the loss is untouched.
    loss_nodes = {original.graph.node[i].SerializeToString() for i in _ancestors(original, {"loss"})}
    assert loss_nodes <= {n.SerializeToString() for n in fused.graph.node}
    # Every matrix product, reduction, reshape, transpose, activation and mask of the backward pass survives
    # (the gradients are computed by MatMul/Gemm and ReduceSum -> Reshape, testdata/README.md).
    backward = [n for n in original.graph.node if n.op_type not in MLP_UPDATE_OP_TYPES]
    assert backward and all(n.SerializeToString() in {m.SerializeToString() for m in fused.graph.node} for n in backward)
    # Each fused node reads a gradient that the kept backward pass computes.
    produced = {o for n in fused.graph.node if n.domain != "ai.sgdfuse" for o in n.output}
    for node in (n for n in fused.graph.node if n.domain == "ai.sgdfuse"):
        assert node.input[1] in produced


@pytest.mark.parametrize("entry", ALL)
def test_initializers_the_updates_do_not_read_are_preserved_byte_for_byte(entry):
    original = _load(entry)
    fused = _fused(entry["file"])
    _, removed = _split_nodes(original, fused)
    read_by_removed = {name for n in removed for name in n.input}
    fused_initializers = {t.name: t.SerializeToString() for t in fused.graph.initializer}
    for tensor in original.graph.initializer:
        if tensor.name in fused_initializers:
            assert fused_initializers[tensor.name] == tensor.SerializeToString(), tensor.name
        else:
            assert tensor.name in read_by_removed, f"{tensor.name} was dropped but no removed node read it"


@pytest.mark.parametrize("entry", ALL)
def test_model_metadata_and_opset_imports_are_preserved(entry):
    original = _load(entry)
    # The exports carry no model-level metadata (the dynamo files carry per-node metadata_props, covered by
    # the node comparison above), so add some to see it survive.
    onnx.helper.set_model_props(original, {"training_run": "42", "owner": "sgdfuse-tests"})
    original.doc_string = "a training step"
    original.producer_name, original.producer_version = "pytorch", "2.13.0"
    original.graph.doc_string = "the graph"
    fused = api.optimize(original).model

    assert [(p.key, p.value) for p in fused.metadata_props] == [(p.key, p.value) for p in original.metadata_props]
    assert (fused.doc_string, fused.producer_name, fused.producer_version) == ("a training step", "pytorch", "2.13.0")
    # Fused nodes call specialised function overloads, which need IR 10; otherwise the IR version is kept.
    ir_version = max(original.ir_version, 10) if entry["expected_momentum_updates"] else original.ir_version
    assert (fused.ir_version, fused.graph.name, fused.graph.doc_string) == (ir_version, original.graph.name, "the graph")
    imports = {(o.domain, o.version) for o in fused.opset_import}
    assert {(o.domain, o.version) for o in original.opset_import} <= imports
    if entry["expected_momentum_updates"]:
        assert imports - {(o.domain, o.version) for o in original.opset_import} == {("ai.sgdfuse", 1)}
    else:
        assert imports == {(o.domain, o.version) for o in original.opset_import}


@pytest.mark.parametrize("entry", ALL)
def test_optimizing_the_output_again_changes_nothing(entry):
    first = _result(entry["file"])
    second = api.optimize(first.model)
    assert second.report.fused == []
    assert second.model.SerializeToString() == first.model.SerializeToString()


@pytest.mark.parametrize("entry", ALL)
def test_the_same_input_gives_byte_identical_output(entry):
    once = _fused(entry["file"]).SerializeToString()
    again = api.optimize(TESTDATA / entry["file"]).model.SerializeToString()
    from_proto = api.optimize(_load(entry)).model.SerializeToString()
    assert once == again == from_proto


@pytest.mark.parametrize("entry", ALL)
def test_optimize_does_not_mutate_the_model_it_is_given(entry):
    model = _load(entry)
    before = model.SerializeToString()
    api.optimize(model)
    assert model.SerializeToString() == before
    api.inspect(model, verify=True)
    assert model.SerializeToString() == before


@pytest.mark.parametrize("entry", ALL)
def test_inspect_reports_what_optimize_fuses_and_rewrites_nothing(entry):
    optimized = _result(entry["file"]).report
    inspected = api.inspect(TESTDATA / entry["file"])
    assert [f.parameters_out for f in inspected.fused] == [f.parameters_out for f in optimized.fused]
    assert [(r.candidate, r.reason) for r in inspected.refused] == [(r.candidate, r.reason) for r in optimized.refused]
    assert inspected.written is False
    assert inspected.nodes_after == inspected.nodes_before


@pytest.mark.parametrize("entry", ALL)
def test_optimize_result_save_writes_a_file_that_loads_back_equal(entry, tmp_path):
    result = _result(entry["file"])
    destination = tmp_path / "fused.onnx"
    result.save(destination)
    assert onnx.load(destination).SerializeToString() == result.model.SerializeToString()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.onnx"]  # no temporary files left
