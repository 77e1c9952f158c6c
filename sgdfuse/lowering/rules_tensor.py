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
from sgdfuse.runtime import onnx_to_numpy_dtype

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
    """``Shape`` → GE ``Shape`` (INT64). With ``start``/``end`` (opset 15) on a static shape, the constant
    slice; on a dynamic one of known rank, ``Shape`` then ``StridedSliceV2`` of the bounds ONNX defines
    (negative ones count from the rank, then clamped to [0, rank])."""
    start, end = int(ctx.attr("start", 0)), ctx.attr("end")
    rank = _rank(ctx)
    whole = start == 0 and (end is None or (rank is not None and int(end) >= rank))
    int64 = {"dtype": ge_ir.ONNX_TO_GE_CPP_DTYPE[TensorProto.INT64]}
    if not whole:
        value = ctx.graph.constant_value(ctx.node.output[0])
        if value is not None:
            ctx.set_output(0, ctx.const(value, "value"))
            return
        if rank is None:
            raise ctx.error("Shape with start/end on a tensor of unknown rank")
        begin, stop = (max(0, min(rank, b + rank if b < 0 else b)) for b in (start, rank if end is None else int(end)))
        full = ctx.op("Shape", [("x", ctx.input(0))], [("y", TensorSpec(f"{ctx.name}/full", (rank,), TensorProto.INT64))], int64)
        inputs = [
            ("x", full.output(0)),
            ("begin", ctx.const(np.array([begin], np.int64), "begin")),
            ("end", ctx.const(np.array([max(begin, stop)], np.int64), "end")),
            ("axes", ctx.const(np.array([0], np.int64), "axes")),
            ("strides", ctx.const(np.array([1], np.int64), "strides")),
        ]
        attrs = {"begin_mask": 0, "end_mask": 0, "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0}
        op = ctx.op("StridedSliceV2", inputs, [("y", ctx.output_spec(0))], attrs)
        ctx.set_output(0, op.output(0))
        return
    op = ctx.op("Shape", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], int64)
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


# ---- padding, slicing, splitting --------------------------------------------------------------------------


def _constant(ctx: NodeLowering, i: int, what: str) -> np.ndarray:
    value = ctx.constant(i)
    if value is None:
        raise ctx.error(f"{what} ({ctx.node.input[i]}) must be a compile-time constant for GE")
    return np.asarray(value)


@register("Pad")
def lower_pad(ctx: NodeLowering) -> None:
    """``Pad`` → ``PadV3(x, paddings, constant_values)`` with ``paddings_contiguous=false``: GE then reads
    ``paddings`` as ``[begin0, begin1, ..., end0, end1, ...]``, which is ONNX's ``pads`` layout. ONNX's
    ``axes`` input (opset 18) is written out to every axis; ``mode`` ``constant``/``reflect``/``edge`` keep
    their names (``wrap`` has no GE counterpart in PadV3's documented modes and is refused)."""
    mode = ctx.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise ctx.error(f"mode {mode!r} has no PadV3 counterpart (constant, reflect, edge)")
    if ctx.opset < 11:
        pads = np.array(ctx.attr("pads"), dtype=np.int64)
        value = ctx.const(np.array(ctx.attr("value", 0.0), dtype=onnx_to_numpy_dtype(ctx.input_spec(0).dtype)), "constant_values")
    else:
        pads = _constant(ctx, 1, "pads")
        value = ctx.input(2) if ctx.has_input(2) else None
    rank = _rank(ctx)
    if ctx.has_input(3):
        if rank is None:
            raise ctx.error("Pad with axes needs the input rank")
        axes = [int(a) % rank for a in _constant(ctx, 3, "axes")]
        full = np.zeros(2 * rank, dtype=np.int64)
        for k, axis in enumerate(axes):
            full[axis], full[rank + axis] = pads[k], pads[len(axes) + k]
        pads = full
    if (np.asarray(pads) < 0).any():
        raise ctx.error(f"negative pads {list(np.ravel(pads))} (cropping) are not lowered; PadV3 pads only")
    paddings = ctx.const(np.asarray(pads, dtype=np.int64).reshape(-1), "paddings")
    op = ctx.op(
        "PadV3",
        [("x", ctx.input(0)), ("paddings", paddings), ("constant_values", value)],
        [("y", ctx.output_spec(0))],
        {"mode": mode, "paddings_contiguous": False},
    )
    ctx.set_output(0, op.output(0))


@register("Slice")
def lower_slice(ctx: NodeLowering) -> None:
    """``Slice`` → ``StridedSliceV2(x, begin, end, axes, strides)`` (all masks 0). With a static input
    shape and constant operands the rule clamps ``starts``/``ends`` into range as ONNX defines (INT64_MAX
    and negative values), so GE sees plain indices; otherwise the operands are passed as they are."""
    if ctx.opset < 10:
        starts, ends, axes = (np.array(ctx.attr(k), dtype=np.int64) if ctx.attr(k) is not None else None for k in ("starts", "ends", "axes"))
        steps = None
    else:
        starts, ends = ctx.constant(1), ctx.constant(2)
        axes = ctx.constant(3) if ctx.has_input(3) else None
        steps = ctx.constant(4) if ctx.has_input(4) else None
    shape = ctx.input_spec(0).shape
    runtime = starts is None or ends is None or (ctx.has_input(3) and axes is None) or (ctx.has_input(4) and steps is None)
    if runtime or shape is None or not ctx.input_spec(0).is_static:
        inputs = [("x", ctx.input(0)), ("begin", ctx.input(1)), ("end", ctx.input(2)), ("axes", ctx.input(3)), ("strides", ctx.input(4))]
    else:
        rank = len(shape)
        starts, ends = np.ravel(starts).astype(np.int64), np.ravel(ends).astype(np.int64)
        axes = np.arange(len(starts)) if axes is None else np.ravel(axes).astype(np.int64) % rank
        steps = np.ones(len(starts), np.int64) if steps is None else np.ravel(steps).astype(np.int64)
        begin, end = [], []
        for start, stop, axis, step in zip(starts, ends, axes, steps):
            b, e, _ = slice(int(start), int(stop), int(step)).indices(int(shape[axis]))
            if step < 0 and e < 0:
                e = -int(shape[axis]) - 1  # "before index 0": -1 would mean the last element
            begin.append(b)
            end.append(e)
        inputs = [
            ("x", ctx.input(0)),
            ("begin", ctx.const(np.array(begin, np.int64), "begin")),
            ("end", ctx.const(np.array(end, np.int64), "end")),
            ("axes", ctx.const(np.array(axes, np.int64), "axes")),
            ("strides", ctx.const(np.array(steps, np.int64), "strides")),
        ]
    attrs = {"begin_mask": 0, "end_mask": 0, "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0}
    op = ctx.op("StridedSliceV2", inputs, [("y", ctx.output_spec(0))], attrs)
    ctx.set_output(0, op.output(0))


@register("Split")
def lower_split(ctx: NodeLowering) -> None:
    """``Split`` → ``SplitV(x, size_splits, split_dim)`` with ``num_split`` outputs ``y0, y1, ...``. Sizes
    come from the ``split`` input/attribute, or (``num_outputs``, opset 18, or neither) from ONNX's rule:
    equal parts of ``ceil(dim / n)``, the last one smaller."""
    shape = ctx.input_spec(0).shape
    if shape is None:
        raise ctx.error("Split needs the input rank")
    axis = int(ctx.attr("axis", 0)) % len(shape)
    count = len(ctx.node.output)
    sizes = ctx.attr("split")
    if sizes is None and ctx.has_input(1):
        sizes = _constant(ctx, 1, "split")
    if sizes is None:
        dim = shape[axis]
        if not isinstance(dim, int):
            raise ctx.error(f"split axis {axis} has no static size")
        part = -(-dim // count)
        sizes = [part] * (count - 1) + [dim - part * (count - 1)]
    sizes = [int(s) for s in np.ravel(sizes)]
    op = ctx.op(
        "SplitV",
        [("x", ctx.input(0)), ("size_splits", ctx.const(np.array(sizes, np.int64), "size_splits")), ("split_dim", ctx.const(np.array(axis, np.int32), "split_dim"))],
        [(f"y{k}", ctx.output_spec(k) if ctx.node.output[k] else TensorSpec(f"{ctx.name}/y{k}", None, ctx.input_spec(0).dtype)) for k in range(count)],
        {"num_split": count},
    )
    for k in range(count):
        ctx.set_output(k, op.output(k))


# ---- gathers and scatters ------------------------------------------------------------------------------------


def _axis(ctx: NodeLowering, attribute: str = "axis", default: int = 0) -> int:
    axis = int(ctx.attr(attribute, default))
    rank = _rank(ctx)
    return axis % rank if rank else axis


@register("GatherElements")
def lower_gather_elements(ctx: NodeLowering) -> None:
    """``GatherElements(data, indices)`` → ``GatherElements(x, index)`` with ``dim`` = ONNX ``axis``."""
    op = ctx.op("GatherElements", [("x", ctx.input(0)), ("index", ctx.input(1))], [("y", ctx.output_spec(0))], {"dim": _axis(ctx)})
    ctx.set_output(0, op.output(0))


@register("GatherND")
def lower_gather_nd(ctx: NodeLowering) -> None:
    """``GatherND(data, indices)`` with ``batch_dims=0`` → ``GatherNd(x, indices)`` (the TensorFlow
    semantics, which equal ONNX's without batch dimensions)."""
    if int(ctx.attr("batch_dims", 0)):
        raise ctx.error("batch_dims != 0 has no GatherNd counterpart")
    op = ctx.op("GatherNd", [("x", ctx.input(0)), ("indices", ctx.input(1))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("ScatterElements")
def lower_scatter_elements(ctx: NodeLowering) -> None:
    """``ScatterElements(data, indices, updates)`` → ``ScatterElements(data, indices, updates)`` with
    ``axis`` and ``reduction`` (``none``, ``add``, ``mul``; ``min``/``max`` are refused)."""
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add", "mul"):
        raise ctx.error(f"reduction {reduction!r} is not lowered (none, add, mul)")
    op = ctx.op(
        "ScatterElements",
        [("data", ctx.input(0)), ("indices", ctx.input(1)), ("updates", ctx.input(2))],
        [("y", ctx.output_spec(0))],
        {"axis": _axis(ctx), "reduction": reduction},
    )
    ctx.set_output(0, op.output(0))


@register("ScatterND")
def lower_scatter_nd(ctx: NodeLowering) -> None:
    """``ScatterND(data, indices, updates)`` → ``TensorScatterUpdate`` (``reduction=none``) or
    ``TensorScatterAdd`` (``add``): TensorFlow's out-of-place scatters into a copy of ``x``, which is ONNX's
    meaning (GE's ``ScatterNdUpdate`` would write its input in place)."""
    reduction = ctx.attr("reduction", "none")
    ge_type = {"none": "TensorScatterUpdate", "add": "TensorScatterAdd"}.get(reduction)
    if ge_type is None:
        raise ctx.error(f"reduction {reduction!r} is not lowered (none, add)")
    op = ctx.op(ge_type, [("x", ctx.input(0)), ("indices", ctx.input(1)), ("updates", ctx.input(2))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


# ---- creation and repetition ---------------------------------------------------------------------------------


@register("Tile")
def lower_tile(ctx: NodeLowering) -> None:
    """``Tile(input, repeats)`` → ``Tile(x, multiples)``."""
    op = ctx.op("Tile", [("x", ctx.input(0)), ("multiples", ctx.input(1))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("Range")
def lower_range(ctx: NodeLowering) -> None:
    """``Range(start, limit, delta)`` → ``Range(start, limit, delta)``."""
    op = ctx.op("Range", [("start", ctx.input(0)), ("limit", ctx.input(1)), ("delta", ctx.input(2))], [("y", ctx.output_spec(0))])
    ctx.set_output(0, op.output(0))


@register("CumSum")
def lower_cumsum(ctx: NodeLowering) -> None:
    """``CumSum(x, axis)`` → ``Cumsum(x, axis)`` with ``exclusive`` and ``reverse`` as bools."""
    op = ctx.op(
        "Cumsum",
        [("x", ctx.input(0)), ("axis", ctx.input(1))],
        [("y", ctx.output_spec(0))],
        {"exclusive": bool(ctx.attr("exclusive", 0)), "reverse": bool(ctx.attr("reverse", 0))},
    )
    ctx.set_output(0, op.output(0))


@register("Trilu")
def lower_trilu(ctx: NodeLowering) -> None:
    """``Trilu(x, k)`` → ``Triu`` (``upper=1``) or ``Tril`` with ``diagonal`` = ``k`` (a constant)."""
    k = int(np.ravel(_constant(ctx, 1, "k"))[0]) if ctx.has_input(1) else 0
    ge_type = "Triu" if int(ctx.attr("upper", 1)) else "Tril"
    op = ctx.op(ge_type, [("x", ctx.input(0))], [("y", ctx.output_spec(0))], {"diagonal": k})
    ctx.set_output(0, op.output(0))
