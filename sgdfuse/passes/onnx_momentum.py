"""Source form: ONNX's own training op ``ai.onnx.preview.training::Momentum`` → ``ai.sgdfuse::SGD``.

The ONNX operator (onnx/defs/training/defs.cc; the reference in onnx/reference/ops/aionnx_preview_training/
op_momentum.py) computes, per tensor X with gradient G and buffer V, learning rate R and step count T:

    G_regularized = norm_coefficient * X + G
    beta_adjusted = T > 0 ? beta : 1
    V_new = alpha * V + beta_adjusted * G_regularized
    X_new = X - R * V_new                                   (mode "standard")
    X_new = X - R * (G_regularized + alpha * V_new)         (mode "nesterov")

Against the contract (docs/contract.md) with m = alpha, wd = norm_coefficient, d = 1 - beta:
``accum_t = accum*m + grad - grad*(1 - stat)*d`` is ``alpha*V + beta*G_reg`` when stat = 0 and
``alpha*V + G_reg`` when stat = 1. So ``stat = (T <= 0)``, broadcast to X's shape, makes every step exact,
the old buffer included (unlike PyTorch, ONNX's first step keeps ``alpha*V``). The parameter updates are the
contract's plain and Nesterov forms. Not expressible, hence refused: alpha == 0 (the contract then keeps the
old buffer, ONNX writes ``beta*G_reg``), Nesterov with beta != 1 (the contract needs dampening 0 with
Nesterov), norm_coefficient < 0, and DOUBLE tensors.

onnxruntime does not run the preview training domain, so each conversion is checked by running the original
node with ``onnx.reference.ReferenceEvaluator`` and the converted nodes with onnxruntime.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from sgdfuse.contract import SgdAttributes, check_attributes, dtype_name
from sgdfuse.errors import ContractError
from sgdfuse.fused_op import DOMAIN, OP_VERSION, ensure_sgd_function, function_opset, make_sgd_function, make_sgd_node
from sgdfuse.passes.index import GraphIndex
from sgdfuse.passes.sgd_match import Miss
from sgdfuse.runtime import make_session, onnx_to_numpy_dtype, run

__all__ = ["TRAINING_DOMAIN", "MomentumConversion", "convert_momentum_nodes"]

logger = logging.getLogger(__name__)

TRAINING_DOMAIN = "ai.onnx.preview.training"
_SUPPORTED = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclasses.dataclass
class MomentumConversion:
    """One tensor of a ``Momentum`` node converted into an SGD node.

    Attributes:
        node: the original Momentum node's name; tensor: position of the tensor in it.
        parameters, gradient, accum, parameters_out, accum_out: value names.
        learning_rate: the value fed as ``learning_rate`` (R, cast when needed); step_count: T.
        momentum, dampening, weight_decay, nesterov: the mapped hyper-parameters.
        dtype, shape: of X.
    """

    node: str
    tensor: int
    parameters: str
    gradient: str
    accum: str
    parameters_out: str
    accum_out: str
    learning_rate: str
    step_count: str
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    dtype: int
    shape: tuple | None
    sgd_node: str = ""
    max_abs_error: float = 0.0


def _state_writers(model: onnx.ModelProto) -> dict[str, list[str]]:
    """State tensor (X or V) → the Momentum nodes (and slots) that update it: two entries mean two writers,
    whether two nodes share a buffer or one node lists a weight twice."""
    writers: dict[str, list[str]] = {}
    for position, node in enumerate(model.graph.node):
        if node.op_type != "Momentum" or node.domain != TRAINING_DOMAIN:
            continue
        name = node.name or f"Momentum_{position}"
        count = (len(node.input) - 2) // 3
        for i in range(count):
            for state in (node.input[2 + i], node.input[2 + 2 * count + i]):
                writers.setdefault(state, []).append(f"Momentum node {name} tensor {i}")
    return writers


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def convert_momentum_nodes(
    model: onnx.ModelProto, index: GraphIndex, *, verify: bool = True, steps: int = 3, seed: int = 0
) -> tuple[onnx.ModelProto, list[MomentumConversion], list[Miss]]:
    """A new model with every convertible ``Momentum`` node replaced by SGD nodes (``model`` untouched).

    A node converts whole or not at all: if any of its tensors is refused, or its check fails, the node is
    kept and every reason is reported.
    """
    taken = set(index.producer) | set(index.initializers) | set(index.graph_inputs) | set(index.consumers)
    taken |= {n.name for n in model.graph.node if n.name}

    def fresh(base: str) -> str:
        name, counter = base, 1
        while name in taken:
            name = f"{base}_{counter}"
            counter += 1
        taken.add(name)
        return name

    replacements: dict[int, tuple[list[onnx.NodeProto], list[onnx.TensorProto]]] = {}
    conversions: list[MomentumConversion] = []
    misses: list[Miss] = []
    opset = function_opset(model)
    writers = _state_writers(model)
    for position, node in enumerate(model.graph.node):
        if node.op_type != "Momentum" or node.domain != TRAINING_DOMAIN:
            continue
        name = node.name or f"Momentum_{position}"
        attributes = _attributes(node)
        alpha = float(attributes.get("alpha", 0.0))
        beta = float(attributes.get("beta", 0.0))
        wd = float(attributes.get("norm_coefficient", 0.0))
        mode = attributes.get("mode", b"standard")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        count = (len(node.input) - 2) // 3
        problems: list[str] = []
        if opset < 15:
            problems.append(f"default-domain opset {opset} < 15 (the SGD function body needs CastLike)")
        if alpha == 0:
            problems.append("alpha (momentum) is 0: ONNX writes V_new = beta*G_reg, the contract keeps the old buffer")
        try:
            check_attributes(1.0 - beta, wd, mode == "nesterov", subject=name)
        except ContractError as error:
            problems.append(str(error) + " (beta must be 1 for Nesterov, since dampening = 1 - beta)")
        r, t = node.input[0], node.input[1]
        for state in sorted({n for n in node.input[2 : 2 + count] + node.input[2 + 2 * count : 2 + 3 * count]}):
            if len(writers.get(state, ())) > 1:
                others = ", ".join(writers[state])
                problems.append(
                    f"{state} is updated more than once ({others}); fused in place, each update would write it "
                    "(one writer per state)"
                )
        node_conversions: list[MomentumConversion] = []
        for i in range(count):
            x, g, v = node.input[2 + i], node.input[2 + count + i], node.input[2 + 2 * count + i]
            x_new, v_new = node.output[i], node.output[count + i]
            spec = index.spec(x)
            if spec.dtype not in _SUPPORTED:
                problems.append(f"{x} is {dtype_name(spec.dtype)}; the SGD operator takes FLOAT, FLOAT16, BFLOAT16")
            node_conversions.append(
                MomentumConversion(name, i, x, g, v, x_new, v_new, r, t, alpha, 1.0 - beta, wd, mode == "nesterov", spec.dtype, spec.shape)
            )
        if problems:
            reason = "shared-state" if any("one writer per state" in problem for problem in problems) else "momentum-op"
            for c in node_conversions:
                misses.append(Miss(c.parameters_out, reason, f"Momentum node {name}, tensor {c.parameters}: " + "; ".join(problems)))
            continue

        new_nodes: list[onnx.NodeProto] = []
        initializers: list[onnx.TensorProto] = []
        base = f"sgdfuse/{name}"
        first = fresh(f"{base}/first_step")
        zero_t = fresh(f"{base}/zero_step")
        new_nodes.append(helper.make_node("Constant", [], [zero_t], name=fresh(f"{base}/Constant"),
                                          value=numpy_helper.from_array(np.zeros((), dtype=np.int64), name="value")))
        new_nodes.append(helper.make_node("LessOrEqual", [t, zero_t], [first], name=fresh(f"{base}/LessOrEqual")))
        for c in node_conversions:
            np_dtype = onnx_to_numpy_dtype(c.dtype)
            lr = c.learning_rate
            if index.spec(lr).dtype != c.dtype:
                lr = fresh(f"{base}/learning_rate_{c.tensor}")
                new_nodes.append(helper.make_node("Cast", [c.learning_rate], [lr], to=c.dtype, name=fresh(f"{base}/Cast")))
            momentum = fresh(f"{base}/momentum_{c.tensor}")
            initializers.append(numpy_helper.from_array(np.array(alpha, dtype=np.float32).astype(np_dtype), name=momentum))
            shape = fresh(f"{base}/shape_{c.tensor}")
            flag = fresh(f"{base}/first_step_flag_{c.tensor}")
            stat = fresh(f"{base}/stat_{c.tensor}")
            new_nodes.append(helper.make_node("Shape", [c.parameters], [shape], name=fresh(f"{base}/Shape")))
            new_nodes.append(helper.make_node("Cast", [first], [flag], to=c.dtype, name=fresh(f"{base}/Cast")))
            new_nodes.append(helper.make_node("Expand", [flag, shape], [stat], name=fresh(f"{base}/Expand")))
            sgd = make_sgd_node(
                (c.parameters, c.gradient, lr, c.accum, momentum, stat),
                (c.parameters_out, c.accum_out, fresh(f"{base}/stat_out_{c.tensor}")),
                SgdAttributes(c.dampening, c.weight_decay, c.nesterov),
                name=fresh(f"{base}/SGD_{c.tensor}"),
            )
            c.sgd_node = sgd.name
            new_nodes.append(sgd)
        if verify:
            failure = _check(model, index, node, new_nodes, initializers, node_conversions, steps=steps, seed=seed)
            if failure:
                for c in node_conversions:
                    misses.append(Miss(c.parameters_out, "verification-failed", f"Momentum node {name}: {failure}"))
                continue
        replacements[position] = (new_nodes, initializers)
        conversions.extend(node_conversions)

    if not replacements:
        result = onnx.ModelProto()
        result.CopyFrom(model)
        return result, conversions, misses
    result = onnx.ModelProto()
    result.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    for position, node in enumerate(model.graph.node):
        if position in replacements:
            nodes.extend(replacements[position][0])
        else:
            nodes.append(node)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    for _, initializers in replacements.values():
        result.graph.initializer.extend(initializers)
    ensure_sgd_function(result)
    return result, conversions, misses


def _check(
    model: onnx.ModelProto,
    index: GraphIndex,
    node: onnx.NodeProto,
    new_nodes: list[onnx.NodeProto],
    initializers: list[onnx.TensorProto],
    conversions: list[MomentumConversion],
    *,
    steps: int,
    seed: int,
) -> str:
    """Run the node (ReferenceEvaluator) and its conversion (onnxruntime) on the same inputs with T = 0, 1,
    ...; "" when every output is within the verification bound, else what differed."""
    from sgdfuse.verify import difference, error_bound_values

    inputs = list(dict.fromkeys(i for i in node.input if i))
    outputs = list(node.output)

    def value_info(name: str) -> onnx.ValueInfoProto:
        spec = index.spec(name)
        return helper.make_tensor_value_info(name, spec.dtype, None if spec.shape is None else list(spec.shape))

    original = helper.make_model(
        helper.make_graph([node], "momentum", [value_info(n) for n in inputs], [helper.make_empty_tensor_value_info(n) for n in outputs]),
        opset_imports=list(model.opset_import),
    )
    opsets = [o for o in model.opset_import if o.domain not in (DOMAIN, "", "ai.onnx")]
    opsets += [helper.make_opsetid("", function_opset(model)), helper.make_opsetid(DOMAIN, OP_VERSION)]
    converted = helper.make_model(
        helper.make_graph(new_nodes, "converted", [value_info(n) for n in inputs], [helper.make_empty_tensor_value_info(n) for n in outputs], initializer=initializers),
        opset_imports=opsets,
    )
    converted.functions.append(make_sgd_function(function_opset(model)))
    reference = ReferenceEvaluator(original)
    session = make_session(converted)

    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name in inputs:
        spec = index.spec(name)
        if spec.shape is None or any(not isinstance(d, int) for d in spec.shape):
            return f"cannot verify: the shape of {name} is not static"
        dtype = onnx_to_numpy_dtype(spec.dtype)
        if name == node.input[0]:
            feeds[name] = np.array(rng.uniform(0.01, 0.1), dtype=np.float32).astype(dtype).reshape(spec.shape)
        elif name != node.input[1]:
            feeds[name] = rng.standard_normal(spec.shape).astype(np.float32).astype(dtype)
    for step in range(steps):
        feeds[node.input[1]] = np.full(index.spec(node.input[1]).shape or (), step, dtype=onnx_to_numpy_dtype(index.spec(node.input[1]).dtype))
        want = dict(zip(outputs, reference.run(None, feeds)))
        have = run(session, feeds, outputs)
        lr = float(np.asarray(feeds[node.input[0]], dtype=np.float64).reshape(-1)[0])
        for c in conversions:
            bounds = error_bound_values(
                c.momentum, c.dampening, c.weight_decay, c.nesterov, feeds[c.parameters], feeds[c.gradient], feeds[c.accum], lr, c.dtype
            )
            for name, bound in zip((c.parameters_out, c.accum_out), bounds):
                w = np.asarray(want[name], dtype=np.float64)
                h = np.asarray(have[name], dtype=np.float64)
                error = difference(w, h)
                c.max_abs_error = max(c.max_abs_error, float(np.max(error)))
                if np.any(~(error <= bound)):
                    k = int(np.argmax(error - bound))
                    return (
                        f"step {step + 1}: {name}[{k}] is {h.reshape(-1)[k]!r} converted vs {w.reshape(-1)[k]!r} "
                        f"(ReferenceEvaluator); bound {bound.reshape(-1)[k]:.3g}"
                    )
        for c in conversions:
            feeds[c.parameters] = np.asarray(want[c.parameters_out]).astype(feeds[c.parameters].dtype)
            feeds[c.accum] = np.asarray(want[c.accum_out]).astype(feeds[c.accum].dtype)
            feeds[c.gradient] = rng.standard_normal(feeds[c.gradient].shape).astype(np.float32).astype(feeds[c.gradient].dtype)
    return ""
