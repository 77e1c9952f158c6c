"""The lowered GE graph computes what the ONNX model computes, for graphs built to break lowering.

Each test builds a small training step the way a user would (onnx.helper; an unfused momentum-SGD update
unless the case needs a fused one), lowers it, and runs the GE step graph *in place* in sgdfuse's numpy GE
executor (state in its variables, set once by the init graph) against onnxruntime on the fused ONNX model
(fed its own new state) over 3 chained steps. Kinds: a layout-keeping Transpose read after the write, a
first-step flag computed from the gradient or from the buffer, a user's ``If`` on the momentum, a ``stat``
fed at run time, shared rewrite initializers after a rollback, a reshape whose shape depends on the update,
``If`` branches that reuse a name, a 600-deep chain, tf2onnx-style names, colliding state names, and
``sgdfuse lower`` refusing to write a graph that disagrees.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse import runtime
from sgdfuse.cli import main
from sgdfuse.contract import SgdAttributes
from sgdfuse.errors import InvalidOutputError
from sgdfuse.fused_op import ensure_sgd_function, is_sgd_node, make_sgd_node
from sgdfuse.lowering.alias import keeps_layout
from sgdfuse.runtime import onnx_to_numpy_dtype
from test_lowering_support import assert_agree

F, B, I64 = TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.INT64
SOC = "Ascend910B2"  # Atlas A2: FLOAT, FLOAT16 and BFLOAT16 updates


def vi(name: str, shape, dtype: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, None if shape is None else list(shape))


def scalar(name: str, value: float, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=dtype), name)


def constant(output: str, value: float, dtype=np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [output], value=numpy_helper.from_array(np.array(value, dtype=dtype)))


def model_of(nodes, inputs, outputs, initializers=(), *, name: str = "step") -> onnx.ModelProto:
    """A checked model; with ``SGD`` nodes, fused as ``sgdfuse optimize`` writes it (the op's function)."""
    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, list(initializers)), opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    if any(is_sgd_node(n) for n in model.graph.node):
        ensure_sgd_function(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def momentum_step(shape=(3, 2), *, p="w", g="g", buf="buf", buffer=None, extra_nodes=(), extra_inputs=(), extra_outputs=(), momentum="m", initializers=()):
    """``buf_out = m*buf + g`` (or ``buffer`` nodes ending in ``<buf>_out``), ``p_out = p - 0.1*buf_out``,
    m = 0.9 unless ``momentum`` is given as an input."""
    nodes = list(buffer) if buffer is not None else [helper.make_node("Mul", [buf, momentum], ["mb"]), helper.make_node("Add", ["mb", g], [f"{buf}_out"])]
    nodes += [helper.make_node("Mul", [f"{buf}_out", "lr"], ["step_size"]), helper.make_node("Sub", [p, "step_size"], [f"{p}_out"])]
    init = [scalar("lr", 0.1)] + ([scalar("m", 0.9)] if momentum == "m" and not any(i.name == "m" for i in extra_inputs) else []) + list(initializers)
    return model_of(
        nodes + list(extra_nodes),
        [vi(p, shape), vi(g, shape), vi(buf, shape)] + list(extra_inputs),
        [vi(f"{p}_out", shape), vi(f"{buf}_out", shape)] + list(extra_outputs),
        init,
    )


def first_step_buffer(first: str = "first"):
    """``buf_out = Where(first, g, m*buf + g)``: torch's first step (the buffer starts as the gradient)."""
    return [
        helper.make_node("Mul", ["buf", "m"], ["mb"]),
        helper.make_node("Add", ["mb", "g"], ["later"]),
        helper.make_node("Where", [first, "g", "later"], ["buf_out"]),
    ]


def state_pairs(fused: onnx.ModelProto) -> dict[str, str]:
    """ONNX output → the input it feeds on the next step: ``X_out`` → ``X``."""
    inputs = {i.name for i in fused.graph.input}
    return {o.name: o.name[: -len("_out")] for o in fused.graph.output if o.name.endswith("_out") and o.name[: -len("_out")] in inputs}


def run_in_place(fused: onnx.ModelProto, lowered, *, steps: int = 3, seed: int = 0, first=None, schedule=None) -> None:
    """The GE step graph in place (state in its variables) against onnxruntime on ``fused`` fed its own new
    state, over ``steps`` chained steps; every output must agree (tolerances of test_lowering_support).
    ``first`` overrides inputs on the first step, ``schedule`` per step (name → values by step)."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in fused.graph.initializer}
    inputs = [i for i in fused.graph.input if i.name not in initializers]

    def fresh(value: onnx.ValueInfoProto) -> np.ndarray:
        shape = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
        return rng.standard_normal(shape).astype(np.float32).astype(onnx_to_numpy_dtype(value.type.tensor_type.elem_type))

    feeds = {i.name: fresh(i) for i in inputs}
    feeds.update(first or {})
    pairs = state_pairs(fused)
    session = runtime.make_session(fused)
    runner = lowered.runner()
    runner.initialise({name: feeds[name] for name in lowered.init_inputs.values()})
    for step in range(steps):
        for name, values in (schedule or {}).items():
            feeds[name] = np.asarray(values[step], dtype=onnx_to_numpy_dtype(next(i for i in inputs if i.name == name).type.tensor_type.elem_type))
        expected = runtime.run(session, feeds)
        actual = runner.step(feeds)
        assert set(actual) == {o.name for o in fused.graph.output}
        for name in actual:
            assert_agree(f"step {step}: {name}", expected[name], actual[name])
        for output, state in pairs.items():
            feeds[state] = expected[output]
        for value in inputs:
            if value.name not in pairs.values():
                feeds[value.name] = fresh(value)


def lower_and_run(model: onnx.ModelProto, **kwargs):
    """Lower the model as a user would (optimised first), check it fused, run it in place against
    onnxruntime on the fused model; returns ``(fused, lowered)``."""
    fused = sgdfuse.optimize(model).model
    assert any(is_sgd_node(n) for n in fused.graph.node), "the update did not fuse"
    lowered = sgdfuse.lower(fused, soc=SOC)
    run_in_place(fused, lowered, **kwargs)
    return fused, lowered


# ---- 1. views ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, perm",
    [((3, 1), (1, 0)), ((1, 3), (1, 0)), ((3, 2), (0, 1)), ((3, 2), (1, 0)), ((2, 1, 3), (1, 0, 2)), ((2, 1, 3), (0, 2, 1)), ((1, 1), (1, 0)), ((2, 3, 1), (2, 0, 1))],
)
def test_a_transpose_aliases_exactly_when_numpy_keeps_the_row_major_order(shape, perm):
    a = np.arange(int(np.prod(shape))).reshape(shape)
    assert keeps_layout(perm, shape) == bool(np.array_equal(np.transpose(a, perm).reshape(-1), a.reshape(-1)))


def test_readers_of_a_layout_keeping_transpose_of_the_weights_see_the_old_weights():
    # Neg(Transpose(w[3,1])): the transpose is a view of w (GE may make it a reshape).
    model = momentum_step(
        (3, 1),
        extra_nodes=[helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]), helper.make_node("Neg", ["w_t"], ["y"])],
        extra_outputs=[vi("y", (1, 3))],
    )
    lower_and_run(model)


@pytest.mark.parametrize("no_op", ["Cast", "Expand"])
def test_readers_through_a_no_op_cast_or_expand_of_the_weights_see_the_old_weights(no_op):
    # Cast(w, FLOAT) of FLOAT w, Expand(w, Shape(w)): no-ops a graph optimiser may remove.
    if no_op == "Cast":
        nodes = [helper.make_node("Cast", ["w"], ["w_same"], to=F)]
    else:
        nodes = [helper.make_node("Shape", ["w"], ["w_shape"]), helper.make_node("Expand", ["w", "w_shape"], ["w_same"])]
    model = momentum_step(extra_nodes=nodes + [helper.make_node("Neg", ["w_same"], ["y"])], extra_outputs=[vi("y", (3, 2))])
    lower_and_run(model)


def test_a_regression_head_read_through_two_transposes_sees_the_old_weights():
    # Linear(H, 1) head, dynamo style: the backward reads Transpose(Transpose(W2)); W2 is [1, H].
    nodes = [
        helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
        helper.make_node("Transpose", ["w_t"], ["w_tt"], perm=[1, 0]),
        helper.make_node("MatMul", ["d", "w_tt"], ["b1"]),
    ]
    model = momentum_step((1, 4), extra_nodes=nodes, extra_inputs=[vi("d", (2, 1))], extra_outputs=[vi("b1", (2, 4))])
    lower_and_run(model)


# ---- 2. stat never takes over another input ---------------------------------------------------------


@pytest.mark.parametrize("read", ["gradient", "initializer"])
def test_a_first_step_condition_reading_the_gradient_or_a_forward_initializer_leaves_it_alone(read):
    # first = step + ReduceSum(x * 0) == 0, with x the gradient or an initializer the forward uses too.
    x = "g" if read == "gradient" else "mask"
    nodes = [
        constant("zero_f", 0.0),
        helper.make_node("Mul", [x, "zero_f"], ["x0"]),
        helper.make_node("ReduceSum", ["x0"], ["s"], keepdims=0),
        helper.make_node("Cast", ["s"], ["s_i"], to=I64),
        helper.make_node("Add", ["step", "s_i"], ["t"]),
        constant("zero_i", 0, np.int64),
        helper.make_node("Equal", ["t", "zero_i"], ["first"]),
        helper.make_node("Mul", ["w", "mask"], ["masked"]),
    ]
    mask = numpy_helper.from_array(np.linspace(0.5, 1.5, 6, dtype=np.float32).reshape(3, 2), "mask")
    model = momentum_step(
        buffer=nodes + first_step_buffer(), extra_inputs=[vi("step", [], I64)], extra_outputs=[vi("masked", (3, 2))], initializers=[mask]
    )
    fused, lowered = lower_and_run(model, schedule={"step": [0, 1, 2]})
    assert "g" in lowered.inputs  # still fed on every step
    stat = [v for v in lowered.state if v.role == "stat"]
    assert [v.source for v in stat] == ["computed"] and stat[0].name not in {"g", "mask"}


def test_a_stat_graph_input_stays_an_input_fed_on_every_step():
    shape = (3, 2)
    nodes = [make_sgd_node(("w", "g", "lr", "buf", "m", "stat"), ("w_out", "buf_out", "stat_out"), SgdAttributes(0.25, 0.0, False), name="update")]
    model = model_of(nodes, [vi(n, shape) for n in ("w", "g", "buf", "stat")], [vi("w_out", shape), vi("buf_out", shape)], [scalar("lr", 0.1), scalar("m", 0.9)])
    lowered = sgdfuse.lower(model, soc=SOC)
    assert "stat" in lowered.inputs
    run_in_place(model, lowered, schedule={"stat": [np.ones(shape), np.zeros(shape), np.ones(shape)]})


# ---- 3. only the rewrite's own If is a write-back ------------------------------------------------------


def test_a_users_if_on_the_runtime_momentum_is_a_monitor_not_a_write_back():
    shape = (3, 2)
    then_branch = helper.make_graph([helper.make_node("Identity", ["buf_out"], ["kept"])], "then", [], [vi("kept", shape)])
    else_branch = helper.make_graph([constant("two", 2.0), helper.make_node("Mul", ["buf_out", "two"], ["doubled"])], "else", [], [vi("doubled", shape)])
    nodes = [
        helper.make_node("Shape", ["w"], ["w_shape"]),
        helper.make_node("ConstantOfShape", ["w_shape"], ["stat"], value=numpy_helper.from_array(np.zeros(1, np.float32))),
        make_sgd_node(("w", "g", "lr", "buf", "m", "stat"), ("w_out", "buf_out", "stat_out"), SgdAttributes(0.0, 0.0, False), name="update"),
        constant("zero", 0.0),
        helper.make_node("Equal", ["m", "zero"], ["m_is_zero"]),
        helper.make_node("If", ["m_is_zero"], ["monitor"], then_branch=then_branch, else_branch=else_branch),
    ]
    model = model_of(nodes, [vi("w", shape), vi("g", shape), vi("buf", shape), vi("m", [])], [vi("w_out", shape), vi("buf_out", shape), vi("monitor", shape)], [scalar("lr", 0.1)])
    lowered = sgdfuse.lower(model, soc=SOC)
    assert all(v.next_value is None for v in lowered.state)
    run_in_place(model, lowered, schedule={"m": [0.9, 0.0, 0.5]})


# ---- 5. a rollback leaves the other rewrites whole; the checker guards every write ----------------------


def two_updates(dtype: int) -> onnx.ModelProto:
    """Two updates of ``dtype`` state computed in FLOAT with the same learning rate; the first with a runtime
    momentum (in BFLOAT16 its verification fails: onnxruntime has no BFLOAT16 Equal), the second with 0.9."""
    shape = (3, 2)
    nodes, inputs, outputs = [], [vi("m", [])], []
    for k, momentum in ((1, "m"), (2, "m_const")):
        p, g, buf = f"p{k}", f"g{k}", f"buf{k}"
        inputs += [vi(p, shape, dtype), vi(g, shape, dtype), vi(buf, shape, dtype)]
        nodes += [helper.make_node("Cast", [x], [f"{x}_f"], to=F) for x in (p, g, buf)]
        nodes += [
            helper.make_node("Mul", [f"{buf}_f", momentum], [f"{buf}_m"]),
            helper.make_node("Add", [f"{buf}_m", f"{g}_f"], [f"{buf}_new"]),
            helper.make_node("Cast", [f"{buf}_new"], [f"{buf}_out"], to=dtype),
            helper.make_node("Mul", [f"{buf}_new", "lr"], [f"{p}_step"]),
            helper.make_node("Sub", [f"{p}_f", f"{p}_step"], [f"{p}_new"]),
            helper.make_node("Cast", [f"{p}_new"], [f"{p}_out"], to=dtype),
        ]
        outputs += [vi(f"{p}_out", shape, dtype), vi(f"{buf}_out", shape, dtype)]
    return model_of(nodes, inputs, outputs, [scalar("lr", 0.1), scalar("m_const", 0.9)])


def test_a_rolled_back_rewrite_leaves_the_initializers_the_kept_one_reads(monkeypatch):
    # Both updates read the learning-rate initializer the rewrite creates for the first; the first fails
    # verification (forced here, whatever the reason) and is rolled back.
    import sgdfuse.verify as verification

    real = verification.verify_plans

    def first_fails(model, index, plans, **kwargs):
        checks = real(model, index, plans, **kwargs)
        return [dataclasses.replace(c, passed=False, message="forced") if c.parameters_out == "p1_out" else c for c in checks]

    monkeypatch.setattr(verification, "verify_plans", first_fails)
    result = sgdfuse.optimize(two_updates(F))
    assert {u.parameters_out for u in result.report.fused} == {"p2_out"}
    onnx.checker.check_model(result.model, full_check=True)
    run_in_place(result.model, sgdfuse.lower(result.model, soc=SOC), schedule={"m": [0.9, 0.8, 0.7]})


def test_bfloat16_updates_with_a_runtime_momentum_give_a_valid_model_that_lowers_and_agrees():
    # The op takes lr and momentum in BFLOAT16 while the graph computes in FLOAT: the rounding is accepted here.
    result = sgdfuse.optimize(two_updates(B), allow_rounding=True)
    assert "p2_out" in {u.parameters_out for u in result.report.fused}
    onnx.checker.check_model(result.model, full_check=True)
    lowered = sgdfuse.lower(result.model, soc=SOC)
    rng = np.random.default_rng(1)
    first = {n: rng.standard_normal((3, 2)).astype(ml_dtypes.bfloat16) for n in ("p1", "g1", "buf1", "p2", "g2", "buf2")}
    run_in_place(result.model, lowered, first=first, schedule={"m": [0.9, 0.8, 0.7]})


def test_optimize_never_returns_or_writes_a_model_the_checker_rejects(monkeypatch, tmp_path, capsys):
    import sgdfuse.api as api

    real = api.apply_plans

    def broken(*args, **kwargs):
        model = real(*args, **kwargs)
        sgd = next(n for n in model.graph.node if is_sgd_node(n))
        sgd.input[2] = "nowhere"  # what the rolled-back initializer did: a read of a missing value
        return model

    monkeypatch.setattr(api, "apply_plans", broken)
    with pytest.raises(InvalidOutputError, match="onnx.checker"):
        sgdfuse.optimize(momentum_step())
    path = tmp_path / "step.onnx"
    onnx.save(momentum_step(), path)
    with pytest.raises(SystemExit) as exited:
        main(["optimize", str(path), "-o", str(tmp_path / "out.onnx")])
    assert exited.value.code == 1
    assert not (tmp_path / "out.onnx").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "onnx.checker" in err[0]


# ---- 6. what used to crash or be refused -----------------------------------------------------------------


@pytest.mark.parametrize("runtime_shape", [False, True])
def test_a_reshape_of_the_weights_shaped_after_the_updated_weights_lowers(runtime_shape):
    # Reshape(w, Shape(w_out) + k), read by another node: the reshape depends on the update but reads w.
    nodes = [helper.make_node("Shape", ["w_out"], ["w_out_shape"])]
    if runtime_shape:  # k = int(0 * sum(w_out)): only known at run time
        nodes += [helper.make_node("ReduceSum", ["w_out"], ["total"], keepdims=0), constant("zero", 0.0), helper.make_node("Mul", ["total", "zero"], ["nothing"]), helper.make_node("Cast", ["nothing"], ["k"], to=I64)]
    else:
        nodes += [constant("k", 0, np.int64)]
    nodes += [helper.make_node("Add", ["w_out_shape", "k"], ["target"]), helper.make_node("Reshape", ["w", "target"], ["w_again"], allowzero=int(runtime_shape)), helper.make_node("Neg", ["w_again"], ["y"])]
    lower_and_run(momentum_step(extra_nodes=nodes, extra_outputs=[vi("y", (3, 2))]))


def test_a_first_step_detected_from_an_all_zero_buffer_lowers_and_agrees():
    nodes = [helper.make_node("Abs", ["buf"], ["buf_abs"]), helper.make_node("ReduceSum", ["buf_abs"], ["buf_sum"], keepdims=0), constant("zero", 0.0), helper.make_node("Equal", ["buf_sum", "zero"], ["first"])]
    model = momentum_step(buffer=nodes + first_step_buffer())
    lower_and_run(model, first={"buf": np.zeros((3, 2), np.float32)})  # the first step, then later ones


def test_if_branches_that_reuse_a_name_are_inlined_apart():
    then_branch = helper.make_graph([helper.make_node("Neg", ["w"], ["tmp"]), helper.make_node("Identity", ["tmp"], ["then_out"])], "then", [], [vi("then_out", (3, 2))])
    else_branch = helper.make_graph([helper.make_node("Abs", ["w"], ["tmp"]), helper.make_node("Identity", ["tmp"], ["else_out"])], "else", [], [vi("else_out", (3, 2))])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    model = momentum_step(extra_nodes=nodes, extra_inputs=[vi("c", [], TensorProto.BOOL)], extra_outputs=[vi("y", (3, 2))])
    lower_and_run(model, schedule={"c": [True, False, True]})


def test_a_600_deep_elementwise_chain_fuses_and_lowers():
    nodes, previous = [], "x"
    for k in range(600):
        nodes.append(helper.make_node("Add" if k % 2 else "Mul", [previous, "c"], [f"h{k}"]))
        previous = f"h{k}"
    nodes.append(helper.make_node("Mul", [previous, "g_raw"], ["g"]))
    model = momentum_step(buffer=nodes + [helper.make_node("Mul", ["buf", "m"], ["mb"]), helper.make_node("Add", ["mb", "g"], ["buf_out"])],
                          g="g_raw", extra_inputs=[vi("x", (3, 2))], initializers=[scalar("c", 1.0001)])
    lower_and_run(model)


def test_tf2onnx_names_keep_their_onnx_names_at_the_executor():
    model = momentum_step(p="w:0", g="g:0", buf="buf:0")
    fused, lowered = lower_and_run(model)
    assert lowered.onnx_input("g_0") == "g:0"


def test_state_named_like_another_states_initial_value_is_initialised():
    model = momentum_step(p="w", buf="w/initial_value", g="g")
    fused, lowered = lower_and_run(model)
    step_variables = {op.name for op in lowered.graph.op if op.type == "Variable"}
    assigned = {op.input[0].rpartition(":")[0] for op in lowered.init_model.graph[0].op if op.type == "Assign"}
    assert step_variables == assigned and {"w", "w/initial_value"} <= step_variables


# ---- 7. sgdfuse lower checks what it writes ----------------------------------------------------------


def _without_control_edges(lowered):
    for op in lowered.graph.op:
        kept = [entry for entry in op.input if not entry.endswith(":-1")]
        del op.input[:]
        op.input.extend(kept)
    return lowered


def test_lower_refuses_to_write_a_graph_that_disagrees_with_onnxruntime(monkeypatch, tmp_path, capsys):
    import sgdfuse.lowering as lowering

    model = momentum_step(extra_nodes=[helper.make_node("Identity", ["w"], ["w_view"]), helper.make_node("Neg", ["w_view"], ["y"])], extra_outputs=[vi("y", (3, 2))])
    path = tmp_path / "step.onnx"
    onnx.save(model, path)
    real = lowering.lower
    monkeypatch.setattr(lowering, "lower", lambda *a, **k: _without_control_edges(real(*a, **k)))  # old reads now after the write
    with pytest.raises(SystemExit) as exited:
        main(["lower", str(path), "--soc", SOC, "-o", str(tmp_path / "step.air")])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disagrees with onnxruntime" in err[0] and "accesses variable w," in err[0], err
    assert not (tmp_path / "step.air").exists() and not (tmp_path / "step.init.air").exists()
    with pytest.raises(SystemExit) as exited:
        main(["lower", str(path), "--soc", SOC, "-o", str(tmp_path / "step.air"), "--no-verify"])
    assert exited.value.code in (0, None) and (tmp_path / "step.air").exists()


def test_lower_verifies_and_writes_a_sound_graph(tmp_path, capsys):
    path = tmp_path / "step.onnx"
    onnx.save(momentum_step((3, 1), extra_nodes=[helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]), helper.make_node("Neg", ["w_t"], ["y"])], extra_outputs=[vi("y", (1, 3))]), path)
    with pytest.raises(SystemExit) as exited:
        main(["lower", str(path), "--soc", SOC, "-o", str(tmp_path / "step.air")])
    assert exited.value.code in (0, None)
    assert "agrees with onnxruntime" in capsys.readouterr().out
    assert (tmp_path / "step.air").exists()


def test_the_check_chains_state_held_in_initializers_and_catches_reads_after_the_write():
    from sgdfuse.lowering.verify import verify_lowering

    shape = (3, 2)
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Shape", ["w"], ["w_shape"]),
        helper.make_node("ConstantOfShape", ["w_shape"], ["stat"]),
        make_sgd_node(("w", "g", "lr", "buf", "m", "stat"), ("w_out", "buf_out", "stat_out"), SgdAttributes(0.0, 0.0, False), name="update"),
        helper.make_node("Neg", ["w"], ["y"]),  # reads the old weights
    ]
    state = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name) for name in ("w", "buf")]
    model = model_of(nodes, [vi("g", shape)], [vi("w_out", shape), vi("y", shape)], [scalar("lr", 0.1), scalar("m", 0.9), *state])
    lowered = sgdfuse.lower(model, soc=SOC)
    assert {v.name: v.source for v in lowered.state if v.role != "stat"} == {"w": "initializer", "buf": "initializer"}
    assert verify_lowering(model, lowered).passed  # buf_out is no graph output: the check reads it anyway
    broken = verify_lowering(model, _without_control_edges(lowered))
    assert not broken.passed and "accesses variable w," in broken.message, broken.message


def test_the_check_feeds_a_zero_runtime_momentum_and_catches_a_missing_write_back():
    from sgdfuse.lowering.verify import verify_lowering

    fused = sgdfuse.optimize(momentum_step(extra_inputs=[vi("m", [])])).model
    lowered = sgdfuse.lower(fused, soc=SOC)
    assert verify_lowering(fused, lowered).passed
    write_back = next(op.name for op in lowered.graph.op if "write_back" in op.name)
    kept = [op for op in lowered.graph.op if op.name != write_back]
    for op in kept:
        entries = [e for e in op.input if e != f"{write_back}:-1"]
        del op.input[:]
        op.input.extend(entries)
    del lowered.graph.op[:]
    lowered.graph.op.extend(kept)
    # Momentum 0 on step 2: the kernel keeps the old buffer, the graph's next buffer is g; without the
    # write-back the GE variable holds the wrong buffer after step 2 (compared as the write into buf).
    check = verify_lowering(fused, lowered)
    assert not check.passed and "write into state buf" in check.message and "step 2" in check.message


def test_lower_says_in_one_line_when_the_check_cannot_run(monkeypatch, tmp_path, capsys):
    from sgdfuse.lowering.executor import KERNELS

    path = tmp_path / "step.onnx"
    onnx.save(momentum_step(extra_nodes=[helper.make_node("Neg", ["w"], ["y"])], extra_outputs=[vi("y", (3, 2))]), path)
    monkeypatch.delitem(KERNELS, "Neg")  # an op the executor cannot run
    with pytest.raises(SystemExit) as exited:
        main(["lower", str(path), "--soc", SOC, "-o", str(tmp_path / "step.air")])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot verify" in err[0] and "Neg" in err[0] and "--no-verify" in err[0]
    assert not (tmp_path / "step.air").exists()
