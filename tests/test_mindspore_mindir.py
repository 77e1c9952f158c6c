"""MindIR files (sgdfuse.mindspore.optimize_mindir) on the exported mint.optim.SGD train steps in
testdata/mindspore/ (made by MindSpore's own export, see make_mindir.py). The oracle for what must fuse is
testdata/mindspore/manifest.json, written from the export configuration; the oracle for the numbers is
MindSpore running the original file (``mindspore.load`` + ``nn.GraphCell``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed here (CI installs .[test,mindspore])")

from typer.testing import CliRunner  # noqa: E402

from sgdfuse.cli import app  # noqa: E402
from sgdfuse.mindspore import check_mindir, load_mindir, optimize_mindir, save_mindir  # noqa: E402
from sgdfuse.mindspore import mindir as mindir_module  # noqa: E402
from sgdfuse.mindspore.errors import MindIRLoadError  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "testdata" / "mindspore"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
FILES = sorted(MANIFEST)


def _ops(model, graph=None) -> list[str]:
    prims = {p.name: p.op_type for p in model.primitives}
    graph = graph if graph is not None else model.graph
    return [prims.get(n.op_type[5:], "call") for n in graph.node if n.op_type.startswith("REF::")]


def _all_ops(model) -> list[str]:
    return [op for g in [model.graph, *model.functions] for op in _ops(model, g)]


def _sgd_runs_per_step(model) -> int:
    """SGD nodes executed per step: in the main graph, plus those in a function once per call of it."""
    calls = {}
    for g in [model.graph, *model.functions]:
        for n in g.node:
            calls[n.op_type[5:]] = calls.get(n.op_type[5:], 0) + 1
    return _ops(model).count("SGD") + sum(_ops(model, f).count("SGD") * calls.get(f.name, 0) for f in model.functions)


@pytest.mark.parametrize("name", FILES)
def test_every_update_of_the_exported_train_step_fuses_as_the_manifest_says(name):
    expected = MANIFEST[name]
    model, report = optimize_mindir(DATA / name, steps=4)
    assert not report.refused
    assert sorted(u.parameters for u in report.fused) == sorted("opt." + p for p in expected["parameters"])
    for update in report.fused:
        param = update.parameters.removeprefix("opt.")
        assert update.accum == "opt." + expected["buffers"][param]
        assert update.learning_rate == pytest.approx(expected["lr"], rel=1e-7)
        assert update.momentum == pytest.approx(expected["momentum"], rel=1e-7)
        assert update.dampening == pytest.approx(expected["dampening"], abs=1e-7)
        assert update.weight_decay == pytest.approx(expected["weight_decay"], rel=1e-7)
        assert update.nesterov is expected["nesterov"]
        assert update.dtype == "FLOAT"
    assert report.verification.enabled and report.verification.passed and report.verification.steps == 4
    ops = _all_ops(model)
    assert _sgd_runs_per_step(model) == len(expected["parameters"])
    assert not {"Switch", "Partial", "InplaceCopy", "InplaceMuls"} & set(ops), "a branch or its ops survived"
    assert ops.count("InplaceAddExt") == 1  # only the step counter's increment is left
    assert not any("run_optim_sgd_opt" in f.name for f in model.functions), "the branch functions must be gone"
    assert report.nodes_after < report.nodes_before


@pytest.mark.parametrize("name", FILES)
def test_rewritten_file_trains_like_the_original_for_several_steps(name, tmp_path):
    model, _ = optimize_mindir(DATA / name, verify=False)
    out = tmp_path / "fused.mindir"
    save_mindir(model, out)
    result = check_mindir(DATA / name, out, steps=5, seed=3)
    compared = {v["name"] for v in result.values}
    params = MANIFEST[name]["parameters"]
    assert compared >= {"output 0", "opt.step_t"} | {f"opt.{p}" for p in params} | {f"opt.momentum_buf.{p}" for p in params}
    assert result.passed, [v for v in result.values if not v["passed"]]


def test_the_check_catches_a_wrong_dampening(tmp_path):
    """The check is sensitive: the rewritten file with a tampered SGD attribute must fail it."""
    model, _ = optimize_mindir(DATA / "train_step_sgd.mindir", verify=False)
    for prim in model.primitives:
        if prim.op_type == "SGD":
            for attribute in prim.attribute:
                if attribute.name == "dampening":
                    attribute.f = 0.5
    result = check_mindir(DATA / "train_step_sgd.mindir", model, steps=3)
    failed = {v["name"] for v in result.values if not v["passed"]}
    assert not result.passed and "opt.momentum_buf.l1.weight" in failed and "output 0" in failed


def test_a_rewrite_failing_its_check_returns_the_original_and_refuses(monkeypatch):
    original_match = mindir_module._match

    def wrong_dampening(*args, **kwargs):
        outcome = original_match(*args, **kwargs)
        if isinstance(outcome, mindir_module._Plan):
            outcome.dampening = 0.5
        return outcome

    monkeypatch.setattr(mindir_module, "_match", wrong_dampening)
    source, _ = load_mindir(DATA / "train_step_sgd.mindir")
    model, report = optimize_mindir(source, steps=2)
    assert not report.fused and len(report.refused) == 4
    assert {r.reason for r in report.refused} == {"verification-failed"}
    assert model.SerializeToString() == source.SerializeToString()


def test_a_condition_other_than_step_t_equals_zero_is_refused_with_its_reason():
    source, _ = load_mindir(DATA / "train_step_sgd.mindir")
    index = mindir_module._Index(source.graph, source)
    eq = next(n for n in source.graph.node if index.op(n) == "EqScalar")
    one = source.graph.node.add(name="one", op_type="Constant")
    one.output.append("one")
    one.attribute.add(name="value", type=7, i=1)
    eq.input[1] = "one"
    model, report = optimize_mindir(source, verify=False)
    assert not report.fused and len(report.refused) == 4
    assert {r.reason for r in report.refused} == {"condition"}
    assert "step_t == 0" in report.refused[0].detail
    assert _all_ops(model).count("Switch") == 4


def test_the_input_model_is_never_mutated():
    source, _ = load_mindir(DATA / "train_step_nesterov.mindir")
    before = source.SerializeToString()
    optimize_mindir(source, verify=False)
    assert source.SerializeToString() == before


def test_bytes_in_give_the_same_rewrite_as_the_path():
    by_path, _ = optimize_mindir(DATA / "train_step_sgd.mindir", verify=False)
    by_bytes, report = optimize_mindir((DATA / "train_step_sgd.mindir").read_bytes(), verify=False)
    assert by_bytes.SerializeToString() == by_path.SerializeToString() and report.source == "<bytes>"


def test_a_file_that_is_not_mindir_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.mindir"
    junk.write_bytes(b"\x00\x01not a protobuf\xff" * 3)
    with pytest.raises(MindIRLoadError, match="junk.mindir"):
        optimize_mindir(junk)
    with pytest.raises(MindIRLoadError, match="no such file"):
        optimize_mindir(tmp_path / "missing.mindir")


def test_cli_optimize_dispatches_mindir_files(tmp_path):
    out = tmp_path / "out.mindir"
    report = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["optimize", str(DATA / "train_step_sgd.mindir"), "-o", str(out), "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and "Wrote" in result.output
    data = json.loads(report.read_text())
    assert len(data["fused"]) == 4 and data["verification"]["passed"]
    fused, _ = load_mindir(out)
    assert _ops(fused).count("SGD") == 4


def test_cli_default_output_sits_beside_the_mindir(tmp_path):
    source = tmp_path / "step.mindir"
    source.write_bytes((DATA / "train_step_sgd.mindir").read_bytes())
    result = CliRunner().invoke(app, ["optimize", str(source), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "step.sgdfused.mindir").is_file()


def test_the_check_compiles_both_files_without_the_registered_pass():
    """The check must compare the original file as exported, never a copy the registered compile-pipeline
    pass fused on load (it would compare the rewrite with itself). MindSpore 2.10 runs no FULL_GRAPH pass on
    GraphCell graphs, and the check also pauses the pass: either way the pass writes no record here."""
    from sgdfuse.mindspore import register

    registration = register("cpu")
    before = len(registration.records())
    model, _ = optimize_mindir(DATA / "train_step_nesterov.mindir", verify=False)
    assert check_mindir(DATA / "train_step_nesterov.mindir", model, steps=2).passed
    assert len(registration.records()) == before


@pytest.mark.parametrize("name", FILES)
def test_each_sgd_reads_a_buffer_zeroed_on_the_first_step(name):
    """mint's first step is buf = grad whatever buf holds (a restarted step_t, buffers restored without it);
    the contract with stat = 1 computes accum*m + grad. So each SGD must follow
    Assign(buf, MaskedFill(Load(buf, U), step_t == 0, 0), U), with the mask and stat from one condition."""
    import numpy as np

    model, _ = optimize_mindir(DATA / name, verify=False)
    prims = {p.name: p.op_type for p in model.primitives}

    def op(node) -> str:
        return prims.get(node.op_type[5:], "call") if node.op_type.startswith("REF::") else node.op_type

    seen = 0
    for graph in [model.graph, *model.functions]:
        producer = {(n.output[0] if n.output else n.name): n for n in graph.node}
        for sgd in (n for n in graph.node if op(n) == "SGD"):
            seen += 1
            _, _, _, buf, _, stat, monad = sgd.input
            ordered = producer[monad]
            assert op(ordered) == "UpdateState"
            u, assign_name = ordered.input
            assign = producer[assign_name]
            assert op(assign) == "Assign" and assign.input[0] == buf and assign.input[2] == u
            fill = producer[assign.input[1]]
            assert op(fill) == "MaskedFill"
            load = producer[fill.input[0]]
            assert op(load) == "Load" and list(load.input) == [buf, u]
            zero = producer[fill.input[2]].attribute[0].tensors[0]
            assert not np.frombuffer(zero.raw_data, np.float32).any()
            mask, stat_cast = producer[fill.input[1]], producer[producer[stat].input[0]]
            assert op(mask) == op(stat_cast) == "Cast" and mask.input[0] == stat_cast.input[0]
            assert op(producer[mask.input[0]]) == "EqScalar"
    assert seen > 0


def test_a_callers_weight_decay_stays_in_the_gradient_when_the_weight_is_also_written():
    """In the shared-function file the callers compute grad + wd*w; the SGD op would read w when it runs.
    Once something else in the step writes one of those weights, folding the term would read w after that
    write: the term stays in the gradient (weight_decay 0) for every parameter of that shared function."""
    source, _ = load_mindir(DATA / "train_step_shared.mindir")
    index = mindir_module._Index(source.graph, source)
    weight = next(p.name for p in source.graph.parameter if p.name.endswith("opt.body.0.weight"))
    load = next(u for u, position in index.users[weight] if index.op(u) == "Load")
    assign_prim = source.primitives.add(name="Assign:test", op_type="Assign", prim_type=2)
    assign_prim.attribute.add(name="side_effect_mem", type=9, i=1)
    write = source.graph.node.add(name="user_write", op_type="REF::Assign:test")
    write.output.append("user_write")
    write.input.extend([weight, load.output[0], load.input[1]])  # w <- w, ordered like the Load: a write all the same
    _, baseline = optimize_mindir(DATA / "train_step_shared.mindir", verify=False)
    _, report = optimize_mindir(source, verify=False)
    before = {u.parameters.removeprefix("opt."): u for u in baseline.fused}
    after = {u.parameters.removeprefix("opt."): u for u in report.fused}
    assert before["body.0.weight"].weight_decay == pytest.approx(1e-4, rel=1e-6)
    assert after.keys() == before.keys(), "still fused, with the term in the gradient"
    assert after["body.0.weight"].weight_decay == 0.0
