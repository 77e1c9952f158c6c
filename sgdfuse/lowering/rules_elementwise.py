"""ONNX → GE rules for elementwise ops: arithmetic, comparisons, activations, ``Clip``, ``Where``.

GE op prototypes (port names, attributes) are those of the public GE op IR headers (TensorFlow-style
names: ``x1, x2 → y``; ``SelectV2``: ``condition, then, else → result``). Broadcasting is numpy's in both
ONNX and GE, so every rule here maps one node to one op, except the variadic ``Sum``/``Max``/``Min``, which
become a left-to-right chain of the binary op (the order ONNX runtimes evaluate them in).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from sgdfuse.contract import TensorSpec
from sgdfuse.lowering.context import NodeLowering
from sgdfuse.lowering.registry import Rule, register
from sgdfuse.runtime import onnx_to_numpy_dtype

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
    "Erf": "Erf",
    "Floor": "Floor",
    "Ceil": "Ceil",
}.items():
    register(_onnx)(_unary(_ge))

register("IsNaN")(_unary("IsNan"))


@register("IsInf")
def lower_is_inf(ctx: NodeLowering) -> None:
    """ONNX ``IsInf`` with both signs (``detect_negative = detect_positive = 1``, the default, what loss-scaling
    overflow checks use) is GE ``IsInf``, which has no sign attributes."""
    if int(ctx.attr("detect_negative", 1)) != 1 or int(ctx.attr("detect_positive", 1)) != 1:
        raise ctx.error("IsInf detecting one sign only has no GE op (GE IsInf detects both); it is not lowered")
    _unary("IsInf")(ctx)


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


@register("Mod")
def lower_mod(ctx: NodeLowering) -> None:
    """``Mod`` → ``FloorMod`` (``fmod=0``: the result has the divisor's sign, Python's ``%``) or ``Mod``
    (``fmod=1``: C's ``fmod``, the dividend's sign)."""
    ge_type = "Mod" if int(ctx.attr("fmod", 0)) else "FloorMod"
    op = ctx.op(ge_type, [("x1", ctx.input(0)), ("x2", ctx.input(1))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("Gelu")
def lower_gelu(ctx: NodeLowering) -> None:
    """``Gelu`` (opset 20) → ``GeluV2`` with ``approximate`` ``"none"`` (erf form) or ``"tanh"``."""
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ctx.error(f"approximate={approximate!r}; ONNX defines only 'none' and 'tanh'")
    op = ctx.op("GeluV2", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], {"approximate": approximate})
    ctx.set_output(0, op.output(0))


@register("Clip")
def lower_clip(ctx: NodeLowering) -> None:
    """``Clip(x, min, max)`` (opset >= 11: bounds as optional inputs) → ``ClipByValue(x, clip_value_min,
    clip_value_max)``; an absent bound becomes a ``Const`` of the dtype's extreme (-inf/+inf for floats),
    which leaves every value unclipped on that side. Opset < 11 bounds come from the attributes."""
    spec = ctx.input_spec(0)
    if not spec.dtype:
        raise ctx.error(f"the dtype of {ctx.node.input[0]} is unknown")
    dtype = onnx_to_numpy_dtype(spec.dtype)
    low_value, high_value = (-np.inf, np.inf) if dtype.kind == "f" or spec.dtype == TensorProto.BFLOAT16 else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    bounds = []
    for index, attribute, extreme, label in ((1, "min", low_value, "min"), (2, "max", high_value, "max")):
        if ctx.opset >= 11:
            tensor = ctx.input(index)
            if tensor is None:
                tensor = ctx.const(np.array(extreme, dtype=dtype), label)
        else:
            tensor = ctx.const(np.array(ctx.attr(attribute, extreme), dtype=dtype), label)
        bounds.append(tensor)
    op = ctx.op(
        "ClipByValue",
        [("x", ctx.input(0)), ("clip_value_min", bounds[0]), ("clip_value_max", bounds[1])],
        [("y", ctx.output_spec(0))],
    )
    ctx.set_output(0, op.output(0))
