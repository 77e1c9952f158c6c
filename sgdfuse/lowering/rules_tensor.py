"""ONNX → GE rules for ops that move, shape, create or convert tensors.

GE takes several operands ONNX passes as tensors as compile-time data: ``Transpose.perm``, ``Reshape.shape``
and ``Concat``'s axis become ``Const`` inputs, ``Squeeze``/``Unsqueeze`` axes become list attributes. Rules
read such operands with ``ctx.constant`` (initializers, ``Constant`` nodes and small constant expressions,
see :meth:`GraphLowering.constant_value`) and refuse, naming the node, when they are only known at run time
and the GE meaning would differ.

Semantics that differ and how the rules close the gap:

- ``Reshape``: ONNX (``allowzero=0``) copies the input dimension where the target shape holds 0; the rule
  writes those dimensions out. A run-time shape with ``allowzero=0`` is refused (0 would be ambiguous).
- ``Cast``: GE's ``dst_type`` is an int in the C++ ``ge::DataType`` numbering (FLOAT = 0, FLOAT16 = 1, ...),
  not the proto enum; ``Shape``'s ``dtype`` likewise.
- ``ConstantOfShape`` → ``Fill(dims, value)``, the value a scalar ``Const`` of the attribute's dtype.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from sgdfuse.contract import TensorSpec, dtype_name
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.context import NodeLowering
from sgdfuse.lowering.registry import register

__all__: list[str] = []


def _axes(ctx: NodeLowering, attribute: str = "axes", input_index: int = 1) -> list[int] | None:
    """Axes from the attribute (older opsets) or the constant input (newer ones); None when absent."""
    axes = ctx.attr(attribute)
    if axes is not None:
        return [int(a) for a in axes]
    if ctx.has_input(input_index):
        value = ctx.constant(input_index)
        if value is None:
            raise ctx.error(f"input {input_index} ({ctx.node.input[input_index]}) must be a compile-time constant for GE")
        return [int(a) for a in np.ravel(value)]
    return None


def _rank(ctx: NodeLowering, i: int = 0) -> int | None:
    shape = ctx.input_spec(i).shape
    return None if shape is None else len(shape)


@register("Reshape")
def lower_reshape(ctx: NodeLowering) -> None:
    allow_zero = bool(ctx.attr("allowzero", 0))
    target = ctx.constant(1)
    if target is None:
        if not allow_zero:
            raise ctx.error(
                "the target shape is only known at run time and allowzero=0: ONNX copies the input dimension "
                "where it holds 0, GE's Reshape does not promise to; export with allowzero=1 or a constant shape"
            )
        shape = ctx.input(1)
    else:
        target = np.array(target, dtype=np.int64).reshape(-1)
        if not allow_zero and (target == 0).any():
            source = ctx.input_spec(0).shape
            for k in np.flatnonzero(target == 0):
                if source is None or k >= len(source) or not isinstance(source[k], int):
                    raise ctx.error(f"target dimension {k} is 0 (copy the input's) but that input dimension is not static")
                target[k] = source[k]
        shape = ctx.const(target, "shape")
    op = ctx.op("Reshape", [("x", ctx.input(0)), ("shape", shape)], [("y", ctx.output_spec(0))], {"axis": 0, "num_axes": -1})
    ctx.set_output(0, op.output(0))


@register("Transpose")
def lower_transpose(ctx: NodeLowering) -> None:
    perm = ctx.attr("perm")
    if perm is None:
        rank = _rank(ctx)
        if rank is None:
            raise ctx.error("no perm and unknown input rank")
        perm = list(reversed(range(rank)))
    perm_tensor = ctx.const(np.array(perm, dtype=np.int64), "perm")
    op = ctx.op("Transpose", [("x", ctx.input(0)), ("perm", perm_tensor)], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("Squeeze")
def lower_squeeze(ctx: NodeLowering) -> None:
    axes = _axes(ctx) or []  # none: every size-1 dimension, in ONNX and GE alike
    rank = _rank(ctx)
    if rank is not None:
        axes = sorted(a % rank for a in axes)
    op = ctx.op("Squeeze", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], {"axis": axes})
    ctx.set_output(0, op.output(0))


@register("Unsqueeze")
def lower_unsqueeze(ctx: NodeLowering) -> None:
    axes = _axes(ctx)
    if not axes:
        raise ctx.error("Unsqueeze needs axes")
    rank = _rank(ctx)
    if rank is not None:
        axes = sorted(a % (rank + len(axes)) for a in axes)
    op = ctx.op("Unsqueeze", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], {"axes": axes})
    ctx.set_output(0, op.output(0))


@register("Concat")
def lower_concat(ctx: NodeLowering) -> None:
    parts = ctx.inputs()
    axis = int(ctx.attr("axis"))
    out_shape = ctx.output_spec(0).shape
    if out_shape is not None:
        axis %= max(len(out_shape), 1)
    dim = ctx.const(np.array(axis, dtype=np.int32), "concat_dim")
    inputs = [(f"x{k}", part) for k, part in enumerate(parts)] + [("concat_dim", dim)]
    op = ctx.op("ConcatV2", inputs, [("y", ctx.output_spec(0))], {"N": len(parts)})
    ctx.set_output(0, op.output(0))


@register("Gather")
def lower_gather(ctx: NodeLowering) -> None:
    axis = int(ctx.attr("axis", 0))
    rank = _rank(ctx)
    if rank is not None:
        axis %= max(rank, 1)
    indices = ctx.constant(1)
    may_be_negative = indices is None or bool((np.asarray(indices) < 0).any())
    op = ctx.op(
        "GatherV2",
        [("x", ctx.input(0)), ("indices", ctx.input(1)), ("axis", ctx.const(np.array(axis, dtype=np.int64), "axis"))],
        [("y", ctx.output_spec(0))],
        {"batch_dims": 0, "negative_index_support": may_be_negative},
    )
    ctx.set_output(0, op.output(0))


@register("Expand")
def lower_expand(ctx: NodeLowering) -> None:
    """``Expand`` → GE ``Expand`` (documented as compatible with the ONNX operator: two-way broadcast)."""
    op = ctx.op("Expand", [("x", ctx.input(0)), ("shape", ctx.input(1))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("Shape")
def lower_shape(ctx: NodeLowering) -> None:
    start, end = int(ctx.attr("start", 0)), ctx.attr("end")
    rank = _rank(ctx)
    whole = start == 0 and (end is None or (rank is not None and int(end) >= rank))
    if not whole:
        value = ctx.graph.constant_value(ctx.node.output[0])
        if value is None:
            raise ctx.error("Shape with start/end on a tensor whose shape is not static")
        ctx.set_output(0, ctx.const(value, "value"))
        return
    op = ctx.op("Shape", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], {"dtype": ge_ir.ONNX_TO_GE_CPP_DTYPE[TensorProto.INT64]})
    ctx.set_output(0, op.output(0))


@register("ConstantOfShape")
def lower_constant_of_shape(ctx: NodeLowering) -> None:
    value = ctx.attr("value")
    value = np.zeros((), dtype=np.float32) if value is None else np.asarray(value).reshape(())
    fill = ctx.const(value, "value")
    op = ctx.op("Fill", [("dims", ctx.input(0)), ("value", fill)], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


def _cast(ctx: NodeLowering, to: int) -> None:
    dst = ge_ir.ge_cpp_dtype(to)
    if dst is None:
        raise ctx.error(f"no GE data type for {dtype_name(to)}")
    out = ctx.output_spec(0)
    spec = out if out.dtype else TensorSpec(out.name, out.shape, to)
    op = ctx.op("Cast", [("x", ctx.input(0))], [("y", spec)], {"dst_type": dst, "truncate": False})
    ctx.set_output(0, op.output(0))


@register("Cast")
def lower_cast(ctx: NodeLowering) -> None:
    _cast(ctx, int(ctx.attr("to")))


@register("CastLike")
def lower_cast_like(ctx: NodeLowering) -> None:
    to = ctx.input_spec(1).dtype
    if not to:
        raise ctx.error(f"the dtype of {ctx.node.input[1]} is unknown")
    _cast(ctx, to)


@register("Constant")
def lower_constant(ctx: NodeLowering) -> None:
    value = ctx.graph.constant_value(ctx.node.output[0])
    if value is None:
        raise ctx.error("Constant without a value attribute sgdfuse can read")
    spec = ctx.output_spec(0)
    tensor = ctx.graph.const(value, ctx.name, onnx_dtype=spec.dtype or None, spec_name=ctx.node.output[0])
    ctx.set_output(0, tensor)
