"""The ``sgdfuse optimize``, ``inspect`` and ``check`` commands, run as a user runs them.

The installed console script runs in a subprocess in a temporary directory holding a copy of a real
export. Pinned: where output goes, the printed table, the JSON report's documented keys, ``--no-verify``,
that ``inspect`` writes nothing, that ``check`` accepts a real pair and rejects a tampered one, and that bad
input or output paths fail with one ``error:`` line naming the path, write nothing (no partial output, no
temporary files) and leave the input file as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import helper

import sgdfuse.api as api

TESTDATA = Path(__file__).resolve().parent.parent / "testdata" / "torch"
MODEL = "sgd_dampening_legacy.onnx"  # w [4,3], b [3]: lr 0.1, momentum 0.9, dampening 0.25
NO_MOMENTUM = "sgd_nomomentum_legacy.onnx"


def _console_script() -> str:
    beside_python = Path(sys.executable).with_name("sgdfuse")
    found = str(beside_python) if beside_python.exists() else shutil.which("sgdfuse")
    assert found, "the sgdfuse console script is not installed (pip install -e .)"
    return found


def _run(*args: str | Path, cwd: Path, columns: int = 250, **env: str) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ, COLUMNS=str(columns), NO_COLOR="1", **env)
    return subprocess.run(
        [_console_script(), *map(str, args)], capture_output=True, text=True, env=environment, cwd=cwd, timeout=120
    )


def _listing(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones included) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    shutil.copy(TESTDATA / MODEL, tmp_path / MODEL)
    return tmp_path


def _sgd_nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(path).graph.node if n.domain == "ai.sgdfuse" and n.op_type == "SGD"]


# -- optimize -------------------------------------------------------------------------------------------


def test_optimize_writes_model_sgdfused_onnx_beside_the_input_and_prints_the_table(workdir):
    result = _run("optimize", MODEL, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert sorted(_listing(workdir)) == sorted([MODEL, "sgd_dampening_legacy.sgdfused.onnx"])
    written = workdir / "sgd_dampening_legacy.sgdfused.onnx"
    onnx.checker.check_model(onnx.load(written), full_check=True)
    assert sorted(n.output[0] for n in _sgd_nodes(written)) == ["b_out", "w_out"]
    out = result.stdout
    assert "Fused updates (2)" in out
    for cell in ("w", "grad_w", "buf_w", "b", "grad_b", "buf_b", "0.1", "0.9", "0.25"):
        assert f" {cell} " in out, cell
    assert "Verification: 2 update(s)" in out
    assert "sgd_dampening_legacy.sgdfused.onnx" in out


def test_optimize_output_option_writes_only_there(workdir):
    (workdir / "out").mkdir()
    result = _run("optimize", MODEL, "-o", "out/fused.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert sorted(_listing(workdir)) == sorted([MODEL, "out/fused.onnx"])
    assert len(_sgd_nodes(workdir / "out" / "fused.onnx")) == 2


def test_optimize_report_json_has_the_documented_keys(workdir):
    result = _run("optimize", MODEL, "-o", "fused.onnx", "--report", "report.json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert sorted(_listing(workdir)) == sorted([MODEL, "fused.onnx", "report.json"])
    report = json.loads((workdir / "report.json").read_text())
    assert {"fused", "refused", "verification"} <= set(report)
    assert len(report["fused"]) == 2
    for entry in report["fused"]:
        assert {"parameters", "gradient", "accum", "dampening", "weight_decay", "nesterov"} <= set(entry)
    by_parameters = {e["parameters"]: e for e in report["fused"]}
    assert by_parameters["w"]["gradient"] == "grad_w" and by_parameters["w"]["accum"] == "buf_w"
    assert by_parameters["w"]["dampening"] == pytest.approx(0.25)
    assert by_parameters["w"]["weight_decay"] == 0.0 and by_parameters["w"]["nesterov"] is False
    assert report["refused"] == []
    verification = report["verification"]
    assert verification["enabled"] is True and verification["steps"] == 3
    assert [u["passed"] for u in verification["updates"]] == [True, True]


def test_optimize_report_json_lists_refusals_with_the_documented_keys(tmp_path):
    shutil.copy(TESTDATA / NO_MOMENTUM, tmp_path / NO_MOMENTUM)
    result = _run("optimize", NO_MOMENTUM, "-o", "same.onnx", "--report", "report.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["fused"] == []
    assert sorted(r["candidate"] for r in report["refused"]) == ["b_out", "w_out"]
    for entry in report["refused"]:
        assert {"candidate", "reason", "detail"} <= set(entry)
        assert entry["reason"] == "no-momentum-buffer"
        assert entry["candidate"] in entry["detail"]
    assert "Refused candidates (2)" in result.stdout


def test_optimize_no_verify_writes_the_model_without_running_the_check(workdir):
    result = _run("optimize", MODEL, "-o", "fused.onnx", "--report", "report.json", "--no-verify", cwd=workdir)
    assert result.returncode == 0, result.stderr
    report = json.loads((workdir / "report.json").read_text())
    assert report["verification"]["enabled"] is False
    assert report["verification"]["updates"] == []
    assert len(report["fused"]) == 2
    assert len(_sgd_nodes(workdir / "fused.onnx")) == 2
    assert "Verification: off" in result.stdout


def test_optimize_output_is_byte_identical_across_processes(workdir):
    # Hash randomisation differs between the runs: nothing may depend on set or dict-of-str order.
    first = _run("optimize", MODEL, "-o", "one.onnx", cwd=workdir, PYTHONHASHSEED="1")
    second = _run("optimize", MODEL, "-o", "two.onnx", cwd=workdir, PYTHONHASHSEED="2")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert (workdir / "one.onnx").read_bytes() == (workdir / "two.onnx").read_bytes()


def test_written_files_get_the_permissions_of_any_new_file(workdir):
    # A written model and report are ordinary files: mode 0o666 less the umask, like onnx.save or `cp`
    # would give (the atomic temporary-file-and-rename must not leave the temporary file's 0o600).
    result = _run("optimize", MODEL, "-o", "fused.onnx", "--report", "report.json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    umask = os.umask(0)
    os.umask(umask)
    for name in ("fused.onnx", "report.json"):
        mode = stat.S_IMODE((workdir / name).stat().st_mode)
        assert mode == 0o666 & ~umask, f"{name}: {oct(mode)}"


# -- inspect --------------------------------------------------------------------------------------------


def test_inspect_prints_the_analysis_and_writes_nothing(workdir):
    before = _listing(workdir)
    result = _run("inspect", MODEL, cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "Fused updates (2)" in result.stdout
    assert _listing(workdir) == before


# -- check ----------------------------------------------------------------------------------------------


def _write_fused(workdir: Path) -> None:
    api.optimize(workdir / MODEL).save(workdir / "fused.onnx")


def test_check_accepts_an_original_and_its_fused_model(workdir):
    _write_fused(workdir)
    result = _run("check", MODEL, "fused.onnx", "--steps", "3", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All outputs agree." in result.stdout


def test_check_rejects_a_fused_model_with_a_tampered_dampening(workdir):
    _write_fused(workdir)
    model = onnx.load(workdir / "fused.onnx")
    tampered = 0
    for node in model.graph.node:
        if node.domain == "ai.sgdfuse":
            for attribute in node.attribute:
                if attribute.name == "dampening":
                    attribute.CopyFrom(helper.make_attribute("dampening", 0.5))
                    tampered += 1
    assert tampered == 2
    onnx.save(model, workdir / "tampered.onnx")
    result = _run("check", MODEL, "tampered.onnx", "--steps", "3", cwd=workdir)
    assert result.returncode != 0
    assert result.stderr.startswith("error:")


# -- bad input and output paths -------------------------------------------------------------------------


def _make_bad_input(kind: str, directory: Path) -> Path:
    original = (TESTDATA / MODEL).read_bytes()
    if kind == "missing":
        return directory / "missing.onnx"
    path = directory / f"{kind}.onnx"
    if kind == "text":
        path.write_text("this is a note, not a model\nsecond line\n")
    elif kind == "truncated-half":
        path.write_bytes(original[: len(original) // 2])
    elif kind == "truncated-before-opset-import":
        # An interrupted copy that lost only the trailing opset_import field still parses as a ModelProto:
        # the longest proper prefix that parses is what such a file looks like.
        cut = max(n for n in range(1, len(original)) if _parses_with_graph(original[:n]))
        assert not onnx.load_from_string(original[:cut]).opset_import
        path.write_bytes(original[:cut])
    elif kind == "empty":
        path.write_bytes(b"")
    else:  # pragma: no cover
        raise AssertionError(kind)
    return path


def _parses_with_graph(data: bytes) -> bool:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:
        return False
    return model.HasField("graph")


def _assert_one_error_line_naming(result: subprocess.CompletedProcess[str], path: Path | str) -> None:
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert str(path) in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("kind", ["missing", "text", "truncated-half", "truncated-before-opset-import", "empty"])
@pytest.mark.parametrize("command", ["optimize", "inspect"])
def test_bad_input_fails_with_one_error_line_and_writes_nothing(tmp_path, kind, command):
    path = _make_bad_input(kind, tmp_path)
    before = _listing(tmp_path)
    # A narrow terminal: the error must stay one line even where it is longer than the terminal is wide.
    result = _run(command, path, cwd=tmp_path, columns=60)
    _assert_one_error_line_naming(result, path)
    assert _listing(tmp_path) == before  # nothing written, no temporary files, input bytes unchanged


@pytest.mark.parametrize("kind", ["missing", "text", "truncated-half"])
def test_check_with_a_bad_fused_model_fails_with_one_error_line(workdir, kind):
    path = _make_bad_input(kind, workdir)
    before = _listing(workdir)
    result = _run("check", MODEL, path, cwd=workdir, columns=60)
    _assert_one_error_line_naming(result, path)
    assert _listing(workdir) == before


def _bad_destination(kind: str, directory: Path) -> list[str]:
    if kind == "output-in-missing-directory":
        return ["-o", str(directory / "no" / "such" / "dir" / "fused.onnx")]
    if kind == "output-under-a-file":
        (directory / "a_file").write_text("x")
        return ["-o", str(directory / "a_file" / "fused.onnx")]
    if kind == "output-is-a-directory":
        (directory / "a_dir").mkdir()
        return ["-o", str(directory / "a_dir")]
    if kind == "report-in-missing-directory":
        return ["-o", str(directory / "fused.onnx"), "--report", str(directory / "no" / "such" / "report.json")]
    if kind == "report-is-a-directory":
        (directory / "a_dir").mkdir()
        return ["-o", str(directory / "fused.onnx"), "--report", str(directory / "a_dir")]
    raise AssertionError(kind)  # pragma: no cover


@pytest.mark.parametrize(
    "kind",
    [
        "output-in-missing-directory",
        "output-under-a-file",
        "output-is-a-directory",
        "report-in-missing-directory",
        "report-is-a-directory",
    ],
)
def test_unwritable_destination_fails_with_one_error_line_and_writes_nothing(workdir, kind):
    arguments = _bad_destination(kind, workdir)
    offending = arguments[-1]
    before = _listing(workdir)
    directories_before = sorted(p for p in workdir.rglob("*") if p.is_dir())
    result = _run("optimize", MODEL, *arguments, cwd=workdir, columns=60)
    _assert_one_error_line_naming(result, offending)
    # No fused model without its report, no temporary files, the input untouched.
    assert _listing(workdir) == before
    assert sorted(p for p in workdir.rglob("*") if p.is_dir()) == directories_before
