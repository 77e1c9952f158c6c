"""The ops of a lowered GE graph, read natively from its serialised ``GraphDef``.

``sgdfuse lower``'s verification reads every op of the step and init graphs back from their bytes (the class
keys of :mod:`sgdfuse.lowering.parts` are computed from what the graph holds, not from what lowering meant to
write): name, type, the bytes after its edges (its *body*) and its edges resolved to op positions. Read in
Python that costs about 6 µs an op, more than the rest of the cut into parts; :func:`read_ops` reads the same
with a small C++ reader (``_opscan.cc`` beside this file, a CPython extension built on first use and cached
like the node scanner, :func:`sgdfuse.passes.scan.build_extension`).

The native reader takes only the layout sgdfuse writes (``_opscan.cc`` says which) and refuses any other, as
it refuses names that are not UTF-8; its caller then reads the bytes in Python, so the answer, or the error, is
always the Python reader's. ``SGDFUSE_NATIVE_SCAN=0``, or a reader that cannot be built, leaves every graph to
the Python reader (tests/test_lowering_op_scan.py holds the two to the same answers).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

from sgdfuse.native import cache_root
from sgdfuse.passes.scan import NATIVE_ENV, ScannerBuildError, build_extension

__all__ = ["NativeOps", "read_ops", "native_available"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_opscan.cc")
_MODULE = "sgdfuse.lowering._opscan"

NativeOps = tuple[list[str], list[tuple[int, int]], list[str], list[int], list[list[tuple[int, int]]], dict[str, int], int]
"""What :func:`read_ops` returns: per op, in graph order, its name, the span of its bytes in the graph
``(start, end)``, its type, its body's number in ``bodies``, its inputs as ``(source position, output
index)`` (position -1 for an absent optional input ``""``, -2 for an op not in the graph; index -1 for a
control edge); then name → position of the last op of that name, and the position of the first
``NetOutput`` (-1 without one)."""


def native_available() -> bool:
    """True when the op reader is built (or builds now) and ``$SGDFUSE_NATIVE_SCAN`` is not ``0``."""
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return False
    try:
        _module()
    except ScannerBuildError as error:
        logger.debug("native GE op reader unavailable, reading GE graphs in Python: %s", error)
        return False
    return True


def read_ops(data: bytes, bodies: dict) -> NativeOps | None:
    """The ops of the serialised ``GraphDef`` ``data`` (:data:`NativeOps`), each body numbered in ``bodies``
    (``(op type, body bytes)`` → number, shared by the graphs of one model; new bodies get the next number);
    None when the native reader is unavailable or refuses the bytes (``bodies`` is then unchanged)."""
    if not native_available():
        return None
    try:
        return _module().read(data, bodies)
    except ValueError as error:
        logger.debug("native GE op reader refused a graph, reading it in Python: %s", error)
        return None


def _module() -> ModuleType:
    """The built reader module (built once per process and cache root, a failure remembered: build_extension)."""
    return build_extension(_SOURCE, _MODULE, "op-scan", "the native GE op reader", root=str(cache_root())).module
