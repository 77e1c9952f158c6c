"""Which old nodes and initializers the rewrite removes: an update's nodes go unless something still reads
their outputs after the rewrite (a kept node, a subgraph from the outer scope, a graph output), and a scalar
goes with the nodes that read it. Expected node sets are worked out by hand from the graphs below."""

from __future__ import annotations

import onnx
from onnx import helper

import sgdfuse.api as api
from graphs import momentum_sgd, value


def _old_nodes(model: onnx.ModelProto) -> set[str]:
    return {n.name for n in model.graph.node if n.domain != "ai.sgdfuse" and not n.name.startswith("sgdfuse/")}


def _fused(model: onnx.ModelProto) -> onnx.ModelProto:
    result = api.optimize(model, verify=False)
    assert len(result.report.fused) == 1, result.report
    return result.model


def test_an_update_read_by_nothing_else_goes_whole_with_its_scalars():
    out = _fused(momentum_sgd())
    assert _old_nodes(out) == set()
    assert not {"m", "lr"} & {t.name for t in out.graph.initializer}


def test_a_helper_read_by_a_kept_node_stays_with_its_scalar():
    copy = helper.make_node("Identity", ["step"], ["step_copy"], name="copy_step")
    out = _fused(momentum_sgd(extra_nodes=[copy], extra_outputs=[value("step_copy")]))
    # step (mul_lr) is still read; buf_scaled (mul_momentum) only by the replaced add_gradient.
    assert _old_nodes(out) == {"mul_lr", "copy_step"}
    initializers = {t.name for t in out.graph.initializer}
    assert "lr" in initializers and "m" not in initializers


def test_a_helper_read_by_a_subgraph_from_the_outer_scope_stays():
    body = helper.make_graph([helper.make_node("Identity", ["step"], ["then_out"])], "then", [], [value("then_out")])
    other = helper.make_graph([helper.make_node("Identity", ["g"], ["else_out"])], "else", [], [value("else_out")])
    flag = helper.make_node("IsNaN", ["lr"], ["flag"], name="flag")
    branch = helper.make_node("If", ["flag"], ["chosen"], name="branch", then_branch=body, else_branch=other)
    out = _fused(momentum_sgd(extra_nodes=[flag, branch], extra_outputs=[value("chosen")]))
    assert _old_nodes(out) == {"mul_lr", "flag", "branch"}
