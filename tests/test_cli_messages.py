"""What the CLI says (issue 13, items 3 to 7): an empty file is called empty, ``--soc`` is read in any case
with a suggestion for a typo, a refusal quotes each equation once, FLOAT16 values are shown as the graph's
FLOAT16 constants, and ``optimize``/``inspect`` end with one fused/refused summary line."""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from sgdfuse import cli
from sgdfuse.cli import main
from sgdfuse.lowering import ge_ir
from sgdfuse.report import Refusal, format_value

TORCH = Path(__file__).resolve().parent.parent / "testdata" / "torch"


def _run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as exited:
            code = int(exited.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_soc_in_any_case_is_written_in_atc_spelling(tmp_path):
    code, _, err = _run("lower", TORCH / "sgd_momentum_legacy.onnx", "--soc", "ascend910b2", "-o", tmp_path / "m.air")
    assert code == 0, err
    model = ge_ir.ModelDef.FromString((tmp_path / "m.air").read_bytes())
    assert model.attr["soc_version"].s == b"Ascend910B2"


def test_soc_typo_is_one_error_line_with_a_suggestion_then_one_line_per_product_line(tmp_path):
    code, _, err = _run("lower", TORCH / "sgd_momentum_legacy.onnx", "--soc", "Ascend910B22", "-o", tmp_path / "m.air")
    first, *rest = err.splitlines()
    assert code == 1 and first.startswith("error: --soc Ascend910B22: unknown SoC version; did you mean Ascend910B2")
    assert len(rest) == 6 and all(line.startswith("  ") for line in rest)
    assert "Ascend950PR_95## and Ascend950DT_95##" in err and "Ascend950PR_95xx" not in err
    assert max(len(line) for line in err.splitlines()) < 200
    assert not (tmp_path / "m.air").exists()


def test_refusal_quotes_its_equation_once(capsys):
    code, out, _ = _run("inspect", TORCH / "sgd_nomomentum_legacy.onnx")
    assert code == 0
    assert out.count("w_out = w - 0.1*grad_w") == 1 and "found:" not in out


def test_refusal_explanation_keeps_equations_the_detail_does_not_quote():
    refusal = Refusal("p_out", "extra-term", "p_out has an extra term.", equation="p_out = p - 0.1*v + q", nearest="p_out = p - 0.1*v", differing="q")
    assert refusal.explanation() == [
        "p_out has an extra term.", "found:   p_out = p - 0.1*v + q", "nearest: p_out = p - 0.1*v", "differs: q",
    ]


@pytest.mark.parametrize("dtype, name", [(np.float16, "FLOAT16"), (ml_dtypes.bfloat16, "BFLOAT16")])
def test_low_precision_constants_show_the_decimal_the_graph_holds_and_the_exact_value(dtype, name):
    stored = float(np.float32(dtype(0.1)))  # what the fused op computes with
    assert stored != 0.1
    assert format_value(stored, name) == f"0.1 ({name} = {str(np.float32(stored))})"
    assert format_value(0.1, "FLOAT") == "0.1"
    assert format_value(0.75, name) == "0.75"  # exact in every dtype: nothing to explain


def test_float16_update_table_names_the_float16_constants():
    code, out, err = _run("inspect", TORCH / "sgd_fp16_wd_legacy.onnx")
    assert code == 0, err
    assert f"0.1 (FLOAT16 = {str(np.float32(np.float16(0.1)))})" in out
    assert "FLOAT16 values: the decimal written in the graph's FLOAT16 constant" in out


def test_no_low_precision_legend_when_no_value_needs_one(tmp_path):
    # PyTorch's BFLOAT16 step with lr 0.125 and momentum 0.875: exact in BFLOAT16, so no cell reads
    # "x (BFLOAT16 = y)" and a legend explaining that form would explain nothing.
    model = onnx.load(Path(__file__).resolve().parent.parent / "testdata" / "torch_bf16" / "sgd_momentum_dynamo.onnx")
    exact = {"scalar_tensor_default": 0.875, "val_2": -0.125}  # momentum, -lr
    for tensor in model.graph.initializer:
        if tensor.name in exact:
            tensor.CopyFrom(onnx.numpy_helper.from_array(np.array(exact[tensor.name], dtype=ml_dtypes.bfloat16), tensor.name))
    path = tmp_path / "exact.onnx"
    onnx.save(model, path)
    code, out, err = _run("inspect", path)
    assert code == 0, err
    assert "0.125" in out and "0.875" in out, out
    assert "BFLOAT16 =" not in out
    assert "values: the decimal written" not in out


def test_optimize_with_nothing_fused_ends_with_a_summary_line(tmp_path):
    code, out, _ = _run("optimize", TORCH / "sgd_nomomentum_legacy.onnx", "-o", tmp_path / "out.onnx")
    last = out.strip().splitlines()[-1]
    assert code == 0
    nodes = len(onnx.load(TORCH / "sgd_nomomentum_legacy.onnx").graph.node)
    assert last.startswith(f"Wrote {tmp_path / 'out.onnx'} ({nodes} nodes, the input's graph unchanged): ")
    assert last.endswith("fused 0 update(s), refused 2 (2 no-momentum-buffer): nothing fused (`sgdfuse inspect` explains each refusal)")


def test_optimize_and_inspect_end_with_fused_and_refused_counts(tmp_path):
    _, out, _ = _run("optimize", TORCH / "sgd_dampening_legacy.onnx", "-o", tmp_path / "out.onnx")
    nodes = len(onnx.load(TORCH / "sgd_dampening_legacy.onnx").graph.node)
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"Wrote {re.escape(str(tmp_path / 'out.onnx'))} \({nodes} → \d+ nodes\): fused 2 update\(s\), refused 0", last), last
    _, out, _ = _run("inspect", TORCH / "sgd_dampening_legacy.onnx")
    assert out.strip().splitlines()[-1] == "Would fuse 2 update(s), refused 0; nothing written (a dry run)"


@pytest.mark.parametrize(
    "argv",
    [
        ("check", TORCH / "sgd_momentum_legacy.onnx", TORCH / "sgd_momentum_legacy.onnx", "--seed", "-1"),
        ("optimize", TORCH / "sgd_momentum_legacy.onnx", "--steps", "100000000000000000000"),
        ("check", TORCH / "sgd_momentum_legacy.onnx", TORCH / "sgd_momentum_legacy.onnx", "--steps", "0"),
    ],
    ids=["negative-seed", "huge-steps", "zero-steps"],
)
def test_an_option_value_out_of_range_is_a_usage_error(argv, tmp_path):
    code, out, err = _run(*argv, "-o", tmp_path / "out.onnx") if argv[0] == "optimize" else _run(*argv)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: Invalid value for"), err
    assert not (tmp_path / "out.onnx").exists()


def test_a_lowering_error_about_the_model_names_the_file(tmp_path):
    # `lower` of a model with an op that has no GE rule said "error: model: ..." (a fresh trial's finding): the
    # one line names the file the user gave.
    model = onnx.load(Path(__file__).resolve().parent.parent / "testdata" / "torch" / "mlp_train_step_dynamo.onnx")
    relu = next(node for node in model.graph.node if node.op_type == "Relu")
    relu.op_type = "Relv"  # an op type no lowering rule knows
    path = tmp_path / "relv.onnx"
    onnx.save(model, path)
    fused = tmp_path / "relv.fused.onnx"
    assert _run("optimize", path, "-o", fused, "--no-verify")[0] == 0
    code, _, err = _run("lower", fused, "--soc", "Ascend910B2", "-o", tmp_path / "out.air")
    assert code == 1
    assert err.startswith(f"error: {fused}: 1 node(s) of 1 op type(s) have no ONNX→GE lowering rule [Relv]"), err
    assert not (tmp_path / "out.air").exists()


def _help_paragraphs(function) -> list[str]:
    """The paragraphs of a command function's docstring, each with its lines joined by one space."""
    text = inspect.cleandoc(function.__doc__ or "")
    return [" ".join(line.strip() for line in paragraph.splitlines()) for paragraph in text.split("\n\n")]


@pytest.mark.parametrize("command", [c.name for c in cli.app.registered_commands])
def test_help_shows_each_paragraph_of_a_command_unbroken(command):
    # typer's rich help keeps the single line breaks of a docstring past its first paragraph: on a wide terminal
    # "what was refused and" ended one line and "why, ..." began the next (lower --help).
    function = next(c.callback for c in cli.app.registered_commands if c.name == command)
    result = CliRunner().invoke(cli.app, [command, "--help"], env={"COLUMNS": "2000"}, terminal_width=2000)
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.split()) for line in result.output.splitlines()]
    for paragraph in _help_paragraphs(function):
        assert " ".join(paragraph.split()) in lines, (command, paragraph)


def test_a_gradient_scaled_by_the_graph_is_explained_under_the_table():
    # Keras writes m = 0.9*m - lr*g: the fused op reads the graph's lr*g (Mul_1:0) as its gradient, with dampening
    # 0; the table alone showed "dampening 0" beside a gradient that is not the model's gradient.
    code, out, _ = _run("inspect", Path(__file__).resolve().parent.parent / "testdata" / "keras" / "keras_opt_momentum_lr0.1.onnx")
    text = " ".join(out.split())
    assert code == 0
    assert "gradient Mul_1:0 (w and 1 more): a value the graph computes from its gradient before the buffer (Identity_2:0 = 0.9*m_w - 0.1*g_w)" in text, out


def test_a_gradient_the_buffer_reads_as_it_is_gets_no_such_note():
    code, out, _ = _run("inspect", TORCH / "sgd_dampening_dynamo.onnx")
    assert code == 0 and "a value the graph computes from its gradient" not in out, out


def test_inspect_of_a_fused_model_lists_its_sgd_nodes_with_the_exported_hyper_parameters(tmp_path):
    # Expected values: the torch optimiser settings the model was exported with (testdata/torch/manifest.json).
    import json

    manifest = json.loads((TORCH / "manifest.json").read_text())
    entry = next(m for m in manifest["models"] if m["file"] == "mlp_train_step_dynamo.onnx")
    fused = tmp_path / "fused.onnx"
    code, _, err = _run("optimize", TORCH / "mlp_train_step_dynamo.onnx", "-o", fused, "--no-verify")
    assert code == 0, err
    code, out, _ = _run("inspect", fused, "--report", tmp_path / "r.json")
    assert code == 0 and "SGD nodes already in the model (4)" in out, out
    existing = {e["parameters"]: e for e in json.loads((tmp_path / "r.json").read_text())["model"]["existing_sgd"]}
    assert sorted(existing) == sorted(u["parameter"] for u in entry["updates"])
    for update in entry["updates"]:
        got = existing[update["parameter"]]
        assert got["accum"] == update["momentum_buffer"]
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            value = got["learning_rate" if key == "lr" else key]
            assert value == pytest.approx(update[key], rel=1e-7), (update["parameter"], key, value)
        assert got["nesterov"] == update["nesterov"]
