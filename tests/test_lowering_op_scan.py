"""The native GE op reader (sgdfuse/lowering/_opscan.cc, ``sgdfuse.lowering.op_scan``) gives what the Python
reader of ``sgdfuse.lowering.parts`` gives, and refuses what it does not read, so that the Python reader's
answer, or its error, is what the lowering check sees.

Expected values come from the Python reader (the reference, itself checked against protobuf's own parse by
the lowering check's tests) and, for the bytes made here, from protobuf.
"""

from __future__ import annotations

import pytest

import sgdfuse
from sgdfuse.lowering import ge_ir, op_scan
from sgdfuse.lowering.parts import _read_ops, _read_python_ops
from test_lowering_support import MODEL_PATHS, fused

FIELDS = ("spans", "names", "types", "bodies", "sources", "position", "net_output")



@pytest.fixture(autouse=True)
def _reader_builds() -> None:
    # Fail, not skip, when the reader cannot be built: a skip would hide a broken build (as for the scanners).
    assert op_scan.native_available(), "the native GE op reader does not build here (or SGDFUSE_NATIVE_SCAN=0)"


def _same(data: bytes) -> None:
    python_bodies, native_bodies = {}, {}
    expected = _read_python_ops(data, python_bodies)
    found = op_scan.read_ops(data, native_bodies)
    assert found is not None, "the native reader refused sgdfuse's own bytes"
    read = _read_ops(data, {})
    for field in FIELDS:
        assert getattr(read, field) == getattr(expected, field), field
    assert native_bodies == python_bodies


@pytest.mark.parametrize("path", MODEL_PATHS, ids=lambda p: p.stem)
def test_the_native_reader_reads_every_lowered_testdata_graph_as_the_python_reader_does(path):
    lowered = sgdfuse.lower(fused(path), soc="Ascend910B2")
    _same(lowered.graph_bytes())
    _same(lowered.graph_bytes(init=True))


def _graph(*ops) -> bytes:
    graph = ge_ir.GraphDef(name="g")
    graph.op.extend(ops)
    return graph.SerializeToString(deterministic=True)


def _data(name: str, index: int):
    op = ge_ir.OpDef(name=name, type="Data")
    op.attr["index"].i = index
    op.attr["_output_name_key"].list.s.append(b"y")
    op.output_desc.add(name="y", dtype=1)
    return op


def _reader(name: str, *inputs: str):
    op = ge_ir.OpDef(name=name, type="Relu")
    op.input.extend(inputs)
    return op


def test_data_ops_that_differ_only_in_index_have_one_body():
    data = _graph(_data("a", 0), _data("b", 1), _reader("r", "a:0", "b:0", "a:-1", ""))
    ops = _read_ops(data, {})
    assert ops.bodies[0] == ops.bodies[1] != ops.bodies[2]
    assert ops.sources[2] == [(0, 0), (1, 0), (0, -1), (-1, 0)]
    _same(data)


@pytest.mark.parametrize("edge", ["a:+1", "a: 1", "a:1_0", "a:", "a", "a:１"])
def test_an_edge_index_python_reads_by_its_own_rules_is_left_to_python(edge):
    data = _graph(_data("a", 0), _reader("r", edge))
    assert op_scan.read_ops(data, {}) is None
    try:
        expected = _read_python_ops(data, {})
    except ValueError as error:  # int() refuses it: so does the lowering check, the same way
        with pytest.raises(type(error)):
            _read_ops(data, {})
        return
    assert _read_ops(data, {}).sources == expected.sources


def test_a_data_op_whose_index_is_not_where_canonical_bytes_put_it_is_left_to_python():
    # The index entry after a descriptor (not the layout protobuf's deterministic serialisation writes): the
    # Python reader cuts it from a parsed copy; the native one refuses the graph.
    op = _data("a", 3)
    del op.attr["index"]
    body = op.SerializeToString(deterministic=True)
    entry = ge_ir.OpDef()
    entry.attr["index"].i = 3
    data = bytes([0x32]) + bytes([len(body) + len(entry.SerializeToString())]) + body + entry.SerializeToString()
    other = _graph(_data("b", 4))
    assert op_scan.read_ops(data + other, {}) is None
    expected = _read_python_ops(data + other, {})
    assert expected.bodies[0] == expected.bodies[1]  # the index left out either way
    assert _read_ops(data + other, {}).bodies == expected.bodies


def test_an_op_name_that_is_not_utf8_gets_the_python_reader_s_error():
    graph = ge_ir.GraphDef()
    op = graph.op.add(type="Relu")
    op.name = "x"
    data = graph.SerializeToString().replace(b"\x0a\x01x", b"\x0a\x01\xff")
    assert op_scan.read_ops(data, {}) is None
    with pytest.raises(UnicodeDecodeError):
        _read_ops(data, {})


def test_bodies_are_numbered_across_the_graphs_of_one_model():
    # The step and init graphs share their body numbers: a Variable op of one class has one number in both.
    lowered = sgdfuse.lower(fused(MODEL_PATHS[0]), soc="Ascend910B2")
    bodies: dict = {}
    step, init = _read_ops(lowered.graph_bytes(), bodies), _read_ops(lowered.graph_bytes(init=True), bodies)
    step_variables = {step.bodies[k] for k, t in enumerate(step.types) if t == "Variable"}
    init_variables = {init.bodies[k] for k, t in enumerate(init.types) if t == "Variable"}
    assert step_variables == init_variables


def test_the_reader_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SGDFUSE_NATIVE_SCAN", "0")
    assert not op_scan.native_available()
    assert op_scan.read_ops(_graph(_data("a", 0)), {}) is None
