"""A small term of the update is held to its own coefficient: the verifier's isolating steps.

The bound gives each coefficient an allowance of a few FLOAT roundings relative to its own term, summed per
element (sgdfuse.verify, "Tolerance rule"). A term much smaller than the others on every element of every step
had its error hidden under their allowance: a weight decay of 1e-6 off by 1 %, a momentum of 1e-4 beside a
weight decay of 0.1, a dampening off by 2.5 roundings where a first-step rule leaves ``(1-d)·g`` beside
``m·buf`` on every later step, a learning rate of 1e-12 whose step ``lr·buf`` lies below the roundoff of the
weights it is subtracted from. ``sgdfuse.verify.ISOLATING_KINDS`` add steps on which each term stands alone on
some element. Every edit below passed ``check`` and ``optimize``'s verification before them (shown on the code
of main before the change: ``check`` and verification passed each edited model, and ``optimize`` fused each
wrong plan) and must fail now; the unedited fused model of each must still pass.

That each edit computes another update is shown with numpy in float64 (the contract's formula on the feeds of
the step that isolates the term), not with sgdfuse.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse.api as api
from sgdfuse.passes.rewrite import Planner
from sgdfuse.verify import check_models

F = TensorProto.FLOAT
SHAPE = [4, 3]
SGD_INPUT = {"learning_rate": 2, "momentum": 4}


def _vi(name: str, dtype: int = F, shape=SHAPE) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _constant(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype), name)


def _torch_step(*, lr: float, m: float, wd: float = 0.0, d: float = 0.0, nesterov: bool = False, maximize: bool = False,
                first_step: bool = False) -> onnx.ModelProto:
    """torch.optim.SGD's step written out (terms of a zero coefficient left out)::

        grad    = (-g if maximize else g) + wd*p
        later   = m*buf + k*grad                    k = 1 - d, computed in the graph as Sub(1, d)
        buf_out = Where(step == 0, grad, later)     with first_step (PyTorch's first step); else later
        p_out   = p - lr*(grad + m*buf_out if nesterov else buf_out)
    """
    nodes: list[onnx.NodeProto] = []
    inits = [_constant("m", m), _constant("lr", lr)]
    inputs = [_vi("p"), _vi("g"), _vi("buf")]
    grad = "g"
    if maximize:
        nodes.append(helper.make_node("Neg", ["g"], ["g_max"]))
        grad = "g_max"
    if wd:
        inits.append(_constant("wd", wd))
        nodes += [helper.make_node("Mul", ["p", "wd"], ["decay"]), helper.make_node("Add", [grad, "decay"], ["grad"])]
        grad = "grad"
    damped = grad
    if d:
        inits += [_constant("one", 1.0), _constant("d", d)]
        nodes += [helper.make_node("Sub", ["one", "d"], ["k"]), helper.make_node("Mul", [grad, "k"], ["damped"])]
        damped = "damped"
    nodes += [helper.make_node("Mul", ["buf", "m"], ["kept"]), helper.make_node("Add", ["kept", damped], ["later"])]
    if first_step:
        inputs.append(_vi("step", TensorProto.INT64, []))
        inits.append(_constant("zero", 0, np.int64))
        nodes += [helper.make_node("Equal", ["step", "zero"], ["first"]), helper.make_node("Where", ["first", grad, "later"], ["buf_out"])]
    else:
        nodes.append(helper.make_node("Identity", ["later"], ["buf_out"]))
    update = "buf_out"
    if nesterov:
        nodes += [helper.make_node("Mul", ["buf_out", "m"], ["ahead"]), helper.make_node("Add", [grad, "ahead"], ["nesterov"])]
        update = "nesterov"
    nodes += [helper.make_node("Mul", [update, "lr"], ["delta"]), helper.make_node("Sub", ["p", "delta"], ["p_out"])]
    graph = helper.make_graph(nodes, "step", inputs, [_vi("p_out"), _vi("buf_out")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _contract(p, g, a, *, lr, m, wd, d, nesterov=False, maximize=False, stat=0.0):
    """The operator contract's step in float64 (SGD-OPERATOR.md, "Formula"): ``(parameters_out, accum_t)``."""
    grad = (-g if maximize else g) + p * wd
    accum = a * m + grad - grad * (1 - stat) * d
    return (p - (grad + accum * m) * lr if nesterov else p - accum * lr), accum


def _one_ulp_up(value: float) -> float:
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


def _relative(value: float, factor: float) -> float:
    return float(np.float32(value) * factor)


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    step: dict
    coefficient: str  # the SGD attribute or input edited
    wrong: float
    isolated_by: str  # the feeds on which the term stands alone: "zero gradient and buffer", "zero gradient and parameters", "zero buffer"


CASES = [
    Case("weight decay 1e-6 x 1.01", dict(lr=0.1, m=0.9, wd=1e-6), "weight_decay", 1e-6 * 1.01, "zero gradient and buffer"),
    Case("weight decay 1e-5 x 1.001", dict(lr=0.1, m=0.9, wd=1e-5), "weight_decay", 1e-5 * 1.001, "zero gradient and buffer"),
    Case("weight decay 1e-4 x 1.0001", dict(lr=0.1, m=0.9, wd=1e-4), "weight_decay", 1e-4 * 1.0001, "zero gradient and buffer"),
    Case("Nesterov weight decay 1e-6 x 1.01", dict(lr=0.1, m=0.9, wd=1e-6, nesterov=True), "weight_decay", 1e-6 * 1.01,
         "zero gradient and buffer"),
    Case("maximize weight decay 1e-6 x 1.01", dict(lr=0.1, m=0.9, wd=1e-6, maximize=True), "weight_decay", 1e-6 * 1.01,
         "zero gradient and buffer"),
    Case("first-step rule, dampening 0.5, weight decay 1e-6 x 1.01", dict(lr=0.1, m=0.9, wd=1e-6, d=0.5, first_step=True),
         "weight_decay", 1e-6 * 1.01, "zero gradient and buffer"),
    Case("momentum 1e-4 beside weight decay 0.1, x (1 + 2e-6)", dict(lr=0.1, m=1e-4, wd=0.1), "momentum", _relative(1e-4, 1 + 2e-6),
         "zero gradient and parameters"),
    Case("Nesterov momentum 1e-4 beside weight decay 0.1, x (1 + 2e-6)", dict(lr=0.1, m=1e-4, wd=0.1, nesterov=True), "momentum",
         _relative(1e-4, 1 + 2e-6), "zero gradient and parameters"),
    Case("first-step rule, momentum 0.99, dampening 0.9 one FLOAT ulp up", dict(lr=0.1, m=0.99, d=0.9, first_step=True), "dampening",
         _one_ulp_up(0.9), "zero buffer"),
    Case("learning rate 1e-12 x (1 + 1e-5)", dict(lr=1e-12, m=0.9), "learning_rate", _relative(1e-12, 1 + 1e-5), "zero gradient and parameters"),
]


def _fused(original: onnx.ModelProto) -> onnx.ModelProto:
    result = api.optimize(original)
    assert [u.parameters for u in result.report.fused] == ["p"], result.report.refused
    return result.model


def _sgd(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "SGD")


def _set(attributes, tensors, node: onnx.NodeProto, coefficient: str, value: float) -> list[onnx.TensorProto]:
    """Set ``coefficient`` of the SGD ``node`` to ``value``: its attribute, or the initializer among ``tensors``
    it reads as an input (returned, edited)."""
    if coefficient in ("weight_decay", "dampening"):
        attribute = next(a for a in attributes if a.name == coefficient)
        attribute.f = value
        return list(tensors)
    name = node.input[SGD_INPUT[coefficient]]
    assert name in [t.name for t in tensors], f"the SGD node reads its {coefficient} from {name}, not an initializer"
    return [numpy_helper.from_array(np.full(numpy_helper.to_array(t).shape, value, np.float32), name) if t.name == name else t
            for t in tensors]


def _edited(fused: onnx.ModelProto, coefficient: str, value: float) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    node = _sgd(copy)
    initializers = _set(node.attribute, copy.graph.initializer, node, coefficient, value)
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(initializers)
    return copy


def _premise(case: Case) -> None:
    """The edit computes another update on the step that isolates its term (numpy, float64)."""
    rng = np.random.default_rng(1)
    p, g, a = (rng.standard_normal(SHAPE) for _ in range(3))
    if case.isolated_by == "zero gradient and buffer":
        g, a = 0 * g, 0 * a
    elif case.isolated_by == "zero gradient and parameters":
        g, p = 0 * g, 0 * p
    else:
        a = 0 * a
    step = case.step
    right = dict(lr=step["lr"], m=step["m"], wd=step.get("wd", 0.0), d=step.get("d", 0.0))
    # The coefficients as the fused node holds them (FLOAT), the edited one replaced.
    right = {k: float(np.float32(v)) for k, v in right.items()}
    wrong = dict(right, **{{"weight_decay": "wd", "momentum": "m", "dampening": "d", "learning_rate": "lr"}[case.coefficient]: case.wrong})
    forms = dict(nesterov=step.get("nesterov", False), maximize=step.get("maximize", False))
    want, have = _contract(p, g, a, **right, **forms), _contract(p, g, a, **wrong, **forms)
    relative = max(float(np.max(np.abs(w - h) / np.maximum(np.abs(w), 1e-300))) for w, h in zip(want, have) if np.any(w))
    # Far above DOUBLE's roundoff and above the few FLOAT roundings of coefficient the bound allows (4·2^-24).
    assert relative > 2 * 4 * 2.0**-24, relative


@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
def test_check_fails_a_fused_model_whose_small_term_has_a_slightly_wrong_coefficient(case):
    _premise(case)
    original = _torch_step(**case.step)
    fused = _fused(original)
    assert check_models(original, fused).passed
    check = check_models(original, _edited(fused, case.coefficient, case.wrong))
    assert not check.passed
    failed = [entry["message"] for entry in check.outputs + check.in_place if not entry["passed"]]
    assert any("isolated" in message or "zero-buffer" in message for message in failed), failed


@pytest.mark.parametrize("case", CASES, ids=[case.label for case in CASES])
def test_optimize_refuses_a_plan_whose_small_term_has_a_slightly_wrong_coefficient(monkeypatch, case):
    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            initializers = _set(plan.sgd_node.attribute, plan.initializers, plan.sgd_node, case.coefficient, case.wrong)
            return dataclasses.replace(plan, initializers=initializers)

    monkeypatch.setattr(api, "Planner", WrongPlanner)
    result = api.optimize(_torch_step(**case.step))
    assert result.report.fused == []
    assert [(r.candidate, r.reason) for r in result.report.refused] == [("p_out", "verification-failed")]


def test_a_first_step_rule_with_its_own_weight_decay_fails_check():
    """An original whose first-step branch adds ``1.01e-6·p`` where its later steps add ``1e-6·p`` is another
    update than any SGD node with one weight decay: the first step's ``wd·p`` beside ``g`` hid the difference
    until the ``isolated-first`` step (zero gradient and buffer, first-step condition true) gave it alone."""
    model = _torch_step(lr=0.1, m=0.9, wd=1e-6, first_step=True)
    fused = _fused(model)
    other = onnx.ModelProto()
    other.CopyFrom(model)
    # The first branch reads grad_first = g + 1.01e-6*p; the later branch keeps grad = g + 1e-6*p.
    where = next(n for n in other.graph.node if n.op_type == "Where")
    where.input[1] = "grad_first"
    other.graph.initializer.append(_constant("wd_first", 1e-6 * 1.01))
    other.graph.node.extend([helper.make_node("Mul", ["p", "wd_first"], ["decay_first"]),
                             helper.make_node("Add", ["g", "decay_first"], ["grad_first"])])
    other.graph.CopyFrom(helper.make_graph(_topological(other.graph.node), other.graph.name, other.graph.input, other.graph.output,
                                           other.graph.initializer))
    onnx.checker.check_model(other, full_check=True)
    rng = np.random.default_rng(1)
    p = rng.standard_normal(SHAPE)
    assert np.max(np.abs((float(np.float32(1e-6 * 1.01)) - float(np.float32(1e-6))) * p)) > 1e-9  # their first steps' buffers differ
    assert check_models(model, fused).passed
    check = check_models(other, fused)
    assert not check.passed
    assert any("isolated-first" in entry["message"] for entry in check.outputs + check.in_place if not entry["passed"])


def _topological(nodes) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each is after the producers of what it reads (they form a DAG)."""
    produced = {o for n in nodes for o in n.output}
    done: set[str] = set()
    ordered, pending = [], list(nodes)
    while pending:
        ready = [n for n in pending if all(i in done or i not in produced for i in n.input)]
        assert ready, "cycle"
        for n in ready:
            ordered.append(n)
            done.update(n.output)
        pending = [n for n in pending if n not in ready]
    return ordered


@pytest.mark.parametrize("step", [dict(lr=0.1, m=0.9), dict(lr=0.1, m=0.9, d=0.25), dict(lr=0.1, m=0.9, wd=5e-4, nesterov=True),
                                  dict(lr=0.1, m=0.9, wd=5e-4, d=0.5, first_step=True), dict(lr=0.1, m=0.9, wd=5e-4, maximize=True)],
                         ids=["plain", "damped", "nesterov-wd", "first-step-damped-wd", "maximize-wd"])
def test_the_right_fused_model_passes_the_isolating_steps(step):
    original = _torch_step(**step)
    check = check_models(original, _fused(original))
    assert check.passed, [e["message"] for e in check.outputs + check.in_place if not e["passed"]]


def _loss_scaled_step(wd: float) -> onnx.ModelProto:
    """A loss-scaling skip around the update of ``gu = g / scale`` (m 0.9, lr 0.1, weight decay ``wd``):
    ``found = any(!isfinite(gu))``; ``p_out = Where(found, p, p - lr*buf_new)``, likewise the buffer."""
    nodes = [
        helper.make_node("Div", ["g", "scale"], ["gu"]), helper.make_node("IsInf", ["gu"], ["inf"]),
        helper.make_node("IsNaN", ["gu"], ["nan"]), helper.make_node("Or", ["inf", "nan"], ["bad"]),
        helper.make_node("Cast", ["bad"], ["bad_f"], to=F), helper.make_node("ReduceMax", ["bad_f"], ["any_bad"], keepdims=0),
        helper.make_node("Cast", ["any_bad"], ["found"], to=TensorProto.BOOL),
        helper.make_node("Mul", ["p", "wd"], ["decay"]), helper.make_node("Add", ["gu", "decay"], ["grad"]),
        helper.make_node("Mul", ["buf", "m"], ["kept"]), helper.make_node("Add", ["kept", "grad"], ["buf_new"]),
        helper.make_node("Mul", ["buf_new", "lr"], ["delta"]), helper.make_node("Sub", ["p", "delta"], ["p_new"]),
        helper.make_node("Where", ["found", "buf", "buf_new"], ["buf_out"]), helper.make_node("Where", ["found", "p", "p_new"], ["p_out"]),
    ]
    graph = helper.make_graph(nodes, "step", [_vi("p"), _vi("g"), _vi("buf"), _vi("scale", F, [])], [_vi("p_out"), _vi("buf_out")],
                              [_constant("m", 0.9), _constant("lr", 0.1), _constant("wd", wd)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_loss_scaled_update_is_not_skipped_on_the_isolating_steps(monkeypatch):
    """``g / scale`` is 0 on the isolating steps, not ``0 / 0``: the one-element loss scale is fed as on a random
    step, so the guard keeps the update and ``wd·p`` stands alone (zeroing the scale too would make ``found``
    true, the step skipped on both sides, and nothing compared). In ``check``, ``optimize`` (whose slice holds the
    gradient's cone, read by the guard) and ``lower``'s check."""
    from sgdfuse.lowering.lower import lower
    from sgdfuse.lowering.verify import verify_lowering

    wd, wrong = 1e-6, 1e-6 * 1.01
    rng = np.random.default_rng(1)
    p = rng.standard_normal(SHAPE)
    # The premise, on the isolated step's feeds (g / scale = 0, buffer 0): the contract's new buffers differ.
    zero = np.zeros(SHAPE)
    want, have = (_contract(p, zero, zero, lr=0.1, m=0.9, wd=w, d=0.0)[1] for w in (float(np.float32(wd)), wrong))
    assert np.max(np.abs(want - have)) > 1e-9
    original = _loss_scaled_step(wd)
    fused = _fused(original)
    assert check_models(original, fused).passed
    assert not check_models(original, _edited(fused, "weight_decay", wrong)).passed
    lowered = lower(fused, soc="Ascend910B2", optimise=False)
    assert verify_lowering(fused, lowered).passed
    lowered.op(lowered.sgd_ops[0]).attr["weight_decay"].f = wrong
    assert not verify_lowering(fused, lowered).passed

    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            _set(plan.sgd_node.attribute, plan.initializers, plan.sgd_node, "weight_decay", wrong)
            return plan

    monkeypatch.setattr(api, "Planner", WrongPlanner)
    assert api.optimize(original).report.fused == []
