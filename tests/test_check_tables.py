"""``sgdfuse check`` reads each model's nodes once, from the node table (``sgdfuse.passes.scan.node_table``), where
it used to read them through protobuf at every stage (issue 12). Each fact it now takes from the table, or
reads once per distinct value, is held here to what protobuf's Python API reads of the same model:

- the class description of every node (``verify._describe_plain_nodes``, filled in ahead from the table) is the
  one ``verify._describe_parts`` makes from the node itself;
- the fused side's op types, domains and SGD nodes, and the probes added to it, are the nodes' own;
- the constant ``stat`` and ``momentum`` values an SGD node's overload is checked against are those read
  without the shared values and the side's producers;
- the declared input and output types (``verify._declarations``, parsed once per distinct type) are each
  value info's own, read field by field as before.

On every testdata model, on its fused form, and on small models made here with what the bench has not: a node
holding a subgraph, omitted optional inputs and outputs, attributes of several kinds.
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
from sgdfuse import verify  # noqa: E402
from sgdfuse.fused_op import DOMAIN, OP_TYPE  # noqa: E402

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"
MODELS = sorted(TESTDATA.rglob("*.onnx"))


def _small_models() -> list[onnx.ModelProto]:
    """A model with an ``If`` holding subgraphs, a node with omitted optional inputs and outputs, and
    attributes of several types; and one momentum-SGD update with a Constant (for the fused form)."""
    then_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [graphs.value("t")])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [graphs.value("e")])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Clip", ["x", "", "top"], ["clipped"]),
        helper.make_node("Dropout", ["clipped"], ["dropped", ""], seed=3),
        helper.make_node("Cast", ["dropped"], ["cast"], to=onnx.TensorProto.DOUBLE),
        helper.make_node("Constant", [], ["k"], value_floats=[1.0, 2.0]),
    ]
    sub = graphs.make_model(nodes, [graphs.value("x")], [graphs.value("y"), graphs.value("cast", onnx.TensorProto.DOUBLE),
                                                          graphs.value("k", shape=[2])],
                            [graphs.scalar("zero", 0.0), graphs.scalar("top", 1.0)])
    update = [
        helper.make_node("Constant", [], ["m"], value=numpy_helper.from_array(np.array(0.9, dtype=np.float32))),
        helper.make_node("Mul", ["buf", "m"], ["scaled"]),
        helper.make_node("Add", ["scaled", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    step = graphs.make_model(update, [graphs.value("p"), graphs.value("g"), graphs.value("buf")],
                             [graphs.value("p_out"), graphs.value("buf_out")], [graphs.scalar("lr", 0.01)])
    return [sub, step]


def _cases() -> list[tuple[str, onnx.ModelProto]]:
    cases = []
    for path in MODELS:
        model = onnx.load(str(path), load_external_data=False)
        cases.append((path.name, model))
        try:
            fused = api.optimize(model, verify=False).model
        except Exception:  # a model the pass refuses: its original alone
            continue
        cases.append((path.name + " (fused)", fused))
    for k, model in enumerate(_small_models()):
        cases.append((f"small {k}", model))
        cases.append((f"small {k} (fused)", api.optimize(model, verify=False).model))
    return cases


@pytest.fixture(scope="module")
def cases() -> list[tuple[str, onnx.ModelProto]]:
    found = _cases()
    assert len(found) > len(MODELS)
    return found


def _content(cache: dict, entry):
    """An entry of a description cache with its interned number replaced by what it stands for."""
    inverse = {number: content for content, number in cache.get("interned", {}).items()}
    number, values = entry
    return inverse[number], values


def test_descriptions_from_the_table_are_the_nodes_own(cases):
    checked = attributed = probes = 0
    for label, model in cases:
        side = verify._Side.of(model)
        graph_inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
        try:
            verify._fused_views(side, graph_inputs)  # adds the probes (Identity nodes) of a fused model
        except ValueError:
            pass
        probes += len(side.copies)
        ahead: dict = {}
        verify._describe_plain_nodes(side, ahead)
        for node in side.nodes:
            read: dict = {}
            parts = verify._Parts([node], [], [], [], None)
            described = verify._describe_parts(parts, lambda name: None, {}, read)
            if described is None:  # a node holding a subgraph: never filled in ahead
                assert id(node) not in ahead, (label, node.op_type)
                continue
            assert id(node) in ahead, (label, node.op_type)
            assert _content(ahead, ahead[id(node)]) == _content(read, read[id(node)]), (label, node.name, node.op_type)
            checked += 1
            attributed += bool(node.attribute)
    assert checked > 1000 and attributed > 100 and probes > 100


def test_a_node_holding_a_subgraph_is_left_to_describe(cases):
    model = dict(cases)["small 0"]
    side = verify._Side.of(model)
    ahead: dict = {}
    verify._describe_plain_nodes(side, ahead)
    node = next(node for node in side.nodes if node.op_type == "If")
    assert id(node) not in ahead
    parts = verify._Parts([node], [], [], [], None)
    assert verify._describe_parts(parts, lambda name: None, {}, ahead) is None


def test_the_fused_side_tables_are_the_nodes_own(cases):
    for label, model in cases:
        side = verify._Side.of(model)
        graph_inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
        try:
            verify._fused_views(side, graph_inputs)
        except ValueError:  # an SGD node writing a state that is not a graph input
            pass
        assert side.op_types == [node.op_type for node in side.nodes], label
        assert side.domains == [node.domain for node in side.nodes], label
        assert verify._sgd_positions(side) == [k for k, node in enumerate(side.nodes) if node.domain == DOMAIN and node.op_type == OP_TYPE]
        assert side.reads == [verify._node_reads(node) for node in side.nodes], label
        assert side.writes == [[o for o in node.output if o] for node in side.nodes], label
        assert side.producer == {o: k for k, node in enumerate(side.nodes) for o in node.output if o}, label
        assert side.subgraph == [verify._holds_subgraph(node) for node in side.nodes], label


def test_overload_constants_are_those_read_each_time(cases):
    compared = 0
    for label, model in cases:
        side = verify._Side.of(model)
        sgd = [side.nodes[k] for k in verify._sgd_positions(side)]
        if not sgd:
            continue
        shared = verify._ConstantInputs(model.graph, verify._Producers(side))
        for node in sgd:
            for position in (4, 5):
                name = node.input[position] if len(node.input) > position else ""
                if not name:
                    continue
                alone = verify._ConstantInputs(model.graph).value(name)  # a fresh table: nothing shared
                got = shared.value(name)
                assert (got is None) == (alone is None), (label, name)
                if got is not None:
                    assert got.dtype == alone.dtype and got.shape == alone.shape and got.tobytes() == alone.tobytes(), (label, name)
                    compared += 1
            assert verify._overload_input_problem(node, shared) == verify._overload_input_problem(node, verify._ConstantInputs(model.graph))
    assert compared > 50


def test_positive_zero_is_what_numpy_says():
    for value in (np.zeros(1), np.zeros(3), np.array([-0.0]), np.array([0.0, -0.0]), np.array([np.nan]), np.zeros(0),
                  np.array([1e-300]), np.zeros((2, 2)), np.array([0.0, 1.0])):
        wanted = value.size != 0 and not np.any(value != 0) and not np.any(np.signbit(value))
        constants = verify._ConstantInputs(onnx.GraphProto())
        assert verify._all_positive_zero(value) == wanted, value
        assert constants.holds(verify._all_positive_zero, value) == wanted, value
        assert constants.holds(verify._all_positive_zero, value.copy()) == wanted, value  # from the memo


def _declared_by_field(model: onnx.ModelProto) -> dict:
    """The declared specs as ``_declarations`` read them before: every value info's type read field by field."""
    specs = {}
    for info in list(model.graph.input) + list(model.graph.output):
        tensor_type = info.type.tensor_type
        if not info.type.HasField("tensor_type") or info.name in specs:
            continue
        shape = None
        if tensor_type.HasField("shape"):
            shape = tuple(int(d.dim_value) if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
                          for d in tensor_type.shape.dim)
        specs[info.name] = (shape, tensor_type.elem_type)
    for tensor in model.graph.initializer:
        specs[tensor.name] = (tuple(int(d) for d in tensor.dims), tensor.data_type)
    return specs


def test_declared_types_are_each_value_infos_own(cases):
    for label, model in cases:
        index = verify._declarations(model)
        assert {name: (spec.shape, spec.dtype) for name, spec in index.specs.items()} == _declared_by_field(model), label


def test_declared_types_of_every_kind():
    dims = onnx.TensorShapeProto(dim=[onnx.TensorShapeProto.Dimension(dim_value=2), onnx.TensorShapeProto.Dimension(dim_param="n"),
                                      onnx.TensorShapeProto.Dimension()])
    inputs = [
        helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, "n", None]),
        helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT16, None),  # no shape
        helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, []),  # rank 0
        helper.make_value_info("d", helper.make_sequence_type_proto(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [1]))),
        onnx.ValueInfoProto(name="e"),  # no type at all
        helper.make_tensor_value_info("a", onnx.TensorProto.INT64, [5]),  # a second declaration: the first kept
    ]
    graph = helper.make_graph([helper.make_node("Identity", ["a"], ["y"])], "g", inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    graph.input[0].type.tensor_type.shape.CopyFrom(dims)
    model = helper.make_model(graph)
    index = verify._declarations(model)
    assert {name: (spec.shape, spec.dtype) for name, spec in index.specs.items()} == _declared_by_field(model)
    assert index.specs["a"].shape == (2, "n", None) and "d" not in index.specs and "e" not in index.specs


@pytest.mark.parametrize("native", ["1", "0"])
def test_check_names_a_node_name_that_is_not_utf8(native, tmp_path, monkeypatch):
    # check hands its node tables to the names' check: the same refusal as before, with the native scanner and
    # without it; and a table listing every node's name (made with the prefix "") is read as those names.
    import test_model_names_utf8 as names

    monkeypatch.setenv("SGDFUSE_NATIVE_SCAN", native)
    model = names._update_model()
    model.graph.node.append(helper.make_node("Identity", ["p"], ["p_copy"], name="NODENAME"))
    model.graph.output.append(helper.make_tensor_value_info("p_copy", onnx.TensorProto.FLOAT, [4, 3]))
    path = names._with_bytes(model, b"NODENAME", tmp_path / "bad_node.onnx")
    code, err = names._run(["check", path, path])
    assert code == 1 and err.startswith(f"error: {path}: the name of node #") and "(b'\\xff\\xfe" in err and "not valid UTF-8" in err, err
    from sgdfuse.errors import ModelNameError
    from sgdfuse.passes.index import require_text_names
    from sgdfuse.passes.scan import node_table

    loaded = onnx.load(str(path))
    for table in (node_table(loaded), node_table(loaded, name_prefix=""), node_table(loaded, name_prefix="sgdfuse/")):
        with pytest.raises(ModelNameError) as raised:
            require_text_names(loaded, table=table)
        assert raised.value.args == pytest.raises(ModelNameError, require_text_names, loaded).value.args


def test_nonzero_is_what_numpy_says():
    for value in (np.array([0.9]), np.zeros(1), np.array([-0.0]), np.array([np.nan]), np.zeros(0), np.array([1.0, 0.0]),
                  np.array([[0.5, -0.5]])):
        wanted = value.size != 0 and not np.any(value == 0)
        constants = verify._ConstantInputs(onnx.GraphProto())
        assert verify._all_nonzero(value) == wanted, value
        assert constants.holds(verify._all_nonzero, value) == wanted, value
        assert constants.holds(verify._all_positive_zero, value.copy()) == (value.size != 0 and not np.any(value != 0)
                                                                            and not np.any(np.signbit(value))), value


def test_non_negative_inputs_through_the_probes_as_through_their_nodes(cases):
    for label, model in cases:
        side = verify._Side.of(model)
        graph_inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
        try:
            verify._fused_views(side, graph_inputs)
        except ValueError:
            continue
        known = len(side.nodes) - len(side.copies)
        through_copies = verify.non_negative_inputs(side.nodes[:known], op_types=side.op_types[:known], identities=side.copies)
        assert through_copies == verify.non_negative_inputs(side.nodes), label
    # A chain through Identity and Cast to a BatchNormalization's variance, and an Identity probe of it.
    nodes = [helper.make_node("Identity", ["v"], ["v1"]), helper.make_node("Cast", ["v1"], ["v2"], to=onnx.TensorProto.FLOAT),
             helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v2"], ["y"])]
    assert verify.non_negative_inputs(nodes) == {"v2", "v1", "v"}
    assert verify.non_negative_inputs(nodes[1:], identities=[("v", "v1")]) == {"v2", "v1", "v"}
