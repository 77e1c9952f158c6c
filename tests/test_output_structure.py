"""The output guard's native pass (sgdfuse.passes.scan.native_structure) decides as its Python pass does.

The guard checks single assignment and definition before use over the rewritten graph and finds the plans' new
nodes in it (sgdfuse.passes.output_check): natively from the output's bytes, or through the node table and
protobuf (``_through_the_table``, built on ``_structure``, the reference). These tests hold the native pass to
the reference on every testdata model and its fused output, on the benchmark's graphs, and on generated graphs
whose names break the rules in every way (read before defined, defined twice, an omitted input or output, a
subgraph reading a later value, a graph output nothing defines, names that are not UTF-8, a graph given twice):
the same reason, the same nodes found, the same names and places, and the same partition of the plans into
classes by what the checker sees of them.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from graphs import bench_generator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import sgdfuse
from sgdfuse.passes import output_check, scan

ROOT = Path(__file__).resolve().parent.parent
TESTDATA_MODELS = sorted((ROOT / "testdata").rglob("*.onnx"))


def _both(model: onnx.ModelProto, wanted: list, sizes: list[int], data: bytes | None = None):
    """The native pass and the reference on ``model``'s bytes (``data``: its serialisation by default)."""
    data = model.SerializeToString() if data is None else data
    native = output_check._natively(model, data, wanted, sizes)
    reference = output_check._through_the_table(model, None, wanted, sizes)
    return native, reference


def _same(native, reference) -> None:
    assert native is not None, "the scanner refused bytes protobuf wrote"
    if isinstance(reference, str):
        assert native == reference
        return
    assert not isinstance(native, str), native
    assert native.positions == reference.positions
    assert native.outer == reference.outer
    # Names, places and outputs alike; the nodes' bytes in another form, but equal exactly for the same plans.
    assert [s[1:] for s in native.summaries] == [s[1:] for s in reference.summaries]
    for i, (a, b) in enumerate(zip(native.summaries, reference.summaries)):
        for c, d in zip(native.summaries[i:], reference.summaries[i:]):
            assert (a[0] == c[0]) == (b[0] == d[0])


def _groups(model: onnx.ModelProto, size: int) -> tuple[list, list[int]]:
    """The first outputs of the graph's nodes (None for a node without one) in groups of ``size``."""
    wanted = [node.output[0] if node.output else None for node in model.graph.node]
    sizes = [size] * (len(wanted) // size) + ([len(wanted) % size] if len(wanted) % size else [])
    return wanted, sizes


@pytest.mark.parametrize("path", TESTDATA_MODELS, ids=lambda p: str(p.relative_to(ROOT / "testdata")))
def test_every_testdata_model_and_its_output_read_alike(path):
    model = onnx.load(path, load_external_data=False)
    for size in (1, 2, 3):
        _same(*_both(model, *_groups(model, size)))
    fused = sgdfuse.optimize(model, verify=False).model
    _same(*_both(fused, *_groups(fused, 2)))


def _bench_generate():
    return bench_generator()


def test_a_fused_bench_graph_reads_alike_and_its_plans_group_alike():
    model, _ = _bench_generate().build(200, seed=3)
    result = sgdfuse.optimize(model, verify=False)
    output = result.model
    # The plans' nodes as the guard asks for them: the SGD nodes with what precedes them.
    wanted, sizes = [], []
    for node in output.graph.node:
        if node.op_type == "SGD":
            sizes.append(1)
            wanted.append(node.output[0])
    _same(*_both(output, wanted, sizes))
    _same(*_both(output, *_groups(output, 2)))


_NAMES = ["a", "b", "c", "x", "y", "", "z"]


@st.composite
def _graphs(draw) -> onnx.ModelProto:
    """Small graphs over a few names, most of them breaking a rule somewhere."""
    inputs = draw(st.lists(st.sampled_from(["a", "b", ""]), max_size=2, unique=True))
    initializers = draw(st.lists(st.sampled_from(["c", "w"]), max_size=1))
    nodes = []
    for k in range(draw(st.integers(0, 6))):
        ins = draw(st.lists(st.sampled_from(_NAMES), max_size=3))
        outs = draw(st.lists(st.sampled_from(_NAMES + [f"n{k}", f"m{k}"]), max_size=2))
        if draw(st.booleans()) and k % 3 == 0:
            # A subgraph reading from outside: an earlier value, or a later one.
            outer = draw(st.sampled_from(_NAMES[:-2] + [f"n{k + 1}"]))
            body = helper.make_graph([helper.make_node("Identity", [outer], ["t"])], "then", [],
                                     [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
            other = helper.make_graph([helper.make_node("Identity", ["a"], ["e"])], "else", [],
                                      [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
            nodes.append(helper.make_node("If", ins[:1] or ["a"], outs or [f"n{k}"], then_branch=body, else_branch=other))
        else:
            nodes.append(helper.make_node("Op", ins, outs, domain=draw(st.sampled_from(["", "d"])),
                                          **({"alpha": draw(st.sampled_from([0.5, 1.5]))} if draw(st.booleans()) else {})))
    outputs = draw(st.lists(st.sampled_from(_NAMES + ["n0", "n1", "m2"]), max_size=2))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[helper.make_tensor(n, TensorProto.FLOAT, [], [1.0]) for n in initializers],
    )
    if draw(st.booleans()):
        graph.sparse_initializer.append(helper.make_sparse_tensor(
            helper.make_tensor(draw(st.sampled_from(["s", "x"])), TensorProto.FLOAT, [1], [1.0]),
            helper.make_tensor("", TensorProto.INT64, [1], [0]), [2]))
    return helper.make_model(graph)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_graphs(), st.integers(1, 3), st.data())
def test_generated_graphs_break_the_rules_alike(model, size, data):
    wanted, sizes = _groups(model, size)
    # Some wanted names nothing outputs first, some wanted twice.
    wanted = [data.draw(st.sampled_from([w, "nothing", "x"])) if w is not None else None for w in wanted]
    _same(*_both(model, wanted, sizes))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + (_varint(len(payload)) + payload if wire_type == 2 else payload)


def _node(inputs: list[bytes], outputs: list[bytes]) -> bytes:
    return b"".join(_field(1, 2, n) for n in inputs) + b"".join(_field(2, 2, n) for n in outputs) + _field(4, 2, b"Op")


@pytest.mark.parametrize(
    "graphs",
    [
        # Names that are not UTF-8 (bytes to protobuf's Python API), defined and read.
        [_field(11, 2, _field(1, 2, b"\xff")) + _field(1, 2, _node([b"\xff"], [b"y\xfe"])) + _field(1, 2, _node([b"y\xfe"], [b"z"]))],
        # ... read before it is defined, and defined twice.
        [_field(1, 2, _node([b"\xfe"], [b"y"]))],
        [_field(11, 2, _field(1, 2, b"\xff")) + _field(1, 2, _node([], [b"\xff"]))],
        # A graph given twice (merged): the second one's input defines what the first one's node reads.
        [_field(1, 2, _node([b"late"], [b"y"])), _field(11, 2, _field(1, 2, b"late"))],
        # A value info's name given twice (the last one counts), a graph output not defined.
        [_field(11, 2, _field(1, 2, b"first") + _field(1, 2, b"second")) + _field(1, 2, _node([b"second"], [b"y"])) + _field(12, 2, _field(1, 2, b"q"))],
        [_field(11, 2, _field(1, 2, b"first") + _field(1, 2, b"second")) + _field(1, 2, _node([b"first"], [b"y"]))],
        # An initializer's name (TensorProto field 8), a sparse initializer's values given twice (merged).
        [_field(5, 2, _field(8, 2, b"w")) + _field(15, 2, _field(1, 2, _field(8, 2, b"s1")) + _field(1, 2, _field(8, 2, b"s2")))
         + _field(1, 2, _node([b"w", b"s2", b""], [b"", b"y"]))],
        [_field(15, 2, _field(1, 2, _field(8, 2, b"s1")) + _field(1, 2, _field(8, 2, b"s2"))) + _field(1, 2, _node([b"s1"], [b"y"]))],
    ],
)
def test_hand_encoded_models_read_alike(graphs):
    data = b"".join(_field(7, 2, g) for g in graphs)
    model = onnx.ModelProto()
    model.ParseFromString(data)
    _same(*_both(model, *_groups(model, 1), data=data))


def test_malformed_bytes_are_refused_and_the_table_read_instead():
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], []))
    data = model.SerializeToString()
    with pytest.raises(scan.ScanError):
        scan.native_structure(data[:-3], ["y"], [1], lambda position: [])
    assert output_check._natively(model, data[:-3], ["y"], [1]) is None


def test_what_a_subgraph_reads_is_asked_of_the_callback_and_its_errors_propagate():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], []))

    def broken(position):
        raise RuntimeError("from the callback")

    with pytest.raises(RuntimeError, match="from the callback"):
        scan.native_structure(model.SerializeToString(), ["y"], [1], broken)
    assert scan.native_structure(model.SerializeToString(), ["y"], [1], lambda p: [["x"]]).error is None
    assert scan.native_structure(model.SerializeToString(), ["y"], [1], lambda p: [["x", "q", "p"]]).error == ("subgraph", ["q", "p"])
