"""The cache of libraries built on first use (sgdfuse.native.build_cached), against what a fresh-clone trial met:
a warm cache mounted read-only made every command an internal error (the lock file was opened for writing
before the library was looked for); a "compiler" exiting 0 without writing a library left an empty .so
cached, whose load was an internal ImportError; a truncated cached .so killed the process with SIGBUS."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import onnx
import pytest

import sgdfuse
from sgdfuse import native
from sgdfuse.errors import NativeBuildError

TORCH = Path(__file__).resolve().parent.parent / "testdata" / "torch"
LIBRARY = b"\x7fELF" + bytes(range(256)) * 8
"""What the stand-in compiler writes: ELF's magic, then bytes (never loaded here)."""


def _writer(data: bytes):
    """A build command writing ``data`` to the output path (a stand-in compiler that exits 0)."""
    return lambda output: [sys.executable, "-c", f"open({str(output)!r}, 'wb').write({data!r})"]


def _build(directory: Path, command, **kwargs):
    return native.build_cached(directory, "lib.so", command, what="a test library", compiler="stand-in", compiler_version="1", **kwargs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in library is an ELF file")
def test_an_intact_build_is_reused_without_writing(tmp_path, monkeypatch):
    path, cached, _ = _build(tmp_path, _writer(LIBRARY))
    assert not cached and path.read_bytes() == LIBRARY
    record = json.loads((tmp_path / "build.json").read_text())
    assert record["size"] == len(LIBRARY) and record["library"] == "lib.so"
    real_open = builtins.open

    def read_only(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(30, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    path, cached, seconds = _build(tmp_path, _writer(b"never run"))
    assert cached and seconds == 0.0 and path.read_bytes() == LIBRARY


def test_a_read_only_cache_without_a_build_is_a_build_error_not_an_internal_one(tmp_path, monkeypatch):
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, mode="r", *a, **k: (_ for _ in ()).throw(OSError(30, "Read-only file system"))
                        if "w" in mode else real_open(file, mode, *a, **k))
    with pytest.raises(NativeBuildError, match="cannot write the cache directory") as caught:
        _build(tmp_path, _writer(LIBRARY))
    assert caught.value.reason == "compile-failed"


@pytest.mark.parametrize("written", [b"", b"not a library at all"], ids=["nothing", "junk"])
def test_a_compiler_exiting_0_without_a_library_caches_nothing(tmp_path, written):
    with pytest.raises(NativeBuildError, match="wrote no shared library"):
        _build(tmp_path, _writer(written))
    assert not (tmp_path / "lib.so").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stand-in library is an ELF file")
@pytest.mark.parametrize("damage", ["truncated", "replaced", "no record"])
def test_a_damaged_build_is_built_again_not_loaded(tmp_path, damage):
    _build(tmp_path, _writer(LIBRARY))
    library = tmp_path / "lib.so"
    if damage == "truncated":
        library.write_bytes(LIBRARY[:1000])
    elif damage == "replaced":
        library.write_bytes(LIBRARY[:-1] + b"\0")
    else:
        (tmp_path / "build.json").unlink()
    path, cached, _ = _build(tmp_path, _writer(LIBRARY))
    assert not cached and path.read_bytes() == LIBRARY


def test_a_compiler_writing_junk_leaves_optimize_on_the_python_path(tmp_path, monkeypatch):
    # CXX=/bin/true: every native build fails, each falls back; the model written is the Python path's.
    model = TORCH / "mlp_train_step_dynamo.onnx"
    monkeypatch.setenv("SGDFUSE_NATIVE_SCAN", "0")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "python"))
    expected = sgdfuse.optimize(str(model), verify=False).model.SerializeToString()
    monkeypatch.delenv("SGDFUSE_NATIVE_SCAN")
    monkeypatch.setenv("CXX", "/bin/true")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "true"))
    got = sgdfuse.optimize(str(model), verify=False).model.SerializeToString()
    assert got == expected
    assert not list((tmp_path / "true").rglob("*.so"))
    onnx.checker.check_model(onnx.load_from_string(got))
