"""Plans replayed per structural class (``sgdfuse.passes.rewrite.Planner.plan``): the first member of a class of
the matcher is planned, each other member gets that plan with its own names; the result must be, node for node
and name for name, the plan made for it directly. Checked here on every path the replay takes (maximize's Neg,
BFLOAT16's casts, a static and a symbolic shape, a runtime learning rate fed as it is, one shared by every
update and one per update), and a first plan changed by its caller must not change the others. A replayed
plan's nodes are made when first read: until then the rewrite writes them from the template, and the output
must be the one the made nodes give."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graphs  # noqa: E402
from sgdfuse.fused_op import function_opset  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.linear import Normaliser  # noqa: E402
from sgdfuse.passes.rewrite import Planner, apply_plans  # noqa: E402
from sgdfuse.passes.sgd_match import MEMO_CHECK_ENV, find_updates  # noqa: E402

N = 12


def _step(*, dtype=TensorProto.FLOAT, shape=graphs.SHAPE, maximize=False, lr="constant") -> onnx.ModelProto:
    """N updates ``buf' = 0.9*buf + g; p' = p -(+) lr*buf'`` with ``lr`` a constant, one runtime input shared by
    all (``shared``) or a runtime input per update (``own``)."""
    nodes, inputs, outputs = [], [], []
    initializers = [graphs.scalar("m", 0.9, dtype)]
    if lr == "constant":
        initializers.append(graphs.scalar("lr", 0.1, dtype))
    elif lr == "shared":
        inputs.append(graphs.value("lr", dtype, []))
    for i in range(N):
        rate = f"lr{i}" if lr == "own" else "lr"
        if lr == "own":
            inputs.append(graphs.value(rate, dtype, []))
        nodes += [
            helper.make_node("Mul", [f"buf{i}", "m"], [f"scaled{i}"]),
            helper.make_node("Add", [f"scaled{i}", f"g{i}"], [f"buf{i}_out"]),
            helper.make_node("Mul", [f"buf{i}_out", rate], [f"step{i}"]),
            helper.make_node("Add" if maximize else "Sub", [f"p{i}", f"step{i}"], [f"p{i}_out"]),
        ]
        inputs += [graphs.value(f"{v}{i}", dtype, shape) for v in ("p", "g", "buf")]
        outputs += [graphs.value(f"{v}{i}_out", dtype, shape) for v in ("p", "buf")]
    return graphs.make_model(nodes, inputs, outputs, initializers)


def _matches(model: onnx.ModelProto):
    index = build_index(model)
    matches, misses = find_updates(index, Normaliser(index))
    assert len(matches) == N and not misses
    assert all(m.structural_class is not None for m in matches), "the updates are one class of the matcher"
    return index, matches


def _text(plan) -> list:
    return [n.SerializeToString(deterministic=True) for n in plan.nodes] + [
        [t.SerializeToString(deterministic=True) for t in plan.initializers],
        plan.gradient_input, plan.learning_rate_input, plan.momentum_input, plan.stat,
    ]


CASES = {
    "plain": {},
    "maximize": {"maximize": True},
    "bfloat16": {"dtype": TensorProto.BFLOAT16},
    "symbolic shape": {"shape": ["n", 3]},
    "shared runtime lr": {"lr": "shared"},
    "runtime lr per update": {"lr": "own"},
}


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_plan_is_the_plan_made_directly(case, monkeypatch):
    monkeypatch.delenv(MEMO_CHECK_ENV, raising=False)  # compare here, by hand
    model = _step(**CASES[case])
    index, matches = _matches(model)
    replaying = Planner(index, function_opset(model))
    replayed = [replaying.plan(m) for m in matches]
    direct_planner = Planner(index, function_opset(model))
    direct = [direct_planner._plan(m) for m in matches]
    assert len(replaying._templates) == 1, "one class, one template"
    for a, b in zip(replayed, direct):
        assert _text(a) == _text(b), a.match.parameters_out
    # Every replayed plan reads its own update's values and names its own nodes.
    for i, plan in enumerate(replayed):
        reads = {n for node in plan.nodes for n in node.input}
        assert {f"p{i}", f"buf{i}"} <= reads and plan.sgd_node.output[0] == f"p{i}_out"
        assert all(node.name.startswith(f"sgdfuse/p{i}_out/") for node in plan.nodes)


def test_changing_the_first_plan_after_it_is_made_changes_no_other(monkeypatch):
    monkeypatch.delenv(MEMO_CHECK_ENV, raising=False)
    model = _step()
    index, matches = _matches(model)
    planner = Planner(index, function_opset(model))
    first = planner.plan(matches[0])
    first.sgd_node.input[2] = "something_else"
    del first.sgd_node.attribute[:]
    second = planner.plan(matches[1])
    assert second.sgd_node.input[2] != "something_else"
    assert {a.name for a in second.sgd_node.attribute} == {"dampening", "weight_decay", "nesterov"}


@pytest.mark.parametrize("case", CASES)
def test_a_replayed_plan_whose_nodes_nobody_read_is_written_as_the_made_one(case, monkeypatch):
    # apply_plans writes a replayed plan's nodes straight from its template while nobody has read them; the
    # output must be the one the made nodes give, byte for byte.
    monkeypatch.delenv(MEMO_CHECK_ENV, raising=False)
    model = _step(**CASES[case])
    index, matches = _matches(model)
    unread = Planner(index, function_opset(model))
    lazy = [unread.plan(m) for m in matches]
    read = Planner(index, function_opset(model))
    made = [read.plan(m) for m in matches]
    for plan in made:
        assert plan.nodes and plan._replay() is None  # read: the nodes are made
    assert sum(plan._replay() is not None for plan in lazy) == N - 1, "all but the first are replays, not made"
    # What the report and the output guard ask of a plan is answered alike either way, without making nodes.
    for a, b in zip(lazy, made):
        assert (a.first_outputs(), a.node_io(), a.op_types(), a.sgd_position(), a.sgd_node_name()) == (
            b.first_outputs(), b.node_io(), b.op_types(), b.sgd_position(), b.sgd_node_name())
    assert sum(plan._replay() is not None for plan in lazy) == N - 1
    output = apply_plans(model, index, lazy)
    assert output.SerializeToString() == apply_plans(model, index, made).SerializeToString()
    # Read after the rewrite, the nodes are the ones written, and the planner's own.
    assert [n.SerializeToString() for p in lazy for n in p.nodes] == [n.SerializeToString() for p in made for n in p.nodes]


def test_a_replayed_plan_changed_after_it_is_read_is_written_as_changed(monkeypatch):
    monkeypatch.delenv(MEMO_CHECK_ENV, raising=False)
    model = _step()
    index, matches = _matches(model)
    planner = Planner(index, function_opset(model))
    plans = [planner.plan(m) for m in matches]
    plans[3].sgd_node.doc_string = "changed by the caller"
    assert plans[3]._replay() is None
    output = apply_plans(model, index, plans)
    assert [n.doc_string for n in output.graph.node if n.name == plans[3].sgd_node.name] == ["changed by the caller"]
    # Setting one of the two fields makes the nodes first: the other keeps the nodes it would have had.
    other = plans[5]
    assert other._replay() is not None
    other.nodes = list(other.nodes)
    assert other.sgd_node is other.nodes[other.sgd_position()]


def test_a_replayed_plan_holds_what_the_dataclass_would_hold():
    # Planner._replayed fills a Plan's __dict__ without its __init__: the same keys in the same order and the
    # same values as Plan(...) given the same fields, and it compares equal to that plan.
    import dataclasses

    from sgdfuse.passes.rewrite import Plan

    index, matches = _matches(_step())
    planner = Planner(index, 18)
    plans = [planner.plan(match) for match in matches]
    replayed = [plan for plan in plans if plan._replay() is not None]
    assert replayed, "no plan was replayed"
    for plan in replayed:
        replay = plan._replay()
        direct = Plan(plan.match, replay, [], replay, plan.gradient_input, plan.learning_rate_input, plan.momentum_input, plan.stat)
        assert list(plan.__dict__) == list(direct.__dict__)
        assert all(plan.__dict__[k] is direct.__dict__[k] or plan.__dict__[k] == direct.__dict__[k] for k in direct.__dict__)
        assert [f.name for f in dataclasses.fields(plan)] == [f.name for f in dataclasses.fields(direct)]
        # (A dict sharing its keys with the other plans', as __init__'s: no larger than the dataclass's.)
        assert sys.getsizeof(plan.__dict__) <= sys.getsizeof(direct.__dict__)


def _renamed(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """``model`` with ``prefix`` before every value name (the graph's inputs, outputs, initializers, nodes)."""
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    graph = renamed.graph
    for node in graph.node:
        node.input[:] = [prefix + n if n else n for n in node.input]
        node.output[:] = [prefix + n for n in node.output]
    for info in [*graph.input, *graph.output, *graph.initializer]:
        info.name = prefix + info.name
    return renamed


WRITER_CASES = {**CASES, "long non-ASCII names": {"prefix": "\u00fcber/" * 30}}


@pytest.mark.parametrize("case", WRITER_CASES)
def test_the_native_node_writer_writes_what_protobuf_writes(case, monkeypatch):
    # _write_nodes serialises runs of replayed nodes natively (_splice.node_wires) and parses them into the
    # output; without it (or when it refuses a run) each node is written through protobuf (_Replay.write).
    # All three give the same bytes; names of 128 bytes and more take a two-byte length, non-ASCII ones UTF-8.
    from sgdfuse.passes import rewrite

    monkeypatch.delenv(MEMO_CHECK_ENV, raising=False)
    options = dict(WRITER_CASES[case])
    prefix = options.pop("prefix", "")
    model = _renamed(_step(**options), prefix) if prefix else _step(**options)
    index = build_index(model)
    matches, _ = find_updates(index, Normaliser(index))
    assert len(matches) == N

    replayed_nodes = []

    def output() -> bytes:
        planner = Planner(index, function_opset(model))
        plans = [planner.plan(m) for m in matches]
        replays = [plan._replay() for plan in plans if plan._replay() is not None]
        assert len(replays) == N - 1
        replayed_nodes.append(sum(len(replay.template.nodes) for replay in replays))
        return apply_plans(model, index, plans).SerializeToString()

    used = []
    real = rewrite._native_writer
    if real() is None:
        pytest.skip("the native node writer does not build here")

    def counted():
        wires = real()
        return lambda items: used.append(len(items)) or wires(items)

    monkeypatch.setattr(rewrite, "_native_writer", counted)
    native = output()
    assert sum(used) == replayed_nodes[-1], "every replayed node went through the native writer"

    def refusing():
        def wires(items):
            raise TypeError("refused")
        return wires

    monkeypatch.setattr(rewrite, "_native_writer", refusing)
    refused = output()
    monkeypatch.setattr(rewrite, "_native_writer", lambda: None)
    assert native == refused == output()
    if prefix:
        assert prefix.encode() in native
