"""Formulations a public-bug-report hunt found refused although they are momentum SGD, in the shape PyTorch's
dynamo exporter writes them (``tests/hunt_graphs.py``): each must fuse, and the fused model must compute what
numpy computes for ``torch.optim.SGD`` with the feature the graph adds (a loss scaler's skip, a clip factor,
an FP16 round trip, a first step); the near misses that are not one SGD update must stay refused, saying why.

The expected numbers come from numpy (:func:`_reference`), never from sgdfuse or from the graphs: the original
graph is run against the same numbers first, so a builder that does not compute what its docstring says fails
there, not in the comparison with the fused model. ``sgdfuse check`` (``check_models``) must pass as well.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import sgdfuse
from hunt_graphs import DAMPENING, GUARD_FORMS, LR, MOMENTUM, SHAPES, broadcast_first_step, clipped, fp16_round_trip, loss_scaled
from sgdfuse.runtime import make_session, run
from sgdfuse.verify import check_models

STEPS = 4


def _reference(p, g, b, *, first=False, skip_parameters=False, skip_buffer=False):
    """One ``torch.optim.SGD`` step (momentum 0.9, dampening 0.25, lr 0.1) in float64 for one tensor: the first
    step ``buf = g``, later ``buf = m*buf + (1-d)*g``; ``p - lr*buf``; a skipped state keeps its old value."""
    p, g, b = (np.asarray(x, np.float64) for x in (p, g, b))
    new_b = g.copy() if first else MOMENTUM * b + (1 - DAMPENING) * g
    new_p = p - LR * new_b
    return (p if skip_parameters else new_p), (b if skip_buffer else new_b)


def _fuse(model: onnx.ModelProto, count: int = len(SHAPES)):
    result = sgdfuse.optimize(model)
    assert not result.report.refused, result.report.refused
    assert len(result.report.fused) == count, result.report
    assert all(u["passed"] for u in result.report.verification.updates)
    onnx.checker.check_model(result.model, full_check=True)
    return result


def _chain(model: onnx.ModelProto, state: dict[str, np.ndarray], feeds_per_step) -> list[dict[str, np.ndarray]]:
    """Run ``model`` for :data:`STEPS` steps, each output k < n fed back as ``p{k}``, output n + k as ``b{k}``."""
    session = make_session(model)
    names = [o.name for o in model.graph.output]
    n = len(names) // 2
    state = dict(state)
    results = []
    for step in range(STEPS):
        got = run(session, {**state, **feeds_per_step(step)})
        results.append(got)
        state = {**{f"p{k}": got[names[k]] for k in range(n)}, **{f"b{k}": got[names[n + k]] for k in range(n)}}
    return results


def _assert_follows_reference(original, fused, state, feeds_per_step, reference_step):
    """Both models, chained over :data:`STEPS` steps from ``state``, agree with numpy's ``reference_step(step,
    state, feeds) -> state`` (``{p0, b0, ...}``) at every step; and ``sgdfuse check`` passes."""
    expected_state = {k: v.astype(np.float64) for k, v in state.items()}
    expected = []
    for step in range(STEPS):
        expected_state = reference_step(step, expected_state, feeds_per_step(step))
        expected.append(expected_state)
    names = [o.name for o in original.graph.output]
    n = len(names) // 2
    for which, model in (("original", original), ("fused", fused)):
        for step, (got, want) in enumerate(zip(_chain(model, state, feeds_per_step), expected)):
            for k in range(n):
                for output, key in ((names[k], f"p{k}"), (names[n + k], f"b{k}")):
                    np.testing.assert_allclose(got[output], want[key], rtol=2e-5, atol=1e-6, err_msg=f"{which} {output} at step {step}")
    assert check_models(original, fused).passed


def _state(seed: int = 0, *, zero_buffers: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {}
    for k, shape in enumerate(SHAPES):
        state[f"p{k}"] = rng.standard_normal(shape).astype(np.float32)
        state[f"b{k}"] = np.zeros(shape, np.float32) if zero_buffers else rng.standard_normal(shape).astype(np.float32)
    return state


def _gradients(step: int, *, seed: int = 1, infinite: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + step)
    grads = {f"g{k}": rng.standard_normal(shape).astype(np.float32) for k, shape in enumerate(SHAPES)}
    if infinite:
        grads["g1"][0, 1] = np.inf  # one overflowed element of one gradient: the whole step is skipped
    return grads


def _tensor_step(step_state, feeds, rule):
    """``rule(k, p, g, b) -> (p', b')`` applied to every tensor of the step."""
    out = {}
    for k in range(len(SHAPES)):
        out[f"p{k}"], out[f"b{k}"] = rule(k, step_state[f"p{k}"], feeds[f"g{k}"], step_state[f"b{k}"])
    return out


# -- 1. a loss scaler's skipped step, however the skip is written ---------------------------------------------


SKIPPED_STEPS = (1, 3)


def _skip_feeds(form: str):
    """Feeds of step ``k`` for :func:`loss_scaled` ``form``: the step is skipped on :data:`SKIPPED_STEPS` (the
    flag set, or an infinite gradient where the graph computes the flag from the gradients)."""

    def feeds(step: int) -> dict[str, np.ndarray]:
        skipped = step in SKIPPED_STEPS
        if form in ("isfinite_all", "nonfinite_any"):
            return _gradients(step, infinite=skipped)
        flag = ("finite", not skipped) if form == "expand" else ("found_inf", skipped)
        return {**_gradients(step), flag[0]: np.array(flag[1])}

    return feeds


@pytest.mark.parametrize("form", GUARD_FORMS)
def test_a_loss_scaled_skip_fuses_however_the_guard_is_written(form):
    # Not(found_inf) once per Where, mixed polarity, a broadcast predicate, a detached kept value: each was
    # refused as guarded-update ("one guard must skip both", "not one boolean"); the forms computed from the
    # gradients (isfinite_all, nonfinite_any) fused before and must go on fusing.
    original = loss_scaled(form)
    result = _fuse(original)
    condition = {"not_per_where": "found_inf", "mixed_polarity": "found_inf", "detach": "found_inf", "expand": "finite"}.get(form)
    for fused in result.report.fused:
        assert fused.guard.startswith("skipped where"), fused.guard
        if condition is not None:
            assert fused.guard == f"skipped where {condition} is {'false' if form == 'expand' else 'true'}", fused.guard
        assert (fused.dampening, fused.momentum, fused.learning_rate) == (pytest.approx(DAMPENING), pytest.approx(MOMENTUM), pytest.approx(LR))

    def reference(step, state, feeds):
        skipped = step in SKIPPED_STEPS
        return _tensor_step(state, feeds, lambda k, p, g, b: _reference(p, g, b, skip_parameters=skipped, skip_buffer=skipped))

    _assert_follows_reference(original, result.model, _state(), _skip_feeds(form), reference)


@pytest.mark.parametrize("guarded", ["parameters", "buffer"])
def test_a_guard_on_one_state_fuses_and_keeps_that_state_alone(guarded):
    # torch.where on the weights only (a frozen step for the weights while the buffer still moves), or on the
    # buffers only: the fused node computes both updates, as the graph does, and the graph's one Where keeps
    # that state. Refused before as "a skipped step would still move one of them" (which the graph does too).
    original = loss_scaled("not_per_where", guarded=guarded)
    result = _fuse(original)
    other = "buffer is" if guarded == "parameters" else "parameters are"
    assert {f.guard for f in result.report.fused} == {f"{guarded} skipped where found_inf is true (the {other} updated on every step)"}

    def reference(step, state, feeds):
        skipped = step in SKIPPED_STEPS
        return _tensor_step(
            state, feeds, lambda k, p, g, b: _reference(p, g, b, skip_parameters=skipped and guarded == "parameters", skip_buffer=skipped and guarded == "buffer")
        )

    _assert_follows_reference(original, result.model, _state(), _skip_feeds("not_per_where"), reference)


# -- 3. a clip factor computed in the graph -------------------------------------------------------------------


def _clip_coefficient(feeds) -> float:
    """``clip_grad_norm_(max_norm=1.0)``'s factor: ``min(1, 1 / (total_norm + 1e-6))``."""
    total = np.sqrt(sum(float(np.sum(np.asarray(feeds[f"g{k}"], np.float64) ** 2)) for k in range(len(SHAPES))))
    return min(1.0, 1.0 / (total + 1e-6))


@pytest.mark.parametrize("first_step", [True, False])
def test_a_clipped_gradient_fuses_with_the_clip_as_a_runtime_factor_on_the_gradient(first_step):
    # With a first step (buf = g_c, no dampening) the gradient must be the clipped g*clip_coef and the
    # dampening the graph's 0.25: the reading that folds 0.75 into the gradient (dampening 0) cannot express
    # the first step, and it was the only one tried (refused as first-step-unsupported).
    original = clipped(first_step=first_step)
    result = _fuse(original)
    for k, fused in enumerate(result.report.fused):
        gradient = onnx_producer(original, fused.gradient)
        assert gradient is not None and gradient.op_type == "Mul", fused
        if first_step:
            assert "clamp" in gradient.input and f"g{k}" in gradient.input, fused  # g*clip_coef itself
            assert fused.dampening == pytest.approx(DAMPENING) and fused.source == "pattern with first-step Where"

    def feeds(step):
        return {**_gradients(step), **({"step": np.array(step, np.int64)} if first_step else {})}

    def reference(step, state, step_feeds):
        coef = _clip_coefficient(step_feeds)
        return _tensor_step(state, step_feeds, lambda k, p, g, b: _reference(p, np.asarray(g, np.float64) * coef, b, first=first_step and step == 0))

    # Non-zero buffers on the first step: the fused model must still give buf = g_c there.
    _assert_follows_reference(original, result.model, _state(), feeds, reference)


def onnx_producer(model: onnx.ModelProto, value: str) -> onnx.NodeProto | None:
    return next((n for n in model.graph.node if value in n.output), None)


def test_a_first_step_taking_another_gradient_than_later_steps_is_refused():
    # buf = where(step == 0, g, m*buf + (1-d)*g*clip_coef): the first step's gradient is not the later steps'
    # (unclipped), which no dampening expresses; it must be refused, never fused with some dampening.
    result = sgdfuse.optimize(clipped(first_unclipped=True))
    assert not result.report.fused
    assert {r.reason for r in result.report.refused} == {"first-step-unsupported"}, result.report.refused


# -- 4. a gradient round-tripped through FLOAT16 ---------------------------------------------------------------


def test_a_gradient_round_tripped_through_float16_is_the_gradient():
    # g.half().float() before the update: the op takes the round-tripped FLOAT value as its gradient; the
    # FLOAT16 value inside the gradient's own computation is not a rounding of the update midway (refused
    # before as mixed-precision).
    original = fp16_round_trip()
    result = _fuse(original)
    for k, fused in enumerate(result.report.fused):
        assert fused.gradient != f"g{k}", fused  # the exact gradient would skip the rounding

    def reference(step, state, feeds):
        return _tensor_step(state, feeds, lambda k, p, g, b: _reference(p, np.asarray(g).astype(np.float16).astype(np.float64), b))

    _assert_follows_reference(original, result.model, _state(), _gradients, reference)


def test_an_update_reading_the_gradient_both_rounded_and_exact_is_refused():
    # (m*buf + 0.375*round(g)) + 0.375*g: the normaliser reads the FLOAT16 round trip as a copy, so the term is
    # 0.75*g algebraically, but no value computes it; reading it as round(g) or g is wrong by the rounding.
    result = sgdfuse.optimize(fp16_round_trip(mixed=True))
    assert not result.report.fused
    assert {r.reason for r in result.report.refused} == {"mixed-precision"}, result.report.refused


# -- 5. a first-step condition of several elements ----------------------------------------------------------------


def test_a_first_step_on_a_broadcast_condition_fuses():
    # where(expand(step == 0), g, m*buf + (1-d)*g): one boolean broadcast to the tensor. Refused before as
    # "where reads a single tensor: momentum is 0".
    original = broadcast_first_step()
    result = _fuse(original)
    assert all(f.source == "pattern with first-step Where" and f.dampening == pytest.approx(DAMPENING) for f in result.report.fused)

    def feeds(step):
        return {**_gradients(step), "step": np.array(step, np.int64)}

    def reference(step, state, step_feeds):
        return _tensor_step(state, step_feeds, lambda k, p, g, b: _reference(p, g, b, first=step == 0))

    _assert_follows_reference(original, result.model, _state(), feeds, reference)


def test_a_per_element_first_step_is_refused_naming_its_condition():
    result = sgdfuse.optimize(broadcast_first_step(per_element=True))
    assert not result.report.fused
    [*refused] = result.report.refused
    assert {r.reason for r in refused} == {"first-step-unsupported"}, refused
    assert "its condition eq has 12 elements" in refused[0].detail and "momentum is 0" not in refused[0].detail, refused[0].detail
