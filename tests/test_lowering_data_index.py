"""Lower's check of the ``Data`` ops' ``index`` (``sgdfuse.lowering.verify._data_indices_differ``) gives the same
answer whether it walks every field of the graph or, given the ops the parts' reader read, only the bytes
between the ops (``_fields_between``), and falls back to the whole walk where those bytes are not the ops'
canonical headers and other fields. ``GEModel.op_count`` counts what protobuf parses.

Expected values: the full walk of every field (the check as it was) and protobuf's own parse, on graphs made here
with protobuf or edited byte by byte.
"""

from __future__ import annotations

import pytest

import sgdfuse
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.ge_model import GEModel
from sgdfuse.lowering.graph_builder import encode_varint
from sgdfuse.lowering.parts import _read_ops
from sgdfuse.lowering.verify import _data_indices_differ, _fields_between
from test_lowering_support import MODEL_PATHS, fused

_OP_FIELD = ge_ir.GraphDef.DESCRIPTOR.fields_by_name["op"].number


def _both(data: bytes) -> str:
    """The answer with the ops given, after checking it is the whole walk's."""
    try:
        ops = _read_ops(data, {})
    except Exception:  # what lower's check does then (verify._verify): the whole walk alone
        ops = None
    fast = _data_indices_differ(data if ops is None else ops.data, "step", ops)
    assert fast == _data_indices_differ(data, "step")
    return fast


def _data(name: str, index: int | None, size: int = 1):
    op = ge_ir.OpDef(name=name, type="Data")
    if index is not None:
        op.attr["index"].i = index
    op.attr["_output_name_key"].list.s.append(b"y")
    op.output_desc.add(name="y", dtype=1).shape.dim.extend([7] * size)  # size: a long op (two-, three-byte lengths)
    return op


def _graph(ops, inputs) -> bytes:
    graph = ge_ir.GraphDef(name="g")
    graph.input.extend(inputs)
    graph.op.extend(ops)
    graph.op.add(name="r", type="Relu", input=[f"{op.name}:0" for op in ops])
    graph.output.append("r:0")
    return graph.SerializeToString(deterministic=True)


@pytest.mark.parametrize("path", MODEL_PATHS[:12], ids=lambda p: p.stem)
def test_lowered_testdata_graphs_take_the_short_walk_and_pass(path):
    lowered = sgdfuse.lower(fused(path), soc="Ascend910B2")
    for init in (False, True):
        ops = _read_ops(lowered.graph_bytes(init=init), {})
        assert _fields_between(ops, _OP_FIELD) is not None
        assert _both(ops.data) == ""


def test_swapped_indices_are_found_by_the_short_walk():
    data = _graph([_data("a", 1), _data("b", 0, size=40), _data("c", 2, size=3000)], ["a:0", "b:0", "c:0"])
    assert _fields_between(_read_ops(data, {}), _OP_FIELD) is not None
    assert "Data op a has index 1, but it is graph input 0" in _both(data)


def test_a_missing_index_and_a_data_op_not_in_the_input_list_are_found():
    # A Data op without an index is refused by the parts' reader (KeyError): lower's check then walks the whole
    # graph first, so the index's absence is what it reports, as before the reader was reused.
    with pytest.raises(KeyError):
        _read_ops(_graph([_data("a", 0), _data("b", None)], ["a:0", "b:0"]), {})
    assert "Data op b has index None" in _both(_graph([_data("a", 0), _data("b", None)], ["a:0", "b:0"]))
    assert "Data op b is not in its input list" in _both(_graph([_data("a", 0), _data("b", 1)], ["a:0"]))
    assert _both(_graph([_data("a", 0), _data("b", 1, size=200)], ["a:0", "b:0"])) == ""


def _op_fields(data: bytes) -> list[tuple[int, int, int]]:
    """(tag, field start, field end) of every top-level field."""
    from sgdfuse.lowering.ge_model import read_varint

    fields, pos = [], 0
    while pos < len(data):
        begin = pos
        tag, pos = read_varint(data, pos)
        length, pos = read_varint(data, pos)
        pos += length
        fields.append((tag, begin, pos))
    return fields


def test_an_input_field_between_the_ops_is_read_by_the_short_walk():
    # Non-canonical: the last input entry moved between the two Data ops (protobuf reads it all the same).
    data = _graph([_data("a", 0), _data("b", 1)], ["a:0", "b:0"])
    fields = _op_fields(data)
    inputs = [f for f in fields if f[0] >> 3 == 4]
    ops = [f for f in fields if f[0] >> 3 == _OP_FIELD]
    moved = inputs[-1]
    edited = data[: moved[1]] + data[moved[2]: ops[0][2]] + data[moved[1]: moved[2]] + data[ops[0][2]:]
    assert list(ge_ir.GraphDef.FromString(edited).input) == ["a:0", "b:0"]
    assert _fields_between(_read_ops(edited, {}), _OP_FIELD) is not None
    assert _both(edited) == ""
    # and with the indices swapped, the entry between the ops still counts
    swapped = _graph([_data("a", 1), _data("b", 0)], ["a:0", "b:0"])
    fields = _op_fields(swapped)
    moved, first = [f for f in fields if f[0] >> 3 == 4][-1], [f for f in fields if f[0] >> 3 == _OP_FIELD][0]
    edited = swapped[: moved[1]] + swapped[moved[2]: first[2]] + swapped[moved[1]: moved[2]] + swapped[first[2]:]
    assert "Data op a has index 1" in _both(edited)


def test_an_op_length_written_as_an_overlong_varint_falls_back_to_the_whole_walk():
    data = _graph([_data("a", 1), _data("b", 0)], ["a:0", "b:0"])
    fields = _op_fields(data)
    tag, begin, end = [f for f in fields if f[0] >> 3 == _OP_FIELD][1]
    length = end - begin - 2
    assert length < 0x80
    edited = data[:begin + 1] + bytes([length | 0x80, 0]) + data[begin + 2:]  # the same length in two bytes
    assert len(ge_ir.GraphDef.FromString(edited).op) == 3
    ops = _read_ops(edited, {})
    assert _fields_between(ops, _OP_FIELD) is None
    assert "Data op a has index 1" in _both(edited)


@pytest.mark.parametrize("sizes", [(1, 1), (40, 1), (3000, 2), (1, 300000)])
def test_op_count_counts_what_protobuf_parses(sizes):
    graph = ge_ir.GraphDef(name="g")
    graph.input.extend(["a:0", "b:0"])
    graph.op.extend([_data("a", 0, size=sizes[0]), _data("b", 1, size=sizes[1])])
    model = ge_ir.ModelDef(name="m")
    model.graph.append(graph)
    data = model.SerializeToString(deterministic=True)
    lowered = sgdfuse.lower(fused(MODEL_PATHS[0]), soc="Ascend910B2")
    probe = GEModel(model=data, init_model=lowered.init_bytes(), soc=lowered.soc, product_line=lowered.product_line,
                    inputs=[], outputs=[], state=[], init_inputs={}, sgd_ops=[])
    assert probe.op_count() == len(ge_ir.ModelDef.FromString(data).graph[0].op) == 2
    assert encode_varint(len(graph.op[1].SerializeToString())) is not None


@pytest.mark.parametrize("edit", ["swap", "drop"])
def test_lower_s_check_fails_a_data_op_index_swapped_or_dropped(edit):
    # Through verify_lowering: the swap is read by the short walk, the dropped index (which the parts' reader
    # refuses) by the whole walk; each was caught before the reader was reused, with the same message.
    from sgdfuse.lowering.verify import verify_lowering

    model = fused(next(p for p in MODEL_PATHS if p.stem == "mlp_train_step_dynamo"))
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    first, second = [op for op in lowered.graph.op if op.type == "Data"][:2]
    if edit == "swap":
        first.attr["index"].i, second.attr["index"].i = second.attr["index"].i, first.attr["index"].i
    else:
        del second.attr["index"]
    check = verify_lowering(model, lowered)
    assert not check.passed
    assert f"Data op {first.name if edit == 'swap' else second.name} has index" in check.message, check.message
