"""The Ascend ``SGD`` operator contract as data, and its validation.

Source: the Ascend ``SGD`` operator's documentation, as docs/contract.md states it. Every constant here is
a clause of that page; the validation functions raise a :class:`~sgdfuse.errors.ContractError`
subclass naming the clause and the offending tensor or attribute.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Sequence

from onnx import TensorProto

from sgdfuse.errors import (
    AttributeContractError,
    DtypeContractError,
    ProductLineError,
    ShapeContractError,
    UnknownSocError,
)

__all__ = [
    "Port",
    "AttributeSpec",
    "INPUTS",
    "OUTPUT",
    "ATTRIBUTES",
    "SUPPORTED_DTYPES",
    "SgdAttributes",
    "TensorSpec",
    "check_attributes",
    "check_signature",
    "ProductLine",
    "PRODUCT_LINES",
    "product_line_for_soc",
    "canonical_soc",
    "accepted_soc_versions",
    "describe_soc_versions",
    "dtype_name",
    "format_shape",
]


@dataclasses.dataclass(frozen=True)
class Port:
    """One input port of the operator.

    Attributes:
        index: position in the operator's input list (contract order).
        name: the contract's name of the port.
        writable: True for ``parameters``, ``accum`` and ``stat``, which the kernel updates in place.
        scalar: True for ``learning_rate`` and ``momentum``, which hold exactly one element.
        description: one line for the CLI's contract table.
    """

    index: int
    name: str
    writable: bool
    scalar: bool
    description: str


@dataclasses.dataclass(frozen=True)
class AttributeSpec:
    """One attribute of the operator: name, kind (``"float"`` or ``"bool"``), default, rule."""

    name: str
    kind: str
    default: float | bool
    rule: str


INPUTS: tuple[Port, ...] = (
    Port(0, "parameters", True, False, "weights; updated in place; rank 1..8, not empty"),
    Port(1, "gradient", False, False, "same shape, dtype and format as parameters"),
    Port(2, "learning_rate", False, True, "exactly 1 element, dtype of parameters"),
    Port(3, "accum", True, False, "momentum buffer; written in place when momentum != 0"),
    Port(4, "momentum", False, True, "exactly 1 element, dtype of parameters"),
    Port(5, "stat", True, False, "per-element first-step flag: 1 = no dampening; set to 0 when momentum != 0"),
)
"""The six inputs in contract order."""

OUTPUT = "parameters"
"""The operator's only declared output: the updated weights."""

ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("dampening", "float", 0.0, "must be 0 when nesterov is true"),
    AttributeSpec("weight_decay", "float", 0.0, "must be >= 0"),
    AttributeSpec("nesterov", "bool", False, ""),
)

SUPPORTED_DTYPES: tuple[int, ...] = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
"""ONNX ``TensorProto.DataType`` codes the operator accepts (the 950 and A2/A3 lines; older lines drop
BFLOAT16, see :data:`PRODUCT_LINES`)."""

MAX_RANK = 8


def dtype_name(dtype: int) -> str:
    """The ONNX name (``"FLOAT16"``) of a ``TensorProto.DataType`` code."""
    try:
        return TensorProto.DataType.Name(dtype)
    except ValueError:
        return f"dtype {dtype}"


@dataclasses.dataclass(frozen=True)
class SgdAttributes:
    """The operator's attributes, with the contract's defaults.

    Attributes:
        dampening: float, default 0.0; must be 0 when ``nesterov``.
        weight_decay: float, default 0.0; must be >= 0.
        nesterov: bool, default False.
    """

    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def check(self, subject: str = "SGD") -> None:
        """Raise :class:`AttributeContractError` if the attributes break the contract."""
        check_attributes(self.dampening, self.weight_decay, self.nesterov, subject=subject)


def check_attributes(dampening: float, weight_decay: float, nesterov: bool, *, subject: str = "SGD") -> None:
    """Validate the attribute clauses of the contract.

    Raises:
        AttributeContractError: ``weight_decay`` is negative or NaN, ``dampening`` is not finite, or
            ``nesterov`` is true with a non-zero ``dampening``.
    """
    if not math.isfinite(dampening):
        raise AttributeContractError("dampening is a finite float", f"{subject}.dampening", f"dampening is {dampening}")
    if not (weight_decay >= 0) or not math.isfinite(weight_decay):
        raise AttributeContractError(
            "weight_decay >= 0", f"{subject}.weight_decay", f"weight_decay is {weight_decay:.6g}, must be >= 0"
        )
    if nesterov and dampening != 0:
        raise AttributeContractError(
            "nesterov requires dampening == 0",
            f"{subject}.dampening",
            f"nesterov is true but dampening is {dampening:.6g}",
        )


@dataclasses.dataclass(frozen=True, slots=True)  # slots: the index holds one per value of the graph
class TensorSpec:
    """What is known statically about one tensor: its name, shape and ONNX element type.

    Attributes:
        name: the value name (ONNX) or tensor name used in messages.
        shape: one entry per dimension: an ``int`` for a fixed size, a ``str`` for a symbolic dimension,
            ``None`` for an unknown one; the whole shape is ``None`` when even the rank is unknown.
        dtype: ``TensorProto.DataType`` code, 0 when unknown.
    """

    name: str
    shape: tuple[int | str | None, ...] | None
    dtype: int

    @property
    def is_static(self) -> bool:
        """True when the rank and every dimension are known integers."""
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def num_elements(self) -> int | None:
        """Element count, or None when any dimension is not a known integer."""
        if self.shape is None:
            return None
        count = 1
        for d in self.shape:  # one pass: this is asked for every value of every matched update
            if not isinstance(d, int):
                return None
            count *= d
        return count


def check_signature(
    parameters: TensorSpec,
    gradient: TensorSpec,
    learning_rate: TensorSpec,
    accum: TensorSpec,
    momentum: TensorSpec,
    stat: TensorSpec,
    *,
    allowed_dtypes: Sequence[int] = SUPPORTED_DTYPES,
) -> None:
    """Validate the tensor clauses of the contract for one call.

    Unknown facts (a symbolic dimension, an unknown rank) are not violations here: they are what dynamic
    shape means, and product lines that forbid it are checked by :meth:`ProductLine.check`.

    Raises:
        DtypeContractError: a dtype outside ``allowed_dtypes``, or one differing from ``parameters``.
        ShapeContractError: ``parameters`` rank outside 1..8 or empty; ``gradient``/``accum``/``stat``
            shaped differently from ``parameters``; ``learning_rate``/``momentum`` not exactly 1 element.
    """
    if parameters.dtype not in allowed_dtypes:
        allowed = ", ".join(dtype_name(d) for d in allowed_dtypes)
        raise DtypeContractError(
            f"parameters dtype in {{{allowed}}}", parameters.name, f"dtype is {dtype_name(parameters.dtype)}"
        )
    for port, spec in zip(INPUTS[1:], (gradient, learning_rate, accum, momentum, stat)):
        if spec.dtype != parameters.dtype:
            raise DtypeContractError(
                f"{port.name} has the dtype of parameters",
                spec.name,
                f"dtype is {dtype_name(spec.dtype)}, parameters {parameters.name} is {dtype_name(parameters.dtype)}",
            )
    if parameters.shape is not None:
        rank = len(parameters.shape)
        if not 1 <= rank <= MAX_RANK:
            raise ShapeContractError("parameters rank is 1..8", parameters.name, f"rank is {rank}")
        if any(d == 0 for d in parameters.shape):
            raise ShapeContractError("empty tensors are not supported", parameters.name, f"shape {list(parameters.shape)} is empty")
    for port, spec in zip((INPUTS[1], INPUTS[3], INPUTS[5]), (gradient, accum, stat)):
        if not _same_shape(parameters.shape, spec.shape):
            raise ShapeContractError(
                f"{port.name} has the shape of parameters",
                spec.name,
                f"shape {format_shape(spec.shape)} differs from parameters {parameters.name} {format_shape(parameters.shape)}",
            )
    for port, spec in ((INPUTS[2], learning_rate), (INPUTS[4], momentum)):
        count = spec.num_elements()
        if count is not None and count != 1:
            raise ShapeContractError(f"{port.name} holds exactly 1 element", spec.name, f"shape {format_shape(spec.shape)} holds {count}")


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
    # Unknown ranks cannot be compared; a dimension that is unknown on one side is not a proven mismatch.
    if a is None or b is None:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        if x != y:
            return False
    return True


def format_shape(shape: tuple | None) -> str:
    """``[4, 3]``, ``[n, ?]`` (symbolic and unknown dimensions), or ``unknown`` for an unknown rank."""
    return "unknown" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


@dataclasses.dataclass(frozen=True)
class ProductLine:
    """One Ascend product line and its limits for ``SGD`` (docs/contract.md, "Product lines").

    Attributes:
        name: the product line as the contract names it.
        soc_versions: ATC ``--soc_version`` strings of the line, in ATC's spelling.
        soc_pattern: a regular expression for families given by pattern (the 950 series), or ``""``.
        dtypes: accepted ONNX element types.
        formats: accepted formats of ``parameters``/``gradient``/``accum``/``stat`` and the output
            (``learning_rate`` and ``momentum`` are always ND).
        dynamic_shape: whether dynamic shapes (and dynamic rank) are supported.
    """

    name: str
    soc_versions: tuple[str, ...]
    soc_pattern: str
    dtypes: tuple[int, ...]
    formats: tuple[str, ...]
    dynamic_shape: bool

    def matches(self, soc: str) -> bool:
        """True when ``soc`` (exact, case-sensitive ATC spelling; see :func:`canonical_soc`) belongs to this line."""
        return soc in self.soc_versions or bool(self.soc_pattern and re.fullmatch(self.soc_pattern, soc))

    def check(self, parameters: TensorSpec, *, node: str) -> None:
        """Raise :class:`ProductLineError` if a call on ``parameters`` breaks this line's limits.

        Checks the dtype and, on lines without dynamic shape, that every dimension is a known integer.
        """
        if parameters.dtype not in self.dtypes:
            allowed = ", ".join(dtype_name(d) for d in self.dtypes)
            raise ProductLineError(
                f"{self.name}: dtypes {allowed}",
                f"node {node}, tensor {parameters.name}",
                f"dtype {dtype_name(parameters.dtype)} is not supported on {self.name}",
            )
        if not self.dynamic_shape and not parameters.is_static:
            raise ProductLineError(
                f"{self.name}: no dynamic shape",
                f"node {node}, tensor {parameters.name}",
                f"shape {format_shape(parameters.shape)} is dynamic; {self.name} supports static shapes only",
            )


_ND_ONLY = ("ND",)
_ALL_FORMATS = ("NC1HWC0", "NDC1HWC0", "ND", "FRACTAL_Z", "FRACTAL_Z_3D")
_F, _H, _B = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16

PRODUCT_LINES: tuple[ProductLine, ...] = (
    ProductLine("Ascend 950PR/950DT", (), r"Ascend950(PR|DT)_95[0-9]{2}", (_F, _H, _B), _ND_ONLY, True),
    ProductLine(
        "Atlas A3 series",
        ("Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372", "Ascend910_9362"),
        "",
        (_F, _H, _B),
        _ALL_FORMATS,
        False,
    ),
    ProductLine(
        "Atlas A2 series",
        ("Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1"),
        "",
        (_F, _H, _B),
        _ALL_FORMATS,
        False,
    ),
    ProductLine(
        "Atlas 200I/500 A2 inference",
        ("Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4"),
        "",
        (_F, _H),
        _ALL_FORMATS,
        False,
    ),
    ProductLine(
        "Atlas inference series",
        ("Ascend310P1", "Ascend310P2", "Ascend310P3", "Ascend310P4", "Ascend310P5", "Ascend310P7"),
        "",
        (_F, _H),
        _ALL_FORMATS,
        False,
    ),
    # Easy to confuse (docs/contract.md): bare "Ascend910B" (no digit) is the old training series, not A2.
    ProductLine(
        "Atlas training series",
        ("Ascend910", "Ascend910A", "Ascend910B", "Ascend910ProA", "Ascend910ProB", "Ascend910PremiumA"),
        "",
        (_F, _H),
        _ALL_FORMATS,
        False,
    ),
)


def product_line_for_soc(soc: str) -> ProductLine:
    """The product line an ATC SoC version string belongs to, whatever the string's case.

    Raises:
        UnknownSocError: ``soc`` is not a known SoC version; the message suggests the nearest known
            spellings and lists the accepted versions, one product line per line.
    """
    spelled = canonical_soc(soc)
    return next(line for line in PRODUCT_LINES if line.matches(spelled))


def canonical_soc(soc: str) -> str:
    """``soc`` in ATC's spelling, whatever its case: ``"ascend910b2"`` → ``"Ascend910B2"``.

    ATC compares ``--soc_version`` strings exactly, so what is written into a GE graph is always this
    spelling, never the user's.

    Raises:
        UnknownSocError: no known SoC version matches ``soc`` ignoring case.
    """
    folded = soc.strip().casefold()
    for line in PRODUCT_LINES:
        for known in line.soc_versions:
            if known.casefold() == folded:
                return known
        if line.soc_pattern:
            found = re.fullmatch(line.soc_pattern, soc.strip(), flags=re.IGNORECASE)
            if found:
                # The 950 family: "ascend950pr_9599" -> "Ascend950PR_9599" (letters upper-case after 950).
                return "Ascend950" + soc.strip()[len("Ascend950"):].upper()
    raise _unknown_soc(soc)


# How the 950 family (given by a pattern) is written in messages: a placeholder that cannot be taken for a name.
_FAMILY_950 = "Ascend950PR_95## and Ascend950DT_95## (## is two digits, e.g. Ascend950PR_9599)"
_EXAMPLES_950 = ("Ascend950PR_9599", "Ascend950DT_9591")


def describe_soc_versions(line: ProductLine) -> str:
    """The SoC versions of ``line`` for people: the names, or for the 950 family its pattern in words."""
    return ", ".join(line.soc_versions) if line.soc_versions else _FAMILY_950


def accepted_soc_versions() -> list[str]:
    """One line per product line: its name and the SoC versions it accepts."""
    return [f"{line.name}: {describe_soc_versions(line)}" for line in PRODUCT_LINES]


def _unknown_soc(soc: str) -> UnknownSocError:
    known = [name for line in PRODUCT_LINES for name in line.soc_versions] + list(_EXAMPLES_950)
    by_fold = {name.casefold(): name for name in known}
    close = difflib.get_close_matches(soc.strip().casefold(), list(by_fold), n=3, cutoff=0.75)
    suggestions = [by_fold[name] for name in close]
    if soc.strip().casefold().startswith("ascend950"):
        suggestions = [s for s in suggestions if not s.startswith("Ascend950")] + ["Ascend950PR_95## / Ascend950DT_95##"]
    return UnknownSocError(soc, suggestions, accepted_soc_versions())
