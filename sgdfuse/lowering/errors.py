"""Exception types of the lowering to the Ascend Graph Engine.

All derive from :class:`sgdfuse.errors.SgdfuseError`, so the CLI prints them as one line and exits 1.
Product-line refusals are :class:`sgdfuse.errors.ProductLineError` (a contract error) and shape/dtype
clauses of the operator are the contract's own errors; the types here cover what is specific to lowering.
"""

from __future__ import annotations

from collections.abc import Sequence

from sgdfuse.errors import SgdfuseError

__all__ = ["LoweringError", "UnsupportedOpError", "InPlaceStateError"]


class LoweringError(SgdfuseError):
    """A model cannot be lowered to a GE graph.

    Attributes:
        subject: the node, value or file the problem is about.
    """

    def __init__(self, subject: str, message: str) -> None:
        super().__init__(f"{subject}: {message}")
        self.subject = subject


class UnsupportedOpError(LoweringError):
    """Nodes whose ONNX op type has no lowering rule. Every such node is listed, not only the first.

    Attributes:
        nodes: ``(op type, node name)`` pairs, in graph order.
    """

    def __init__(self, nodes: Sequence[tuple[str, str]]) -> None:
        self.nodes = list(nodes)
        kinds = sorted({op for op, _ in self.nodes})
        listing = "; ".join(f"{op} (node {name})" for op, name in self.nodes)
        super().__init__(
            "model",
            f"{len(self.nodes)} node(s) of {len(kinds)} op type(s) have no ONNX→GE lowering rule "
            f"[{', '.join(kinds)}]: {listing}",
        )


class InPlaceStateError(LoweringError):
    """An ``SGD`` node's writable input (``parameters``, ``accum``, ``stat``) cannot become GE state: it is
    neither a graph input, an initializer nor a zero-filled ``ConstantOfShape``, or two nodes write it."""
