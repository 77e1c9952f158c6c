"""``sgdfuse check`` on outputs computed from an update's new value (a logged weight norm).

The fused model computes the new weights within the update's bound, not identically, so an output computed
from them (``ReduceSumSquare(w_out)``) was compared exactly and disagreed by the update's own rounding: a false
"the models disagree" for a correct fusion. Such readers are now fed one value of the update on both sides
(sgdfuse.verify._feed_update_readers), which must give identical numbers, while the update's outputs keep
their bound. Every edit below of what comes after the update must still fail.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.verify import check_models

F = TensorProto.FLOAT
SHAPE = [64, 32]


def _vi(name, shape=SHAPE):
    return helper.make_tensor_value_info(name, F, shape)


def _step() -> onnx.ModelProto:
    """Momentum SGD with dampening 0.3 written ``g - d*g`` (so the fused op's ``(1 - d)*g`` rounds otherwise),
    and two outputs computed from the new weights: their squared norm and their mean."""
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["kept"]),
        helper.make_node("Mul", ["g", "d"], ["dg"]),
        helper.make_node("Sub", ["g", "dg"], ["gd"]),
        helper.make_node("Add", ["kept", "gd"], ["buf_out"]),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"]),
        helper.make_node("Sub", ["w", "step"], ["w_out"]),
        helper.make_node("ReduceSumSquare", ["w_out"], ["w_norm2"], keepdims=0),
        helper.make_node("ReduceMean", ["w_out"], ["w_mean"], keepdims=0),
    ]
    constants = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("m", 0.9), ("lr", 0.1), ("d", 0.3))]
    graph = helper.make_graph(nodes, "step", [_vi("w"), _vi("g"), _vi("buf")],
                              [_vi("w_out"), _vi("buf_out"), _vi("w_norm2", []), _vi("w_mean", [])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _fused() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original = _step()
    result = sgdfuse.optimize(original)
    assert [u.parameters for u in result.report.fused] == ["w"] and result.report.refused == []
    return original, result.model


def _entry(check, name):
    return next(e for e in check.outputs if e["name"] == name)


def test_outputs_read_from_the_new_weights_agree_for_a_correct_fusion():
    original, fused = _fused()
    # The premise: the two models' new weights differ by rounding, so the norm computed from them differs too.
    from sgdfuse.runtime import make_session, run

    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(SHAPE).astype(np.float32) for n in ("w", "g", "buf")}
    want = run(make_session(original), feeds, ["w_norm2", "w_out"])
    have = run(make_session(fused), feeds, ["w_norm2", "w_out"])
    assert not np.array_equal(want["w_out"], have["w_out"])
    check = check_models(original, fused)
    assert check.passed, [e["message"] for e in check.outputs + check.in_place if not e["passed"]]
    assert _entry(check, "w_norm2")["kind"] == "exact" and _entry(check, "w_norm2")["max_abs_error"] == 0.0
    assert "w_norm2" in check.note and "w_mean" in check.note


def _edit(fused: onnx.ModelProto, edit) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(fused)
    edit(copy.graph)
    return copy


def _node(graph, output):
    return next(n for n in graph.node if output in n.output)


def _reads_old_weights(graph):
    _node(graph, "w_norm2").input[0] = "w"


def _sums_instead(graph):
    _node(graph, "w_norm2").op_type = "ReduceSum"


def _scaled_after(graph):
    node = _node(graph, "w_norm2")
    node.output[0] = "w_norm2_raw"
    graph.node.append(helper.make_node("Mul", ["w_norm2_raw", "almost_one"], ["w_norm2"]))
    graph.initializer.append(numpy_helper.from_array(np.array(1 + 2.0**-20, np.float32), "almost_one"))


def _renamed_reader(graph):
    # the reader writes another name and an Identity gives the output: the original's node is not found by name
    node = _node(graph, "w_mean")
    node.output[0] = "mean_elsewhere"
    graph.node.append(helper.make_node("Mul", ["mean_elsewhere", "almost_one"], ["w_mean"]))
    graph.initializer.append(numpy_helper.from_array(np.array(1 + 2.0**-20, np.float32), "almost_one"))


@pytest.mark.parametrize("edit, output", [(_reads_old_weights, "w_norm2"), (_sums_instead, "w_norm2"),
                                          (_scaled_after, "w_norm2"), (_renamed_reader, "w_mean")],
                         ids=["reads-old-weights", "sums-instead", "scaled-after", "renamed-reader"])
def test_what_comes_after_the_update_edited_in_the_fused_model_fails(edit, output):
    original, fused = _fused()
    check = check_models(original, _edit(fused, edit))
    assert not check.passed
    assert not _entry(check, output)["passed"]
    assert _entry(check, "w_out")["passed"]  # the update itself is still right


def test_the_update_itself_a_little_off_still_fails_with_readers_fed():
    original, fused = _fused()

    def lr_up(graph):
        sgd = next(n for n in graph.node if n.op_type == "SGD")
        lr = next(t for t in graph.initializer if t.name == sgd.input[2])
        lr.CopyFrom(numpy_helper.from_array(np.array(0.1 * (1 + 1e-4), np.float32), lr.name))

    check = check_models(original, _edit(fused, lr_up))
    assert not check.passed and not _entry(check, "w_out")["passed"]


def _step_logging_in_an_if() -> onnx.ModelProto:
    """The step of :func:`_step` with its norm logged inside an ``If`` (on the steps a condition computed from the
    gradient selects; here every step) and no mean: the branch reads ``w_out`` from the enclosing graph, not
    through an input."""
    model = _step()
    graph = model.graph
    graph.node.remove(_node(graph, "w_norm2"))
    graph.node.remove(_node(graph, "w_mean"))  # the If alone reads the new weights
    graph.output.remove(next(o for o in graph.output if o.name == "w_mean"))
    then_branch = helper.make_graph([helper.make_node("ReduceSumSquare", ["w_out"], ["logged"], keepdims=0)], "then", [],
                                    [_vi("logged", [])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["zero"], ["skipped"])], "else", [], [_vi("skipped", [])])
    graph.node.extend([
        helper.make_node("ReduceSum", ["g"], ["g_sum"], keepdims=0),
        helper.make_node("Greater", ["g_sum", "low"], ["log_now"]),
        helper.make_node("If", ["log_now"], ["w_norm2"], then_branch=then_branch, else_branch=else_branch),
    ])
    graph.initializer.extend([numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                              numpy_helper.from_array(np.array(-1e30, np.float32), "low")])
    return model


def test_a_norm_logged_inside_an_if_branch_is_fed_too():
    # The branch reads w_out as an outer-scope name: the reader was found (and the note said it was fed) but
    # only the node's inputs were renamed, so the branch read each side's own w_out and the norm was compared
    # exactly against the update's rounding: "the models disagree" (2.4e-4 of 2165) for a correct fusion.
    original = _step_logging_in_an_if()
    result = sgdfuse.optimize(original)
    assert [u.parameters for u in result.report.fused] == ["w"]
    check = check_models(original, result.model)
    assert check.passed, [e["message"] for e in check.outputs + check.in_place if not e["passed"]]
    assert _entry(check, "w_norm2")["max_abs_error"] == 0.0


def _branch_reads_old_weights(graph):
    branch = next(a.g for a in _node(graph, "w_norm2").attribute if a.name == "then_branch")
    branch.node[0].input[0] = "w"


def _branch_scaled(graph):
    branch = next(a.g for a in _node(graph, "w_norm2").attribute if a.name == "then_branch")
    branch.node[0].output[0] = "raw"
    branch.node.append(helper.make_node("Mul", ["raw", "almost_one"], ["logged"]))
    graph.initializer.append(numpy_helper.from_array(np.array(1 + 2.0**-20, np.float32), "almost_one"))


@pytest.mark.parametrize("edit", [_branch_reads_old_weights, _branch_scaled], ids=["reads-old-weights", "scaled"])
def test_a_norm_logged_inside_an_if_branch_edited_in_the_fused_model_fails(edit):
    original = _step_logging_in_an_if()
    check = check_models(original, _edit(sgdfuse.optimize(original).model, edit))
    assert not check.passed and not _entry(check, "w_norm2")["passed"]
    assert _entry(check, "w_out")["passed"]
