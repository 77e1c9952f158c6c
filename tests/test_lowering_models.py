"""Lowering the committed PyTorch training steps and synthetic fused models, per product line, and checking
the lowered GE graphs numerically against onnxruntime on the fused ONNX models (3 chained steps)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import sgdfuse
from sgdfuse.contract import SgdAttributes, product_line_for_soc
from sgdfuse.errors import ProductLineError
from sgdfuse.fused_op import is_sgd_node
from sgdfuse.lowering import GEModel
from sgdfuse.lowering.errors import InPlaceStateError
from sgdfuse.lowering.executor import ExecutorError
from test_lowering_support import MODEL_PATHS, NO_BF16_LINES, SOC_PER_LINE, fused, run_both, sgd_model

MODEL_IDS = [p.stem for p in MODEL_PATHS]


def test_testdata_is_present():
    assert len(MODEL_PATHS) >= 37


def test_one_soc_per_product_line_is_what_the_table_says():
    assert {name: product_line_for_soc(soc).name for name, soc in SOC_PER_LINE.items()} == {n: n for n in SOC_PER_LINE}


@pytest.mark.parametrize("line", list(SOC_PER_LINE))
@pytest.mark.parametrize("path", MODEL_PATHS, ids=MODEL_IDS)
def test_every_committed_model_lowers_on_every_product_line(path, line):
    # The committed models are FLOAT or FLOAT16 with static shapes of rank 1..2: every line accepts them.
    model = fused(path)
    lowered = sgdfuse.lower(model, soc=SOC_PER_LINE[line])
    assert isinstance(lowered, GEModel)
    assert lowered.product_line.name == line
    sgd_nodes = [n for n in model.graph.node if is_sgd_node(n)]
    assert len(lowered.sgd_ops) == len(sgd_nodes)
    assert [op.type for op in lowered.graph.op].count("SGD") == len(sgd_nodes)
    assert lowered.outputs == [o.name for o in model.graph.output]
    assert lowered.graph.op[-1].type == "NetOutput"
    assert len([i for i in lowered.graph.op[-1].input if not i.endswith(":-1")]) == len(model.graph.output)


@pytest.mark.parametrize("path", MODEL_PATHS, ids=MODEL_IDS)
def test_executor_agrees_with_onnxruntime_over_three_chained_steps(path):
    model = fused(path)
    report = run_both(model, sgdfuse.lower(model, soc="Ascend910B2"), steps=3)
    assert len(report) == 3


def test_unfused_model_is_optimised_first():
    path = next(p for p in MODEL_PATHS if p.stem == "sgd_momentum_legacy")
    lowered = sgdfuse.lower(path, soc="Ascend910B2")
    assert len(lowered.sgd_ops) == 2
    assert {v.role for v in lowered.state} == {"parameters", "accum", "stat"}


def test_stat_becomes_a_zero_initialised_variable_and_its_shape_plumbing_is_pruned():
    lowered = sgdfuse.lower(fused(next(p for p in MODEL_PATHS if p.stem == "sgd_momentum_dynamo")), soc="Ascend910B2")
    stats = [v for v in lowered.state if v.role == "stat"]
    assert stats and all(v.source == "zeros" for v in stats)
    assert not [op for op in lowered.graph.op if op.type in ("Shape", "Fill")]
    init_ops = {op.name: op for op in lowered.init_model.graph[0].op}
    for variable in stats:
        assign = init_ops[f"{variable.name}/assign"]
        assert assign.type == "Assign" and assign.input[0] == f"{variable.name}:0"
        assert init_ops[assign.input[1].rsplit(":", 1)[0]].type == "Const"


def test_state_persists_in_variables_across_runs():
    model = sgd_model()
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    runner = lowered.runner()
    rng = np.random.default_rng(1)
    w, buf = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    runner.initialise({"w": w, "buf_w": buf})
    out = runner.step({"grad_w": np.ones((4, 3), np.float32)})
    np.testing.assert_array_equal(runner.variables["w"], out["w_out"])
    np.testing.assert_array_equal(runner.variables["buf_w"], out["buf_w_out"])
    assert not np.shares_memory(out["buf_w_out"], runner.variables["buf_w"])  # graph outputs are copies


def test_reading_a_variable_before_the_init_graph_ran_is_an_error():
    lowered = sgdfuse.lower(sgd_model(), soc="Ascend910B2")
    with pytest.raises(ExecutorError, match="before it was assigned"):
        lowered.runner().step({"grad_w": np.ones((4, 3), np.float32)})


# ---- product lines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("line", list(SOC_PER_LINE))
def test_bfloat16_is_refused_exactly_where_the_contract_says(line):
    model = sgd_model(TensorProto.BFLOAT16)
    soc = SOC_PER_LINE[line]
    if line in NO_BF16_LINES:
        with pytest.raises(ProductLineError) as caught:
            sgdfuse.lower(model, soc=soc)
        message = str(caught.value)
        assert "node update/SGD" in message and "tensor w" in message and "BFLOAT16" in message
        assert f"contract: {line}: dtypes FLOAT, FLOAT16" in message
    else:
        assert len(sgdfuse.lower(model, soc=soc).sgd_ops) == 1


def test_bfloat16_lowered_graph_agrees_with_onnxruntime():
    model = sgd_model(TensorProto.BFLOAT16)
    run_both(model, sgdfuse.lower(model, soc="Ascend910B2"), steps=3)


@pytest.mark.parametrize("line", list(SOC_PER_LINE))
def test_dynamic_shape_is_refused_everywhere_but_the_950_series(line):
    model = sgd_model(shape=("N", 3))
    soc = SOC_PER_LINE[line]
    if line != "Ascend 950PR/950DT":
        with pytest.raises(ProductLineError) as caught:
            sgdfuse.lower(model, soc=soc)
        assert "node update/SGD, tensor w" in str(caught.value)
        assert f"contract: {line}: no dynamic shape" in str(caught.value)
    else:
        lowered = sgdfuse.lower(model, soc=soc)
        sgd = lowered.op(lowered.sgd_ops[0])
        assert list(sgd.input_desc[0].shape.dim) == [-1, 3]


def test_dynamic_shape_refused_on_910B2_and_accepted_and_correct_on_950PR_9599():
    model = sgd_model(shape=("N", 3), lr_input=True)
    with pytest.raises(ProductLineError, match="no dynamic shape"):
        sgdfuse.lower(model, soc="Ascend910B2")
    lowered = sgdfuse.lower(model, soc="Ascend950PR_9599")
    # The zero stat of unknown shape is filled like the parameters in the init graph.
    assert "Fill" in [op.type for op in lowered.init_model.graph[0].op]
    run_both(model, lowered, steps=3)


@pytest.mark.parametrize("shape, clause", [((), "parameters rank is 1..8"), ((1,) * 9, "parameters rank is 1..8"), ((4, 0), "empty tensors")])
@pytest.mark.parametrize("soc", ["Ascend950PR_9599", "Ascend910B2", "Ascend310P3"])
def test_rank_and_empty_tensor_limits_hold_on_every_line(shape, clause, soc):
    with pytest.raises(ProductLineError) as caught:
        sgdfuse.lower(sgd_model(shape=shape), soc=soc)
    assert clause in str(caught.value) and "node update/SGD" in str(caught.value)


def test_unknown_soc_lists_the_accepted_families():
    with pytest.raises(ProductLineError) as caught:
        sgdfuse.lower(sgd_model(), soc="Ascend910C")
    message = str(caught.value)
    for family in ("Ascend950PR_95##", "Ascend910B2", "Ascend910_9391", "Ascend310B1", "Ascend310P3", "Ascend910ProA"):
        assert family in message


def test_float16_is_accepted_on_every_line():
    model = sgd_model(TensorProto.FLOAT16)
    for soc in SOC_PER_LINE.values():
        assert sgdfuse.lower(model, soc=soc).sgd_ops


# ---- state that cannot be in place ---------------------------------------------------------------------


def test_an_accum_computed_from_its_own_buffer_is_assigned_to_it_before_the_update():
    # accum = buf + buf: computed from the one state of its shape and dtype, so that state's variable is
    # assigned the value before the op writes it in place.
    model = sgd_model()
    model.graph.node.insert(0, onnx.helper.make_node("Identity", ["buf_w"], ["buf_copy"], name="copy"))
    model.graph.node.insert(1, onnx.helper.make_node("Add", ["buf_copy", "buf_copy"], ["buf_twice"], name="twice"))
    sgd = next(n for n in model.graph.node if is_sgd_node(n))
    sgd.input[3] = "buf_twice"
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    accum = next(v for v in lowered.state if v.role == "accum")
    assert (accum.name, accum.assigned) == ("buf_w", "buf_twice")
    assign = lowered.op("update/SGD/assign_accum")
    assert assign.input[:2] == ["buf_w:0", "twice:0"] and "update/SGD/assign_accum:-1" in list(lowered.op("update/SGD").input)
    run_both(model, lowered, steps=3)


def test_two_updates_writing_one_parameter_are_refused():
    model = sgd_model()
    sgd = next(n for n in model.graph.node if is_sgd_node(n))
    second = onnx.NodeProto()
    second.CopyFrom(sgd)
    second.name = "update2/SGD"
    second.input[3] = "grad_w"  # its own accum, the same parameters
    second.output[:] = ["w_out2", "buf2_out", "stat2_out"]
    model.graph.node.append(second)
    with pytest.raises(InPlaceStateError, match="already written in place"):
        sgdfuse.lower(model, soc="Ascend910B2")


def test_initializer_parameters_become_a_variable_initialised_from_the_initializer():
    model = sgd_model()
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    model.graph.initializer.append(onnx.numpy_helper.from_array(w, "w"))
    del model.graph.input[0]
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    parameters = next(v for v in lowered.state if v.role == "parameters")
    assert parameters.source == "initializer" and "w" not in lowered.init_inputs.values()
    runner = lowered.runner()
    runner.initialise({"buf_w": np.zeros((4, 3), np.float32)})
    np.testing.assert_array_equal(runner.variables["w"], w)
    from sgdfuse import runtime

    grad = np.ones((4, 3), np.float32)
    expected = runtime.run(runtime.make_session(model), {"grad_w": grad, "buf_w": np.zeros((4, 3), np.float32)})
    actual = runner.step({"grad_w": grad})
    np.testing.assert_array_equal(actual["w_out"], expected["w_out"])


def test_attributes_reach_the_sgd_op_with_contract_kinds():
    lowered = sgdfuse.lower(sgd_model(attributes=SgdAttributes(0.0, 0.5, True)), soc="Ascend910B2")
    sgd = lowered.op(lowered.sgd_ops[0])
    assert sgd.attr["dampening"].WhichOneof("value") == "f" and sgd.attr["dampening"].f == 0.0
    assert sgd.attr["weight_decay"].WhichOneof("value") == "f" and sgd.attr["weight_decay"].f == 0.5
    assert sgd.attr["nesterov"].WhichOneof("value") == "b" and sgd.attr["nesterov"].b is True
    assert [d.name for d in sgd.input_desc] == ["parameters", "gradient", "learning_rate", "accum", "momentum", "stat"]
    assert [d.name for d in sgd.output_desc] == ["parameters"]
    assert [s.decode() for s in sgd.attr["_input_name_key"].list.s] == [d.name for d in sgd.input_desc]
    assert list(sgd.attr["_input_name_value"].list.i) == [0, 1, 2, 3, 4, 5]
    assert [s.decode() for s in sgd.attr["_output_name_key"].list.s] == ["parameters"]
    for desc in sgd.input_desc:
        assert desc.layout == "ND" and desc.attr["origin_format"].s == b"ND"
    assert sgd.input_desc[0].attr["origin_data_type"].s == b"DT_FLOAT"
    assert list(sgd.input_desc[0].attr["origin_shape"].list.i) == [4, 3]
    assert sgd.input[:6] == ["w:0", "grad_w:0", "lr:0", "buf_w:0", "momentum:0", "stat:0"]


def test_a_zero_accum_recomputed_every_step_is_assigned_zeros_on_every_step():
    # Zeros from ConstantOfShape stay unassigned only for stat (the kernel keeps them zero); an accum fed
    # zeros is a fresh variable assigned zeros before every update, as the ONNX graph feeds it.
    model = sgd_model()
    sgd = next(n for n in model.graph.node if is_sgd_node(n))
    sgd.input[3] = "stat"
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    accum, stat = (next(v for v in lowered.state if v.role == role) for role in ("accum", "stat"))
    assert (accum.source, accum.assigned) == ("computed", "stat")
    assert (stat.source, stat.assigned) == ("zeros", None) and stat.name != accum.name
    run_both(model, lowered, steps=3)
