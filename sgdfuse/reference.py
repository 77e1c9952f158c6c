"""Independent numpy reference of the Ascend ``SGD`` operator: the oracle everything is tested against.

Transcribed line by line from the contract (docs/contract.md, "The formula" and "Rules that belong to the
contract"); read it side by side:

    grad    = gradient + parameters * wd          if wd != 0
            = gradient                            if wd == 0
    accum_t = accum * m + grad
    if d != 0:
        accum_t = accum_t - grad * (1 - stat) * d
    parameters_out = parameters - (grad + accum_t * m) * lr     if nesterov
                   = parameters - accum_t * lr                   otherwise
    if m != 0:  accum <- accum_t ; stat <- 0
    if m == 0:  accum and stat keep their input values

Intermediate arithmetic is FLOAT (fp32); FLOAT16 and BFLOAT16 results are converted back to the input
dtype with round-to-nearest-even (numpy's and ml_dtypes' ``astype`` from float32 do exactly that).
Operations are evaluated left to right as written, one fp32 rounding per operation, no fused multiply-add.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["sgd", "REFERENCE_DTYPES"]

REFERENCE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
"""The numpy dtypes of FLOAT, FLOAT16 and BFLOAT16."""


def sgd(
    parameters: np.ndarray,
    gradient: np.ndarray,
    learning_rate: np.ndarray,
    accum: np.ndarray,
    momentum: np.ndarray,
    stat: np.ndarray,
    *,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One call of the SGD operator.

    Args:
        parameters: weights, any shape of rank 1..8, dtype float32, float16 or ml_dtypes.bfloat16.
        gradient, accum, stat: same shape and dtype as ``parameters``.
        learning_rate, momentum: exactly one element each, dtype of ``parameters``.
        dampening, weight_decay: the float attributes (stored as fp32, as an ONNX/GE float attribute is).
        nesterov: the bool attribute.

    Returns:
        ``(parameters_out, accum_out, stat_out)``, new arrays of the input dtype and shape. When
        ``momentum == 0`` the last two are copies of ``accum`` and ``stat``. Inputs are never mutated.

    Raises:
        ValueError: a dtype outside FLOAT/FLOAT16/BFLOAT16, mixed dtypes, shapes that differ from
            ``parameters``, or a ``learning_rate``/``momentum`` that is not one element. Attribute rules
            (``nesterov`` with ``dampening``, negative ``weight_decay``) are the contract module's job:
            the reference computes what the formula says for any attribute values.
    """
    dtype = np.asarray(parameters).dtype
    if dtype not in REFERENCE_DTYPES:
        raise ValueError(f"parameters: dtype {dtype} is not FLOAT, FLOAT16 or BFLOAT16")
    tensors = {"gradient": gradient, "accum": accum, "stat": stat}
    for name, array in tensors.items():
        if np.asarray(array).dtype != dtype or np.shape(array) != np.shape(parameters):
            raise ValueError(f"{name}: must have the shape and dtype of parameters ({np.shape(parameters)}, {dtype})")
    for name, array in (("learning_rate", learning_rate), ("momentum", momentum)):
        if np.asarray(array).dtype != dtype or np.size(array) != 1:
            raise ValueError(f"{name}: must hold exactly one element of dtype {dtype}")

    f32 = np.float32
    p = np.asarray(parameters).astype(f32)
    g = np.asarray(gradient).astype(f32)
    a = np.asarray(accum).astype(f32)
    s = np.asarray(stat).astype(f32)
    lr = np.asarray(learning_rate).astype(f32).reshape(())
    m = np.asarray(momentum).astype(f32).reshape(())
    d = f32(dampening)
    wd = f32(weight_decay)

    with np.errstate(all="ignore"):  # Inf and NaN are part of the contract (0 * Inf = NaN reaches the weights)
        grad = g + p * wd if wd != 0 else g
        accum_t = a * m + grad
        if d != 0:
            accum_t = accum_t - grad * (f32(1) - s) * d
        if nesterov:
            parameters_out = p - (grad + accum_t * m) * lr
        else:
            parameters_out = p - accum_t * lr

        # Rounding back may overflow to Inf (FLOAT16 max is 65504): that is the contract's result, not an error.
        parameters_out = parameters_out.astype(dtype)
        if m != 0:
            accum_out = accum_t.astype(dtype)
            stat_out = np.zeros_like(np.asarray(stat))
        else:
            accum_out = np.array(accum, dtype=dtype, copy=True)
            stat_out = np.array(stat, dtype=dtype, copy=True)
    return parameters_out, accum_out, stat_out
