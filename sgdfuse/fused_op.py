"""The fused operator's ONNX form: ``ai.sgdfuse::SGD`` version 1, and its model-local function.

Form (docs/design.md, "The fused op in ONNX"):

- inputs, contract order: ``parameters, gradient, learning_rate, accum, momentum, stat``;
- outputs: ``parameters_out, accum_out, stat_out`` (ONNX has no in-place update, so the writes to ``accum``
  and ``stat`` are explicit outputs; lowering turns them back into GE ref semantics);
- attributes: ``dampening`` (FLOAT), ``weight_decay`` (FLOAT), ``nesterov`` (INT 0/1); defaults 0.

The FunctionProto's body is the contract (docs/contract.md) written with standard ops: every input is
cast to FLOAT, the formula is evaluated one operation at a time in the order the contract writes it, and the
results are cast back to the input dtype (``CastLike``, round-to-nearest-even). The ``if`` clauses of the
formula become ``If`` on a scalar condition, which selects without letting the unselected branch's NaN
through (so ``wd == 0`` really means ``grad = gradient``, even where ``parameters`` is Inf) and passes the
selected tensor through bit for bit (``Where`` would do too by the ONNX spec, but onnxruntime's CPU ``Where``
returns +0 for a selected -0, microsoft/onnxruntime#32191).

Specialised bodies (:class:`Specialisation`): the rewrite knows the dtype, the attributes, whether the momentum
is a non-zero constant and whether ``stat`` is zero, so it can give a node a body with what is provably
constant folded away (no ``Cast`` for FLOAT, no ``If`` for a constant momentum, no dampening term when
``dampening == 0``...). Each specialisation is a function *overload* of ``ai.sgdfuse::SGD`` (ONNX IR 10: a node
calls the FunctionProto of its ``(domain, op_type, overload)``), so every fused node stays ``op_type`` SGD
with the same inputs, outputs and attributes, and readers that look at the node (lowering, the report) do not
change. The general body is the overload ``""``. A specialised body computes the contract's results bit for
bit on every input that meets its preconditions (:meth:`Specialisation.preconditions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper

from sgdfuse.contract import SgdAttributes

__all__ = [
    "DOMAIN",
    "OP_TYPE",
    "OP_VERSION",
    "INPUT_NAMES",
    "OUTPUT_NAMES",
    "MIN_OPSET",
    "make_sgd_node",
    "make_sgd_function",
    "ensure_sgd_function",
    "Specialisation",
    "OVERLOAD_IR_VERSION",
    "sgd_functions_for",
    "sgd_functions_for_overloads",
    "is_sgd_node",
    "read_sgd_attributes",
    "default_opset",
    "function_opset",
]

DOMAIN = "ai.sgdfuse"
OP_TYPE = "SGD"
OP_VERSION = 1
INPUT_NAMES = ("parameters", "gradient", "learning_rate", "accum", "momentum", "stat")
OUTPUT_NAMES = ("parameters_out", "accum_out", "stat_out")
MIN_OPSET = 15
"""The body uses ``CastLike`` (opset 15); the function is declared against the model's own default-domain
opset, which must be at least this."""


OVERLOAD_IR_VERSION = 10
"""The first ONNX IR version with function overloads (``NodeProto.overload``, ``FunctionProto.overload``): a
model whose SGD nodes call a specialised body is raised to it."""

_DTYPE_TAGS = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}


@dataclasses.dataclass(frozen=True)
class Specialisation:
    """What a specialised SGD body may assume about the node that calls it; the rewrite proves each of these
    before it gives a node the specialisation.

    Attributes:
        dtype: ONNX element type of every input and output (FLOAT, FLOAT16 or BFLOAT16). FLOAT needs no
            ``Cast``; the others are cast to FLOAT and back (round-to-nearest-even), as the contract says.
        nesterov: the node's ``nesterov`` attribute.
        dampening: whether the node's ``dampening`` attribute is non-zero (False: no dampening term; the
            contract's ``if d != 0`` clause is decided here, not at run time).
        weight_decay: whether ``weight_decay`` is non-zero (False: ``grad = gradient``).
        momentum_nonzero: ``momentum`` is a constant other than ±0, so the contract always writes
            ``accum <- accum_t`` and ``stat <- 0`` (no ``If``).
        stat_zero: every element of ``stat`` is +0 (the graph applies dampening on every step): ``1 - stat``
            is exactly 1, ``grad * 1`` is ``grad`` bit for bit, and ``stat_out`` (kept, or written 0) is +0,
            i.e. ``stat`` itself.

    Every specialised body also assumes that ``learning_rate`` and ``momentum`` (one element each) have no
    higher rank than ``parameters``: they are broadcast as they are, without the general body's ``Reshape``.

    Raises:
        ValueError: a dtype outside the three, or ``nesterov`` with ``dampening`` (the contract forbids it).
    """

    dtype: int
    nesterov: bool
    dampening: bool
    weight_decay: bool
    momentum_nonzero: bool
    stat_zero: bool

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_TAGS:
            raise ValueError(f"SGD specialisation: dtype {helper.tensor_dtype_to_string(self.dtype)} is not FLOAT, FLOAT16 or BFLOAT16")
        if self.nesterov and self.dampening:
            raise ValueError("SGD specialisation: nesterov requires dampening == 0 (docs/contract.md)")

    @property
    def overload(self) -> str:
        """The function overload name, which spells every assumption, e.g.
        ``f32_plain_nodamp_nowd_mconst_stat0``: dtype; ``nesterov``/``plain``; ``damp``/``nodamp``;
        ``wd``/``nowd``; ``mconst`` (non-zero constant momentum) / ``mruntime``; ``stat0``/``statany``."""
        return "_".join(
            [
                _DTYPE_TAGS[self.dtype],
                "nesterov" if self.nesterov else "plain",
                "damp" if self.dampening else "nodamp",
                "wd" if self.weight_decay else "nowd",
                "mconst" if self.momentum_nonzero else "mruntime",
                "stat0" if self.stat_zero else "statany",
            ]
        )

    @classmethod
    def from_overload(cls, overload: str) -> "Specialisation":
        """The specialisation named ``overload`` (the inverse of :attr:`overload`).

        Raises:
            ValueError: not a name :attr:`overload` produces.
        """
        parts = overload.split("_")
        tags = {tag: dtype for dtype, tag in _DTYPE_TAGS.items()}
        choices = (tuple(tags), ("plain", "nesterov"), ("nodamp", "damp"), ("nowd", "wd"), ("mruntime", "mconst"), ("statany", "stat0"))
        if len(parts) != len(choices) or any(part not in options for part, options in zip(parts, choices)):
            raise ValueError(f"{overload!r} is not an ai.sgdfuse::SGD overload name (e.g. f32_plain_nodamp_nowd_mconst_stat0)")
        flags = [part == options[1] for part, options in zip(parts[1:], choices[1:])]
        return cls(tags[parts[0]], *flags)

    @classmethod
    def of(cls, dtype: int, attributes: SgdAttributes, *, momentum_nonzero: bool, stat_zero: bool) -> "Specialisation":
        """The specialisation for a node of ``dtype`` with ``attributes``; a FLOAT attribute is non-zero when it
        is as stored (1e-46 is stored as 0 and means "off")."""
        return cls(dtype, bool(attributes.nesterov), _nonzero(attributes.dampening), _nonzero(attributes.weight_decay), momentum_nonzero, stat_zero)

    def check(self, attributes: SgdAttributes, *, subject: str) -> None:
        """Raise ValueError naming ``subject`` when ``attributes`` are not the ones this body assumes."""
        wanted = (self.nesterov, self.dampening, self.weight_decay)
        actual = (bool(attributes.nesterov), _nonzero(attributes.dampening), _nonzero(attributes.weight_decay))
        if wanted != actual:
            raise ValueError(
                f"{subject}: the SGD overload {self.overload} assumes nesterov={wanted[0]}, dampening != 0 is {wanted[1]}, "
                f"weight_decay != 0 is {wanted[2]}; the node has {attributes}"
            )

    def preconditions(self) -> list[str]:
        """What a caller must guarantee, in words (also the function's doc string)."""
        items = [
            f"inputs and outputs are {helper.tensor_dtype_to_string(self.dtype).split('.')[-1]}",
            f"nesterov == {int(self.nesterov)}",
            "dampening != 0" if self.dampening else "dampening == 0",
            "weight_decay != 0" if self.weight_decay else "weight_decay == 0",
            "learning_rate and momentum have no higher rank than parameters",
        ]
        if self.momentum_nonzero:
            items.append("momentum is a constant != 0")
        if self.stat_zero:
            items.append("stat is +0 in every element")
        return items


def _nonzero(value: float) -> bool:
    """Whether a FLOAT attribute holding ``value`` is non-zero (it is stored as fp32)."""
    return bool(np.float32(value) != 0)


def make_sgd_node(
    inputs: tuple[str, str, str, str, str, str],
    outputs: tuple[str, str, str],
    attributes: SgdAttributes,
    *,
    name: str,
    specialisation: Specialisation | None = None,
) -> onnx.NodeProto:
    """An ``ai.sgdfuse::SGD`` node.

    Args:
        inputs: value names in contract order (parameters, gradient, learning_rate, accum, momentum, stat).
        outputs: value names for (parameters_out, accum_out, stat_out).
        attributes: checked against the contract first.
        name: the node name.
        specialisation: when given, the node calls that specialised body (its overload); the caller
            guarantees the preconditions that are not attributes (momentum, stat, dtype, scalar ranks).

    Raises:
        AttributeContractError: the attributes break the contract.
        ValueError: ``specialisation`` assumes other attributes than ``attributes``.
    """
    attributes.check(subject=name)
    if specialisation is not None:
        specialisation.check(attributes, subject=name)
    node = helper.make_node(OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN)
    # What helper.make_node(..., dampening=, weight_decay=, nesterov=) writes (attributes in name order),
    # without its per-value type dispatch: this runs once per fused update.
    node.attribute.extend(
        [
            onnx.AttributeProto(name="dampening", type=onnx.AttributeProto.FLOAT, f=float(attributes.dampening)),
            onnx.AttributeProto(name="nesterov", type=onnx.AttributeProto.INT, i=int(bool(attributes.nesterov))),
            onnx.AttributeProto(name="weight_decay", type=onnx.AttributeProto.FLOAT, f=float(attributes.weight_decay)),
        ]
    )
    if specialisation is not None:
        node.overload = specialisation.overload
    return node


def is_sgd_node(node: onnx.NodeProto) -> bool:
    """True for an ``ai.sgdfuse::SGD`` node."""
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def read_sgd_attributes(node: onnx.NodeProto) -> SgdAttributes:
    """The attributes of an ``ai.sgdfuse::SGD`` node, contract defaults filled in."""
    values = {a.name: _attribute_value(a) for a in node.attribute}
    return SgdAttributes(
        dampening=float(values.get("dampening", 0.0)),
        weight_decay=float(values.get("weight_decay", 0.0)),
        nesterov=bool(values.get("nesterov", 0)),
    )


def _attribute_value(attribute: onnx.AttributeProto):
    """``onnx.helper.get_attribute_value``, with the float and int kinds every ``SGD`` attribute has read
    directly (lowering reads the attributes of every node: the helper's dispatch cost more than the read)."""
    if attribute.type == onnx.AttributeProto.FLOAT:
        return attribute.f
    if attribute.type == onnx.AttributeProto.INT:
        return attribute.i
    return helper.get_attribute_value(attribute)


def make_sgd_function(opset: int, specialisation: Specialisation | None = None) -> onnx.FunctionProto:
    """The model-local FunctionProto for ``ai.sgdfuse::SGD`` whose body is the contract.

    Args:
        opset: the default-domain opset the body is declared against (the model's own), >= 15.
        specialisation: None for the general body (overload ``""``); else the body specialised to it, as the
            overload :attr:`Specialisation.overload`.

    Raises:
        ValueError: ``opset`` is below 15.
    """
    if opset < MIN_OPSET:
        raise ValueError(f"the SGD function body needs default-domain opset >= {MIN_OPSET}, got {opset}")
    if specialisation is None:
        body = _general_body()
        doc = "Ascend SGD operator contract (sgdfuse, docs/contract.md): FLOAT intermediates, results cast back with round-to-nearest-even."
    else:
        body = _specialised_body(specialisation)
        doc = (
            "Ascend SGD operator contract (sgdfuse, docs/contract.md), specialised: valid only where "
            + "; ".join(specialisation.preconditions())
            + ". FLOAT intermediates, results cast back with round-to-nearest-even."
        )
    function = helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUT_NAMES),
        list(OUTPUT_NAMES),
        body,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[],
        doc_string=doc,
    )
    if specialisation is not None:
        function.overload = specialisation.overload
    function.attribute_proto.extend(
        [
            helper.make_attribute("dampening", 0.0),
            helper.make_attribute("weight_decay", 0.0),
            helper.make_attribute("nesterov", 0),
        ]
    )
    return function


def _general_body() -> list[onnx.NodeProto]:
    """The contract for any dtype, attributes, momentum and stat (``If`` for every clause)."""
    n = helper.make_node
    return [
        # Attributes as FLOAT scalars; attribute references resolve per call site.
        _attr_constant("d", "dampening", TensorProto.FLOAT),
        _attr_constant("wd", "weight_decay", TensorProto.FLOAT),
        _attr_constant("nesterov_i", "nesterov", TensorProto.INT64),
        n("Constant", [], ["zero"], value=helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])),
        n("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])),
        n("Constant", [], ["zero_i"], value=helper.make_tensor("zero_i", TensorProto.INT64, [], [0])),
        n("Constant", [], ["scalar_shape"], value=helper.make_tensor("scalar_shape", TensorProto.INT64, [0], [])),
        # FLOAT intermediates.
        n("Cast", ["parameters"], ["p"], to=TensorProto.FLOAT),
        n("Cast", ["gradient"], ["g"], to=TensorProto.FLOAT),
        n("Cast", ["accum"], ["a"], to=TensorProto.FLOAT),
        n("Cast", ["stat"], ["s"], to=TensorProto.FLOAT),
        n("Cast", ["learning_rate"], ["lr_any"], to=TensorProto.FLOAT),
        n("Reshape", ["lr_any", "scalar_shape"], ["lr"]),
        n("Cast", ["momentum"], ["m_any"], to=TensorProto.FLOAT),
        n("Reshape", ["m_any", "scalar_shape"], ["m"]),
        # grad = gradient + parameters * wd if wd != 0 else gradient
        n("Mul", ["p", "wd"], ["p_wd"]),
        n("Add", ["g", "p_wd"], ["g_plus_wd"]),
        n("Equal", ["wd", "zero"], ["wd_is_zero"]),
        _select("wd_is_zero", "g", "g_plus_wd", "grad"),
        # accum_t = accum * m + grad
        n("Mul", ["a", "m"], ["a_m"]),
        n("Add", ["a_m", "grad"], ["accum_t0"]),
        # if d != 0: accum_t = accum_t - grad * (1 - stat) * d
        n("Sub", ["one", "s"], ["one_minus_s"]),
        n("Mul", ["grad", "one_minus_s"], ["grad_1ms"]),
        n("Mul", ["grad_1ms", "d"], ["damp_term"]),
        n("Sub", ["accum_t0", "damp_term"], ["accum_t_damped"]),
        n("Equal", ["d", "zero"], ["d_is_zero"]),
        _select("d_is_zero", "accum_t0", "accum_t_damped", "accum_t"),
        # parameters_out = parameters - (grad + accum_t * m) * lr  if nesterov
        #                = parameters - accum_t * lr                otherwise
        n("Mul", ["accum_t", "m"], ["accum_t_m"]),
        n("Add", ["grad", "accum_t_m"], ["nesterov_step"]),
        n("Mul", ["nesterov_step", "lr"], ["nesterov_delta"]),
        n("Sub", ["p", "nesterov_delta"], ["p_nesterov"]),
        n("Mul", ["accum_t", "lr"], ["plain_delta"]),
        n("Sub", ["p", "plain_delta"], ["p_plain"]),
        n("Equal", ["nesterov_i", "zero_i"], ["not_nesterov"]),
        _select("not_nesterov", "p_plain", "p_nesterov", "p_out"),
        n("CastLike", ["p_out", "parameters"], ["parameters_out"]),
        # if m != 0: accum <- accum_t, stat <- 0; else both keep their input values
        n("Equal", ["m", "zero"], ["m_is_zero"]),
        # Selected in FLOAT and cast back (If has no BFLOAT16 before opset 16); FLOAT16/BFLOAT16 values
        # round-trip through FLOAT exactly, so an unchanged accum or stat keeps its value.
        _select("m_is_zero", "a", "accum_t", "accum_sel"),
        n("CastLike", ["accum_sel", "accum"], ["accum_out"]),
        n("Shape", ["s"], ["stat_shape"]),
        n("ConstantOfShape", ["stat_shape"], ["stat_zeros"]),  # FLOAT 0 of stat's shape
        _select("m_is_zero", "s", "stat_zeros", "stat_sel"),
        n("CastLike", ["stat_sel", "stat"], ["stat_out"]),
    ]


class _Body:
    """A node list under construction; FLOAT values named so that a FLOAT body writes its outputs directly."""

    def __init__(self, dtype: int) -> None:
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self._cast: set[str] = set()

    def op(self, op_type: str, inputs: list[str], output: str, **attributes) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attributes))
        return output

    def read(self, name: str) -> str:
        """Input ``name`` as FLOAT (itself for a FLOAT body), cast once however often it is read."""
        if self.dtype == TensorProto.FLOAT:
            return name
        cast = f"{name}_f"
        if cast not in self._cast:
            self._cast.add(cast)
            self.op("Cast", [name], cast, to=TensorProto.FLOAT)
        return cast

    def result(self, output: str) -> str:
        """The name a FLOAT result bound for ``output`` gets: ``output`` itself in a FLOAT body."""
        return output if self.dtype == TensorProto.FLOAT else f"{output}_f"

    def write(self, value: str, output: str) -> None:
        """Cast FLOAT ``value`` back to the dtype as ``output`` (nothing when ``value`` already is it)."""
        if value != output:
            self.op("Cast", [value], output, to=self.dtype)


def _specialised_body(spec: Specialisation) -> list[onnx.NodeProto]:
    """The contract with what ``spec`` makes constant folded away, the operations that remain in the
    contract's order (each one fp32 rounding, as in the reference), so results are the same bits."""
    b = _Body(spec.dtype)
    p, g, a = b.read("parameters"), b.read("gradient"), b.read("accum")
    lr, m = b.read("learning_rate"), b.read("momentum")
    grad = g
    if spec.weight_decay:  # grad = gradient + parameters * wd
        b.nodes.append(_attr_constant("wd", "weight_decay", TensorProto.FLOAT))
        grad = b.op("Add", [g, b.op("Mul", [p, "wd"], "p_wd")], "grad")
    # The buffer's final value is written directly as accum_out when nothing has to select it.
    accum_name = b.result("accum_out") if spec.momentum_nonzero else "accum_t"
    a_m = b.op("Mul", [a, m], "a_m")
    if spec.dampening:  # accum_t = accum * m + grad - grad * (1 - stat) * d
        b.nodes.append(_attr_constant("d", "dampening", TensorProto.FLOAT))
        accum_t0 = b.op("Add", [a_m, grad], "accum_t0")
        if spec.stat_zero:
            # (1 - (+0)) is exactly 1 and grad * 1 is grad bit for bit (-0, Inf and NaN included).
            damp_term = b.op("Mul", [grad, "d"], "damp_term")
        else:
            b.nodes.append(_float_constant("one", 1.0))
            one_minus_s = b.op("Sub", ["one", b.read("stat")], "one_minus_s")
            damp_term = b.op("Mul", [b.op("Mul", [grad, one_minus_s], "grad_1ms"), "d"], "damp_term")
        accum_t = b.op("Sub", [accum_t0, damp_term], accum_name)
    else:  # accum_t = accum * m + grad
        accum_t = b.op("Add", [a_m, grad], accum_name)
    p_name = b.result("parameters_out")
    if spec.nesterov:  # parameters - (grad + accum_t * m) * lr
        step = b.op("Add", [grad, b.op("Mul", [accum_t, m], "accum_t_m")], "nesterov_step")
        p_out = b.op("Sub", [p, b.op("Mul", [step, lr], "delta")], p_name)
    else:  # parameters - accum_t * lr
        p_out = b.op("Sub", [p, b.op("Mul", [accum_t, lr], "delta")], p_name)
    b.write(p_out, "parameters_out")
    _specialised_state_outputs(b, spec, a, accum_t, m)
    return b.nodes


def _specialised_state_outputs(b: _Body, spec: Specialisation, a: str, accum_t: str, m: str) -> None:
    """``accum_out`` and ``stat_out``: if m != 0 accum_t and 0, else the inputs as they are."""
    if spec.momentum_nonzero:
        b.write(accum_t, "accum_out")
    else:
        b.nodes.append(_float_constant("zero", 0.0))
        m_is_zero = b.op("Equal", [m, "zero"], "m_is_zero")
        # In FLOAT, as in the general body (If has no BFLOAT16 before opset 16); exact round trip.
        b.nodes.append(_select(m_is_zero, a, accum_t, b.result("accum_out")))
        b.write(b.result("accum_out"), "accum_out")
    if spec.stat_zero:
        # stat is +0 everywhere, and the contract's stat_out is +0 both ways (written 0, or kept).
        b.op("Identity", ["stat"], "stat_out")
        return
    low = spec.dtype == TensorProto.BFLOAT16  # onnxruntime's CPU ConstantOfShape has no BFLOAT16
    zero_dtype = TensorProto.FLOAT if low else spec.dtype
    zero = helper.make_tensor("value", zero_dtype, [1], [0.0])
    shape = b.op("Shape", ["stat"], "stat_shape")
    if spec.momentum_nonzero:
        zeros = b.op("ConstantOfShape", [shape], "stat_zeros" if low else "stat_out", value=zero)
        if low:
            b.op("Cast", [zeros], "stat_out", to=spec.dtype)
        return
    # Selected in FLOAT and cast back, as the general body does (exact round trip).
    s = b.read("stat")
    zeros = b.op("ConstantOfShape", [shape], "stat_zeros", value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0]))
    b.nodes.append(_select("m_is_zero", s, zeros, b.result("stat_out")))
    b.write(b.result("stat_out"), "stat_out")


def _float_constant(output: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [output], value=helper.make_tensor(output, TensorProto.FLOAT, [], [value]))


def _select(condition: str, if_true: str, if_false: str, output: str) -> onnx.NodeProto:
    """``output = if_true if condition else if_false`` for a scalar BOOL ``condition``, bit for bit.

    An ``If`` whose branches are one ``Identity`` each: only the selected tensor reaches ``output``, with its
    bits (-0, NaN payloads) intact. onnxruntime's CPU ``Where`` would turn a selected -0 into +0
    (microsoft/onnxruntime#32191), and the contract's results must match the reference bit for bit.
    """

    def branch(source: str, tag: str) -> onnx.GraphProto:
        name = f"{output}_{tag}"
        return helper.make_graph(
            [helper.make_node("Identity", [source], [name])], name, [], [helper.make_value_info(name, onnx.TypeProto())]
        )

    return helper.make_node(
        "If", [condition], [output], then_branch=branch(if_true, "then"), else_branch=branch(if_false, "else")
    )


def _attr_constant(output: str, attribute: str, dtype: int) -> onnx.NodeProto:
    kind = "value_float" if dtype == TensorProto.FLOAT else "value_int"
    node = helper.make_node("Constant", [], [output])
    ref = onnx.AttributeProto()
    ref.name = kind
    ref.ref_attr_name = attribute
    ref.type = onnx.AttributeProto.FLOAT if dtype == TensorProto.FLOAT else onnx.AttributeProto.INT
    node.attribute.append(ref)
    return node


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (``""`` / ``ai.onnx``) opset version, 0 if it imports none."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


DEFAULT_OPSET_WHEN_ABSENT = 18
"""Opset declared for the default domain when a model imports none (a model of training-domain ops only,
like ONNX's own Momentum test cases): no existing node reads it, and the function body needs one."""


def function_opset(model: onnx.ModelProto) -> int:
    """The default-domain opset the SGD function will be declared against in ``model``: the model's own, or
    :data:`DEFAULT_OPSET_WHEN_ABSENT` when it imports none."""
    return default_opset(model) or DEFAULT_OPSET_WHEN_ABSENT


def sgd_functions_for(nodes: Iterable[onnx.NodeProto], opset: int) -> list[onnx.FunctionProto]:
    """One FunctionProto per distinct overload the SGD nodes among ``nodes`` call, general body first;
    the general body alone when there is no SGD node.

    Raises:
        ValueError: ``opset`` below 15, or a node calls an overload name no :class:`Specialisation` has.
    """
    return _sgd_functions({node.overload for node in nodes if is_sgd_node(node)}, opset)


def sgd_functions_for_overloads(overloads: Iterable[str], opset: int) -> list[onnx.FunctionProto]:
    """One FunctionProto per overload name in ``overloads`` (``""``: the general body), sorted by name; the
    general body alone when ``overloads`` is empty.

    Raises:
        ValueError: ``opset`` below 15, or an overload name no :class:`Specialisation` has.
    """
    return _sgd_functions(set(overloads), opset)


def _sgd_functions(overloads: set[str], opset: int) -> list[onnx.FunctionProto]:
    return [make_sgd_function(opset, Specialisation.from_overload(o) if o else None) for o in sorted(overloads) or [""]]


def ensure_sgd_function(model: onnx.ModelProto, overloads: Iterable[str] | None = None) -> None:
    """Declare the ``ai.sgdfuse`` domain and add the SGD FunctionProtos the model's SGD nodes call (the
    general one when there is none) to ``model`` (in place), each once. ``overloads``: the overloads the
    model's SGD nodes call, when the caller knows them (a rewrite that made the nodes); else read from them.

    A model with no default-domain import gets one (:data:`DEFAULT_OPSET_WHEN_ABSENT`); the IR version is
    raised to 8 if lower, the first with model-local functions, and to :data:`OVERLOAD_IR_VERSION` when a
    node calls a specialised body.

    Raises:
        ValueError: the model's default-domain opset is below 15 (the body needs ``CastLike``), or a node
            calls an unknown overload.
    """
    if default_opset(model) == 0:
        model.opset_import.append(helper.make_opsetid("", DEFAULT_OPSET_WHEN_ABSENT))
    if model.ir_version < 8:
        model.ir_version = 8
    if not any(entry.domain == DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OP_VERSION))
    present = {f.overload for f in model.functions if f.domain == DOMAIN and f.name == OP_TYPE}
    opset = default_opset(model)
    functions = sgd_functions_for(model.graph.node, opset) if overloads is None else _sgd_functions(set(overloads), opset)
    for function in functions:
        if function.overload not in present:
            model.functions.append(function)
            present.add(function.overload)
    if any(present - {""}) and model.ir_version < OVERLOAD_IR_VERSION:
        model.ir_version = OVERLOAD_IR_VERSION
