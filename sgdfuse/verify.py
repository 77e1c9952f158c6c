"""Differential checks with onnxruntime: the fused update computes what the original computed.

The check is local (seed 002: evaluate only what a check needs): the matched slice of the original graph
(the update's nodes, fed its leaves as inputs) runs beside the fused slice (the SGD node and its helpers)
for several chained steps. Slices of all updates are batched into one model each, so one onnxruntime
session per side checks every update; an update whose outputs differ is reported and not applied.

Tolerance (derived, per element, per step). Both sides compute the same real value y from the same inputs;
each rounds every operation once. With unit roundoff u of the parameters' dtype (FLOAT 2^-24, FLOAT16 2^-11,
BFLOAT16 2^-8) and at most ``OPERATIONS`` roundings on either path, the standard forward error bound gives
``|computed - y| <= OPERATIONS·u·S`` to first order, where S is the sum of the magnitudes of every term the
update adds (for the buffer: ``|m·a| + (1+|d|)·(|g| + wd·|p|)``; for the weights: ``|p| + |lr|·S_buffer``,
Nesterov adds ``|lr|·(|g| + wd·|p|)`` and scales ``S_buffer`` by ``|m|``). The two sides differ by at most
the sum of their errors, so the check allows ``2·OPERATIONS·u·S`` plus a few subnormal spacings. For
FLOAT16/BFLOAT16 graphs whose original math is FLOAT16/BFLOAT16 this is what covers the original's own
per-operation rounding against the contract's FLOAT intermediates; it is not loosened further.
Steps are lockstep: both sides get the same inputs at every step (the original's outputs of the step before),
so the bound stays a one-step bound while the state evolves as in training.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from sgdfuse.external_data import tensor_to_array
from sgdfuse.passes.index import GraphIndex
from sgdfuse.passes.rewrite import Plan, _reads
from sgdfuse.runtime import make_session, onnx_to_numpy_dtype, run

__all__ = ["OPERATIONS", "UpdateCheck", "ModelCheck", "verify_plans", "check_models", "error_bound", "error_bound_values", "unit_roundoff", "difference"]

logger = logging.getLogger(__name__)

BATCH_UPDATES = 100
"""Updates checked per onnxruntime session pair (see :func:`verify_plans`)."""

OPERATIONS = 8
"""Upper bound on the roundings either side performs for one output element (the contract: grad, accum·m,
+grad, (1-stat), ·d, -, ·lr (·m, +grad for Nesterov), and the final cast)."""

_UNIT_ROUNDOFF = {onnx.TensorProto.FLOAT: 2.0**-24, onnx.TensorProto.FLOAT16: 2.0**-11, onnx.TensorProto.BFLOAT16: 2.0**-8}
_SMALLEST_SUBNORMAL = {onnx.TensorProto.FLOAT: 2.0**-149, onnx.TensorProto.FLOAT16: 2.0**-24, onnx.TensorProto.BFLOAT16: 2.0**-133}


def unit_roundoff(dtype: int) -> float:
    """Unit roundoff (half the machine epsilon) of an ONNX float dtype."""
    return _UNIT_ROUNDOFF[dtype]


@dataclasses.dataclass
class UpdateCheck:
    """The verification of one fused update.

    Attributes:
        parameters_out: the update's new-weights output (identifies the update).
        steps: chained steps run.
        passed: every element of both outputs within the bound at every step.
        max_abs_error: largest |fused - original| over both outputs and all steps.
        max_bound_ratio: largest |fused - original| / bound (<= 1 when passed).
        message: why it failed, or "".
    """

    parameters_out: str
    steps: int
    passed: bool
    max_abs_error: float
    max_bound_ratio: float
    message: str = ""


def error_bound(plan, p: np.ndarray, g: np.ndarray, a: np.ndarray, lr: float, dtype: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds ``(weights, buffer)`` on |fused - original| for one step of ``plan``'s update
    (see the module docstring); a runtime momentum is bounded by 1 in magnitude."""
    match = plan.match
    m = abs(float(match.momentum.constant_value)) if match.momentum.is_constant else 1.0
    return error_bound_values(m, match.dampening, match.weight_decay, match.nesterov, p, g, a, lr, dtype)


def error_bound_values(
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    p: np.ndarray,
    g: np.ndarray,
    a: np.ndarray,
    lr: float,
    dtype: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds ``(weights, buffer)`` on |fused - original| for one step (module docstring).

    Args:
        momentum, dampening, weight_decay, nesterov: the update's hyper-parameters.
        p, g, a: the step's parameters, gradient and buffer (any float dtype; computed in float64).
        lr: the learning rate of the step.
        dtype: the parameters' ONNX dtype (FLOAT, FLOAT16 or BFLOAT16).
    """
    m, d, wd = abs(momentum), abs(dampening), abs(weight_decay)
    p64, g64, a64 = (np.abs(np.asarray(x, dtype=np.float64)) for x in (p, g, a))
    grad = g64 + wd * p64
    s_buffer = m * a64 + (1 + d) * grad
    if nesterov:
        s_weights = p64 + abs(lr) * (grad + m * s_buffer)
    else:
        s_weights = p64 + abs(lr) * s_buffer
    u = _UNIT_ROUNDOFF[dtype]
    floor = 4 * _SMALLEST_SUBNORMAL[dtype]
    return 2 * OPERATIONS * u * s_weights + floor, 2 * OPERATIONS * u * s_buffer + floor


def difference(want: np.ndarray, have: np.ndarray) -> np.ndarray:
    """Elementwise |have - want| in float64; equal values (Inf included) and NaN against NaN count 0, any other
    NaN or Inf mismatch counts Inf. Non-float arrays: 0 where equal, Inf where not."""
    want, have = np.asarray(want), np.asarray(have)
    if want.dtype.kind not in "fV" and want.dtype.name != "bfloat16":
        return np.where(want == have, 0.0, np.inf)
    want, have = want.astype(np.float64), have.astype(np.float64)
    with np.errstate(invalid="ignore"):
        same = (want == have) | (np.isnan(want) & np.isnan(have))
        return np.nan_to_num(np.where(same, 0.0, np.abs(have - want)), nan=np.inf)


def _slice_model(
    index: GraphIndex,
    nodes: Sequence[onnx.NodeProto],
    initializers: Sequence[onnx.TensorProto],
    outputs: Sequence[str],
    opset_import: Sequence[onnx.OperatorSetIdProto],
    functions: Sequence[onnx.FunctionProto],
) -> tuple[onnx.ModelProto, list[str]]:
    """A model of ``nodes`` whose inputs are every value they read that nothing in the slice defines."""
    produced = {o for node in nodes for o in node.output if o}
    own = {t.name for t in initializers}
    needed_initializers: list[onnx.TensorProto] = list(initializers)
    inputs: list[str] = []
    for node in nodes:
        for name in _reads(node):  # subgraph bodies read outer values too
            if not name or name in produced or name in own or name in inputs:
                continue
            tensor = index.initializers.get(name)
            # An initializer whose data is external (not loaded) is fed like an input: onnxruntime would
            # resolve its location against the current directory, unchecked (sgdfuse.external_data).
            if tensor is not None and name not in index.graph_inputs and tensor.data_location != onnx.TensorProto.EXTERNAL:
                needed_initializers.append(tensor)
                own.add(name)
            else:
                inputs.append(name)
    graph = helper.make_graph(
        list(nodes),
        "sgdfuse_slice",
        [_value_info(index, name) for name in inputs],
        [helper.make_empty_tensor_value_info(name) for name in outputs],
        initializer=needed_initializers,
    )
    model = helper.make_model(graph, opset_imports=list(opset_import))
    model.ir_version = max(model.ir_version, 8)
    model.functions.extend(functions)
    return model, inputs


def _value_info(index: GraphIndex, name: str) -> onnx.ValueInfoProto:
    spec = index.spec(name)
    return helper.make_tensor_value_info(name, spec.dtype, None if spec.shape is None else list(spec.shape))


def _feed(index: GraphIndex, name: str, rng: np.random.Generator, scale: float = 1.0, step: int = 0) -> np.ndarray:
    spec = index.spec(name)
    if spec.shape is None or any(d is None for d in spec.shape):
        raise ValueError(f"cannot verify: the shape of {name} is unknown")
    shape = tuple(2 if isinstance(d, str) else d for d in spec.shape)
    dtype = onnx_to_numpy_dtype(spec.dtype)
    if spec.dtype in _UNIT_ROUNDOFF or spec.dtype == onnx.TensorProto.DOUBLE:
        if int(np.prod(shape)) == 1:
            # A runtime scalar feeding the update (a learning rate fed as an input): a learning-rate-like value.
            return rng.uniform(0.01, 0.1, size=shape).astype(np.float32).astype(dtype)
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        # Integer scalars are read as step counters (0 on the first step, then 1, 2, ...); integer tensors
        # (class labels, say) are zeros, valid for any number of classes.
        return np.full(shape, step if int(np.prod(shape)) == 1 else 0, dtype=dtype)
    if dtype == np.bool_:
        return np.full(shape, step == 0, dtype=bool)
    raise ValueError(f"cannot verify: no test data for {name} of dtype {dtype}")


def verify_plans(
    model: onnx.ModelProto,
    index: GraphIndex,
    plans: Sequence[Plan],
    *,
    steps: int = 3,
    seed: int = 0,
    shared: dict[str, onnx.TensorProto] | None = None,
) -> list[UpdateCheck]:
    """Run the original and the fused slices of ``plans`` for ``steps`` lockstep steps; one result per
    plan, in order. Exceptions from onnxruntime on the batch fall back to one plan at a time, and a plan
    that still fails to run is reported as not passed with the error.

    ``shared``: the scalar initializers of every plan (plans share constants: the plan that made one owns
    it), so that a batch can include what its plans read; computed from ``plans`` when not given.
    """
    if not plans:
        return []
    if shared is None:
        shared = {t.name: t for plan in plans for t in plan.initializers}
    if len(plans) > BATCH_UPDATES:
        # onnxruntime's session creation grows faster than linearly with the graph: check in fixed-size
        # batches so the whole check stays linear in the number of updates.
        results: list[UpdateCheck] = []
        for start in range(0, len(plans), BATCH_UPDATES):
            results.extend(verify_plans(model, index, plans[start : start + BATCH_UPDATES], steps=steps, seed=seed + start, shared=shared))
        return results
    try:
        return _verify_batch(model, index, plans, steps=steps, seed=seed, shared=shared)
    except Exception as error:  # one bad slice must not sink the others: retry one by one
        if len(plans) == 1:
            return [UpdateCheck(plans[0].match.parameters_out, 0, False, float("nan"), float("nan"), f"could not run: {error}")]
        logger.info("batched verification failed (%s); verifying one update at a time", error)
        results = []
        for plan in plans:
            results.extend(verify_plans(model, index, [plan], steps=steps, seed=seed, shared=shared))
        return results


def _verify_batch(
    model: onnx.ModelProto, index: GraphIndex, plans: Sequence[Plan], *, steps: int, seed: int, shared: dict[str, onnx.TensorProto]
) -> list[UpdateCheck]:
    from sgdfuse.fused_op import OVERLOAD_IR_VERSION, sgd_functions_for, function_opset, DOMAIN, OP_VERSION

    from sgdfuse.passes.rewrite import _stable_topological_sort

    outputs = [name for plan in plans for name in (plan.match.parameters_out, plan.match.accum_out)]
    cone = sorted(set().union(*(plan.match.nodes for plan in plans)))
    original_nodes = [index.graph.node[i] for i in cone]
    # Gradients computed inside the cone (a sum of contributions) are read back for the error bound.
    produced = {o for node in original_nodes for o in node.output}
    inner_gradients = [plan.match.gradient for plan in plans if plan.match.gradient in produced]
    original, original_inputs = _slice_model(index, original_nodes, [], outputs + inner_gradients, model.opset_import, [])
    opsets = list(model.opset_import)
    if not any(o.domain == DOMAIN for o in opsets):
        opsets.append(helper.make_opsetid(DOMAIN, OP_VERSION))
    # The fused side is the rewrite as it will be applied: the cone minus the producers of the replaced
    # outputs, plus every plan's nodes (what computes a gradient inside the cone stays).
    replaced = set(outputs)
    entries = [((i, 0), index.graph.node[i]) for i in cone if not replaced.intersection(index.graph.node[i].output)]
    for plan in plans:
        anchor = max(plan.match.nodes) if plan.match.nodes else 0
        entries.extend(((anchor, 1 + j), node) for j, node in enumerate(plan.nodes))
    fused_nodes = _stable_topological_sort(entries, available=set())
    read = {name for node in fused_nodes for name in node.input}
    fused_initializers = [tensor for name, tensor in shared.items() if name in read]
    fused, fused_inputs = _slice_model(
        index, fused_nodes, fused_initializers, outputs, opsets, sgd_functions_for(fused_nodes, function_opset(model))
    )
    # The fused side runs the bodies the output model will call (specialised overloads need IR 10).
    fused.ir_version = max(fused.ir_version, OVERLOAD_IR_VERSION)
    original_session, fused_session = make_session(original), make_session(fused)

    rng = np.random.default_rng(seed)
    state = {name for plan in plans for name in (plan.match.parameters, plan.match.accum)}
    feeds: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(original_inputs + fused_inputs):
        feeds[name] = _feed(index, name, rng, scale=0.1 if any(name == p.match.accum for p in plans) else 1.0)

    checks = {plan.match.parameters_out: [0.0, 0.0, True, ""] for plan in plans}
    for step in range(steps):
        got_original = run(original_session, {k: feeds[k] for k in original_inputs}, outputs + inner_gradients)
        got_fused = run(fused_session, {k: feeds[k] for k in fused_inputs}, outputs)
        for plan in plans:
            match = plan.match
            lr = _learning_rate_value(plan, feeds)
            gradient = _value(match.gradient, got_original, feeds, index)
            bound_w, bound_v = error_bound(plan, feeds[match.parameters], gradient, feeds[match.accum], lr, match.dtype)
            entry = checks[match.parameters_out]
            for name, bound in ((match.parameters_out, bound_w), (match.accum_out, bound_v)):
                want, have = np.asarray(got_original[name]), np.asarray(got_fused[name])
                if want.shape != have.shape:
                    entry[2] = False
                    entry[3] = f"step {step + 1}: {name} has shape {have.shape}, the original {want.shape}"
                    continue
                error = difference(want, have)
                ratio = float(np.max(error / bound)) if error.size else 0.0
                entry[0] = max(entry[0], float(np.max(error)) if error.size else 0.0)
                entry[1] = max(entry[1], ratio)
                if ratio > 1 and entry[2]:
                    worst = int(np.argmax(error / bound))
                    entry[2] = False
                    entry[3] = (
                        f"step {step + 1}: {name}[{worst}] is {float(have.reshape(-1)[worst])!r} fused vs "
                        f"{float(want.reshape(-1)[worst])!r} original; |difference| {error.reshape(-1)[worst]:.3g} exceeds "
                        f"the bound {bound.reshape(-1)[worst]:.3g}"
                    )
        # Next step: the original's new state, fresh gradients and other inputs.
        for plan in plans:
            feeds[plan.match.parameters] = got_original[plan.match.parameters_out]
            feeds[plan.match.accum] = got_original[plan.match.accum_out]
        for name in feeds:
            if name not in state:
                feeds[name] = _feed(index, name, rng, step=step + 1)
    return [
        UpdateCheck(name, steps, passed, max_abs, ratio, message)
        for name, (max_abs, ratio, passed, message) in checks.items()
    ]


def _value(name: str, computed: dict, feeds: dict, index: GraphIndex) -> np.ndarray:
    """A tensor's value in this step: computed by the slice, fed, or a (small) initializer."""
    if name in computed:
        return computed[name]
    if name in feeds:
        return feeds[name]
    return tensor_to_array(index.initializers[name])


def _learning_rate_value(plan: Plan, feeds: dict[str, np.ndarray]) -> float:
    poly = plan.match.learning_rate
    total = 0.0
    for monomial, coefficient in poly.terms.items():
        term = coefficient
        for symbol, power in monomial:
            term *= float(np.asarray(feeds[symbol], dtype=np.float64).reshape(-1)[0]) ** power
        total += term
    return total


@dataclasses.dataclass
class ModelCheck:
    """The result of :func:`check_models`.

    Attributes:
        steps: chained steps run.
        passed: every output agreed at every step.
        outputs: per graph output: ``{"name", "kind" ("fused update" or "exact"), "max_abs_error",
            "max_bound_ratio", "passed", "message"}``.
        state_pairs: graph output → graph input fed back between steps.
    """

    steps: int
    passed: bool
    outputs: list[dict]
    state_pairs: dict[str, str]


def check_models(original: onnx.ModelProto, fused: onnx.ModelProto, *, steps: int = 3, seed: int = 0) -> ModelCheck:
    """Run two whole models in onnxruntime on the same seeded inputs for ``steps`` lockstep steps.

    State pairs (new weights → weights, new buffer → buffer) come from matching ``original``; after each
    step the original's new state is fed to both. Outputs of updates that were fused are compared with the
    per-element bound of this module; every other output must be identical (NaN equal to NaN), since the
    rewrite leaves the nodes computing it untouched.

    Raises:
        ValueError: the two models do not have the same graph inputs and outputs, or an input's shape is
            unknown so no test data can be made.
    """
    from sgdfuse.passes.index import build_index
    from sgdfuse.passes.linear import Normaliser
    from sgdfuse.passes.rewrite import Planner
    from sgdfuse.passes.sgd_match import find_updates

    original_inputs = [i.name for i in original.graph.input if i.name not in {t.name for t in original.graph.initializer}]
    fused_inputs = [i.name for i in fused.graph.input if i.name not in {t.name for t in fused.graph.initializer}]
    outputs = [o.name for o in original.graph.output]
    if original_inputs != fused_inputs or outputs != [o.name for o in fused.graph.output]:
        raise ValueError("the two models differ in their graph inputs or outputs; they are not an original and its fused form")

    index = build_index(original)
    matches, _ = find_updates(index, Normaliser(index))
    planner = Planner(index)
    plans = {m.parameters_out: planner.plan(m) for m in matches}
    fused_outputs = {o for n in fused.graph.node if n.domain == "ai.sgdfuse" for o in n.output}
    plans = {k: v for k, v in plans.items() if k in fused_outputs}
    by_output = {}
    for plan in plans.values():
        by_output[plan.match.parameters_out] = (plan, "weights")
        by_output[plan.match.accum_out] = (plan, "buffer")
    pairs = {p.match.parameters_out: p.match.parameters for p in plans.values()}
    pairs.update({p.match.accum_out: p.match.accum for p in plans.values()})

    # Gradients computed inside the graph are read back for the bound.
    probe = onnx.ModelProto()
    probe.CopyFrom(original)
    extra = [p.match.gradient for p in plans.values() if p.match.gradient not in original_inputs]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in dict.fromkeys(extra))
    original_session, fused_session = make_session(probe), make_session(fused)

    rng = np.random.default_rng(seed)
    feeds = {name: _feed(index, name, rng) for name in original_inputs}
    results = {name: {"name": name, "kind": "fused update" if name in by_output else "exact", "max_abs_error": 0.0,
                      "max_bound_ratio": 0.0, "passed": True, "message": ""} for name in outputs}
    for step in range(steps):
        want_all = run(original_session, feeds, outputs + list(dict.fromkeys(extra)))
        have_all = run(fused_session, feeds, outputs)
        for name in outputs:
            want, have = np.asarray(want_all[name]), np.asarray(have_all[name])
            entry = results[name]
            if want.shape != have.shape:
                entry.update(passed=False, message=f"step {step + 1}: shape {have.shape} vs {want.shape}")
                continue
            if name in by_output:
                plan, role = by_output[name]
                match = plan.match
                gradient = _value(match.gradient, want_all, feeds, index)
                lr = _learning_rate_value(plan, feeds)
                bounds = error_bound(plan, feeds[match.parameters], gradient, feeds[match.accum], lr, match.dtype)
                bound = bounds[0] if role == "weights" else bounds[1]
            else:
                bound = np.zeros(want.shape)
            error = difference(want, have)
            worst = float(np.max(error)) if error.size else 0.0
            entry["max_abs_error"] = max(entry["max_abs_error"], worst)
            over = error > bound
            if error.size and np.any(over):
                k = int(np.argmax(over.reshape(-1)))
                ratio = float(np.max(np.where(bound > 0, error / np.where(bound > 0, bound, 1), np.inf)))
                entry["max_bound_ratio"] = max(entry["max_bound_ratio"], ratio)
                if entry["passed"]:
                    entry.update(
                        passed=False,
                        message=f"step {step + 1} (of {steps}): element {k} is {float(have.reshape(-1)[k])!r} fused vs "
                        f"{float(want.reshape(-1)[k])!r} original (allowed difference {bound.reshape(-1)[k]:.3g})",
                    )
            elif error.size and np.any(bound > 0):
                entry["max_bound_ratio"] = max(entry["max_bound_ratio"], float(np.max(error / np.where(bound > 0, bound, np.inf))))
        for output, state in pairs.items():
            feeds[state] = want_all[output]
        for name in original_inputs:
            if name not in pairs.values():
                feeds[name] = _feed(index, name, rng, step=step + 1)
    listed = list(results.values())
    return ModelCheck(steps, all(r["passed"] for r in listed), listed, pairs)
