"""A model whose nodes form a cycle is refused with one clear error, promptly, and nothing is written.

ONNX graphs are acyclic (IR spec: nodes are topologically sortable), but a model file is untrusted input. A
fresh trial's ``buf_out = bm + d; d = buf_out * lr`` made ``optimize`` and ``inspect`` run for ten minutes
and grow to 13 GB (the matcher's iterative walk pushed the cycle forever); a cycle through a one-element
learning rate reached the rewrite and was reported as an internal error of sgdfuse. A graph merely out of
topological order, with no cycle, is still optimised.
"""

from __future__ import annotations

import os
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

sys.path.insert(0, os.path.dirname(__file__))
import graphs  # noqa: E402

import sgdfuse  # noqa: E402
from sgdfuse.errors import GraphCycleError  # noqa: E402

node = helper.make_node


def _model(nodes, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "step", [graphs.value(n) for n in ("p", "g", "buf")], [graphs.value("p_out"), graphs.value("buf_out")],
        [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1), graphs.scalar("c", 0.5)], value_info=list(value_info),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])  # not checked: it has a cycle


TENSOR_CYCLE = [
    node("Mul", ["buf", "m"], ["bm"]),
    node("Add", ["bm", "d"], ["buf_out"]),
    node("Mul", ["buf_out", "lr"], ["d"]),
    node("Sub", ["p", "d"], ["p_out"]),
]
SCALAR_CYCLE = [
    node("Mul", ["buf", "m"], ["bm"]),
    node("Add", ["bm", "g"], ["buf_out"]),
    node("Mul", ["lr2", "c"], ["lr3"]),
    node("Add", ["lr3", "c"], ["lr2"]),
    node("Mul", ["buf_out", "lr2"], ["st"]),
    node("Sub", ["p", "st"], ["p_out"]),
]


@pytest.mark.parametrize("nodes, on_cycle", [(TENSOR_CYCLE, {"buf_out", "d"}), (SCALAR_CYCLE, {"lr2", "lr3"})])
def test_a_cycle_is_refused_naming_a_value_on_it(nodes, on_cycle):
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("lr2", "lr3")]
    with pytest.raises(GraphCycleError) as caught:
        sgdfuse.optimize(_model(nodes, info))
    assert caught.value.value in on_cycle
    assert "cycle" in str(caught.value)


@pytest.mark.parametrize("command", ["optimize", "inspect"])
def test_the_cli_says_so_and_writes_nothing(tmp_path, command):
    source = tmp_path / "cycle.onnx"
    onnx.save(_model(TENSOR_CYCLE), source)
    before = source.read_bytes()
    result = subprocess.run([sys.executable, "-m", "sgdfuse.cli", command, str(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: the graph has a cycle:"), result.stderr
    assert "internal error" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cycle.onnx"] and source.read_bytes() == before


def test_nodes_out_of_order_without_a_cycle_are_still_optimised():
    model = graphs.make_model(
        [node("Mul", ["buf", "m"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]),
         node("Sub", ["p", "st"], ["p_out"])],
        [graphs.value(n) for n in ("p", "g", "buf")], [graphs.value("p_out"), graphs.value("buf_out")],
        [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1)],
    )
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    result = sgdfuse.optimize(model)
    assert [f.parameters_out for f in result.report.fused] == ["p_out"]
    assert result.report.sorted_nodes and result.report.to_dict()["model"]["sorted_nodes"]


def _damped_step() -> onnx.ModelProto:
    """Dampening written ``g - d*g``: a helper (``d*g``) that only another helper of the update reads."""
    return graphs.make_model(
        [node("Mul", ["buf", "m"], ["bm"]), node("Mul", ["g", "c"], ["dg"]), node("Sub", ["g", "dg"], ["gd"]),
         node("Add", ["bm", "gd"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])],
        [graphs.value(n) for n in ("p", "g", "buf")], [graphs.value("p_out"), graphs.value("buf_out")],
        [graphs.scalar("m", 0.9), graphs.scalar("lr", 0.1), graphs.scalar("c", 0.5)],
    )


def test_nodes_out_of_order_lose_every_helper_of_the_update_as_in_order(tmp_path):
    # Reversed, the helper d*g came before its reader g - d*g, and the removal (last to first) kept it: a dead
    # Mul stayed in the output. The CLI also says that the output is sorted.
    in_order = sgdfuse.optimize(_damped_step())
    assert not in_order.report.sorted_nodes
    reversed_model = _damped_step()
    nodes = list(reversed_model.graph.node)
    del reversed_model.graph.node[:]
    reversed_model.graph.node.extend(reversed(nodes))
    result = sgdfuse.optimize(reversed_model)
    assert [n.op_type for n in result.model.graph.node] == [n.op_type for n in in_order.model.graph.node] == ["ConstantOfShape", "SGD"]
    onnx.save(reversed_model, tmp_path / "reversed.onnx")
    done = subprocess.run([sys.executable, "-m", "sgdfuse.cli", "optimize", str(tmp_path / "reversed.onnx"), "-o", str(tmp_path / "out.onnx")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "not in topological order" in done.stdout and "sorted" in done.stdout


def test_a_value_output_by_two_nodes_is_refused_naming_both():
    # A fresh trial's model with d defined by a Mul and again by an Identity was refused as no-momentum-buffer.
    from sgdfuse.errors import DuplicateValueError

    nodes = [
        node("Mul", ["buf", "m"], ["bm"]),
        node("Add", ["bm", "g"], ["buf_out"]),
        node("Mul", ["buf_out", "lr"], ["d"], name="first_d"),
        node("Sub", ["p", "d"], ["p_out"]),
        node("Identity", ["g"], ["d"], name="second_d"),
    ]
    with pytest.raises(DuplicateValueError) as caught:
        sgdfuse.optimize(_model(nodes))
    assert (caught.value.value, caught.value.first, caught.value.second) == ("d", "first_d", "second_d")


def test_a_gradient_nothing_defines_is_named():
    model = _model([node("Mul", ["buf", "m"], ["bm"]), node("Add", ["bm", "gX"], ["buf_out"]),
                    node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])])
    [refusal] = sgdfuse.optimize(model).report.refused
    assert "gX is read but nothing defines it" in refusal.detail, refusal.detail
