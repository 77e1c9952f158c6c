"""The precision in which a graph computes an update's coefficients, and what "equal" means there.

A coefficient the fused op applies must equal the graph's own to the precision the graph works in — not to
the precision the state is stored in (docs/design.md, "Exact coefficients"). A BFLOAT16 model whose update is
computed in FLOAT between Casts, with FLOAT constants, is compared at FLOAT's precision: a decoupled weight
decay of ``1 - 2^-6`` on the parameters is a real term there, not a rounding of 1.

Two coefficients are equal at a precision when they differ by at most :data:`SPACINGS` spacings of that
precision at the larger magnitude (exporters fold products such as ``lr*m`` or ``1 - d`` into one rounded
constant, which the op forms from its own rounded factors: that is a rounding of the same number). A coefficient the op applies
with no arithmetic at all (the parameters' own coefficient 1 when there is no weight decay) must be met exactly:
no rounding can turn 1 into ``1 - 2^-10``.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import onnx

from sgdfuse.passes.linear import Poly

__all__ = ["Precision", "FLOAT_DTYPES", "SPACINGS", "round_to_dtype", "working_precision"]

SPACINGS = 4.0
"""How far apart (in spacings of the working precision, at the larger magnitude) two coefficients may be and
still be one number. Exporters fold products of up to three hyper-parameters (``lr*m*m`` in a Nesterov step)
into one rounded constant, which the op forms from its own rounded factors (a learning rate solved from
folded constants carries their roundings too): a generated Nesterov step with lr 0.3 and momentum 0.9 is
3.2 spacings apart. A 1 - dampening that the op forms in float32 from a dampening near 1 is far more (12
million spacings at lr 1e-6); readings are ranked by this distance, so the exact one wins."""

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_NUMPY = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.BFLOAT16: _BFLOAT16,
    onnx.TensorProto.DOUBLE: np.dtype(np.float64),
}
_UNIT_ROUNDOFF = {
    onnx.TensorProto.FLOAT: 2.0**-24,
    onnx.TensorProto.FLOAT16: 2.0**-11,
    onnx.TensorProto.BFLOAT16: 2.0**-8,
    onnx.TensorProto.DOUBLE: 2.0**-53,
}
FLOAT_DTYPES = frozenset(_NUMPY)
"""The ONNX float dtypes a coefficient can be computed in."""


def round_to_dtype(value: float, dtype: int) -> float:
    """``value`` rounded to nearest even in the ONNX float ``dtype`` (as ``Cast`` and the op's inputs store it).
    Raises KeyError for a dtype that is not FLOAT, FLOAT16, BFLOAT16 or DOUBLE."""
    with np.errstate(over="ignore"):
        return float(np.array(value, dtype=np.float64).astype(_NUMPY[dtype]).astype(np.float64))


@dataclasses.dataclass(frozen=True)
class Precision:
    """A working precision: the ONNX float dtype whose spacing decides when two coefficients are one number.

    Attributes:
        dtype: ``TensorProto.FLOAT``, ``FLOAT16``, ``BFLOAT16`` or ``DOUBLE``.
    """

    dtype: int

    @property
    def unit_roundoff(self) -> float:
        """Half the machine epsilon of :attr:`dtype` (FLOAT 2^-24, FLOAT16 2^-11, BFLOAT16 2^-8)."""
        return _UNIT_ROUNDOFF[self.dtype]

    def spacing(self, magnitude: float) -> float:
        """The distance from ``|magnitude|`` to the next larger number of :attr:`dtype` (an ulp there)."""
        magnitude = abs(magnitude)
        if magnitude == 0 or not math.isfinite(magnitude):
            return 0.0
        exponent = math.frexp(magnitude)[1]  # magnitude in [2^(e-1), 2^e)
        digits = {onnx.TensorProto.FLOAT: 24, onnx.TensorProto.FLOAT16: 11, onnx.TensorProto.BFLOAT16: 8, onnx.TensorProto.DOUBLE: 53}[self.dtype]
        return 2.0 ** (exponent - digits)

    def close(self, x: float, y: float, scale: float = 0.0) -> bool:
        """``x`` and ``y`` are one coefficient at this precision: they differ by at most :data:`SPACINGS`
        spacings at the larger of ``|x|``, ``|y|`` and ``|scale|`` (``scale`` for a small term of a
        coefficient near 1)."""
        if x == y:
            return True
        if not (math.isfinite(x) and math.isfinite(y)):
            return False
        return abs(x - y) <= SPACINGS * self.spacing(max(abs(x), abs(y), abs(scale)))

    def spacings(self, x: float, y: float) -> float:
        """``|x - y|`` in spacings of this precision at the larger magnitude (0 when equal, inf when one is
        not finite or the other is 0)."""
        if x == y:
            return 0.0
        spacing = self.spacing(max(abs(x), abs(y)))
        if not (math.isfinite(x) and math.isfinite(y)) or spacing == 0:
            return math.inf
        return abs(x - y) / spacing

    def spacings_poly(self, a: Poly, b: Poly) -> float:
        """The largest :meth:`spacings` over the monomials of ``a`` and ``b``; a monomial present in one only
        is a whole term (inf)."""
        worst = 0.0
        for monomial in set(a.terms) | set(b.terms):
            x, y = a.terms.get(monomial, 0.0), b.terms.get(monomial, 0.0)
            worst = max(worst, math.inf if (x == 0) != (y == 0) else self.spacings(x, y))
        return worst

    def close_poly(self, a: Poly, b: Poly, scale: Poly | None = None) -> bool:
        """:meth:`close` per monomial; the reference magnitude is the largest coefficient among ``a``, ``b``
        and ``scale``."""
        reference = max(
            [abs(v) for v in a.terms.values()] + [abs(v) for v in b.terms.values()] + ([abs(v) for v in scale.terms.values()] if scale else []),
            default=0.0,
        )
        return all(
            self.close(a.terms.get(monomial, 0.0), b.terms.get(monomial, 0.0), reference) for monomial in set(a.terms) | set(b.terms)
        )

    def relative_error(self, have: float, want: float) -> float:
        """``|have - want| / |want|`` (inf when ``want`` is 0 and ``have`` is not)."""
        if have == want:
            return 0.0
        return abs(have - want) / abs(want) if want else math.inf


def working_precision(dtypes: set[int], fallback: int) -> Precision:
    """The coarsest of the float ``dtypes`` the graph computes and stores an update's coefficients in
    (intermediate values and constants; not the state, which the op rounds once at the end); ``fallback``
    (the parameters' dtype) when there is none."""
    floats = [d for d in dtypes if d in _UNIT_ROUNDOFF]
    if not floats:
        return Precision(fallback if fallback in _UNIT_ROUNDOFF else onnx.TensorProto.FLOAT)
    return Precision(max(floats, key=lambda d: _UNIT_ROUNDOFF[d]))
