"""The load skips the walk over every tensor of a model only when the file's bytes prove that none of them has
external data (``sgdfuse.external_data.may_hold_external_data``, protobuf's binary format only): wherever an
external tensor sits (an initializer, a ``Constant``'s attribute, a sparse tensor, a subgraph, a model-local
function, an attribute whose declared type is not a tensor), the bytes show it; a model in a text format, which
can spell the key and the enum otherwise, is always walked; and a binary model without one loads, optimises
and saves without the walk."""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse import external_data
from sgdfuse.errors import ExternalDataError

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(os.path.dirname(HERE), "testdata")


def _external(name: str, *, location: str | None = "w.bin") -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[2])
    tensor.data_location = TensorProto.EXTERNAL
    if location is not None:
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", location
    return tensor


def _update_graph(extra_nodes=(), initializers=()) -> onnx.GraphProto:
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["bm"]),
        helper.make_node("Add", ["bm", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "neg_lr"], ["step"]),
        helper.make_node("Add", ["p", "step"], ["p_out"]),
        *extra_nodes,
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("p", "g", "buf")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("p_out", "buf_out")]
    scalars = [numpy_helper.from_array(np.array(0.9, np.float32), "m"), numpy_helper.from_array(np.array(-0.01, np.float32), "neg_lr")]
    return helper.make_graph(nodes, "g", inputs, outputs, initializer=[*scalars, *initializers])


def _model(graph: onnx.GraphProto, functions=()) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)], functions=list(functions))
    model.ir_version = 9
    return model


def _placements(location: str | None):
    """Models with one external tensor, each in another place of the model."""
    constant = helper.make_node("Constant", [], ["c"], value=_external("c_value", location=location))
    yield "initializer", _model(_update_graph(initializers=[_external("w", location=location)]))
    yield "Constant attribute", _model(_update_graph([constant]))
    sparse = onnx.SparseTensorProto(values=_external("sv", location=location), indices=numpy_helper.from_array(np.array([0], np.int64), "si"))
    sparse.dims.extend([2])
    sparse_graph = _update_graph()
    sparse_graph.sparse_initializer.append(sparse)
    yield "sparse initializer", _model(sparse_graph)
    branch = helper.make_graph([helper.make_node("Constant", [], ["b"], value=_external("b_value", location=location))], "branch", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    yield "If branch", _model(_update_graph([helper.make_node("If", ["cond"], ["b_out"], then_branch=branch, else_branch=branch)], [cond]))
    function = helper.make_function("local", "F", [], ["y"], [helper.make_node("Constant", [], ["y"], value=_external("f_value", location=location))],
                                    [helper.make_opsetid("", 18)])
    yield "model-local function", _model(_update_graph(), [function])
    # An attribute declared INT that also carries a tensor: onnx's external-data loader still follows it.
    odd = helper.make_node("Cast", ["p"], ["p_cast"], to=TensorProto.FLOAT)
    odd.attribute[0].t.CopyFrom(_external("odd_value", location=location))
    yield "tensor field of an INT attribute", _model(_update_graph([odd]))


@pytest.mark.parametrize("location", ["w.bin", "../../etc/passwd", None], ids=["inside", "escaping", "no location"])
def test_every_placement_of_an_external_tensor_shows_in_the_bytes(location):
    for where, model in _placements(location):
        assert list(external_data.external_tensors(model)), where  # the walk itself finds it
        assert external_data.may_hold_external_data(model.SerializeToString()), f"{where}: binary"


def _disguised_json(path, model) -> None:
    """``model`` in onnx's JSON format with the key ``location`` written with a JSON escape, the field
    ``data_location`` by its camel-case name and the ``EXTERNAL`` enum as its number: bytes in which no marker
    of a binary model appears, which the JSON parser reads back as the same model."""
    onnx.save(model, path)
    text = path.read_text()
    assert '"EXTERNAL"' in text and ('"location"' in text) == any(e.key == "location" for t in model.graph.initializer for e in t.external_data)
    # The JSON parser takes a field by its camel-case name too, and any character escaped.
    disguised = text.replace('"location"', '"loc\\u0061tion"').replace('"EXTERNAL"', "1").replace('"data_location"', '"dataLocation"')
    assert b"location" not in disguised.encode() and not external_data.may_hold_external_data(disguised.encode())
    path.write_text(disguised)
    assert onnx.load(path, load_external_data=False) == model


@pytest.mark.parametrize("location", ["../outside/secret.bin", None], ids=["escaping", "no location"])
def test_a_text_format_model_is_walked_however_it_spells_the_location(tmp_path, location):
    model = _model(_update_graph(initializers=[_external("w", location=location)]))
    path = tmp_path / "model.json"
    _disguised_json(path, model)
    with pytest.raises(ExternalDataError, match="'w'"):
        sgdfuse.optimize(path, verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json"]  # nothing written


def test_a_valid_text_format_model_with_external_data_is_saved_with_its_data(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "w.bin").write_bytes(np.arange(2, dtype=np.float32).tobytes())
    model = _model(_update_graph(initializers=[_external("w")]))
    path = tmp_path / "in" / "model.json"
    _disguised_json(path, model)
    result = sgdfuse.optimize(path, verify=False)
    assert result.has_external_data
    (tmp_path / "out").mkdir()
    result.save(tmp_path / "out" / "model.onnx")
    assert (tmp_path / "out" / "w.bin").read_bytes() == (tmp_path / "in" / "w.bin").read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=64), st.text(min_size=1, max_size=12), st.integers(0, 2))
def test_any_external_tensor_in_random_surroundings_is_seen(noise, location, place):
    """The markers survive any neighbouring bytes (raw data of other tensors, names): a tensor with external data
    is always seen, whatever else the model holds."""
    filler = TensorProto(name="noise", data_type=TensorProto.UINT8, dims=[len(noise)], raw_data=noise)
    external = _external("w", location=location)
    graph = _update_graph(initializers=[filler] + ([external] if place == 0 else []))
    if place == 1:
        graph.node.append(helper.make_node("Constant", [], ["c"], value=external))
    if place == 2:
        graph.node.append(helper.make_node("Constant", [], ["c"], sparse_value=onnx.SparseTensorProto(values=external, indices=filler, dims=[2])))
    assert external_data.may_hold_external_data(_model(graph).SerializeToString())


def test_committed_models_agree_with_the_walk():
    """On every committed model: the bytes say "maybe" whenever the walk finds an external tensor."""
    paths = glob.glob(os.path.join(TESTDATA, "**", "*.onnx"), recursive=True)
    assert len(paths) > 20
    for path in paths:
        with open(path, "rb") as handle:
            data = handle.read()
        model = onnx.load_model_from_string(data)
        if list(external_data.external_tensors(model)):
            assert external_data.may_hold_external_data(data), path


def test_a_model_without_external_data_is_loaded_and_saved_without_the_walk(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(_model(_update_graph()), path)

    def walked(model):
        raise AssertionError("external_tensors was called for a model whose bytes hold no external data")

    monkeypatch.setattr(external_data, "external_tensors", walked)
    result = sgdfuse.optimize(path, verify=False)
    assert result.has_external_data is False
    assert len(result.report.fused) == 1
    (tmp_path / "out").mkdir()
    result.save(tmp_path / "out" / "m.onnx")  # another directory: no data file to copy, and none is looked for
    saved = onnx.load(tmp_path / "out" / "m.onnx")
    assert [n.op_type for n in saved.graph.node if n.domain == "ai.sgdfuse"] == ["SGD"]


def test_a_model_with_an_escaping_location_in_an_int_attribute_is_still_refused(tmp_path):
    """The case the markers exist for: the location is found and refused before anything is read."""
    model = dict(_placements("../outside.bin"))["tensor field of an INT attribute"]
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(ExternalDataError, match="outside.bin"):
        sgdfuse.optimize(path, verify=False)
