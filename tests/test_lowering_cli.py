"""``sgdfuse lower``: the .air/.init.air/JSON outputs, ``--format onnx-atc`` (the ATC-ready ONNX model and the
op plugin source), and refusals as one ``error:`` line with exit 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

from sgdfuse.cli import main
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.onnx_atc import to_onnx_atc
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
    # Two updates: one fuses, one with decoupled weight decay (p*0.99 - 0.1*buf_out) is refused.
    from forms import Builder

    b = Builder()
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_out")
    b.sub(b.mul(p, b.scalar(0.99)), b.mul(b.scalar(0.1), "buf_out"), out="p_out")
    q, gq, bufq = b.tensor_input("q"), b.tensor_input("gq"), b.tensor_input("bufq")
    b.add(b.mul(bufq, b.scalar(0.9)), gq, out="bufq_out")
    b.sub(q, b.mul(b.scalar(0.1), "bufq_out"), out="q_out")
    model = tmp_path / "two.onnx"
    onnx.save(b.model(["p_out", "buf_out", "q_out", "bufq_out"]), model)
    code, stdout, stderr = _lower(model, "--soc", "Ascend910B2", capsys=capsys)
    assert code == 0 and not stderr
    [line] = [line for line in stdout.splitlines() if "optimised first" in line]
    assert "two.onnx had no ai.sgdfuse::SGD node" in line
    assert "1 update(s) fused, 1 refused (1 extra-term)" in line
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


# The plugin source and the onnx-atc form in detail: tests/test_onnx_atc.py.

