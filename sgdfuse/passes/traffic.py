"""Memory-traffic estimate of an update before and after fusion.

Elementwise kernels are bound by memory bandwidth: each pass over a parameter-sized tensor costs its bytes.
The estimate counts, per step, the bytes every non-scalar tensor operand is read and every non-scalar result
is written, assuming one kernel per ONNX node and no fusion by the runtime (what an unfused graph executes):

- before: the matched update's nodes in the original graph;
- after: the fused ``SGD`` kernel, which reads ``parameters``, ``gradient``, ``accum``, ``stat`` and writes
  ``parameters``, ``accum``, ``stat`` in place (7 tensor passes; docs/contract.md), plus the helper
  nodes the rewrite added that touch full tensors (a ``Neg`` for maximize, the first-step zeroing, the
  ``stat`` fill, which on GE is a zero-initialised variable and costs nothing per step).

Sizes are element count times the dtype's byte width; a tensor with a symbolic dimension has no estimate.
"""

from __future__ import annotations

import math

import onnx

from sgdfuse.passes.index import GraphIndex

__all__ = ["tensor_bytes", "cone_traffic", "fused_traffic"]

_WIDTH = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2, onnx.TensorProto.DOUBLE: 8}

SGD_TENSOR_PASSES = 7
"""Reads of parameters, gradient, accum, stat; in-place writes of parameters, accum, stat."""


def tensor_bytes(index: GraphIndex, value: str) -> int | None:
    """Bytes of a float tensor with a static shape; 0 for scalars (one element); None when unknown."""
    spec = index.spec(value)
    if spec.dtype not in _WIDTH:
        return None
    count = spec.num_elements()
    if count is None:
        return None
    return 0 if count <= 1 else count * _WIDTH[spec.dtype]


def cone_traffic(index: GraphIndex, nodes: set[int]) -> int | None:
    """Bytes read and written per step by ``nodes`` of the original graph (None if any size is unknown)."""
    total = 0
    facts = index.nodes
    specs = index.specs  # a value with no spec has dtype 0 (GraphIndex.spec): not a float, no traffic
    for i in nodes:
        _, _, inputs, outputs, _, _ = facts[i]
        for names in (inputs, outputs):
            for name in names:
                if not name:
                    continue
                spec = specs.get(name)
                if spec is None:
                    continue
                width = _WIDTH.get(spec.dtype)
                if width is None:
                    continue  # not a float tensor: no traffic counted
                count = spec.num_elements()
                if count is None:
                    return None
                if count > 1:
                    total += count * width
    return total


def fused_traffic(index: GraphIndex, parameters: str, helper_passes: int) -> int | None:
    """Bytes per step of the fused kernel plus ``helper_passes`` extra full-tensor passes."""
    size = tensor_bytes(index, parameters)
    if size is None:
        return None
    return (SGD_TENSOR_PASSES + helper_passes) * size


def helper_passes(node_types: list[str]) -> int:
    """Full-tensor passes of the rewrite's helper nodes per step: Neg reads and writes (2), Where zeroing
    reads and writes (2); the stat fill is a GE variable (0)."""
    return sum(2 for t in node_types if t in ("Neg", "Where"))


def fmt_bytes(count: int | None) -> str:
    """``1.5 MiB``-style text."""
    if count is None:
        return "?"
    if count < 1024:
        return f"{count} B"
    exponent = min(int(math.log(count, 1024)), 4)
    return f"{count / 1024 ** exponent:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exponent]}"
