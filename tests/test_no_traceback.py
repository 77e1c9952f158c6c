"""No command prints a Python traceback, whatever the input (issue 13, items 1 and 2).

Every command (``optimize``, ``inspect --verify``, ``check``, ``lower`` to a GE graph and to ATC's ONNX) runs
over every model in ``testdata/``, ONNX's own ``Momentum`` test models, graphs whose learning rate is
computed in the graph (a schedule ``Gather``, an ``Exp`` decay, a StepLR expression), first-step forms,
FLOAT16/BFLOAT16 updates, a sample of the generated equivalent forms and near misses, and broken files. Each
run must either succeed (exit 0, no ``error:`` line) or fail with exactly one line starting ``error:`` and
exit 1 — never a traceback, and never the CLI's "internal error" line, which is how an unexpected exception
reaches the user (it means a bug to fix, not an answer).

The CLI runs in-process (``sgdfuse.cli.main``) to keep this fast; a few cases run the installed console
script to pin the real entry point.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from sgdfuse.cli import main

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"
TESTDATA_MODELS = sorted([*TESTDATA.glob("*/*.onnx"), *TESTDATA.glob("*/*.mindir")])
SOC = "Ascend910B2"


# -- running the CLI ---------------------------------------------------------------------------------------


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``sgdfuse ARGV`` in-process: (exit code, stdout, stderr). An exception escaping ``main`` is re-raised
    by pytest with its traceback, which is what this file exists to rule out."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in argv])
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def _problem(argv: list[str], code: int, out: str, err: str) -> str | None:
    """What is wrong with one run, or None: a traceback, an internal error, a failure that is not exactly
    one ``error:`` line, or a success that printed an ``error:`` line."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    command = "sgdfuse " + " ".join(str(a) for a in argv)
    if "Traceback (most recent call last)" in out + err:
        return f"{command}: printed a traceback:\n{err[-2000:]}"
    if any("internal error" in line for line in errors):
        return f"{command}: {errors[0]}"
    if code == 0 and errors:
        return f"{command}: exit 0 but printed {errors[0]!r}"
    if code != 0 and (code != 1 or len(errors) != 1):
        return f"{command}: exit {code} with {len(errors)} error: line(s); stderr:\n{err[-2000:]}"
    return None


def _every_command(model: Path, workdir: Path) -> list[str]:
    """Runs every command on ``model`` (writing only into ``workdir``) and returns the problems found.
    ``check`` and the GE lowering take the fused model when ``optimize`` wrote one, else ``model`` itself."""
    fused = workdir / ("fused.mindir" if model.name.endswith(".mindir") else "fused.onnx")
    problems = []

    def run(*argv) -> None:
        problem = _problem(list(argv), *_run(list(argv)))
        if problem:
            problems.append(problem)

    run("optimize", model, "-o", fused, "--report", workdir / "report.json", "--quiet")
    after = fused if fused.exists() else model
    run("inspect", model, "--verify", "--report", workdir / "inspect.json")
    run("check", model, after)
    run("lower", after, "--soc", SOC, "-o", workdir / "step.air", "--json", workdir / "step.json")
    run("lower", model, "--soc", "ascend950pr_9599", "--format", "onnx-atc", "-o", workdir / "atc.onnx")
    return problems


def _assert_every_command_is_clean(model: Path) -> None:
    with tempfile.TemporaryDirectory() as directory:
        problems = _every_command(model, Path(directory))
    assert not problems, "\n\n".join(problems)


# -- models ------------------------------------------------------------------------------------------------


def _vi(name: str, dtype: int = TensorProto.FLOAT, shape=(2, 3)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


def _const(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _computed_lr_model(lr_nodes, lr_inputs, lr_initializers) -> onnx.ModelProto:
    """``buf' = 0.9*buf + g; p' = p - lr*buf'`` with ``lr`` computed in the graph by ``lr_nodes``."""
    nodes = [
        *lr_nodes,
        helper.make_node("Mul", ["buf", "m"], ["buf_scaled"]),
        helper.make_node("Add", ["buf_scaled", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step_size"]),
        helper.make_node("Sub", ["p", "step_size"], ["p_out"]),
    ]
    graph = helper.make_graph(
        nodes, "step", [_vi("p"), _vi("g"), _vi("buf"), *lr_inputs], [_vi("p_out"), _vi("buf_out")],
        [_const("m", 0.9), *lr_initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def lr_from_schedule() -> onnx.ModelProto:
    """``lr = Gather(schedule, step)``: a per-step learning-rate table indexed by the step counter."""
    return _computed_lr_model(
        [helper.make_node("Gather", ["schedule", "step"], ["lr"], axis=0)],
        [_vi("step", TensorProto.INT64, ())],
        [_const("schedule", [0.1, 0.05, 0.025, 0.01])],
    )


def lr_exponential_decay() -> onnx.ModelProto:
    """``lr = 0.1 * Exp(-0.05 * t)``."""
    return _computed_lr_model(
        [
            helper.make_node("Mul", ["t", "rate"], ["scaled_t"]),
            helper.make_node("Exp", ["scaled_t"], ["decay"]),
            helper.make_node("Mul", ["decay", "base"], ["lr"]),
        ],
        [_vi("t", TensorProto.FLOAT, ())],
        [_const("rate", -0.05), _const("base", 0.1)],
    )


def lr_step_lr() -> onnx.ModelProto:
    """PyTorch's StepLR written out: ``lr = 0.1 * 0.1 ** Floor(step / 30)``."""
    return _computed_lr_model(
        [
            helper.make_node("Cast", ["step"], ["step_float"], to=TensorProto.FLOAT),
            helper.make_node("Div", ["step_float", "step_size_epochs"], ["epochs"]),
            helper.make_node("Floor", ["epochs"], ["decays"]),
            helper.make_node("Pow", ["gamma", "decays"], ["factor"]),
            helper.make_node("Mul", ["base", "factor"], ["lr"]),
        ],
        [_vi("step", TensorProto.INT64, ())],
        [_const("step_size_epochs", 30.0), _const("gamma", 0.1), _const("base", 0.1)],
    )


def _low_precision(dtype: int) -> onnx.ModelProto:
    """The plain update with every tensor and constant in ``dtype`` (FLOAT16 or BFLOAT16)."""
    from forms import Builder

    b = Builder(dtype=dtype)
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_new")
    b.sub(p, b.mul(b.scalar(0.1), "buf_new"), out="p_new")
    return b.model(["p_new", "buf_new"])


def _dynamic_shape() -> onnx.ModelProto:
    """The plain update on ``[n, 3]`` tensors: lowering to a line without dynamic shape refuses it."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["buf", "m"], ["buf_scaled"]),
            helper.make_node("Add", ["buf_scaled", "g"], ["buf_out"]),
            helper.make_node("Mul", ["buf_out", "lr"], ["step_size"]),
            helper.make_node("Sub", ["p", "step_size"], ["p_out"]),
        ],
        "step",
        [_vi(n, shape=("n", 3)) for n in ("p", "g", "buf")],
        [_vi(n, shape=("n", 3)) for n in ("p_out", "buf_out")],
        [_const("m", 0.9), _const("lr", 0.1)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _onnx_momentum_cases() -> dict[str, onnx.ModelProto]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unrelated case modules warn while they are collected
        from onnx.backend.test.case.node import collect_testcases

        return {case.name: case.model for case in collect_testcases("Momentum")}


def _first_step_forms() -> dict[str, onnx.ModelProto]:
    from test_formulations import _first_step_model, _if_first_step_model

    return {
        "first_step_where": _first_step_model("grad"),
        "first_step_where_keeps_buffer": _first_step_model("momentum_plus_grad"),
        "first_step_if": _if_first_step_model("grad"),
    }


BUILT = {
    "lr_gather_schedule": lr_from_schedule,
    "lr_exp_decay": lr_exponential_decay,
    "lr_step_lr": lr_step_lr,
    "float16_plain": lambda: _low_precision(TensorProto.FLOAT16),
    "bfloat16_plain": lambda: _low_precision(TensorProto.BFLOAT16),
    "dynamic_shape": _dynamic_shape,
    **{name: (lambda name=name: _onnx_momentum_cases()[name]) for name in ("test_momentum", "test_momentum_multiple", "test_nesterov_momentum")},
    **{name: (lambda name=name: _first_step_forms()[name]) for name in ("first_step_where", "first_step_where_keeps_buffer", "first_step_if")},
}


# -- tests -------------------------------------------------------------------------------------------------


def test_testdata_is_found():
    assert len(TESTDATA_MODELS) >= 40, TESTDATA_MODELS


@pytest.mark.parametrize("model", TESTDATA_MODELS, ids=lambda p: p.name)
def test_every_command_on_every_testdata_model_succeeds_or_prints_one_error_line(model):
    _assert_every_command_is_clean(model)


@pytest.mark.parametrize("name", sorted(BUILT))
def test_every_command_on_built_forms_succeeds_or_prints_one_error_line(name, tmp_path):
    path = tmp_path / f"{name}.onnx"
    onnx.save(BUILT[name](), path)
    _assert_every_command_is_clean(path)


@settings(max_examples=16, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_command_on_generated_forms_and_near_misses_succeeds_or_prints_one_error_line(data):
    import dataclasses

    from test_generated_forms import PERTURBATIONS, _build, draws

    draw = data.draw(draws())
    perturbation = data.draw(st.sampled_from((None, None, *PERTURBATIONS)))
    if perturbation == "nesterov_momentum":
        draw = dataclasses.replace(draw, nesterov=True, dampening=0.0)
    if perturbation in ("per_element_lr", "extra_gradient"):
        draw = dataclasses.replace(draw, nesterov=False)
    model = _build(draw, data, perturbation)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "form.onnx"
        onnx.save(model, path)
        _assert_every_command_is_clean(path)


def _broken_inputs(directory: Path) -> dict[str, Path]:
    real = TESTDATA / "torch" / "sgd_momentum_legacy.onnx"
    data = real.read_bytes()
    files = {
        "empty.onnx": b"",
        "truncated.onnx": data[: len(data) // 2],
        "text.onnx": b"this is not a model\n",
        "no_graph.onnx": onnx.ModelProto(ir_version=8).SerializeToString(),
        "empty.mindir": b"",
        "text.mindir": b"not a MindIR file\n",
    }
    paths = {}
    for name, content in files.items():
        paths[name] = directory / name
        paths[name].write_bytes(content)
    paths["directory.onnx"] = directory / "directory.onnx"
    paths["directory.onnx"].mkdir()
    paths["missing.onnx"] = directory / "missing.onnx"
    return paths


@pytest.mark.parametrize(
    "name", ["empty.onnx", "truncated.onnx", "text.onnx", "no_graph.onnx", "empty.mindir", "text.mindir", "directory.onnx", "missing.onnx"]
)
def test_every_command_on_a_broken_file_prints_one_error_line(name, tmp_path):
    path = _broken_inputs(tmp_path)[name]
    problems = _every_command(path, tmp_path)
    assert not problems, "\n\n".join(problems)
    code, _, err = _run(["optimize", path, "-o", tmp_path / "out.onnx"])
    assert code == 1 and err.startswith("error: ") and str(path) in err


def test_an_empty_file_is_called_empty(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    for argv in (["inspect", path], ["optimize", path], ["check", path, path], ["lower", path, "--soc", SOC]):
        code, _, err = _run(argv)
        assert code == 1 and err.startswith(f"error: {path}: the file is empty"), (argv, err)


def test_check_with_a_learning_rate_computed_in_the_graph_runs(tmp_path):
    # Issue 13 item 2: `check` fell over with KeyError when lr is Gather(schedule, step), Exp(t) or StepLR.
    for name in ("lr_gather_schedule", "lr_exp_decay", "lr_step_lr"):
        original, fused = tmp_path / f"{name}.onnx", tmp_path / f"{name}.fused.onnx"
        onnx.save(BUILT[name](), original)
        assert _run(["optimize", original, "-o", fused, "--quiet"])[0] == 0
        code, out, err = _run(["check", original, fused])
        assert code == 0 and "All outputs agree." in out, (name, err)


# -- the installed console script ---------------------------------------------------------------------------


def _console_script() -> str:
    beside_python = Path(sys.executable).with_name("sgdfuse")
    found = str(beside_python) if beside_python.exists() else shutil.which("sgdfuse")
    assert found, "the sgdfuse console script is not installed (pip install -e .)"
    return found


@pytest.mark.parametrize("case", ["momentum-optimize", "empty-inspect", "unknown-soc"])
def test_console_script_prints_no_traceback(case, tmp_path):
    model = tmp_path / "m.onnx"
    if case == "momentum-optimize":
        onnx.save(_onnx_momentum_cases()["test_momentum_multiple"], model)
        argv = ["optimize", model, "-o", tmp_path / "out.onnx"]
    elif case == "empty-inspect":
        model.write_bytes(b"")
        argv = ["inspect", model]
    else:
        shutil.copy(TESTDATA / "torch" / "sgd_momentum_legacy.onnx", model)
        argv = ["lower", model, "--soc", "Ascend910X"]
    result = subprocess.run(
        [_console_script(), *map(str, argv)], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, COLUMNS="200", NO_COLOR="1"),
    )
    assert _problem(argv, result.returncode, result.stdout, result.stderr) is None
    assert (result.returncode == 0) == (case == "momentum-optimize"), result.stderr
