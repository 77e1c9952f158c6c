"""numpy kernels of the executor (:mod:`sgdfuse.lowering.executor`) for the GE ops of the layer, indexing
and activation rules (:mod:`.rules_nn`, and the newer rules of :mod:`.rules_tensor`,
:mod:`.rules_elementwise`, :mod:`.rules_linalg`).

Each kernel transcribes the GE prototype's documented meaning for the attribute values the rules emit
(NCHW layouts, ``padding_mode="CALCULATED"``, ``paddings_contiguous=false``...). As in the executor,
FLOAT16/BFLOAT16 inputs are computed in FLOAT and rounded once; sums over windows (convolution, pooling)
accumulate in FLOAT64 and round once, a reference rather than a model of a device's summation order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.executor import ExecutorError, GraphContradictionError, Op, kernel
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__: list[str] = []

_SMALL = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_CPP_TO_ONNX = {cpp: onnx for onnx, cpp in ge_ir.ONNX_TO_GE_CPP_DTYPE.items()}


def _wide(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype in _SMALL else a


def _out(op: Op, value: np.ndarray, index: int = 0) -> np.ndarray:
    dtype = op.output_dtypes[index] if index < len(op.output_dtypes) else None
    value = np.asarray(value)
    return value.astype(dtype) if dtype is not None and value.dtype != dtype else value


def _unary(function: Callable[[np.ndarray], np.ndarray]) -> Callable[[Op, list], list]:
    def run(op: Op, inputs: list) -> list:
        with np.errstate(all="ignore"):
            return [_out(op, function(_wide(inputs[0])))]

    return run


_erf = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise (``math.erf``), in ``x``'s dtype."""
    x = np.asarray(x)
    return np.asarray(_erf(x.astype(np.float64)), dtype=np.float64).astype(x.dtype)


_GELU_TWO_OVER_PI = np.float32(0.63661975)
_GELU_C0 = np.float32(0.044715)
"""The constants of ONNX's ``Gelu`` (opset 20) ``approximate="tanh"`` function body: FLOAT ``Constant``s that
the body ``CastLike``s to the input's dtype, then ``Sqrt(TwoOverPi)``. onnxruntime 1.32 has no DOUBLE ``Gelu``
kernel and runs that body, so in a lifted DOUBLE run its ``sqrt(2/pi)`` and ``0.044715`` are these FLOAT values
widened: the exact DOUBLE constants differed from it by ~2.5e-9 of ``|x| + 1``, above DOUBLE's tolerance."""


def _gelu(op: Op, inputs: list) -> list:
    x = _wide(inputs[0])
    if op.attrs.get("approximate", "none") == "tanh":
        inner = np.sqrt(_GELU_TWO_OVER_PI.astype(x.dtype)) * (x + _GELU_C0.astype(x.dtype) * x * x * x)
        return [_out(op, np.asarray(0.5, x.dtype) * x * (1 + np.tanh(inner)))]
    return [_out(op, np.asarray(0.5, x.dtype) * x * (1 + erf(x / np.sqrt(np.asarray(2.0, x.dtype)))))]


kernel("Erf")(_unary(erf))
kernel("Floor")(_unary(np.floor))
kernel("Ceil")(_unary(np.ceil))
kernel("Rsqrt")(_unary(lambda x: 1 / np.sqrt(x)))
kernel("GeluV2")(_gelu)


@kernel("FloorMod")
def _floor_mod(op: Op, inputs: list) -> list:
    with np.errstate(all="ignore"):
        return [_out(op, np.mod(_wide(inputs[0]), _wide(inputs[1])))]


@kernel("Mod")
def _mod(op: Op, inputs: list) -> list:
    with np.errstate(all="ignore"):
        return [_out(op, np.fmod(_wide(inputs[0]), _wide(inputs[1])))]


@kernel("ClipByValue")
def _clip(op: Op, inputs: list) -> list:
    x, low, high = (_wide(a) for a in inputs)
    return [_out(op, np.minimum(np.maximum(x, low), high))]


def _reduce(function: Callable[..., np.ndarray]) -> Callable[[Op, list], list]:
    def run(op: Op, inputs: list) -> list:
        x, axes = inputs
        axes = tuple(int(a) for a in np.ravel(axes))
        if not axes:
            return [np.array(x, copy=True)]
        return [_out(op, function(_wide(x), axis=axes, keepdims=bool(op.attrs.get("keep_dims", False))))]

    return run


kernel("ReduceMax")(_reduce(np.max))
kernel("ReduceMin")(_reduce(np.min))
kernel("ReduceProd")(_reduce(np.prod))


@kernel("ArgMaxV2")
def _arg_max(op: Op, inputs: list) -> list:
    x, dimension = inputs
    dtype = onnx_to_numpy_dtype(_CPP_TO_ONNX[int(op.attrs.get("dtype", 3))])
    return [np.argmax(_wide(x), axis=int(np.asarray(dimension))).astype(dtype)]


# ---- shape and indexing -----------------------------------------------------------------------------------


@kernel("PadV3")
def _pad(op: Op, inputs: list) -> list:
    x, paddings = inputs[0], np.ravel(inputs[1]).astype(np.int64)
    value = inputs[2] if len(inputs) > 2 and inputs[2] is not None else np.zeros((), x.dtype)
    rank = x.ndim
    if op.attrs.get("paddings_contiguous", True):
        widths = [(int(paddings[2 * a]), int(paddings[2 * a + 1])) for a in range(rank)]
    else:
        widths = [(int(paddings[a]), int(paddings[rank + a])) for a in range(rank)]
    mode = op.attrs.get("mode", "constant")
    if mode == "constant":
        return [np.pad(x, widths, mode="constant", constant_values=np.asarray(value).reshape(()).astype(x.dtype))]
    return [np.pad(x, widths, mode={"reflect": "reflect", "edge": "edge"}[mode])]


@kernel("StridedSliceV2")
def _strided_slice(op: Op, inputs: list) -> list:
    # ONNX Slice semantics (the op is documented as compatible with it): negative starts/ends count from
    # the end, then both are clamped into range (for negative steps, ends into [-1, dim - 1], -1 = before 0).
    x, begin, end = inputs[0], np.ravel(inputs[1]), np.ravel(inputs[2])
    axes = np.ravel(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else np.arange(len(begin))
    strides = np.ravel(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else np.ones(len(begin), np.int64)
    index = [slice(None)] * x.ndim
    for start, stop, axis, step in zip(begin, end, axes, strides):
        axis, dim, start, stop, step = int(axis) % x.ndim, x.shape[int(axis) % x.ndim], int(start), int(stop), int(step)
        start += dim if start < 0 else 0
        stop += dim if stop < 0 else 0
        if step > 0:
            start, stop = min(max(start, 0), dim), min(max(stop, 0), dim)
            index[axis] = slice(start, stop, step)
        else:
            start, stop = min(max(start, 0), dim - 1), min(max(stop, -1), dim - 1)
            index[axis] = slice(start, None if stop == -1 else stop, step)
    return [np.array(x[tuple(index)], copy=True)]


@kernel("SplitV")
def _split(op: Op, inputs: list) -> list:
    x, sizes, axis = inputs
    if "num_split" in op.attrs and int(op.attrs["num_split"]) != np.size(sizes):
        raise GraphContradictionError(f"op {op.name} (SplitV): num_split {op.attrs['num_split']} for {np.size(sizes)} sizes")
    cuts = np.cumsum(np.ravel(sizes).astype(np.int64))[:-1]
    return [np.array(part, copy=True) for part in np.split(x, cuts, axis=int(np.asarray(axis)))]


def _positive(indices: np.ndarray, dim: int) -> np.ndarray:
    indices = np.asarray(indices).astype(np.int64)
    return np.where(indices < 0, indices + dim, indices)


@kernel("GatherElements")
def _gather_elements(op: Op, inputs: list) -> list:
    x, index = inputs
    axis = int(op.attrs.get("dim", 0))
    return [np.take_along_axis(x, _positive(index, x.shape[axis]), axis=axis)]


@kernel("GatherNd")
def _gather_nd(op: Op, inputs: list) -> list:
    x, indices = inputs
    depth = indices.shape[-1]
    columns = tuple(_positive(indices[..., k], x.shape[k]) for k in range(depth))
    return [np.array(x[columns], copy=True)]


def _element_positions(shape: tuple[int, ...], indices: np.ndarray, axis: int) -> tuple[np.ndarray, ...]:
    grid = list(np.indices(indices.shape, sparse=False))
    grid[axis] = _positive(indices, shape[axis])
    return tuple(grid)


@kernel("ScatterElements")
def _scatter_elements(op: Op, inputs: list) -> list:
    data, indices, updates = inputs
    axis = int(op.attrs.get("axis", 0)) % data.ndim
    result = np.array(_wide(data), copy=True)
    positions = _element_positions(data.shape, indices, axis)
    reduction = op.attrs.get("reduction", "none")
    values = _wide(updates)
    if reduction == "add":
        np.add.at(result, positions, values)
    elif reduction == "mul":
        np.multiply.at(result, positions, values)
    else:
        result[positions] = values
    return [_out(op, result)]


def _scatter_nd(add: bool) -> Callable[[Op, list], list]:
    def run(op: Op, inputs: list) -> list:
        x, indices, updates = inputs
        result = np.array(_wide(x), copy=True)
        depth = indices.shape[-1]
        columns = tuple(_positive(indices[..., k], x.shape[k]).reshape(-1) for k in range(depth))
        values = _wide(updates).reshape((-1,) + x.shape[depth:])
        if add:
            np.add.at(result, columns, values)
        else:
            result[columns] = values
        return [_out(op, result)]

    return run


kernel("TensorScatterUpdate")(_scatter_nd(False))
kernel("TensorScatterAdd")(_scatter_nd(True))


@kernel("Tile")
def _tile(op: Op, inputs: list) -> list:
    return [np.tile(inputs[0], tuple(int(m) for m in np.ravel(inputs[1])))]


@kernel("Range")
def _range(op: Op, inputs: list) -> list:
    start, limit, delta = (np.asarray(a).reshape(()) for a in inputs)
    count = max(int(np.ceil((limit - start) / delta)), 0)
    return [_out(op, start + np.arange(count, dtype=np.asarray(start).dtype) * delta)]


@kernel("Cumsum")
def _cumsum(op: Op, inputs: list) -> list:
    x, axis = _wide(inputs[0]), int(np.asarray(inputs[1]).reshape(()))
    if op.attrs.get("reverse"):
        x = np.flip(x, axis)
    total = np.cumsum(x, axis=axis, dtype=x.dtype)
    if op.attrs.get("exclusive"):
        total = total - x
    if op.attrs.get("reverse"):
        total = np.flip(total, axis)
    return [_out(op, total)]


@kernel("Tril")
def _tril(op: Op, inputs: list) -> list:
    return [np.tril(inputs[0], int(op.attrs.get("diagonal", 0)))]


@kernel("Triu")
def _triu(op: Op, inputs: list) -> list:
    return [np.triu(inputs[0], int(op.attrs.get("diagonal", 0)))]


# ---- convolution ----------------------------------------------------------------------------------------------


def _pairs(pads: list[int], spatial: int) -> list[tuple[int, int]]:
    """GE's interleaved pads ([top, bottom, left, right]) → (begin, end) per spatial axis."""
    pads = list(pads) or [0] * (2 * spatial)
    return [(int(pads[2 * a]), int(pads[2 * a + 1])) for a in range(spatial)]


def _taps(kernel_shape: tuple[int, ...]):
    return itertools.product(*(range(k) for k in kernel_shape))


def _tap_slice(tap: tuple[int, ...], dilations: list[int], strides: list[int], counts: list[int]) -> tuple[slice, ...]:
    return tuple(slice(t * d, t * d + s * (c - 1) + 1, s) for t, d, s, c in zip(tap, dilations, strides, counts))


@kernel("Conv2D", "Conv3D")
def _conv(op: Op, inputs: list) -> list:
    x, w = np.asarray(inputs[0], np.float64), np.asarray(inputs[1], np.float64)
    bias = inputs[2] if len(inputs) > 2 else None
    spatial = x.ndim - 2
    strides, dilations = list(op.attrs["strides"])[2:], list(op.attrs.get("dilations") or [1] * x.ndim)[2:]
    groups = int(op.attrs.get("groups", 1))
    padded = np.pad(x, [(0, 0), (0, 0), *_pairs(op.attrs.get("pads", []), spatial)])
    kernel_shape = w.shape[2:]
    counts = [(padded.shape[2 + a] - (dilations[a] * (kernel_shape[a] - 1) + 1)) // strides[a] + 1 for a in range(spatial)]
    out = np.zeros((x.shape[0], w.shape[0], *counts))
    cin, cout = w.shape[1], w.shape[0] // groups
    for tap in _taps(kernel_shape):
        patch = padded[(slice(None), slice(None), *_tap_slice(tap, dilations, strides, counts))]
        for g in range(groups):
            weights = w[(slice(g * cout, (g + 1) * cout), slice(None), *tap)]
            out[:, g * cout : (g + 1) * cout] += np.einsum("nc...,oc->no...", patch[:, g * cin : (g + 1) * cin], weights)
    if bias is not None:
        out += np.asarray(bias, np.float64).reshape((1, -1) + (1,) * spatial)
    return [_out(op, out)]


@kernel("Conv2DTranspose")
def _conv_transpose(op: Op, inputs: list) -> list:
    size, x, w = inputs[0], np.asarray(inputs[1], np.float64), np.asarray(inputs[2], np.float64)
    bias = inputs[3] if len(inputs) > 3 else None
    spatial = x.ndim - 2
    strides, dilations = list(op.attrs["strides"])[2:], list(op.attrs.get("dilations") or [1] * x.ndim)[2:]
    extra = list(op.attrs.get("output_padding") or [0] * x.ndim)[2:]
    groups = int(op.attrs.get("groups", 1))
    kernel_shape = w.shape[2:]
    full = [(x.shape[2 + a] - 1) * strides[a] + (kernel_shape[a] - 1) * dilations[a] + 1 + extra[a] for a in range(spatial)]
    cin, cout = x.shape[1] // groups, w.shape[1]
    out = np.zeros((x.shape[0], cout * groups, *full))
    counts = list(x.shape[2:])
    for tap in _taps(kernel_shape):
        target = (slice(None), slice(None), *_tap_slice(tap, dilations, strides, counts))
        for g in range(groups):
            weights = w[(slice(g * cin, (g + 1) * cin), slice(None), *tap)]
            view = out[(slice(None), slice(g * cout, (g + 1) * cout), *target[2:])]
            view += np.einsum("nc...,co->no...", x[:, g * cin : (g + 1) * cin], weights)
    sizes = [int(s) for s in np.ravel(size)][2:]
    crop = tuple(slice(begin, begin + s) for (begin, _), s in zip(_pairs(op.attrs.get("pads", []), spatial), sizes))
    out = out[(slice(None), slice(None), *crop)]
    if bias is not None:
        out = out + np.asarray(bias, np.float64).reshape((1, -1) + (1,) * spatial)
    return [_out(op, out)]


@kernel("Col2im")
def _col2im(op: Op, inputs: list) -> list:
    x, size = np.asarray(inputs[0], np.float64), [int(s) for s in np.ravel(inputs[1])]
    kernel_shape = [int(k) for k in op.attrs["kernel_size"]]
    dilations = [int(d) for d in op.attrs.get("dilation") or [1, 1]]
    strides = [int(s) for s in op.attrs.get("stride") or [1, 1]]
    padding = [int(p) for p in op.attrs.get("padding") or [0, 0]]
    padded = [size[a] + 2 * padding[a] for a in range(2)]
    counts = [(padded[a] - (dilations[a] * (kernel_shape[a] - 1) + 1)) // strides[a] + 1 for a in range(2)]
    n, c = x.shape[:2]
    out = np.zeros((n, c, *padded))
    for k, tap in enumerate(_taps(tuple(kernel_shape))):
        out[(slice(None), slice(None), *_tap_slice(tap, dilations, strides, counts))] += x[:, :, k, :].reshape(n, c, *counts)
    return [_out(op, out[:, :, padding[0] : padding[0] + size[0], padding[1] : padding[1] + size[1]])]


# ---- normalisation ----------------------------------------------------------------------------------------------


@kernel("BatchNorm")
def _batch_norm(op: Op, inputs: list) -> list:
    if op.attrs.get("is_training", True):
        raise ExecutorError(f"op {op.name}: BatchNorm with is_training=true is not run here (sgdfuse lowers training BatchNormalization to reductions)")
    x, scale, offset, mean, variance = (np.asarray(_wide(a)) for a in inputs[:5])
    view = (1, -1) + (1,) * (x.ndim - 2)
    epsilon = float(op.attrs.get("epsilon", 1e-4))
    y = (x - mean.reshape(view)) / np.sqrt(variance.reshape(view) + np.asarray(epsilon, x.dtype)) * scale.reshape(view) + offset.reshape(view)
    # Inference: the statistics outputs echo the inputs; reserve_space_3 holds one meaningless element.
    # Copies: a kernel's outputs never alias its inputs unless sgdfuse.lowering.alias says the op may.
    return [_out(op, y), _out(op, mean.copy(), 1), _out(op, variance.copy(), 2), _out(op, mean.copy(), 3), _out(op, variance.copy(), 4),
            _out(op, np.zeros(1), 5)]


@kernel("LayerNorm")
def _layer_norm(op: Op, inputs: list) -> list:
    x, gamma, beta = (np.asarray(_wide(a)) for a in inputs)
    axis = int(op.attrs.get("begin_norm_axis", 0)) % x.ndim
    params_axis = int(op.attrs.get("begin_params_axis", 0)) % x.ndim
    for name, value in (("gamma", gamma), ("beta", beta)):
        # GE's LayerNorm applies gamma and beta over the dimensions from begin_params_axis on (the prototype's
        # contract); numpy would broadcast any trailing shape, so a mismatch is the graph's, named here.
        if value.shape != x.shape[params_axis:]:
            raise GraphContradictionError(
                f"op {op.name} (LayerNorm): {name} has shape {list(value.shape)}, but begin_params_axis {params_axis} of an "
                f"input of shape {list(x.shape)} needs {list(x.shape[params_axis:])}"
            )
    axes = tuple(range(axis, x.ndim))
    mean = np.mean(x, axis=axes, keepdims=True)
    variance = np.mean(np.square(x - mean), axis=axes, keepdims=True)
    epsilon = np.asarray(float(op.attrs.get("epsilon", 1e-7)), x.dtype)
    y = (x - mean) / np.sqrt(variance + epsilon) * gamma + beta
    return [_out(op, y), _out(op, mean, 1), _out(op, variance, 2)]


# ---- pooling ------------------------------------------------------------------------------------------------------


def _pool_windows(op: Op, x: np.ndarray, fill: float) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """``(windows [N, C, OH, OW, K], (in_region, in_input) [OH, OW, K])``: each output's window over ``x``
    padded with ``fill``; which window elements lie inside the explicitly padded input (not past it in ceil
    mode), and which inside the input itself."""
    kernel_shape = list(op.attrs["ksize"])[2:]
    strides = list(op.attrs["strides"])[2:]
    pads = _pairs(op.attrs.get("pads", []), 2)
    ceil_mode = bool(op.attrs.get("ceil_mode", False))
    counts = []
    for a in range(2):
        span = x.shape[2 + a] + pads[a][0] + pads[a][1] - kernel_shape[a]
        count = (-(-span // strides[a]) if ceil_mode else span // strides[a]) + 1
        if ceil_mode and (count - 1) * strides[a] >= x.shape[2 + a] + pads[a][0]:
            count -= 1  # the last window must start inside the input or its begin padding
        counts.append(count)
    extra = [max(0, (counts[a] - 1) * strides[a] + kernel_shape[a] - (x.shape[2 + a] + pads[a][0] + pads[a][1])) for a in range(2)]
    widths = [(0, 0), (0, 0)] + [(pads[a][0], pads[a][1] + extra[a]) for a in range(2)]
    padded = np.pad(x, widths, constant_values=fill)
    region = np.zeros(padded.shape[2:], bool)
    region[: x.shape[2] + pads[0][0] + pads[0][1], : x.shape[3] + pads[1][0] + pads[1][1]] = True
    real = np.zeros(padded.shape[2:], bool)
    real[pads[0][0] : pads[0][0] + x.shape[2], pads[1][0] : pads[1][0] + x.shape[3]] = True
    taps = list(_taps(tuple(kernel_shape)))
    windows = np.stack([padded[(slice(None), slice(None), *_tap_slice(t, [1, 1], strides, counts))] for t in taps], axis=-1)
    in_region = np.stack([region[_tap_slice(t, [1, 1], strides, counts)] for t in taps], axis=-1)
    in_input = np.stack([real[_tap_slice(t, [1, 1], strides, counts)] for t in taps], axis=-1)
    return windows, (in_region, in_input)


@kernel("MaxPoolV3")
def _max_pool(op: Op, inputs: list) -> list:
    x = _wide(inputs[0])
    windows, _ = _pool_windows(op, x, -np.inf)
    return [_out(op, np.max(windows, axis=-1))]


@kernel("AvgPoolV2")
def _avg_pool(op: Op, inputs: list) -> list:
    x = np.asarray(_wide(inputs[0]), np.float64)
    windows, (in_region, in_input) = _pool_windows(op, x, 0.0)
    counted = in_input if op.attrs.get("exclusive", True) else in_region
    return [_out(op, np.sum(windows, axis=-1) / np.sum(counted, axis=-1))]


# ---- losses ---------------------------------------------------------------------------------------------------------


@kernel("NLLLoss")
def _nll_loss(op: Op, inputs: list) -> list:
    x, target = np.asarray(_wide(inputs[0]), np.float64), np.asarray(inputs[1]).astype(np.int64)
    weight = np.asarray(_wide(inputs[2]), np.float64) if len(inputs) > 2 and inputs[2] is not None else np.ones(x.shape[1])
    kept = target != int(op.attrs.get("ignore_index", -100))
    safe = np.where(kept, target, 0)
    weights = np.where(kept, weight[safe], 0.0)
    losses = -x[np.arange(x.shape[0]), safe] * weights
    reduction = op.attrs.get("reduction", "mean")
    total = weights.sum()
    loss = losses if reduction == "none" else losses.sum() if reduction == "sum" else losses.sum() / total
    return [_out(op, loss), _out(op, np.asarray(total), 1)]
