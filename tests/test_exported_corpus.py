"""Real framework exports (Keras/tf2onnx, JAX/optax/jax2onnx, PyTorch with default names) against the
framework's own numbers.

``testdata/{keras,jax,torch_default_names}`` each hold ONNX training steps, a ``manifest.json`` and, per
model, an ``.npz`` of the inputs and the eager framework's outputs for three chained steps (written by
the generators in ``testdata/``; layout: ``s{step}_in_{i}`` is ``inputs[i]`` fed at step 1..3,
``s{step}_out_{j}`` is ``outputs[j]`` as the framework computed it). The manifest is the oracle: which
graph inputs/outputs are each update's parameter, gradient and momentum buffer, and the framework's
hyper-parameters. No framework is needed here.

What is pinned:

- every committed model loads, passes the full ONNX checker, and onnxruntime reproduces the framework's
  outputs over the three chained steps;
- ``sgdfuse.optimize`` never fuses wrongly: every fused update has the manifest's roles and the
  framework's hyper-parameters, and the fused model, run with the fused updates writing their parameter
  and buffer in place (as the ``SGD`` operator does), gives the framework's numbers over three steps;
  an update that is not fused must be reported refused with a reason.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import sgdfuse.api as api

TESTDATA = Path(__file__).resolve().parent.parent / "testdata"
FOLDERS = ("keras", "jax", "torch_default_names")
MANIFESTS = {folder: json.loads((TESTDATA / folder / "manifest.json").read_text()) for folder in FOLDERS}
ENTRIES = [(folder, entry) for folder in FOLDERS for entry in MANIFESTS[folder]["models"]]
ALL = [pytest.param(folder, entry, id=f"{folder}/{entry['file'][:-len('.onnx')]}") for folder, entry in ENTRIES]
STEPS = 3

# Tolerance between two float32 computations of the same step (onnxruntime vs the framework, fused vs
# the framework). Each output element is the result of at most a few dozen float32 roundings per step
# (a product over at most 16 terms, the loss, a handful of elementwise update operations), done in a
# different order by each side, over three chained steps; 64 float32 ulps of the element plus 64 ulps of
# the largest element of the same array bound that with room to spare (the generators saw at most 3.5
# ulps of the largest element). A wrongly fused update (a wrong sign, a wrong learning rate or momentum,
# a buffer that is not written back) moves values far more, unless float32 itself cannot see the change.
ULPS = 64
EPS32 = float(np.finfo(np.float32).eps)
# Hyper-parameters are float32 constants in the graphs, compared relative to the framework's Python values.
HYPER_RTOL = 1e-6


def _allowed(expected: np.ndarray) -> np.ndarray:
    e = np.abs(expected.astype(np.float64))
    return ULPS * EPS32 * (e + (float(e.max()) if e.size else 0.0))


def _assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    allowed = _allowed(expected)
    worst = int(np.argmax(diff - allowed))
    if not np.all(diff <= allowed):
        pytest.fail(
            f"{what}: differs from the framework by {diff.flat[worst]:.3g} at flat index {worst} "
            f"(allowed {allowed.flat[worst]:.3g}; framework value {expected.flat[worst]:.9g}, got {actual.flat[worst]:.9g})",
            pytrace=False,
        )


@functools.lru_cache(maxsize=None)
def _data(folder: str, file: str) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    entry = next(e for e in MANIFESTS[folder]["models"] if e["file"] == file)
    with np.load(TESTDATA / folder / entry["data"]) as arrays:
        return [
            (
                {name: arrays[f"s{s}_in_{i}"] for i, name in enumerate(entry["inputs"])},
                {name: arrays[f"s{s}_out_{j}"] for j, name in enumerate(entry["outputs"])},
            )
            for s in range(1, STEPS + 1)
        ]


@functools.lru_cache(maxsize=None)
def _optimized(folder: str, file: str) -> api.OptimizeResult:
    return api.optimize(TESTDATA / folder / file)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _by_parameter_out(entry: dict) -> dict[str, dict]:
    return {u["parameter_out"]: u for u in entry["updates"]}


@pytest.mark.parametrize("folder", FOLDERS)
def test_manifest_lists_every_committed_model_with_its_data(folder):
    directory = TESTDATA / folder
    on_disk = sorted(p.name for p in directory.glob("*.onnx") if not p.name.endswith(".sgdfused.onnx"))
    entries = MANIFESTS[folder]["models"]
    assert sorted(e["file"] for e in entries) == on_disk
    assert on_disk
    for entry in entries:
        assert (directory / entry["data"]).is_file()
        assert entry["expected_momentum_updates"] == len(entry["updates"]) > 0
        for update in entry["updates"]:
            assert update["parameter"] in entry["inputs"] and update["momentum_buffer"] in entry["inputs"]
            assert update["parameter_out"] in entry["outputs"] and update["momentum_buffer_out"] in entry["outputs"]
            assert entry["state"][update["parameter_out"]] == update["parameter"]
            assert entry["state"][update["momentum_buffer_out"]] == update["momentum_buffer"]


@pytest.mark.parametrize("folder, entry", ALL)
def test_committed_model_passes_the_full_checker(folder, entry):
    model = onnx.load(TESTDATA / folder / entry["file"])
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == entry["inputs"]
    assert [o.name for o in model.graph.output] == entry["outputs"]


@pytest.mark.parametrize("folder, entry", ALL)
def test_committed_data_chains_the_framework_steps(folder, entry):
    # Step s + 1 was fed the framework's own new parameters and buffers of step s.
    steps = _data(folder, entry["file"])
    for (_, outputs), (inputs, _) in zip(steps, steps[1:]):
        for output, state_input in entry["state"].items():
            np.testing.assert_array_equal(inputs[state_input], outputs[output])


@pytest.mark.parametrize("folder, entry", ALL)
def test_onnxruntime_reproduces_the_framework_over_three_chained_steps(folder, entry):
    session = _session(onnx.load(TESTDATA / folder / entry["file"]))
    names = entry["outputs"]
    feeds = dict(_data(folder, entry["file"])[0][0])
    for step, (inputs, expected) in enumerate(_data(folder, entry["file"]), start=1):
        if step > 1:
            feeds = dict(inputs) | {entry["state"][o]: got[o] for o in entry["state"]}  # noqa: F821
        got = dict(zip(names, session.run(names, feeds)))
        for name in names:
            _assert_close(got[name], expected[name], f"{entry['file']}: {name} at step {step}")


@pytest.mark.parametrize("folder, entry", ALL)
def test_every_update_is_fused_or_refused_with_a_reason(folder, entry):
    report = _optimized(folder, entry["file"]).report
    fused = {f.parameters_out for f in report.fused}
    refused = {r.candidate: r for r in report.refused}
    for update in entry["updates"]:
        name = update["parameter_out"]
        assert name in fused or name in refused, f"{entry['file']}: update of {name} neither fused nor refused"
        if name in refused:
            assert refused[name].reason and refused[name].detail


@pytest.mark.parametrize("folder, entry", ALL)
def test_fused_updates_have_the_manifest_roles(folder, entry):
    # The SGD operator overwrites its parameters and accum inputs: a fused update must read and write the
    # framework's own parameter and momentum buffer, not some other tensor with the same numbers.
    expected = _by_parameter_out(entry)
    for fused in _optimized(folder, entry["file"]).report.fused:
        assert fused.parameters_out in expected, f"{entry['file']}: fused {fused.parameters_out}, not a parameter update"
        want = expected[fused.parameters_out]
        got = (fused.parameters, fused.accum, fused.accum_out)
        assert got == (want["parameter"], want["momentum_buffer"], want["momentum_buffer_out"]), (
            f"{entry['file']}: fused {fused.parameters_out} as (parameter, buffer, buffer out) {got}"
        )
        if want["gradient"] is not None and "sgd_operator" not in want:
            assert fused.gradient == want["gradient"], fused


def _expected_operator_hyperparameters(update: dict) -> dict:
    # Keras's velocity form m' = mu*m - lr*g, w' = w + m' keeps its slot as the operator's accum only with
    # gradient lr*g, maximize and learning rate -1 (see the manifest's notes); the others are PyTorch's form.
    if "sgd_operator" in update:
        return update["sgd_operator"]
    return update


@pytest.mark.parametrize("folder, entry", ALL)
def test_fused_updates_have_the_framework_hyperparameters(folder, entry):
    expected = _by_parameter_out(entry)
    for fused in _optimized(folder, entry["file"]).report.fused:
        want = _expected_operator_hyperparameters(expected[fused.parameters_out])
        what = f"{entry['file']}: {fused.parameters_out}"
        lr = want.get("learning_rate", want.get("lr"))
        if isinstance(lr, str):  # "input:lr": the graph input itself (the report may write it "1*lr")
            assert fused.learning_rate in (lr[len("input:"):], f"1*{lr[len('input:'):]}"), (what, fused.learning_rate)
        else:
            assert isinstance(fused.learning_rate, float), (what, fused.learning_rate)
            assert math.isclose(fused.learning_rate, lr, rel_tol=HYPER_RTOL), (what, "learning rate", fused.learning_rate, lr)
        assert isinstance(fused.momentum, float), (what, "momentum", fused.momentum)
        assert math.isclose(fused.momentum, want["momentum"], rel_tol=HYPER_RTOL), (what, "momentum", fused.momentum)
        for field in ("dampening", "weight_decay"):
            assert math.isclose(getattr(fused, field), want[field], rel_tol=HYPER_RTOL, abs_tol=0.0), (
                what, field, getattr(fused, field), want[field]
            )
        assert fused.nesterov is want["nesterov"], (what, "nesterov")
        assert fused.maximize is want["maximize"], (what, "maximize")


def _next_feeds(entry, inputs, previous_feeds, outputs, fused):
    """Inputs of the next step as a runtime running the fused model would hold them.

    Fused updates write their ``parameters`` and ``accum`` inputs in place (their new values are the
    fused node's outputs). State of an update left unfused is fed back as the framework does (the
    manifest's output -> input pairs). State of a fused update that its fused node does not write keeps
    its old value: nothing else writes it. Everything else (gradients, data, lr) is the step's own.
    """
    feeds = dict(inputs)
    fused_outputs = {f.parameters_out for f in fused}
    for update in entry["updates"]:
        if update["parameter_out"] not in fused_outputs:
            feeds[update["parameter"]] = outputs[update["parameter_out"]]
            feeds[update["momentum_buffer"]] = outputs[update["momentum_buffer_out"]]
        else:
            feeds[update["parameter"]] = previous_feeds[update["parameter"]]
            feeds[update["momentum_buffer"]] = previous_feeds[update["momentum_buffer"]]
    for f in fused:
        for state, new in ((f.parameters, f.parameters_out), (f.accum, f.accum_out)):
            if state in entry["state"].values():
                feeds[state] = outputs[new]
    return feeds


@pytest.mark.parametrize("folder, entry", ALL)
def test_fused_model_gives_the_framework_numbers_in_place_or_refuses(folder, entry):
    result = _optimized(folder, entry["file"])
    fused = result.report.fused
    graph_inputs = set(entry["inputs"])
    for f in fused:
        # The operator updates parameters and accum in place: both must be state the caller holds.
        assert f.parameters in graph_inputs and f.accum in graph_inputs, (
            f"{entry['file']}: fused {f.parameters_out} updates {f.parameters!r}/{f.accum!r} in place, not graph inputs"
        )
    session = _session(result.model)
    names = entry["outputs"]
    assert [o.name for o in session.get_outputs()] == names
    steps = _data(folder, entry["file"])
    feeds = dict(steps[0][0])
    for step, (inputs, expected) in enumerate(steps, start=1):
        if step > 1:
            feeds = _next_feeds(entry, inputs, feeds, got, fused)  # noqa: F821
        got = dict(zip(names, session.run(names, feeds)))
        for name in names:
            _assert_close(
                got[name], expected[name],
                f"{entry['file']} fused ({len(fused)} updates: {sorted(f.parameters_out for f in fused)}): {name} at step {step}",
            )
