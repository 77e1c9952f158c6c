"""The fused forms whose writable SGD inputs are computed in the step, lowered on every product line their
dtype is allowed on and run against onnxruntime on the fused ONNX model over chained steps:

- PyTorch's first step (``Where(step == 0, g, ...)``): ``sgdfuse optimize`` feeds ``accum = Where(first, 0,
  buf)`` and ``stat = Expand(Cast(first), Shape(p))``;
- ONNX's ``Momentum`` training op: ``stat = Expand(Cast(T <= 0), Shape(X))``;
- BFLOAT16: ``stat = Cast(ConstantOfShape(FLOAT zeros))``;
- a runtime momentum: an ``If(momentum == 0)`` selects the buffer output.

The models are written here with onnx.helper (tests/forms.py) and fused by ``sgdfuse.optimize``; the step
counter is fed 0, 1, 2 so the first-step branch runs; the expected values are onnxruntime's on the fused model.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from forms import Builder
from sgdfuse.errors import ProductLineError
from sgdfuse.fused_op import is_sgd_node, make_sgd_node
from sgdfuse.contract import SgdAttributes
from sgdfuse.lowering.errors import InPlaceStateError, LoweringError
from sgdfuse.lowering.executor import GraphContradictionError
from sgdfuse.lowering.rules_control import MAX_BRANCH_NODES
from test_lowering_support import NO_BF16_LINES, SOC_PER_LINE, run_both, sgd_model

F, F16, BF16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT64
LR, M, D = 0.01, 0.9, 0.25


def update_model(dtype: int = F, *, first_step: bool = False, negated: bool = False, runtime_momentum: bool = False, shape=(3, 2)) -> onnx.ModelProto:
    """``buf_out = m*buf + (1-d)*g`` (``g`` on the first step when ``first_step``), ``p_out = p - lr*buf_out``;
    FLOAT16/BFLOAT16 state computed in FLOAT between casts, as exporters write it."""
    b = Builder(dtype=dtype, shape=list(shape))
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    low = dtype != F
    p32, g32, buf32 = (b.op("Cast", x, to=F) for x in (p, g, buf)) if low else (p, g, buf)
    m = b.scalar_input("m", dtype=F) if runtime_momentum else b.scalar(M, dtype=F)
    later = b.add(b.mul(buf32, m), b.mul(g32, b.scalar(1 - D, dtype=F)))
    buffer = later
    if first_step:
        is_first = b.op("Equal", b.scalar_input("step", dtype=I64), b._int64(0))
        if negated:
            buffer = b.op("Where", b.op("Not", is_first), later, g32)
        else:
            buffer = b.op("Where", is_first, g32, later)
    if low:
        b.op("Cast", buffer, out="buf_out", to=dtype)
        b.op("Cast", b.sub(p32, b.mul(b.scalar(LR, dtype=F), buffer)), out="p_out", to=dtype)
    else:
        b.identity(buffer, out="buf_out")
        b.sub(p, b.mul(b.scalar(LR), buffer), out="p_out")
    return b.model(["p_out", "buf_out"])


def momentum_model(dtype: int = F, mode: str = "standard") -> onnx.ModelProto:
    """One ``ai.onnx.preview.training::Momentum`` node updating two tensors, step count ``T``."""
    value = lambda name, shape: helper.make_tensor_value_info(name, dtype, shape)  # noqa: E731
    node = helper.make_node(
        "Momentum", ["lr", "T", "x", "y", "gx", "gy", "vx", "vy"], ["x_out", "y_out", "vx_out", "vy_out"],
        domain="ai.onnx.preview.training", alpha=M, beta=1 - D if mode == "standard" else 1.0, norm_coefficient=1e-3,
        mode=mode, name="momentum",
    )
    inputs = [helper.make_tensor_value_info("lr", F, []), helper.make_tensor_value_info("T", I64, [])]
    inputs += [value(n, [3, 2] if n.endswith("x") else [4]) for n in ("x", "y", "gx", "gy", "vx", "vy")]
    outputs = [value(n, [3, 2] if n.startswith(("x", "vx")) else [4]) for n in ("x_out", "y_out", "vx_out", "vy_out")]
    graph = helper.make_graph([node], "momentum_step", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)])


STEPS = [0, 1, 2]
FORMS = {
    # name: (model, dtype, inputs fed per step, updates expected to fuse)
    "first_step": (lambda: update_model(first_step=True), F, {"step": STEPS}, 1),
    "first_step_negated": (lambda: update_model(first_step=True, negated=True), F, {"step": STEPS}, 1),
    "first_step_float16": (lambda: update_model(F16, first_step=True), F16, {"step": STEPS}, 1),
    "first_step_bfloat16": (lambda: update_model(BF16, first_step=True), BF16, {"step": STEPS}, 1),
    "momentum_op": (lambda: momentum_model(), F, {"T": STEPS}, 2),
    "momentum_op_nesterov": (lambda: momentum_model(mode="nesterov"), F, {"T": STEPS}, 2),
    "momentum_op_float16": (lambda: momentum_model(F16), F16, {"T": STEPS}, 2),
    "zero_stat_bfloat16": (lambda: update_model(BF16), BF16, {}, 1),
    "runtime_momentum": (lambda: update_model(runtime_momentum=True), F, {"m": [M, 0.0, M, 0.0]}, 1),
    "runtime_momentum_first_step": (lambda: update_model(F16, first_step=True, runtime_momentum=True), F16, {"m": [0.0, M, 0.0], "step": STEPS}, 1),
}


@functools.lru_cache(maxsize=None)
def fused_form(name: str) -> onnx.ModelProto:
    build, _, _, count = FORMS[name]
    # The FLOAT16/BFLOAT16 forms compute in FLOAT with FLOAT lr 0.01 and momentum 0.9, which the op takes in
    # the parameters' dtype: these tests are about lowering what fused, so the rounding is accepted here.
    result = sgdfuse.optimize(build(), allow_rounding=True)
    assert len(result.report.fused) == count and not result.report.refused, result.report
    return result.model


def _steps(schedule: dict) -> int:
    return max([3] + [len(v) for v in schedule.values()])


def _ops(graph, op_type: str) -> list:
    return [op for op in graph.op if op.type == op_type]


# ---- each form on each product line ---------------------------------------------------------------------


def test_the_forms_carry_the_computed_inputs_the_brief_names():
    def ops(name):
        return [n.op_type for n in fused_form(name).graph.node]

    assert {"Where", "Expand", "Cast", "SGD"} <= set(ops("first_step"))
    assert {"LessOrEqual", "Expand", "Cast"} <= set(ops("momentum_op")) and ops("momentum_op").count("SGD") == 2
    zero_stat = fused_form("zero_stat_bfloat16")
    cast = next(n for n in zero_stat.graph.node if n.op_type == "Cast" and n.output[0] == next(s for s in zero_stat.graph.node if is_sgd_node(s)).input[5])
    assert next(n for n in zero_stat.graph.node if cast.input[0] in n.output).op_type == "ConstantOfShape"
    assert "If" in ops("runtime_momentum") and "If" in ops("runtime_momentum_first_step")


@pytest.mark.parametrize("line", list(SOC_PER_LINE))
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_lowers_and_agrees_with_onnxruntime_over_chained_steps(form, line):
    _, dtype, schedule, count = FORMS[form]
    model = fused_form(form)
    soc = SOC_PER_LINE[line]
    if dtype == BF16 and line in NO_BF16_LINES:
        with pytest.raises(ProductLineError, match="BFLOAT16"):
            sgdfuse.lower(model, soc=soc)
        return
    lowered = sgdfuse.lower(model, soc=soc)
    assert len(lowered.sgd_ops) == count
    report = run_both(model, lowered, steps=_steps(schedule), schedule=schedule)
    assert len(report) >= 3


def test_first_step_form_on_a_dynamic_shape_lowers_on_the_950_series_and_agrees():
    model = sgdfuse.optimize(update_model(first_step=True, runtime_momentum=True, shape=("N", 2))).model
    with pytest.raises(ProductLineError, match="no dynamic shape"):
        sgdfuse.lower(model, soc="Ascend910B2")
    lowered = sgdfuse.lower(model, soc="Ascend950PR_9599")
    assert "Fill" in [op.type for op in lowered.init_model.graph[0].op]  # the computed stat sized like p
    run_both(model, lowered, steps=3, schedule={"step": STEPS, "m": [0.0, M, M]})


# ---- the semantics of each lowered form -------------------------------------------------------------------


def test_first_step_buffer_becomes_its_variable_assigned_the_zeroed_value_before_the_update():
    model = fused_form("first_step")
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    sgd_node = next(n for n in model.graph.node if is_sgd_node(n))
    accum = next(v for v in lowered.state if v.role == "accum")
    assert (accum.name, accum.source, accum.assigned) == ("buf", "graph input", sgd_node.input[3])
    sgd = lowered.op(lowered.sgd_ops[0])
    assert sgd.input[3] == "buf:0"  # the op still writes the variable in place
    assign = lowered.op(f"{lowered.sgd_ops[0]}/assign_accum")
    assert assign.type == "Assign" and assign.input[0] == "buf:0"
    select = lowered.op(assign.input[1].rsplit(":", 1)[0])
    assert select.type == "SelectV2" and select.input[2] == "buf:0"  # Where(first, 0, buf) reads the variable
    assert f"{assign.name}:-1" in list(sgd.input)  # assigned before the update
    assert "buf/initial_value" in lowered.init_inputs  # initial value from the caller, as for any buffer


def test_stat_from_the_step_counter_is_a_zero_initialised_variable_assigned_every_step():
    lowered = sgdfuse.lower(fused_form("first_step"), soc="Ascend910B2")
    stat = next(v for v in lowered.state if v.role == "stat")
    assert stat.source == "computed" and stat.assigned == stat.name
    assign = lowered.op(f"{lowered.sgd_ops[0]}/assign_stat")
    assert assign.input[0] == f"{stat.name}:0"
    assert lowered.op(assign.input[1].rsplit(":", 1)[0]).type == "Expand"
    assert f"{assign.name}:-1" in list(lowered.op(lowered.sgd_ops[0]).input)
    init = {op.name: op for op in lowered.init_model.graph[0].op}
    assert init[init[f"{stat.name}/assign"].input[1].rsplit(":", 1)[0]].type == "Const"  # zeros


def test_momentum_op_stats_are_assigned_from_the_shared_step_count_test():
    lowered = sgdfuse.lower(fused_form("momentum_op"), soc="Ascend910B2")
    stats = [v for v in lowered.state if v.role == "stat"]
    accums = [v for v in lowered.state if v.role == "accum"]
    assert [v.source for v in stats] == ["computed", "computed"]
    assert [(v.name, v.source, v.assigned) for v in accums] == [("vx", "graph input", None), ("vy", "graph input", None)]
    assert len(_ops(lowered.graph, "LessEqual")) == 1 and len(_ops(lowered.graph, "Assign")) == 2


def test_a_zero_stat_through_a_cast_is_a_zero_variable_never_assigned_by_the_step():
    lowered = sgdfuse.lower(fused_form("zero_stat_bfloat16"), soc="Ascend910B2")
    stat = next(v for v in lowered.state if v.role == "stat")
    assert stat.source == "zeros" and stat.assigned is None and stat.spec.dtype == BF16
    assert not {op.type for op in lowered.graph.op} & {"Assign", "Cast", "Fill", "Shape"}


def test_runtime_momentum_if_becomes_a_select_and_its_result_is_written_back_after_the_update():
    lowered = sgdfuse.lower(fused_form("runtime_momentum"), soc="Ascend910B2")
    accum = next(v for v in lowered.state if v.role == "accum")
    assert accum.next_value == "buf_out"
    sgd = lowered.sgd_ops[0]
    write_back = lowered.op(f"{sgd}/write_back_accum")
    select = lowered.op(write_back.input[1].rsplit(":", 1)[0])
    assert select.type == "SelectV2" and select.name.endswith("/If")
    assert write_back.input[0] == "buf:0"
    controls = [e[: -len(":-1")] for e in write_back.input if e.endswith(":-1")]
    assert sgd in controls and f"{sgd}/accum_after_write" in controls
    assert lowered.graph.output[1] == f"{select.name}:0"  # buf_out is the selected value
    assert not _ops(lowered.graph, "If")


def _drop_op(lowered, name: str) -> None:
    graph = lowered.graph
    kept = [op for op in graph.op if op.name != name]
    for op in kept:
        entries = [e for e in op.input if e != f"{name}:-1"]
        del op.input[:]
        op.input.extend(entries)
    del graph.op[:]
    graph.op.extend(kept)


def test_without_the_write_back_a_zero_momentum_step_leaves_the_old_buffer_for_the_next_step():
    # With momentum 0 the kernel keeps the old buffer while the graph outputs (1-d)*g as the next buffer:
    # the write-back is what makes the next step start from the graph's buffer.
    model = fused_form("runtime_momentum")
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    _drop_op(lowered, f"{lowered.sgd_ops[0]}/write_back_accum")
    report = run_both(model, lowered, steps=2, schedule={"m": [0.0, M]}, check=False)
    assert report[0]["buf_out"] == 0.0 and report[1]["p_out"] > 1e-4


def _strip_control_edges_into(lowered, name: str) -> None:
    op = lowered.op(name)
    entries = [e for e in op.input if not e.endswith(":-1")]
    del op.input[:]
    op.input.extend(entries)


def test_without_the_assign_edges_the_update_can_run_on_the_unassigned_state():
    model = fused_form("first_step")
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    _strip_control_edges_into(lowered, lowered.sgd_ops[0])
    # The SGD op's reads of the buffer and stat are no longer ordered after their Assigns: the device could run
    # the update on the unassigned state (the executor ran it so, p_out off by > 1e-4, before it refused such graphs).
    with pytest.raises(GraphContradictionError, match="accesses variable .*no data or control edge orders the two"):
        run_both(model, lowered, steps=1, schedule={"step": [0]}, check=False)


# ---- what stays refused, and why -------------------------------------------------------------------------


def _with_if(model: onnx.ModelProto, then_nodes, then_out, else_nodes, else_out, *, name="select/If") -> onnx.ModelProto:
    cond = numpy_helper.from_array(np.array(True), "cond")
    then_branch = helper.make_graph(then_nodes, "then", [], [then_out])
    else_branch = helper.make_graph(else_nodes, "else", [], [else_out])
    model.graph.initializer.append(cond)
    model.graph.node.append(helper.make_node("If", ["cond"], ["picked"], name=name, then_branch=then_branch, else_branch=else_branch))
    model.graph.output.append(helper.make_tensor_value_info("picked", F, None))
    return model


def test_an_if_with_a_large_branch_is_refused_naming_node_limit_and_what_to_do():
    chain = [helper.make_node("Identity", ["w_out" if k == 0 else f"t{k - 1}"], [f"t{k}"]) for k in range(MAX_BRANCH_NODES + 1)]
    model = _with_if(
        sgd_model(), chain, helper.make_tensor_value_info(f"t{MAX_BRANCH_NODES}", F, [4, 3]),
        [helper.make_node("Identity", ["w_out"], ["e"])], helper.make_tensor_value_info("e", F, [4, 3]),
    )
    with pytest.raises(LoweringError) as caught:
        sgdfuse.lower(model, soc="Ascend910B2")
    message = str(caught.value)
    assert "node select/If (If)" in message and f"limit {MAX_BRANCH_NODES}" in message
    assert "give momentum as an initializer" in message


def test_an_if_whose_branches_differ_in_shape_is_refused():
    model = _with_if(
        sgd_model(),
        [helper.make_node("Identity", ["w_out"], ["a"])], helper.make_tensor_value_info("a", F, [4, 3]),
        [helper.make_node("ReduceSum", ["w_out"], ["b"], keepdims=1)], helper.make_tensor_value_info("b", F, [1, 1]),
    )
    with pytest.raises(LoweringError, match="node select/If \\(If\\): output 0: the branches give FLOAT \\[4, 3\\] and FLOAT \\[1, 1\\]"):
        sgdfuse.lower(model, soc="Ascend910B2")


def test_an_if_running_an_in_place_update_in_a_branch_is_refused():
    update = make_sgd_node(("w", "grad_w", "lr", "buf_w", "momentum", "stat"), ("w2", "b2", "s2"), SgdAttributes(0.0, 0.0, False), name="inner/SGD")
    model = _with_if(
        sgd_model(),
        [update], helper.make_tensor_value_info("w2", F, [4, 3]),
        [helper.make_node("Identity", ["w_out"], ["e"])], helper.make_tensor_value_info("e", F, [4, 3]),
    )
    with pytest.raises(LoweringError, match="the then branch runs the in-place update inner/SGD"):
        sgdfuse.lower(model, soc="Ascend910B2")


def test_an_accum_computed_from_two_candidate_states_is_refused_naming_both():
    model = sgd_model()
    model.graph.node.insert(0, helper.make_node("Add", ["buf_w", "grad_w"], ["buf_plus_grad"], name="mix"))
    next(n for n in model.graph.node if is_sgd_node(n)).input[3] = "buf_plus_grad"
    with pytest.raises(InPlaceStateError) as caught:
        sgdfuse.lower(model, soc="Ascend910B2")
    message = str(caught.value)
    assert "node update/SGD, input accum (buf_plus_grad)" in message and "Add node 'mix'" in message
    assert "buf_w, grad_w" in message and "at most one" in message


def test_an_accum_computed_from_another_updates_result_is_refused():
    model = sgd_model()
    first = next(n for n in model.graph.node if is_sgd_node(n))
    second = onnx.NodeProto()
    second.CopyFrom(first)
    second.name = "update2/SGD"
    second.input[0] = "grad_w"
    second.input[3] = "doubled"
    second.output[:] = ["g_out", "buf2_out", "stat2_out"]
    model.graph.node.extend([helper.make_node("Add", ["buf_w_out", "buf_w_out"], ["doubled"], name="double"), second])
    with pytest.raises(InPlaceStateError, match="from the result of the in-place update update/SGD"):
        sgdfuse.lower(model, soc="Ascend910B2")
