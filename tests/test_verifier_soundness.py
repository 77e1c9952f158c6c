"""The verifier (``sgdfuse.verify``) cannot be fooled: wrong plans are refused, wrong fused models fail
``check``.

Each test hands the verifier a fused update that computes other numbers than its original and asserts it is
caught, or a correct one that must still pass. The wrong plans are built here (the matcher may refuse the
same graphs on its own; the verifier must catch them independently):

- a 1e-4 relative change of dampening, learning rate or momentum (a loosening of the bound by much less
  than the 1e4 x it takes to pass these would let them through: the bound is a few FLOAT ulps of the
  coefficient);
- the Keras step ``m' = 0.9*m - lr*g; w' = w + m'`` fused as maximize with learning rate -1 and dampening
  1 - lr, whose FLOAT dampening attribute cannot express ``1 - d = lr`` (off by 1.3e-2 relative at lr 1e-6,
  6.5e-5 at lr 1e-3; at lr 0.1 it is 2.2e-7 = 3.7 FLOAT roundings, within the op's own roundoff and accepted,
  though the matcher prefers the exact reading with the graph's own lr*g);
- a wrong output taken as the in-place buffer or weights (ONNX outputs identical, in-place state not);
- a [2, 1] constant used as the learning rate against parameters [N, 4];
- terms that cancel algebraically but not in floating point (``(x + z) - z``, ``0*z``, ``(x*s)/s``).

Expected behaviour is the operator contract (``sgdfuse.reference``) and onnxruntime, not
the verifier's own output.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs  # noqa: E402
import sgdfuse.api as api  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.linear import Poly  # noqa: E402
from sgdfuse.passes.rewrite import Planner, apply_plans  # noqa: E402
from sgdfuse.passes.sgd_match import Match  # noqa: E402
from sgdfuse.reference import sgd as reference_sgd  # noqa: E402
from sgdfuse.verify import check_models, verify_plans  # noqa: E402

F32 = TensorProto.FLOAT


def _match(model: onnx.ModelProto, **fields) -> Match:
    """A hand-made match over every node of ``model`` (plain SGD defaults, overridden by ``fields``)."""
    values = dict(
        parameters="p", gradient="g", accum="buf", parameters_out="p_out", accum_out="buf_out",
        learning_rate=Poly.const(0.1), momentum=Poly.const(0.9), dampening=0.0, weight_decay=0.0,
        nesterov=False, maximize=False, dtype=F32, shape=(2, 3), nodes=set(range(len(model.graph.node))),
        parameter_equation="", accum_equation="", first_step=None,
    )
    values.update(fields)
    return Match(**values)


def _verify(model: onnx.ModelProto, match: Match):
    index = build_index(model)
    plan = Planner(index).plan(match)
    (check,) = verify_plans(model, index, [plan])
    return check, apply_plans(model, index, [plan])


def _cli_check(original: onnx.ModelProto, fused: onnx.ModelProto, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    onnx.save(original, tmp_path / "original.onnx")
    onnx.save(fused, tmp_path / "fused.onnx")
    script = Path(sys.executable).with_name("sgdfuse")
    return subprocess.run(
        [str(script), "check", "original.onnx", "fused.onnx"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={"COLUMNS": "250", "NO_COLOR": "1", "PATH": str(script.parent), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )


# -- wrong coefficients ----------------------------------------------------------------------------------


def _damped_wd_model() -> onnx.ModelProto:
    """PyTorch's step with dampening 0.25 and weight decay 0.01, written out::

        grad    = g + 0.01*p
        buf_out = 0.9*buf + 0.75*grad
        p_out   = p - 0.1*buf_out
    """
    nodes = [
        helper.make_node("Mul", ["p", "wd"], ["p_wd"]),
        helper.make_node("Add", ["g", "p_wd"], ["grad"]),
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Mul", ["grad", "one_minus_d"], ["grad_d"]),
        helper.make_node("Add", ["buf_m", "grad_d"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    initializers = [graphs.scalar("wd", 0.01), graphs.scalar("m", 0.9), graphs.scalar("one_minus_d", 0.75), graphs.scalar("lr", 0.1)]
    return graphs.make_model(nodes, [graphs.value(n) for n in ("p", "g", "buf")], [graphs.value("p_out"), graphs.value("buf_out")], initializers)


def _scaled_tensor(tensor: onnx.TensorProto, factor: float) -> onnx.TensorProto:
    array = numpy_helper.to_array(tensor)
    return numpy_helper.from_array((array.astype(np.float64) * factor).astype(array.dtype), name=tensor.name)


def _mutate_plan(plan, what: str):
    """``plan`` with dampening, learning rate or momentum 1e-4 relatively off."""
    factor = 1 + 1e-4
    if what == "dampening":
        for attribute in plan.sgd_node.attribute:
            if attribute.name == "dampening":
                attribute.f = float(np.float32(attribute.f * factor))
        return plan
    name = plan.learning_rate_input if what == "learning_rate" else plan.momentum_input
    initializers = [_scaled_tensor(t, factor) if t.name == name else t for t in plan.initializers]
    assert initializers != plan.initializers, f"the plan has no {what} initializer to change"
    return dataclasses.replace(plan, initializers=initializers)


def test_the_correct_plan_of_the_damped_update_passes_and_fuses():
    # The control for the mutations below: the same pipeline, unmutated, fuses.
    result = api.optimize(_damped_wd_model())
    assert [f.parameters_out for f in result.report.fused] == ["p_out"]
    assert result.report.fused[0].dampening == pytest.approx(0.25)
    assert all(u["passed"] for u in result.report.verification.updates)


@pytest.mark.parametrize("what", ["dampening", "learning_rate", "momentum"])
def test_optimize_refuses_a_plan_with_a_coefficient_1e_4_relatively_off_and_leaves_the_model_unfused(monkeypatch, what):
    class WrongPlanner(Planner):
        def plan(self, match):
            return _mutate_plan(super().plan(match), what)

    monkeypatch.setattr(api, "Planner", WrongPlanner)
    model = _damped_wd_model()
    result = api.optimize(model)
    assert result.report.fused == []
    assert [(r.candidate, r.reason) for r in result.report.refused] == [("p_out", "verification-failed")]
    assert not any(n.domain == "ai.sgdfuse" for n in result.model.graph.node)
    assert result.model.SerializeToString() == model.SerializeToString()


def test_optimize_refuses_a_plan_whose_buffer_output_is_swapped(monkeypatch):
    # accum_out swapped for the parameters' output (and the other way round): same values in the graph,
    # written to the wrong state.
    class SwappingPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            outputs = list(plan.sgd_node.output)
            outputs[0], outputs[1] = outputs[1], outputs[0]
            del plan.sgd_node.output[:]
            plan.sgd_node.output.extend(outputs)
            return plan

    monkeypatch.setattr(api, "Planner", SwappingPlanner)
    model = _damped_wd_model()
    result = api.optimize(model)
    assert result.report.fused == []
    assert [(r.candidate, r.reason) for r in result.report.refused] == [("p_out", "verification-failed")]
    assert result.model.SerializeToString() == model.SerializeToString()


# -- the Keras step fused with dampening 1 - lr ----------------------------------------------------------


def _keras_model(lr: float) -> onnx.ModelProto:
    """Keras' momentum step: ``m_out = 0.9*m - lr*g;  w_out = w + m_out``."""
    nodes = [
        helper.make_node("Mul", ["m", "momentum"], ["m_scaled"]),
        helper.make_node("Mul", ["g", "lr"], ["g_scaled"]),
        helper.make_node("Sub", ["m_scaled", "g_scaled"], ["m_out"]),
        helper.make_node("Add", ["w", "m_out"], ["w_out"]),
    ]
    initializers = [graphs.scalar("momentum", 0.9), graphs.scalar("lr", lr)]
    return graphs.make_model(nodes, [graphs.value(n) for n in ("w", "g", "m")], [graphs.value("w_out"), graphs.value("m_out")], initializers)


def _keras_as_maximize(model: onnx.ModelProto, lr: float) -> Match:
    # The reading that fooled the old verifier: m_out = 0.9*m + (1 - d)*(-g) with d = 1 - lr, w_out = w - (-1)*m_out.
    return _match(
        model, parameters="w", accum="m", parameters_out="w_out", accum_out="m_out", learning_rate=Poly.const(-1.0),
        dampening=1.0 - float(np.float32(lr)), maximize=True,
    )


@pytest.mark.parametrize("lr", [1e-6, 1e-3])
def test_keras_step_fused_with_dampening_one_minus_lr_fails_verification(lr):
    model = _keras_model(lr)
    check, _ = _verify(model, _keras_as_maximize(model, lr))
    assert not check.passed
    assert "double" in check.message  # the lifted run is what sees a coefficient a few ulps off


def test_keras_at_lr_1e_6_the_fused_op_really_computes_another_buffer():
    # Independent of the verifier: the contract's reference with dampening = float32(1 - 1e-6) against the
    # Keras buffer m_out = 0.9*m - lr*g on a zero buffer.
    g = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    zero = np.zeros_like(g)
    one = lambda x: np.array([x], dtype=np.float32)  # noqa: E731
    _, buffer, _ = reference_sgd(zero, -g, one(-1.0), zero, one(0.9), zero, dampening=float(np.float32(1 - 1e-6)))
    keras = -np.float32(1e-6) * g
    assert np.max(np.abs(buffer - keras) / np.abs(keras)) > 1e-2


@pytest.mark.parametrize("lr", [1e-6, 1e-3])
def test_check_fails_on_a_keras_step_fused_with_dampening_one_minus_lr(lr, tmp_path):
    model = _keras_model(lr)
    _, fused = _verify(model, _keras_as_maximize(model, lr))
    result = check_models(model, fused)
    assert not result.passed
    completed = _cli_check(model, fused, tmp_path)
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert "error: the models disagree" in completed.stderr


# -- the wrong output taken as the in-place target -------------------------------------------------------


def _delta_model() -> onnx.ModelProto:
    """``buf_out = 0.9*buf + g;  delta = 0.1*buf_out;  p_out = p - delta`` with outputs (p_out, delta, buf_out)."""
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["delta"]),
        helper.make_node("Sub", ["p", "delta"], ["p_out"]),
    ]
    outputs = [graphs.value("p_out"), graphs.value("delta"), graphs.value("buf_out")]
    return graphs.make_model(nodes, [graphs.value(n) for n in ("p", "g", "buf")], outputs, [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)])


def _delta_as_buffer(model: onnx.ModelProto) -> Match:
    # delta = 0.09*buf + 0.1*g = 0.09*buf + (1 - 0.9)*g and p_out = p - 1*delta: the ONNX outputs are right,
    # but in place buf would receive delta, a tenth of buf_out.
    return _match(model, accum_out="delta", learning_rate=Poly.const(1.0), momentum=Poly.const(0.09), dampening=0.9)


def _p_eval_model() -> onnx.ModelProto:
    """``buf_out = 0.9*buf + g;  p_out = p - 0.1*buf_out;  p_eval = p - 0.1*(g + 0.9*buf_out)``."""
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
        helper.make_node("Mul", ["buf_out", "m"], ["look_ahead"]),
        helper.make_node("Add", ["g", "look_ahead"], ["nesterov_step"]),
        helper.make_node("Mul", ["nesterov_step", "lr"], ["nesterov_delta"]),
        helper.make_node("Sub", ["p", "nesterov_delta"], ["p_eval"]),
    ]
    outputs = [graphs.value("p_eval"), graphs.value("p_out"), graphs.value("buf_out")]
    return graphs.make_model(nodes, [graphs.value(n) for n in ("p", "g", "buf")], outputs, [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)])


WRONG_TARGETS = {
    # (model, wrong match, the state written wrongly, whether every ONNX output still agrees within the bound)
    # delta-as-buffer also applies dampening 0.9, whose FLOAT attribute makes 1 - d 3.7 ulps off 0.1: its
    # outputs fail the bound too.
    "delta-as-buffer": (_delta_model, _delta_as_buffer, "buf", False),
    "p_eval-as-parameters": (_p_eval_model, lambda model: _match(model, parameters_out="p_eval", nesterov=True), "p", True),
}


@pytest.mark.parametrize("case", sorted(WRONG_TARGETS))
def test_verification_fails_when_the_fused_op_writes_the_wrong_output_in_place(case):
    build, wrong, _, _ = WRONG_TARGETS[case]
    model = build()
    check, _ = _verify(model, wrong(model))
    assert not check.passed
    assert "in place" in check.message


@pytest.mark.parametrize("case", sorted(WRONG_TARGETS))
def test_check_fails_on_a_model_fused_with_the_wrong_in_place_target_although_its_outputs_agree(case, tmp_path):
    build, wrong, state, outputs_agree = WRONG_TARGETS[case]
    model = build()
    _, fused = _verify(model, wrong(model))
    result = check_models(model, fused)
    if outputs_agree:
        # Every ONNX output agrees when both are fed the same state: only the in-place run sees the difference.
        assert all(entry["passed"] for entry in result.outputs), result.outputs
    failing = [entry["name"] for entry in result.in_place if not entry["passed"]]
    assert failing == [state]
    assert not result.passed
    assert _cli_check(model, fused, tmp_path).returncode == 1


def test_the_right_in_place_targets_of_the_delta_model_pass():
    model = _delta_model()
    check, fused = _verify(model, _match(model))
    assert check.passed, check.message
    assert check_models(model, fused).passed


# -- dynamic dimensions ----------------------------------------------------------------------------------


def _broadcast_lr_model() -> onnx.ModelProto:
    """Parameters [N, 4], learning rate a uniform constant of shape [2, 1]: ``p_out = p - lr21*buf_out``."""
    shape = ["N", 4]
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    lr = numpy_helper.from_array(np.full((2, 1), 0.1, dtype=np.float32), name="lr")
    inputs = [graphs.value(n, shape=shape) for n in ("p", "g", "buf")]
    outputs = [graphs.value("p_out", shape=["M", 4]), graphs.value("buf_out", shape=shape)]
    return graphs.make_model(nodes, inputs, outputs, [graphs.scalar("m", 0.9), lr])


def test_a_2x1_constant_learning_rate_against_n_by_4_parameters_fails_verification_and_check():
    model = _broadcast_lr_model()
    check, fused = _verify(model, _match(model, shape=("N", 4)))
    assert not check.passed
    result = check_models(model, fused)
    assert not result.passed
    assert any("size 1" in entry["message"] for entry in result.outputs if not entry["passed"])


# -- terms that cancel algebraically but not in floating point ------------------------------------------


def _cancelling_model(form: str) -> onnx.ModelProto:
    """Plain momentum SGD with an extra runtime tensor ``z`` that cancels on paper."""
    n = helper.make_node
    nodes = [n("Mul", ["buf", "m"], ["buf_m"]), n("Add", ["buf_m", "g"], ["buf_sum"])]
    if form == "add-sub":  # buf_out = ((0.9*buf + g) + z) - z
        nodes += [n("Add", ["buf_sum", "z"], ["with_z"]), n("Sub", ["with_z", "z"], ["buf_out"])]
        nodes += [n("Mul", ["buf_out", "lr"], ["step"])]
    elif form == "times-zero":  # buf_out = 0.9*buf + g + 0*z
        nodes += [n("Mul", ["z", "zero"], ["z0"]), n("Add", ["buf_sum", "z0"], ["buf_out"])]
        nodes += [n("Mul", ["buf_out", "lr"], ["step"])]
    else:  # step = ((buf_out*z)*0.1)/z
        nodes += [n("Identity", ["buf_sum"], ["buf_out"]), n("Mul", ["buf_out", "z"], ["scaled"])]
        nodes += [n("Mul", ["scaled", "lr"], ["scaled_lr"]), n("Div", ["scaled_lr", "z"], ["step"])]
    nodes.append(n("Sub", ["p", "step"], ["p_out"]))
    initializers = [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1), graphs.scalar("zero", 0.0)]
    used = {name for node in nodes for name in node.input}
    return graphs.make_model(
        nodes, [graphs.value(x) for x in ("p", "g", "buf", "z")], [graphs.value("p_out"), graphs.value("buf_out")],
        [t for t in initializers if t.name in used],
    )


@pytest.mark.parametrize("form", ["add-sub", "times-zero", "mul-div"])
def test_a_runtime_tensor_that_cancels_only_on_paper_fails_verification(form):
    model = _cancelling_model(form)
    check, _ = _verify(model, _match(model))
    assert not check.passed, form


def test_check_passes_when_an_input_fed_inf_gives_the_same_nan_on_both_sides():
    # z feeds an output the rewrite does not touch: its Inf/NaN is the same on both sides.
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
        helper.make_node("Sub", ["z", "z"], ["z_diff"]),
    ]
    model = graphs.make_model(
        nodes, [graphs.value(n) for n in ("p", "g", "buf", "z")], [graphs.value(n) for n in ("p_out", "buf_out", "z_diff")],
        [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)],
    )
    result = api.optimize(model)
    assert [f.parameters_out for f in result.report.fused] == ["p_out"]
    check = check_models(model, result.model)
    assert check.passed, [e["message"] for e in check.outputs + check.in_place if not e["passed"]]


# -- what the verifier runs --------------------------------------------------------------------------------


def test_the_specialised_fused_function_computes_bit_for_bit_what_the_function_computes():
    # The verifier runs SGD nodes as their function body inlined with the If's on constant attributes
    # resolved; onnxruntime must give the same bits (-0, NaN, Inf included) as the function itself.
    from sgdfuse.contract import SgdAttributes
    from sgdfuse.fused_op import ensure_sgd_function, make_sgd_node
    from sgdfuse.lift import specialise
    from sgdfuse.runtime import make_session, run

    combos = [(0.0, 0.0, False), (0.25, 0.01, False), (0.0, 0.01, True), (0.1, 0.0, False)]
    nodes, outputs = [], []
    for k, (d, wd, nesterov) in enumerate(combos):
        names = [f"{k}_{n}" for n in ("p_out", "a_out", "s_out")]
        nodes.append(make_sgd_node(("p", "g", "lr", "a", "m", "s"), tuple(names), SgdAttributes(d, wd, nesterov), name=f"sgd{k}"))
        outputs.extend(names)
    shape = [8]
    graph = helper.make_graph(
        nodes, "sgd", [graphs.value(n, shape=shape) for n in ("p", "g", "a", "s")] + [graphs.value(n, shape=[1]) for n in ("lr", "m")],
        [graphs.value(n, shape=None) for n in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    ensure_sgd_function(model)
    specialised = specialise(model)
    assert not specialised.functions
    feeds = {
        "p": np.array([1, -0.0, np.inf, -2, 0, 3, np.nan, 1e30], np.float32),
        "g": np.array([0.5, 0.0, 1, -np.inf, -0.0, 2, 1, -1e30], np.float32),
        "a": np.array([0, -0.0, 1, 2, np.inf, -1, 0, 1e30], np.float32),
        "s": np.array([1, 0, 0, 1, 0, 0, 1, 0], np.float32),
    }
    for m in (0.9, 0.0):
        feeds.update(lr=np.array([0.1], np.float32), m=np.array([m], np.float32))
        want = run(make_session(model), feeds, outputs)
        have = run(make_session(specialised), feeds, outputs)
        for name in outputs:
            assert want[name].tobytes() == have[name].tobytes(), (m, name, want[name], have[name])


def _erf_beside_update_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
        helper.make_node("Erf", ["x"], ["erf_x"]),
    ]
    return graphs.make_model(
        nodes, [graphs.value(n) for n in ("p", "g", "buf", "x")], [graphs.value(n) for n in ("p_out", "buf_out", "erf_x")],
        [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)],
    )


def test_check_runs_lifted_where_onnxruntime_has_no_double_kernel(tmp_path):
    # onnxruntime has no DOUBLE Erf kernel: the Erf runs in onnx's reference implementation, the rest in
    # onnxruntime, and the DOUBLE comparison runs (it used to be skipped with a note, native only).
    model = _erf_beside_update_model()
    fused = api.optimize(model).model
    result = check_models(model, fused)
    assert result.passed
    assert "double" in result.runs and result.note == "", (result.runs, result.note)
    completed = _cli_check(model, fused, tmp_path)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "native, double" in completed.stdout and "native dtypes only" not in completed.stdout


def test_check_says_when_the_double_comparison_cannot_run_even_so_and_names_the_op(monkeypatch, tmp_path):
    # Where the staged run cannot be made either (here: made to refuse as onnxruntime does), check still runs
    # natively, and says so rather than passing quietly.
    import sgdfuse.verify as verify

    def refusing(model, known=()):
        raise RuntimeError("Could not find an implementation for Erf(13) node with name ''")

    monkeypatch.setattr(verify, "make_session_with_reference_ops", refusing)
    model = _erf_beside_update_model()
    result = check_models(model, api.optimize(model).model)
    assert result.passed
    assert "Erf" in result.note and "DOUBLE" in result.note and "native dtypes only" in result.note
    assert not any(run.startswith("double") for run in result.runs)


@pytest.mark.parametrize("schedule", ["exp", "gather"])
def test_check_reads_a_learning_rate_computed_in_the_graph_from_the_run(schedule):
    # lr = Exp(t) or Gather(schedule, step): the learning rate is no graph input to look up by name.
    n = helper.make_node
    if schedule == "exp":
        lr_nodes = [n("Exp", ["t"], ["lr"])]
        extra_inputs = [graphs.value("t", shape=[])]
        extra_initializers = []
    else:
        lr_nodes = [n("Gather", ["lr_schedule", "step"], ["lr"])]
        extra_inputs = [helper.make_tensor_value_info("step", TensorProto.INT64, [])]
        extra_initializers = [numpy_helper.from_array(np.array([0.1, 0.05, 0.01, 0.005], np.float32), name="lr_schedule")]
    nodes = lr_nodes + [
        n("Mul", ["buf", "m"], ["buf_m"]),
        n("Add", ["buf_m", "g"], ["buf_out"]),
        n("Mul", ["buf_out", "lr"], ["delta"]),
        n("Sub", ["p", "delta"], ["p_out"]),
    ]
    model = graphs.make_model(
        nodes, [graphs.value(x) for x in ("p", "g", "buf")] + extra_inputs, [graphs.value("p_out"), graphs.value("buf_out")],
        [graphs.scalar("m", 0.9)] + extra_initializers,
    )
    result = api.optimize(model)
    assert [f.parameters_out for f in result.report.fused] == ["p_out"], result.report.refused
    check = check_models(model, result.model)
    assert check.passed, [e["message"] for e in check.outputs + check.in_place if not e["passed"]]


def _two_updates_one_beside_erf():
    n = helper.make_node
    nodes = []
    for k in ("1", "2"):
        nodes += [
            n("Mul", [f"buf{k}", "m"], [f"buf{k}_m"]),
            n("Add", [f"buf{k}_m", f"g{k}"], [f"buf{k}_out"]),
            n("Mul", [f"buf{k}_out", "lr"], [f"step{k}"]),
            n("Sub", [f"p{k}", f"step{k}"], [f"p{k}_out"]),
        ]
    nodes.append(n("Erf", ["x"], ["erf_x"]))
    names = [f"{r}{k}" for k in "12" for r in ("p", "g", "buf")] + ["x"]
    model = graphs.make_model(
        nodes, [graphs.value(x) for x in names], [graphs.value(x) for x in ("p1_out", "buf1_out", "p2_out", "buf2_out", "erf_x")],
        [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)],
    )
    index = build_index(model)
    planner = Planner(index)
    first = _match(model, parameters="p1", gradient="g1", accum="buf1", parameters_out="p1_out", accum_out="buf1_out", nodes={0, 1, 2, 3, 8})
    second = _match(model, parameters="p2", gradient="g2", accum="buf2", parameters_out="p2_out", accum_out="buf2_out", nodes={4, 5, 6, 7})
    return model, index, [planner.plan(first), planner.plan(second)]


def test_an_update_whose_slice_lacks_a_double_kernel_is_verified_lifted():
    # Two updates verified in one batch; the first one's slice holds an Erf (no DOUBLE kernel in onnxruntime):
    # it runs in onnx's reference implementation, and both updates are verified in DOUBLE.
    model, index, plans = _two_updates_one_beside_erf()
    checks = verify_plans(model, index, plans)
    assert [c.passed for c in checks] == [True, True]
    for check in checks:
        assert check.note == "" and any(run.startswith("double") for run in check.runs), (check.runs, check.note)


def test_only_the_update_whose_slice_cannot_run_lifted_loses_the_lifted_run(monkeypatch):
    # Where the staged run cannot be made either (made to refuse here, as onnxruntime does, for a model with
    # an Erf), the update whose slice holds the Erf is checked natively with a note naming Erf, the other still
    # in DOUBLE.
    import sgdfuse.verify as verify

    real = verify.make_session_with_reference_ops

    def refusing_erf(model, known=()):
        if any(node.op_type == "Erf" for node in model.graph.node):
            raise RuntimeError("Could not find an implementation for Erf(13) node with name ''")
        return real(model, known)

    monkeypatch.setattr(verify, "make_session_with_reference_ops", refusing_erf)
    model, index, plans = _two_updates_one_beside_erf()
    checks = verify_plans(model, index, plans)
    assert [c.passed for c in checks] == [True, True]
    assert "Erf" in checks[0].note and not any(run.startswith("double") for run in checks[0].runs)
    assert checks[1].note == "" and any(run.startswith("double") for run in checks[1].runs)


def _first_step_model() -> onnx.ModelProto:
    """PyTorch's first step: ``buf_out = first ? g : 0.9*buf + g;  p_out = p - 0.1*buf_out``."""
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g"], ["buf_later"]),
        helper.make_node("Where", ["first", "g", "buf_later"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["p", "step"], ["p_out"]),
    ]
    inputs = [graphs.value(n) for n in ("p", "g", "buf")] + [helper.make_tensor_value_info("first", TensorProto.BOOL, [])]
    return graphs.make_model(nodes, inputs, [graphs.value("p_out"), graphs.value("buf_out")], [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)])


@pytest.mark.parametrize("zero_accum", [True, False])
def test_a_first_step_that_ignores_the_buffer_is_checked_with_a_buffer_that_is_not_zero(zero_accum):
    # Fused without zeroing the buffer on the first step, the op computes 0.9*buf + g where the graph takes g:
    # invisible from a fresh (zero) buffer, seen when the first step comes with a buffer.
    from sgdfuse.passes.sgd_match import FirstStep

    model = _first_step_model()
    check, _ = _verify(model, _match(model, first_step=FirstStep("first", True, zero_accum)))
    assert check.passed is zero_accum, check.message


def test_optimize_refuses_a_plan_that_rounds_the_gradient_to_float16_which_only_the_native_run_sees(monkeypatch):
    # Lifted to DOUBLE the casts vanish and both sides agree; in FLOAT the gradient loses 13 bits (2^-11
    # relative), far beyond the few FLOAT roundings the native bound allows: a loosened native bound lets it by.
    class RoundingPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            gradient = plan.sgd_node.input[1]
            rounded, back = f"{gradient}/as_float16", f"{gradient}/back_to_float"
            casts = [
                helper.make_node("Cast", [gradient], [rounded], to=TensorProto.FLOAT16),
                helper.make_node("Cast", [rounded], [back], to=F32),
            ]
            plan.sgd_node.input[1] = back
            return dataclasses.replace(plan, nodes=plan.nodes[:-1] + casts + [plan.sgd_node])

    monkeypatch.setattr(api, "Planner", RoundingPlanner)
    model = _damped_wd_model()
    result = api.optimize(model)
    assert result.report.fused == []
    (refusal,) = result.report.refused
    assert refusal.reason == "verification-failed"
    assert refusal.detail.startswith("native"), refusal.detail
    assert result.model.SerializeToString() == model.SerializeToString()
