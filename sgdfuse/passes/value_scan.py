"""The value infos of a main graph, read natively from the model's serialised bytes.

Reading a ``ValueInfoProto``'s name and type through protobuf's Python API makes new Python objects at
every read, and :func:`sgdfuse.passes.index.build_index` reads half a million of them at 50,000 updates
(graph inputs, outputs, declared and inferred value infos). :func:`scan_value_infos` reads every name and
the bytes of every distinct type at once with a small C++ scanner (``_vscan.cc`` beside this file, built
and cached like the node scanner, :mod:`sgdfuse.passes.scan`), so the index parses each distinct type once.

Field numbers (onnx/onnx.proto): ``ModelProto.graph`` 7; ``GraphProto.node`` 1 (counted), ``input`` 11,
``output`` 12, ``value_info`` 13; ``ValueInfoProto.name`` 1, ``type`` 2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from types import ModuleType

from sgdfuse.native import cache_root
from sgdfuse.passes.scan import NATIVE_ENV, ScanError, ScannerBuildError, build_extension

__all__ = ["INPUT", "OUTPUT", "VALUE_INFO", "ScannedInfos", "scan_value_infos", "native_available", "inference_bytes", "add_specs", "sweep_nodes"]

logger = logging.getLogger(__name__)

INPUT, OUTPUT, VALUE_INFO = 1, 2, 4
"""Bits of ``fields`` in :func:`scan_value_infos`: ``GraphProto.input``, ``output``, ``value_info``."""

_SOURCE = Path(__file__).with_name("_vscan.cc")
_MODULE = "sgdfuse.passes._vscan"


@dataclasses.dataclass(frozen=True)
class ScannedInfos:
    """The value infos of one model's main graph, per field, in order.

    Attributes:
        names: per field (input, output, value_info), ``ValueInfoProto.name`` of each entry, interned (the
            last ``name`` field wins, ``""`` without one); empty for a field not asked for.
        type_ids: per field, the position in ``types`` of each entry's type.
        types: the distinct serialised types: the concatenated payloads of an entry's ``type`` fields (protobuf
            merges a message field given twice, and concatenated serialisations parse as their merge), so
            ``TypeProto.FromString(types[i])`` equals the entry's parsed ``type``; ``b""`` without one.
        node_count: the number of ``GraphProto.node`` entries.
    """

    names: tuple[list[str], list[str], list[str]]
    type_ids: tuple[list[int], list[int], list[int]]
    types: list[bytes]
    node_count: int


def native_available() -> bool:
    """True when the value-info scanner is built (or builds now) and ``$SGDFUSE_NATIVE_SCAN`` is not ``0``."""
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return False
    try:
        _module()
    except ScannerBuildError as error:
        logger.debug("native value-info scanner unavailable, reading value infos through protobuf: %s", error)
        return False
    return True


def scan_value_infos(data: bytes | bytearray | memoryview, fields: int) -> ScannedInfos:
    """The value infos of the serialised ``ModelProto`` ``data`` in the graph fields ``fields`` (a sum of
    :data:`INPUT`, :data:`OUTPUT`, :data:`VALUE_INFO`).

    Raises:
        ScanError: ``data`` is not well-formed protobuf where the scanner reads it, or a value name is not
            UTF-8 (protobuf's Python API returns such names as ``bytes``; the caller reads them through it).
        ScannerBuildError: the scanner cannot be built.
    """
    module = _module()
    try:
        names, type_ids, types, node_count = module.scan(data, fields)
    except ValueError as error:
        raise ScanError.from_message(str(error)) from None
    return ScannedInfos(names, type_ids, types, node_count)


def inference_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """The serialised ``ModelProto`` ``data`` without what ONNX shape inference never reads: the nodes'
    ``name``, ``doc_string`` and ``metadata_props`` (``NodeProto`` fields 3, 6, 9) in the main graph, the
    graph's ``doc_string`` and ``metadata_props`` (``GraphProto`` 10, 16) and the model's (``ModelProto`` 6, 14).
    Every other field is copied byte for byte, in order; subgraphs are copied whole. Inference then parses,
    holds and returns less (an exporter's per-node stack traces, the bench's node names: 40 % of its bytes).

    Raises:
        ScanError: ``data`` is not well-formed protobuf where the stripper reads it.
        ScannerBuildError: the scanner cannot be built.
    """
    try:
        return _module().strip(data)
    except ValueError as error:
        raise ScanError.from_message(str(error)) from None


def add_specs(specs: dict, names: list[str], type_ids: list[int], found_of: list[tuple | None], spec_type: type) -> None:
    """Natively, the loop of :func:`sgdfuse.passes.index._add_scanned_specs`: for each ``names[i]`` (in order) whose
    entry in ``specs`` is missing or has ``shape`` None, and whose ``found_of[type_ids[i]]`` is a ``(shape, dtype)``
    pair (not None), set ``specs[names[i]] = spec_type(names[i], shape, dtype)``.

    ``spec_type`` is :class:`~sgdfuse.contract.TensorSpec` (a frozen slots dataclass whose ``__init__`` only sets
    its three slots ``name``, ``shape``, ``dtype``): each spec is made as ``object.__new__`` makes it, its slots set
    directly, at about a twentieth of the cost of calling the class (``__init__`` sets each slot through
    ``object.__setattr__``); at 50,000 updates the index makes half a million.

    Raises:
        TypeError: ``spec_type`` has no object slots ``name``, ``shape`` and ``dtype``, or an entry of ``found_of``
            is neither a pair nor None.
        ValueError, IndexError: ``type_ids`` does not match ``names`` or ``found_of``.
        ScannerBuildError: the scanner cannot be built.
    """
    _module().add_specs(specs, names, type_ids, found_of, spec_type)


def sweep_nodes(nodes: list[tuple]) -> tuple[dict, dict, list[int], int, bool]:
    """Natively, the loop of :func:`sgdfuse.passes.index._sweep_nodes` over the node facts ``nodes``
    (:data:`sgdfuse.passes.index.NodeFacts`: ``(op_type, domain, inputs, outputs, has_subgraph, has_attributes)``):
    ``(producer, consumers, holders, defined, text)``, where, node by node in order, ``producer[name] = k`` for
    each non-empty output name of node ``k``, ``consumers[name]`` has ``k`` appended for each non-empty input name
    (in the order of the inputs, a name read twice listed twice), ``holders`` lists the ``k`` whose
    ``has_subgraph`` is true, ``defined`` counts the non-empty output names (``len(producer)`` unless a name is
    output twice), and ``text`` is True when every op type, domain and non-empty input and output name is a
    ``str`` (protobuf hands out other bytes as ``bytes``: then :func:`sgdfuse.passes.index._require_text_names`
    has one to name). The same dictionaries, in the same insertion order, as the Python loop.

    Raises:
        TypeError: an entry of ``nodes`` is not such a tuple.
        ScannerBuildError: the scanner cannot be built.
    """
    return _module().sweep(nodes)


def _module() -> ModuleType:
    """The built scanner module (built once per process and cache root, a failure remembered: build_extension)."""
    return build_extension(_SOURCE, _MODULE, "value-scan", "the native value-info scanner", root=str(cache_root())).module
