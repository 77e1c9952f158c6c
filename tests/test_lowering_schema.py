"""The GE IR schema and the ``.air`` bytes: field numbers and enums as documented (the public ge_ir.proto; docs/lowering.md),
round trips through our classes and through a plain protobuf wire decoder written here, and the JSON
layout of ATC's model-to-JSON mode."""

from __future__ import annotations

import json
import re
import struct
import sys

import pytest

import sgdfuse
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.atc_json import ATC_OMITTED_FIELDS
from sgdfuse.lowering.ge_ir import ProtoSyntaxError, parse_proto
from test_lowering_support import MODEL_PATHS, fused, sgd_model

# Transcribed from the public GE IR schema (metadef/torchair ge_ir.proto): message -> {field: number}.
DOCUMENTED_FIELDS = {
    "AttrDef": {"list": 1, "s": 2, "i": 3, "f": 4, "b": 5, "bt": 7, "func": 10, "td": 11, "t": 12, "g": 13, "list_list_int": 14, "dt": 15, "list_list_float": 16},
    "AttrDef.ListValue": {"s": 2, "i": 3, "f": 4, "b": 5, "bt": 7, "td": 8, "t": 9, "g": 10, "na": 11, "dt": 12, "val_type": 20},
    "AttrDef.ListListInt": {"list_list_i": 1},
    "AttrDef.ListListInt.ListInt": {"list_i": 1},
    "AttrDef.ListListFloat": {"list_list_f": 1},
    "AttrDef.ListListFloat.ListFloat": {"list_f": 1},
    "NamedAttrs": {"name": 1, "attr": 2},
    "ShapeDef": {"dim": 1},
    "TensorDescriptor": {
        "name": 1, "dtype": 2, "shape": 3, "layout": 4, "attr": 5, "has_out_attr": 9, "size": 10, "weight_size": 11,
        "reuse_input": 12, "output_tensor": 13, "device_type": 14, "input_tensor": 15, "real_dim_cnt": 16,
        "reuse_input_index": 17, "data_offset": 18, "cmps_size": 19, "cmps_tab": 20, "cmps_tab_offset": 21,
    },
    "TensorDef": {"desc": 1, "data": 2},
    "OpDef": {
        "name": 1, "type": 2, "input": 5, "attr": 10, "has_out_attr": 20, "id": 21, "stream_id": 22, "input_name": 23,
        "src_name": 24, "src_index": 25, "dst_name": 26, "dst_index": 27, "input_i": 28, "output_i": 29, "workspace": 30,
        "workspace_bytes": 31, "is_input_const": 32, "input_desc": 33, "output_desc": 34, "subgraph_name": 35,
    },
    "GraphDef": {"name": 1, "input": 4, "output": 5, "op": 6, "attr": 11},
    "ModelDef": {"name": 1, "version": 2, "custom_version": 3, "graph": 7, "attr": 11},
}
DOCUMENTED_DATA_TYPES = dict(
    DT_UNDEFINED=0, DT_FLOAT=1, DT_FLOAT16=2, DT_INT8=3, DT_UINT8=4, DT_INT16=5, DT_UINT16=6, DT_INT32=7, DT_INT64=8,
    DT_UINT32=9, DT_UINT64=10, DT_BOOL=11, DT_DOUBLE=12, DT_STRING=13, DT_DUAL_SUB_INT8=14, DT_DUAL_SUB_UINT8=15,
    DT_COMPLEX64=16, DT_COMPLEX128=17, DT_QINT8=18, DT_QINT16=19, DT_QINT32=20, DT_QUINT8=21, DT_QUINT16=22,
    DT_RESOURCE=23, DT_STRING_REF=24, DT_DUAL=25, DT_VARIANT=26, DT_BF16=27, DT_INT4=28, DT_UINT1=29, DT_INT2=30,
    DT_UINT2=31, DT_COMPLEX32=32,
)
DOCUMENTED_LIST_TYPES = [
    "VT_LIST_NONE", "VT_LIST_STRING", "VT_LIST_INT", "VT_LIST_FLOAT", "VT_LIST_BOOL", "VT_LIST_BYTES",
    "VT_LIST_TENSOR_DESC", "VT_LIST_TENSOR", "VT_LIST_GRAPH", "VT_LIST_NAMED_ATTRS", "VT_LIST_DATA_TYPE",
]


def _descriptor(path: str):
    parts = path.split(".")
    descriptor = getattr(ge_ir, parts[0]).DESCRIPTOR
    for part in parts[1:]:
        descriptor = descriptor.nested_types_by_name[part]
    return descriptor


@pytest.mark.parametrize("message", list(DOCUMENTED_FIELDS))
def test_message_classes_have_the_documented_field_numbers(message):
    descriptor = _descriptor(message)
    assert {f.name: f.number for f in descriptor.fields} == DOCUMENTED_FIELDS[message]


def test_enums_have_the_documented_values():
    assert {v.name: v.number for v in ge_ir.DataType.values} == DOCUMENTED_DATA_TYPES
    list_type = ge_ir.AttrDef.DESCRIPTOR.nested_types_by_name["ListValue"].enum_types_by_name["ListValueType"]
    assert [(v.name, v.number) for v in list_type.values] == [(name, k) for k, name in enumerate(DOCUMENTED_LIST_TYPES)]


def test_proto_text_declares_the_documented_numbers():
    # Read the .proto with a regular expression, independently of the parser that builds the classes.
    text = re.sub(r"//[^\n]*", "", ge_ir.PROTO_SOURCE)
    declared: dict[str, int] = {}
    for match in re.finditer(r"(?:repeated\s+)?(?:map<[^>]+>|[A-Za-z_][\w.]*)\s+([a-z_][a-z0-9_]*)\s*=\s*(\d+)\s*;", text):
        declared.setdefault(match.group(1), int(match.group(2)))
    for fields in DOCUMENTED_FIELDS.values():
        for name, number in fields.items():
            assert re.search(rf"\b{name}\s*=\s*{number}\s*;", text), f"{name} = {number} not in ge_ir.proto"
    assert ge_ir.FILE_DESCRIPTOR.package == "ge.proto" and ge_ir.FILE_DESCRIPTOR.syntax == "proto3"


def test_proto_parser_refuses_what_it_does_not_understand():
    with pytest.raises(ProtoSyntaxError):
        parse_proto('syntax = "proto2"; package p; message M { optional int32 a = 1; }')
    with pytest.raises(ProtoSyntaxError, match="unknown type"):
        parse_proto('syntax = "proto3"; package p; message M { Missing a = 1; }')


def test_message_classes_do_not_touch_the_default_pool():
    from google.protobuf import descriptor_pool

    with pytest.raises(KeyError):
        descriptor_pool.Default().FindMessageTypeByName("ge.proto.ModelDef")


# ---- a plain protobuf wire decoder (no generated or reflected classes) -------------------------------------


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def decode(data: bytes) -> dict[int, list]:
    """field number -> values: int for varints, bytes for length-delimited, raw 4/8 bytes for fixed."""
    fields: dict[int, list] = {}
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position)
        elif wire == 1:
            value, position = data[position : position + 8], position + 8
        elif wire == 2:
            length, position = _varint(data, position)
            value, position = data[position : position + length], position + length
        elif wire == 5:
            value, position = data[position : position + 4], position + 4
        else:
            raise ValueError(f"wire type {wire}")
        fields.setdefault(number, []).append(value)
    assert position == len(data)
    return fields


def _packed(data: bytes) -> list[int]:
    values, position = [], 0
    while position < len(data):
        value, position = _varint(data, position)
        values.append(value - (1 << 64) if value >= 1 << 63 else value)
    return values


def _attr_map(op: dict[int, list]) -> dict[str, dict[int, list]]:
    # OpDef.attr = 10: map entries {key = 1, value = 2 (AttrDef)}
    return {decode(entry)[1][0].decode(): decode(decode(entry)[2][0]) for entry in op.get(10, [])}


@pytest.fixture(scope="module")
def mlp_air(tmp_path_factory):
    lowered = sgdfuse.lower(fused(next(p for p in MODEL_PATHS if p.stem == "mlp_train_step_legacy")), soc="Ascend910B2")
    path = tmp_path_factory.mktemp("air") / "mlp.air"
    lowered.save_air(path)
    return lowered, path.read_bytes()


def test_air_parses_back_to_an_equal_message(mlp_air):
    lowered, data = mlp_air
    parsed = ge_ir.ModelDef.FromString(data)
    assert parsed == lowered.model
    assert parsed.SerializeToString(deterministic=True) == data  # and the bytes are reproducible
    assert lowered.to_bytes() == data


def test_air_decodes_with_a_plain_wire_decoder_to_the_documented_fields(mlp_air):
    lowered, data = mlp_air
    model = decode(data)
    assert model[1] == [lowered.model.name.encode()]  # ModelDef.name = 1
    soc = {decode(e)[1][0]: decode(decode(e)[2][0]) for e in model[11]}  # ModelDef.attr = 11
    assert soc[b"soc_version"][2] == [b"Ascend910B2"]  # AttrDef.s = 2
    (graph_bytes,) = model[7]  # ModelDef.graph = 7
    graph = decode(graph_bytes)
    assert graph[4] == [b"x:0", b"y:0"]  # GraphDef.input = 4
    assert len(graph[5]) == 9  # GraphDef.output = 5
    ops = [decode(op) for op in graph[6]]  # GraphDef.op = 6
    sgd = next(op for op in ops if op[2] == [b"SGD"] and op[1] == [b"sgdfuse/w2_out/SGD"])  # OpDef.type = 2, name = 1
    inputs = [s.decode() for s in sgd[5]]  # OpDef.input = 5
    assert inputs[:6] == ["w2:0", "/gm/Gemm_3:0", "sgdfuse/learning_rate_1:0", "buf_w2:0", "sgdfuse/momentum_1:0", "sgdfuse/w2_out/stat:0"]
    assert inputs[6:] == ["/gm/Gemm_2:-1"]  # control edge after the data inputs
    attrs = _attr_map(sgd)
    assert struct.unpack("<f", attrs["dampening"][4][0]) == (0.0,)  # AttrDef.f = 4 (fixed32)
    assert struct.unpack("<f", attrs["weight_decay"][4][0]) == (0.0,)
    assert attrs["nesterov"][5] == [1]  # AttrDef.b = 5
    names = decode(attrs["_input_name_key"][1][0])  # AttrDef.list = 1
    assert names[2] == [b"parameters", b"gradient", b"learning_rate", b"accum", b"momentum", b"stat"]  # ListValue.s = 2
    assert names[20] == [1]  # ListValue.val_type = 20: VT_LIST_STRING
    assert _packed(decode(attrs["_input_name_value"][1][0])[3][0]) == [0, 1, 2, 3, 4, 5]  # ListValue.i = 3
    descs = [decode(d) for d in sgd[33]]  # OpDef.input_desc = 33
    assert [d[1][0] for d in descs] == [b"parameters", b"gradient", b"learning_rate", b"accum", b"momentum", b"stat"]
    parameters = descs[0]
    assert parameters[2] == [1]  # TensorDescriptor.dtype = 2: DT_FLOAT
    assert _packed(decode(parameters[3][0])[1][0]) == [2, 8]  # shape = 3, ShapeDef.dim = 1 (packed)
    assert parameters[4] == [b"ND"]  # layout = 4
    desc_attrs = {decode(e)[1][0].decode(): decode(decode(e)[2][0]) for e in parameters[5]}  # attr = 5
    assert desc_attrs["origin_format"][2] == [b"ND"] and desc_attrs["origin_data_type"][2] == [b"DT_FLOAT"]
    (output,) = [decode(d) for d in sgd[34]]  # OpDef.output_desc = 34
    assert output[1] == [b"parameters"]


def test_first_step_attributes_decode_as_floats(tmp_path):
    from sgdfuse.contract import SgdAttributes

    lowered = sgdfuse.lower(sgd_model(attributes=SgdAttributes(0.25, 1e-4, False)), soc="Ascend910B2")
    path = tmp_path / "one.air"
    lowered.save_air(path)
    ops = [decode(op) for op in decode(decode(path.read_bytes())[7][0])[6]]
    attrs = _attr_map(next(op for op in ops if op[2] == [b"SGD"]))
    assert struct.unpack("<f", attrs["dampening"][4][0])[0] == 0.25
    assert struct.unpack("<f", attrs["weight_decay"][4][0])[0] == pytest.approx(1e-4, rel=1e-7)
    assert attrs["nesterov"].get(5, [0]) == [0]  # proto3: false is the default, not written


def test_save_air_is_atomic_and_refuses_a_missing_directory(tmp_path):
    lowered = sgdfuse.lower(sgd_model(), soc="Ascend910B2")
    target = tmp_path / "model.air"
    target.write_bytes(b"old")
    lowered.save_air(target)
    assert ge_ir.ModelDef.FromString(target.read_bytes()) == lowered.model
    assert [p.name for p in tmp_path.iterdir()] == ["model.air"]  # no temporary left behind
    with pytest.raises(sgdfuse.OutputWriteError):
        lowered.save_air(tmp_path / "missing" / "model.air")


def test_init_graph_round_trips_too(tmp_path):
    lowered = sgdfuse.lower(sgd_model(), soc="Ascend910B2")
    path = tmp_path / "model.init.air"
    lowered.save_init_air(path)
    parsed = ge_ir.ModelDef.FromString(path.read_bytes())
    assert parsed == lowered.init_model
    assert sorted(op.type for op in parsed.graph[0].op).count("Assign") == 3


# ---- JSON in the layout of atc --mode=1 ------------------------------------------------------------------


def test_json_uses_atc_layout(mlp_air):
    lowered, _ = mlp_air
    document = json.loads(lowered.to_json())
    assert set(document) == {"attr", "graph", "name"}
    (graph,) = document["graph"]
    assert "output" not in graph  # in ATC's black list
    assert graph["input"] == ["x:0", "y:0"]
    sgd = next(op for op in graph["op"] if op["name"] == "sgdfuse/w1_out/SGD")
    attrs = {entry["key"]: entry["value"] for entry in sgd["attr"]}
    assert attrs["dampening"] == {"f": "0.25"}  # singular floats print with %g, as strings
    assert attrs["weight_decay"] == {"f": "0.0001"}
    assert attrs["nesterov"] == {"b": False}  # proto3 default but a set oneof member: printed
    assert attrs["_input_name_key"]["list"]["val_type"] == "VT_LIST_STRING"
    desc = sgd["input_desc"][0]
    assert desc["dtype"] == "DT_FLOAT" and desc["layout"] == "ND" and desc["shape"] == {"dim": [8, 4]}
    assert [entry["key"] for entry in desc["attr"]] == sorted(entry["key"] for entry in desc["attr"])
    const = next(op for op in graph["op"] if op["type"] == "Const")
    value = next(entry["value"] for entry in const["attr"] if entry["key"] == "value")
    assert set(value["t"]) == {"desc"}  # TensorDef.data (the bytes) is black-listed
    assert {"output", "data", "size", "weight_size", "data_offset"} <= ATC_OMITTED_FIELDS


def test_written_files_get_the_usual_mode_not_the_temporary_files_0600(tmp_path):
    import os
    import stat

    lowered = sgdfuse.lower(sgd_model(), soc="Ascend910B2")
    umask = os.umask(0o022)
    try:
        lowered.save_air(tmp_path / "new.air")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.air").stat().st_mode) == 0o644
    existing = tmp_path / "existing.air"
    existing.write_bytes(b"")
    existing.chmod(0o640)
    lowered.save_air(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640


# ---- the fast OpDef encoding against the message-built reference ------------------------------------------


def _captured_builders(model):
    """Lower ``model``, keeping the GraphBuilder that wrote the step graph, and the init graph built again as
    records in a GraphBuilder (lowering writes it with a GraphWriter, which keeps none)."""
    from sgdfuse.lowering import graph_builder, state

    builders = []
    plans = []
    original = graph_builder.GraphBuilder.to_model_def_bytes
    original_plan = state.plan_state
    lower_module = sys.modules["sgdfuse.lowering.lower"]

    def keep(self, *args, **kwargs):
        builders.append(self)
        return original(self, *args, **kwargs)

    def keep_plan(index):
        plans.append(original_plan(index))
        return plans[-1]

    graph_builder.GraphBuilder.to_model_def_bytes = keep
    lower_module.plan_state = keep_plan
    try:
        lowered = sgdfuse.lower(model, soc="Ascend950PR_9599")
    finally:
        graph_builder.GraphBuilder.to_model_def_bytes = original
        lower_module.plan_state = original_plan
    name = lowered.init_model.graph[0].name
    init, *_ = state.build_init_graph(plans[-1], name, graph=graph_builder.GraphBuilder(name))
    return lowered, builders + [init]


@pytest.mark.parametrize("path", MODEL_PATHS[:6] + [p for p in MODEL_PATHS if p.stem == "mlp_train_step_legacy"], ids=lambda p: p.stem)
def test_encoded_ops_are_the_ops_the_message_api_builds(path):
    # The step and init graphs are written from cached wire bytes (graph_builder._Encoder); each op must be
    # exactly the OpDef that graph_builder._op_def builds field by field.
    from sgdfuse.lowering.graph_builder import _op_def

    lowered, builders = _captured_builders(fused(path))
    assert len(builders) == 2
    for builder, model in zip(builders, (lowered.model, lowered.init_model)):
        written = {op.name: op for op in model.graph[0].op}
        assert set(written) == set(builder.ops)
        for name, record in builder.ops.items():
            assert written[name] == _op_def(record), name


@pytest.mark.parametrize("path", MODEL_PATHS[:6] + [p for p in MODEL_PATHS if p.stem == "mlp_train_step_legacy"], ids=lambda p: p.stem)
def test_the_init_graph_written_as_its_ops_are_added_is_the_graph_its_records_encode_to(path):
    # Lowering writes the init graph with a GraphWriter (each op encoded when it is added, no record kept);
    # the same ops added to a GraphBuilder as records must encode to the same bytes.
    from sgdfuse.lowering import graph_builder

    lowered, builders = _captured_builders(fused(path))
    init = builders[1]
    outputs = [t for _, t in init.ops["NetOutput"].inputs]
    data = [op.name for op in lowered.init_model.graph[0].op if op.type == "Data"]
    again = init.to_model_def_bytes(init.name, {"soc_version": b"Ascend950PR_9599"}, inputs=data, outputs=outputs)
    assert again == lowered.init_bytes()
    assert isinstance(init, graph_builder.GraphBuilder)
