"""Chains of fused updates whose later gradients are kept nodes computed from the earlier updates' new values.

In ``g2 = 2*w1_new`` with PyTorch's first-step ``Where`` (tests/hunt_graphs.py's :func:`reads_fused_update`),
the next SGD node reads the kept ``mul_3 = 2*add_1``, not ``add_1`` itself. Each side computes ``mul_3`` from
its own ``add_1``, and those differ by the first update's rounding, which no bound allowed in lockstep: at
dampening 0.9, optimize refused the third link of a chain of three as ``verification-failed`` (learning rate
0.5), and check failed correct fusions (seeds 0, 2, 8 of ``2*buf_new`` at learning rate 0.1).

- ``optimize``'s verification now propagates the measured difference of such a gradient
  (``verify._mark_computed_upstream_gradients``). This is sound there because the nodes between are the
  original's own.
- ``check`` feeds those nodes one value on both sides (``verify._feed_update_readers``). Where it cannot
  because the original computes its update from them (``mul_3 = 2*mul_2``, ``mul_2 = -lr*buf_new`` being also
  the step of the update before), it propagates the measured difference only for nodes proven equal to the
  original's (``verify._mark_proven_upstream_gradients``).
- A fused model whose nodes between were edited must still fail.

A fused link after an unfused one (the middle link refused) computes that link's exact outputs from a fused
``add_1``, and they were compared exactly, so check failed. A reader that no output is computed from
(``mul_11 = 2*add_5`` after the last link) was listed as checked.

The expected numbers come from numpy (``torch.optim.SGD``'s step), never from sgdfuse.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import sgdfuse
import sgdfuse.verify as verify
from hunt_graphs import MOMENTUM, reads_fused_update
from sgdfuse.runtime import make_session, run
from sgdfuse.verify import check_models

SEEDS = range(9)
SHAPE = (4, 3)
# (gradient form, learning rate, dampening): the Mul forms that failed at dampening 0.9.
KEPT = [("twice_new_weights", 0.5, 0.9), ("twice_new_buffer", 0.1, 0.9)]


def _failures(check) -> list[str]:
    return [f"{e['name']}: {e['message']}" for e in check.outputs + check.in_place if not e["passed"]]


def _failed(check) -> set[str]:
    return {e["name"] for e in check.outputs + check.in_place if not e["passed"]}


def _fused(form: str, lr: float, dampening: float, chain: int = 3) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    model = reads_fused_update(form, chain=chain, first_step=True, dampening=dampening, lr=lr)
    result = sgdfuse.optimize(model)
    assert sorted(f.parameters for f in result.report.fused) == [f"p{i}" for i in range(chain)], result.report.refused
    assert result.report.verification.passed
    return model, result.model


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: node for node in model.graph.node for o in node.output}


def _reference(form: str, chain: int, lr: float, dampening: float, state: dict, g0, step: int) -> dict:
    """One step of ``chain`` ``torch.optim.SGD`` updates in float64 (momentum 0.9; the first step ``buf = g``),
    update i + 1's gradient computed from update i's new values as :func:`reads_fused_update` says."""
    out, grad = {}, np.asarray(g0, np.float64)
    for i in range(chain):
        p, b = (np.asarray(state[f"{kind}{i}"], np.float64) for kind in "pb")
        new_b = grad.copy() if step == 0 else MOMENTUM * b + (1 - dampening) * grad
        new_p = p - lr * new_b
        out[f"p{i}"], out[f"b{i}"] = new_p, new_b
        grad = {"twice_new_weights": 2 * new_p, "twice_new_buffer": 2 * new_b, "twice_step": 2 * (-lr * new_b)}[form]
    return out


@pytest.mark.parametrize("form, lr, dampening", KEPT)
def test_optimize_fuses_every_link_whose_gradient_is_a_kept_node_and_computes_torch_sgd(form, lr, dampening):
    # lr 0.5: the third link was refused as verification-failed (add_5, step 3: 1.14e-7 against 1.07e-7).
    chain = 3
    model, fused = _fused(form, lr, dampening, chain)
    producers = _producers(fused)
    sgd = [node for node in fused.graph.node if node.op_type == "SGD"]
    assert all(producers[node.input[1]].op_type == "Mul" for node in sgd[1:])  # the kept mul_3, not add_1
    rng = np.random.default_rng(3)
    state = {f"{kind}{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(chain) for kind in "pb"}
    want, got = dict(state), dict(state)
    session, names = make_session(fused), [o.name for o in fused.graph.output]
    for step in range(3):
        g0 = rng.standard_normal(SHAPE).astype(np.float32)
        want = _reference(form, chain, lr, dampening, want, g0, step)
        out = run(session, {**got, "g0": g0, "step": np.array(step, np.int64)})
        got = {f"{kind}{i}": out[names[2 * i + j]] for i in range(chain) for j, kind in enumerate("pb")}
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6, err_msg=f"{key} at step {step}")


@pytest.mark.parametrize("form, lr, dampening", KEPT)
def test_check_passes_a_chain_whose_gradients_are_kept_nodes_at_every_seed(form, lr, dampening):
    # 2*buf_new at lr 0.1 failed seeds 0, 2, 8 (where_2 by up to 2.2 times its bound).
    model, fused = _fused(form, lr, dampening)
    for seed in SEEDS:
        check = check_models(model, fused, seed=seed)
        assert check.passed, (seed, _failures(check))


def _with_initializer(fused: onnx.ModelProto, node_output: str, value: float, *, rename: bool) -> onnx.ModelProto:
    """``fused`` with the constant the node writing ``node_output`` reads set to ``value``: a new initializer
    (``rename``) or the same one with another value (nothing else reads it)."""
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    node = next(n for n in model.graph.node if node_output in n.output)
    tensors = {t.name: t for t in model.graph.initializer}
    slot = next(i for i, name in enumerate(node.input) if name in tensors)
    old = numpy_helper.to_array(tensors[node.input[slot]])
    assert sum(node.input[slot] in n.input for n in model.graph.node) == 1
    new = np.full(old.shape, value, old.dtype)
    assert new.tobytes() != old.tobytes()
    if rename:
        model.graph.initializer.append(numpy_helper.from_array(new, "edited_constant"))
        node.input[slot] = "edited_constant"
    else:
        tensors[node.input[slot]].CopyFrom(numpy_helper.from_array(new, node.input[slot]))
    return model


def _reading(fused: onnx.ModelProto, node_output: str, old: str, new: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    node = next(n for n in model.graph.node if node_output in n.output)
    assert old in node.input
    node.input[list(node.input).index(old)] = new
    return model


TWO_PLUS_ULP = float(np.nextafter(np.float32(2.0), np.float32(3.0)))


@pytest.mark.parametrize("edit", ["constant one ulp up", "constant one ulp up, same initializer", "reads the old weights"])
def test_a_kept_gradient_node_edited_in_the_fused_model_fails_check(edit):
    # Regression guard: the fused model's mul_3 = 2.0000002*add_1 (or 2*p0) feeds the next SGD node; the kept
    # node is fed one value on both sides, so the next link's outputs differ with no allowance for it.
    model, fused = _fused("twice_new_weights", 0.5, 0.9)
    gradient = [node for node in fused.graph.node if node.op_type == "SGD"][1].input[1]
    if edit == "reads the old weights":
        edited = _reading(fused, gradient, model.graph.output[0].name, "p0")
    else:
        edited = _with_initializer(fused, gradient, TWO_PLUS_ULP, rename=edit == "constant one ulp up")
    second = {model.graph.output[2].name, model.graph.output[3].name}
    for seed in (0, 4, 7):
        check = check_models(model, edited, seed=seed)
        assert not check.passed and _failed(check) & second, (seed, _failures(check))


def test_verification_with_the_allowance_still_refuses_a_wrong_third_link(monkeypatch):
    # Regression guard: the third link's gradient mul_7 is computed from the second's output, whose measured
    # difference is now allowed; its own SGD node with a dampening 1e-6 off must still fail verification.
    model = reads_fused_update("twice_new_weights", chain=3, first_step=True, dampening=0.9, lr=0.5)
    third = model.graph.output[4].name
    verify_plans = verify.verify_plans
    marked: list[str] = []
    mark = verify._mark_computed_upstream_gradients

    def spy(views, nodes, replaced):
        found = mark(views, nodes, replaced)
        marked.extend(found)
        return found

    def tampered(model_, index, plans, **kwargs):
        for plan in plans:
            if plan.match.parameters_out == third:
                next(a for a in plan.sgd_node.attribute if a.name == "dampening").f += 1e-6
        return verify_plans(model_, index, plans, **kwargs)

    monkeypatch.setattr(verify, "verify_plans", tampered)
    monkeypatch.setattr(verify, "_mark_computed_upstream_gradients", spy)
    report = sgdfuse.optimize(model).report
    assert [(r.candidate, r.reason) for r in report.refused] == [(third, "verification-failed")], report.refused
    assert sorted(f.parameters for f in report.fused) == ["p0", "p1"]
    assert len(marked) >= 2, marked  # the second and third links' gradients were given the allowance


# ----------------------------------------------------------------------- twice_step: g2 = 2*(-lr*buf1_new)


@pytest.mark.parametrize("lr, dampening", [(0.1, 0.9), (0.5, 0.25)])
def test_check_passes_a_chain_whose_gradient_is_computed_from_the_step_of_the_one_before(lr, dampening):
    # mul_3 = 2*mul_2, mul_2 = -lr*buf_new the step add_1 = p0 + mul_2 takes: mul_2 is part of the first update
    # in the original and is not fed a value. At lr 0.1 the SGD node reads the kept mul_3 (failed seeds 0, 4 at
    # dampening 0.9, chain of 4: no allowance); at lr 0.5 it reads the rewrite's Neg(buf_new), which check fed a
    # value on the fused side alone (failed every seed by a factor of 1e8 to 1e10).
    model, fused = _fused("twice_step", lr, dampening, chain=4)
    for seed in SEEDS:
        check = check_models(model, fused, seed=seed)
        assert check.passed, (seed, _failures(check))


@pytest.mark.parametrize("edit", ["same initializer", "new initializer", "another op"])
def test_a_node_between_a_step_and_the_next_gradient_edited_in_the_fused_model_fails_check(edit):
    # The measured difference of mul_3 is allowed only because mul_3 and mul_2 are proven to be the original's
    # nodes; a fused mul_3 = 2.0000002*mul_2 would have hidden in that difference.
    model, fused = _fused("twice_step", 0.1, 0.9, chain=4)
    gradient = [node for node in fused.graph.node if node.op_type == "SGD"][1].input[1]
    if edit == "another op":
        edited = onnx.ModelProto()
        edited.CopyFrom(fused)
        node = next(n for n in edited.graph.node if gradient in n.output)
        position = list(edited.graph.node).index(node)
        edited.graph.initializer.append(numpy_helper.from_array(np.array(1 / TWO_PLUS_ULP, np.float32), "edited_constant"))
        edited.graph.node.remove(node)
        edited.graph.node.insert(position, helper.make_node("Div", [node.input[0], "edited_constant"], [gradient]))
    else:
        edited = _with_initializer(fused, gradient, TWO_PLUS_ULP, rename=edit == "new initializer")
    second = {model.graph.output[2].name, model.graph.output[3].name}
    for seed in (0, 4, 7):
        check = check_models(model, edited, seed=seed)
        assert not check.passed and _failed(check) & second, (seed, _failures(check))


def test_the_rewrites_negated_gradient_edited_fails_check():
    # lr 0.5: 2*(-0.5*buf) is -buf, written as the rewrite's Neg(buf_new); scaled 1 + 1e-6 it must fail.
    model, fused = _fused("twice_step", 0.5, 0.25)
    edited = onnx.ModelProto()
    edited.CopyFrom(fused)
    sgd = [node for node in edited.graph.node if node.op_type == "SGD"][1]
    node = next(n for n in edited.graph.node if sgd.input[1] in n.output)
    assert node.op_type == "Neg"
    position = list(edited.graph.node).index(node)
    edited.graph.initializer.append(numpy_helper.from_array(np.array(-(1 + 1e-6), np.float32), "edited_constant"))
    edited.graph.node.remove(node)
    edited.graph.node.insert(position, helper.make_node("Mul", [node.input[0], "edited_constant"], list(node.output)))
    for seed in (0, 4):
        check = check_models(model, edited, seed=seed)
        assert not check.passed and model.graph.output[2].name in _failed(check), (seed, _failures(check))


# ------------------------------------------------------------------- a fused link after an unfused one


def _middle_refused(monkeypatch, model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` optimized with verification refusing its second update (as it did at random when the
    allowance above was missing), so the third update is fused after an unfused one."""
    second = model.graph.output[2].name
    verify_plans = verify.verify_plans

    def refusing(model_, index, plans, **kwargs):
        checks = verify_plans(model_, index, plans, **kwargs)
        return [dataclasses.replace(c, passed=False, message="refused by the test") if c.parameters_out == second else c
                for c in checks]

    with monkeypatch.context() as patch:
        patch.setattr(verify, "verify_plans", refusing)
        result = sgdfuse.optimize(model)
    assert sorted(f.parameters for f in result.report.fused) == ["p0", "p2"], result.report
    return result.model


MIDDLE = [(True, 0.25, 0.1), (False, 0.25, 0.1), (True, 0.9, 0.5)]


@pytest.mark.parametrize("first_step, dampening, lr", MIDDLE)
def test_check_passes_a_fused_link_after_an_unfused_one(monkeypatch, first_step, dampening, lr):
    # The second update's outputs are exact and computed from the fused add_1 (through mul_3, which also
    # feeds the fused third update): compared exactly, they differed by add_1's rounding (5.96e-8 vs bound 0).
    model = reads_fused_update("twice_new_weights", chain=3, first_step=first_step, dampening=dampening, lr=lr)
    fused = _middle_refused(monkeypatch, model)
    for seed in SEEDS:
        check = check_models(model, fused, seed=seed)
        assert check.passed, (seed, _failures(check))


@pytest.mark.parametrize("first_step, dampening, lr", MIDDLE)
def test_a_wrong_node_before_or_after_the_unfused_link_fails_check(monkeypatch, first_step, dampening, lr):
    # Regression guards: mul_3 (what the unfused update reads) one ulp off fails at its exact outputs; the
    # fused third link's dampening 1e-6 off fails at its own outputs.
    model = reads_fused_update("twice_new_weights", chain=3, first_step=first_step, dampening=dampening, lr=lr)
    fused = _middle_refused(monkeypatch, model)
    names = [o.name for o in model.graph.output]
    first_new = names[0]
    reader = next(n for n in fused.graph.node if first_new in n.input and n.op_type == "Mul")
    wrong_reader = _with_initializer(fused, reader.output[0], TWO_PLUS_ULP, rename=True)
    wrong_third = onnx.ModelProto()
    wrong_third.CopyFrom(fused)
    next(a for a in [n for n in wrong_third.graph.node if n.op_type == "SGD"][1].attribute if a.name == "dampening").f += 1e-6
    for edited, where in ((wrong_reader, set(names[2:4])), (wrong_third, set(names[4:]))):
        for seed in (0, 4):
            check = check_models(model, edited, seed=seed)
            assert not check.passed and _failed(check) & where, (seed, _failures(check))


# ------------------------------------------------------------------------------------ the readers' note


def test_the_note_names_a_reader_no_output_is_computed_from_as_not_checked():
    # mul_11 = 2*add_5 after the last link of a chain: nothing reads it. The note listed it among the readers
    # "checked from the same fed value"; it names it as not checked now, and the fed readers are those that
    # compute the next gradients.
    model, fused = _fused("twice_new_weights", 0.5, 0.9)
    last = model.graph.output[4].name
    dead = next(n.output[0] for n in fused.graph.node if last in n.input and n.op_type == "Mul")
    assert not any(dead in n.input for n in fused.graph.node) and dead not in [o.name for o in fused.graph.output]
    fed = [node.input[1] for node in fused.graph.node if node.op_type == "SGD"][1:]
    note = check_models(model, fused).note
    checked = [part for part in note.split("; ") if "checked from the same fed value" in part]
    unchecked = [part for part in note.split("; ") if part.endswith("not checked")]
    assert len(checked) == 1 and dead not in checked[0] and all(name in checked[0] for name in fed), note
    assert len(unchecked) == 1 and dead in unchecked[0], note


# ------------------------------------------- twice_step at lr 0.5, dampening 0.9: the rewrite's Neg(buf_new)
#
# g2 = 2*(-0.5*buf1_new) is -buf1_new exactly: the second update is read as gradient buf1_new with maximize, and
# its SGD node reads the rewrite's Neg(buf1_new). The original has no value of that name, so check gave the
# second update no allowance for the difference of the two sides' buf1_new. Both updates apply dampening 0.9 as
# the FLOAT attribute (1 - 0.9f = 0.10000002, 3.75 FLOAT roundings of k from the graph's 0.1f, inside the
# allowance of 4): the first update's buffer differs by that, and the second's gradient with it, so the second
# buffer differed by twice its allowance and check failed the correct fusion (where_1, ratio 1.87, every seed at
# chain 2). Now the measured difference of buf1_new is propagated (verify._UpdateView.negated_upstream).


def _negated_chain(chain: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    model, fused = _fused("twice_step", 0.5, 0.9, chain=chain)
    producers = _producers(fused)
    for node in [n for n in fused.graph.node if n.op_type == "SGD"][1:]:
        assert producers[node.input[1]].op_type == "Neg"  # the rewrite's helper, no node of the original
    return model, fused


@pytest.mark.parametrize("chain", [2, 4])
def test_the_negated_step_chain_at_dampening_0_9_computes_torch_sgd(chain):
    # The premise, from numpy: the fusion is right (float64 torch.optim.SGD, within FLOAT's roundoff).
    model, fused = _negated_chain(chain)
    rng = np.random.default_rng(5)
    state = {f"{kind}{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(chain) for kind in "pb"}
    want, got = dict(state), dict(state)
    session, names = make_session(fused), [o.name for o in fused.graph.output]
    for step in range(5):
        g0 = rng.standard_normal(SHAPE).astype(np.float32)
        want = _reference("twice_step", chain, 0.5, 0.9, want, g0, step)
        out = run(session, {**got, "g0": g0, "step": np.array(step, np.int64)})
        got = {f"{kind}{i}": out[names[2 * i + j]] for i in range(chain) for j, kind in enumerate("pb")}
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-6, err_msg=f"{key} at step {step}")


@pytest.mark.parametrize("chain", [2, 4])
def test_check_passes_the_negated_step_chain_at_dampening_0_9_at_every_seed(chain):
    model, fused = _negated_chain(chain)
    for seed in SEEDS:
        check = check_models(model, fused, seed=seed)
        assert check.passed, (seed, _failures(check))


def _second_sgd_edited(fused: onnx.ModelProto, what: str, ulps: int) -> onnx.ModelProto:
    """``fused`` with the second SGD node's dampening attribute, or its own copy of the learning rate or momentum
    initializer, moved by ``ulps`` FLOAT spacings; or (``what`` "gradient") its Neg reading the first update's
    new weights instead of its new buffer."""
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    sgd = [node for node in model.graph.node if node.op_type == "SGD"][1]

    def moved(value) -> np.float32:
        value = np.float32(value)
        for _ in range(abs(ulps)):
            value = np.nextafter(value, np.float32(np.inf if ulps > 0 else -np.inf))
        return value

    if what == "dampening":
        attribute = next(a for a in sgd.attribute if a.name == "dampening")
        attribute.f = float(moved(attribute.f))
    elif what == "gradient":
        negation = next(n for n in model.graph.node if sgd.input[1] in n.output)
        assert list(negation.input) == [model.graph.output[1].name]  # Neg(buf1_new)
        negation.input[0] = model.graph.output[0].name
    else:
        slot = {"learning_rate": 2, "momentum": 4}[what]
        (tensor,) = [t for t in model.graph.initializer if t.name == sgd.input[slot]]
        value = numpy_helper.to_array(tensor)
        model.graph.initializer.append(numpy_helper.from_array(np.full(value.shape, moved(value), value.dtype), "edited_constant"))
        sgd.input[slot] = "edited_constant"
    return model


@pytest.mark.parametrize("what, ulps", [("dampening", -1), ("momentum", 4), ("learning_rate", 2), ("gradient", 0)])
def test_a_wrong_second_link_of_the_negated_step_chain_fails_check(what, ulps):
    # Regression guard for the allowance above: it is the measured difference of buf1_new, and the second update's
    # own coefficients are still held to theirs (dampening one ulp low is k 13.75 FLOAT roundings off the graph's
    # 0.1f; momentum 4 ulps and lr 2 ulps are beyond 4 roundings), and a Neg of another value fails.
    model, fused = _negated_chain(2)
    edited = _second_sgd_edited(fused, what, ulps)
    second = {model.graph.output[2].name, model.graph.output[3].name}
    for seed in (0, 1, 2, 3):
        check = check_models(model, edited, seed=seed)
        assert not check.passed and _failed(check) & second, (seed, _failures(check))


@pytest.mark.xfail(strict=True, reason="known gap: the measured |Δbuf1_new| is allowed as a magnitude, so a second-link "
                   "coefficient error of the opposite sign hides in it (dampening one ulp high: k 6.25 FLOAT roundings "
                   "off, beside the first link's own +3.75)")
def test_the_second_links_dampening_one_ulp_high_fails_check():
    model, fused = _negated_chain(2)
    edited = _second_sgd_edited(fused, "dampening", 1)
    assert not any(check_models(model, edited, seed=seed).passed for seed in (0, 1, 2, 3))
