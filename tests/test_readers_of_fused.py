"""An update whose gradient is computed from another update's *new* values (``g2 = 2*w1_new``) is fused or
refused with a reason, never dropped in silence.

Read through the first update's nodes, the second one's gradient mixes the first one's state; the matcher
dropped it as "a reader of a fused update" (the rule for ``delta = lr*buf_out``): the report said "refused 0"
and one SGD node was written where the graph holds two updates. After the rewrite the first update's new
values are an SGD node's outputs, which the second update's gradient reads like any computed value
(``sgd_match._solve_readers_of_fused``). The graphs are ``tests/hunt_graphs.py``'s :func:`reads_fused_update`;
the expected numbers come from numpy (``torch.optim.SGD``'s step, :func:`_reference`), never from sgdfuse.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import sgdfuse
from hunt_graphs import DAMPENING, LR, MOMENTUM, reads_fused_update
from sgdfuse.runtime import make_session, run
from sgdfuse.verify import check_models

SHAPE = (4, 3)
STEPS = 3


def _gradient_of(form: str, new_p: np.ndarray, new_b: np.ndarray) -> np.ndarray:
    """The next update's gradient as :func:`reads_fused_update`'s docstring defines it."""
    return {"twice_new_weights": 2 * new_p, "new_weights_times_c": 0.5 * new_p, "twice_new_buffer": 2 * new_b}[form]


def _reference(form: str, chain: int, state: dict, g0: np.ndarray, step: int) -> dict:
    """One step of ``chain`` ``torch.optim.SGD`` updates (momentum 0.9, dampening 0.25, lr 0.1; the first step
    ``buf = g``) in float64, update i + 1's gradient computed from update i's new values."""
    out, grad = {}, np.asarray(g0, np.float64)
    for i in range(chain):
        p, b = (np.asarray(state[f"{kind}{i}"], np.float64) for kind in "pb")
        new_b = grad.copy() if step == 0 else MOMENTUM * b + (1 - DAMPENING) * grad
        new_p = p - LR * new_b
        out[f"p{i}"], out[f"b{i}"] = new_p, new_b
        grad = _gradient_of(form, new_p, new_b)
    return out


def _chained(model: onnx.ModelProto, chain: int, state: dict, gradients: list) -> list[dict]:
    """``model`` run for ``len(gradients)`` steps; its outputs are (p_new, b_new) per update, fed back."""
    session = make_session(model)
    names = [o.name for o in model.graph.output]
    results = []
    for step, g0 in enumerate(gradients):
        got = run(session, {**state, "g0": g0, "step": np.array(step, np.int64)})
        state = {f"{kind}{i}": got[names[2 * i + j]] for i in range(chain) for j, kind in enumerate("pb")}
        results.append(state)
    return results


@pytest.mark.parametrize("form", ["twice_new_weights", "new_weights_times_c", "twice_new_buffer"])
@pytest.mark.parametrize("chain", [2, 3])
def test_an_update_whose_gradient_reads_another_updates_new_values_fuses_and_computes_torch_sgd(form, chain):
    model = reads_fused_update(form, chain=chain)
    result = sgdfuse.optimize(model)
    report = result.report
    assert not report.refused, report.refused
    assert sorted(f.parameters for f in report.fused) == [f"p{i}" for i in range(chain)], report.fused
    assert report.verification.passed and all(u["passed"] for u in report.verification.updates)
    assert sum(n.op_type == "SGD" for n in result.model.graph.node) == chain
    onnx.checker.check_model(result.model, full_check=True)  # also: every value defined before it is read
    rng = np.random.default_rng(3)
    state = {f"{kind}{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(chain) for kind in "pb"}
    gradients = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(STEPS)]
    expected, current = [], state
    for step, g0 in enumerate(gradients):
        current = _reference(form, chain, current, g0, step)
        expected.append(current)
    for which, m in (("original", model), ("fused", result.model)):
        for step, (got, want) in enumerate(zip(_chained(m, chain, state, gradients), expected)):
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6, err_msg=f"{which} {key} at step {step}")
    assert check_models(model, result.model).passed


def test_an_update_without_a_first_step_reading_new_weights_fuses():
    # The simpler form (no Where): the second buffer is 0.9*b1 + 0.75*(2*p0_new).
    model = reads_fused_update("twice_new_weights", first_step=False)
    result = sgdfuse.optimize(model)
    assert not result.report.refused and len(result.report.fused) == 2, result.report
    assert result.report.verification.passed
    assert check_models(model, result.model).passed


@pytest.mark.parametrize("form, reason", [("twice_new_weights", "extra-term"), ("new_weights_plus_input", "gradient-mixes-tensors")])
@pytest.mark.parametrize("first_step", [True, False])
def test_a_reader_of_new_weights_that_is_not_momentum_sgd_is_refused_with_its_reason(form, reason, first_step):
    # Decoupled weight decay on the second update (p1 - lr*buf - 0.01*p1), or a gradient 2*p0_new + h1 that
    # weighs two tensors differently: not the contract's update; it must be in the refusals, by name, with the
    # reason of its own terms. With the first-step Where, 2*p0_new + h1 was reported as computed-state: a
    # reading taking p0_new (the fused update's new weights) as this update's buffer outranked the real one.
    model = reads_fused_update(form, decoupled_decay=form == "twice_new_weights", first_step=first_step)
    report = sgdfuse.inspect(model)
    assert [f.parameters for f in report.fused] == ["p0"], report.fused
    second = model.graph.output[2].name
    mine = [r for r in report.refused if r.candidate == second]
    assert len(mine) == 1 and mine[0].reason == reason and mine[0].detail, report.refused
    if reason == "gradient-mixes-tensors":
        assert [r.candidate for r in report.refused] == [second], report.refused


def test_a_first_step_update_whose_gradient_mixes_inputs_is_refused_for_the_mix_not_the_first_step():
    # The same kind unchained: where(step == 0, g, 0.9*b + 0.75*g) with g = 2*x + h. The branches read the other
    # way round (buffer x, momentum 2) failed the first-step check, which outranked the real reading's
    # refusal (first-step-unsupported for gradient-mixes-tensors).
    from onnx import TensorProto

    from hunt_graphs import F32, Exported

    b = Exported()
    p, buf, x, h = (b.input(name, F32, SHAPE) for name in ("p", "b", "x", "h"))
    step = b.input("step", TensorProto.INT64)
    grad = b.op("Add", [b.op("Mul", [x, b.const(2.0)], "mul"), h], "add")
    first = b.op("Expand", [b.op("Equal", [step, b.const(0, np.int64)], "eq"), b.const(SHAPE, np.int64, (2,))], "expand")
    new_buf = b.op("Where", [first, grad, b.momentum(buf, grad)], "where")
    report = sgdfuse.inspect(b.model([(b.step(p, new_buf), SHAPE), (new_buf, SHAPE)]))
    assert not report.fused and [r.reason for r in report.refused] == ["gradient-mixes-tensors"], report.refused


def test_an_output_scaling_a_fused_updates_new_buffer_is_still_a_reader_not_a_refusal():
    # delta = lr*buf_new beside the update is no update of its own: solved again with the fused update's
    # outputs opaque, it is one leaf, so it stays out of the refusals (as before).
    from onnx import helper

    from graphs import momentum_sgd, value

    model = momentum_sgd(extra_nodes=[helper.make_node("Mul", ["buf_out", "lr"], ["delta"], name="delta")],
                         extra_outputs=[value("delta")])
    report = sgdfuse.inspect(model)
    assert len(report.fused) == 1 and not report.refused, report


_FACTOR = {"twice_new_weights": 2.0, "new_weights_times_c": 0.5, "twice_new_buffer": 2.0}
"""The constant each form of :func:`reads_fused_update` scales the previous update's new values by."""


def _gradient_values(model: onnx.ModelProto, form: str, chain: int) -> list[str]:
    """The value the builder computes as update ``i``'s gradient, for i = 1 .. chain - 1: the ``Mul`` of update
    ``i - 1``'s new weights (or buffer) by the form's constant (read off the graph, not off sgdfuse)."""
    from onnx import numpy_helper

    constants = {t.name: float(numpy_helper.to_array(t)) for t in model.graph.initializer if not t.dims}
    outputs = [o.name for o in model.graph.output]
    found = []
    for i in range(1, chain):
        source = outputs[2 * (i - 1) + (1 if form == "twice_new_buffer" else 0)]
        (value,) = [n.output[0] for n in model.graph.node if n.op_type == "Mul" and source in n.input
                    and any(constants.get(x) == _FACTOR[form] for x in n.input)]
        found.append(value)
    return found


@pytest.mark.parametrize("form", sorted(_FACTOR))
@pytest.mark.parametrize("dampening", [0.0, 0.25])
@pytest.mark.parametrize("chain", [2, 3])
def test_an_update_reading_new_values_is_read_with_the_users_gradient_and_dampening(form, dampening, chain):
    # Without a first-step Where the algebra cannot tell g2 = 2*p0_new (dampening d) from gradient p0_new with
    # 1 - d' = 2*(1 - d): the matcher read the latter, dampening -1 (-0.5 for d = 0.25), and 0.5*p0_new with
    # 0.75 as dampening 0.625. Numbers were right; the reported hyper-parameters were not the user's, and
    # `sgdfuse state` refused a checkpoint without buffers for the "dampening -1".
    model = reads_fused_update(form, first_step=False, chain=chain, dampening=dampening)
    result = sgdfuse.optimize(model)
    report = result.report
    assert not report.refused and report.verification.passed, report
    by_parameters = {f.parameters: f for f in report.fused}
    assert sorted(by_parameters) == [f"p{i}" for i in range(chain)]
    assert [by_parameters[f"p{i}"].dampening for i in range(chain)] == [dampening] * chain
    assert [by_parameters[f"p{i}"].gradient for i in range(1, chain)] == _gradient_values(model, form, chain)
    assert by_parameters["p0"].gradient == "g0"
    assert check_models(model, result.model).passed


def test_state_maps_a_checkpoint_without_buffers_onto_a_chained_update_and_it_takes_torchs_first_step(tmp_path):
    # The chain of two read with dampening -1 made `state` refuse the first step; read with the user's
    # dampening 0 it is exact: a zero buffer and dampening 0 give buf = grad. The numbers are torch's first
    # step (buf = g, p' = p - lr*g; g1 = 2*p0'), in numpy.
    from sgdfuse.checkpoint import checkpoint_feeds

    model = reads_fused_update("twice_new_weights", first_step=False, dampening=0.0)
    fused = tmp_path / "chain.fused.onnx"
    sgdfuse.optimize(model).save(fused)
    rng = np.random.default_rng(7)
    p0, p1, g0 = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3))
    np.savez(tmp_path / "ckpt.npz", p0=p0, p1=p1)
    feeds = checkpoint_feeds(tmp_path / "ckpt.npz", fused).feeds
    fused_model = onnx.load(fused)
    got = run(make_session(fused_model), {**feeds, "g0": g0})
    outputs = [o.name for o in model.graph.output]
    p0_new = p0.astype(np.float64) - LR * g0
    g1 = 2 * p0_new
    want = {outputs[0]: p0_new, outputs[1]: g0, outputs[2]: p1 - LR * g1, outputs[3]: g1}
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def _scaled_gradient_update(factor: float, dampening: float) -> tuple[onnx.ModelProto, str]:
    """One unchained update ``buf' = 0.9*buf + (1 - d)*(factor*g)``, ``p' = p - 0.1*buf'``, and the name of the
    value ``factor*g`` (``g`` itself when ``factor`` is 1)."""
    from hunt_graphs import F32, Exported

    b = Exported()
    p, buf, g = (b.input(name, F32, SHAPE) for name in ("p", "buf", "g"))
    grad = g if factor == 1.0 else b.op("Mul", [g, b.const(factor)], "scaled")
    new_buf = b.momentum(buf, grad, one_minus_d=1 - dampening)
    return b.model([(b.step(p, new_buf), SHAPE), (new_buf, SHAPE)]), grad


@pytest.mark.parametrize("dampening", [0.0, 0.25])
def test_an_unchained_gradient_scaled_by_more_than_one_is_read_with_dampening_in_range(dampening):
    # The same kind without a chain: 0.9*buf + 2*g was read as gradient g with dampening -1 (and
    # 0.9*buf + 0.75*(2*g) as dampening -0.5); a factor above 1 is no 1 - d of a dampening in [0, 1).
    model, scaled = _scaled_gradient_update(2.0, dampening)
    result = sgdfuse.optimize(model)
    ((entry,),) = [result.report.fused]
    assert (entry.gradient, entry.dampening) == (scaled, dampening) and result.report.verification.passed
    assert check_models(model, result.model).passed


@pytest.mark.parametrize("factor, dampening, gradient, read_dampening", [(1.0, 0.25, "g", 0.25), (0.5, 0.0, "g", 0.5)])
def test_a_plain_update_keeps_the_leaf_gradient_with_the_graphs_own_factor_as_dampening(factor, dampening, gradient, read_dampening):
    # Regression guard: torch's own 0.9*buf + 0.75*g stays gradient g, dampening 0.25, and a factor in (0, 1)
    # on a leaf gradient is still read as dampening (0.9*buf + 0.5*g: dampening 0.5), as before.
    model, _ = _scaled_gradient_update(factor, dampening)
    ((entry,),) = [sgdfuse.inspect(model).fused]
    assert (entry.gradient, entry.dampening) == (gradient, read_dampening)


def _guarded_reader(first_guarded: bool) -> onnx.ModelProto:
    """Two updates (dampening 0.25, as :func:`reads_fused_update`), the second's gradient ``2*p0_new`` and the
    second's state guarded by a loss scaler, ``Where(found_inf, old, new)`` (the first's too when
    ``first_guarded``). Outputs: p0', b0', p1', b1'."""
    from onnx import TensorProto

    from hunt_graphs import F32, Exported

    b = Exported()
    p0, p1, b0, b1, g0 = (b.input(name, F32, SHAPE) for name in ("p0", "p1", "b0", "b1", "g0"))
    found_inf = b.input("found_inf", TensorProto.BOOL)
    new_b0 = b.momentum(b0, g0)
    new_p0 = b.step(p0, new_b0)
    new_b1 = b.momentum(b1, b.op("Mul", [new_p0, b.const(2.0)], "mul"))
    new_p1 = b.step(p1, new_b1)
    guard = lambda old, new: b.op("Where", [found_inf, old, new], "where")
    outputs = [guard(p0, new_p0), guard(b0, new_b0)] if first_guarded else [new_p0, new_b0]
    return b.model([(o, SHAPE) for o in outputs + [guard(p1, new_p1), guard(b1, new_b1)]])


@pytest.mark.parametrize("first_guarded", [False, True])
def test_a_guarded_update_reading_new_weights_fuses_with_its_guard_and_skips_as_torch_does(first_guarded):
    # The reader was solved again without its guard: its outputs are Where nodes, no update, so it was
    # neither fused nor refused (dropped in silence, one SGD node for two updates). Now it fuses with its guard.
    model = _guarded_reader(first_guarded)
    result = sgdfuse.optimize(model)
    report = result.report
    assert not report.refused and report.verification.passed, report
    by_parameters = {f.parameters: f for f in report.fused}
    assert sorted(by_parameters) == ["p0", "p1"] and by_parameters["p1"].guard and bool(by_parameters["p0"].guard) == first_guarded
    assert check_models(model, result.model).passed
    # torch with a GradScaler: a step with found_inf skips the guarded states (numpy, float64).
    rng = np.random.default_rng(5)
    state = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("p0", "b0", "p1", "b1")}
    session, names = make_session(result.model), [o.name for o in model.graph.output]
    want = {k: v.astype(np.float64) for k, v in state.items()}
    for found_inf in (False, True, False):
        g0 = rng.standard_normal(SHAPE).astype(np.float32)
        got = run(session, {**state, "g0": g0, "found_inf": np.array(found_inf)})
        b0 = MOMENTUM * want["b0"] + (1 - DAMPENING) * g0
        p0 = want["p0"] - LR * b0
        b1 = MOMENTUM * want["b1"] + (1 - DAMPENING) * 2 * p0
        p1 = want["p1"] - LR * b1
        if not (found_inf and first_guarded):
            want["p0"], want["b0"] = p0, b0
        if not found_inf:
            want["p1"], want["b1"] = p1, b1
        state = dict(zip(("p0", "b0", "p1", "b1"), (got[n] for n in names)))
        for key in want:
            np.testing.assert_allclose(state[key], want[key], rtol=2e-5, atol=1e-6, err_msg=f"{key}, found_inf={found_inf}")
