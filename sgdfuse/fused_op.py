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
"""

from __future__ import annotations

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


def make_sgd_node(
    inputs: tuple[str, str, str, str, str, str],
    outputs: tuple[str, str, str],
    attributes: SgdAttributes,
    *,
    name: str,
) -> onnx.NodeProto:
    """An ``ai.sgdfuse::SGD`` node.

    Args:
        inputs: value names in contract order (parameters, gradient, learning_rate, accum, momentum, stat).
        outputs: value names for (parameters_out, accum_out, stat_out).
        attributes: checked against the contract first.
        name: the node name.

    Raises:
        AttributeContractError: the attributes break the contract.
    """
    attributes.check(subject=name)
    return helper.make_node(
        OP_TYPE,
        list(inputs),
        list(outputs),
        name=name,
        domain=DOMAIN,
        dampening=float(attributes.dampening),
        weight_decay=float(attributes.weight_decay),
        nesterov=int(bool(attributes.nesterov)),
    )


def is_sgd_node(node: onnx.NodeProto) -> bool:
    """True for an ``ai.sgdfuse::SGD`` node."""
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def read_sgd_attributes(node: onnx.NodeProto) -> SgdAttributes:
    """The attributes of an ``ai.sgdfuse::SGD`` node, contract defaults filled in."""
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return SgdAttributes(
        dampening=float(values.get("dampening", 0.0)),
        weight_decay=float(values.get("weight_decay", 0.0)),
        nesterov=bool(values.get("nesterov", 0)),
    )


def make_sgd_function(opset: int) -> onnx.FunctionProto:
    """The model-local FunctionProto for ``ai.sgdfuse::SGD`` whose body is the contract.

    Args:
        opset: the default-domain opset the body is declared against (the model's own), >= 15.

    Raises:
        ValueError: ``opset`` is below 15.
    """
    if opset < MIN_OPSET:
        raise ValueError(f"the SGD function body needs default-domain opset >= {MIN_OPSET}, got {opset}")
    n = helper.make_node
    body = [
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
    function = helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUT_NAMES),
        list(OUTPUT_NAMES),
        body,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[],
        doc_string="Ascend SGD operator contract (sgdfuse, docs/contract.md): FLOAT intermediates, "
        "results cast back with round-to-nearest-even.",
    )
    function.attribute_proto.extend(
        [
            helper.make_attribute("dampening", 0.0),
            helper.make_attribute("weight_decay", 0.0),
            helper.make_attribute("nesterov", 0),
        ]
    )
    return function


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


def ensure_sgd_function(model: onnx.ModelProto) -> None:
    """Declare the ``ai.sgdfuse`` domain and add the SGD FunctionProto to ``model`` (in place) if absent.

    A model with no default-domain import gets one (:data:`DEFAULT_OPSET_WHEN_ABSENT`); the IR version is
    raised to 8 if lower, the first with model-local functions.

    Raises:
        ValueError: the model's default-domain opset is below 15 (the body needs ``CastLike``).
    """
    if default_opset(model) == 0:
        model.opset_import.append(helper.make_opsetid("", DEFAULT_OPSET_WHEN_ABSENT))
    if model.ir_version < 8:
        model.ir_version = 8
    if not any(entry.domain == DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OP_VERSION))
    if not any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions):
        model.functions.append(make_sgd_function(default_opset(model)))
