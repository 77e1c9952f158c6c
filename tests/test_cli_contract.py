"""The command line's foundation: ``--version``, ``contract``, and usage errors.

The console script is run as installed (a subprocess), the way a user runs it; ``typer``'s CliRunner
covers the same commands in-process. The terminal is made wide so rich does not truncate table cells.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import sgdfuse
from sgdfuse.cli import app


def _console_script() -> str:
    beside_python = Path(sys.executable).with_name("sgdfuse")
    found = str(beside_python) if beside_python.exists() else shutil.which("sgdfuse")
    assert found, "the sgdfuse console script is not installed (pip install .)"
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="250", NO_COLOR="1")
    return subprocess.run([_console_script(), *args], capture_output=True, text=True, env=env, timeout=120)


def test_version_prints_the_package_version():
    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"sgdfuse {sgdfuse.__version__}"


def test_version_in_process():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert sgdfuse.__version__ in result.output


def test_contract_prints_ports_attributes_formula_and_product_lines():
    result = _run("contract")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for port in ("parameters", "gradient", "learning_rate", "accum", "momentum", "stat"):
        assert port in out
    assert out.index("gradient") < out.index("learning_rate") < out.index("momentum")  # contract order
    assert "Declared output: parameters" in out
    for attribute_rule in ("dampening", "must be 0 when nesterov is true", "weight_decay", "must be >= 0", "nesterov"):
        assert attribute_rule in out
    assert "accum_t = accum * m + grad" in out
    assert "parameters_out = parameters - (grad + accum_t * m) * lr" in out
    for text in (
        "Ascend 950PR/950DT",
        "Ascend950PR_95##",
        "Atlas A2 series",
        "Ascend910B2",
        "Atlas training series",
        "Ascend910ProA",
        "Atlas 200I/500 A2 inference",
        "FRACTAL_Z_3D",
        "BFLOAT16",
    ):
        assert text in out, text


def test_contract_in_process_exits_zero():
    result = CliRunner().invoke(app, ["contract"])
    assert result.exit_code == 0, result.output
    assert "learning_rate" in result.output


@pytest.mark.parametrize(
    "args", [("bogus",), ("contract", "--no-such-option")], ids=["unknown-command", "unknown-option"]
)
def test_unknown_command_or_option_exits_non_zero_with_one_clear_error(args):
    result = _run(*args)
    assert result.returncode != 0
    assert result.stdout.strip() == "" or "Usage" in result.stdout
    assert "No such" in result.stderr


def test_unknown_command_in_process_exits_non_zero():
    result = CliRunner().invoke(app, ["bogus"])
    assert result.exit_code != 0
