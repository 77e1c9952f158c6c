"""Build, cache and register the MindSpore custom pass plugin (``sgdfuse_pass.cc``, shipped as package data).

The plugin is a C++ shared library compiled against the headers that the installed MindSpore wheel ships
under ``mindspore/include``. It is built on first use with the system C++ compiler and cached per MindSpore
version, compiler and source (``$SGDFUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/sgdfuse``, else
``~/.cache/sgdfuse``), then registered with ``mindspore.graph.register_custom_pass`` as a FULL_GRAPH pass.

Why FULL_GRAPH and not PATTERN: a PATTERN pass runs in the backend on kernel graphs, where the two branches
of mint's ``step_t == 0`` Switch already live in separate kernel graphs; no pattern can see both branches,
the condition and the parameter update at once. A FULL_GRAPH pass runs in the frontend (after
``cse_after_recomputation``, before ``auto_monad_reorder``) on the whole FuncGraph, branches included.

What the pass does (details and measurements in ``sgdfuse_pass.cc``):

1. rewrites each update -- in the top graph, or in the update graphs MindSpore shares between parameters of
   one shape once a model has many parameters -- into ``SGD(w, g, lr, buf, m, stat, U)`` with
   ``stat = BroadcastTo(Cast(step_t == 0))``, the buffer zeroed first where ``step_t == 0``, and mint's weight
   decay folded into the op's attribute when nothing else writes the weight in the step;
2. inlines the shared graphs at their call sites (they are straight-line code now);
3. on CPU, moves each run of consecutive fused updates into one ``no_inline`` subgraph called once:
   MindSpore's CPU runtime runs backward kernels several times slower in a kernel graph that also writes
   its weights in place, which would otherwise cost more than the fusion saves.

The pass reports every candidate it fused or refused as JSON lines in ``$SGDFUSE_MINDSPORE_REPORT``;
:meth:`Registration.report` turns them into the same :class:`~sgdfuse.report.Report` the ONNX side uses.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

from sgdfuse.mindspore.errors import MindSporeMissingError, PluginBuildError, PluginRegisterError
from sgdfuse.native import build_cached, cache_root, find_compiler
from sgdfuse.report import FusedUpdate, Refusal, Report

__all__ = [
    "PASS_NAME",
    "PluginBuild",
    "Registration",
    "build_plugin",
    "register",
    "paused",
    "report_from_records",
]

logger = logging.getLogger(__name__)

PASS_NAME = "sgdfuse_mint_sgd"
REPORT_ENV = "SGDFUSE_MINDSPORE_REPORT"
DISABLE_ENV = "SGDFUSE_MINDSPORE_DISABLE"
DEVICES_ENV = "SGDFUSE_MINDSPORE_DEVICES"
_SOURCE = Path(__file__).with_name("sgdfuse_pass.cc")
_DEVICES = ("cpu", "ascend", "all")

# Relative to the installed ``mindspore`` package. The wheel's headers include each other through all of these.
_INCLUDE_DIRS = (
    "include",
    "include/mindspore",
    "include/mindspore/core/include",
    "include/mindspore/core",
    "include/mindspore/ccsrc",
    "include/mindspore/ccsrc/include",
    "include/mindspore/ops",
    "include/mindspore/ops/include",
    "include/mindspore/ops/kernel/include",
    "include/mindapi",
    "include/third_party",
    "include/third_party/robin_hood_hashing",
)
_LIBRARIES = ("mindspore_core", "mindspore_common", "mindspore_backend_common")
# The wheel's libraries are built with the old libstdc++ string ABI (without it loading fails on an undefined
# ``Base::ToString[abi:cxx11]``) and with robin_hood hash maps: without ENABLE_FAST_HASH_TABLE the headers
# declare std::unordered_map members, FuncGraph's layout differs from the library's and inline accessors
# such as ``get_return()`` read garbage (seen: null returns and segfaults).
_DEFINES = ("_GLIBCXX_USE_CXX11_ABI=0", "ENABLE_FAST_HASH_TABLE=1")
_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-w")
_HEADER_PROBE = "include/mindspore/include/custom_pass_api.h"


@dataclasses.dataclass(frozen=True)
class PluginBuild:
    """A built plugin.

    Attributes:
        path: the shared library.
        mindspore_version: the MindSpore version it was built against.
        compiler: the compiler command; compiler_version: the first line of its ``--version``.
        cached: True when an earlier build was reused.
        seconds: compile time (0 when cached).
    """

    path: Path
    mindspore_version: str
    compiler: str
    compiler_version: str
    cached: bool
    seconds: float


def _mindspore_dir() -> tuple[Path, str]:
    spec = importlib.util.find_spec("mindspore")
    if spec is None or spec.origin is None:
        raise MindSporeMissingError("MindSpore is not installed here; install it with `pip install 'sgdfuse[mindspore]'`")
    try:
        version = importlib.metadata.version("mindspore")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Path(spec.origin).parent, version


def _command(compiler: str, ms_dir: Path, source: Path, output: Path) -> list[str]:
    command = [compiler, *_FLAGS]
    command += [f"-D{d}" for d in _DEFINES]
    command += [f"-I{ms_dir / d}" for d in _INCLUDE_DIRS]
    command += [str(source), "-o", str(output), f"-L{ms_dir / 'lib'}"]
    command += [f"-l{lib}" for lib in _LIBRARIES]
    command += [f"-Wl,-rpath,{ms_dir / 'lib'}"]
    return command


def build_plugin(*, cache_dir: str | os.PathLike | None = None, force: bool = False) -> PluginBuild:
    """Build the plugin for the installed MindSpore, or reuse the cached build.

    The cache key covers the MindSpore version, the compiler and its version, the flags and the source, so a
    changed toolchain or source builds anew. Concurrent builders serialise on a lock file; the library is
    written to a temporary name and renamed, so a reader never sees a partial file.

    Raises:
        MindSporeMissingError: MindSpore is not installed.
        PluginBuildError: no compiler (``reason="no-compiler"``), the wheel ships no plugin headers
            (``"no-headers"``), or the compile failed (``"compile-failed"``, with the compiler's output).
    """
    ms_dir, ms_version = _mindspore_dir()
    if not (ms_dir / _HEADER_PROBE).is_file():
        raise PluginBuildError(
            "no-headers",
            f"MindSpore {ms_version} at {ms_dir} ships no custom pass headers ({_HEADER_PROBE} is missing); "
            "the plugin needs a wheel with mindspore/include (MindSpore 2.10 or later)",
        )
    compiler, compiler_version = find_compiler("the MindSpore plugin", PluginBuildError)
    key = hashlib.sha256(
        "\0".join([ms_version, compiler_version, *_FLAGS, *_DEFINES, *_LIBRARIES, _SOURCE.read_text()]).encode()
    ).hexdigest()[:16]
    source = _SOURCE
    library, cached, seconds = build_cached(
        cache_root(cache_dir) / f"mindspore-{ms_version}" / key,
        "libsgdfuse_mindspore.so",
        lambda output: _command(compiler, ms_dir, source, output),
        what="the MindSpore plugin",
        compiler=compiler,
        compiler_version=compiler_version,
        metadata={"mindspore": ms_version},
        force=force,
        error_type=PluginBuildError,
    )
    return PluginBuild(library, ms_version, compiler, compiler_version, cached, seconds)


@dataclasses.dataclass
class Registration:
    """A registered plugin and where its pass writes what it did.

    Attributes:
        plugin: the build that was registered.
        device: ``"cpu"``, ``"ascend"`` or ``"all"`` (lower case, as registered with MindSpore).
        report_path: the JSON-lines file the pass appends to (one record per parameter and per graph).
        compiled_for: the device MindSpore compiles graphs for in this process (``"CPU"``, ``"Ascend"``...),
            read at registration.
    """

    plugin: PluginBuild
    device: str
    report_path: Path
    compiled_for: str = "?"

    def records(self) -> list[dict]:
        """Every record the pass wrote so far (all graphs compiled since the file was created)."""
        try:
            text = self.report_path.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def report(self, graph: str | None = None) -> Report:
        """What the pass fused and refused, as a :class:`~sgdfuse.report.Report` (one graph, or all)."""
        records = self.records()
        if graph is not None:
            records = [r for r in records if r.get("graph") == graph]
        return report_from_records(records, source=f"mindspore:{graph or 'all compiled graphs'}")

    def graphs(self) -> list[str]:
        """Names of the graphs the pass has run on, in compile order."""
        return [r["graph"] for r in self.records() if r.get("event") == "graph"]


# register_custom_pass returns True for a repeated registration and then runs the pass once per
# registration; remember what this process registered so that register() is idempotent.
_registered: dict[tuple[str, str], Registration] = {}
# Report files register() created in the temporary directory; removed when the process exits.
_temporary_reports: set[Path] = set()


def _remove_temporary_reports() -> None:
    for path in _temporary_reports:
        with contextlib.suppress(OSError):
            path.unlink()


atexit.register(_remove_temporary_reports)


def _compiled_for() -> str:
    """The device MindSpore compiles graphs for here: the context's device target (``"CPU"`` on a CPU wheel)."""
    try:
        import mindspore as ms

        return str(ms.get_context("device_target"))
    except Exception:  # MindSpore raises its own RuntimeError/ValueError kinds here; the caller only reports it
        return "?"


def _graphs_compiled_so_far() -> int:
    """How many compile phases MindSpore went through in this process so far (jit functions and GRAPH_MODE
    cells; one train step can take several). 0: nothing compiled yet."""
    try:
        from mindspore.graph import api
    except ImportError:
        return 0
    cells = getattr(api, "cells_compile_cache", {})
    return len(getattr(api, "ms_compile_cache", ())) + sum(len(v) for v in cells.values() if isinstance(v, (set, dict, list)))


def register(
    device: str = "cpu",
    *,
    report_path: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Registration:
    """Build (first use, cached) and register the pass that fuses ``mindspore.mint.optim.SGD`` updates.

    Graphs compiled afterwards (``@mindspore.jit`` functions, GRAPH_MODE cells) for ``device`` have each
    per-parameter ``mint.optim.SGD`` update -- both ``step_t == 0`` branches, the condition, the weight decay
    and the parameter update -- replaced by one ``SGD`` op. Graphs compiled before registration keep their
    unfused updates (MindSpore does not compile a called jit function again): register before the first
    training step. Registration cannot be undone in a process; use :func:`paused` around the first call of a
    function that must compile without the pass.

    Args:
        device: ``"cpu"``, ``"ascend"`` or ``"all"``, in any case (MindSpore's ``"CPU"``, ``"Ascend"`` too).
            The pass rewrites only graphs compiled for that device (``"all"``: any device). When MindSpore
            here compiles for another device, a warning says so: the pass will leave those graphs alone.
        report_path: the JSON-lines file the pass appends its records to. Default: a new file in the
            temporary directory, removed when the process exits (read it with :meth:`Registration.report`
            before then); an earlier registration's file is kept.
        cache_dir: where built plugins are cached (see :func:`build_plugin`).

    Warns:
        UserWarning: ``device`` is not the device graphs are compiled for here, or graphs were already
            compiled in this process (their updates stay unfused).

    Raises:
        ValueError: unknown ``device``.
        MindSporeMissingError, PluginBuildError: see :func:`build_plugin`.
        PluginRegisterError: MindSpore refused the plugin.
    """
    if not isinstance(device, str) or device.lower() not in _DEVICES:
        raise ValueError(f"device must be one of {', '.join(_DEVICES)} (any case), not {device!r}")
    device = device.lower()
    build = build_plugin(cache_dir=cache_dir)
    if report_path is not None:
        path = Path(report_path)
    elif os.environ.get(REPORT_ENV):
        path = Path(os.environ[REPORT_ENV])
    else:
        descriptor, name = tempfile.mkstemp(prefix="sgdfuse-mindspore-", suffix=".jsonl")
        os.close(descriptor)
        path = Path(name)
        _temporary_reports.add(path)
    os.environ[REPORT_ENV] = str(path)
    key = (str(build.path), device)
    if key in _registered:
        registration = dataclasses.replace(_registered[key], report_path=path)
        _registered[key] = registration
        return registration
    try:
        import mindspore.graph as ms_graph
    except ImportError as error:
        raise MindSporeMissingError(f"MindSpore cannot be imported: {error}") from error
    compiled_for = _compiled_for()
    already = _graphs_compiled_so_far()
    ok = ms_graph.register_custom_pass(PASS_NAME, str(build.path), device, ms_graph.CustomPassType.FULL_GRAPH)
    if not ok:
        raise PluginRegisterError(
            f"{build.path}: mindspore.graph.register_custom_pass refused pass {PASS_NAME!r} for device {device!r} "
            "(MindSpore's log above says why)"
        )
    # MindSpore 2.10 runs a FULL_GRAPH pass whatever device it was registered for; the pass itself checks
    # the device it compiles for against every device registered in this process.
    devices = {d for d in os.environ.get(DEVICES_ENV, "").split(",") if d}
    os.environ[DEVICES_ENV] = ",".join(sorted(devices | {device}))
    if device != "all" and compiled_for.lower() not in (device, "?"):
        warnings.warn(
            f"sgdfuse: registered for {device!r}, but MindSpore here compiles graphs for {compiled_for!r}: "
            f"the pass leaves them unfused (register(device={compiled_for.lower()!r}) to fuse them)",
            UserWarning,
            stacklevel=2,
        )
    if already:
        warnings.warn(
            "sgdfuse: MindSpore compiled graphs in this process before register(); those keep their unfused "
            "updates (a compiled jit function is not compiled again): register before the first step",
            UserWarning,
            stacklevel=2,
        )
    registration = Registration(build, device, path, compiled_for)
    _registered[key] = registration
    return registration


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Graphs *compiled* inside this block keep their unfused updates (the pass reads the switch at
    compile time, so wrap the first call of a jit function)."""
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = previous


def report_from_records(records: list[dict], source: str) -> Report:
    """Turn the pass's (or the MindIR rewriter's) records into a :class:`~sgdfuse.report.Report`.

    Each parameter counts once per graph: fused if any record of that graph fused it, else refused with
    the first reason recorded for it.
    """
    report = Report(source=source)
    fused_names = {(r.get("graph"), r["parameters"]) for r in records if r.get("event") == "fused"}
    seen: set[tuple[str, str, str]] = set()
    for record in records:
        event = record.get("event")
        if event == "fused":
            key = ("fused", record.get("graph"), record["parameters"])
            if key not in seen:
                seen.add(key)
                report.fused.append(_fused(record))
        elif event == "refused":
            key = ("refused", record.get("graph"), record["candidate"])
            if key not in seen and (record.get("graph"), record["candidate"]) not in fused_names:
                seen.add(key)
                report.refused.append(Refusal(record["candidate"], record["reason"], record["detail"]))
        elif event == "error":
            report.refused.append(
                Refusal(record.get("graph", "?"), "pass-error", f"the pass stopped and left the graph as it was: {record['detail']}")
            )
        elif event == "graph":
            report.nodes_before += int(record.get("nodes_before", 0))
            report.nodes_after += int(record.get("nodes_after", 0))
    return report


def _fused(record: dict) -> FusedUpdate:
    name = record["parameters"]
    return FusedUpdate(
        node=record.get("node", f"sgdfuse/SGD/{name}"),
        parameters=name,
        gradient=record["gradient"],
        accum=record["accum"],
        parameters_out=name,  # written in place
        accum_out=record["accum"],  # written in place
        # A number, or the name of the tensor the op reads it from at run time.
        learning_rate=lr if isinstance(lr := record["learning_rate"], str) else float(lr),
        momentum=float(record["momentum"]),
        learning_rate_input=record.get("learning_rate_input", "constant"),
        momentum_input="constant",
        dampening=float(record["dampening"]),
        weight_decay=float(record["weight_decay"]),
        nesterov=bool(record["nesterov"]),
        maximize=bool(record["maximize"]),
        stat=f"BroadcastTo(Cast({record['step']} == 0)): 1 on the first step (the buffer is zeroed first), 0 after",
        dtype=record["dtype"],
        shape=list(record["shape"]),
        parameter_equation=record["parameter_equation"],
        accum_equation=record["accum_equation"],
        matched_nodes=int(record.get("matched_nodes", 0)),
    )
