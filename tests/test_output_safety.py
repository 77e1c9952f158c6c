"""Outputs are written whole or not at all, together, through symlinks, and never over a device."""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys

import pytest

MODEL = "testdata/torch/sgd_wd_dynamo.onnx"


def _sgdfuse(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "sgdfuse.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_a_device_destination_is_refused_not_replaced(tmp_path):
    # A rename onto /dev/null (as root) would replace the device with a plain file; a fifo stands in here.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for args in (["optimize", os.path.abspath(MODEL), "-o", fifo], ["optimize", os.path.abspath(MODEL), "--report", fifo]):
        result = _sgdfuse(*args, cwd=tmp_path)
        assert result.returncode == 1
        assert result.stderr.startswith(f"error: {fifo}: exists and is not a regular file")
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_symlink_destination_is_written_through(tmp_path):
    target = tmp_path / "target.onnx"
    link = tmp_path / "link.onnx"
    link.symlink_to(target)
    result = _sgdfuse("optimize", os.path.abspath(MODEL), "-o", link)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and target.stat().st_size > 0


def test_when_the_report_cannot_be_written_the_model_is_not_written_either(tmp_path):
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("a file where a directory should be")
    result = _sgdfuse("optimize", os.path.abspath(MODEL), "-o", tmp_path / "fused.onnx", "--report", blocked / "r.json")
    assert result.returncode == 1 and result.stderr.startswith("error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_dir"]


def test_a_failure_while_staging_removes_what_was_staged(tmp_path):
    from sgdfuse.errors import OutputWriteError
    from sgdfuse.output import OutputBatch

    with pytest.raises(OutputWriteError):
        with OutputBatch() as batch:
            batch.stage(tmp_path / "a.bin", b"first")
            batch.stage(tmp_path / "missing" / "b.bin", b"second")
            batch.commit()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("through_symlink", [False, True])
def test_inspect_never_writes_its_report_over_the_model(tmp_path, through_symlink):
    model = tmp_path / "m.onnx"
    model.write_bytes(open(MODEL, "rb").read())
    before = model.read_bytes()
    report = model
    if through_symlink:
        report = tmp_path / "report.json"
        report.symlink_to(model)
    result = _sgdfuse("inspect", model, "--report", report)
    assert result.returncode == 1
    assert "is an input of this command" in result.stderr
    assert model.read_bytes() == before


def test_one_path_for_two_outputs_is_refused_before_any_work(tmp_path):
    out = tmp_path / "y.air"
    result = _sgdfuse("lower", os.path.abspath(MODEL), "--soc", "Ascend910B2", "-o", out, "--json", out)
    assert result.returncode == 1
    assert "is named twice" in result.stderr
    assert "Verified" not in result.stdout
    assert not out.exists()


def test_a_destination_under_a_file_says_the_file_is_not_a_directory(tmp_path):
    # "directory a.txt/sub does not exist" sends the user to create a directory that cannot be made.
    blocker = tmp_path / "a.txt"
    blocker.write_text("x")
    for destination in (blocker / "out.onnx", blocker / "sub" / "out.onnx"):
        result = _sgdfuse("optimize", os.path.abspath(MODEL), "-o", destination, cwd=tmp_path)
        assert result.returncode == 1
        assert f"{blocker} is a file, not a directory" in result.stderr, result.stderr
    assert blocker.read_text() == "x"


def test_a_destination_in_a_missing_directory_says_so(tmp_path):
    result = _sgdfuse("optimize", os.path.abspath(MODEL), "-o", tmp_path / "no" / "out.onnx", cwd=tmp_path)
    assert result.returncode == 1
    assert f"directory {tmp_path / 'no'} does not exist" in result.stderr, result.stderr



def test_lower_refuses_a_directory_it_cannot_write_before_the_work(tmp_path, monkeypatch):
    # Lowering takes seconds to minutes; a destination it cannot write must fail first, not at the end. The
    # tests run as root, which may write any directory, so the permission answer is what is replaced here.
    from typer.testing import CliRunner

    from sgdfuse.cli import app

    lower_module = importlib.import_module("sgdfuse.lowering.lower")  # the package's `lower` attribute is the function

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(locked) else real_access(path, mode, **kw))
    monkeypatch.setattr(lower_module, "prepare", lambda *a, **k: pytest.fail("lower did the work before finding it cannot write"))
    result = CliRunner().invoke(app, ["lower", os.path.abspath(MODEL), "--soc", "Ascend910B2", "-o", str(locked / "m.air")], env={"COLUMNS": "250"})
    said = result.output + str(result.exception)  # the app raises; the console script's main prints it as "error: ..."
    assert result.exit_code == 1, said
    assert f"directory {locked} is not writable" in said, said
    assert list(locked.iterdir()) == []
