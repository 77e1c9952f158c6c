"""ONNX → GE rule for ``If`` with small, side-effect-free branches: both branches computed, then ``SelectV2``.

Why: ``sgdfuse optimize`` writes ``If(momentum == 0)`` after an update whose momentum is a runtime value
(:meth:`sgdfuse.passes.rewrite.Planner._momentum_zero_buffer`): the then-branch recomputes the buffer the
original graph writes when momentum is 0 (about ten elementwise ops), the else-branch is ``Identity`` of the
fused op's buffer. GE has an ``If`` op with subgraphs (``OpDef.subgraph_name``), but its conventions (the
subgraphs' ``Data`` ops and their parent-input indices, how ref outputs cross the boundary) are not among
the facts we can check here, and the numpy executor would need nested graph runs. For branches like these,
computing both and selecting is exact and cheap, so that is what this rule emits:

    If(cond) {then: ... → t} {else: ... → e}   ⟶   t', e' (both branches inlined);  SelectV2(cond, t', e')

Exact because ONNX branches have no side effects (each op here is a pure function of its inputs), so
computing the branch not taken changes nothing but time; float arithmetic does not trap, and an Inf or NaN
in the branch not taken is discarded by the select. Reads of state inside a branch are ordinary reads of the
state variables, ordered before the in-place writes like any other (:mod:`sgdfuse.lowering.state`).

Accepted when (otherwise refused, naming the node and the cause):

- each branch has at most :data:`MAX_BRANCH_NODES` nodes, nested ones included (the cost of computing
  both every step stays small);
- no node in a branch is an ``ai.sgdfuse::SGD`` (an in-place write must not run unconditionally) and every
  node has a lowering rule;
- the branches' outputs pair up with the same dtype and the same known shape (``SelectV2`` broadcasts,
  ``If`` does not); the condition is one element (reshaped to a scalar when it is not rank 0).

Shapes and dtypes of branch values come from the graph index (:mod:`sgdfuse.passes.index`), whose shape
inference also records the types inferred inside subgraphs (value names are unique across scopes).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto

from sgdfuse.contract import TensorSpec, dtype_name
from sgdfuse.fused_op import DOMAIN, OP_TYPE
from sgdfuse.lowering.context import NodeLowering
from sgdfuse.lowering.graph_builder import Tensor
from sgdfuse.lowering.registry import register, rule_for
from sgdfuse.passes.index import _subgraphs

__all__ = ["MAX_BRANCH_NODES"]

MAX_BRANCH_NODES = 64
"""Largest branch (nodes, nested included) an ``If`` may have to be lowered by computing both branches."""


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in _subgraphs(attribute):
                yield from _nodes(sub)


def _check_branch(ctx: NodeLowering, label: str, branch: onnx.GraphProto) -> None:
    nodes = list(_nodes(branch))
    if len(nodes) > MAX_BRANCH_NODES:
        raise ctx.error(
            f"the {label} branch has {len(nodes)} nodes (limit {MAX_BRANCH_NODES}): sgdfuse lowers If by computing both "
            "branches and selecting (GE SelectV2), which is cheap only for small branches, and does not emit GE's If "
            "with subgraphs; simplify the branch, or make its condition a constant so that no If is needed (for "
            "sgdfuse's own If(momentum == 0): give momentum as an initializer, not a graph input)"
        )
    updates = [node.name or node.op_type for node in nodes if node.op_type == OP_TYPE and node.domain == DOMAIN]
    if updates:
        raise ctx.error(
            f"the {label} branch runs the in-place update {updates[0]}: computing both branches would run it on "
            "every step; sgdfuse does not lower conditional in-place updates"
        )
    missing = sorted({node.op_type for node in nodes if rule_for(node.domain, node.op_type) is None})
    if missing:
        raise ctx.error(f"the {label} branch has nodes without an ONNX→GE lowering rule [{', '.join(missing)}]")
    if branch.input:
        raise ctx.error(f"the {label} branch declares inputs; an If branch takes none")
    if len(branch.output) != len(ctx.node.output):
        raise ctx.error(f"the {label} branch has {len(branch.output)} outputs, the node {len(ctx.node.output)}")


def _inline(ctx: NodeLowering, label: str, branch: onnx.GraphProto) -> list[Tensor]:
    """Lower the branch's nodes into the enclosing graph; return the GE tensors of its outputs."""
    graph = ctx.graph
    index = graph.index
    local = [t.name for t in branch.initializer] + [o for node in branch.node for o in node.output if o]
    for name in local:
        if name in graph.values or index.node(name) is not None or index.is_input_name(name) or name in index.initializers:
            raise ctx.error(f"the {label} branch redefines {name!r}, a value of the enclosing graph")
    for tensor in branch.initializer:
        graph.scoped_initializers[tensor.name] = tensor
    for node in branch.node:
        for output in node.output:
            if output:
                graph.scoped_producers[output] = node
    for k, node in enumerate(branch.node):
        name = node.name or f"{ctx.name}/{label}/{node.op_type}_{k}"
        rule_for(node.domain, node.op_type)(NodeLowering(graph, node, ctx.position, name=name))  # type: ignore[misc]
    return [graph.tensor(output.name, reader=f"{ctx.name} ({label} branch output)") for output in branch.output]


def _same_type(a: TensorSpec, b: TensorSpec) -> bool:
    return bool(a.dtype) and a.dtype == b.dtype and a.shape is not None and a.shape == b.shape and None not in a.shape


@register("If")
def lower_if(ctx: NodeLowering) -> None:
    """``If`` → both branches inlined, ``SelectV2(condition, then, else)`` per output (module docstring)."""
    then_branch, else_branch = ctx.attr("then_branch"), ctx.attr("else_branch")
    _check_branch(ctx, "then", then_branch)
    _check_branch(ctx, "else", else_branch)
    condition = ctx.input(0)
    condition_spec = ctx.input_spec(0)
    if condition_spec.shape is not None and condition_spec.shape not in ((), (1,)) and not all(d == 1 for d in condition_spec.shape):
        raise ctx.error(f"the condition {ctx.node.input[0]} has shape {list(condition_spec.shape)}; If takes one element")
    if condition_spec.shape != ():
        scalar = TensorSpec(f"{ctx.name}/condition", (), TensorProto.BOOL)
        shape = ctx.const(np.zeros((0,), dtype=np.int64), "condition_shape")
        condition = ctx.op("Reshape", [("x", condition), ("shape", shape)], [("y", scalar)], {"axis": 0, "num_axes": -1}, suffix="condition").output(0)
    taken = _inline(ctx, "then", then_branch)
    other = _inline(ctx, "else", else_branch)
    for k, (a, b) in enumerate(zip(taken, other)):
        if not _same_type(a.spec, b.spec):
            raise ctx.error(
                f"output {k}: the branches give {_describe(a.spec)} and {_describe(b.spec)}; lowering If as a select "
                "needs the same dtype and the same known shape from both"
            )
        out = ctx.output_spec(k)
        spec = out if out.dtype and out.shape == a.spec.shape else TensorSpec(ctx.node.output[k], a.spec.shape, a.spec.dtype)
        op = ctx.op(
            "SelectV2",
            [("condition", condition), ("then", a), ("else", b)],
            [("result", spec)],
            suffix=None if len(taken) == 1 else f"select_{k}",
        )
        ctx.set_output(k, op.output(0))


def _describe(spec: TensorSpec) -> str:
    shape = "unknown shape" if spec.shape is None else str(list(spec.shape))
    return f"{dtype_name(spec.dtype) if spec.dtype else 'unknown dtype'} {shape}"
