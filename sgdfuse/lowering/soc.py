"""The SoC a GE graph is built for, and the limits its product line puts on every ``SGD`` call.

``--soc`` takes an ATC ``--soc_version`` string; :func:`sgdfuse.contract.product_line_for_soc` maps it to
its product line (docs/contract.md table, with the bare ``Ascend910B`` = old training series trap) and
lists the accepted families for an unknown string. The product line decides (docs/contract.md, "Product
lines"), for each ``SGD`` node, on every one of its six tensors:

- dtype: FLOAT, FLOAT16 everywhere; BFLOAT16 only on the 950, A3 and A2 series;
- shape: dynamic shapes (a symbolic or unknown dimension, or an unknown rank) only on the 950 series;
- on every line: ``parameters`` rank 1..8 and no empty tensor.

These are clauses of the operator's contract, so they are checked on the ``SGD`` nodes' tensors; the rest of
the graph is ordinary GE ops whose own limits GE checks when it compiles. All refusals are
:class:`~sgdfuse.errors.ProductLineError` naming the node, the tensor and the clause. The remaining
signature clauses (same shape and dtype as ``parameters``, one-element ``learning_rate``/``momentum``) are
checked with :func:`sgdfuse.contract.check_signature`, their errors carrying the node too.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from sgdfuse.contract import INPUTS, MAX_RANK, ProductLine, TensorSpec, check_signature
from sgdfuse.errors import ContractError, ProductLineError
from sgdfuse.passes.index import GraphIndex

__all__ = ["check_product_line", "sgd_tensor_specs"]


def sgd_tensor_specs(index: GraphIndex, node: onnx.NodeProto) -> list[TensorSpec]:
    """Static facts of the six inputs of an ``SGD`` node, in contract order."""
    return [index.spec(node.input[i]) if i < len(node.input) else TensorSpec(port.name, None, 0) for i, port in enumerate(INPUTS)]


def check_product_line(index: GraphIndex, positions: Iterable[int], line: ProductLine) -> None:
    """Refuse the first ``SGD`` node (of those at ``positions`` in ``index``'s graph) that breaks ``line``'s
    limits or the operator's signature.

    Raises:
        ProductLineError: dtype not supported on ``line``; a dynamic shape where ``line`` has none;
            ``parameters`` rank outside 1..8; an empty tensor.
        ContractError: another signature clause (shapes/dtypes differ from ``parameters``, a
            ``learning_rate``/``momentum`` that is not one element), with the node named.
    """
    # Every clause reads only the dtypes and shapes (names appear in messages alone), and a graph of N
    # updates has a few distinct signatures: each is checked once. The inputs come from the index's node
    # facts; a node is read through protobuf only when its signature is new (for its name).
    passed: set[tuple] = set()
    for position in positions:
        signature = _signature(index, index.nodes[position][2])
        if signature in passed:
            continue
        node = index.graph.node[position]
        name = node.name or "SGD"
        specs = sgd_tensor_specs(index, node)
        for spec in specs:
            line.check(spec, node=name)
        parameters = specs[0]
        if parameters.shape is not None and not 1 <= len(parameters.shape) <= MAX_RANK:
            raise ProductLineError(
                f"{line.name}: parameters rank is 1..{MAX_RANK}",
                f"node {name}, tensor {parameters.name}",
                f"rank is {len(parameters.shape)}",
            )
        for spec in specs:
            if spec.shape is not None and any(d == 0 for d in spec.shape):
                raise ProductLineError(
                    f"{line.name}: empty tensors are not supported",
                    f"node {name}, tensor {spec.name}",
                    f"shape {list(spec.shape)} is empty",
                )
        try:
            check_signature(*specs, allowed_dtypes=line.dtypes)
        except ContractError as error:
            raise _with_node(error, name) from error
        passed.add(signature)


def _signature(index: GraphIndex, inputs: tuple[str, ...]) -> tuple:
    """``(dtype, shape)`` of each of the six inputs of an ``SGD`` node reading ``inputs``, as
    :func:`sgd_tensor_specs` gives them (dtype 0 and shape None for an unknown or absent input)."""
    specs = index.specs
    unknown = (0, None)
    found = []
    for i in range(len(INPUTS)):
        spec = specs.get(inputs[i]) if i < len(inputs) else None
        found.append(unknown if spec is None else (spec.dtype, spec.shape))
    return tuple(found)


def _with_node(error: ContractError, node: str) -> ContractError:
    # ContractError formats "subject: message (contract: clause)"; keep the message, add the node.
    text = str(error)
    message = text[len(error.subject) + 2 : len(text) - len(f" (contract: {error.clause})")]
    return type(error)(error.clause, f"node {node}, tensor {error.subject}", message)
