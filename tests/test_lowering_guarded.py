"""Guarded updates lowered to GE: ``p_out = Where(found_inf, p, p_new)`` (a loss-scaling overflow skip) or
``Where(has_grad, p_new, p)`` around a fused momentum-SGD update. GE's ``SGD`` writes its state in place
whatever the guard says, so the lowered graph must restore the old state on a skipped step. Every test runs
the lowered graph in the GE executor, in place, with the guard true on some steps and false on others, and
compares outputs and the state variables with onnxruntime on the ORIGINAL (unfused) model, whose state is
carried by its graph outputs (``p_out`` → ``p``, ``buf_out`` → ``buf``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse import runtime
from sgdfuse.contract import SgdAttributes
from sgdfuse.fused_op import ensure_sgd_function, is_sgd_node, make_sgd_node
from sgdfuse.lowering.errors import InPlaceStateError
from sgdfuse.lowering.lower import prepare
from sgdfuse.lowering.verify import verify_lowering
from steps_support import ENTRIES, STEPS_DIR, step_feeds
from test_lowering_support import assert_agree

SOC = "Ascend910B2"
SHAPE = (2, 3)
CHAIN = {"p_out": "p", "buf_out": "buf"}


def vi(name: str, dtype: int = TensorProto.FLOAT, shape=SHAPE) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


def scalar(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


def guarded_step(
    *,
    skip_when: bool = True,
    momentum: float = 0.9,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    momentum_input: bool = False,
    extra_reader: bool = False,
) -> onnx.ModelProto:
    """PyTorch's momentum SGD step written out (``g' = g + wd*p``, ``buf' = m*buf + (1-d)*g'``, ``p' = p -
    lr*(g' + m*buf' if nesterov else buf')``) with both state outputs guarded: ``Where(found_inf, old, new)``
    when ``skip_when`` (skip where true), else ``Where(has_grad, new, old)`` (skip where false).
    ``extra_reader`` adds an output ``delta = p' - p`` reading the unguarded new parameters."""
    nodes, inputs = [], [vi("p"), vi("g"), vi("buf")]
    initializers = [scalar("lr", 0.1)]
    gradient = "g"
    if weight_decay:
        initializers.append(scalar("wd", weight_decay))
        nodes += [helper.make_node("Mul", ["p", "wd"], ["p_wd"]), helper.make_node("Add", ["g", "p_wd"], ["g_eff"])]
        gradient = "g_eff"
    if momentum_input:
        inputs.append(vi("mom", shape=()))
    else:
        initializers.append(scalar("mom", momentum))
    nodes.append(helper.make_node("Mul", ["buf", "mom"], ["buf_m"]))
    if dampening:
        initializers.append(scalar("one_minus_d", 1.0 - dampening))
        nodes += [helper.make_node("Mul", [gradient, "one_minus_d"], ["g_d"]), helper.make_node("Add", ["buf_m", "g_d"], ["buf_new"])]
    else:
        nodes.append(helper.make_node("Add", ["buf_m", gradient], ["buf_new"]))
    direction = "buf_new"
    if nesterov:
        nodes += [helper.make_node("Mul", ["buf_new", "mom"], ["look"]), helper.make_node("Add", [gradient, "look"], ["direction"])]
        direction = "direction"
    nodes += [helper.make_node("Mul", [direction, "lr"], ["lr_step"]), helper.make_node("Sub", ["p", "lr_step"], ["p_new"])]
    condition = "found_inf" if skip_when else "has_grad"
    inputs.append(vi(condition, TensorProto.BOOL, ()))
    for old, new, out in (("p", "p_new", "p_out"), ("buf", "buf_new", "buf_out")):
        nodes.append(helper.make_node("Where", [condition, old, new] if skip_when else [condition, new, old], [out]))
    outputs = [vi("p_out"), vi("buf_out")]
    if extra_reader:
        nodes.append(helper.make_node("Sub", ["p_new", "p"], ["delta"]))
        outputs.append(vi("delta"))
    graph = helper.make_graph(nodes, "guarded_step", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def lowered_guarded(original: onnx.ModelProto):
    """The fused model (one guarded update) and its lowering."""
    result = sgdfuse.optimize(original)
    (update,) = result.report.fused
    assert update.guard is not None
    lowered = sgdfuse.lower(result.model, soc=SOC)
    assert [op.type for op in lowered.graph.op].count("SGD") == 1
    return result.model, lowered


def run_steps(
    original: onnx.ModelProto, lowered, skips: list[bool], *, condition: str, skip_when: bool, extra=None
) -> list[dict[str, np.ndarray]]:
    """Run ``len(skips)`` chained steps (step k skipped when ``skips[k]``) in onnxruntime on ``original`` and in
    the executor; assert every output and the state variables agree at every step; return the variables
    after each step (copies)."""
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("p", "g", "buf")}
    session = runtime.make_session(original)
    runner = lowered.runner()
    runner.initialise({name: feeds[name] for name in lowered.init_inputs.values()})
    history = []
    for step, skip in enumerate(skips):
        feeds[condition] = np.array(skip == skip_when)
        for name, values in (extra or {}).items():
            feeds[name] = np.asarray(values[step], dtype=np.float32)
        expected = runtime.run(session, feeds)
        actual = runner.step(feeds)
        for name in lowered.outputs:
            assert_agree(f"step {step} {name}", expected[name], actual[name])
        for output, state in CHAIN.items():
            assert_agree(f"step {step} variable {state}", expected[output], runner.variables[state])
            feeds[state] = expected[output]
        history.append({state: runner.variables[state].copy() for state in CHAIN.values()})
        feeds["g"] = rng.standard_normal(SHAPE).astype(np.float32)
    return history


SKIPS = [False, True, False, True, True, False]


@pytest.mark.parametrize("skip_when", [True, False], ids=["where_found_inf_keeps_old", "where_has_grad_takes_new"])
def test_a_guarded_update_leaves_the_state_unchanged_on_skipped_steps(skip_when):
    condition = "found_inf" if skip_when else "has_grad"
    original = guarded_step(skip_when=skip_when)
    _, lowered = lowered_guarded(original)
    guarded = {v.name: v.guarded_by for v in lowered.state}
    assert guarded == {"p": condition, "buf": condition, next(v.name for v in lowered.state if v.role == "stat"): None}
    history = run_steps(original, lowered, SKIPS, condition=condition, skip_when=skip_when)
    # The in-place write happened on every step; the state after a skipped step is the one before it, bit
    # for bit (without the restore it would be the unguarded update).
    for step in (1, 3, 4):
        for state in CHAIN.values():
            np.testing.assert_array_equal(history[step][state], history[step - 1][state])
    assert not np.array_equal(history[2]["p"], history[1]["p"])


@pytest.mark.parametrize(
    "settings",
    [dict(nesterov=True, weight_decay=0.01), dict(dampening=0.25, weight_decay=0.01, momentum=0.8)],
    ids=["nesterov_weight_decay", "dampening_weight_decay"],
)
def test_guarded_nesterov_dampening_and_weight_decay_updates_agree_with_the_original_step(settings):
    original = guarded_step(**settings)
    fused, lowered = lowered_guarded(original)
    (sgd,) = [n for n in fused.graph.node if is_sgd_node(n)]
    attributes = {a.name: helper.get_attribute_value(a) for a in sgd.attribute}
    assert attributes["weight_decay"] == pytest.approx(0.01)
    run_steps(original, lowered, SKIPS, condition="found_inf", skip_when=True)


def test_a_guarded_update_with_a_runtime_momentum_restores_the_buffer_the_If_selected():
    # The buffer's next value is Where(found_inf, buf, If(mom == 0, ...)): the guard around the rewrite's If.
    original = guarded_step(momentum_input=True)
    _, lowered = lowered_guarded(original)
    buffer = next(v for v in lowered.state if v.name == "buf")
    assert buffer.guarded_by == "found_inf" and buffer.next_value == "buf_out"
    momenta = [0.9, 0.0, 0.0, 0.5, 0.9, 0.0]
    run_steps(original, lowered, [False, True, False, True, False, True], condition="found_inf", skip_when=True, extra={"mom": momenta})


def test_a_guarded_float16_update_computed_in_float_is_restored_bit_for_bit():
    # FLOAT16 state computed in FLOAT between casts, as exporters write it; the guard selects the cast results.
    half = TensorProto.FLOAT16
    nodes = [helper.make_node("Cast", [x], [f"{x}_f"], to=TensorProto.FLOAT) for x in ("p", "g", "buf")]
    nodes += [
        helper.make_node("Mul", ["buf_f", "mom"], ["buf_m"]),
        helper.make_node("Add", ["buf_m", "g_f"], ["buf_new_f"]),
        helper.make_node("Cast", ["buf_new_f"], ["buf_new"], to=half),
        helper.make_node("Mul", ["buf_new_f", "lr"], ["lr_step"]),
        helper.make_node("Sub", ["p_f", "lr_step"], ["p_new_f"]),
        helper.make_node("Cast", ["p_new_f"], ["p_new"], to=half),
        helper.make_node("Where", ["found_inf", "p", "p_new"], ["p_out"]),
        helper.make_node("Where", ["found_inf", "buf", "buf_new"], ["buf_out"]),
    ]
    inputs = [vi("p", half), vi("g", half), vi("buf", half), vi("found_inf", TensorProto.BOOL, ())]
    graph = helper.make_graph(nodes, "half", inputs, [vi("p_out", half), vi("buf_out", half)], [scalar("mom", 0.875), scalar("lr", 0.125)])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    _, lowered = lowered_guarded(original)
    rng = np.random.default_rng(3)
    feeds = {name: rng.standard_normal(SHAPE).astype(np.float16) for name in ("p", "g", "buf")}
    session = runtime.make_session(original)
    runner = lowered.runner()
    runner.initialise({name: feeds[name] for name in lowered.init_inputs.values()})
    for step, skip in enumerate(SKIPS):
        feeds["found_inf"] = np.array(skip)
        before = {state: runner.variables[state].copy() for state in CHAIN.values()}
        expected = runtime.run(session, feeds)
        runner.step(feeds)
        for output, state in CHAIN.items():
            assert_agree(f"step {step} variable {state}", expected[output], runner.variables[state])
            assert np.array_equal(runner.variables[state], before[state]) == skip
            feeds[state] = expected[output]
        feeds["g"] = rng.standard_normal(SHAPE).astype(np.float16)


def test_readers_of_the_unguarded_new_parameters_read_them_before_the_restore():
    # delta = p_new - p is an output: it reads the op's result, which the restore on a skipped step would
    # otherwise overwrite before delta is computed.
    original = guarded_step(extra_reader=True)
    _, lowered = lowered_guarded(original)
    run_steps(original, lowered, SKIPS, condition="found_inf", skip_when=True)


def first_step_pair(dampening: float = 0.25) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """PyTorch's first step under a found_inf guard, unfused (``buf' = Where(first, g, m*buf + (1-d)*g)``) and
    fused by hand the way the rewrite feeds the op on a first step (``accum = Where(first, 0, buf)``, ``stat =
    Expand(Cast(first), Shape(p))``: the contract then gives ``buf' = g``); both guarded by the same Where
    outputs. Lowered, the buffer is assigned its zeroed value before the op and stat is a variable of its
    own assigned every step."""
    inputs = [vi("p"), vi("g"), vi("buf"), vi("first", TensorProto.BOOL, ()), vi("found_inf", TensorProto.BOOL, ())]
    outputs = [vi("p_out"), vi("buf_out")]
    constants = [scalar("lr", 0.1), scalar("mom", 0.9)]
    guards = [
        helper.make_node("Where", ["found_inf", "p", "p_new"], ["p_out"]),
        helper.make_node("Where", ["found_inf", "buf", "buf_new"], ["buf_out"]),
    ]
    unfused_nodes = [
        helper.make_node("Mul", ["buf", "mom"], ["buf_m"]),
        helper.make_node("Mul", ["g", "one_minus_d"], ["g_d"]),
        helper.make_node("Add", ["buf_m", "g_d"], ["buf_later"]),
        helper.make_node("Where", ["first", "g", "buf_later"], ["buf_new"]),
        helper.make_node("Mul", ["buf_new", "lr"], ["lr_step"]),
        helper.make_node("Sub", ["p", "lr_step"], ["p_new"]),
        *guards,
    ]
    unfused = helper.make_graph(unfused_nodes, "first_step", inputs, outputs, initializer=[*constants, scalar("one_minus_d", 1.0 - dampening)])
    fused_nodes = [
        helper.make_node("Where", ["first", "zero", "buf"], ["accum"]),
        helper.make_node("Cast", ["first"], ["first_f"], to=TensorProto.FLOAT),
        helper.make_node("Shape", ["p"], ["p_shape"]),
        helper.make_node("Expand", ["first_f", "p_shape"], ["stat"]),
        make_sgd_node(("p", "g", "lr", "accum", "mom", "stat"), ("p_new", "buf_new", "stat_out"), SgdAttributes(dampening, 0.0, False), name="update/SGD"),
        *guards,
    ]
    fused = helper.make_graph(fused_nodes, "first_step", inputs, outputs, initializer=[*constants, scalar("zero", 0.0)])
    models = [helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8) for graph in (unfused, fused)]
    ensure_sgd_function(models[1])
    return models[0], models[1]


@pytest.mark.parametrize("fused_by", ["hand", "optimize"])
def test_a_guarded_first_step_keeps_the_buffer_zeroing_and_the_stat_flag_exact(fused_by):
    original, fused = first_step_pair()
    if fused_by == "optimize":
        result = sgdfuse.optimize(original)
        (update,) = result.report.fused
        assert update.guard == "skipped where found_inf is true" and "first" in update.stat
        fused = result.model
    lowered = sgdfuse.lower(fused, soc=SOC)
    by_role = {v.role: v for v in lowered.state}
    assert (by_role["accum"].name, by_role["accum"].guarded_by) == ("buf", "found_inf") and by_role["accum"].assigned
    assert by_role["stat"].source == "computed" and by_role["stat"].guarded_by is None
    assert verify_lowering(fused, lowered).passed
    # Skipped first step, taken first step, then later steps taken and skipped.
    rng = np.random.default_rng(2)
    feeds = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("p", "g", "buf")}
    session = runtime.make_session(original)
    runner = lowered.runner()
    runner.initialise({name: feeds[name] for name in lowered.init_inputs.values()})
    for step, (first, skip) in enumerate([(True, True), (True, False), (False, False), (False, True), (False, False)]):
        feeds.update(first=np.array(first), found_inf=np.array(skip))
        before = {state: runner.variables[state].copy() for state in CHAIN.values()}
        expected = runtime.run(session, feeds)
        actual = runner.step(feeds)
        for output, state in CHAIN.items():
            assert_agree(f"step {step} {output}", expected[output], actual[output])
            assert_agree(f"step {step} variable {state}", expected[output], runner.variables[state])
            if skip:
                np.testing.assert_array_equal(runner.variables[state], before[state])
            feeds[state] = expected[output]
        feeds["g"] = rng.standard_normal(SHAPE).astype(np.float32)


def test_a_new_value_guarded_by_two_outputs_is_refused():
    fused, _ = lowered_guarded(guarded_step())
    (sgd,) = [n for n in fused.graph.node if is_sgd_node(n)]
    fused.graph.input.append(vi("other", TensorProto.BOOL, ()))
    fused.graph.node.append(helper.make_node("Where", ["other", "p", sgd.output[0]], ["p_out_2"]))
    fused.graph.output.append(vi("p_out_2"))
    with pytest.raises(InPlaceStateError, match="several guarded outputs"):
        sgdfuse.lower(fused, soc=SOC)


def _without_write_backs(lowered):
    """A copy of ``lowered`` whose step graph lacks the write-back ``Assign`` s (the lowering before guarded
    updates were restored: the state keeps the unguarded in-place write)."""
    model = type(lowered.model)()
    model.CopyFrom(lowered.model)
    graph = model.graph[0]
    dropped = {op.name for op in graph.op if op.type == "Assign" and "write_back" in op.name}
    assert dropped
    kept = [op for op in graph.op if op.name not in dropped]
    for op in kept:
        entries = [e for e in op.input if e.rsplit(":", 1)[0] not in dropped]
        del op.input[:]
        op.input.extend(entries)
    del graph.op[:]
    graph.op.extend(kept)
    return dataclasses.replace(lowered, model=model)


@pytest.mark.parametrize("skip_when", [True, False])
def test_the_lowering_check_chains_the_guarded_outputs_and_sees_a_missing_restore(skip_when):
    original = guarded_step(skip_when=skip_when)
    fused, lowered = lowered_guarded(original)
    assert verify_lowering(fused, lowered).passed
    # The check feeds the boolean guard true on step 1 only: found_inf skips step 1, has_grad skips steps 2
    # and 3; without the restore the GE variables hold the unguarded update after the first skipped step,
    # and the check compares what each side writes into the state at every step.
    broken = verify_lowering(fused, _without_write_backs(lowered))
    assert not broken.passed and ("step 1" if skip_when else "step 2") in broken.message


# ---- a real loss-scaled PyTorch step: found_inf computed in the graph from the gradients ------------------

AMP = "mlp_amp"


@pytest.fixture(scope="module")
def amp():
    """``(original, fused, report of the fusion, lowered)`` for the loss-scaled step."""
    original = onnx.load(STEPS_DIR / ENTRIES[AMP]["file"])
    fused, report = prepare(original)
    return original, fused, report, sgdfuse.lower(fused, soc=SOC)


def test_the_loss_scaled_step_lowers_to_one_SGD_op_per_guarded_update(amp):
    _, fused, report, lowered = amp
    assert len(report.fused) == ENTRIES[AMP]["expected_momentum_updates"] == 4
    assert all(update.guard for update in report.fused)
    assert sum(is_sgd_node(n) for n in fused.graph.node) == 4
    assert [op.type for op in lowered.graph.op].count("SGD") == len(lowered.sgd_ops) == 4
    state = {v.name: v.guarded_by for v in lowered.state if v.role != "stat"}
    parameters = [o["feeds"] for o in ENTRIES[AMP]["outputs"] if o["feeds"]]
    assert set(state) == set(parameters)
    condition = {v for v in state.values()}
    assert len(condition) == 1 and None not in condition


def test_the_loss_scaled_step_skips_overflowing_steps_in_place(amp):
    original, _, _, lowered = amp
    initial, batches = step_feeds(AMP)
    feeds = dict(initial)
    session = runtime.make_session(original)
    runner = lowered.runner()
    runner.initialise({name: feeds[name] for name in lowered.init_inputs.values()})
    chain = {o["name"]: o["feeds"] for o in ENTRIES[AMP]["outputs"] if o["feeds"]}
    # A loss scale of +inf overflows the scaled gradients: found_inf, the step is skipped.
    scales = [1024.0, np.inf, 1024.0, np.inf, 512.0]
    previous = {state: initial[state].copy() for state in chain.values()}
    for step, scale in enumerate(scales):
        feeds.update(batches[step % len(batches)])
        feeds["scale"] = np.array(scale, dtype=np.float32)
        expected = runtime.run(session, feeds)
        actual = runner.step(feeds)
        for name in lowered.outputs:
            assert_agree(f"step {step} {name}", expected[name], actual[name])
        for output, state in chain.items():
            assert_agree(f"step {step} variable {state}", expected[output], runner.variables[state])
            if np.isinf(scale):
                np.testing.assert_array_equal(runner.variables[state], previous[state])
            else:
                assert not np.array_equal(runner.variables[state], previous[state])
            feeds[state] = expected[output]
            previous[state] = runner.variables[state].copy()


def test_the_lowering_check_takes_a_computed_guard_and_sees_a_missing_restore(amp):
    _, fused, _, lowered = amp
    assert verify_lowering(fused, lowered).passed
    broken = verify_lowering(fused, _without_write_backs(lowered))
    # The check's second step feeds the gradient's sources zeros: g / scale = 0/0 = NaN, found_inf, skipped;
    # without the restore the GE variables hold the unguarded (NaN) update after it.
    assert not broken.passed and "step 2 (zero-gradient)" in broken.message


def test_the_onnx_check_of_a_guarded_model_chains_the_guarded_outputs():
    from sgdfuse.verify import check_models

    original = guarded_step()
    check = check_models(original, sgdfuse.optimize(original).model)
    assert check.passed and check.state_pairs == CHAIN
    assert {o["name"]: o["kind"] for o in check.outputs} == {"p_out": "fused update", "buf_out": "fused update"}


def test_a_guard_computed_with_isinf_and_isnan_lowers():
    # A GradScaler-style overflow check: found_inf = ReduceMax(Or(IsInf(g), IsNaN(g))); GE IsInf/IsNan.
    nodes = [
        helper.make_node("IsInf", ["g"], ["inf"]), helper.make_node("IsNaN", ["g"], ["nan"]), helper.make_node("Or", ["inf", "nan"], ["bad"]),
        helper.make_node("Cast", ["bad"], ["bad_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["bad_f"], ["any_bad"], keepdims=0),
        helper.make_node("Greater", ["any_bad", "zero"], ["found_inf"]),
        helper.make_node("Mul", ["buf", "mom"], ["bm"]), helper.make_node("Add", ["bm", "g"], ["bnew"]),
        helper.make_node("Mul", ["bnew", "lr"], ["st"]), helper.make_node("Sub", ["p", "st"], ["pnew"]),
        helper.make_node("Where", ["found_inf", "p", "pnew"], ["p_out"]), helper.make_node("Where", ["found_inf", "buf", "bnew"], ["buf_out"]),
    ]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3])  # noqa: E731
    scalar = lambda name, x: onnx.numpy_helper.from_array(np.array(x, np.float32), name)  # noqa: E731
    graph = helper.make_graph(nodes, "step", [value("p"), value("g"), value("buf")], [value("p_out"), value("buf_out")],
                              initializer=[scalar("mom", 0.9), scalar("lr", 0.1), scalar("zero", 0.0)])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    result = sgdfuse.optimize(original)
    assert len(result.report.fused) == 1 and result.report.fused[0].guard, result.report
    lowered = sgdfuse.lower(result.model, soc="Ascend910B2")
    assert "IsInf" in {op.type for op in lowered.model.graph[0].op} and "IsNan" in {op.type for op in lowered.model.graph[0].op}
    from sgdfuse.lowering.verify import verify_lowering

    assert verify_lowering(result.model, lowered, steps=3).passed
