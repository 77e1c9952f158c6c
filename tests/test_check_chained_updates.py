"""``sgdfuse check`` on chains of fused updates, each one's gradient computed from the last one's new weights.

``g2 = 2*p1_new``, ``g3 = 2*p2_new`` (tests/hunt_graphs.py's :func:`reads_fused_update`, dynamo-style names
``add_1``, ``mul_2``, ``val_3``) fuse into SGD nodes that read the previous SGD node's output
(``sgd_match._solve_readers_of_fused``). Without a first-step ``Where``, the ``2*(1-d)`` folds into the next
node's dampening and that node reads ``add_1`` itself. Check probes every SGD node's gradient operand, and its
readers of update outputs (``verify._feed_update_readers``) took the probe of ``add_1`` for a reader: the probe
read a fed value, 0 on the zero-gradient step and random numbers elsewhere, instead of ``p1_new`` (up to about
2.4). So the bound of the third update's buffer left out the rounding of its real gradient, and check failed a
correct fusion: ``add_4`` on the zero-gradient step, |difference| 5.96e-8 against a bound of 3.22e-8 (seeds 0
and 7 at dampening 0.25, seeds 4 and 8 at dampening 0).

In that folded form the next SGD node's gradient *is* ``add_1``, and each side reads its own ``add_1``: they
differ by the first update's rounding, which is absolute (about ``ulp(|p| + lr*|v|)``) and large beside a
``p1_new`` near 0. Neither optimize's verification nor check's lockstep run allowed that difference, so
optimize refused the second update of a chain of three at dampening 0.1 or 0.3 as ``verification-failed``
(``add_2`` at step 1: 2.08e-8 against a bound of 6.01e-10, on a value of 5e-4) and check failed seeds 0 and 1
of the fused chain. The bound now propagates the measured difference of such a gradient
(``verify._UpdateView.upstream_gradient``), which is itself compared within the first update's bound.

Since the matcher stopped folding a gradient's scale into the dampening, every link reads the kept
``mul_3 = 2*p_new``, which check feeds one value on both sides (tests/test_check_chained_kept_gradients.py).

The gradients the bound reads are checked against numpy, computed from the step's own feeds; a chain edited
to be wrong must still fail.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import sgdfuse
import sgdfuse.verify as verify
from hunt_graphs import LR, MOMENTUM, reads_fused_update
from sgdfuse.verify import check_models

CONFIGS = [(chain, first_step, dampening) for chain in (2, 3) for first_step in (True, False) for dampening in (0.0, 0.25)] + [
    (3, False, 0.1), (3, False, 0.3)]
SEEDS = range(9)


def _fused(chain: int, first_step: bool, dampening: float) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    model = reads_fused_update("twice_new_weights", chain=chain, first_step=first_step, dampening=dampening)
    result = sgdfuse.optimize(model)
    assert sorted(f.parameters for f in result.report.fused) == [f"p{i}" for i in range(chain)], result.report
    assert result.report.verification.passed
    return model, result.model


def _failures(check) -> list[str]:
    return [f"{e['name']}: {e['message']}" for e in check.outputs + check.in_place if not e["passed"]]


@pytest.mark.parametrize("chain, first_step, dampening", CONFIGS,
                         ids=[f"chain{c}-{'where' if f else 'nofirst'}-d{d}" for c, f, d in CONFIGS])
def test_check_passes_a_correct_fused_chain_at_every_seed(chain, first_step, dampening):
    model, fused = _fused(chain, first_step, dampening)
    for seed in SEEDS:
        check = check_models(model, fused, seed=seed)
        assert check.passed, (seed, _failures(check))
        # No probe of an SGD node's operand is among the readers fed a value of an update.
        assert "sgdfuse_probe" not in check.note, check.note


def _numpy_gradients(feeds, chain: int, first_step: bool, dampening: float, new_weights: list[str]) -> list[np.ndarray]:
    """Per update, the gradient it reads in one step, from that step's feeds (float64, ``torch.optim.SGD``):
    ``g0`` for the first, ``2*p_new`` of the one before for the others, where ``p_new`` (named
    ``new_weights[i]``) is the value check feeds the kept ``Mul`` that computes that gradient, when it feeds
    one (``verify._feed_update_readers``), else computed from the feeds."""
    gradients, grad = [], np.asarray(feeds["g0"], np.float64)
    first = first_step and int(np.asarray(feeds["step"])) == 0
    for i in range(chain):
        gradients.append(grad)
        p, b = (np.asarray(feeds[f"{kind}{i}"], np.float64) for kind in "pb")
        new_b = grad if first else MOMENTUM * b + (1 - dampening) * grad
        fed = feeds.get(verify.UPDATE_FEED_PREFIX + new_weights[i])
        grad = 2 * (p - LR * new_b if fed is None else np.asarray(fed, np.float64))
    return gradients


@pytest.mark.parametrize("first_step, dampening", [(True, 0.25), (False, 0.0), (False, 0.25)])
def test_the_bound_of_a_chained_update_reads_its_real_gradient_on_every_step(monkeypatch, first_step, dampening):
    # The gradient term of the bound, (1 - d)*g with the SGD node's own d and operand (a folded 2*(1 - d) reads
    # p_new with d = 1 - 2*(1 - d)), against numpy's (1 - d)*2*p_new from the step's feeds: on the
    # zero-gradient step too, where g0 is 0 but the chained gradients are not, where an SGD node reads p_new
    # itself. Where it reads the kept mul_3 = 2*p_new (every link since the matcher stopped folding the 2 into
    # the dampening), check feeds mul_3 a value of p_new, 0 on that step, and the bound must read 2*that.
    chain = 3
    model, fused = _fused(chain, first_step, dampening)
    new_weights = [o.name for o in model.graph.output][::2]
    reads_new_weights = any(node.input[1] in new_weights for node in fused.graph.node if node.op_type == "SGD")
    seen: list[tuple] = []
    lazy_bounds = verify._lazy_bounds

    def spy(view, original_feeds, fused_feeds, original_out, fused_out, **kwargs):
        terms = verify._view_terms(view, original_feeds, fused_feeds, original_out, fused_out, carried=kwargs.get("carried", False))
        seen.append((view.parameters, original_feeds, terms))
        return lazy_bounds(view, original_feeds, fused_feeds, original_out, fused_out, **kwargs)

    monkeypatch.setattr(verify, "_lazy_bounds", spy)
    assert check_models(model, fused).passed
    zero_gradient_steps = 0
    for parameters, feeds, terms in seen:
        link = int(parameters[1:])
        want = (1 - dampening) * np.abs(_numpy_gradients(feeds, chain, first_step, dampening, new_weights)[link])
        have = abs(1 - terms.d) * np.abs(np.asarray(terms.g, np.float64))
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5 * float(want.max() + 1), err_msg=parameters)
        zero_gradient_steps += link > 0 and not np.any(feeds["g0"]) and bool(np.any(want))
        fed = any(name.startswith(verify.UPDATE_FEED_PREFIX) for name in feeds)
        assert fed != reads_new_weights, sorted(feeds)
    assert zero_gradient_steps or not reads_new_weights, "no zero-gradient step of a chained update was bounded"


def _edited(fused: onnx.ModelProto, what: str, link: int = -1) -> onnx.ModelProto:
    """``fused`` with its SGD node ``link`` (the last) wrong: the dampening attribute 1e-6 off, the learning rate
    doubled, or the momentum 1e-6 (relative) off, each as a new initializer read by that node alone."""
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    sgd = [node for node in model.graph.node if node.op_type == "SGD"][link]
    if what == "dampening":
        attribute = next(a for a in sgd.attribute if a.name == "dampening")
        attribute.f += 1e-6
        return model
    slot, factor = {"learning rate doubled": (2, 2.0), "momentum": (4, 1 + 1e-6)}[what]
    value = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == sgd.input[slot]))
    edited = (value.astype(np.float64) * factor).astype(np.float32)
    assert edited != value
    model.graph.initializer.append(numpy_helper.from_array(edited, "edited_coefficient"))
    sgd.input[slot] = "edited_coefficient"
    return model


@pytest.mark.parametrize("what", ["dampening", "learning rate doubled", "momentum"])
@pytest.mark.parametrize("first_step, dampening", [(True, 0.0), (True, 0.25), (False, 0.0), (False, 0.25), (False, 0.3)])
def test_a_wrong_last_link_of_a_chain_of_three_fails_check(first_step, dampening, what):
    model, fused = _fused(3, first_step, dampening)
    last = [o.name for o in model.graph.output][-2:]  # the third update's new weights and buffer
    for seed in (0, 4, 7):
        check = check_models(model, _edited(fused, what), seed=seed)
        assert not check.passed, seed
        failed = {e["name"] for e in check.outputs if not e["passed"]}
        assert failed & set(last), (seed, _failures(check))


@pytest.mark.parametrize("what", ["dampening", "momentum"])
def test_a_wrong_first_link_fails_at_its_own_outputs_though_the_next_one_reads_them(what):
    # The next update's bound allows the difference of the add_1 it reads; add_1 itself must still fail.
    model, fused = _fused(3, False, 0.3)
    first = [o.name for o in model.graph.output][:2]
    for seed in (0, 4, 7):
        check = check_models(model, _edited(fused, what, 0), seed=seed)
        failed = {e["name"] for e in check.outputs if not e["passed"]}
        assert not check.passed and failed & set(first), (seed, _failures(check))
