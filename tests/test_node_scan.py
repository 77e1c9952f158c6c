"""The node table (sgdfuse.passes.scan): the native scanner, the protobuf-API reader and protobuf itself agree.

The expected table (and the node names under a prefix, ``_protobuf_names``) is read here through protobuf's
Python API field by field (``_protobuf_rows``), which is the independent tool: both readers must return exactly
what protobuf returns for the same bytes, including for
hand-encoded wire data that exercises protobuf's parsing rules (repeated and duplicated fields, wrong wire
types, unknown fields and groups, enum values outside AttributeType, text that is not UTF-8).

The native build is not optional here: a failed build fails these tests (CI has g++ and Python's headers).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from graphs import bench_generator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

import sgdfuse
from sgdfuse.passes import scan

ROOT = Path(__file__).resolve().parent.parent
TESTDATA_MODELS = sorted((ROOT / "testdata").rglob("*.onnx"))


def _protobuf_rows(model: onnx.ModelProto) -> list[tuple]:
    """Per node: what protobuf's Python API returns for op_type, domain, input, output, attribute, and whether
    an attribute holds a graph (type GRAPH/GRAPHS, or g set, or graphs not empty)."""
    rows = []
    for node in model.graph.node:
        subgraph = any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) or a.HasField("g") or len(a.graphs) > 0
            for a in node.attribute
        )
        rows.append((node.op_type, node.domain, tuple(node.input), tuple(node.output), len(node.attribute) > 0, subgraph))
    return rows


def _protobuf_non_text_name(model: onnx.ModelProto) -> int:
    """The first node whose name or one of whose attributes' names protobuf returns as bytes (not UTF-8); -1."""
    for k, node in enumerate(model.graph.node):
        if not isinstance(node.name, str) or any(not isinstance(a.name, str) for a in node.attribute):
            return k
    return -1


def _protobuf_details(model: onnx.ModelProto) -> list[tuple]:
    """Per node: its overload and each attribute, as protobuf parses them."""
    return [(node.overload, list(node.attribute)) for node in model.graph.node]


def _parsed_details(table: scan.NodeTable) -> list[tuple]:
    """The table's details with each attribute's bytes parsed by protobuf (the bytes as they stand in a
    hand-encoded model can differ from protobuf's serialisation of the attribute they parse to)."""
    rows = []
    for overload, attributes in table.details:
        parsed = []
        for data in attributes:
            attribute = onnx.AttributeProto()
            attribute.ParseFromString(data)
            parsed.append(attribute)
        rows.append((overload, parsed))
    return rows


def _rows(table: scan.NodeTable) -> list[tuple]:
    return list(zip(table.op_types, table.domains, table.inputs, table.outputs, table.has_attributes, table.has_subgraph))


PREFIXES = ("", "sgdfuse/", "n", "名")


def _protobuf_names(model: onnx.ModelProto, prefix: str) -> tuple:
    """The node names protobuf returns that start with ``prefix`` (a name that is not UTF-8 comes back as bytes
    and is compared as UTF-8 bytes)."""
    names = []
    for node in model.graph.node:
        name = node.name
        if (name.startswith(prefix) if isinstance(name, str) else name.startswith(prefix.encode())):
            names.append(name)
    return tuple(names)


def _check_all_readers(model: onnx.ModelProto, data: bytes) -> scan.NodeTable:
    """Every reader gives protobuf's rows and prefixed names for ``model`` (parsed from ``data``); returns the
    native table."""
    expected = _protobuf_rows(model)
    native = scan.native_node_table(data)
    assert native.reader == "native"
    assert _rows(native) == expected
    assert native.non_text_name == scan.python_node_table(model).non_text_name == _protobuf_non_text_name(model)
    assert native.details is None
    detailed = scan.native_node_table(data, details=True)
    assert _rows(detailed) == expected and detailed.details == scan.python_node_table(model, details=True).details
    assert _parsed_details(detailed) == _protobuf_details(model)
    assert native.prefixed_names is None
    assert _rows(scan.python_node_table(model)) == expected
    from_bytes = scan.node_table(model, data)
    assert from_bytes.reader == "native" and _rows(from_bytes) == expected
    reserialised = scan.node_table(model)
    assert reserialised.reader == "native" and _rows(reserialised) == expected
    for prefix in PREFIXES:
        names = _protobuf_names(model, prefix)
        assert scan.native_node_table(data, name_prefix=prefix).prefixed_names == names
        assert scan.python_node_table(model, name_prefix=prefix).prefixed_names == names
        assert scan.node_table(model, data, name_prefix=prefix) == scan.python_node_table(model, name_prefix=prefix)
    return native


def test_native_scanner_builds_and_loads():
    build = scan.build_scanner()
    assert build.path.is_file()
    assert callable(build.module.scan)


@pytest.mark.parametrize("path", TESTDATA_MODELS, ids=lambda p: str(p.relative_to(ROOT / "testdata")))
def test_every_testdata_model_reads_the_same_through_every_reader(path):
    data = path.read_bytes()
    model = onnx.load_model_from_string(data)
    table = _check_all_readers(model, data)
    assert len(table) == len(model.graph.node) > 0


def test_testdata_holds_models():
    assert len(TESTDATA_MODELS) >= 50


def _bench_generate():
    return bench_generator()


def test_a_generated_bench_graph_and_its_fused_model_with_functions_read_the_same(tmp_path):
    model, _ = _bench_generate().build(60, seed=5)
    path = tmp_path / "bench.onnx"
    onnx.save(model, path)
    data = path.read_bytes()
    _check_all_readers(onnx.load_model_from_string(data), data)
    fused_path = tmp_path / "fused.onnx"
    sgdfuse.optimize(model, verify=False).save(fused_path)
    fused_data = fused_path.read_bytes()
    fused = onnx.load_model_from_string(fused_data)
    assert fused.functions  # the model-local SGD function: skipped by the scanner, not read as nodes
    table = _check_all_readers(fused, fused_data)
    assert "ai.sgdfuse" in table.domains


def _subgraph_model() -> onnx.ModelProto:
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1])])
    body = helper.make_graph(
        [helper.make_node("Add", ["v", "x"], ["v_out"]), helper.make_node("Identity", ["c"], ["c_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1])],
    )
    nodes = [
        helper.make_node("Greater", ["x", "x"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
        helper.make_node("Loop", ["n", "", "y"], ["z"], body=body),
        helper.make_node("Relu", ["z"], ["out"], name="plain"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]), helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_subgraph_nodes_are_flagged_and_their_inner_nodes_are_not_rows():
    model = _subgraph_model()
    data = model.SerializeToString()
    table = _check_all_readers(model, data)
    assert table.op_types == ("Greater", "If", "Loop", "Relu")
    assert table.has_subgraph == (False, True, True, False)
    assert table.inputs[2] == ("n", "", "y")  # an omitted optional input stays ""


def test_external_data_models_read_from_the_file_bytes(tmp_path):
    model, _ = _bench_generate().build(20, seed=1)
    path = tmp_path / "external.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    data = path.read_bytes()
    loaded = onnx.load_model_from_string(data)
    assert any(t.data_location == TensorProto.EXTERNAL for t in loaded.graph.initializer)
    _check_all_readers(loaded, data)
    _check_all_readers(sgdfuse.load_model(path), data)


def test_equal_names_are_one_interned_object():
    model, _ = _bench_generate().build(10, seed=2)
    table = scan.native_node_table(model.SerializeToString())
    seen: dict[str, str] = {}
    total = 0
    for names in (*table.inputs, *table.outputs, table.op_types, table.domains):
        for name in names:
            assert seen.setdefault(name, name) is name
            total += 1
    assert total > 2 * len(seen)  # names do repeat, so identity was checked
    # Interned: the same object sys.intern gives for a fresh copy of the text.
    name = table.outputs[0][0]
    assert sys.intern("".join(list(name))) is name


# --- Hand-encoded wire data: the scanner follows protobuf's parsing rules -----------------------------------


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
    tag = _varint(number << 3 | wire_type)
    return tag + (_varint(len(payload)) + payload if wire_type == 2 else payload)


_names = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "x", "lr", "/Mul_3_output_0", "ñ", "名前", "\x00", "😀"]).map(str),
).map(lambda s: s.encode())
_EDGE_UTF8 = [
    b"\xff", b"\xed\xa0\x80", b"a\xc3", b"\xc0\x80", b"\xc1\xbf", b"\xc2\x80", b"\xdf\xbf", b"\xe0\x80\xaf", b"\xe0\xa0\x80",
    b"\xed\x9f\xbf", b"\xed\xbf\xbf", b"\xee\x80\x80", b"\xef\xbf\xbf", b"\xf0\x8f\xbf\xbf", b"\xf0\x90\x80\x80", b"\xf0\x9f\x98\x80",
    b"\xf4\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xe2\x82", b"\xe2\x28\xa1", b"\x80", b"ok\xf0\x9f\x98",
]
"""Byte strings at the edges of UTF-8's rules (overlong forms, surrogates, the last code point, truncations)."""
_raw_names = st.one_of(_names, _names, st.binary(max_size=5), st.sampled_from(_EDGE_UTF8))


def _unknown_field(number: st.SearchStrategy[int]) -> st.SearchStrategy[bytes]:
    """A field the reader must skip: any wire type, groups included (possibly nested)."""
    leaf = st.one_of(
        st.tuples(number, st.integers(0, 2**64 - 1)).map(lambda f: _field(f[0], 0, _varint(f[1]))),
        st.tuples(number, st.binary(min_size=8, max_size=8)).map(lambda f: _field(f[0], 1, f[1])),
        st.tuples(number, st.binary(max_size=6)).map(lambda f: _field(f[0], 2, f[1])),
        st.tuples(number, st.binary(min_size=4, max_size=4)).map(lambda f: _field(f[0], 5, f[1])),
    )
    return st.recursive(
        leaf,
        lambda inner: st.tuples(number, st.lists(inner, max_size=3)).map(
            lambda g: _varint(g[0] << 3 | 3) + b"".join(g[1]) + _varint(g[0] << 3 | 4)
        ),
        max_leaves=4,
    )


_attribute_field = st.one_of(
    # type (20): in range, out of range, negative, above 32 bits (read as int32)
    st.sampled_from([0, 1, 4, 5, 6, 10, 14, 15, 99, 2**32 + 5, 2**32 + 10, 2**64 - 1, 2**63 + 5]).map(lambda v: _field(20, 0, _varint(v))),
    st.sampled_from([b"", _field(2, 2, b"sub")]).map(lambda g: _field(6, 2, g)),  # g: an empty or a small graph
    st.sampled_from([b"", _field(1, 2, b"")]).map(lambda g: _field(11, 2, g)),  # graphs
    _raw_names.map(lambda n: _field(1, 2, n)),  # name (last wins; not always UTF-8)
    st.sampled_from([_field(6, 0, b"\x01"), _field(11, 5, b"\0\0\0\0"), _field(20, 2, _varint(5)), _field(20, 5, b"\x05\0\0\0")]),
    # unknown numbers, or string fields (any bytes parse), so that protobuf accepts what is generated
    _unknown_field(st.sampled_from([13, 21, 30, 1000, 2**29 - 1])),
)

_node_field = st.one_of(
    _raw_names.map(lambda n: _field(1, 2, n)),  # input
    _raw_names.map(lambda n: _field(2, 2, n)),  # output
    _raw_names.map(lambda n: _field(4, 2, n)),  # op_type (last wins)
    _raw_names.map(lambda n: _field(7, 2, n)),  # domain (last wins)
    _names.map(lambda n: _field(3, 2, n)),  # name
    _raw_names.map(lambda n: _field(3, 2, n)),  # name, not always UTF-8
    st.lists(_attribute_field, max_size=4).map(lambda a: _field(5, 2, b"".join(a))),  # attribute
    # known fields with another wire type: unknown fields to protobuf
    st.sampled_from(
        [
            _field(1, 0, b"\x05"),
            _field(4, 5, b"abcd"),
            _field(7, 1, b"12345678"),
            _field(5, 0, b"\x01"),
            _varint(1 << 3 | 3) + _varint(1 << 3 | 4),  # input as a group
            _varint(5 << 3 | 3) + _field(20, 0, _varint(5)) + _varint(5 << 3 | 4),  # attribute as a group
        ]
    ),
    _unknown_field(st.sampled_from([6, 8, 99, 536870911])),  # doc_string, overload, unknown
)

_node = st.lists(_node_field, max_size=10).map(b"".join)
_graph_filler = st.one_of(
    _unknown_field(st.sampled_from([2, 10, 99])),  # name, doc_string, unknown
    st.just(_varint(1 << 3 | 3) + _field(4, 2, b"Group") + _varint(1 << 3 | 4)),  # a node as a group: unknown
)
_graph = st.lists(st.one_of(_node.map(lambda n: _field(1, 2, n)), _graph_filler), max_size=6).map(b"".join)
_model = st.lists(
    st.one_of(
        _graph.map(lambda g: _field(7, 2, g)),  # graph, possibly several times (merged: nodes appended)
        st.sampled_from([_field(1, 0, _varint(9)), _field(2, 2, b"producer"), _field(8, 2, _field(2, 0, b"\x11"))]),
        # graph with a wrong wire type (a group too): unknown fields
        st.sampled_from([_field(7, 0, b"\x01"), _field(7, 5, b"\0\0\0\0"), _varint(7 << 3 | 3) + _field(1, 2, b"") + _varint(7 << 3 | 4)]),
        _unknown_field(st.sampled_from([3, 6, 99])),  # producer_version, doc_string, unknown
    ),
    max_size=4,
).map(b"".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_model)
def test_hand_encoded_models_read_as_protobuf_reads_them(data):
    model = onnx.ModelProto()
    model.ParseFromString(data)  # the generator writes well-formed wire data only
    expected = _protobuf_rows(model)
    assert _rows(scan.native_node_table(data)) == expected
    assert _rows(scan.python_node_table(model)) == expected
    non_text_name = _protobuf_non_text_name(model)
    assert scan.native_node_table(data).non_text_name == scan.python_node_table(model).non_text_name == non_text_name
    detailed = scan.native_node_table(data, details=True)
    assert _rows(detailed) == expected and _parsed_details(detailed) == _protobuf_details(model)
    assert _parsed_details(scan.python_node_table(model, details=True)) == _protobuf_details(model)
    graph_data = model.graph.SerializeToString()
    assert _rows(scan.native_node_table(graph_data, graph=True)) == expected
    assert scan.native_node_table(graph_data, graph=True).non_text_name == non_text_name
    for prefix in PREFIXES:
        assert scan.native_node_table(data, name_prefix=prefix).prefixed_names == _protobuf_names(model, prefix)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(max_size=8),
            st.text(max_size=4),
            st.lists(st.text(max_size=8), max_size=4),
            st.lists(st.text(max_size=8), max_size=3),
            st.booleans(),
        ),
        max_size=6,
    )
)
def test_nodes_with_odd_names_made_with_the_onnx_helper_read_the_same(rows):
    nodes = []
    for op_type, domain, inputs, outputs, with_attribute in rows:
        attributes = {"alpha": 0.5} if with_attribute else {}
        nodes.append(helper.make_node(op_type or "Op", inputs, outputs, domain=domain, **attributes))
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    data = model.SerializeToString()
    _check_all_readers(onnx.load_model_from_string(data), data)


def test_a_node_name_given_twice_is_the_last_one_as_protobuf_reads_it():
    node = _field(3, 2, b"sgdfuse/first") + _field(4, 2, b"Relu") + _field(3, 2, b"last") + _field(3, 0, b"\x01")
    data = _field(7, 2, _field(1, 2, node) + _field(1, 2, _field(3, 2, b"sgdfuse")) + _field(1, 2, _field(3, 2, b"sgdfuse/x")))
    model = onnx.ModelProto()
    model.ParseFromString(data)
    assert scan.native_node_table(data, name_prefix="sgdfuse/").prefixed_names == ("sgdfuse/x",) == _protobuf_names(model, "sgdfuse/")
    assert scan.native_node_table(data, name_prefix="sgdfuse").prefixed_names == ("sgdfuse", "sgdfuse/x")


def test_strings_that_are_not_utf8_come_back_as_bytes_as_protobuf_gives_them():
    node = _field(1, 2, b"\xff") + _field(1, 2, b"ok") + _field(4, 2, b"\xed\xa0\x80") + _field(2, 2, b"ok")
    data = _field(7, 2, _field(1, 2, node))
    model = onnx.ModelProto()
    model.ParseFromString(data)
    table = scan.native_node_table(data)
    assert table.inputs == ((b"\xff", "ok"),) and table.op_types == (b"\xed\xa0\x80",)
    assert table.outputs[0][0] is table.inputs[0][1]
    assert _rows(table) == _rows(scan.python_node_table(model)) == _protobuf_rows(model)
    named = _field(7, 2, _field(1, 2, _field(3, 2, b"sgdfuse/\xff") + _field(8, 2, b"\xfe")) + _field(1, 2, _field(3, 2, b"x\xff")))
    model = onnx.ModelProto()
    model.ParseFromString(named)
    assert scan.native_node_table(named, name_prefix="sgdfuse/").prefixed_names == (b"sgdfuse/\xff",) == _protobuf_names(model, "sgdfuse/")
    assert scan.python_node_table(model, name_prefix="sgdfuse/").prefixed_names == (b"sgdfuse/\xff",)


@pytest.mark.parametrize("name", _EDGE_UTF8 + [b"", b"plain", "名前".encode(), bytes(range(1, 128))])
def test_the_first_node_with_a_name_protobuf_gives_as_bytes_is_found_as_python_decodes_it(name):
    try:
        name.decode("utf-8")
        expected = -1
    except UnicodeDecodeError:
        expected = 1
    for bad in (_field(3, 2, name), _field(5, 2, _field(1, 2, name) + _field(20, 0, _varint(1)))):  # node name, attribute name
        nodes = _field(1, 2, _field(4, 2, b"Relu") + _field(3, 2, b"\xff") + _field(3, 2, b"fine")) + _field(1, 2, _field(4, 2, b"Relu") + bad)
        data = _field(7, 2, nodes)
        model = onnx.ModelProto()
        model.ParseFromString(data)
        assert _protobuf_non_text_name(model) == expected
        assert scan.native_node_table(data).non_text_name == expected
        assert scan.python_node_table(model).non_text_name == expected


def test_repeated_singular_fields_keep_the_last_value_and_repeated_ones_append_in_order():
    node = (
        _field(4, 2, b"Mul") + _field(1, 2, b"a") + _field(7, 2, b"dom") + _field(2, 2, b"y")
        + _field(1, 2, b"") + _field(4, 2, b"Add") + _field(1, 2, b"c") + _field(7, 2, b"")
    )
    second_graph = _field(1, 2, _field(4, 2, b"Relu"))
    data = _field(7, 2, _field(1, 2, node)) + _field(8, 2, b"") + _field(7, 2, second_graph)
    table = scan.native_node_table(data)
    assert table.op_types == ("Add", "Relu")
    assert table.domains == ("", "")
    assert table.inputs == (("a", "", "c"), ())
    assert table.outputs == (("y",), ())


def test_an_attribute_type_outside_the_enum_leaves_the_earlier_type_as_protobuf_does():
    # proto2 closed enum: 99 goes to the unknown fields, the type stays GRAPH (5); 2**32 + 10 reads as int32 10.
    for attribute, expected in [
        (_field(20, 0, _varint(5)) + _field(20, 0, _varint(99)), True),
        (_field(20, 0, _varint(5)) + _field(20, 0, _varint(1)), False),
        (_field(20, 0, _varint(2**32 + 10)), True),
        (_field(20, 0, _varint(2**64 - 1)), False),
        (_field(20, 2, _varint(5)), False),
        (_field(6, 2, b""), True),
    ]:
        data = _field(7, 2, _field(1, 2, _field(5, 2, attribute)))
        model = onnx.ModelProto()
        model.ParseFromString(data)
        assert scan.native_node_table(data).has_subgraph == (expected,) == tuple(r[5] for r in _protobuf_rows(model))


# --- Malformed bytes: an error naming the offset, or the fallback; never a crash ----------------------------

_NODE = _field(4, 2, b"Add")
_MALFORMED = {
    "truncated varint": _field(7, 2, _field(1, 2, _NODE + _varint(9 << 3) + b"\xff")),
    "length past the end": _field(7, 2, _field(1, 2, _NODE)) + _varint(7 << 3 | 2) + _varint(1000) + b"abc",
    "wire type 6": _field(7, 2, _field(1, 2, _NODE)) + _varint(9 << 3 | 6),
    "wire type 7": _varint(9 << 3 | 7) + b"\0",
    "field number 0": _varint(0 << 3 | 0) + b"\x01",
    "tag above 32 bits": _varint(2**32 | (9 << 3)) + b"\x01",
    "overlong varint": _varint(9 << 3) + b"\xff" * 10 + b"\x01",
    "end group without a start": _varint(9 << 3 | 4),
    "group without an end": _varint(9 << 3 | 3) + _field(1, 0, b"\x01"),
    "end group of another field": _varint(9 << 3 | 3) + _varint(8 << 3 | 4),
    "groups nested too deep": b"".join(_varint(9 << 3 | 3) for _ in range(70)) + b"".join(_varint(9 << 3 | 4) for _ in range(70)),
    "truncated fixed64": _varint(9 << 3 | 1) + b"1234",
    "truncated fixed32": _varint(9 << 3 | 5) + b"12",
    "malformed attribute": _field(7, 2, _field(1, 2, _field(5, 2, _varint(20 << 3)))),
}


@pytest.mark.parametrize("name", sorted(_MALFORMED))
def test_malformed_bytes_raise_a_scan_error_naming_the_offset(name):
    data = _MALFORMED[name]
    with pytest.raises(scan.ScanError) as raised:
        scan.native_node_table(data)
    assert 0 <= raised.value.offset <= len(data)
    assert raised.value.reason


def test_protobuf_refuses_the_malformed_bytes_too_except_groups_nested_deeper_than_the_scanner_goes():
    # The scanner is not stricter than protobuf, but for unknown groups nested past 64 levels (protobuf allows
    # 100): node_table then reads the model through protobuf.
    for name, data in _MALFORMED.items():
        if name == "groups nested too deep":
            continue
        with pytest.raises(DecodeError):
            onnx.ModelProto().ParseFromString(data)
    deep = onnx.ModelProto()
    deep.ParseFromString(_MALFORMED["groups nested too deep"] + _field(7, 2, _field(1, 2, _NODE)))
    table = scan.node_table(deep, _MALFORMED["groups nested too deep"] + _field(7, 2, _field(1, 2, _NODE)))
    assert table.reader == "python" and table.op_types == ("Add",)


@pytest.fixture(scope="module")
def _small_model_bytes() -> bytes:
    return (ROOT / "testdata" / "torch" / "mlp_train_step_dynamo_noopt.onnx").read_bytes()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_truncated_or_corrupted_bytes_never_crash_and_node_table_falls_back(_small_model_bytes, data):
    blob = _small_model_bytes
    model = onnx.load_model_from_string(blob)
    expected = _protobuf_rows(model)
    cut = data.draw(st.integers(0, len(blob) - 1))
    truncated = blob[:cut]
    try:
        table = scan.native_node_table(truncated)
    except scan.ScanError as error:
        assert 0 <= error.offset <= len(truncated)
    else:
        assert len(table) <= len(expected)
    # Fewer nodes or an error: node_table notices and reads the model instead.
    assert _rows(scan.node_table(model, truncated)) == expected
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)), min_size=1, max_size=8))
    corrupted = bytearray(blob)
    for at, value in flips:
        corrupted[at] = value
    try:
        scan.native_node_table(bytes(corrupted))
    except scan.ScanError:
        pass


def test_bytes_of_another_model_make_node_table_read_the_model(caplog):
    model = _subgraph_model()
    other, _ = _bench_generate().build(5, seed=0)
    with caplog.at_level(logging.DEBUG, logger="sgdfuse.passes.scan"):
        table = scan.node_table(model, other.SerializeToString())
    assert table.reader == "python"
    assert _rows(table) == _protobuf_rows(model)
    assert "nodes" in caplog.text


# --- Fallback: turned off, or no compiler --------------------------------------------------------------------


def test_native_scan_env_zero_reads_through_protobuf(monkeypatch):
    model = _subgraph_model()
    monkeypatch.setenv(scan.NATIVE_ENV, "0")
    table = scan.node_table(model, model.SerializeToString())
    assert table.reader == "python"
    assert _rows(table) == _protobuf_rows(model)
    monkeypatch.setenv(scan.NATIVE_ENV, "1")
    assert scan.node_table(model).reader == "native"


def test_without_a_compiler_node_table_falls_back_and_logs_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SGDFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    model = _subgraph_model()
    with caplog.at_level(logging.DEBUG, logger="sgdfuse.passes.scan"):
        table = scan.node_table(model, model.SerializeToString())
    assert table.reader == "python"
    assert _rows(table) == _protobuf_rows(model)
    assert "no C++ compiler" in caplog.text
    with pytest.raises(scan.ScannerBuildError) as raised:
        scan.build_scanner()
    assert raised.value.reason == "no-compiler"


def test_the_build_is_loaded_once_per_process_and_reused_from_the_cache_by_the_next(tmp_path):
    first = scan.build_scanner(cache_dir=tmp_path)
    assert not first.cached
    assert scan.build_scanner(cache_dir=tmp_path) is first
    script = f"from sgdfuse.passes import scan; b = scan.build_scanner(cache_dir={str(tmp_path)!r}); print(b.cached, b.path)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.split() == ["True", str(first.path)]
