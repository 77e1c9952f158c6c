"""The node table: what the passes read of every node of the main graph, read once.

Reading a field of a node through protobuf's Python API makes a new Python object at every read; for a
graph of 77,000 nodes one such sweep of every node's op type, domain, inputs, outputs and attributes costs
about as much as ``onnx.load`` and ``onnx.save`` together. :func:`node_table` reads the same facts from the
model's serialised bytes with a small native scanner (``_scan.cc`` beside this file, a CPython extension
compiled on first use with the system C++ compiler and cached, see :mod:`sgdfuse.native`), which skips
everything but the nodes (initializers, value infos, functions) by their length.

Where the scanner cannot be built (no compiler, no Python headers) or is turned off with
``SGDFUSE_NATIVE_SCAN=0``, :func:`python_node_table` reads the same table through protobuf's Python API.
Both give the same table for every model (tests/test_node_scan.py), equal to what protobuf returns.

The table can list the node names under a prefix (``name_prefix``). :func:`native_structure` is the output
guard's pass over a rewritten graph (:mod:`sgdfuse.passes.output_check`): definition before use, and what the
checker sees of the new nodes, from the bytes, with Python objects made only for those nodes.

Field numbers (onnx/onnx.proto): ``ModelProto.graph`` 7; ``GraphProto.node`` 1; ``NodeProto.input`` 1,
``output`` 2, ``name`` 3, ``op_type`` 4, ``attribute`` 5, ``domain`` 7, ``overload`` 8;
``AttributeProto.type`` 20 (``GRAPH`` = 5, ``GRAPHS`` = 10), ``g`` 6, ``graphs`` 11.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import onnx

from sgdfuse.errors import NativeBuildError, SgdfuseError
from sgdfuse.native import build_cached, cache_root, find_compiler

__all__ = [
    "NATIVE_ENV",
    "NodeTable",
    "ScanError",
    "ScannerBuildError",
    "ScannerBuild",
    "node_table",
    "graph_node_table",
    "python_node_table",
    "native_node_table",
    "python_node_details",
    "NodeDetails",
    "GroupSummary",
    "StructureScan",
    "native_structure",
    "native_available",
    "build_scanner",
    "build_extension",
]

logger = logging.getLogger(__name__)

NATIVE_ENV = "SGDFUSE_NATIVE_SCAN"
"""Environment variable: ``0`` makes :func:`node_table` read through protobuf's Python API, never building or
loading the native scanner."""

_SOURCE = Path(__file__).with_name("_scan.cc")
_WIRE_HEADER = Path(__file__).with_name("_wire.h")
_PYLIST_HEADER = Path(__file__).with_name("_pylist.h")
_MODULE = "sgdfuse.passes._scan"
# -fno-strict-aliasing as CPython's own extensions are built; no -ffast-math (there is no arithmetic to speed).
_FLAGS = ("-std=c++17", "-O2", "-fno-strict-aliasing", "-fPIC", "-shared", "-fvisibility=hidden")
_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS


@dataclasses.dataclass(frozen=True)
class NodeTable:
    """Per node of the main graph (``ModelProto.graph.node``), in graph order, one entry in each tuple.

    Strings are what protobuf's Python API returns for the field: ``str``, interned (equal names are one
    object), or ``bytes`` for a string field that is not valid UTF-8 (protobuf's upb backend, the default, returns
    those as bytes for proto2 strings).

    Attributes:
        op_types: ``NodeProto.op_type`` (field 4; ``""`` when absent).
        domains: ``NodeProto.domain`` (field 7; ``""`` when absent, the default ONNX domain).
        inputs: ``NodeProto.input`` (field 1), a tuple per node; an omitted optional input stays ``""``.
        outputs: ``NodeProto.output`` (field 2), a tuple per node, ``""`` kept likewise.
        has_attributes: the node has at least one ``NodeProto.attribute`` (field 5).
        has_subgraph: one of its attributes holds a graph: ``type`` (field 20) is ``GRAPH`` or ``GRAPHS``, or
            ``g`` (field 6) is set or ``graphs`` (field 11) is not empty.
        prefixed_names: with ``name_prefix``, the ``NodeProto.name`` (field 3) of every node whose name
            starts with it, in node order (a name that is not UTF-8 is ``bytes`` and is compared as such);
            None when no prefix was asked for.
        reader: ``"native"`` or ``"python"``: which reader made the table (not compared by ``==``).
        non_text_name: the position of the first node whose ``NodeProto.name`` (field 3) or one of whose
            ``AttributeProto.name`` (field 1) is not valid UTF-8 (protobuf's Python API gives it as ``bytes``);
            -1 when every one is text.
        details: when asked for (``details=True``), per node its ``NodeProto.overload`` (field 8; ``""`` when
            absent) and the bytes of each ``NodeProto.attribute`` (field 5), in order (:data:`NodeDetails`); else
            None. The native reader gives each attribute's bytes as they stand in the serialised model, the
            Python reader its serialisation by protobuf: the same bytes for a model protobuf wrote, and for
            any model equal bytes are equal attributes.
    """

    op_types: tuple[str, ...]
    domains: tuple[str, ...]
    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    has_attributes: tuple[bool, ...]
    has_subgraph: tuple[bool, ...]
    reader: str = dataclasses.field(default="python", compare=False)
    prefixed_names: tuple[str, ...] | None = None
    non_text_name: int = -1
    details: "tuple[NodeDetails, ...] | None" = None

    def __len__(self) -> int:
        """The number of nodes."""
        return len(self.op_types)


class ScanError(SgdfuseError):
    """The native scanner found bytes that are not a well-formed ``ModelProto`` (or ``GraphProto``).

    Attributes:
        offset: the byte offset where the scanner stopped. reason: what it found there.
    """

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"malformed protobuf at byte {offset}: {reason}")
        self.offset = offset
        self.reason = reason

    @classmethod
    def from_message(cls, message: str) -> "ScanError":
        """The error a native scanner reported as ``malformed protobuf at byte N: reason`` (its ValueError)."""
        head, _, reason = message.partition(": ")
        return cls(int(head.rsplit(" ", 1)[-1]), reason)


class ScannerBuildError(NativeBuildError):
    """The native scanner could not be built: no compiler (``reason="no-compiler"``), no Python headers
    (``"no-headers"``), or the compile failed (``"compile-failed"``)."""


@dataclasses.dataclass(frozen=True)
class ScannerBuild:
    """A built scanner.

    Attributes:
        path: the extension module file. module: the loaded module.
        cached: True when an earlier build was reused; seconds: compile time (0 when cached).
    """

    path: Path
    module: ModuleType
    cached: bool
    seconds: float


def native_available() -> bool:
    """True when the native node scanner is to be used (``$SGDFUSE_NATIVE_SCAN`` is not ``0``) and builds (or
    is built); why not is logged at debug level."""
    return _native_enabled()


def _native_enabled() -> bool:
    """The native scanner is to be used and builds (why not is logged at debug level)."""
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return False
    try:
        build_scanner()
    except NativeBuildError as error:
        logger.debug("native node scanner unavailable, reading nodes through protobuf: %s", error)
        return False
    return True


def node_table(model: onnx.ModelProto, data: bytes | None = None, *, graph: bool = False, name_prefix: str | None = None,
               details: bool = False) -> NodeTable:
    """The node table of ``model``'s main graph (:class:`NodeTable`), read natively when the scanner builds.

    Args:
        model: the model; not modified.
        data: the serialised bytes ``model`` was parsed from (binary protobuf, unchanged since), when the
            caller has them: then nothing is serialised again. Without them the scanner reads
            ``model.graph.SerializeToString()``.
        graph: ``data`` is ``model.graph`` serialised, not the whole model.
        name_prefix: also list the names of the nodes that start with it (:attr:`NodeTable.prefixed_names`).
        details: also read each node's overload and attributes' bytes (:attr:`NodeTable.details`).

    Falls back to :func:`python_node_table` (logged at debug level) when ``$SGDFUSE_NATIVE_SCAN`` is ``0``,
    when the scanner cannot be built, when ``data`` is not well-formed protobuf, or when it does not hold as
    many nodes as ``model``; the table is the same either way.
    """
    if not _native_enabled():
        return python_node_table(model, name_prefix=name_prefix, details=details)
    nodes = model.graph.node
    try:
        if data is None:
            table = native_node_table(model.graph.SerializeToString(), graph=True, name_prefix=name_prefix, details=details)
        else:
            table = native_node_table(data, graph=graph, name_prefix=name_prefix, details=details)
    except ScanError as error:
        logger.debug("native node scanner refused the model's bytes, reading nodes through protobuf: %s", error)
        return python_node_table(model, name_prefix=name_prefix, details=details)
    if len(table) != len(nodes):
        logger.debug("the bytes given hold %d nodes, the model %d; reading nodes through protobuf", len(table), len(nodes))
        return python_node_table(model, name_prefix=name_prefix, details=details)
    return table


@dataclasses.dataclass(frozen=True)
class _GraphOnly:
    """What :func:`node_table` and :func:`python_node_table` read of a model: its ``graph`` alone."""

    graph: onnx.GraphProto


def graph_node_table(graph: onnx.GraphProto) -> NodeTable:
    """The node table of any ``GraphProto``: a subgraph (an ``If`` branch, a ``Loop`` or ``Scan`` body) as well
    as a main graph, read as :func:`node_table` reads a model's (natively from ``graph`` serialised when the
    scanner builds, else through protobuf; the same table either way). Its nodes' own subgraphs are not read
    (``has_subgraph`` says which nodes hold one)."""
    return node_table(_GraphOnly(graph))  # type: ignore[arg-type]  # only .graph is read


def native_node_table(data: bytes | bytearray | memoryview, *, graph: bool = False, name_prefix: str | None = None,
                      details: bool = False) -> NodeTable:
    """The node table read by the native scanner from serialised bytes.

    Args:
        data: a serialised ``ModelProto`` (binary protobuf), or a ``GraphProto`` when ``graph``. Untrusted
            bytes are safe: every read is bounds-checked.
        name_prefix: also list the names of the nodes that start with it (their UTF-8 bytes start with its).
        details: also read each node's overload and attributes' bytes (:attr:`NodeTable.details`).

    Raises:
        ScanError: ``data`` is not well-formed protobuf where the scanner reads it (a truncated field, a length
            past the end, an invalid tag or wire type; bytes inside fields it skips are not checked).
        ScannerBuildError: the scanner cannot be built (see :func:`build_scanner`).
    """
    module = build_scanner().module
    prefix = None if name_prefix is None else name_prefix.encode()
    try:
        op_types, domains, inputs, outputs, has_attributes, has_subgraph, names, non_text_name, rows = module.scan(
            data, not graph, prefix, details)
    except ValueError as error:
        raise ScanError.from_message(str(error)) from None
    return NodeTable(
        tuple(op_types), tuple(domains), tuple(inputs), tuple(outputs), tuple(has_attributes), tuple(has_subgraph), "native",
        None if name_prefix is None else tuple(names), non_text_name, None if rows is None else tuple(rows),
    )


def python_node_table(model: onnx.ModelProto, *, name_prefix: str | None = None, details: bool = False) -> NodeTable:
    """The node table read through protobuf's Python API (the reader :func:`node_table` falls back to)."""
    op_types: list[str] = []
    domains: list[str] = []
    inputs: list[tuple[str, ...]] = []
    outputs: list[tuple[str, ...]] = []
    has_attributes: list[bool] = []
    has_subgraph: list[bool] = []
    intern = sys.intern
    non_text_name = -1
    for k, node in enumerate(model.graph.node):
        try:
            op_type, domain = intern(node.op_type), intern(node.domain)
            names_in, names_out = tuple(map(intern, node.input)), tuple(map(intern, node.output))
        except TypeError:  # a string field that is not UTF-8 comes back as bytes, which cannot be interned
            op_type, domain = _intern_text(node.op_type), _intern_text(node.domain)
            names_in, names_out = tuple(map(_intern_text, node.input)), tuple(map(_intern_text, node.output))
        op_types.append(op_type)
        domains.append(domain)
        inputs.append(names_in)
        outputs.append(names_out)
        attributes = node.attribute
        if non_text_name < 0 and (type(node.name) is not str or any(type(a.name) is not str for a in attributes)):
            non_text_name = k
        if attributes:
            has_attributes.append(True)
            has_subgraph.append(any(a.type in (_GRAPH, _GRAPHS) or a.HasField("g") or len(a.graphs) > 0 for a in attributes))
        else:
            has_attributes.append(False)
            has_subgraph.append(False)
    names = None
    if name_prefix is not None:
        prefix = name_prefix.encode()
        names = []
        for node in model.graph.node:
            name = node.name
            if name.startswith(name_prefix) if type(name) is str else name.startswith(prefix):
                names.append(_intern_text(name))
    return NodeTable(
        tuple(op_types), tuple(domains), tuple(inputs), tuple(outputs), tuple(has_attributes), tuple(has_subgraph), "python",
        None if names is None else tuple(names), non_text_name,
        tuple(python_node_details(model, range(len(op_types)))) if details else None,
    )


def _intern_text(value: str | bytes) -> str | bytes:
    return sys.intern(value) if type(value) is str else value


NodeDetails = tuple[str, tuple[bytes, ...]]
"""What :func:`python_node_details` reads of one node: its ``overload`` (field 8; ``""`` when absent) and each of its
attributes (field 5) serialised, in order."""


def python_node_details(model: onnx.ModelProto, positions: Sequence[int]) -> list[NodeDetails]:
    """:data:`NodeDetails` of the main graph's nodes at ``positions``, read through protobuf's Python API."""
    nodes = model.graph.node
    return [(_intern_text(nodes[k].overload), tuple(a.SerializeToString() for a in nodes[k].attribute)) for k in positions]


GroupSummary = tuple[bytes, tuple[str, ...], tuple[int, ...], tuple[bool, ...]]
"""What :func:`native_structure` says of one group of nodes (a plan's): the bytes of what the checker reads of them
but names (per node its domain, op type, overload, each attribute's bytes, the numbers of inputs and outputs; then
per input and output slot, in order, the place its name first stands in that sequence, -1 for ``""``; every length
written, so that equal bytes are equal nodes up to a renaming that keeps ``""``), the distinct non-empty names in
the order they first stand, those places, and whether the group's nodes output each."""


@dataclasses.dataclass(frozen=True)
class StructureScan:
    """What :func:`native_structure` found in a graph.

    Attributes:
        error: None, or the first rule broken, as ``(kind, names)``: ``"read"`` (a node reads a name not defined
            before it), ``"subgraph"`` (a subgraph reads such names: all of one subgraph's), ``"twice"`` (a node
            defines a name already defined, or one twice), ``"output"`` (a graph output nothing defines).
        found: per wanted name, the position of the node whose first output it is, -1 when there is none (or the
            name is wanted again later, or None); complete only without ``error``.
        subgraph: per wanted name, whether its node holds a subgraph.
        groups: per group, its :data:`GroupSummary`, or None when one of its nodes was not found (all None after an
            error).
    """

    error: tuple[str, list] | None
    found: list[int]
    subgraph: list[bool]
    groups: list[GroupSummary | None]


def native_structure(
    data: bytes | bytearray | memoryview, wanted: Sequence[str | None], sizes: Sequence[int], outer: Callable[[int], list[list[str]]],
    *, graph: bool = False,
) -> StructureScan:
    """Single assignment and definition before use over the main graph of the serialised ``data``, read by the
    native scanner (the rules of :func:`sgdfuse.passes.output_check` and its Python pass, which is the reference):
    the names defined before the first node are the graph inputs', the initializers', the sparse initializers'
    values' and ``""``; each node must read defined names only (and its subgraphs too: ``outer(position)`` gives,
    per subgraph of the node, the names it reads from outside), and define new, distinct names; every graph output
    must be defined. Names are compared as their bytes. Meanwhile the nodes whose first output is in ``wanted``
    are found, and each group of ``sizes[i]`` consecutive wanted names summarised (:data:`GroupSummary`).

    Raises:
        ScanError: ``data`` is not well-formed protobuf where the scanner reads it.
        ScannerBuildError: the scanner cannot be built.
    """
    module = build_scanner().module
    try:
        error, found, subgraph, groups = module.structure(data, not graph, wanted, sizes, outer)
    except ValueError as error:
        if str(error).startswith("malformed protobuf"):
            raise ScanError.from_message(str(error)) from None
        raise
    return StructureScan(error, found, subgraph, groups)


def build_scanner(*, cache_dir: str | os.PathLike | None = None, force: bool = False) -> ScannerBuild:
    """Build the native scanner (or reuse the cached build) and load it; once per process and cache root.

    The cache key covers the compiler and its version, the flags, the source and the Python ABI (the
    extension suffix and the headers' ``patchlevel.h``), so any change builds anew (:func:`sgdfuse.native.build_cached`).

    Raises:
        ScannerBuildError: no compiler (``reason="no-compiler"``), no ``Python.h`` (``"no-headers"``), or the
            compile failed (``"compile-failed"``, the compiler's output in ``log``); a failure is remembered,
            so a process tries once per cache root.
    """
    return build_extension(_SOURCE, _MODULE, "node-scan", "the native node scanner", root=str(cache_root(cache_dir)), force=force)


# What build_extension() found per module and cache root in this process: the build, or the error it raised.
_LOADED: dict[tuple[str, str], ScannerBuild | ScannerBuildError] = {}


def build_extension(source: Path, module_name: str, cache_name: str, what: str, *, root: str, force: bool = False) -> ScannerBuild:
    """Build (or reuse) and load the CPython extension module ``module_name`` compiled from the C++ file
    ``source`` and the headers ``_wire.h`` (the wire format) and ``_pylist.h`` it includes (all beside this file), cached under
    ``root / cache_name`` by a key of compiler, flags, Python ABI, sources and header: the node scanner's
    build, shared by :mod:`sgdfuse.passes.value_scan`. Once per module and cache root in a process (a
    failure is remembered too), unless ``force``.

    Raises:
        ScannerBuildError: no compiler (``no-compiler``), no Python headers (``no-headers``), or the compile or
            the load failed (``compile-failed``); ``what`` names the scanner in the message.
    """
    loaded = _LOADED.get((module_name, root))
    if loaded is None or force:
        try:
            loaded = _build_extension(source, module_name, cache_name, what, root=root, force=force)
        except ScannerBuildError as error:
            loaded = error
        _LOADED[(module_name, root)] = loaded
    if isinstance(loaded, ScannerBuildError):
        raise loaded
    return loaded


def _build_extension(source: Path, module_name: str, cache_name: str, what: str, *, root: str, force: bool) -> ScannerBuild:
    includes = _python_includes(what)
    compiler, compiler_version = find_compiler(what, ScannerBuildError)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    patchlevel = Path(includes[0], "patchlevel.h")
    headers = patchlevel.read_bytes() if patchlevel.is_file() else b""
    flags = [*_FLAGS, *(["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else [])]
    key = hashlib.sha256(
        b"\0".join([compiler_version.encode(), *(f.encode() for f in flags), suffix.encode(), sys.version.encode(), headers,
                     source.read_bytes(), _WIRE_HEADER.read_bytes(), _PYLIST_HEADER.read_bytes()])
    ).hexdigest()[:16]
    path, cached, seconds = build_cached(
        Path(root) / cache_name / key,
        f"{module_name.rpartition('.')[2]}{suffix}",
        lambda output: [compiler, *flags, *(f"-I{p}" for p in includes), str(source), "-o", str(output)],
        what=what,
        compiler=compiler,
        compiler_version=compiler_version,
        metadata={"python": sys.version, "extension_suffix": suffix},
        force=force,
        error_type=ScannerBuildError,
    )
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ScannerBuildError("compile-failed", f"{path} cannot be loaded as an extension module")
    try:
        module = importlib.util.module_from_spec(spec)  # dlopen: a library that is no library fails here
        spec.loader.exec_module(module)
    except ImportError as error:
        raise ScannerBuildError("compile-failed", f"{what} built at {path} does not load: {error}") from error
    return ScannerBuild(path, module, cached, seconds)


def _python_includes(what: str) -> list[str]:
    """The directories holding ``Python.h`` and ``pyconfig.h`` (they differ on Debian's system Python)."""
    paths = sysconfig.get_paths()
    found = list(dict.fromkeys(p for p in (paths.get("include"), paths.get("platinclude")) if p))
    if not any(os.path.isfile(os.path.join(p, "Python.h")) for p in found):
        raise ScannerBuildError(
            "no-headers",
            f"{what} needs Python's headers (Python.h, looked in {', '.join(found) or 'nowhere'}): "
            f"install them (e.g. `apt-get install python3-dev`), or set {NATIVE_ENV}=0 to read the model through protobuf",
        )
    return found


