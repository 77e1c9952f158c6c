"""The console past :data:`sgdfuse.cli.TABLE_ROWS` rows: ``optimize``, ``inspect`` and ``check`` print a grouped
summary (fused updates by hyper-parameters, refusals by reason, check outputs by comparison) with counts and one
example each; ``--verbose`` prints every row, and the JSON report always holds everything.

The model is built here: 25 plain momentum-SGD updates, every third one (i = 0, 3, ..., 24: 9 of them) with
learning rate 0.01 and the others (16) with 0.1, plus 25 momentum-free updates ``q - 0.1*g`` that are refused
(no momentum buffer).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import helper

from tests.graphs import make_model, scalar, value

FUSED, REFUSED = 25, 25


def _many_updates() -> onnx.ModelProto:
    nodes, inputs, outputs = [], [], []
    initializers = [scalar("m", 0.9), scalar("lr_a", 0.1), scalar("lr_b", 0.01)]
    for i in range(FUSED):
        lr = "lr_b" if i % 3 == 0 else "lr_a"
        nodes += [
            helper.make_node("Mul", [f"buf{i}", "m"], [f"scaled{i}"]),
            helper.make_node("Add", [f"scaled{i}", f"g{i}"], [f"buf{i}_out"]),
            helper.make_node("Mul", [f"buf{i}_out", lr], [f"step{i}"]),
            helper.make_node("Sub", [f"p{i}", f"step{i}"], [f"p{i}_out"]),
        ]
        inputs += [value(f"p{i}"), value(f"g{i}"), value(f"buf{i}")]
        outputs += [value(f"p{i}_out"), value(f"buf{i}_out")]
    for i in range(REFUSED):
        nodes += [helper.make_node("Mul", [f"qg{i}", "lr_a"], [f"qs{i}"]), helper.make_node("Sub", [f"q{i}", f"qs{i}"], [f"q{i}_out"])]
        inputs += [value(f"q{i}"), value(f"qg{i}")]
        outputs += [value(f"q{i}_out")]
    return make_model(nodes, inputs, outputs, initializers)


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("sgdfuse")
    command = [str(script)] if script.exists() else [shutil.which("sgdfuse") or "sgdfuse"]
    environment = dict(os.environ, COLUMNS="250", NO_COLOR="1")
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, env=environment, cwd=cwd, timeout=120)


def _rows(text: str) -> list[list[str]]:
    """The cells of each table row of rich's output."""
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in text.splitlines() if line.startswith("│")]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    onnx.save(_many_updates(), tmp_path / "many.onnx")
    return tmp_path


def test_optimize_past_twenty_rows_prints_groups_with_counts_and_the_report_keeps_every_row(workdir):
    result = _run("optimize", "many.onnx", "--no-verify", "--report", "report.json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    fused_groups = sorted((row[0], row[2]) for row in rows if len(row) == 9)
    assert fused_groups == [("16", "0.1"), ("9", "0.01")]
    refusal_groups = [row for row in rows if len(row) == 4 and row[0] == "no-momentum-buffer"]
    assert [row[1] for row in refusal_groups] == [str(REFUSED)]
    assert len(rows) < 12  # two fused groups, one refusal group (its explanation may wrap)
    report = json.loads((workdir / "report.json").read_text())
    assert sorted(f["parameters"] for f in report["fused"]) == sorted(f"p{i}" for i in range(FUSED))
    assert sorted(r["candidate"] for r in report["refused"]) == sorted(f"q{i}_out" for i in range(REFUSED))


def test_verbose_prints_one_row_per_fused_update_and_refusal(workdir):
    result = _run("inspect", "many.onnx", "--verbose", cwd=workdir)
    assert result.returncode == 0, result.stderr
    first_cells = {row[0] for row in _rows(result.stdout)}
    assert {f"p{i}" for i in range(FUSED)} <= first_cells
    assert {f"q{i}_out" for i in range(REFUSED)} <= first_cells


def test_check_past_twenty_rows_groups_outputs_and_verbose_lists_each(workdir):
    assert _run("optimize", "many.onnx", "--no-verify", "-o", "fused.onnx", cwd=workdir).returncode == 0
    grouped = _run("check", "many.onnx", "fused.onnx", "--steps", "2", cwd=workdir)
    assert grouped.returncode == 0, grouped.stderr
    rows = _rows(grouped.stdout)
    # 25 refused outputs unchanged, 50 fused outputs and 50 in-place writes: every one agrees.
    assert sum(int(row[2]) for row in rows) == REFUSED + 2 * FUSED + 2 * FUSED
    assert all(row[1] == "yes" for row in rows)
    verbose = _run("check", "many.onnx", "fused.onnx", "--steps", "2", "--verbose", cwd=workdir)
    assert verbose.returncode == 0, verbose.stderr
    assert {f"q{i}_out" for i in range(REFUSED)} | {f"p{i}_out" for i in range(FUSED)} <= {row[0] for row in _rows(verbose.stdout)}
