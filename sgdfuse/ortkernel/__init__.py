"""A native onnxruntime kernel for ``ai.sgdfuse::SGD``: build it on first use, cache it, register it.

A fused model runs anywhere onnxruntime runs through its model-local functions (:mod:`sgdfuse.fused_op`),
but a function body is a chain of elementwise nodes, each one pass over memory. The kernel
(``sgd_kernel.cc``, shipped as package data) is one loop that reads ``parameters``, ``gradient``, ``accum``
and ``stat`` once and writes the three results once, computing the contract (docs/contract.md) with the same
FLOAT roundings in the same order as :func:`sgdfuse.reference.sgd`, so its results are the reference's bits.

Registered on a session's options (:func:`register`), the kernel runs every ``ai.sgdfuse::SGD`` node of
element type FLOAT, FLOAT16 or BFLOAT16 instead of the node's function body, whatever overload the node names
(onnxruntime inlines a model-local function only for a node that no registered kernel claims). It also runs
DOUBLE nodes as :mod:`sgdfuse.lift` 's lifted bodies compute them (the formula in DOUBLE), so lifted models load
with it registered (the registration gives the op a schema, which refuses element types without a kernel).

**Headers.** The kernel is compiled against onnxruntime's C API header (``onnxruntime_c_api.h``), which no
PyPI onnxruntime wheel and no Debian 12 package ships. It is taken from a registry package at build time:

1. ``$SGDFUSE_ORT_INCLUDE``, a directory holding ``onnxruntime_c_api.h`` (any onnxruntime release's
   ``include`` directory, e.g. from a distribution's development package), when set;
2. else the npm package :data:`HEADERS_PACKAGE` at :data:`HEADERS_VERSION` (MIT, Microsoft's onnxruntime
   headers inside a Unity plugin's iOS framework), fetched once with ``npm pack`` and its headers unpacked
   into the cache. The download is about 143 MB; only the headers (about 1 MB) are kept.

Any header of C API version 16 or later will do: the kernel uses only what API 16 (onnxruntime 1.16) has
and asks onnxruntime for exactly that version, so one build loads into onnxruntime 1.16 and every later one.

**Build.** With the system C++ compiler (``$CXX``, else g++), ``-O3 -ffp-contract=off -fno-trapping-math``
(vectorised; no fused multiply-add, no fast-math), cached per compiler, flags, source and header version under the cache root
(:func:`sgdfuse.native.cache_root`). About one second to compile.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import onnxruntime as ort

from sgdfuse.errors import NativeBuildError
from sgdfuse.native import build_cached, cache_root, find_compiler

__all__ = [
    "HEADERS_PACKAGE",
    "HEADERS_VERSION",
    "INCLUDE_ENV",
    "MIN_API_VERSION",
    "KernelBuild",
    "KernelBuildError",
    "headers",
    "build_kernel",
    "register",
    "session_options",
]

logger = logging.getLogger(__name__)

HEADERS_PACKAGE = "com.github.asus4.onnxruntime"
"""npm package whose tarball holds onnxruntime's C/C++ API headers (in its iOS framework)."""
HEADERS_VERSION = "0.4.9"
"""The pinned version of :data:`HEADERS_PACKAGE` (its headers are C API version 29)."""
_HEADERS_IN_TARBALL = "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers/"
INCLUDE_ENV = "SGDFUSE_ORT_INCLUDE"
"""Environment variable naming a directory with ``onnxruntime_c_api.h`` to build against instead."""
MIN_API_VERSION = 16
"""The C API version the kernel asks onnxruntime for (``CreateKernelV2``/``KernelComputeV2``)."""

_SOURCE = Path(__file__).with_name("sgd_kernel.cc")
# Value-safe flags only: -ffp-contract=off (no fused multiply-add), no -ffast-math (no reassociation, no
# assumptions about zeros, Inf or NaN). -O3 and -fno-trapping-math let GCC vectorise the loops, FLOAT16's
# branch-free conversions included (it will not evaluate both sides of a select of FLOAT operations when
# they might trap); neither changes a result, only whether a floating-point exception could be trapped,
# and onnxruntime runs with them masked.
_FLAGS = ("-std=c++17", "-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fPIC", "-shared", "-fvisibility=hidden")
_HEADER = "onnxruntime_c_api.h"
_LIBRARY = "libsgdfuse_ort_sgd.so"
_NPM_TIMEOUT_S = 1200


class KernelBuildError(NativeBuildError):
    """The native kernel could not be built: no compiler (``reason="no-compiler"``), no headers
    (``"no-headers"``: no ``$SGDFUSE_ORT_INCLUDE``, no npm, or the package could not be fetched), or the
    compile failed (``"compile-failed"``)."""


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """A built kernel library.

    Attributes:
        path: the shared library to pass to ``SessionOptions.register_custom_ops_library``.
        include: the header directory it was compiled against; api_version: that header's ``ORT_API_VERSION``.
        compiler, compiler_version: the compiler and the first line of its ``--version``.
        cached: True when an earlier build was reused; seconds: compile time (0 when cached).
    """

    path: Path
    include: Path
    api_version: int
    compiler: str
    compiler_version: str
    cached: bool
    seconds: float


def _api_version(include: Path) -> int:
    """``ORT_API_VERSION`` as ``include/onnxruntime_c_api.h`` defines it (0 when it cannot be read)."""
    try:
        text = (include / _HEADER).read_text(errors="replace")
    except OSError:
        return 0
    found = re.search(r"^#define\s+ORT_API_VERSION\s+(\d+)", text, re.MULTILINE)
    return int(found.group(1)) if found else 0


def _fetch_npm_headers(target: Path) -> None:
    """Unpack the headers of :data:`HEADERS_PACKAGE` into ``target`` (made here; absent on failure)."""
    npm = shutil.which("npm")
    if npm is None:
        raise KernelBuildError(
            "no-headers",
            f"the native SGD kernel needs onnxruntime's {_HEADER}: set {INCLUDE_ENV} to a directory holding it, "
            f"or install npm so that sgdfuse can fetch it from the npm package {HEADERS_PACKAGE}@{HEADERS_VERSION}",
        )
    spec = f"{HEADERS_PACKAGE}@{HEADERS_VERSION}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".npm-", dir=target.parent) as work:
        logger.info("fetching onnxruntime's headers: npm pack %s", spec)
        try:
            # npm checks the tarball against the registry's integrity hash.
            result = subprocess.run([npm, "pack", spec, "--silent"], cwd=work, capture_output=True, text=True, timeout=_NPM_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelBuildError("no-headers", f"`npm pack {spec}` could not run: {error}") from error
        tarballs = list(Path(work).glob("*.tgz"))
        if result.returncode != 0 or len(tarballs) != 1:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-10:])
            raise KernelBuildError(
                "no-headers", f"`npm pack {spec}` did not fetch the headers (exit {result.returncode}); last lines:\n{tail}"
            )
        unpacked = Path(work) / "include"
        unpacked.mkdir()
        with tarfile.open(tarballs[0]) as archive:
            for member in archive.getmembers():
                name = member.name[len(_HEADERS_IN_TARBALL):]
                # Only the flat list of regular header files, nothing that could name a path elsewhere.
                if member.isfile() and member.name.startswith(_HEADERS_IN_TARBALL) and name.endswith(".h") and "/" not in name:
                    source = archive.extractfile(member)
                    assert source is not None  # a regular file
                    (unpacked / name).write_bytes(source.read())
        if not (unpacked / _HEADER).is_file():
            raise KernelBuildError("no-headers", f"{spec} no longer holds {_HEADERS_IN_TARBALL}{_HEADER}")
        os.replace(unpacked, target)


def headers(*, cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding ``onnxruntime_c_api.h`` to build against (see the module doc for the order).

    Raises:
        KernelBuildError: ``reason="no-headers"``: ``$SGDFUSE_ORT_INCLUDE`` lacks the header, the header's
            API version is below :data:`MIN_API_VERSION`, or the npm package could not be fetched.
    """
    if os.environ.get(INCLUDE_ENV):
        include = Path(os.environ[INCLUDE_ENV])
        if not (include / _HEADER).is_file():
            raise KernelBuildError("no-headers", f"{INCLUDE_ENV}={include}: no {_HEADER} there")
    else:
        include = cache_root(cache_dir) / "ort-headers" / f"{HEADERS_PACKAGE}-{HEADERS_VERSION}"
        if not (include / _HEADER).is_file():
            try:
                include.parent.mkdir(parents=True, exist_ok=True)
                lock = open(include.parent / ".lock", "w")
            except OSError as error:
                raise KernelBuildError(
                    "no-headers",
                    f"cannot use the cache directory {include.parent} ({error.strerror or error}); point "
                    "SGDFUSE_CACHE_DIR at a writable directory",
                ) from error
            with lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch at a time; the others find it done
                if not (include / _HEADER).is_file():
                    _fetch_npm_headers(include)
    version = _api_version(include)
    if version < MIN_API_VERSION:
        raise KernelBuildError(
            "no-headers", f"{include / _HEADER} is C API version {version or '?'}; the kernel needs {MIN_API_VERSION} or later"
        )
    return include


def build_kernel(*, cache_dir: str | os.PathLike | None = None, force: bool = False) -> KernelBuild:
    """Build the kernel library, or reuse the cached build.

    The cache key covers the header's API version and digest, the compiler and its version, the flags and
    the source, so any change builds anew; concurrent builders serialise (:func:`sgdfuse.native.build_cached`).

    Raises:
        KernelBuildError: no headers (``reason="no-headers"``), no compiler (``"no-compiler"``), or the
            compile failed (``"compile-failed"``, with the compiler's output in ``log``).
    """
    include = headers(cache_dir=cache_dir)
    api_version = _api_version(include)
    compiler, compiler_version = find_compiler("the native SGD kernel", KernelBuildError)
    source = _SOURCE
    header_digest = hashlib.sha256((include / _HEADER).read_bytes()).hexdigest()
    key = hashlib.sha256("\0".join([compiler_version, *_FLAGS, header_digest, source.read_text()]).encode()).hexdigest()[:16]
    library, cached, seconds = build_cached(
        cache_root(cache_dir) / "ort-kernel" / key,
        _LIBRARY,
        lambda output: [compiler, *_FLAGS, f"-I{include}", str(source), "-o", str(output)],
        what="the native SGD kernel",
        compiler=compiler,
        compiler_version=compiler_version,
        metadata={"include": str(include), "ort_api_version": api_version},
        force=force,
        error_type=KernelBuildError,
    )
    return KernelBuild(library, include, api_version, compiler, compiler_version, cached, seconds)


def register(options: ort.SessionOptions, *, cache_dir: str | os.PathLike | None = None) -> KernelBuild:
    """Register the kernel on ``options`` (building it first if needed); sessions made with ``options`` then
    run every ``ai.sgdfuse::SGD`` node with it instead of the node's function body.

    Registering again on the same ``options`` changes nothing (onnxruntime would refuse a session whose options
    name the domain twice: "Domain already set in registry"); the options remember the library in their
    session configuration entry :data:`REGISTERED_ENTRY`.

    Raises:
        KernelBuildError: see :func:`build_kernel`.
    """
    key = (str(cache_root(cache_dir)), os.environ.get(INCLUDE_ENV, ""))
    build = _REGISTERED.get(key)
    if build is None or not build.path.is_file():
        build = _REGISTERED[key] = build_kernel(cache_dir=cache_dir)
    if _registered_on(options):
        return build
    options.register_custom_ops_library(str(build.path))
    options.add_session_config_entry(REGISTERED_ENTRY, str(build.path))
    return build


def _registered_on(options: ort.SessionOptions) -> bool:
    try:
        return bool(options.get_session_config_entry(REGISTERED_ENTRY))
    except RuntimeError:  # onnxruntime raises for a key the options do not have
        return False


REGISTERED_ENTRY = "sgdfuse.ortkernel.library"
"""Session configuration key :func:`register` sets on the options it registered the kernel on (onnxruntime
ignores keys it does not know)."""


# The build each register() call reuses within this process (sessions are made by the thousand in a check).
_REGISTERED: dict[tuple[str, str], KernelBuild] = {}


def session_options(*, cache_dir: str | os.PathLike | None = None) -> ort.SessionOptions:
    """New ``SessionOptions`` with the kernel registered (see :func:`register`)."""
    options = ort.SessionOptions()
    register(options, cache_dir=cache_dir)
    return options
