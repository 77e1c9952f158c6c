"""Verification per class (``sgdfuse.verify.verify_plans`` from ``CLASS_MIN_PLANS`` plans on): updates whose
slices are identical up to value names share one run, and a wrong rewrite is still caught wherever it is.

The models are built here: N plain momentum-SGD updates ``buf' = 0.9*buf + g; p' = p - lr*buf'`` over [2, 3]
tensors, each with its own names; the wrong plans are made here by changing one SGD node's dampening
attribute (the original has none, so the fused op computes another buffer).
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
from sgdfuse.passes.rewrite import Planner  # noqa: E402
from sgdfuse.verify import CLASS_MIN_PLANS  # noqa: E402

N = 80


def _updates(n: int, lr_of=lambda i: "lr_a", shape_of=lambda i: graphs.SHAPE) -> onnx.ModelProto:
    nodes, inputs, outputs = [], [], []
    initializers = [graphs.scalar("m", 0.9), graphs.scalar("lr_a", 0.1), graphs.scalar("lr_b", 0.01)]
    for i in range(n):
        nodes += [
            helper.make_node("Mul", [f"buf{i}", "m"], [f"scaled{i}"]),
            helper.make_node("Add", [f"scaled{i}", f"g{i}"], [f"buf{i}_out"]),
            helper.make_node("Mul", [f"buf{i}_out", lr_of(i)], [f"step{i}"]),
            helper.make_node("Sub", [f"p{i}", f"step{i}"], [f"p{i}_out"]),
        ]
        shape = shape_of(i)
        inputs += [graphs.value(f"p{i}", shape=shape), graphs.value(f"g{i}", shape=shape), graphs.value(f"buf{i}", shape=shape)]
        outputs += [graphs.value(f"p{i}_out", shape=shape), graphs.value(f"buf{i}_out", shape=shape)]
    return graphs.make_model(nodes, inputs, outputs, initializers)


def _with_dampening(plan, value: float):
    kept = [a for a in plan.sgd_node.attribute if a.name != "dampening"]
    del plan.sgd_node.attribute[:]
    plan.sgd_node.attribute.extend(kept + [helper.make_attribute("dampening", value)])
    return plan


def _wrong_planner(wrong: set[str], dampening: float = 1e-3):
    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            return _with_dampening(plan, dampening) if match.parameters_out in wrong else plan

    return WrongPlanner


def test_the_model_is_large_enough_to_be_verified_per_class():
    assert N >= CLASS_MIN_PLANS


@pytest.mark.parametrize("wrong", [{"p37_out"}, {"p0_out"}, {"p5_out", "p61_out"}])
def test_a_wrong_rewrite_among_identical_updates_is_refused_and_only_it(monkeypatch, wrong):
    monkeypatch.setattr(api, "Planner", _wrong_planner(wrong))
    report = api.optimize(_updates(N)).report
    assert sorted(f.parameters_out for f in report.fused) == sorted(f"p{i}_out" for i in range(N) if f"p{i}_out" not in wrong)
    assert {(r.candidate, r.reason) for r in report.refused} == {(name, "verification-failed") for name in wrong}
    shared = [u for u in report.verification.updates if u["verified_as"]]
    assert shared, "the identical updates share a run"
    assert all(u["passed"] for u in shared)


def test_every_member_of_a_wrong_class_is_refused(monkeypatch):
    wrong = {f"p{i}_out" for i in range(N)}
    monkeypatch.setattr(api, "Planner", _wrong_planner(wrong))
    report = api.optimize(_updates(N)).report
    assert report.fused == []
    assert len(report.refused) == N and {r.reason for r in report.refused} == {"verification-failed"}


def test_updates_differing_in_a_constant_or_a_shape_are_run_each_in_their_own_class():
    model = _updates(N, lr_of=lambda i: "lr_b" if i % 10 == 3 else "lr_a", shape_of=lambda i: [4] if i % 10 == 7 else graphs.SHAPE)
    report = api.optimize(model).report
    checks = {u["parameters_out"]: u for u in report.verification.updates}
    assert len(checks) == N and all(u["passed"] for u in checks.values())
    for i, j in ((3, 13), (7, 17), (0, 1)):
        # Two members of one class: one of them at most shares the other's run, never one of another class.
        a, b = checks[f"p{i}_out"], checks[f"p{j}_out"]
        for check in (a, b):
            if check["verified_as"]:
                k = int(check["verified_as"][1:].split("_")[0])
                assert (k % 10 == 3) == (i % 10 == 3) and (k % 10 == 7) == (i % 10 == 7), (check, i)
    run = [name for name, u in checks.items() if not u["verified_as"]]
    classes = {("b" if int(n[1:-4]) % 10 == 3 else "s" if int(n[1:-4]) % 10 == 7 else "a") for n in run}
    assert classes == {"a", "b", "s"}


def _wrong_learning_rate_planner(wrong: set[str]):
    """A planner that feeds the listed updates' SGD nodes a learning rate of 0.2 instead of the graph's 0.1: a
    rewrite whose attributes and overload agree (so only running it shows it is wrong)."""

    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            if match.parameters_out not in wrong:
                return plan
            name = f"wrong_lr_{match.parameters_out}"
            plan.sgd_node.input[2] = name
            plan.initializers.append(graphs.scalar(name, 0.2))
            return plan

    return WrongPlanner


@pytest.mark.parametrize("wrong", [{"p37_out"}, {"p0_out"}, {"p5_out", "p61_out"}])
def test_a_consistent_wrong_rewrite_in_a_matcher_class_is_run_and_refused(monkeypatch, wrong):
    # The 80 updates are one structural class of the matcher: the wrong plans' own nodes differ from the
    # others', so they are run, whoever the class's first member is.
    monkeypatch.setattr(api, "Planner", _wrong_learning_rate_planner(wrong))
    report = api.optimize(_updates(N)).report
    assert sorted(f.parameters_out for f in report.fused) == sorted(f"p{i}_out" for i in range(N) if f"p{i}_out" not in wrong)
    assert {(r.candidate, r.reason) for r in report.refused} == {(name, "verification-failed") for name in wrong}
    assert any(u["verified_as"] for u in report.verification.updates), "the identical updates share a run"


def test_an_omitted_input_and_an_omitted_output_are_different_nodes_to_the_class_key():
    # Dropout(x, "") -> y and Dropout(x) -> ("", y) read and write other slots, but their values lists (inputs,
    # separator, outputs, an omitted name numbered -1 like the separator) were equal, so a member whose node had
    # moved a slot could take the result of a class member it does not compute like (a helper's finding).
    from sgdfuse.passes.index import build_index
    from sgdfuse.verify import _describe_parts, _Parts

    def described(node):
        graph = helper.make_graph([node], "g", [graphs.value("x")], [graphs.value("y")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])  # not checked: a slot test
        parts = _Parts([node], [], ["y"], list(model.opset_import), None, inputs=["x"])
        return _describe_parts(parts, build_index(model, infer_shapes=False).spec, {})

    first = described(helper.make_node("Dropout", ["x", ""], ["y"]))
    second = described(helper.make_node("Dropout", ["x"], ["", "y"]))
    assert first != second
    assert described(helper.make_node("Dropout", ["x", ""], ["y"])) == first  # and the same node keys alike
