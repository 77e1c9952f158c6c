"""Build a C++ shared library on first use with the system compiler, and cache it.

Shared by the MindSpore pass plugin (:mod:`sgdfuse.mindspore.plugin`) and the native onnxruntime kernel
(:mod:`sgdfuse.ortkernel`). Both ship their source as package data and compile it where they run, because
the headers they compile against (MindSpore's, onnxruntime's) come from a registry package installed beside
sgdfuse, not from this repository.

Cache layout: ``cache_root() / <what> / <key> / <library>``, where the caller's key covers everything the
binary depends on (source, flags, compiler version, the headers' version), so a change builds anew and an
unchanged setup reuses the library. The cache root is ``$SGDFUSE_CACHE_DIR``, else
``$XDG_CACHE_HOME/sgdfuse``, else ``~/.cache/sgdfuse``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sgdfuse.errors import NativeBuildError

__all__ = ["CACHE_ENV", "cache_root", "find_compiler", "build_cached"]

logger = logging.getLogger(__name__)

CACHE_ENV = "SGDFUSE_CACHE_DIR"
"""Environment variable naming the cache root."""

_COMPILE_TIMEOUT_S = 1800


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir`` when given, else ``$SGDFUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/sgdfuse``,
    else ``~/.cache/sgdfuse``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sgdfuse"


def find_compiler(what: str, error_type: type[NativeBuildError] = NativeBuildError) -> tuple[str, str]:
    """The C++ compiler to build ``what`` with: ``$CXX`` when set, else the first of g++, c++, clang++ found.

    Returns:
        ``(path, first line of its --version)``.

    Raises:
        error_type: ``reason="no-compiler"`` when none runs.
    """
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for candidate in candidates:
        found = shutil.which(candidate)
        if found is None:
            continue
        try:
            out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return found, (out.splitlines() or ["?"])[0].strip()
    raise error_type(
        "no-compiler",
        f"no C++ compiler found (tried {', '.join(candidates)}); {what} is built from source on first use: "
        "install g++ (e.g. `apt-get install g++`) or set CXX",
    )


def build_cached(
    directory: Path,
    library_name: str,
    command: Callable[[Path], list[str]],
    *,
    what: str,
    compiler: str,
    compiler_version: str,
    metadata: Mapping[str, object] | None = None,
    force: bool = False,
    error_type: type[NativeBuildError] = NativeBuildError,
) -> tuple[Path, bool, float]:
    """Build ``directory / library_name`` with ``command(output_path)``, or reuse it when it is there.

    Concurrent builders serialise on a lock file in ``directory``; the library is written to a temporary
    name and renamed, so a reader never sees a partial file, and a failed build leaves none. ``build.json``
    beside the library records the command, the compiler, the compile time, ``metadata`` and the library's
    size and SHA-256: a library is reused only when it matches them (a truncated file is built again, not
    loaded), and an intact build is reused without writing anything, so a read-only cache serves.

    Returns:
        ``(library path, cached, compile seconds)`` (``cached`` True and 0 s when an earlier build was reused).

    Raises:
        error_type: ``reason="compile-failed"`` when the directory cannot be made or written and holds no
            intact build, the compiler cannot run, it fails (the message ends with the last lines of its
            output; ``log`` holds all of it), or it exits 0 without writing a shared library.
    """
    library = directory / library_name
    if not force and _intact(directory, library):
        return library, True, 0.0  # a read-only cache serves as well: nothing is written to reuse a build
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / ".lock", "w")
    except OSError as error:
        raise error_type(
            "compile-failed", f"cannot write the cache directory {directory} for {what} ({error}), and it holds no intact build"
        ) from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _intact(directory, library):
            return library, True, 0.0
        descriptor, temporary = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
        os.close(descriptor)
        argv = command(Path(temporary))
        logger.info("building %s: %s", what, " ".join(argv))
        start = time.perf_counter()
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as error:
            os.unlink(temporary)
            raise error_type("compile-failed", f"{compiler} could not run: {error}") from error
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            os.unlink(temporary)
            log = result.stdout + result.stderr
            tail = "\n".join(log.strip().splitlines()[-15:])
            raise error_type(
                "compile-failed", f"building {what} with {compiler} ({compiler_version}) failed; last lines:\n{tail}", log
            )
        built = Path(temporary).read_bytes()
        if not _looks_like_library(built):
            os.unlink(temporary)
            raise error_type(
                "compile-failed",
                f"{compiler} ({compiler_version}) exited 0 building {what} but wrote no shared library "
                f"({len(built)} bytes, not {'ELF' if sys.platform.startswith('linux') else 'a library'})",
            )
        record = {**(metadata or {}), "compiler": compiler, "compiler_version": compiler_version, "command": argv, "seconds": round(seconds, 2),
                  "library": library_name, "size": len(built), "sha256": hashlib.sha256(built).hexdigest()}
        # The record first, then the library: a reader finds the library only with the record that vouches for it.
        _write_atomically(directory / "build.json", json.dumps(record, indent=2).encode())
        os.replace(temporary, library)
        return library, False, seconds


def _looks_like_library(data: bytes) -> bool:
    """Whether ``data`` starts as a shared library of this platform does (ELF on Linux, Mach-O on macOS)."""
    if sys.platform == "darwin":
        return data[:4] in (b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe", b"\xce\xfa\xed\xfe")
    return data[:4] == b"\x7fELF" if sys.platform.startswith("linux") else len(data) > 0


def _intact(directory: Path, library: Path) -> bool:
    """Whether ``library`` is the one ``build.json`` beside it records, by size and SHA-256: a truncated or
    replaced file (loading a truncated library can kill the process with SIGBUS) or one without a record
    (an older sgdfuse's build) is not reused."""
    try:
        record = json.loads((directory / "build.json").read_text())
        data = library.read_bytes()
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("library") != library.name:
        return False
    return record.get("size") == len(data) and record.get("sha256") == hashlib.sha256(data).hexdigest() and _looks_like_library(data)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file beside it and a rename."""
    descriptor, temporary = tempfile.mkstemp(prefix=".write-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
