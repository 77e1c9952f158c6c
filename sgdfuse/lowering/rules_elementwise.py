"""ONNX → GE rules for elementwise ops: arithmetic, comparisons, activations, ``Where``.

GE op prototypes (port names, attributes) are those of the public GE op IR headers (TensorFlow-style
names: ``x1, x2 → y``; ``SelectV2``: ``condition, then, else → result``). Broadcasting is numpy's in both
ONNX and GE, so every rule here maps one node to one op, except the variadic ``Sum``/``Max``/``Min``, which
become a left-to-right chain of the binary op (the order ONNX runtimes evaluate them in).
"""

from __future__ import annotations

from onnx import TensorProto

from sgdfuse.contract import TensorSpec
from sgdfuse.lowering.context import NodeLowering
from sgdfuse.lowering.registry import Rule, register

__all__: list[str] = []

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


def _unary(ge_type: str, **attrs: object) -> Rule:
    def rule(ctx: NodeLowering) -> None:
        op = ctx.op(ge_type, [("x", ctx.input(0))], [("y", ctx.output_spec(0))], dict(attrs))
        ctx.set_output(0, op.output(0))

    rule.__name__ = f"lower_{ge_type}"
    return rule


def _binary(ge_type: str) -> Rule:
    def rule(ctx: NodeLowering) -> None:
        op = ctx.op(ge_type, [("x1", ctx.input(0)), ("x2", ctx.input(1))], [("y", ctx.output_spec(0))])
        ctx.set_output(0, op.output(0))

    rule.__name__ = f"lower_{ge_type}"
    return rule


def _chain(ge_type: str) -> Rule:
    # Variadic ONNX op → ((x0 op x1) op x2) ...; a single input is an Identity.
    def rule(ctx: NodeLowering) -> None:
        operands = ctx.inputs()
        if len(operands) == 1:
            op = ctx.op("Identity", [("x", operands[0])], [("y", ctx.output_spec(0))])
            ctx.set_output(0, op.output(0))
            return
        out = ctx.output_spec(0)
        total = operands[0]
        for k, operand in enumerate(operands[1:], start=1):
            last = k == len(operands) - 1
            spec = out if last else TensorSpec(f"{ctx.name}/partial_{k}", None, out.dtype)
            total = ctx.op(ge_type, [("x1", total), ("x2", operand)], [("y", spec)], suffix=None if last else f"partial_{k}").output(0)
        ctx.set_output(0, total)

    rule.__name__ = f"lower_chain_{ge_type}"
    return rule


for _onnx, _ge in {
    "Neg": "Neg",
    "Relu": "Relu",
    "Abs": "Abs",
    "Sqrt": "Sqrt",
    "Sigmoid": "Sigmoid",
    "Tanh": "Tanh",
    "Not": "LogicalNot",
    "Identity": "Identity",
    "Reciprocal": "Reciprocal",
}.items():
    register(_onnx)(_unary(_ge))

# GE's Exp/Log compute base^(scale*x + shift) / log_base(scale*x + shift); base -1 means e.
register("Exp")(_unary("Exp", base=-1.0, scale=1.0, shift=0.0))
register("Log")(_unary("Log", base=-1.0, scale=1.0, shift=0.0))

for _onnx, _ge in {
    "Add": "Add",
    "Sub": "Sub",
    "Mul": "Mul",
    "Pow": "Pow",
    "Equal": "Equal",
    "Less": "Less",
    "LessOrEqual": "LessEqual",
    "Greater": "Greater",
    "GreaterOrEqual": "GreaterEqual",
    "And": "LogicalAnd",
    "Or": "LogicalOr",
}.items():
    register(_onnx)(_binary(_ge))

register("Sum")(_chain("Add"))
register("Max")(_chain("Maximum"))
register("Min")(_chain("Minimum"))


@register("Div")
def lower_div(ctx: NodeLowering) -> None:
    """``Div`` → ``RealDiv`` for floating types; ``TruncateDiv`` for integers (ONNX integer division
    truncates toward zero)."""
    ge_type = "RealDiv" if ctx.output_spec(0).dtype in _FLOATS else "TruncateDiv"
    op = ctx.op(ge_type, [("x1", ctx.input(0)), ("x2", ctx.input(1))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("Where")
def lower_where(ctx: NodeLowering) -> None:
    """``Where(condition, X, Y)`` → ``SelectV2(condition, then, else)`` (broadcasting select)."""
    op = ctx.op(
        "SelectV2",
        [("condition", ctx.input(0)), ("then", ctx.input(1)), ("else", ctx.input(2))],
        [("result", ctx.output_spec(0))],
    )
    ctx.set_output(0, op.output(0))
