"""ONNX → GE rules for matrix products, reductions and softmax.

- ``MatMul`` → ``MatMulV2`` (both operands rank 2) or ``BatchMatMulV2`` (numpy-style batch broadcasting);
  a rank-1 operand is made a matrix with ``Unsqueeze`` and the added axis is removed after, as ONNX (numpy)
  defines it.
- ``Gemm(A, B, C)`` = ``alpha * op(A) @ op(B) + beta * C`` → ``MatMulV2`` (``transpose_x1/x2`` from
  ``transA/transB``), then ``Mul`` by ``alpha`` and ``Add`` of ``beta * C`` only when they change anything.
  Three ops round three times where ORT's GEMM may round once; the executor comparison bounds that.
- ``ReduceSum``/``ReduceMean``/``ReduceMax``/``ReduceMin``/``ReduceProd`` → the GE op of the same name
  with the axes as a ``Const`` input and ``keep_dims``. ONNX's "no axes" means "all axes" unless
  ``noop_with_empty_axes``; GE's empty axes mean no reduction, so the rule always writes the axes out
  (which needs the input rank). ``ReduceL2`` is composed (square, ``ReduceSum``, ``Sqrt``), ``ReduceSumSquare``
  likewise without the root.
- ``Softmax``/``LogSoftmax`` (opset >= 13: one axis) → ``SoftmaxV2``/``LogSoftmaxV2`` with ``axes``.
"""

from __future__ import annotations

import numpy as np

from sgdfuse.contract import TensorSpec
from sgdfuse.lowering.context import NodeLowering
from sgdfuse.lowering.graph_builder import Tensor
from sgdfuse.lowering.registry import Rule, register
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = ["reduce_axes"]


def _rank(ctx: NodeLowering, i: int, what: str) -> int:
    shape = ctx.input_spec(i).shape
    if shape is None:
        raise ctx.error(f"the rank of {what} ({ctx.node.input[i]}) is unknown; lowering needs it")
    return len(shape)


def _with_dims(spec: TensorSpec, name: str, shape: tuple | None) -> TensorSpec:
    return TensorSpec(name, shape, spec.dtype)


@register("MatMul")
def lower_matmul(ctx: NodeLowering) -> None:
    a, b = ctx.input(0), ctx.input(1)
    rank_a, rank_b = _rank(ctx, 0, "A"), _rank(ctx, 1, "B")
    out = ctx.output_spec(0)
    product_shape = list(out.shape) if out.shape is not None else None
    if rank_a == 1:
        shape = (1,) + tuple(ctx.input_spec(0).shape)
        a = ctx.op("Unsqueeze", [("x", a)], [("y", _with_dims(a.spec, f"{ctx.name}/a_2d", shape))], {"axes": [0]}, suffix="a_2d").output(0)
        if product_shape is not None:
            product_shape.insert(len(product_shape) - (0 if rank_b == 1 else 1), 1)
    if rank_b == 1:
        shape = tuple(ctx.input_spec(1).shape) + (1,)
        b = ctx.op("Unsqueeze", [("x", b)], [("y", _with_dims(b.spec, f"{ctx.name}/b_2d", shape))], {"axes": [1]}, suffix="b_2d").output(0)
        if product_shape is not None:
            product_shape.append(1)
    squeezed = [axis for axis, flag in ((-2, rank_a == 1), (-1, rank_b == 1)) if flag]
    ge_type = "MatMulV2" if max(rank_a, rank_b, 2) == 2 else "BatchMatMulV2"
    attrs: dict[str, object] = (
        {"transpose_x1": False, "transpose_x2": False, "offset_x": 0}
        if ge_type == "MatMulV2"
        else {"adj_x1": False, "adj_x2": False, "offset_x": 0}
    )
    spec = out if not squeezed else _with_dims(out, f"{ctx.name}/product", tuple(product_shape) if product_shape else None)
    product = ctx.op(ge_type, [("x1", a), ("x2", b)], [("y", spec)], attrs, suffix="product" if squeezed else None).output(0)
    if squeezed:
        rank = len(product_shape) if product_shape is not None else max(rank_a, rank_b, 2)
        axes = sorted(axis % rank for axis in squeezed)
        product = ctx.op("Squeeze", [("x", product)], [("y", out)], {"axis": axes}).output(0)
    ctx.set_output(0, product)


@register("Gemm")
def lower_gemm(ctx: NodeLowering) -> None:
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    out = ctx.output_spec(0)
    has_c = ctx.has_input(2) and beta != 0.0
    steps = [name for name, needed in (("scaled", alpha != 1.0), ("biased", has_c)) if needed]
    last = steps[-1] if steps else None

    def spec_for(step: str) -> TensorSpec:
        return out if step == last else _with_dims(out, f"{ctx.name}/{step}", out.shape)

    product = ctx.op(
        "MatMulV2",
        [("x1", ctx.input(0)), ("x2", ctx.input(1))],
        [("y", spec_for("product"))],
        {"transpose_x1": bool(ctx.attr("transA", 0)), "transpose_x2": bool(ctx.attr("transB", 0)), "offset_x": 0},
        suffix=None if last is None else "product",
    ).output(0)
    if alpha != 1.0:
        scale = ctx.const(np.array(alpha, dtype=_numpy(out)), "alpha")
        product = ctx.op("Mul", [("x1", product), ("x2", scale)], [("y", spec_for("scaled"))], suffix=None if last == "scaled" else "scaled").output(0)
    if has_c:
        bias: Tensor = ctx.input(2)  # type: ignore[assignment]
        if beta != 1.0:
            factor = ctx.const(np.array(beta, dtype=_numpy(out)), "beta")
            bias = ctx.op("Mul", [("x1", bias), ("x2", factor)], [("y", _with_dims(bias.spec, f"{ctx.name}/beta_c", bias.spec.shape))], suffix="beta_c").output(0)
        product = ctx.op("Add", [("x1", product), ("x2", bias)], [("y", out)]).output(0)
    ctx.set_output(0, product)


def _numpy(spec: TensorSpec) -> np.dtype:
    return onnx_to_numpy_dtype(spec.dtype)


def reduce_axes(ctx: NodeLowering) -> list[int] | None:
    """The axes an ONNX ``Reduce*`` node reduces, written out and non-negative; None for
    ``noop_with_empty_axes`` with no axes (the node is an identity).

    ONNX's "no axes" means "all axes" unless ``noop_with_empty_axes``; GE's empty axes mean no reduction, so
    the axes are always written out (which needs the input rank).

    Raises:
        LoweringError: the axes are a run-time input, or all axes are meant and the rank is unknown.
    """
    axes = ctx.attr("axes")
    if axes is None and ctx.has_input(1):
        value = ctx.constant(1)
        if value is None:
            raise ctx.error("the axes input must be a compile-time constant (GE reads empty axes differently)")
        axes = [int(a) for a in np.ravel(value)]
    shape = ctx.input_spec(0).shape
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return None
        return list(range(_rank(ctx, 0, "the input")))
    if shape is not None:
        return [a % len(shape) if len(shape) else a for a in axes]
    return [int(a) for a in axes]


def _reduce(ge_type: str) -> Rule:
    def rule(ctx: NodeLowering) -> None:
        axes = reduce_axes(ctx)
        if axes is None:
            op = ctx.op("Identity", [("x", ctx.input(0))], [("y", ctx.output_spec(0))])
            ctx.set_output(0, op.output(0))
            return
        axes_tensor = ctx.const(np.array(axes, dtype=np.int64), "axes")
        op = ctx.op(ge_type, [("x", ctx.input(0)), ("axes", axes_tensor)], [("y", ctx.output_spec(0))], {"keep_dims": bool(ctx.attr("keepdims", 1))})
        ctx.set_output(0, op.output(0))

    rule.__name__ = f"lower_{ge_type}"
    return rule


register("ReduceSum")(_reduce("ReduceSum"))
register("ReduceMean")(_reduce("ReduceMean"))
register("ReduceMax")(_reduce("ReduceMax"))
register("ReduceMin")(_reduce("ReduceMin"))
register("ReduceProd")(_reduce("ReduceProd"))


def _summed_square(ctx: NodeLowering, *, last: bool) -> tuple[Tensor, TensorSpec]:
    """``sum(x²)`` over the node's axes as ``Mul(x, x)`` then ``ReduceSum`` (the square alone when the node
    reduces nothing), and the node's output spec; with ``last`` the final op writes that spec (the node's
    output), else one of its own."""
    x = ctx.input(0)
    out = ctx.output_spec(0)
    axes = reduce_axes(ctx)
    square_spec = out if last and axes is None else _with_dims(out, f"{ctx.name}/square", ctx.input_spec(0).shape)
    square = ctx.op("Mul", [("x1", x), ("x2", x)], [("y", square_spec)], suffix="square").output(0)
    if axes is None:
        return square, out
    axes_tensor = ctx.const(np.array(axes, dtype=np.int64), "axes")
    total = ctx.op(
        "ReduceSum", [("x", square), ("axes", axes_tensor)], [("y", out if last else _with_dims(out, f"{ctx.name}/sum", out.shape))],
        {"keep_dims": bool(ctx.attr("keepdims", 1))}, suffix="sum",
    ).output(0)
    return total, out


@register("ReduceL2")
def lower_reduce_l2(ctx: NodeLowering) -> None:
    """``ReduceL2`` = sqrt(sum(x²)) → ``Mul(x, x)``, ``ReduceSum``, ``Sqrt``: three ops because GE's
    ``LpNorm`` carries an ``epsilon`` whose effect the public prototype does not state; ONNX's definition
    composed from exact pieces rounds as onnxruntime's kernel does (square, sum, root)."""
    total, out = _summed_square(ctx, last=False)
    op = ctx.op("Sqrt", [("x", total)], [("y", out)])
    ctx.set_output(0, op.output(0))


@register("ReduceSumSquare")
def lower_reduce_sum_square(ctx: NodeLowering) -> None:
    """``ReduceSumSquare`` = sum(x²) (ONNX operator definition) → ``Mul(x, x)``, ``ReduceSum``: the squared
    norm a training step logs or clips by, composed as ``ReduceL2`` is, without its root."""
    total, _ = _summed_square(ctx, last=True)
    ctx.set_output(0, total)


def _softmax(ge_type: str, in_port: str, out_port: str) -> Rule:
    def rule(ctx: NodeLowering) -> None:
        rank = _rank(ctx, 0, "the input")
        axis = int(ctx.attr("axis", -1 if ctx.opset >= 13 else 1)) % max(rank, 1)
        if ctx.opset < 13 and axis != rank - 1:
            raise ctx.error(f"opset {ctx.opset} softmax flattens from axis {axis}; only the last axis maps to GE")
        op = ctx.op(ge_type, [(in_port, ctx.input(0))], [(out_port, ctx.output_spec(0))], {"axes": [axis]})
        ctx.set_output(0, op.output(0))

    rule.__name__ = f"lower_{ge_type}"
    return rule


register("Softmax")(_softmax("SoftmaxV2", "x", "y"))
register("LogSoftmax")(_softmax("LogSoftmaxV2", "logits", "logsoftmax"))
