"""Outputs are written whole or not at all, together, through symlinks, and never over a device."""

from __future__ import annotations

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
