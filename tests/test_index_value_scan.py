"""The native value-info scanner (sgdfuse.passes.value_scan) against protobuf's own parse, and build_index
with it against build_index reading through protobuf's Python API (SGDFUSE_NATIVE_SCAN=0)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from sgdfuse.passes import index as index_module
from sgdfuse.passes.scan import ScanError
from sgdfuse.passes.value_scan import INPUT, OUTPUT, VALUE_INFO, native_available, scan_value_infos


@pytest.fixture(autouse=True, scope="module")
def _scanner_builds() -> None:
    # Fail, not skip, when the scanner cannot be built: a skip would hide a broken build (CI has a compiler and
    # Python's headers; ScannerBuildError says what is missing).
    scan_value_infos(helper.make_model(helper.make_graph([], "empty", [], [])).SerializeToString(), INPUT)
    assert native_available(), "SGDFUSE_NATIVE_SCAN=0 turns the scanner these tests check off"

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"
MODELS = sorted(TESTDATA.rglob("*.onnx"))


def _protobuf_answer(model: onnx.ModelProto) -> list[list[tuple[str, onnx.TypeProto]]]:
    graph = model.graph
    return [[(info.name, info.type) for info in infos] for infos in (graph.input, graph.output, graph.value_info)]


def _scanned_answer(data: bytes) -> list[list[tuple[str, onnx.TypeProto]]]:
    scanned = scan_value_infos(data, INPUT | OUTPUT | VALUE_INFO)
    return [
        [(name, onnx.TypeProto.FromString(scanned.types[k])) for name, k in zip(names, ids)]
        for names, ids in zip(scanned.names, scanned.type_ids)
    ]


@pytest.mark.parametrize("path", MODELS, ids=lambda p: str(p.relative_to(TESTDATA)))
def test_scan_reads_the_value_infos_protobuf_parses(path: Path) -> None:
    model = onnx.load(path, load_external_data=False)
    data = model.SerializeToString()
    assert _scanned_answer(data) == _protobuf_answer(model)
    assert scan_value_infos(data, VALUE_INFO).node_count == len(model.graph.node)


def _info_bytes(*fields: bytes) -> bytes:
    """A ModelProto whose graph holds one value_info made of the given serialised fields."""
    info = b"".join(fields)
    graph = b"\x6a" + bytes([len(info)]) + info  # GraphProto.value_info = 13, length-delimited
    return b"\x3a" + bytes([len(graph)]) + graph  # ModelProto.graph = 7


def _type_field(type_proto: onnx.TypeProto) -> bytes:
    payload = type_proto.SerializeToString()
    return b"\x12" + bytes([len(payload)]) + payload


def test_a_type_given_twice_is_merged_and_the_last_name_wins() -> None:
    first = helper.make_tensor_type_proto(TensorProto.FLOAT, None)
    second = onnx.TypeProto()
    second.tensor_type.shape.dim.add().dim_value = 3
    data = _info_bytes(b"\x0a\x01a", _type_field(first), b"\x0a\x01b", _type_field(second), b"\x08\x05")  # field 1 as a varint: unknown
    model = onnx.ModelProto.FromString(data)
    assert _scanned_answer(data) == _protobuf_answer(model)
    assert _scanned_answer(data)[2][0][0] == "b"


def test_a_name_that_is_not_utf8_and_truncated_bytes_are_refused() -> None:
    with pytest.raises(ScanError):
        scan_value_infos(_info_bytes(b"\x0a\x01\xff"), VALUE_INFO)
    with pytest.raises(ScanError):
        scan_value_infos(_info_bytes(b"\x0a\x01a")[:-2], VALUE_INFO)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: str(p.relative_to(TESTDATA)))
def test_index_specs_equal_the_protobuf_readers(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = onnx.load(path, load_external_data=False)
    native = index_module.build_index(model)
    monkeypatch.setenv("SGDFUSE_NATIVE_SCAN", "0")
    python = index_module.build_index(model)
    assert native.specs == python.specs
    assert native.nodes == python.nodes
