"""``sgdfuse.optimize`` on the real PyTorch exports in ``testdata/torch`` against their oracle.

``testdata/torch/manifest.json`` was written from the PyTorch-side configuration of each export (see
testdata/README.md), not from sgdfuse: for every model it lists the parameter updates with their
hyper-parameters. The tests below hold the pass to it:

- exactly the manifest's momentum updates are fused, with the manifest's roles and hyper-parameters,
  both in the report and on the ``ai.sgdfuse::SGD`` nodes of the output model;
- the momentum-0 models fuse nothing and say why;
- every fused update passed verification, and the output passes the full ONNX checker;
- ``sgdfuse.verify.check_models`` (what ``sgdfuse check`` runs) accepts every pair, and, independently of
  sgdfuse's own verification code, onnxruntime gives the same numbers for the original and the fused model
  over three training steps.
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
from onnx import helper

import sgdfuse.api as api
from sgdfuse.fused_op import Specialisation, read_sgd_attributes
from sgdfuse.verify import check_models

TESTDATA = Path(__file__).resolve().parent.parent / "testdata" / "torch"
MANIFEST = json.loads((TESTDATA / "manifest.json").read_text())
ENTRIES = MANIFEST["models"]

# Hyper-parameters are compared relative to the manifest's exact Python values.
# FLOAT models: the exporters store FLOAT constants, and some hyper-parameters are derived from one, e.g.
# dampening = 1 - fp32(0.9) = 0.100000024 in the dampening == momentum case: a few FLOAT ulps, so 1e-6.
# FLOAT16 models: the constants are stored in FLOAT16 (0.9 -> 0.89990234375, 1e-4 -> 1.0001659e-4,
# 0.1 -> 0.0999755859375), i.e. off by up to half an fp16 ulp (2^-11 ~ 4.9e-4 relative), so 1e-3.
RELATIVE_TOLERANCE = {"float32": 1e-6, "float16": 1e-3}


def _entry_id(entry: dict) -> str:
    return entry["file"][: -len(".onnx")]


def _params(entries: list[dict]) -> list:
    return [pytest.param(entry, id=_entry_id(entry)) for entry in entries]


ALL = _params(ENTRIES)
WITH_MOMENTUM = _params([e for e in ENTRIES if e["expected_momentum_updates"] > 0])
WITHOUT_MOMENTUM = _params([e for e in ENTRIES if e["expected_momentum_updates"] == 0])


@functools.lru_cache(maxsize=None)
def _optimized(file: str) -> api.OptimizeResult:
    # One optimisation per model for the whole module; tests only read the result.
    return api.optimize(TESTDATA / file)


def _momentum_updates(entry: dict) -> dict[str, dict]:
    return {u["parameter_out"]: u for u in entry["updates"] if u["momentum_buffer"] is not None}


def _close(actual: float, expected: float, dtype: str) -> bool:
    # abs_tol 0: a hyper-parameter the manifest says is 0 must be reported as exactly 0.
    return math.isclose(actual, expected, rel_tol=RELATIVE_TOLERANCE[dtype], abs_tol=0.0)


def test_manifest_covers_every_committed_model():
    # Outputs of the README's main job (*.sgdfused.onnx, git-ignored) may lie beside the inputs.
    on_disk = sorted(p.name for p in TESTDATA.glob("*.onnx") if not p.name.endswith(".sgdfused.onnx"))
    assert sorted(e["file"] for e in ENTRIES) == on_disk
    assert len(on_disk) == 37
    assert MANIFEST["failures"] == []


@pytest.mark.parametrize("entry", ALL)
def test_fuses_exactly_the_manifest_momentum_updates(entry):
    report = _optimized(entry["file"]).report
    expected = _momentum_updates(entry)
    assert len(expected) == entry["expected_momentum_updates"]
    assert sorted(f.parameters_out for f in report.fused) == sorted(expected)
    assert len(report.fused) == entry["expected_momentum_updates"]


@pytest.mark.parametrize("entry", WITH_MOMENTUM)
def test_fused_update_roles_match_the_manifest(entry):
    expected = _momentum_updates(entry)
    for fused in _optimized(entry["file"]).report.fused:
        want = expected[fused.parameters_out]
        assert fused.parameters == want["parameter"], fused
        assert fused.accum == want["momentum_buffer"], fused
        assert fused.accum_out == want["momentum_buffer_out"], fused
        if want["gradient"] is not None:  # null for the full training step: its gradients are internal
            assert fused.gradient == want["gradient"], fused


@pytest.mark.parametrize("entry", WITH_MOMENTUM)
def test_fused_update_hyperparameters_match_the_manifest(entry):
    expected = _momentum_updates(entry)
    dtype = entry["dtype"]
    for fused in _optimized(entry["file"]).report.fused:
        want = expected[fused.parameters_out]
        if isinstance(want["lr"], str):
            # "input:lr": the learning rate is the graph input itself, reported as its expression.
            assert want["lr"].startswith("input:")
            assert fused.learning_rate == want["lr"][len("input:") :], fused
        else:
            assert isinstance(fused.learning_rate, float), fused
            assert _close(fused.learning_rate, want["lr"], dtype), (fused.learning_rate, want["lr"])
        assert isinstance(fused.momentum, float), fused
        assert _close(fused.momentum, want["momentum"], dtype), (fused.momentum, want["momentum"])
        assert _close(fused.dampening, want["dampening"], dtype), (fused.dampening, want["dampening"])
        assert _close(fused.weight_decay, want["weight_decay"], dtype), (fused.weight_decay, want["weight_decay"])
        assert fused.nesterov is want["nesterov"]
        assert fused.maximize is want["maximize"]


@pytest.mark.parametrize("entry", WITH_MOMENTUM)
def test_output_model_has_one_sgd_node_per_manifest_update_with_its_state_and_attributes(entry):
    model = _optimized(entry["file"]).model
    expected = _momentum_updates(entry)
    sgd_nodes = [n for n in model.graph.node if n.domain == "ai.sgdfuse"]
    assert [n.op_type for n in sgd_nodes] == ["SGD"] * len(expected)
    assert sorted(n.output[0] for n in sgd_nodes) == sorted(expected)
    for node in sgd_nodes:
        want = expected[node.output[0]]
        # Contract order: parameters, gradient, learning_rate, accum, momentum, stat.
        assert node.input[0] == want["parameter"]
        assert node.input[3] == want["momentum_buffer"]
        assert node.output[1] == want["momentum_buffer_out"]
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert _close(attributes["dampening"], want["dampening"], entry["dtype"])
        assert _close(attributes["weight_decay"], want["weight_decay"], entry["dtype"])
        assert attributes["nesterov"] == int(want["nesterov"])
    assert any(o.domain == "ai.sgdfuse" for o in model.opset_import)
    # One function per distinct body the nodes call (function overloads), each assuming the node's own
    # attributes and dtype.
    overloads = sorted({n.overload for n in sgd_nodes})
    assert sorted((f.domain, f.name, f.overload) for f in model.functions) == [("ai.sgdfuse", "SGD", o) for o in overloads]
    for node in sgd_nodes:
        spec = Specialisation.from_overload(node.overload)
        spec.check(read_sgd_attributes(node), subject=node.name)
        assert spec.dtype == {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[entry["dtype"]]


@pytest.mark.parametrize("entry", WITHOUT_MOMENTUM)
def test_momentum_zero_models_fuse_nothing_and_refuse_each_parameter_update(entry):
    result = _optimized(entry["file"])
    assert result.report.fused == []
    refused = {r.candidate: r for r in result.report.refused}
    assert sorted(refused) == sorted(u["parameter_out"] for u in entry["updates"])
    for candidate, refusal in refused.items():
        assert refusal.reason == "no-momentum-buffer", refusal
        assert candidate in refusal.detail
    assert not any(n.domain == "ai.sgdfuse" for n in result.model.graph.node)
    assert result.model.SerializeToString() == onnx.load(TESTDATA / entry["file"]).SerializeToString()


@pytest.mark.parametrize("entry", WITH_MOMENTUM)
def test_verification_ran_and_passed_for_every_fused_update(entry):
    report = _optimized(entry["file"]).report
    assert report.verification.enabled
    assert report.verification.steps == 3
    checked = {u["parameters_out"]: u for u in report.verification.updates}
    assert sorted(checked) == sorted(f.parameters_out for f in report.fused)
    for name, check in checked.items():
        assert check["passed"], (name, check["message"])
        assert check["max_bound_ratio"] <= 1.0
    assert not [r for r in report.refused if r.reason == "verification-failed"]


@pytest.mark.parametrize("entry", ALL)
def test_output_passes_the_full_onnx_checker(entry):
    onnx.checker.check_model(_optimized(entry["file"]).model, full_check=True)


@pytest.mark.parametrize("entry", ALL)
def test_check_models_accepts_original_and_fused(entry):
    original = onnx.load(TESTDATA / entry["file"])
    result = check_models(original, _optimized(entry["file"]).model, steps=3)
    failing = [o for o in result.outputs if not o["passed"]]
    assert result.passed, failing
    assert sorted(o["name"] for o in result.outputs) == sorted(entry["outputs"])


# Independent of sgdfuse.verify: onnxruntime (all graph optimisations off) runs both models for three
# training steps, each model fed back its own new weights and buffers (the manifest's state pairs).
# FLOAT: rtol 1e-5 / atol 1e-6, the tolerance testdata/README.md used for onnxruntime vs eager PyTorch
# (differences seen are a few FLOAT ulps: both compute the same formula, rounding in a different order).
# FLOAT16: the original rounds to FLOAT16 after every Mul/Add, the fused function computes in FLOAT and
# rounds once; inputs are standard normal (|x| up to ~4), where an fp16 ulp is up to 2^-9 ~ 2e-3, so
# rtol 2e-3 / atol 4e-3 allows about two ulps.
ORT_TOLERANCE = {"float32": {"rtol": 1e-5, "atol": 1e-6}, "float16": {"rtol": 2e-3, "atol": 4e-3}}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _seeded_feeds(session: ort.InferenceSession, rng: np.random.Generator) -> dict[str, np.ndarray]:
    dtypes = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    feeds = {}
    for info in session.get_inputs():
        shape = [int(d) for d in info.shape]
        if int(np.prod(shape)) == 1:  # the runtime learning rate
            feeds[info.name] = rng.uniform(0.01, 0.1, size=shape).astype(dtypes[info.type])
        else:
            feeds[info.name] = rng.standard_normal(shape).astype(dtypes[info.type])
    return feeds


@pytest.mark.parametrize("entry", ALL)
def test_onnxruntime_gives_the_same_numbers_for_original_and_fused_over_three_steps(entry):
    original = _session(onnx.load(TESTDATA / entry["file"]))
    fused = _session(_optimized(entry["file"]).model)
    assert [i.name for i in original.get_inputs()] == [i.name for i in fused.get_inputs()]
    names = [o.name for o in original.get_outputs()]
    assert names == [o.name for o in fused.get_outputs()]

    state = {u["parameter_out"]: u["parameter"] for u in entry["updates"]}
    state.update({u["momentum_buffer_out"]: u["momentum_buffer"] for u in entry["updates"] if u["momentum_buffer"]})
    rng = np.random.default_rng(1234)
    feeds_original = _seeded_feeds(original, rng)
    feeds_fused = dict(feeds_original)
    tolerance = ORT_TOLERANCE[entry["dtype"]]
    for step in range(3):
        want = dict(zip(names, original.run(names, feeds_original)))
        have = dict(zip(names, fused.run(names, feeds_fused)))
        for name in names:
            assert have[name].dtype == want[name].dtype
            np.testing.assert_allclose(
                have[name].astype(np.float64), want[name].astype(np.float64), **tolerance,
                err_msg=f"{entry['file']}: output {name} at step {step + 1}",
            )
        for output, state_input in state.items():
            feeds_original[state_input] = want[output]
            feeds_fused[state_input] = have[output]
        fresh = _seeded_feeds(original, rng)
        for name, array in fresh.items():
            if name not in state.values():  # fresh gradients, data and learning rate each step
                feeds_original[name] = feeds_fused[name] = array
