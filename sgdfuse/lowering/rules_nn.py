"""ONNX → GE rules for neural-network layers: convolution, normalisation, pooling and losses.

GE takes these ops in the NCHW layout with the layout named in ``data_format``; list attributes cover all
four (five) dimensions, ``[1, 1, h, w]`` for ``strides``/``ksize``/``dilations``. ONNX's
``pads = [x1_begin, x2_begin, ..., x1_end, x2_end, ...]`` becomes GE's ``pads = [top, bottom, left, right]``
(``[head, tail, top, bottom, left, right]`` in 3-D): begin and end per axis, interleaved. ``auto_pad`` is
resolved to explicit pads from the static input shape (ONNX's SAME_UPPER/SAME_LOWER formulas), so GE always
gets ``padding_mode="CALCULATED"`` (pooling) or explicit pads (convolution).

Rules that emit several GE ops, and why:

- ``BatchNormalization`` in training mode: reductions and elementwise ops, because GE's ``BatchNorm``
  training outputs follow TensorFlow's fused batch norm (its prototype documents ``batch_variance`` as
  Bessel-corrected) while ONNX updates ``running_var`` with the population variance;
- ``LayerNormalization`` with its ``InvStdDev`` output: GE's ``LayerNorm`` returns the variance, so
  ``Rsqrt(variance + epsilon)`` follows;
- ``MaxPool`` with ``Indices``: GE's argmax pooling ops return Ascend's argmax-mask layout, not ONNX's flat
  NCHW indices, so the indices come from the pooling windows gathered from the (padded) input
  (``GatherV2`` + ``ArgMaxV2``) mapped to flat positions by constant tables; the values come from
  ``MaxPoolV3``;
- ``Col2Im``: a ``Reshape`` to ``Col2im``'s ``[N, C, kh*kw, L]`` input layout first;
- ``NegativeLogLikelihoodLoss``: GE's ``NLLLoss`` takes ``[N, C]`` scores and an INT32 target, so extra
  dimensions are moved behind the batch (``Transpose``/``Reshape``) and the target is cast;
  ``SoftmaxCrossEntropyLoss`` is ONNX's own definition: ``LogSoftmaxV2`` then the same NLL lowering (GE's
  ``SoftmaxCrossEntropyWithLogits`` wants one-hot labels and has no weight or ignore_index).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from sgdfuse.contract import TensorSpec
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.context import NodeLowering
from sgdfuse.lowering.graph_builder import Tensor
from sgdfuse.lowering.registry import register
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__: list[str] = []

_DATA_FORMAT = {4: "NCHW", 5: "NCDHW"}


def _static(ctx: NodeLowering, i: int) -> tuple[int, ...]:
    spec = ctx.input_spec(i)
    if not spec.is_static:
        raise ctx.error(f"the shape of {ctx.node.input[i]} is not static; GE needs it for this node")
    return tuple(int(d) for d in spec.shape)  # type: ignore[union-attr]


def _spec(ctx: NodeLowering, suffix: str, shape: tuple | None, dtype: int) -> TensorSpec:
    return TensorSpec(f"{ctx.name}/{suffix}", None if shape is None else tuple(shape), dtype)


def _window(ctx: NodeLowering, spatial: tuple[int, ...], kernel: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(strides, dilations, pads_begin, pads_end)`` of a convolution/pooling node, ``auto_pad`` resolved."""
    n = len(spatial)
    strides = [int(s) for s in ctx.attr("strides", [1] * n)]
    dilations = [int(d) for d in ctx.attr("dilations", [1] * n)]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        pads = [int(p) for p in ctx.attr("pads", [0] * (2 * n))]
        return strides, dilations, pads[:n], pads[n:]
    if auto_pad == "VALID":
        return strides, dilations, [0] * n, [0] * n
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, large = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else large)
        end.append(large if auto_pad == "SAME_UPPER" else small)
    return strides, dilations, begin, end


def _interleave(begin: list[int], end: list[int]) -> list[int]:
    """ONNX begin/end pads → GE's per-axis ``[begin, end]`` pairs (``[top, bottom, left, right]``)."""
    return [v for pair in zip(begin, end) for v in pair]


# ---- convolution ------------------------------------------------------------------------------------------


@register("Conv")
def lower_conv(ctx: NodeLowering) -> None:
    """``Conv`` (2-D or 3-D) → ``Conv2D``/``Conv3D(x, filter, bias)`` with ``strides``, ``pads``,
    ``dilations``, ``groups``, ``data_format`` NCHW/NCDHW."""
    shape = _static(ctx, 0)
    rank = len(shape)
    if rank not in _DATA_FORMAT:
        raise ctx.error(f"{rank - 2}-D convolution is not lowered (2-D and 3-D are)")
    kernel = list(_static(ctx, 1)[2:])
    strides, dilations, begin, end = _window(ctx, shape[2:], kernel)
    attrs = {
        "strides": [1, 1, *strides],
        "pads": _interleave(begin, end),
        "dilations": [1, 1, *dilations],
        "groups": int(ctx.attr("group", 1)),
        "data_format": _DATA_FORMAT[rank],
        "offset_x": 0,
    }
    op = ctx.op(
        "Conv2D" if rank == 4 else "Conv3D",
        [("x", ctx.input(0)), ("filter", ctx.input(1)), ("bias", ctx.input(2)), ("offset_w", None)],
        [("y", ctx.output_spec(0))],
        attrs,
    )
    ctx.set_output(0, op.output(0))


@register("ConvTranspose")
def lower_conv_transpose(ctx: NodeLowering) -> None:
    """``ConvTranspose`` (2-D) → ``Conv2DTranspose(input_size, x, filter, bias)``: ``input_size`` is the
    output shape (a ``Const``), pads as ONNX resolves them (``output_shape`` given: the total padding split
    per ``auto_pad``), ``output_padding`` as ``[0, 0, h, w]``."""
    shape = _static(ctx, 0)
    if len(shape) != 4:
        raise ctx.error(f"{len(shape) - 2}-D transposed convolution is not lowered (2-D is)")
    out = ctx.output_spec(0)
    if not out.is_static:
        raise ctx.error("the output shape is not static")
    kernel = list(_static(ctx, 1)[2:])
    strides = [int(s) for s in ctx.attr("strides", [1, 1])]
    dilations = [int(d) for d in ctx.attr("dilations", [1, 1])]
    output_padding = [int(p) for p in ctx.attr("output_padding", [0, 0])]
    pads = ctx.attr("pads")
    if pads is not None and ctx.attr("output_shape") is None and ctx.attr("auto_pad", "NOTSET") in ("NOTSET", ""):
        begin, end = [int(p) for p in pads[:2]], [int(p) for p in pads[2:]]
    else:
        begin, end = [], []
        for size, target, k, s, d, extra in zip(shape[2:], out.shape[2:], kernel, strides, dilations, output_padding):  # type: ignore[index]
            total = s * (size - 1) + extra + (k - 1) * d + 1 - int(target)
            upper = ctx.attr("auto_pad", "NOTSET") == "SAME_UPPER"
            begin.append(total // 2 if upper else total - total // 2)
            end.append(total - total // 2 if upper else total // 2)
    attrs = {
        "strides": [1, 1, *strides],
        "pads": _interleave(begin, end),
        "dilations": [1, 1, *dilations],
        "groups": int(ctx.attr("group", 1)),
        "data_format": "NCHW",
        "output_padding": [0, 0, *output_padding],
        "offset_x": 0,
    }
    size = ctx.const(np.array(out.shape, dtype=np.int32), "input_size")
    op = ctx.op(
        "Conv2DTranspose",
        [("input_size", size), ("x", ctx.input(0)), ("filter", ctx.input(1)), ("bias", ctx.input(2)), ("offset_w", None)],
        [("y", out)],
        attrs,
    )
    ctx.set_output(0, op.output(0))


@register("Col2Im")
def lower_col2im(ctx: NodeLowering) -> None:
    """``Col2Im(input [N, C*kh*kw, L], image_shape, block_shape)`` → ``Reshape`` to ``[N, C, kh*kw, L]``,
    then ``Col2im(x, output_size)`` with ``kernel_size``, ``dilation``, ``padding`` ([h, w], the same at
    both ends: asymmetric ONNX pads are refused), ``stride``."""
    image = ctx.constant(1)
    block = ctx.constant(2)
    if image is None or block is None:
        raise ctx.error("image_shape and block_shape must be compile-time constants for GE")
    image, block = [int(v) for v in np.ravel(image)], [int(v) for v in np.ravel(block)]
    if len(block) != 2:
        raise ctx.error(f"{len(block)}-D Col2Im is not lowered (2-D is)")
    n, cols, length = _static(ctx, 0)
    pads = [int(p) for p in ctx.attr("pads", [0, 0, 0, 0])]
    if pads[:2] != pads[2:]:
        raise ctx.error(f"pads {pads} differ at the two ends; GE's Col2im pads both ends alike")
    dtype = ctx.input_spec(0).dtype
    k = block[0] * block[1]
    blocks = ctx.op(
        "Reshape",
        [("x", ctx.input(0)), ("shape", ctx.const(np.array([n, cols // k, k, length], np.int64), "blocks_shape"))],
        [("y", _spec(ctx, "blocks", (n, cols // k, k, length), dtype))],
        {"axis": 0, "num_axes": -1},
        suffix="blocks",
    ).output(0)
    op = ctx.op(
        "Col2im",
        [("x", blocks), ("output_size", ctx.const(np.array(image, np.int32), "output_size"))],
        [("y", ctx.output_spec(0))],
        {
            "kernel_size": block,
            "dilation": [int(d) for d in ctx.attr("dilations", [1, 1])],
            "padding": pads[:2],
            "stride": [int(s) for s in ctx.attr("strides", [1, 1])],
        },
    )
    ctx.set_output(0, op.output(0))


# ---- normalisation ------------------------------------------------------------------------------------------


def _channel_view(ctx: NodeLowering, tensor: Tensor, rank: int, channels: int, suffix: str) -> Tensor:
    """A per-channel ``[C]`` tensor reshaped to ``[1, C, 1, ...]`` to broadcast against NC... data."""
    shape = (1, channels) + (1,) * (rank - 2)
    return ctx.op(
        "Reshape",
        [("x", tensor), ("shape", ctx.const(np.array(shape, np.int64), f"{suffix}_shape"))],
        [("y", _spec(ctx, suffix, shape, tensor.spec.dtype))],
        {"axis": 0, "num_axes": -1},
        suffix=suffix,
    ).output(0)


def _binary(ctx: NodeLowering, ge_type: str, a: Tensor, b: Tensor, spec: TensorSpec, suffix: str | None) -> Tensor:
    return ctx.op(ge_type, [("x1", a), ("x2", b)], [("y", spec)], suffix=suffix).output(0)


@register("BatchNormalization")
def lower_batch_norm(ctx: NodeLowering) -> None:
    """Inference form → GE ``BatchNorm(x, scale, offset, mean, variance)`` with ``is_training=false``,
    ``epsilon``, ``data_format=NCHW`` (other ranks reshaped to ``[N, C, rest, 1]`` and back). Training form
    (``training_mode=1``) → reductions and elementwise ops (module docstring)."""
    if int(ctx.attr("training_mode", 0)):
        _batch_norm_training(ctx)
        return
    shape = _static(ctx, 0)
    dtype = ctx.input_spec(0).dtype
    x = ctx.input(0)
    four_d = (shape[0], shape[1], int(np.prod(shape[2:], dtype=np.int64)), 1)
    if len(shape) != 4:
        x = ctx.op(
            "Reshape", [("x", x), ("shape", ctx.const(np.array(four_d, np.int64), "nchw_shape"))], [("y", _spec(ctx, "nchw", four_d, dtype))], {"axis": 0, "num_axes": -1}, suffix="nchw"
        ).output(0)
    channel = _spec(ctx, "stat", (shape[1],), TensorProto.FLOAT)
    y_spec = ctx.output_spec(0) if len(shape) == 4 else _spec(ctx, "y", four_d, dtype)
    op = ctx.op(
        "BatchNorm",
        [("x", x), ("scale", ctx.input(1)), ("offset", ctx.input(2)), ("mean", ctx.input(3)), ("variance", ctx.input(4))],
        [
            ("y", y_spec),
            ("batch_mean", channel),
            ("batch_variance", channel),
            ("reserve_space_1", channel),
            ("reserve_space_2", channel),
            ("reserve_space_3", _spec(ctx, "reserve_space_3", (1,), TensorProto.FLOAT)),
        ],
        {"epsilon": float(ctx.attr("epsilon", 1e-5)), "data_format": "NCHW", "is_training": False},
        suffix=None if len(shape) == 4 else "nchw_norm",
    )
    y = op.output(0)
    if len(shape) != 4:
        y = ctx.op("Reshape", [("x", y), ("shape", ctx.const(np.array(shape, np.int64), "shape"))], [("y", ctx.output_spec(0))], {"axis": 0, "num_axes": -1}).output(0)
    ctx.set_output(0, y)


def _batch_norm_training(ctx: NodeLowering) -> None:
    shape = _static(ctx, 0)
    rank, channels = len(shape), shape[1]
    dtype = ctx.input_spec(0).dtype
    np_dtype = onnx_to_numpy_dtype(dtype)
    x = ctx.input(0)
    axes = ctx.const(np.array([a for a in range(rank) if a != 1], np.int64), "axes")
    kept = (1, channels) + (1,) * (rank - 2)
    full = _spec(ctx, "centered", shape, dtype)

    def reduce_mean(value: Tensor, suffix: str) -> Tensor:
        return ctx.op("ReduceMean", [("x", value), ("axes", axes)], [("y", _spec(ctx, suffix, kept, dtype))], {"keep_dims": True}, suffix=suffix).output(0)

    mean = reduce_mean(x, "mean")
    centered = _binary(ctx, "Sub", x, mean, full, "centered")
    variance = reduce_mean(_binary(ctx, "Mul", centered, centered, _spec(ctx, "square", shape, dtype), "square"), "variance")
    eps = ctx.const(np.array(ctx.attr("epsilon", 1e-5), np_dtype), "epsilon")
    inv = ctx.op("Rsqrt", [("x", _binary(ctx, "Add", variance, eps, _spec(ctx, "var_eps", kept, dtype), "var_eps"))], [("y", _spec(ctx, "inv_std", kept, dtype))], suffix="inv_std").output(0)
    normed = _binary(ctx, "Mul", centered, inv, _spec(ctx, "normed", shape, dtype), "normed")
    scaled = _binary(ctx, "Mul", normed, _channel_view(ctx, ctx.input(1), rank, channels, "scale"), _spec(ctx, "scaled", shape, dtype), "scaled")  # type: ignore[arg-type]
    y = _binary(ctx, "Add", scaled, _channel_view(ctx, ctx.input(2), rank, channels, "bias"), ctx.output_spec(0), None)  # type: ignore[arg-type]
    ctx.set_output(0, y)
    momentum = float(ctx.attr("momentum", 0.9))
    for k, (batch_stat, label) in enumerate(((mean, "mean"), (variance, "var")), start=1):
        if k >= len(ctx.node.output) or not ctx.node.output[k]:
            continue
        running = ctx.input(2 + k)
        stat_dtype = ctx.input_spec(2 + k).dtype
        flat = ctx.op(
            "Reshape",
            [("x", batch_stat), ("shape", ctx.const(np.array([channels], np.int64), f"{label}_flat_shape"))],
            [("y", _spec(ctx, f"{label}_flat", (channels,), dtype))],
            {"axis": 0, "num_axes": -1},
            suffix=f"{label}_flat",
        ).output(0)
        stat_np = onnx_to_numpy_dtype(stat_dtype)
        old = _binary(ctx, "Mul", running, ctx.const(np.array(momentum, stat_np), f"{label}_momentum"), _spec(ctx, f"{label}_old", (channels,), stat_dtype), f"{label}_old")  # type: ignore[arg-type]
        new = _binary(ctx, "Mul", flat, ctx.const(np.array(1.0 - momentum, np_dtype), f"{label}_rest"), _spec(ctx, f"{label}_new", (channels,), dtype), f"{label}_new")
        ctx.set_output(k, _binary(ctx, "Add", old, new, ctx.output_spec(k), f"running_{label}"))


@register("LayerNormalization")
def lower_layer_norm(ctx: NodeLowering) -> None:
    """``LayerNormalization(X, Scale, B)`` → GE ``LayerNorm(x, gamma, beta)`` with ``begin_norm_axis`` =
    ``begin_params_axis`` = ``axis`` and ``epsilon``; outputs ``y``, ``mean``, ``variance``. An absent ``B``
    is a zero ``Const``; ONNX's ``InvStdDev`` is ``Rsqrt(variance + epsilon)``."""
    shape = ctx.input_spec(0).shape
    if shape is None:
        raise ctx.error("LayerNormalization needs the input rank")
    axis = int(ctx.attr("axis", -1)) % len(shape)
    epsilon = float(ctx.attr("epsilon", 1e-5))
    beta = ctx.input(2)
    if beta is None:
        beta = ctx.const(np.zeros(_static(ctx, 1), onnx_to_numpy_dtype(ctx.input_spec(1).dtype)), "beta")
    stat_shape = tuple(shape[:axis]) + (1,) * (len(shape) - axis)
    stat_dtype = ctx.output_spec(1).dtype if len(ctx.node.output) > 1 and ctx.node.output[1] else TensorProto.FLOAT
    mean_spec = ctx.output_spec(1) if len(ctx.node.output) > 1 and ctx.node.output[1] else _spec(ctx, "mean", stat_shape, stat_dtype)
    op = ctx.op(
        "LayerNorm",
        [("x", ctx.input(0)), ("gamma", ctx.input(1)), ("beta", beta)],
        [("y", ctx.output_spec(0)), ("mean", mean_spec), ("variance", _spec(ctx, "variance", stat_shape, stat_dtype))],
        {"begin_norm_axis": axis, "begin_params_axis": axis, "epsilon": epsilon},
    )
    ctx.set_output(0, op.output(0))
    ctx.set_output(1, op.output(1))
    if len(ctx.node.output) > 2 and ctx.node.output[2]:
        eps = ctx.const(np.array(epsilon, onnx_to_numpy_dtype(stat_dtype)), "epsilon")
        shifted = _binary(ctx, "Add", op.output(2), eps, _spec(ctx, "var_eps", stat_shape, stat_dtype), "var_eps")
        ctx.set_output(2, ctx.op("Rsqrt", [("x", shifted)], [("y", ctx.output_spec(2))], suffix="inv_std_dev").output(0))


# ---- pooling --------------------------------------------------------------------------------------------------


def _pool_window(ctx: NodeLowering) -> tuple[tuple[int, ...], list[int], list[int], list[int], list[int], list[int]]:
    shape = _static(ctx, 0)
    if len(shape) != 4:
        raise ctx.error(f"{len(shape) - 2}-D pooling is not lowered (2-D is)")
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    strides, dilations, begin, end = _window(ctx, shape[2:], kernel)
    return shape, kernel, strides, dilations, begin, end


def _pool_attrs(kernel: list[int], strides: list[int], begin: list[int], end: list[int], ceil_mode: bool) -> dict[str, object]:
    return {
        "ksize": [1, 1, *kernel],
        "strides": [1, 1, *strides],
        "padding_mode": "CALCULATED",
        "pads": _interleave(begin, end),
        "data_format": "NCHW",
        "global_pooling": False,
        "ceil_mode": ceil_mode,
    }


@register("MaxPool")
def lower_max_pool(ctx: NodeLowering) -> None:
    """``MaxPool`` (2-D) → ``MaxPoolV3(x)`` with ``ksize``, ``strides``, ``pads``, ``ceil_mode``; the
    ``Indices`` output, when used, from gathered windows (module docstring)."""
    shape, kernel, strides, dilations, begin, end = _pool_window(ctx)
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    if any(d != 1 for d in dilations):
        raise ctx.error(f"dilations {dilations}: MaxPoolV3 has no dilation")
    op = ctx.op("MaxPoolV3", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], _pool_attrs(kernel, strides, begin, end, ceil_mode))
    ctx.set_output(0, op.output(0))
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        if int(ctx.attr("storage_order", 0)):
            raise ctx.error("storage_order=1 (column-major indices) is not lowered")
        ctx.set_output(1, _max_pool_indices(ctx, shape, kernel, strides, begin, end))


def _max_pool_indices(ctx: NodeLowering, shape: tuple[int, ...], kernel: list[int], strides: list[int], begin: list[int], end: list[int]) -> Tensor:
    n, c, h, w = shape
    out = ctx.output_spec(1)
    if not out.is_static:
        raise ctx.error("the Indices output shape is not static")
    oh, ow = int(out.shape[2]), int(out.shape[3])  # type: ignore[index]
    kh, kw = kernel
    padded_h = max(h + begin[0] + end[0], (oh - 1) * strides[0] + kh)
    padded_w = max(w + begin[1] + end[1], (ow - 1) * strides[1] + kw)
    dtype = ctx.input_spec(0).dtype
    np_dtype = onnx_to_numpy_dtype(dtype)
    x = ctx.input(0)
    if (padded_h, padded_w) != (h, w):
        lowest = np.array(-np.inf if dtype in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE) else np.iinfo(np_dtype).min, np_dtype)
        pads = [0, 0, begin[0], begin[1], 0, 0, padded_h - h - begin[0], padded_w - w - begin[1]]
        x = ctx.op(
            "PadV3",
            [("x", x), ("paddings", ctx.const(np.array(pads, np.int64), "paddings")), ("constant_values", ctx.const(lowest, "lowest"))],
            [("y", _spec(ctx, "padded", (n, c, padded_h, padded_w), dtype))],
            {"mode": "constant", "paddings_contiguous": False},
            suffix="padded",
        ).output(0)
    # Window element k of output (i, j) sits at padded (i*sh + k // kw, j*sw + k % kw).
    rows = (np.arange(oh)[:, None, None] * strides[0] + np.arange(kh)[None, None, :, None]).reshape(oh, 1, kh, 1)
    cols = (np.arange(ow)[None, :, None] * strides[1] + np.arange(kw)[None, None, None, :]).reshape(1, ow, 1, kw)
    window_index = (rows * padded_w + cols).reshape(-1).astype(np.int64)
    flat = ctx.op(
        "Reshape",
        [("x", x), ("shape", ctx.const(np.array([n, c, padded_h * padded_w], np.int64), "flat_shape"))],
        [("y", _spec(ctx, "flat", (n, c, padded_h * padded_w), dtype))],
        {"axis": 0, "num_axes": -1},
        suffix="flat",
    ).output(0)
    windows = ctx.op(
        "GatherV2",
        [("x", flat), ("indices", ctx.const(window_index, "window_index")), ("axis", ctx.const(np.array(2, np.int64), "window_axis"))],
        [("y", _spec(ctx, "windows_flat", (n, c, oh * ow * kh * kw), dtype))],
        {"batch_dims": 0, "negative_index_support": False},
        suffix="windows_flat",
    ).output(0)
    windows = ctx.op(
        "Reshape",
        [("x", windows), ("shape", ctx.const(np.array([n, c, oh * ow, kh * kw], np.int64), "windows_shape"))],
        [("y", _spec(ctx, "windows", (n, c, oh * ow, kh * kw), dtype))],
        {"axis": 0, "num_axes": -1},
        suffix="windows",
    ).output(0)
    first_max = ctx.op(
        "ArgMaxV2",
        [("x", windows), ("dimension", ctx.const(np.array(3, np.int64), "window_dim"))],
        [("y", _spec(ctx, "argmax", (n, c, oh * ow), TensorProto.INT64))],
        {"dtype": ge_ir.ONNX_TO_GE_CPP_DTYPE[TensorProto.INT64]},
        suffix="argmax",
    ).output(0)
    # Offset of window element k from the window's first element, in the unpadded plane; and the flat NCHW
    # index of each window's first element (may lie in the padding: only real elements are ever chosen).
    element_offset = ((np.arange(kh)[:, None] * w) + np.arange(kw)[None, :]).reshape(-1).astype(np.int64)
    offsets = ctx.op(
        "GatherV2",
        [("x", ctx.const(element_offset, "element_offset")), ("indices", first_max), ("axis", ctx.const(np.array(0, np.int64), "offset_axis"))],
        [("y", _spec(ctx, "offsets", (n, c, oh * ow), TensorProto.INT64))],
        {"batch_dims": 0, "negative_index_support": False},
        suffix="offsets",
    ).output(0)
    top = np.arange(oh)[:, None] * strides[0] - begin[0]
    left = np.arange(ow)[None, :] * strides[1] - begin[1]
    plane = (np.arange(n)[:, None, None] * c + np.arange(c)[None, :, None]) * (h * w)
    start = (plane + (top * w + left).reshape(1, 1, -1)).astype(np.int64)
    flat_index = _binary(ctx, "Add", offsets, ctx.const(start, "window_start"), _spec(ctx, "flat_index", (n, c, oh * ow), TensorProto.INT64), "flat_index")
    return ctx.op(
        "Reshape", [("x", flat_index), ("shape", ctx.const(np.array(out.shape, np.int64), "indices_shape"))], [("y", out)], {"axis": 0, "num_axes": -1}, suffix="indices"
    ).output(0)


@register("AveragePool")
def lower_average_pool(ctx: NodeLowering) -> None:
    """``AveragePool`` (2-D) → ``AvgPoolV2(x)``; ``count_include_pad=0`` is ``exclusive=true``."""
    _, kernel, strides, dilations, begin, end = _pool_window(ctx)
    if any(d != 1 for d in dilations):
        raise ctx.error(f"dilations {dilations}: AvgPoolV2 has no dilation")
    attrs = _pool_attrs(kernel, strides, begin, end, bool(ctx.attr("ceil_mode", 0)))
    attrs["exclusive"] = not bool(ctx.attr("count_include_pad", 0))
    attrs["divisor_override"] = 0
    op = ctx.op("AvgPoolV2", [("x", ctx.input(0))], [("y", ctx.output_spec(0))], attrs)
    ctx.set_output(0, op.output(0))


def _global_pool(ge_type: str):
    def rule(ctx: NodeLowering) -> None:
        shape = ctx.input_spec(0).shape
        if shape is None:
            raise ctx.error("global pooling needs the input rank")
        axes = ctx.const(np.arange(2, len(shape), dtype=np.int64), "axes")
        op = ctx.op(ge_type, [("x", ctx.input(0)), ("axes", axes)], [("y", ctx.output_spec(0))], {"keep_dims": True})
        ctx.set_output(0, op.output(0))

    rule.__doc__ = f"Global pooling → ``{ge_type}`` over the spatial axes with ``keep_dims=true`` (the same numbers)."
    return rule


register("GlobalAveragePool")(_global_pool("ReduceMean"))
register("GlobalMaxPool")(_global_pool("ReduceMax"))


# ---- losses ----------------------------------------------------------------------------------------------------


def _nll(ctx: NodeLowering, scores: Tensor, scores_shape: tuple[int, ...], out: TensorSpec) -> Tensor:
    """GE ``NLLLoss`` of ``scores`` ``[N, C, d1...]`` (log-probabilities) against ONNX input 1 (target) and
    input 2 (weight), with ONNX's ``reduction`` and ``ignore_index``."""
    reduction = ctx.attr("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        raise ctx.error(f"reduction {reduction!r} is not an ONNX reduction")
    dtype = scores.spec.dtype
    np_dtype = onnx_to_numpy_dtype(dtype)
    n, classes = scores_shape[0], scores_shape[1]
    rows = int(np.prod([n, *scores_shape[2:]], dtype=np.int64))
    target = ctx.input(1)
    if len(scores_shape) > 2:
        perm = [0, *range(2, len(scores_shape)), 1]
        moved_shape = tuple(scores_shape[a] for a in perm)
        scores = ctx.op(
            "Transpose", [("x", scores), ("perm", ctx.const(np.array(perm, np.int64), "class_last_perm"))], [("y", _spec(ctx, "class_last", moved_shape, dtype))], suffix="class_last"
        ).output(0)
        scores = ctx.op(
            "Reshape", [("x", scores), ("shape", ctx.const(np.array([rows, classes], np.int64), "rows_shape"))], [("y", _spec(ctx, "rows", (rows, classes), dtype))], {"axis": 0, "num_axes": -1}, suffix="rows"
        ).output(0)
        target = ctx.op(
            "Reshape", [("x", target), ("shape", ctx.const(np.array([rows], np.int64), "target_shape"))], [("y", _spec(ctx, "target_rows", (rows,), ctx.input_spec(1).dtype))], {"axis": 0, "num_axes": -1}, suffix="target_rows"
        ).output(0)
    if ctx.input_spec(1).dtype != TensorProto.INT32:
        target = ctx.op(
            "Cast", [("x", target)], [("y", _spec(ctx, "target_int32", (rows,), TensorProto.INT32))], {"dst_type": ge_ir.ONNX_TO_GE_CPP_DTYPE[TensorProto.INT32], "truncate": False}, suffix="target_int32"
        ).output(0)
    weight = ctx.input(2) if ctx.has_input(2) else ctx.const(np.ones(classes, np_dtype), "weight")
    loss_shape = (rows,) if reduction == "none" else ()
    loss_spec = out if loss_shape == out.shape else _spec(ctx, "loss_rows", loss_shape, dtype)
    op = ctx.op(
        "NLLLoss",
        [("x", scores), ("target", target), ("weight", weight)],
        [("y", loss_spec), ("total_weight", _spec(ctx, "total_weight", (), dtype))],
        {"reduction": reduction, "ignore_index": int(ctx.attr("ignore_index", -100))},
        suffix="nll" if loss_spec is not out else None,
    )
    loss = op.output(0)
    if loss_spec is not out:
        loss = ctx.op("Reshape", [("x", loss), ("shape", ctx.const(np.array(out.shape, np.int64), "loss_shape"))], [("y", out)], {"axis": 0, "num_axes": -1}).output(0)
    return loss


@register("NegativeLogLikelihoodLoss")
def lower_nll_loss(ctx: NodeLowering) -> None:
    """``NegativeLogLikelihoodLoss(input, target, weight)`` → GE ``NLLLoss(x, target, weight)`` with
    ``reduction`` and ``ignore_index`` (module docstring for the reshapes and the INT32 target)."""
    ctx.set_output(0, _nll(ctx, ctx.input(0), _static(ctx, 0), ctx.output_spec(0)))  # type: ignore[arg-type]


@register("SoftmaxCrossEntropyLoss")
def lower_softmax_cross_entropy(ctx: NodeLowering) -> None:
    """``SoftmaxCrossEntropyLoss(scores, labels, weights)`` → ``LogSoftmaxV2`` over axis 1, then the
    ``NegativeLogLikelihoodLoss`` lowering (ONNX defines the op as exactly that composition); the optional
    ``log_prob`` output is the ``LogSoftmaxV2`` result."""
    shape = _static(ctx, 0)
    wants_log_prob = len(ctx.node.output) > 1 and bool(ctx.node.output[1])
    log_prob_spec = ctx.output_spec(1) if wants_log_prob else _spec(ctx, "log_prob", shape, ctx.input_spec(0).dtype)
    log_prob = ctx.op("LogSoftmaxV2", [("logits", ctx.input(0))], [("logsoftmax", log_prob_spec)], {"axes": [1]}, suffix="log_prob").output(0)
    ctx.set_output(0, _nll(ctx, log_prob, shape, ctx.output_spec(0)))
    if wants_log_prob:
        ctx.set_output(1, log_prob)
