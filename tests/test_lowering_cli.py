"""``sgdfuse lower``: the .air/.init.air/JSON outputs, ``--format onnx-atc`` (the ATC-ready ONNX model and the
op plugin source), and refusals as one ``error:`` line with exit 1."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

from sgdfuse.cli import main
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.onnx_atc import ATC_OP_KEY, plugin_source, to_onnx_atc
from test_lowering_support import TESTDATA, fused, sgd_model

MODEL = TESTDATA / "mlp_train_step_legacy.onnx"


def _lower(*args: str | Path, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["lower", *map(str, args)])
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err


def test_lower_writes_air_init_air_and_json(tmp_path, capsys):
    out = tmp_path / "step.air"
    code, stdout, _ = _lower(MODEL, "--soc", "Ascend910B2", "-o", out, "--json", tmp_path / "step.json", capsys=capsys)
    assert code == 0
    step = ge_ir.ModelDef.FromString(out.read_bytes())
    init = ge_ir.ModelDef.FromString((tmp_path / "step.init.air").read_bytes())
    assert [op.type for op in step.graph[0].op].count("SGD") == 4
    assert {op.type for op in init.graph[0].op} >= {"Variable", "Assign", "Data", "Const", "NetOutput"}
    document = json.loads((tmp_path / "step.json").read_text())
    assert any(op["type"] == "SGD" for op in document["graph"][0]["op"])
    assert "Atlas A2 series" in stdout and "step.init.air" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.air", "step.init.air", "step.json"]


def test_default_output_is_beside_the_model(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    shutil.copy(MODEL, model)
    assert _lower(model, "--soc", "Ascend950PR_9599", capsys=capsys)[0] == 0
    assert (tmp_path / "m.air").exists() and (tmp_path / "m.init.air").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("--soc", "Ascend910X"), "unknown SoC version; did you mean Ascend910"),
        (("--soc", "Ascend910B2", "-o", "missing/dir/out.air"), "does not exist"),
    ],
)
def test_refusals_are_one_error_line_and_write_nothing(tmp_path, capsys, args, message):
    before = sorted(os.listdir(tmp_path))
    code, _, stderr = _lower(MODEL, *[a if not a.startswith("missing") else str(tmp_path / a) for a in args], capsys=capsys)
    assert code == 1
    assert stderr.startswith("error: ") and message in stderr
    assert sorted(os.listdir(tmp_path)) == before


def test_bfloat16_refusal_names_node_tensor_and_clause(tmp_path, capsys):
    model = tmp_path / "bf16.onnx"
    onnx.save(sgd_model(TensorProto.BFLOAT16), model)
    code, _, stderr = _lower(model, "--soc", "Ascend310P3", capsys=capsys)
    assert code == 1
    assert "node update/SGD, tensor w" in stderr and "contract: Atlas inference series: dtypes FLOAT, FLOAT16" in stderr
    assert not (tmp_path / "bf16.air").exists()


def test_unknown_format_is_a_usage_error(capsys):
    code, _, stderr = _lower(MODEL, "--soc", "Ascend910B2", "--format", "om", capsys=capsys)
    assert code == 2 and "--format" in stderr


def test_an_unfused_model_gets_one_summary_line_of_what_fused_what_was_refused_and_the_check(tmp_path, capsys):
    # Two updates: one fuses, one with a runtime dampening is refused (the contract needs it as an attribute).
    from forms import Builder

    b = Builder()
    p, g, buf, d = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf"), b.scalar_input("d")
    b.add(b.mul(buf, b.scalar(0.9)), b.mul(g, b.sub(b.scalar(1.0), d)), out="buf_out")
    b.sub(p, b.mul(b.scalar(0.1), "buf_out"), out="p_out")
    q, gq, bufq = b.tensor_input("q"), b.tensor_input("gq"), b.tensor_input("bufq")
    b.add(b.mul(bufq, b.scalar(0.9)), gq, out="bufq_out")
    b.sub(q, b.mul(b.scalar(0.1), "bufq_out"), out="q_out")
    model = tmp_path / "two.onnx"
    onnx.save(b.model(["p_out", "buf_out", "q_out", "bufq_out"]), model)
    code, stdout, stderr = _lower(model, "--soc", "Ascend910B2", capsys=capsys)
    assert code == 0 and not stderr
    [line] = [line for line in stdout.splitlines() if "optimised first" in line]
    assert "two.onnx had no ai.sgdfuse::SGD node" in line
    assert "1 update(s) fused, 1 refused (1 runtime-hyperparameter)" in line
    assert "verification ran (1 update(s), 3 chained steps in onnxruntime, 0 failed)" in line


def test_a_fused_model_is_lowered_without_an_optimisation_line(tmp_path, capsys):
    model = tmp_path / "fused.onnx"
    onnx.save(sgd_model(), model)
    code, stdout, stderr = _lower(model, "--soc", "Ascend910B2", capsys=capsys)
    assert code == 0 and "optimised first" not in stdout and not stderr


@pytest.mark.parametrize("output_format", ["air", "onnx-atc"])
def test_a_model_with_nothing_to_fuse_is_lowered_with_a_warning_line(tmp_path, capsys, output_format):
    from forms import Builder

    b = Builder()
    b.add(b.tensor_input("x"), b.tensor_input("y"), out="z")
    model = tmp_path / "plain.onnx"
    onnx.save(b.model(["z"]), model)
    code, stdout, stderr = _lower(model, "--soc", "Ascend910B2", "--format", output_format, capsys=capsys)
    assert code == 0
    assert "so it was optimised first: 0 update(s) fused" in stdout
    [warning] = stderr.splitlines()
    assert warning.startswith("warning: plain.onnx has no momentum-SGD update to lower") and "sgdfuse inspect" in warning


def test_console_script_runs(tmp_path):
    script = Path(sys.executable).with_name("sgdfuse")
    executable = str(script) if script.exists() else shutil.which("sgdfuse")
    assert executable
    result = subprocess.run(
        [executable, "lower", str(TESTDATA / "sgd_fp16_wd_legacy.onnx"), "--soc", "Ascend910B", "-o", str(tmp_path / "fp16.air")],
        capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"), timeout=120,
    )
    assert result.returncode == 0, result.stderr
    step = ge_ir.ModelDef.FromString((tmp_path / "fp16.air").read_bytes())
    sgd = next(op for op in step.graph[0].op if op.type == "SGD")
    assert sgd.input_desc[0].dtype == ge_ir.DataType.values_by_name["DT_FLOAT16"].number


# ---- --format onnx-atc ------------------------------------------------------------------------------------


def _atc_keys(model: onnx.ModelProto) -> list[str]:
    """The op keys ATC's ONNX parser computes (docs/lowering.md, "ONNX for ATC's parser"):
    ``<domain>::<version of that domain in opset_import>::<op_type>``; an empty domain is allowed only with a
    single opset_import entry."""
    versions = {entry.domain: entry.version for entry in model.opset_import}
    keys = []
    for node in model.graph.node:
        domain = node.domain
        if domain:
            assert domain in versions, f"ATC: the opset of domain {domain} has no version"
            version = versions[domain]
        else:
            assert len(versions) == 1, "ATC refuses an empty domain beside another opset"
            domain, version = next(iter(versions.items()))
        keys.append(f"{domain or 'ai.onnx'}::{version}::{node.op_type}")
    return keys


def test_onnx_atc_model_has_explicit_domains_the_documented_key_and_no_functions(tmp_path, capsys):
    out = tmp_path / "mlp.atc.onnx"
    code, stdout, _ = _lower(MODEL, "--soc", "Ascend910B2", "--format", "onnx-atc", "-o", out, capsys=capsys)
    assert code == 0 and ATC_OP_KEY in stdout
    model = onnx.load(out)
    assert ATC_OP_KEY == "ai.sgdfuse::1::SGD"
    assert not model.functions
    assert all(node.domain for node in model.graph.node)
    keys = _atc_keys(model)
    assert keys.count(ATC_OP_KEY) == 4
    assert {k for k in keys if k != ATC_OP_KEY} <= {f"ai.onnx::20::{op}" for op in ("Gemm", "Relu", "Sub", "Mul", "ReduceMean", "Shape", "ConstantOfShape", "Constant", "ReduceSum", "Reshape", "LessOrEqual", "Where")}
    plugin = (tmp_path / "mlp.atc.sgd_onnx_plugin.cc").read_text()
    assert plugin == plugin_source()


def test_onnx_atc_keeps_the_graph_and_does_not_mutate_its_input():
    source = fused(MODEL)
    before = source.SerializeToString()
    prepared = to_onnx_atc(source, soc="Ascend910B2")
    assert source.SerializeToString() == before
    assert [n.op_type for n in prepared.graph.node] == [n.op_type for n in source.graph.node]
    assert [o.name for o in prepared.graph.output] == [o.name for o in source.graph.output]


def test_onnx_atc_checks_the_product_line_too():
    from sgdfuse.errors import ProductLineError

    with pytest.raises(ProductLineError, match="no dynamic shape"):
        to_onnx_atc(sgd_model(shape=("N", 3)), soc="Ascend910B2")


def test_json_is_for_air_only(capsys):
    code, _, stderr = _lower(MODEL, "--soc", "Ascend910B2", "--format", "onnx-atc", "--json", "x.json", capsys=capsys)
    assert code == 2 and "--json" in stderr


def test_plugin_source_registers_the_key_and_maps_it_to_ge_sgd():
    source = plugin_source()
    registration = re.search(r"REGISTER_CUSTOM_OP\(\"(\w+)\"\)(.*?);", source, re.S)
    assert registration and registration.group(1) == "PartitionedCall"
    chain = registration.group(2)
    assert ".FrameworkType(ONNX)" in chain
    assert f'.OriginOpType("{ATC_OP_KEY}")' in chain
    assert ".ParseParamsByOperatorFn(ParseParamsSgdfuseSGD)" in chain and ".ParseOpToGraphFn(ParseOpToGraphSgdfuseSGD)" in chain
    assert "Status ParseParamsSgdfuseSGD(const ge::Operator &op_src, ge::Operator &op_dest)" in source
    assert "Status ParseOpToGraphSgdfuseSGD(const ge::Operator &op, ge::Graph &graph)" in source
    # the ONNX attributes, by name and ONNX attribute type, become the GE attributes
    for name, kind in (("dampening", "kOnnxAttrFloat"), ("weight_decay", "kOnnxAttrFloat"), ("nesterov", "kOnnxAttrInt")):
        assert f'name == "{name}" && type == {kind}' in source
        assert f'op_dest.SetAttr("{name}", {name});' in source
        assert f".set_attr_{name}({name})" in source
    assert "constexpr int kOnnxAttrFloat = 1;" in source and "constexpr int kOnnxAttrInt = 2;" in source
    # GE SGD's inputs in contract order, fed by Data ops of index 0..5
    order = [m.group(1) for m in re.finditer(r"\.set_input_(\w+)\(", source.split("ge::op::SGD(")[1].split(";")[0])]
    assert order == ["parameters", "gradient", "learning_rate", "accum", "momentum", "stat"]
    for index, port in enumerate(order):
        assert f'ge::op::Data((name + "_{port}").c_str()).set_attr_index({index});' in source
    # three outputs: SGD's parameters, then copies of accum and stat taken after the update
    assert "accum_out.AddControlInput(sgd);" in source and "stat_out.AddControlInput(sgd);" in source
    assert re.findall(r"outputs\.emplace_back\((\w+),", source) == ["sgd", "accum_out", "stat_out"]
    assert 'op_dest.DynamicInputRegister("x", kSgdInputs);' in source and "constexpr int kSgdInputs = 6;" in source
    assert 'op_dest.DynamicOutputRegister("y", kSgdOutputs);' in source and "constexpr int kSgdOutputs = 3;" in source
    assert f'op_dest.SetAttr("original_type", "{ATC_OP_KEY}");' in source
    assert source.count("{") == source.count("}") and source.count("(") == source.count(")")


# Minimal declarations of the CANN/GE API surface the plugin uses, as the public headers declare them (to our
# knowledge): they check the generated text is well-formed C++ against that surface, not against CANN itself.
_STUBS = {
    "graph/operator.h": r"""
#pragma once
#include <cstdint>
#include <string>
namespace ge {
using graphStatus = uint32_t;
constexpr graphStatus GRAPH_SUCCESS = 0;
class AscendString { public: AscendString() = default; AscendString(const char *) {} const char *GetString() const { return ""; } };
class Operator {
 public:
  graphStatus GetAttr(const char *, AscendString &) const { return 0; }
  graphStatus GetAttr(const char *, float &) const { return 0; }
  graphStatus GetAttr(const char *, bool &) const { return 0; }
  graphStatus GetName(AscendString &) const { return 0; }
  Operator &SetAttr(const char *, const AscendString &) { return *this; }
  Operator &SetAttr(const char *, float) { return *this; }
  Operator &SetAttr(const char *, bool) { return *this; }
  Operator &SetAttr(const char *, const char *) { return *this; }
  void DynamicInputRegister(const char *, uint32_t) {}
  void DynamicOutputRegister(const char *, uint32_t) {}
  Operator &AddControlInput(const Operator &) { return *this; }
};
}  // namespace ge
""",
    "graph/graph.h": r"""
#pragma once
#include <utility>
#include <vector>
#include "graph/operator.h"
namespace ge {
class Graph {
 public:
  Graph &SetInputs(const std::vector<Operator> &) { return *this; }
  Graph &SetOutputs(const std::vector<std::pair<Operator, std::vector<size_t>>> &) { return *this; }
};
}  // namespace ge
""",
    "register/register.h": r"""
#pragma once
#include "graph/graph.h"
#include "graph/operator.h"
namespace domi {
using Status = uint32_t;
constexpr Status SUCCESS = 0;
enum FrameworkType { ONNX = 5 };
enum class ImplyType { TVM };
class OpRegistrationData {
 public:
  explicit OpRegistrationData(const char *) {}
  OpRegistrationData &FrameworkType(const domi::FrameworkType &) { return *this; }
  OpRegistrationData &OriginOpType(const char *) { return *this; }
  OpRegistrationData &ParseParamsByOperatorFn(Status (*)(const ge::Operator &, ge::Operator &)) { return *this; }
  OpRegistrationData &ParseOpToGraphFn(Status (*)(const ge::Operator &, ge::Graph &)) { return *this; }
  OpRegistrationData &ImplyType(const domi::ImplyType &) { return *this; }
};
struct OpReceiver { OpReceiver(const OpRegistrationData &) {} };
}  // namespace domi
#define SGDFUSE_STUB_CAT(a, b) a##b
#define SGDFUSE_STUB_REG(ctr, name) static domi::OpReceiver SGDFUSE_STUB_CAT(register_op, ctr) __attribute__((unused)) = domi::OpRegistrationData(name)
#define REGISTER_CUSTOM_OP(name) SGDFUSE_STUB_REG(__COUNTER__, name)
""",
    "all_ops.h": r"""
#pragma once
#include "graph/operator.h"
namespace ge { namespace op {
struct Data : Operator { explicit Data(const char *) {} Data &set_attr_index(int64_t) { return *this; } };
struct TensorMove : Operator { explicit TensorMove(const char *) {} TensorMove &set_input_x(const Operator &) { return *this; } };
struct SGD : Operator {
  explicit SGD(const char *) {}
  SGD &set_input_parameters(const Operator &) { return *this; }
  SGD &set_input_gradient(const Operator &) { return *this; }
  SGD &set_input_learning_rate(const Operator &) { return *this; }
  SGD &set_input_accum(const Operator &) { return *this; }
  SGD &set_input_momentum(const Operator &) { return *this; }
  SGD &set_input_stat(const Operator &) { return *this; }
  SGD &set_attr_dampening(float) { return *this; }
  SGD &set_attr_weight_decay(float) { return *this; }
  SGD &set_attr_nesterov(bool) { return *this; }
};
} }  // namespace ge::op
""",
    "json.hpp": r"""
#pragma once
#include <string>
#include <vector>
namespace nlohmann {
class json {
 public:
  static json parse(const char *) { return json(); }
  json &operator[](const char *) { return *this; }
  const json &operator[](const char *) const { return *this; }
  template <typename T> T get() const { return T(); }
  bool operator==(const char *) const { return false; }
  std::vector<json>::const_iterator begin() const { return items.begin(); }
  std::vector<json>::const_iterator end() const { return items.end(); }
  std::vector<json> items;
};
}  // namespace nlohmann
""",
}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_plugin_source_is_well_formed_cpp_against_the_api_it_uses(tmp_path):
    for name, text in _STUBS.items():
        header = tmp_path / "include" / name
        header.parent.mkdir(parents=True, exist_ok=True)
        header.write_text(text)
    source = tmp_path / "sgd_onnx_plugin.cc"
    source.write_text(plugin_source())
    result = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", str(tmp_path / "include"), str(source)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
