"""Solve for the SGD roles in normalised update equations.

A candidate is a graph output ``W`` (new parameters) whose elementwise cone contains another graph output
``V`` (the new momentum buffer). With both normalised by :mod:`sgdfuse.passes.linear`, the contract
(shared/SGD-OPERATOR.md, with ``stat = 0``, which is what a step after the first computes) says

    V = m·A + (1-d)·s·G + (1-d)·wd·P                      (s = -1 for maximize, +1 otherwise)
    W = P - lr·V                                           (plain)
    W = P - lr·(s·G + wd·P) - lr·m·V  =  P - lr·(1+m)·V + lr·m·A      (Nesterov, d = 0)

so for a choice of the leaves ``A`` (old buffer) and ``P`` (old parameters), ``W - P = α·V + β·A`` must
hold exactly for two scalars α, β: β = 0 is plain momentum with lr = -α; otherwise Nesterov with
lr = β/m and α = -lr·(1+m). The gradient is whatever is left of ``V`` once ``m·A`` and the ``P`` term are
removed; it must be the value of one tensor in the graph (times a constant ±(1-d)). Any formulation with
these equations fuses; anything else is refused with the term that did not fit.
"""

from __future__ import annotations

import dataclasses
import logging

import onnx

from sgdfuse.contract import TensorSpec, check_attributes, dtype_name
from sgdfuse.errors import ContractError
from sgdfuse.passes.index import GraphIndex
from sgdfuse.passes.linear import ONE, Form, Normaliser, Poly, add_forms, format_form, format_poly, scale_form

__all__ = ["Match", "Miss", "find_updates", "coefficient_tolerance"]

logger = logging.getLogger(__name__)

_EPS = {onnx.TensorProto.FLOAT: 2.0**-23, onnx.TensorProto.FLOAT16: 2.0**-10, onnx.TensorProto.BFLOAT16: 2.0**-7}


def coefficient_tolerance(dtype: int) -> float:
    """Relative tolerance for comparing coefficients read from constants of ``dtype``.

    Exporters fold products of hyper-parameters (``-lr``, ``lr·m``, ``1 - d``) into one constant of the
    model's dtype; each fold rounds once. Four machine epsilons cover a product of up to three rounded
    factors; anything further apart is a different coefficient, not a rounding of the same one.
    """
    return 4 * _EPS.get(dtype, 2.0**-23)


@dataclasses.dataclass
class Match:
    """One momentum-SGD update found in the graph, with its roles solved.

    Attributes:
        parameters, gradient, accum: value names of the old weights, the gradient and the old buffer.
        parameters_out, accum_out: graph outputs holding the new weights and the new buffer.
        learning_rate, momentum: coefficients (constants or expressions of runtime scalars).
        dampening, weight_decay: compile-time constants (contract attributes).
        nesterov, maximize: the update's form; maximize means the gradient enters negated.
        dtype, shape: of the parameters (ONNX dtype code; dims, symbolic ones as strings).
        nodes: indices of the nodes of the matched cone (the update's nodes in the original graph).
        parameter_equation, accum_equation: the normalised equations, for the report.
    """

    parameters: str
    gradient: str
    accum: str
    parameters_out: str
    accum_out: str
    learning_rate: Poly
    momentum: Poly
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    dtype: int
    shape: tuple | None
    nodes: set[int]
    parameter_equation: str
    accum_equation: str


@dataclasses.dataclass
class Miss:
    """A candidate that did not fuse.

    Attributes:
        candidate: the graph output that looked like an update.
        reason: a stable reason code (see :data:`REASONS`).
        detail: one sentence saying what did not fit and what the user can do.
        equation: the update equation recovered from the graph, if any.
        nearest: the closest SGD form the solver reached, if any.
        differing: the term that differed between the two.
        score: how far the candidate got (higher is nearer); used to pick the nearest miss.
    """

    candidate: str
    reason: str
    detail: str
    equation: str = ""
    nearest: str = ""
    differing: str = ""
    score: int = 0


REASONS = {
    "no-momentum-buffer": "the parameter update reads no momentum buffer that the graph outputs (momentum 0 or absent)",
    "constant-state": "parameters or momentum buffer are constants (initializers), not state the graph is fed",
    "computed-state": "parameters or momentum buffer are computed inside the graph, not fed as state",
    "extra-term": "the parameter update has a term momentum SGD does not have",
    "no-gradient": "the buffer update has no gradient term",
    "gradient-not-a-value": "the gradient term is a sum that no single tensor in the graph computes",
    "nesterov-momentum-mismatch": "the Nesterov look-ahead uses a different momentum than the buffer",
    "runtime-hyperparameter": "dampening or weight decay is computed at run time; the contract needs constants",
    "runtime-momentum": "momentum is a runtime value that may be 0, where the contract's momentum == 0 rule differs",
    "contract": "the solved hyper-parameters break the operator contract",
    "shape-mismatch": "parameters, gradient and buffers do not share one shape",
    "dtype-mismatch": "parameters, gradient and buffers do not share one dtype",
    "mixed-precision": "the update is computed in a different precision than the parameters",
    "shared-state": "another update already uses this parameter or buffer",
    "verification-failed": "onnxruntime found the fused update computes different numbers",
}


def find_updates(index: GraphIndex, normaliser: Normaliser | None = None) -> tuple[list[Match], list[Miss]]:
    """All momentum-SGD updates among the graph outputs of ``index``, and the candidates refused.

    Deterministic: candidates are taken in graph-output order.
    """
    normaliser = normaliser or Normaliser(index)
    outputs = list(dict.fromkeys(index.graph_outputs))
    float_outputs = [o for o in outputs if index.spec(o).dtype in _EPS]
    canonical = {o: _skip_identity(index, o) for o in float_outputs}

    matches: list[Match] = []
    misses: list[Miss] = []
    for w in float_outputs:
        form_w = normaliser.form(w)
        if not _looks_like_update(index, w, form_w):
            continue
        _, values_w = normaliser.cone(w)
        buffers = [v for v in float_outputs if v != w and canonical[v] in values_w and canonical[v] != canonical[w]]
        if not buffers:
            misses.append(
                Miss(
                    w,
                    "no-momentum-buffer",
                    f"{w} = {format_form(form_w)} reads no momentum buffer that the graph outputs "
                    "(momentum 0 or absent): plain SGD is left as it is.",
                    equation=f"{w} = {format_form(form_w)}",
                    score=0,
                )
            )
            continue
        best: Miss | None = None
        found: Match | None = None
        for v in buffers:
            result = _solve(index, normaliser, w, v)
            if isinstance(result, Match):
                found = result
                break
            if best is None or result.score > best.score:
                best = result
        if found is not None:
            matches.append(found)
        elif best is not None:
            misses.append(best)

    # One parameter, one buffer, one update: a second claim on the same state is refused.
    claimed: set[str] = set()
    accepted: list[Match] = []
    for match in matches:
        state = {match.parameters, match.accum, match.parameters_out, match.accum_out}
        if state & claimed:
            misses.append(
                Miss(
                    match.parameters_out,
                    "shared-state",
                    f"{match.parameters_out}: {', '.join(sorted(state & claimed))} is already updated by "
                    "another fused update; fusing both would write it twice.",
                    score=5,
                )
            )
            continue
        claimed |= state
        accepted.append(match)
    buffer_outputs = {m.accum_out for m in accepted}
    misses = [miss for miss in misses if miss.candidate not in buffer_outputs]
    return accepted, misses


def _skip_identity(index: GraphIndex, value: str) -> str:
    seen = set()
    while value not in seen:
        seen.add(value)
        node = index.node(value)
        if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            return value
        value = node.input[0]
    return value


def _looks_like_update(index: GraphIndex, w: str, form_w: Form) -> bool:
    """A candidate reads itself plus something: at least two leaves, one of them a tensor with the
    output's shape and dtype fed from outside the elementwise cone (an input or an initializer)."""
    if len(form_w) < 2:
        return False
    spec_w = index.spec(w)
    for leaf in form_w:
        if leaf == ONE or index.producer.get(leaf) is not None:
            continue
        spec = index.spec(leaf)
        if spec.dtype == spec_w.dtype and _same_shape(spec, spec_w):
            return True
    return False


def _same_shape(a: TensorSpec, b: TensorSpec) -> bool:
    if a.shape is None or b.shape is None:
        return True
    return len(a.shape) == len(b.shape) and all(x == y or x is None or y is None for x, y in zip(a.shape, b.shape))


def _solve(index: GraphIndex, normaliser: Normaliser, w: str, v: str) -> Match | Miss:
    form_w, form_v = normaliser.form(w), normaliser.form(v)
    dtype = index.spec(w).dtype
    rel = coefficient_tolerance(dtype)
    equation = f"{w} = {format_form(form_w)};  {v} = {format_form(form_v)}"
    best = Miss(w, "extra-term", f"{w} is not a momentum-SGD update of buffer {v}.", equation=equation, score=1)

    for a in [leaf for leaf in form_v if leaf != ONE]:
        m = form_v[a]
        for p in [leaf for leaf in form_w if leaf not in (ONE, a)]:
            result = _solve_roles(index, normaliser, w, v, p, a, m, rel, equation)
            if isinstance(result, Match):
                return result
            if result.score > best.score:
                best = result
    return best


def _solve_roles(
    index: GraphIndex,
    normaliser: Normaliser,
    w: str,
    v: str,
    p: str,
    a: str,
    m: Poly,
    rel: float,
    equation: str,
) -> Match | Miss:
    form_w, form_v = normaliser.form(w), normaliser.form(v)
    vp = form_v.get(p, Poly.const(0))
    # What V holds besides the buffer and parameter terms: (1-d)·s·G.
    rest_v = add_forms(add_forms(form_v, {a: m}, Poly.const(-1)), {p: vp}, Poly.const(-1))
    if not rest_v:
        return Miss(w, "no-gradient", f"buffer update {v} = {format_form(form_v)} has no gradient term.", equation=equation, score=2)
    if ONE in rest_v:
        return Miss(
            w,
            "extra-term",
            f"buffer update {v} adds a constant {format_poly(rest_v[ONE])}, which momentum SGD does not.",
            equation=equation,
            differing=f"{format_poly(rest_v[ONE])}*1",
            score=2,
        )

    # W - P = α·V + β·A: read α off a gradient leaf, β off the buffer leaf, then demand the rest vanishes.
    delta = add_forms(form_w, {p: Poly.const(1)}, Poly.const(-1))
    pivot = sorted(rest_v)[0]
    inverse = form_v[pivot].inverse()
    if inverse is None:
        return Miss(w, "extra-term", f"coefficient {format_poly(form_v[pivot])} of {pivot} is not a single term.", equation=equation, score=2)
    alpha = delta.get(pivot, Poly.const(0)) * inverse
    if alpha.is_zero:
        return Miss(
            w,
            "extra-term",
            f"{w} does not use the new buffer {v}: its {pivot} term is not the buffer's.",
            equation=equation,
            score=2,
        )
    beta = delta.get(a, Poly.const(0)) - alpha * m
    predicted = add_forms(scale_form(form_v, alpha), {a: beta})
    differing = _differing_terms(delta, predicted, rel)
    lr_plain = -alpha
    nearest = f"{w} = {p} - {format_poly(lr_plain)}*{v}"
    if differing:
        return Miss(
            w,
            "extra-term",
            f"{w} = {p} + ({format_form(delta, [p, a])}) is not {p} - lr*{v} "
            f"(nor the Nesterov form): the term{'s' if len(differing) > 1 else ''} "
            f"{', '.join(differing)} do{'es' if len(differing) == 1 else ''} not fit.",
            equation=equation,
            nearest=nearest,
            differing=", ".join(differing),
            score=4,
        )

    nesterov = not _close(beta, Poly.const(0), rel, scale=alpha * m)
    if nesterov:
        m_inverse = m.inverse()
        if m_inverse is None:
            return Miss(w, "extra-term", f"momentum {format_poly(m)} is not a single term.", equation=equation, score=3)
        lr = beta * m_inverse
        expected_alpha = -(lr + lr * m)
        if not _close(alpha, expected_alpha, rel):
            return Miss(
                w,
                "nesterov-momentum-mismatch",
                f"{w} adds {format_poly(beta)}*{a} beside {format_poly(alpha)}*{v}: a Nesterov step with "
                f"momentum {format_poly(m)} would have {format_poly(expected_alpha)}*{v}; the look-ahead "
                "momentum differs from the buffer's.",
                equation=equation,
                nearest=f"{w} = {p} - {format_poly(lr)}*(g + {format_poly(m)}*{v})",
                differing=f"{format_poly(alpha)}*{v} vs {format_poly(expected_alpha)}*{v}",
                score=5,
            )
    else:
        lr = lr_plain

    gradient = _find_gradient(index, normaliser, v, rest_v, {a, p})
    if gradient is None:
        return Miss(
            w,
            "gradient-not-a-value",
            f"the gradient term {format_form(rest_v)} of {v} is not computed by any one tensor of the graph.",
            equation=equation,
            score=5,
        )
    g, k = gradient
    if not k.is_constant or not vp.is_constant:
        return Miss(
            w,
            "runtime-hyperparameter",
            f"dampening or weight decay of {v} depend on runtime values ({format_poly(k)}, {format_poly(vp)}); "
            "the contract needs them as compile-time attributes.",
            equation=equation,
            score=6,
        )
    k_value = k.constant_value
    maximize = k_value < 0
    one_minus_d = abs(k_value)
    dampening = 1.0 - one_minus_d
    if one_minus_d == 0:
        return Miss(w, "no-gradient", f"{v} has dampening 1: the gradient never enters the buffer.", equation=equation, score=6)
    weight_decay = vp.constant_value / one_minus_d
    if abs(dampening) < rel:
        dampening = 0.0

    # Nesterov's step also reads the weight-decayed gradient: W's P coefficient must carry wd·lr once more,
    # which the α·V + β·A identity already enforced. Only the contract clauses are left to check.
    try:
        check_attributes(dampening, weight_decay, nesterov, subject=w)
    except ContractError as error:
        return Miss(w, "contract", str(error), equation=equation, score=7)
    if not m.is_constant:
        return Miss(
            w,
            "runtime-momentum",
            f"momentum {format_poly(m)} of {v} is a runtime value; with momentum 0 the contract keeps the old "
            "buffer where this graph overwrites it, so the update is left alone.",
            equation=equation,
            score=7,
        )
    state_problem = _state_problem(index, w, p, a)
    if state_problem is not None:
        return dataclasses.replace(state_problem, equation=equation, score=8)
    typing_problem = _typing_problem(index, normaliser, w, v, p, a, g)
    if typing_problem is not None:
        return dataclasses.replace(typing_problem, equation=equation, score=8)

    nodes_w, _ = normaliser.cone(w)
    nodes_v, _ = normaliser.cone(v)
    return Match(
        parameters=p,
        gradient=g,
        accum=a,
        parameters_out=w,
        accum_out=v,
        learning_rate=lr,
        momentum=m,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        dtype=index.spec(p).dtype,
        shape=index.spec(p).shape,
        nodes=nodes_w | nodes_v,
        parameter_equation=f"{w} = {format_form(normaliser.form(w), [p, a])}",
        accum_equation=f"{v} = {format_form(normaliser.form(v), [a, g, p])}",
    )


def _close(a: Poly, b: Poly, rel: float, scale: Poly | None = None) -> bool:
    """``a ≈ b`` per monomial, relative to the larger magnitude among a, b and ``scale``."""
    reference = max(
        [abs(x) for x in a.terms.values()] + [abs(x) for x in b.terms.values()] + ([abs(x) for x in scale.terms.values()] if scale else []),
        default=0.0,
    )
    for monomial in set(a.terms) | set(b.terms):
        if abs(a.terms.get(monomial, 0.0) - b.terms.get(monomial, 0.0)) > rel * reference:
            return False
    return True


def _differing_terms(actual: Form, predicted: Form, rel: float) -> list[str]:
    differing = []
    for leaf in sorted(set(actual) | set(predicted)):
        x, y = actual.get(leaf, Poly.const(0)), predicted.get(leaf, Poly.const(0))
        if not _close(x, y, rel):
            name = "1" if leaf == ONE else leaf
            differing.append(f"{format_poly(x - y)}*{name}")
    return differing


def _find_gradient(index: GraphIndex, normaliser: Normaliser, v: str, rest: Form, exclude: set[str]) -> tuple[str, Poly] | None:
    """A tensor ``g`` of the graph with ``rest = k·form(g)`` for a scalar ``k``: a single leaf itself, or
    an intermediate of ``v``'s cone (a gradient summed from several contributions, say)."""
    if len(rest) == 1:
        ((leaf, coefficient),) = rest.items()
        return (leaf, coefficient) if leaf not in exclude else None
    _, values = normaliser.cone(v)
    for value in sorted(values):
        if value == v or value in exclude:
            continue
        form = normaliser.form(value)
        if set(form) != set(rest):
            continue
        pivot = sorted(form)[0]
        inverse = form[pivot].inverse()
        if inverse is None:
            continue
        k = rest[pivot] * inverse
        if all(_close(rest[leaf], form[leaf] * k, 1e-6) for leaf in rest):
            return value, k
    return None


def _state_problem(index: GraphIndex, w: str, p: str, a: str) -> Miss | None:
    for role, name in (("parameters", p), ("momentum buffer", a)):
        if name in index.initializers and name not in index.graph_inputs:
            return Miss(
                w,
                "constant-state",
                f"the {role} {name} is an initializer, a constant of the model, not state fed to the step "
                "(exporters fold module buffers this way); make it a graph input to fuse.",
            )
        if name not in index.graph_inputs:
            origin = index.node(name)
            what = f"computed by {origin.op_type} node {origin.name or '(unnamed)'}" if origin is not None else "not a graph input"
            return Miss(
                w,
                "computed-state",
                f"the {role} {name} is {what}; fused state must be a graph input the caller feeds and updates.",
            )
    return None


def _typing_problem(
    index: GraphIndex, normaliser: Normaliser, w: str, v: str, p: str, a: str, g: str
) -> Miss | None:
    specs = {name: index.spec(name) for name in (p, g, a, w, v)}
    dtype = specs[p].dtype
    for name, spec in specs.items():
        if spec.dtype != dtype:
            return Miss(
                w,
                "dtype-mismatch",
                f"{name} is {dtype_name(spec.dtype)} but parameters {p} is {dtype_name(dtype)}; the SGD operator "
                "needs one dtype.",
            )
    for name, spec in specs.items():
        if not _same_shape(spec, specs[p]) or spec.shape is None and specs[p].shape is not None:
            return Miss(
                w,
                "shape-mismatch",
                f"{name} has shape {spec.shape} but parameters {p} has {specs[p].shape}; the SGD operator needs "
                "one shape.",
            )
    # Every tensor the update computes must be in the parameters' precision: an update carried out in FLOAT
    # between Casts rounds differently from the contract's single rounding at the end.
    for root in (w, v):
        _, values = normaliser.cone(root)
        for value in sorted(values):
            spec = index.spec(value)
            if spec.num_elements() == 1 or value == ONE:
                continue
            if spec.dtype and spec.dtype != dtype:
                return Miss(
                    w,
                    "mixed-precision",
                    f"{value} in the update is computed in {dtype_name(spec.dtype)} while parameters {p} are "
                    f"{dtype_name(dtype)}.",
                )
    return None
