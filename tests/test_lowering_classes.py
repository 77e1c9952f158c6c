"""``sgdfuse lower``'s verification on a model of many updates: the lowered model is cut into independent
parts, and from ``CLASS_MIN_PLANS`` parts on one member per class of parts equal up to names is run (plus a
seeded sample). A GE graph lowered wrongly for one member that is not the first of its class is still caught:
the class key covers the GE ops that member actually got, so it is a class of its own and is run.

The model: N momentum-SGD updates ``buf' = 0.9*buf + g; p' = p - lr*buf'`` over [2, 3] tensors, each with its
own names, all reading one learning rate computed in the graph from a fed ``lr`` (``Neg`` then ``Neg``), and
each with a read of its old parameters (``y = Neg(Identity(p))``, an output), which lowering must order before
the in-place write. The fused model comes from ``sgdfuse.optimize``, the GE graph from ``sgdfuse.lower``; the
wrong ones are made here by editing the GE ops of one member. Expected outcomes come from the contract: an
edited attribute, initial value or ordering changes that member's numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs  # noqa: E402
import sgdfuse.api as api  # noqa: E402
from sgdfuse.fused_op import is_sgd_node  # noqa: E402
from sgdfuse.lowering import lower  # noqa: E402
from sgdfuse.lowering.verify import verify_lowering  # noqa: E402
from sgdfuse.verify import CLASS_MIN_PLANS  # noqa: E402

N = 80
WRONG = 57  # not the first update, so never the first member of its class


def _updates(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Neg", ["lr"], ["neg_lr"]), helper.make_node("Neg", ["neg_lr"], ["lr_used"])]
    inputs = [graphs.value("lr", shape=[])]
    outputs = []
    for i in range(n):
        nodes += [
            helper.make_node("Mul", [f"buf{i}", "m"], [f"scaled{i}"]),
            helper.make_node("Add", [f"scaled{i}", f"g{i}"], [f"buf{i}_out"]),
            helper.make_node("Mul", [f"buf{i}_out", "lr_used"], [f"step{i}"]),
            helper.make_node("Sub", [f"p{i}", f"step{i}"], [f"p{i}_out"]),
            helper.make_node("Identity", [f"p{i}"], [f"view{i}"]),
            helper.make_node("Neg", [f"view{i}"], [f"y{i}"]),
        ]
        inputs += [graphs.value(f"p{i}"), graphs.value(f"g{i}"), graphs.value(f"buf{i}")]
        outputs += [graphs.value(f"p{i}_out"), graphs.value(f"buf{i}_out"), graphs.value(f"y{i}")]
    return graphs.make_model(nodes, inputs, outputs, [graphs.scalar("m", 0.9)])


@pytest.fixture(scope="module")
def fused() -> onnx.ModelProto:
    model = api.optimize(_updates(N), verify=False).model
    assert sum(is_sgd_node(node) for node in model.graph.node) == N
    return model


def _lowered(fused: onnx.ModelProto):
    return lower(fused, soc="Ascend910B2", optimise=False)


def _sgd_op(lowered, parameters: str):
    """The step graph's SGD op updating the variable ``parameters``."""
    for op in lowered.graph.op:
        if op.type == "SGD" and op.input[0].rpartition(":")[0] == parameters:
            return op
    raise AssertionError(f"no SGD op writes {parameters}")


def test_a_correct_lowering_passes_with_one_run_per_class(fused):
    check = verify_lowering(fused, _lowered(fused))
    assert check.passed, check.message
    assert check.parts == N  # one part per update: the shared learning-rate ops are copied, not joined
    assert N >= CLASS_MIN_PLANS and check.parts_run < check.parts
    assert check.classes < check.parts  # names (and each Data op's place among the inputs) are abstracted
    assert set(check.outputs) == {o.name for o in fused.graph.output}


def test_one_member_whose_sgd_op_has_another_weight_decay_is_caught(fused):
    """The GE op of one update decays its weights (weight_decay 0.25) where the ONNX update does not."""
    lowered = _lowered(fused)
    op = _sgd_op(lowered, f"p{WRONG}")
    op.attr["weight_decay"].f = 0.25
    check = verify_lowering(fused, lowered)
    assert not check.passed
    assert f"p{WRONG}_out" in check.message or f"buf{WRONG}_out" in check.message


def test_one_member_whose_init_graph_assigns_the_wrong_initial_value_is_caught(fused):
    """The init graph assigns one update's parameters variable the initial value fed for its buffer: the
    GE graph then steps from other weights than onnxruntime."""
    lowered = _lowered(fused)
    init = lowered.init_model.graph[0]
    assign = next(op for op in init.op if op.type == "Assign" and op.input[0] == f"p{WRONG}:0")
    assert assign.input[1] == f"p{WRONG}/initial_value:0"
    assign.input[1] = f"buf{WRONG}/initial_value:0"
    check = verify_lowering(fused, lowered)
    assert not check.passed
    # The init graph is checked on its own (the step comparison writes the state it feeds into the variables).
    assert f"variable p{WRONG} " in check.message and "init graph" in check.message


def test_one_member_whose_old_value_read_is_not_ordered_before_the_write_is_caught(fused):
    """The control edges that order one update's read of its old parameters (``y = Neg(Identity(p))``)
    before the SGD op's in-place write are dropped: the read and the write of that member's parameters are
    then unordered, which the executor refuses (it used to run the writer first and give ``y`` the new
    parameters, which the comparison caught)."""
    lowered = _lowered(fused)
    sgd = _sgd_op(lowered, f"p{WRONG}")
    controls = [entry for entry in sgd.input if entry.endswith(":-1")]
    assert controls, "lowering orders the old-value read by a control edge on the SGD op"
    kept = [entry for entry in sgd.input if not entry.endswith(":-1")]
    del sgd.input[:]
    sgd.input.extend(kept)
    check = verify_lowering(fused, lowered)
    assert not check.passed
    assert f"accesses variable p{WRONG}," in check.message, check.message


def test_the_sample_does_not_decide_it(fused):
    """Whatever the seed (so whichever members the sample picks), the wrong member is run and caught."""
    for seed in (0, 1, 2):
        lowered = _lowered(fused)
        _sgd_op(lowered, f"p{WRONG}").attr["weight_decay"].f = 0.25
        check = verify_lowering(fused, lowered, seed=seed)
        assert not check.passed and check.parts_run < check.parts
