"""The names a plan makes collide with nothing in the graph (sgdfuse.passes.rewrite.Planner).

Every name the planner makes starts with ``sgdfuse/`` and is the first of ``base``, ``base_1``, ``base_2``, ...
that no node, value, initializer or graph input of the graph holds yet and no earlier plan made. The planner
looks only at the graph's names under that prefix (the node names as the index read them); these tests give
it graphs whose own names under the prefix are exactly the ones a plan would make first (a model fused
before, or names chosen to collide) and check each made name against every name of the graph, read here
through protobuf.
"""

from __future__ import annotations

import dataclasses

import onnx
import pytest
from onnx import helper

from sgdfuse.fused_op import function_opset
from sgdfuse.passes.index import OWN_PREFIX, build_index
from sgdfuse.passes.linear import Normaliser
from sgdfuse.passes.rewrite import Planner
from sgdfuse.passes.sgd_match import find_updates
from graphs import make_model, scalar, value


def _graph_names(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    names = {n.name for n in graph.node} | {t.name for t in graph.initializer} | {i.name for i in graph.input}
    names |= {name for n in graph.node for name in (*n.input, *n.output)}
    return names - {""}


def _updates(count: int, *, taken: dict[str, str] | None = None) -> onnx.ModelProto:
    """``count`` alike momentum-SGD updates ``p{k}_out = p{k} - 0.1*(0.9*b{k} + g{k})``, plus, per entry of
    ``taken`` (name -> kind: ``node``, ``value``, ``initializer``, ``input``), a graph name that a plan would
    make first."""
    nodes, inputs, outputs, initializers = [], [], [], [scalar("m", 0.9), scalar("lr", 0.1)]
    for k in range(count):
        p, g, b = f"p{k}", f"g{k}", f"b{k}"
        nodes += [
            helper.make_node("Mul", [b, "m"], [f"{b}_scaled"]),
            helper.make_node("Add", [f"{b}_scaled", g], [f"{b}_out"]),
            helper.make_node("Mul", [f"{b}_out", "lr"], [f"{p}_step"]),
            helper.make_node("Sub", [p, f"{p}_step"], [f"{p}_out"]),
        ]
        inputs += [value(p), value(g), value(b)]
        outputs += [value(f"{p}_out"), value(f"{b}_out")]
    for name, kind in (taken or {}).items():
        if kind == "node":
            nodes.append(helper.make_node("Identity", ["m"], [f"watch_{len(outputs)}"], name=name))
            outputs.append(value(f"watch_{len(outputs)}", shape=[]))
        elif kind == "value":
            nodes.append(helper.make_node("Identity", ["m"], [name]))
            outputs.append(value(name, shape=[]))
        elif kind == "initializer":
            initializers.append(scalar(name, 2.0))
        else:
            inputs.append(value(name, shape=[]))
    return make_model(nodes, inputs, outputs, initializers)


def _plans(model: onnx.ModelProto, index=None):
    index = index or build_index(model)
    matches, _ = find_updates(index, Normaliser(index))
    planner = Planner(index, function_opset(model))
    return planner, [planner.plan(match) for match in matches]


def _made_names(plans) -> list[str]:
    names = []
    for plan in plans:
        for node in plan.nodes:
            names.append(node.name)
            names.extend(node.output)
        names.extend(t.name for t in plan.initializers)
    return [n for n in names if n.startswith(OWN_PREFIX)]


TAKEN = {
    "sgdfuse/p0_out/SGD": "node",
    "sgdfuse/p1_out/ConstantOfShape": "node",
    "sgdfuse/p2_out/stat": "value",
    "sgdfuse/learning_rate_0": "initializer",
    "sgdfuse/p0_out/stat_out": "input",
    "sgdfuse/stat_shape_0": "value",
}


def test_names_made_by_the_plans_collide_with_no_name_of_the_graph():
    model = _updates(4, taken=TAKEN)
    _, plans = _plans(model)
    assert len(plans) == 4
    made = _made_names(plans)
    assert not set(made) & _graph_names(model)
    assert len(made) == len(set(made))  # and with no other name made
    # The first free name of base, base_1, ...: each taken name pushed its plan's name to _1.
    assert "sgdfuse/p0_out/SGD_1" in made and "sgdfuse/p1_out/ConstantOfShape_1" in made
    assert "sgdfuse/p2_out/stat_1" in made and "sgdfuse/learning_rate_0_1" in made
    assert "sgdfuse/p0_out/stat_out_1" in made and "sgdfuse/stat_shape_0_1" in made


def test_the_plans_are_the_same_when_the_index_holds_no_node_names():
    # An index made by hand (own_node_names None): the planner reads the node names from the graph.
    model = _updates(3, taken=TAKEN)
    index = build_index(model)
    assert index.own_node_names == {name for name, kind in TAKEN.items() if kind == "node"}
    _, from_index = _plans(model, index)
    _, from_graph = _plans(model, dataclasses.replace(index, own_node_names=None))
    assert [[n.SerializeToString() for n in p.nodes] for p in from_index] == [[n.SerializeToString() for n in p.nodes] for p in from_graph]


@pytest.mark.parametrize("name", ["p0", "b1_out", "lr", "watch_6"])
def test_a_name_requested_outside_the_prefix_meets_every_name_of_the_graph(name):
    model = _updates(3, taken={"sgdfuse/x": "node"})
    planner, _ = _plans(model)
    assert name in _graph_names(model)
    made = planner._fresh(name)
    assert made == f"{name}_1" and made not in _graph_names(model)
