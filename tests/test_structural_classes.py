"""Matching per structural class (sgdfuse.passes.classes): one member of each class is solved, the others are
renamed, and the result is the direct matcher's, update for update.

Each test builds a graph of several updates that differ in exactly one thing the matcher reads (a constant, a
name, an input order, a shape, a name that says which input an output replaces) and checks that the updates
land in different classes and that each gets its own solution, equal to solving it alone. Expected values
come from the graphs as written (the hyper-parameters each update was built with) and from the direct
matcher (``_find`` over the whole graph), never from the per-class path itself.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphs import F16, F32, bench_generator, make_model, scalar, value
from sgdfuse.passes import classes, sgd_match
from sgdfuse.passes.index import build_index
from sgdfuse.passes.linear import Normaliser
from sgdfuse.passes.sgd_match import RolePins, find_updates


def _update(k: int, *, lr: float = 0.1, m: float = 0.9, names: dict[str, str] | None = None, swap_add: bool = False,
            shape=(2, 3), dtype=F32, shared_lr: str | None = None):
    """One update ``buf_out = m*buf + g; p_out = p - lr*buf_out`` with names suffixed ``k`` (or as ``names``
    says), its scalars as its own rank-0 initializers (or ``shared_lr`` for the learning rate)."""
    n = {"p": f"p{k}", "g": f"g{k}", "buf": f"buf{k}", "p_out": f"p{k}_out", "buf_out": f"buf{k}_out"}
    n.update(names or {})
    lr_name = shared_lr or f"lr{k}"
    add_inputs = [n["g"], f"scaled{k}"] if swap_add else [f"scaled{k}", n["g"]]
    nodes = [
        helper.make_node("Mul", [n["buf"], f"m{k}"], [f"scaled{k}"]),
        helper.make_node("Add", add_inputs, [n["buf_out"]]),
        helper.make_node("Mul", [n["buf_out"], lr_name], [f"step{k}"]),
        helper.make_node("Sub", [n["p"], f"step{k}"], [n["p_out"]]),
    ]
    inputs = [value(n["p"], dtype, shape), value(n["g"], dtype, shape), value(n["buf"], dtype, shape)]
    outputs = [value(n["p_out"], dtype, shape), value(n["buf_out"], dtype, shape)]
    initializers = [scalar(f"m{k}", m, dtype)] + ([] if shared_lr else [scalar(lr_name, lr, dtype)])
    return nodes, inputs, outputs, initializers


def _model(*updates, extra_initializers=()):
    nodes, inputs, outputs, initializers = [], [], [], list(extra_initializers)
    for u in updates:
        nodes += u[0]
        inputs += u[1]
        outputs += u[2]
        initializers += u[3]
    return make_model(nodes, inputs, outputs, initializers)


def _direct(model, pins=None):
    index = build_index(model)
    return sgd_match._find(index, Normaliser(index), list(dict.fromkeys(index.graph_outputs)), pins or RolePins(), False, {})


def _by_class(model, pins=None):
    index = build_index(model)
    return find_updates(index, Normaliser(index), pins=pins)


def _plain(matches):
    return [
        (m.parameters, m.gradient, m.accum, m.parameters_out, m.accum_out, sgd_match.format_poly(m.learning_rate),
         sgd_match.format_poly(m.momentum), m.dampening, m.weight_decay, m.nesterov, sorted(m.nodes),
         str(m.parameter_equation), str(m.accum_equation), m.roles_from)
        for m in matches
    ]


def _no_name_facts(names, is_output):
    """Name facts that say nothing about any name: keys then tell structures apart only."""
    return [((), None, None)] * len(names)


def _keys(model):
    index = build_index(model)
    outputs = [o for o in dict.fromkeys(index.graph_outputs)]
    clusters = classes.clusters_of(index, outputs, _no_name_facts, lambda o: set())
    return {tuple(c.outputs): c.key for c in clusters}


def test_updates_identical_up_to_names_share_one_class_and_each_gets_its_own_names():
    model = _model(*(_update(k) for k in range(5)))
    keys = _keys(model)
    assert len(keys) == 5 and len(set(keys.values())) == 1
    found, refused = _by_class(model)
    assert not refused
    assert [(m.parameters, m.gradient, m.accum, m.parameters_out, m.accum_out) for m in found] == [
        (f"p{k}", f"g{k}", f"buf{k}", f"p{k}_out", f"buf{k}_out") for k in range(5)
    ]
    assert [str(m.parameter_equation) for m in found] == [f"p{k}_out = p{k} - 0.1*buf{k}_out" for k in range(5)]
    assert _plain(found) == _plain(_direct(model)[0])


def test_nodes_of_each_member_are_its_own():
    model = _model(*(_update(k) for k in range(3)))
    found, _ = _by_class(model)
    for k, match in enumerate(found):
        written = {o for i in match.nodes for o in model.graph.node[i].output}
        assert written == {f"scaled{k}", f"buf{k}_out", f"step{k}", f"p{k}_out"}


@pytest.mark.parametrize(
    "variant",
    [
        {"lr": 0.05},
        {"m": 0.8},
        {"swap_add": True},
        {"shape": (4,)},
        {"dtype": F16},
    ],
    ids=["learning-rate", "momentum", "input-order", "shape", "dtype"],
)
def test_a_difference_the_matcher_reads_makes_another_class(variant):
    model = _model(_update(0), _update(1), _update(2, **variant))
    keys = _keys(model)
    assert keys[("p0_out", "buf0_out")] == keys[("p1_out", "buf1_out")]
    assert keys[("p2_out", "buf2_out")] != keys[("p0_out", "buf0_out")]
    found, refused = _by_class(model)
    assert not refused and len(found) == 3
    expected_lr = variant.get("lr", 0.1)
    expected_m = variant.get("m", 0.9)
    dtype = np.float16 if variant.get("dtype") == F16 else np.float32
    assert found[2].learning_rate.constant_value == pytest.approx(float(dtype(expected_lr)))
    assert found[2].momentum.constant_value == pytest.approx(float(dtype(expected_m)))
    assert found[0].learning_rate.constant_value == pytest.approx(float(np.float32(0.1)))
    assert _plain(found) == _plain(_direct(model)[0])


def test_names_that_decide_roles_are_part_of_the_class():
    # buf' = 0.9*buf + g also reads as "accum = g, momentum 1, dampening 0.1"; with both fed from outside,
    # names decide. The two updates have the same structure and the same name order; only update 0's names
    # follow the conventions (m_buf0, m_grad0), update 1's do not (m_bxf1, m_grxd1).
    zero = _update(0, names={"buf": "m_buf0", "g": "m_grad0"})
    one = _update(1, names={"buf": "m_bxf1", "g": "m_grxd1"})
    model = _model(zero, one)
    assert len(set(_keys(model).values())) == 1  # without name facts: one structure
    index = build_index(model)
    real = classes.clusters_of(index, list(index.graph_outputs), _real_name_facts(index), lambda o: set())
    assert real[0].key != real[1].key
    found, refused = _by_class(model)
    assert _plain(found) == _plain(_direct(model)[0])
    by_output = {m.parameters_out: m for m in found}
    assert (by_output["p0_out"].accum, by_output["p0_out"].roles_from) == ("m_buf0", "conventions")
    assert (by_output["p1_out"].accum, by_output["p1_out"].roles_from) == ("m_bxf1", "plausibility")


def _real_name_facts(index, pins=RolePins()):
    return sgd_match.name_facts_of(index, pins, {})


def test_an_output_named_as_the_next_value_elsewhere_is_refused_as_directly():
    # Update 1 reads p1, but another output (computed apart from it) is named p1_out: the in-place write would
    # hit the wrong value. Updates 0 and 2 are the same structure with honest names.
    one = _update(1, names={"p_out": "w1_next"})
    decoy = (
        [helper.make_node("Mul", ["q1", "two1"], ["p1_out"])],
        [value("q1")],
        [value("p1_out")],
        [scalar("two1", 2.0)],
    )
    model = _model(_update(0), one, _update(2), decoy)
    found, refused = _by_class(model)
    direct_found, direct_refused = _direct(model)
    assert _plain(found) == _plain(direct_found)
    assert sorted((r.candidate, r.reason, r.detail) for r in refused) == sorted((r.candidate, r.reason, r.detail) for r in direct_refused)
    assert "w1_next" not in {m.parameters_out for m in found}
    assert {m.parameters_out for m in found} == {"p0_out", "p2_out"}


def test_a_refused_class_names_each_member_in_its_own_words():
    # Momentum-free updates (q_out = q - lr*g): refused, each with its own names in the message.
    def plain(k):
        return (
            [helper.make_node("Mul", [f"gq{k}", f"lrq{k}"], [f"sq{k}"]), helper.make_node("Sub", [f"q{k}", f"sq{k}"], [f"q{k}_out"])],
            [value(f"q{k}"), value(f"gq{k}")],
            [value(f"q{k}_out")],
            [scalar(f"lrq{k}", 0.1)],
        )

    model = _model(plain(0), plain(1), plain(2), _update(3))
    found, refused = _by_class(model)
    direct_found, direct_refused = _direct(model)
    assert _plain(found) == _plain(direct_found)
    assert [(r.candidate, r.reason, r.detail, str(r.equation)) for r in refused] == [
        (r.candidate, r.reason, r.detail, str(r.equation)) for r in direct_refused
    ]
    assert [r.candidate for r in refused] == ["q0_out", "q1_out", "q2_out"]
    assert all(f"q{k}" in r.detail for k, r in enumerate(refused))


def test_a_shared_learning_rate_input_is_keyed_by_name_and_links_nothing():
    lr = value("lr", F32, [])
    updates = [_update(k, shared_lr="lr") for k in range(6)]
    updates[0][1].append(lr)
    model = _model(*updates)
    keys = _keys(model)
    assert len(keys) == 6 and len(set(keys.values())) == 1
    found, _ = _by_class(model)
    assert [sgd_match.format_poly(m.learning_rate) for m in found] == ["lr"] * 6
    assert _plain(found) == _plain(_direct(model)[0])


def test_pins_are_part_of_the_class():
    model = _model(*(_update(k, names={"buf": f"b{k}", "g": f"h{k}", "buf_out": f"nb{k}"}) for k in range(3)))
    pins = RolePins(state={"nb1": "h1"})
    found, refused = _by_class(model, pins)
    direct_found, direct_refused = _direct(model, pins)
    assert _plain(found) == _plain(direct_found)
    assert sorted((r.candidate, r.reason) for r in refused) == sorted((r.candidate, r.reason) for r in direct_refused)
    by_output = {m.parameters_out: m for m in found}
    assert "p1_out" not in by_output or by_output["p1_out"].accum == "h1"


def test_first_step_selection_is_solved_directly():
    # A Where on a first-step flag: outside what the key captures, so solved directly, with the same result.
    def first_step(k):
        nodes = [
            helper.make_node("Mul", [f"buf{k}", f"m{k}"], [f"scaled{k}"]),
            helper.make_node("Add", [f"scaled{k}", f"g{k}"], [f"later{k}"]),
            helper.make_node("Where", ["first", f"g{k}", f"later{k}"], [f"buf{k}_out"]),
            helper.make_node("Mul", [f"buf{k}_out", f"lr{k}"], [f"step{k}"]),
            helper.make_node("Sub", [f"p{k}", f"step{k}"], [f"p{k}_out"]),
        ]
        return nodes, [value(f"p{k}"), value(f"g{k}"), value(f"buf{k}")], [value(f"p{k}_out"), value(f"buf{k}_out")], [scalar(f"m{k}", 0.9), scalar(f"lr{k}", 0.1)]

    updates = [first_step(k) for k in range(2)]
    updates[0][1].append(value("first", TensorProto.BOOL, []))
    model = _model(*updates)
    index = build_index(model)
    clusters = classes.clusters_of(index, list(index.graph_outputs), _no_name_facts, lambda o: set())
    assert all(c.key is None for c in clusters)
    found, _ = _by_class(model)
    assert _plain(found) == _plain(_direct(model)[0]) and len(found) == 2
    assert all(m.first_step is not None for m in found)


def test_bench_style_graph_matches_the_direct_matcher(monkeypatch):
    """Many updates of the exporters' three families, as bench/generate.py writes them: the per-class result is
    the direct one (the check mode solves every member both ways)."""
    model, _ = bench_generator().build(300, seed=3)
    monkeypatch.setenv(sgd_match.MEMO_CHECK_ENV, "1")
    index = build_index(model)
    found, refused = find_updates(index, Normaliser(index))
    assert len(found) == 300


def test_a_schedule_output_of_the_shared_learning_rate_keeps_classes_and_results():
    # lr_next = lr*0.99 is an output computed from the shared learning rate alone: it goes along with every
    # cluster as a keyed extra; the updates still share one class and each fuses as directly.
    updates = [_update(k, shared_lr="lr") for k in range(6)]
    updates[0][1].append(value("lr", F32, []))
    schedule = ([helper.make_node("Mul", ["lr", "gamma"], ["lr_next"])], [], [value("lr_next", F32, [])], [scalar("gamma", 0.99)])
    model = _model(*updates, schedule)
    index = build_index(model)
    normaliser = Normaliser(index)
    clusters = classes.clusters_of(
        index, list(index.graph_outputs), sgd_match.name_facts_of(index, RolePins(), {}), lambda o: set(normaliser.form(o)) - {""}
    )
    keyed = [c for c in clusters if c.key is not None]
    assert len(keyed) == 6 and len({c.key for c in keyed}) == 1
    assert all(c.extras == ["lr_next"] for c in keyed)
    found, refused = _by_class(model)
    direct_found, direct_refused = _direct(model)
    assert _plain(found) == _plain(direct_found) and len(found) == 6
    assert sorted((r.candidate, r.reason) for r in refused) == sorted((r.candidate, r.reason) for r in direct_refused)


def test_a_one_element_state_shared_by_many_updates_is_written_once():
    # Six updates read the same one-element "parameters" p (read by more than four regions, so it links no
    # clusters): each alone is an update of p, but only one may write p in place.
    def update(k):
        nodes = [
            helper.make_node("Mul", [f"buf{k}", f"m{k}"], [f"scaled{k}"]),
            helper.make_node("Add", [f"scaled{k}", f"g{k}"], [f"buf{k}_out"]),
            helper.make_node("Mul", [f"buf{k}_out", f"lr{k}"], [f"step{k}"]),
            helper.make_node("Sub", ["p", f"step{k}"], [f"q{k}"]),
        ]
        inputs = [value(f"g{k}", F32, [1]), value(f"buf{k}", F32, [1])]
        return nodes, inputs, [value(f"q{k}", F32, [1]), value(f"buf{k}_out", F32, [1])], [scalar(f"m{k}", 0.9), scalar(f"lr{k}", 0.1)]

    updates = [update(k) for k in range(6)]
    updates[0][1].append(value("p", F32, [1]))
    model = _model(*updates)
    found, refused = _by_class(model)
    writers = [m for m in found if m.parameters == "p"]
    assert len(writers) <= 1
    assert {r.reason for r in refused if r.candidate.startswith("q")} <= {"shared-state"}
