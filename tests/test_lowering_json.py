"""The JSON of ``sgdfuse lower --json`` (ATC's ``atc --mode=1`` layout) is what ``json.dumps`` writes.

``message_to_json`` writes the text itself, from the message, in pieces (``message_json_pieces``), keeping a
sub-message's text by its wire bytes. The independent reference here is ``json.dumps(message_to_dict(m),
indent=2, sort_keys=True, ensure_ascii=False)``: the dictionary of ATC's layout rendered by the standard
library. Both must give the same text, byte for byte, for the graphs sgdfuse lowers from the committed models
and for messages holding anything the schema can: odd strings, non-UTF-8 bytes, non-finite and signed-zero
floats, unknown enum numbers, nested lists and graphs, empty messages, omitted fields.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import sgdfuse
from sgdfuse.cli import app
from sgdfuse.errors import OutputWriteError
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.atc_json import ATC_OMITTED_FIELDS, message_json_pieces, message_to_dict, message_to_json
from sgdfuse.output import OutputBatch
from test_lowering_support import MODEL_PATHS, fused


def _reference(message, omit=ATC_OMITTED_FIELDS) -> str:
    return json.dumps(message_to_dict(message, omit=omit), indent=2, sort_keys=True, ensure_ascii=False)


@pytest.mark.parametrize("path", MODEL_PATHS[:4], ids=lambda p: p.stem)
def test_lowered_graphs_of_committed_models_print_as_json_dumps_does(path):
    lowered = sgdfuse.lower(fused(path), soc="Ascend910B2")
    for message in (lowered.model, lowered.init_model):
        assert message_to_json(message) == _reference(message)
    assert "".join(lowered.json_pieces(init=True)) == _reference(lowered.init_model)


# ---- messages holding anything the schema can ---------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6) | st.sampled_from(["", "a\nb", '"\\', "\u2028", "é", "\x00"])
_bytes = st.binary(max_size=6) | _text.map(lambda s: s.encode())
_floats = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-45, 0.1, 3.4e38])
_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_enum = st.integers(min_value=0, max_value=40)  # 33..40 are not DataType members: printed as numbers


def _shape(draw) -> ge_ir.ShapeDef:
    return ge_ir.ShapeDef(dim=draw(st.lists(_ints, max_size=3)))


@st.composite
def _descriptors(draw, depth: int = 0) -> ge_ir.TensorDescriptor:
    desc = ge_ir.TensorDescriptor(
        name=draw(_text), dtype=draw(_enum), layout=draw(_text), size=draw(_ints), data_offset=draw(_ints),
        real_dim_cnt=draw(_ints), has_out_attr=draw(st.booleans()), device_type=draw(_text),
    )
    if draw(st.booleans()):
        desc.shape.CopyFrom(_shape(draw))
    if draw(st.booleans()):
        desc.shape.SetInParent()  # set but empty: left out
    if depth < 2:
        for key in draw(st.lists(_text, max_size=2, unique=True)):
            desc.attr[key].CopyFrom(draw(_attrs(depth + 1)))
    return desc


@st.composite
def _attrs(draw, depth: int = 0) -> ge_ir.AttrDef:
    attr = ge_ir.AttrDef()
    kind = draw(st.sampled_from(["none", "s", "i", "f", "b", "bt", "dt", "list", "td", "t", "func", "g", "lli", "llf"]))
    if kind == "s":
        attr.s = draw(_bytes)
    elif kind == "i":
        attr.i = draw(_ints)
    elif kind == "f":
        attr.f = draw(_floats)
    elif kind == "b":
        attr.b = draw(st.booleans())
    elif kind == "bt":
        attr.bt = draw(_bytes)
    elif kind == "dt":
        attr.dt = draw(_ints)
    elif kind == "list":
        values = attr.list
        values.val_type = draw(st.integers(min_value=0, max_value=12))
        values.s.extend(draw(st.lists(_bytes, max_size=3)))
        values.i.extend(draw(st.lists(_ints, max_size=3)))
        values.f.extend(draw(st.lists(_floats, max_size=3)))
        values.b.extend(draw(st.lists(st.booleans(), max_size=2)))
        if depth < 2:
            values.td.extend(draw(st.lists(_descriptors(depth + 1), max_size=2)))
            values.g.extend(draw(st.lists(_graphs(depth + 1), max_size=1)))
    elif kind == "td" and depth < 2:
        attr.td.CopyFrom(draw(_descriptors(depth + 1)))
    elif kind == "t" and depth < 2:
        attr.t.desc.CopyFrom(draw(_descriptors(depth + 1)))
        attr.t.data = draw(_bytes)
    elif kind == "func" and depth < 2:
        attr.func.name = draw(_text)
        for key in draw(st.lists(_text, max_size=2, unique=True)):
            attr.func.attr[key].CopyFrom(draw(_attrs(depth + 1)))
    elif kind == "g" and depth < 2:
        attr.g.CopyFrom(draw(_graphs(depth + 1)))
    elif kind == "lli":
        for row in draw(st.lists(st.lists(_ints, max_size=2), max_size=2)):
            attr.list_list_int.list_list_i.add().list_i.extend(row)
    elif kind == "llf":
        for row in draw(st.lists(st.lists(_floats, max_size=2), max_size=2)):
            attr.list_list_float.list_list_f.add().list_f.extend(row)
    return attr


@st.composite
def _ops(draw, depth: int = 0) -> ge_ir.OpDef:
    op = ge_ir.OpDef(name=draw(_text), type=draw(_text), id=draw(_ints), input=draw(st.lists(_text, max_size=2)))
    op.src_index.extend(draw(st.lists(_ints, max_size=2)))
    op.is_input_const.extend(draw(st.lists(st.booleans(), max_size=2)))
    op.workspace.extend(draw(st.lists(_ints, max_size=2)))  # omitted by ATC
    for key in draw(st.lists(_text, max_size=3, unique=True)):
        op.attr[key].CopyFrom(draw(_attrs(depth)))
    op.input_desc.extend(draw(st.lists(_descriptors(depth), max_size=2)))
    op.output_desc.extend(draw(st.lists(_descriptors(depth), max_size=1)))
    return op


@st.composite
def _graphs(draw, depth: int = 0) -> ge_ir.GraphDef:
    graph = ge_ir.GraphDef(name=draw(_text), input=draw(st.lists(_text, max_size=2)), output=draw(st.lists(_text, max_size=2)))
    graph.op.extend(draw(st.lists(_ops(depth), max_size=3 if depth == 0 else 1)))
    for key in draw(st.lists(_text, max_size=2, unique=True)):
        graph.attr[key].CopyFrom(draw(_attrs(depth + 1)))
    return graph


@st.composite
def _models(draw) -> ge_ir.ModelDef:
    model = ge_ir.ModelDef(name=draw(_text), version=draw(st.integers(min_value=0, max_value=2**32 - 1)), custom_version=draw(_text))
    model.graph.extend(draw(st.lists(_graphs(), max_size=2)))
    for key in draw(st.lists(_text, max_size=2, unique=True)):
        model.attr[key].CopyFrom(draw(_attrs()))
    return model


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_models(), st.sampled_from([ATC_OMITTED_FIELDS, frozenset(), frozenset({"name", "attr"})]))
def test_any_message_prints_as_json_dumps_does(model, omit):
    assert message_to_json(model, omit=omit) == _reference(model, omit)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.one_of(_ops(), _descriptors(), _attrs(), _graphs()))
def test_any_sub_message_prints_alone_as_json_dumps_does(message):
    assert message_to_json(message) == _reference(message)
    assert message_to_json(message, indent=4) == json.dumps(message_to_dict(message), indent=4, sort_keys=True, ensure_ascii=False)


def test_equal_sub_messages_at_different_depths_get_their_own_indent():
    # One descriptor's text is kept by its bytes, then written once at an op's depth and once inside an
    # attribute of a graph nested in an attribute: each copy must carry its own depth's indent.
    desc = ge_ir.TensorDescriptor(name="x", dtype=1, layout="ND")
    desc.shape.dim.extend([2, 3])
    desc.attr["origin_format"].s = b"ND"
    model = ge_ir.ModelDef(name="m")
    graph = model.graph.add(name="g")
    op = graph.op.add(name="a", type="Data")
    op.output_desc.append(desc)
    inner = op.attr["body"].g
    inner.op.add(name="b", type="Data").output_desc.append(desc)
    op.attr["same"].td.CopyFrom(desc)
    assert message_to_json(model) == _reference(model)


def test_pieces_stream_ops_one_by_one():
    model = ge_ir.ModelDef(name="m")
    graph = model.graph.add(name="g")
    for k in range(50):
        graph.op.add(name=f"op{k}", type="Identity", input=[f"op{k - 1}:0"])
    pieces = list(message_json_pieces(model))
    assert "".join(pieces) == _reference(model)
    assert len(pieces) > 50 and max(len(p) for p in pieces) < 200


# ---- the file sgdfuse lower --json writes ----------------------------------------------------------------------


def test_lower_json_file_is_the_step_graph_as_json_dumps_writes_it(tmp_path):
    model_path = tmp_path / "model.onnx"
    import onnx

    onnx.save(fused(MODEL_PATHS[0]), model_path)
    result = CliRunner().invoke(app, ["lower", str(model_path), "--soc", "Ascend910B2", "-o", str(tmp_path / "m.air"), "--json", str(tmp_path / "m.json"), "--no-verify"])
    assert result.exit_code == 0, result.output
    step = ge_ir.ModelDef.FromString((tmp_path / "m.air").read_bytes())
    assert (tmp_path / "m.json").read_text(encoding="utf-8") == _reference(step) + "\n"


def test_stage_text_failing_midway_leaves_no_file_and_no_temporary(tmp_path):
    def pieces():
        yield "{"
        raise RuntimeError("broken piece")

    with pytest.raises(RuntimeError, match="broken piece"):
        with OutputBatch() as batch:
            batch.stage_text(tmp_path / "out.json", pieces())
            batch.commit()
    assert os.listdir(tmp_path) == []


def test_stage_text_writes_utf8_pieces_whole(tmp_path):
    with OutputBatch() as batch:
        batch.stage_text(tmp_path / "out.json", iter(["é", "\u2028", "\n"]))
        batch.commit()
    assert (tmp_path / "out.json").read_bytes() == "é\u2028\n".encode()
    with pytest.raises(OutputWriteError):
        with OutputBatch() as batch:
            batch.stage_text(tmp_path / "missing" / "out.json", iter(["x"]))


def test_non_finite_and_signed_zero_floats_print_as_json_dumps_does():
    attr = ge_ir.AttrDef()
    attr.list.f.extend([float("nan"), float("inf"), -float("inf"), -0.0, 0.1])
    single = ge_ir.AttrDef(f=float("nan"))
    graph = ge_ir.GraphDef(name="g")
    graph.attr["list"].CopyFrom(attr)
    graph.attr["single"].CopyFrom(single)
    graph.attr["negative_zero"].f = -0.0
    text = message_to_json(graph)
    assert text == _reference(graph)
    assert "NaN,\n" in text and "-Infinity" in text and '"nan"' in text
