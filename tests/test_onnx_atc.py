"""``sgdfuse lower --format onnx-atc`` (docs/atc.md): the ONNX model passes ``onnx.checker`` (full check) for
every testdata model, its SGD nodes carry ATC's key and the exact float32 bits of their FLOAT attributes, and
the plugin source compiles against the CANN API it uses (declared in tests/cann_api) and reads the node's
attributes the way ATC's ONNX parser passes them.

How ATC's parser passes them (public parser source, ``pb2json.cc`` / ``message2operator.cc``; emulated here by
:func:`atc_attribute_json`, independently of the plugin): the node's ``AttributeProto`` list becomes
``{"attribute": [{"name": ..., "type": 1 | 2, "f": ..., "i": ...}]}``, dumped with an indent of 2; ``f`` is the
``%g`` text of the float when it fits in 9 characters, otherwise a JSON number (newer parsers) or ``""`` (older
ones); zero ``f``/``i`` fields are left out by older parsers (proto3) and written by the newest.

The C++ checks need g++ and the nlohmann-json headers (the ``nlohmann-json`` package of the test extra); a
missing one fails with a message, it is never skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from sgdfuse import api
from sgdfuse.cli import main
from sgdfuse.contract import SgdAttributes
from sgdfuse.fused_op import is_sgd_node
from sgdfuse.lowering.onnx_atc import (
    ATC_OP_KEY,
    attribute_reader_source,
    float32_bits,
    plugin_path_for,
    plugin_source,
    to_onnx_atc,
)
from test_lowering_support import sgd_model

ROOT = Path(__file__).resolve().parent.parent
CANN_API = Path(__file__).resolve().parent / "cann_api"
ONNX_TESTDATA = sorted((ROOT / "testdata").glob("*/*.onnx"))
MLP = ROOT / "testdata" / "torch" / "mlp_train_step_legacy.onnx"
SOC = "Ascend950PR_9599"  # the line that accepts every dtype and dynamic shapes: the form is under test, not the line
FLOAT, INT = onnx.AttributeProto.FLOAT, onnx.AttributeProto.INT


# ---- helpers ------------------------------------------------------------------------------------------------


def gxx() -> str:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.fail("g++ is needed to compile the ATC plugin source (Debian: apt-get install g++)")
    return compiler


def nlohmann_include() -> Path:
    try:
        import nlohmann_json
    except ImportError:
        pytest.fail("the nlohmann-json headers are needed (pip install 'nlohmann-json>=3.10', in the test extra)")
    return Path(str(nlohmann_json.get_include()))


def compile_flags() -> list[str]:
    include = nlohmann_include()
    # the plugin includes "json.hpp" as CANN's samples do; the package ships it as nlohmann/json.hpp
    return ["-Wall", "-Wextra", "-Werror", "-I", str(include / "nlohmann"), "-I", str(include)]


def atc_key(model: onnx.ModelProto, node: onnx.NodeProto) -> str:
    """The key ATC's parser computes for a custom-domain node: ``<domain>::<its opset version>::<op_type>``."""
    versions = {entry.domain: entry.version for entry in model.opset_import}
    return f"{node.domain}::{versions[node.domain]}::{node.op_type}"


def g_text(value: float) -> str:
    """C's ``%g`` of a float32 value (promoted to double, as printf does); Python's ``%g`` is the same
    correctly rounded conversion."""
    return "%g" % value


def atc_attribute_json(node: onnx.NodeProto, *, long_float: str = "number", zeros: str = "left-out", floats: str = "text") -> str:
    """The ``"attribute"`` JSON ATC's parser passes the plugin for ``node``.

    Args:
        long_float: a FLOAT whose ``%g`` text does not fit in 9 characters becomes a JSON ``"number"`` (newer
            parsers) or ``"empty"`` text (older ones).
        zeros: zero ``f``/``i`` fields ``"left-out"`` (proto3, older parsers) or ``"written"`` (newest).
        floats: ``"text"`` (``%g``, the parser's form) or ``"number"`` for every FLOAT.
    """
    entries = []
    for attribute in node.attribute:
        entry: dict = {"name": attribute.name, "type": int(attribute.type)}
        if attribute.type == FLOAT:
            value = attribute.f
            if value != 0 or zeros == "written":
                text = g_text(value)
                if floats == "number":
                    entry["f"] = value
                elif len(text) <= 9:
                    entry["f"] = text
                else:
                    entry["f"] = value if long_float == "number" else ""
        elif attribute.type == INT:
            if attribute.i != 0 or zeros == "written":
                entry["i"] = attribute.i
        entries.append(entry)
    return json.dumps({"attribute": entries}, indent=2)


def bits_of(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def sgd_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if is_sgd_node(n)]


def atc_model(path: Path) -> onnx.ModelProto:
    # fused without verification: the form is under test here; test_lowering_models checks the numbers
    return to_onnx_atc(api.optimize(path, verify=False).model, soc=SOC, optimise=False)


_HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include "json.hpp"
@READER@
// Reads NUL-separated JSON documents from stdin; one result line per document.
int main() {
  std::string document;
  while (std::getline(std::cin, document, '\0')) {
    sgdfuse_atc::SgdAttributes attributes;
    attributes.dampening = -7.0f;  // a sentinel: a failed read must leave the struct unchanged
    std::string error;
    if (sgdfuse_atc::ReadSgdAttributes(document, attributes, error)) {
      uint32_t dampening = 0, weight_decay = 0;
      std::memcpy(&dampening, &attributes.dampening, sizeof dampening);
      std::memcpy(&weight_decay, &attributes.weight_decay, sizeof weight_decay);
      std::printf("ok %u %u %d\n", dampening, weight_decay, attributes.nesterov ? 1 : 0);
    } else {
      for (char &c : error) {
        if (c == '\n') c = ' ';
      }
      std::printf("error %s | sentinel %s\n", error.c_str(), attributes.dampening == -7.0f ? "kept" : "changed");
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """The plugin's attribute reader compiled alone (C++11) into a harness; call it with JSON documents."""
    work = tmp_path_factory.mktemp("reader")
    source = work / "reader.cc"
    source.write_text(_HARNESS.replace("@READER@", attribute_reader_source()))
    binary = work / "reader"
    built = subprocess.run([gxx(), "-std=c++11", "-O0", *compile_flags(), str(source), "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr

    def run(documents: list[str]) -> list[str]:
        assert all("\0" not in d for d in documents)
        result = subprocess.run([str(binary)], input="\0".join(documents) + "\0", capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr  # no abort, no uncaught exception
        lines = result.stdout.splitlines()
        assert len(lines) == len(documents), result.stdout
        return lines

    return run


def expected_ok(node: onnx.NodeProto) -> str:
    """What the reader must return for a node: the bits of its FLOAT attributes as ONNX stores them."""
    values = {a.name: a for a in node.attribute}
    return f"ok {bits_of(values['dampening'].f)} {bits_of(values['weight_decay'].f)} {values['nesterov'].i}"


# ---- the ONNX model -----------------------------------------------------------------------------------------


def test_testdata_has_onnx_models_of_every_exporter():
    assert {p.parent.name for p in ONNX_TESTDATA} >= {"torch", "torch_default_names", "jax", "keras"}
    assert len(ONNX_TESTDATA) >= 60


@pytest.mark.parametrize("path", ONNX_TESTDATA, ids=[f"{p.parent.name}/{p.stem}" for p in ONNX_TESTDATA])
def test_every_onnx_atc_output_passes_the_full_checker(path):
    model = atc_model(path)
    onnx.checker.check_model(model, full_check=True)
    assert not model.functions  # ATC's parser reads graph and opset_import only
    standard = [n for n in model.graph.node if not is_sgd_node(n)]
    assert all(n.domain == "" for n in standard)
    assert [e.domain for e in model.opset_import].count("") == 1 and "ai.onnx" not in {e.domain for e in model.opset_import}
    for node in sgd_nodes(model):
        assert atc_key(model, node) == ATC_OP_KEY == "ai.sgdfuse::1::SGD"
        kinds = {a.name: a.type for a in node.attribute}
        assert kinds == {"dampening": FLOAT, "weight_decay": FLOAT, "nesterov": INT, "dampening_bits": INT, "weight_decay_bits": INT}


def test_the_mlp_step_has_four_sgd_nodes_with_the_bits_of_their_floats():
    source = api.optimize(MLP, verify=False).model
    model = to_onnx_atc(source, soc=SOC, optimise=False)
    nodes = sgd_nodes(model)
    assert len(nodes) == 4
    for before, after in zip(sgd_nodes(source), nodes):
        original = {a.name: onnx.helper.get_attribute_value(a) for a in before.attribute}
        values = {a.name: onnx.helper.get_attribute_value(a) for a in after.attribute}
        for name in ("dampening", "weight_decay"):
            stored = np.float32(original.get(name, 0.0))  # ONNX keeps a FLOAT attribute as float32
            assert values[name + "_bits"] == int(np.array(stored).view(np.uint32))
            assert np.float32(values[name]) == stored


def test_source_model_is_not_mutated_and_the_graph_keeps_its_nodes_and_outputs():
    source = api.optimize(MLP, verify=False).model
    before = source.SerializeToString()
    prepared = to_onnx_atc(source, soc=SOC, optimise=False)
    assert source.SerializeToString() == before
    assert [n.op_type for n in prepared.graph.node] == [n.op_type for n in source.graph.node]
    assert [o.name for o in prepared.graph.output] == [o.name for o in source.graph.output]


def test_explicit_onnx_domain_writes_ai_onnx_which_the_checker_refuses():
    model = to_onnx_atc(api.optimize(MLP, verify=False).model, soc=SOC, optimise=False, explicit_onnx_domain=True)
    assert all(n.domain == "ai.onnx" for n in model.graph.node if not is_sgd_node(n))
    assert {e.domain for e in model.opset_import} == {"ai.onnx", "ai.sgdfuse"}
    with pytest.raises(onnx.checker.ValidationError, match="No Op registered"):
        onnx.checker.check_model(model)


def test_an_input_already_in_explicit_domains_comes_out_in_the_default_one():
    explicit = to_onnx_atc(api.optimize(MLP, verify=False).model, soc=SOC, optimise=False, explicit_onnx_domain=True)
    again = to_onnx_atc(explicit, soc=SOC, optimise=False)
    onnx.checker.check_model(again, full_check=True)
    assert all(n.domain == "" for n in again.graph.node if not is_sgd_node(n))


def atc_parser_keys(model: onnx.ModelProto) -> list[str]:
    """The op keys ATC's ONNX parser computes (``ConstructOriType`` in the public ``parser/onnx/onnx_parser.cc``,
    every version from 2020 to 2023-12): a node with a domain takes that domain's version from
    ``opset_import``; a node without one is resolved only when ``opset_import`` has a single entry.

    Raises:
        ValueError: where that parser refuses the node.
    """
    versions = {entry.domain: entry.version for entry in model.opset_import}
    keys = []
    for node in model.graph.node:
        if node.domain:
            if node.domain not in versions:
                raise ValueError(f"the opset of domain {node.domain} has no version")
            keys.append(f"{node.domain}::{versions[node.domain]}::{node.op_type}")
        elif len(versions) == 1:
            ((domain, version),) = versions.items()
            keys.append(f"{domain or 'ai.onnx'}::{version}::{node.op_type}")
        else:
            raise ValueError(f"node {node.name}: an empty domain beside {len(versions)} opset_import entries")
    return keys


def test_explicit_form_resolves_every_node_under_the_rule_of_the_public_atc_parsers():
    model = to_onnx_atc(api.optimize(MLP, verify=False).model, soc=SOC, optimise=False, explicit_onnx_domain=True)
    keys = atc_parser_keys(model)
    assert keys.count(ATC_OP_KEY) == 4
    assert {k for k in keys if k != ATC_OP_KEY} == {f"ai.onnx::20::{n.op_type}" for n in model.graph.node if not is_sgd_node(n)}


def test_default_form_is_the_one_those_parsers_refuse():
    # The trade-off docs/atc.md describes: the checker-clean default needs a parser that resolves "" beside a
    # custom domain; --explicit-onnx-domain is the form the public parser source accepts.
    with pytest.raises(ValueError, match="empty domain"):
        atc_parser_keys(atc_model(MLP))


def test_float32_bits_are_ieee_binary32_patterns():
    assert float32_bits(1.0) == 0x3F800000
    assert float32_bits(-0.0) == 0x80000000
    assert float32_bits(0.1) == int(np.array(np.float32(0.1)).view(np.uint32))


# ---- the CLI ------------------------------------------------------------------------------------------------


def _lower(*args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["lower", *map(str, args)])
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err


def test_cli_writes_a_checker_clean_model_and_the_plugin_beside_it(tmp_path, capsys):
    out = tmp_path / "mlp.atc.onnx"
    code, stdout, _ = _lower(MLP, "--soc", "Ascend910B2", "--format", "onnx-atc", "-o", out, capsys=capsys)
    assert code == 0 and ATC_OP_KEY in stdout and 'default domain ""' in stdout
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert plugin_path_for(out).read_text() == plugin_source()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.atc.onnx", "mlp.atc.sgd_onnx_plugin.cc"]


def test_cli_explicit_onnx_domain_says_the_checker_refuses_it(tmp_path, capsys):
    out = tmp_path / "mlp.atc.onnx"
    code, stdout, _ = _lower(MLP, "--soc", "Ascend910B2", "--format", "onnx-atc", "--explicit-onnx-domain", "-o", out, capsys=capsys)
    assert code == 0 and "domain ai.onnx" in stdout and "onnx.checker refuses" in stdout
    assert all(n.domain == "ai.onnx" for n in onnx.load(out).graph.node if not is_sgd_node(n))


def test_cli_explicit_onnx_domain_is_for_onnx_atc_only(tmp_path, capsys):
    code, _, stderr = _lower(MLP, "--soc", "Ascend910B2", "--explicit-onnx-domain", "-o", tmp_path / "m.air", capsys=capsys)
    assert code == 2 and "--explicit-onnx-domain" in stderr
    assert not list(tmp_path.iterdir())


# ---- the plugin compiles against the CANN API it uses -------------------------------------------------------


def test_plugin_source_compiles_against_the_declared_cann_api(tmp_path):
    source = tmp_path / "sgd_onnx_plugin.cc"
    source.write_text(plugin_source())
    result = subprocess.run(
        [gxx(), "-std=c++17", "-fsyntax-only", *compile_flags(), "-I", str(CANN_API), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr


def test_the_declared_api_keeps_dynamic_register_protected_as_cann_does(tmp_path):
    # Pins the property the plugin must respect: calling the protected members does not compile.
    source = tmp_path / "protected.cc"
    source.write_text('#include "graph/operator.h"\nvoid f(ge::Operator &op) { op.DynamicInputRegister("x", 6); }\n')
    result = subprocess.run([gxx(), "-std=c++17", "-fsyntax-only", "-I", str(CANN_API), str(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "protected" in result.stderr
    assert not re.search(r"\bDynamic(Input|Output)Register\s*\(", plugin_source())


def test_plugin_registers_the_key_as_a_partitioned_call_expanded_to_ge_sgd():
    source = plugin_source()
    assert attribute_reader_source() in source
    registration = re.search(r"REGISTER_CUSTOM_OP\(\"(\w+)\"\)(.*?);", source, re.S)
    assert registration and registration.group(1) == "PartitionedCall"
    chain = registration.group(2)
    assert ".FrameworkType(ONNX)" in chain and f'.OriginOpType("{ATC_OP_KEY}")' in chain
    assert ".ParseParamsByOperatorFn(ParseParamsSgdfuseSGD)" in chain and ".ParseOpToGraphFn(ParseOpToGraphSgdfuseSGD)" in chain
    assert f'op_dest.SetAttr("original_type", "{ATC_OP_KEY}");' in source
    # six inputs and three outputs through the public AutoMappingByOpFnDynamic
    assert "AutoMappingByOpFnDynamic(op_src, op_dest, ports)" in source
    assert "constexpr int64_t kSgdInputs = 6;" in source and "constexpr int64_t kSgdOutputs = 3;" in source
    # GE SGD's inputs in contract order, fed by Data ops of index 0..5
    order = [m.group(1) for m in re.finditer(r"\.set_input_(\w+)\(", source.split("ge::op::SGD(")[1].split(";")[0])]
    assert order == ["parameters", "gradient", "learning_rate", "accum", "momentum", "stat"]
    for index, port in enumerate(order):
        assert f'ge::op::Data((name + "_{port}").c_str()).set_attr_index({index});' in source
    assert "accum_out.AddControlInput(sgd);" in source and "stat_out.AddControlInput(sgd);" in source
    assert re.findall(r"outputs\.emplace_back\((\w+),", source) == ["sgd", "accum_out", "stat_out"]
    for name in ("dampening", "weight_decay", "nesterov"):
        assert f'op_dest.SetAttr("{name}", attributes.{name});' in source and f".set_attr_{name}({name})" in source


# ---- the attribute reader, on JSON as ATC's parser writes it ------------------------------------------------

ENCODINGS = [
    dict(long_float="number", zeros="left-out"),
    dict(long_float="number", zeros="written"),
    dict(long_float="empty", zeros="left-out"),
    dict(long_float="empty", zeros="written"),
    dict(floats="number", zeros="left-out"),
    dict(floats="number", zeros="written"),
]


def test_reader_reads_every_sgd_node_of_every_testdata_model_in_every_encoding(reader):
    documents, expected = [], []
    for path in ONNX_TESTDATA:
        for node in sgd_nodes(atc_model(path)):
            for encoding in ENCODINGS:
                documents.append(atc_attribute_json(node, **encoding))
                expected.append(expected_ok(node))
    assert len(documents) >= 6 * 100
    assert reader(documents) == expected


def test_reader_reads_the_mlp_step_in_the_form_that_broke_get_float(reader):
    # ATC writes "f" as text: a plugin reading attr["f"] as a number throws type_error 302 on every node
    nodes = sgd_nodes(atc_model(MLP))
    documents = [atc_attribute_json(n) for n in nodes]
    assert all(isinstance(e["f"], str) for d in documents for e in json.loads(d)["attribute"] if "f" in e)
    assert any("f" in e for d in documents for e in json.loads(d)["attribute"])
    assert reader(documents) == [expected_ok(n) for n in nodes]


HARD_VALUES = [
    float(np.nextafter(np.float32(0.1), np.float32(1))),  # 0.100000024: "%g" gives "0.1", the float next to it
    float(np.float32(1e-4)),
    float(np.float32(1.2345678e-5)),  # "%g" text of 11 characters: number or "" by parser version
    float(np.float32(3e-39)),  # subnormal
    float(np.nextafter(np.float32(0.9), np.float32(0))),
    0.0,
]


@pytest.mark.parametrize("encoding", ENCODINGS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_reader_is_exact_where_percent_g_rounds(reader, encoding):
    documents, expected = [], []
    for dampening in HARD_VALUES:
        for weight_decay in HARD_VALUES:
            model = to_onnx_atc(sgd_model(attributes=SgdAttributes(dampening, weight_decay, False)), soc=SOC, optimise=False)
            (node,) = sgd_nodes(model)
            documents.append(atc_attribute_json(node, **encoding))
            expected.append(f"ok {bits_of(dampening)} {bits_of(weight_decay)} 0")
    assert reader(documents) == expected
    # the bits are needed: "%g" alone turns 0.100000024 into 0.1
    assert np.float32(float(g_text(HARD_VALUES[0]))) != np.float32(HARD_VALUES[0])


def _entries(**overrides) -> list[dict]:
    """The attribute entries of a node with dampening 0.25, weight_decay 1e-4 (float32), nesterov 0, in the
    parser's text form; ``overrides`` replaces entries by name (None drops one)."""
    wd = float(np.float32(1e-4))
    entries = {
        "dampening": {"name": "dampening", "type": 1, "f": "0.25"},
        "weight_decay": {"name": "weight_decay", "type": 1, "f": g_text(wd)},
        "nesterov": {"name": "nesterov", "type": 2},
        "dampening_bits": {"name": "dampening_bits", "type": 2, "i": bits_of(0.25)},
        "weight_decay_bits": {"name": "weight_decay_bits", "type": 2, "i": bits_of(wd)},
    }
    for name, entry in overrides.items():
        entries[name] = entry
    return [e for e in entries.values() if e is not None]


def _doc(entries) -> str:
    return json.dumps({"attribute": entries})


def test_reader_accepts_the_baseline_document_type_names_and_left_out_zeros(reader):
    wd_bits = bits_of(float(np.float32(1e-4)))
    by_name = _entries(
        dampening={"name": "dampening", "type": "FLOAT"},  # f left out: 0
        dampening_bits={"name": "dampening_bits", "type": "INT"},  # i left out: 0
        nesterov={"name": "nesterov", "type": "INT", "i": 1},
    )
    assert reader([_doc(_entries()), _doc(by_name)]) == [f"ok {bits_of(0.25)} {wd_bits} 0", f"ok 0 {wd_bits} 1"]


BAD_DOCUMENTS = {
    "malformed JSON": ("{", "cannot be read"),
    "not JSON at all": ("dampening=0.25", "cannot be read"),
    "empty text": ("", "cannot be read"),
    "not an object": ("[]", "not an object"),
    "no attribute array": ('{"attributes": []}', 'no "attribute" array'),
    "attribute not an array": ('{"attribute": {}}', 'no "attribute" array'),
    "entry not an object": (_doc([1]), "is not an object"),
    "entry without a name": (_doc([{"type": 1, "f": "0.25"}]), "has no name"),
    "missing dampening": (_doc(_entries(dampening=None)), "attribute dampening is missing"),
    "missing weight_decay_bits": (_doc(_entries(weight_decay_bits=None)), "attribute weight_decay_bits is missing"),
    "missing nesterov": (_doc(_entries(nesterov=None)), "attribute nesterov is missing"),
    "unknown attribute": (_doc(_entries() + [{"name": "maximize", "type": 2, "i": 1}]), 'unknown attribute "maximize"'),
    "repeated attribute": (_doc(_entries() + [{"name": "nesterov", "type": 2}]), "nesterov appears twice"),
    "FLOAT given as INT": (_doc(_entries(dampening={"name": "dampening", "type": 2, "i": 0})), "dampening has type 2, expected FLOAT"),
    "INT given as FLOAT": (_doc(_entries(nesterov={"name": "nesterov", "type": 1, "f": "1"})), "nesterov has type 1, expected INT"),
    "no type": (_doc(_entries(nesterov={"name": "nesterov"})), "nesterov has type UNDEFINED"),
    "f not a number": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": "abc"})), 'dampening: "f" is "abc", not a finite decimal'),
    "f with trailing text": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": "0.25x"})), "not a finite decimal"),
    "f a boolean": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": True})), "neither a number nor text"),
    "f with a decimal comma": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": "0,25"})), "not a finite decimal"),
    "f inf text": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": "inf"})), "not a finite decimal"),
    "i a float": (_doc(_entries(nesterov={"name": "nesterov", "type": 2, "i": 1.5})), 'nesterov: "i" is 1.5, not an integer'),
    "i text": (_doc(_entries(nesterov={"name": "nesterov", "type": 2, "i": "1"})), "not an integer"),
    "i past int64": (_doc(_entries(nesterov={"name": "nesterov", "type": 2, "i": 2**64 - 1})), "past the int64 range"),
    "nesterov 2": (_doc(_entries(nesterov={"name": "nesterov", "type": 2, "i": 2})), "nesterov is 2, not 0 or 1"),
    "negative bits": (_doc(_entries(dampening_bits={"name": "dampening_bits", "type": 2, "i": -1})), "not a float32 bit pattern"),
    "bits past 32": (_doc(_entries(dampening_bits={"name": "dampening_bits", "type": 2, "i": 2**32})), "not a float32 bit pattern"),
    "NaN bits": (_doc(_entries(dampening_bits={"name": "dampening_bits", "type": 2, "i": 0x7FC00000})), "non-finite"),
    "edited f": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": "0.5"})), "dampening is 0.5 but dampening_bits holds 0.25"),
    "edited number": (_doc(_entries(dampening={"name": "dampening", "type": 1, "f": 0.2500001})), "dampening_bits holds 0.25"),
    "zero f against non-zero bits": (_doc(_entries(dampening={"name": "dampening", "type": 1})), "dampening is 0 but dampening_bits holds 0.25"),
}


def test_reader_refuses_each_bad_document_with_a_message_and_changes_nothing(reader):
    results = reader([document for document, _ in BAD_DOCUMENTS.values()])
    for (case, (_, message)), line in zip(BAD_DOCUMENTS.items(), results):
        assert line.startswith("error "), f"{case}: {line}"
        assert message in line, f"{case}: {line}"
        assert line.endswith("| sentinel kept"), f"{case}: {line}"
