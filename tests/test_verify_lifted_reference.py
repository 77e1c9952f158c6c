"""``optimize``'s verification and ``sgdfuse check`` run lifted (DOUBLE) where onnxruntime lacks DOUBLE kernels.

onnxruntime 1.32 has no DOUBLE kernel for ``Conv``, ``Col2Im``, ``AveragePool``, ``LayerNormalization``, the
``Erf`` of ``Gelu``, and more. A lifted slice or part holding one of those used to be skipped ("the lifted
(DOUBLE) comparison could not run ...; checked in the native dtypes only"), and the native comparison, whose
bound allows FLOAT's roundoff of every term, lets a coefficient through that is many FLOAT ulps off. Those nodes
now run in onnx's reference implementation and the rest in onnxruntime
(``sgdfuse.runtime.make_session_with_reference_ops``, as ``sgdfuse lower``'s check already did).

- Every committed whole step of testdata/steps (CNN with Conv/BatchNorm via Col2Im, the frozen CNN with native
  ``Conv``/``AveragePool``, the GPT-style step with ``LayerNormalization`` and ``Gelu``, the ResNet-18 shape)
  is verified by ``optimize`` and ``check`` lifted, with no "native dtypes only" note.
- A fused model whose learning rate (FLOAT, 8 ulps: 6e-7 relative) or momentum (4 ulps: 2.6e-7 relative) is
  off fails ``check``, and it fails in the DOUBLE run only: the native run accepts it, as the old check did,
  which had no DOUBLE run on these models.
- A guarded update (a loss-scaling skip on ``IsInf(ReduceSum(g))``) whose gradient goes through a ``Conv`` has
  that ``Conv`` in optimize's slice; a plan with such a coefficient is refused by the DOUBLE run.

How far off a coefficient must be to fail is set by the bound (``sgdfuse.verify``'s docstring): each coefficient
may differ by ``COEFFICIENT_ROUNDINGS`` = 4 FLOAT roundings of itself (exporters fold products of
hyper-parameters into one rounded constant), and the weights' bound adds the buffer's allowance times the
learning rate, so a learning rate is held to about 8 roundings (6 ulps of 0.05 pass, 7 fail) and a momentum to 4
(3 ulps of 0.9 pass, 4 fail). The wrong values are moved from the fused model's own constant by
``numpy.nextafter``; that they are that many FLOAT ulps from the manifest's hyper-parameter is checked here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse.api as api
from graphs import make_model, scalar, value
from sgdfuse import runtime
from sgdfuse.passes.rewrite import Planner
from sgdfuse.verify import check_models

STEPS_DIR = Path(__file__).resolve().parent.parent / "testdata" / "steps"
MANIFEST = {Path(entry["file"]).stem: entry for entry in json.loads((STEPS_DIR / "manifest.json").read_text())["models"]}
NATIVE_ONLY = "native dtypes only"
F32 = TensorProto.FLOAT

# The committed steps with an op onnxruntime has no DOUBLE kernel for (mlp_amp has none: it ran lifted before).
WITHOUT_DOUBLE_KERNELS = {
    "cnn_bn": "Col2Im",
    "cnn_clip": "Col2Im",
    "cnn_frozen": "Conv",
    "gpt_tiny": "LayerNormalization",
    "resnet_small": "Col2Im",
}


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(STEPS_DIR / MANIFEST[name]["file"])


_FUSED: dict[str, onnx.ModelProto] = {}


def _fused(name: str) -> onnx.ModelProto:
    """The committed step fused by ``optimize`` with its verification, which must pass lifted (cached)."""
    if name not in _FUSED:
        result = api.optimize(_load(name))
        updates = result.report.verification.updates
        assert len(result.report.fused) == MANIFEST[name]["expected_momentum_updates"], result.report.refused
        assert updates and all(u["passed"] for u in updates), [u["message"] for u in updates if not u["passed"]]
        assert all("double" in u["runs"] for u in updates), [(u["parameters_out"], u["runs"], u["note"]) for u in updates]
        assert not any(NATIVE_ONLY in u["note"] for u in updates)
        _FUSED[name] = result.model
    return _FUSED[name]


def _nextafter(array: np.ndarray, ulps: int) -> np.ndarray:
    """``array`` (FLOAT) moved by ``ulps`` FLOAT spacings (up when positive), one ``nextafter`` at a time."""
    moved = np.asarray(array, np.float32).copy()
    toward = np.float32(np.inf if ulps > 0 else -np.inf)
    for _ in range(abs(ulps)):
        moved = np.nextafter(moved, toward).astype(np.float32)
    return moved


def _with_initializer_moved(model: onnx.ModelProto, name: str, ulps: int) -> onnx.ModelProto:
    edited = onnx.ModelProto()
    edited.CopyFrom(model)
    (tensor,) = [t for t in edited.graph.initializer if t.name == name]
    tensor.CopyFrom(numpy_helper.from_array(_nextafter(numpy_helper.to_array(tensor), ulps), name))
    return edited


def _failures(result) -> dict[str, str]:
    return {e["name"]: e["message"] for e in result.outputs + result.in_place if not e["passed"]}


def test_onnxruntime_lacks_the_double_kernels_of_these_steps():
    # The premise: each step's lifted model is refused by onnxruntime alone, naming the op.
    from sgdfuse.lift import lift_to_double, missing_kernels

    for name, op in WITHOUT_DOUBLE_KERNELS.items():
        with pytest.raises(runtime.ONNXRUNTIME_ERRORS) as refused:
            runtime.make_session(lift_to_double(_load(name)))
        assert op in missing_kernels(refused.value) or op in str(refused.value), (name, str(refused.value)[:300])


@pytest.mark.parametrize("name", sorted(WITHOUT_DOUBLE_KERNELS))
def test_optimize_and_check_verify_every_committed_step_lifted(name):
    fused = _fused(name)  # optimize's own verification, lifted (asserted there)
    result = check_models(_load(name), fused)
    assert result.passed, _failures(result)
    assert "double" in result.runs, (result.runs, result.note)
    assert NATIVE_ONLY not in result.note and "could not run" not in result.note, result.note


# name, the fused model's constant, the manifest's hyper-parameter it holds, FLOAT ulps it is moved by
WRONG_COEFFICIENTS = [
    ("cnn_bn", "sgdfuse/learning_rate_0", "lr", 8),
    ("cnn_frozen", "sgdfuse/learning_rate_0", "lr", -8),
    ("gpt_tiny", "sgdfuse/momentum_0", "momentum", 4),
]


@pytest.mark.parametrize("name, constant, hyperparameter, ulps", WRONG_COEFFICIENTS)
def test_a_coefficient_a_few_float_ulps_off_fails_check_in_the_double_run_which_the_native_run_accepts(name, constant, hyperparameter, ulps):
    fused = _fused(name)
    (stored,) = [numpy_helper.to_array(t) for t in fused.graph.initializer if t.name == constant]
    wanted = MANIFEST[name]["sgd"][hyperparameter]
    assert stored == np.float32(wanted)  # the fused constant is the framework's value, rounded to FLOAT
    wrong = _with_initializer_moved(fused, constant, ulps)
    (moved,) = [numpy_helper.to_array(t) for t in wrong.graph.initializer if t.name == constant]
    spacing = np.spacing(np.float32(wanted))
    assert abs(float(moved) - float(np.float32(wanted))) == pytest.approx(abs(ulps) * float(spacing))  # no binade crossed
    result = check_models(_load(name), wrong)
    failures = _failures(result)
    assert not result.passed and failures
    # The first failure of every entry is in the DOUBLE run: the native run, which ran first, passed them all,
    # so the check without a DOUBLE run (the old one on these models) accepted this model.
    assert all(message.startswith("double") for message in failures.values()), failures


# -- optimize: a guarded update whose slice holds a Conv ------------------------------------------------------

SHAPE = [4, 3]


def _guarded_conv_step() -> onnx.ModelProto:
    """``g = Conv(x)`` (x [4, 3] as a 1x1 image, a 3x3 kernel, padding 1); a loss-scaling skip:
    ``found_inf = IsInf(ReduceSum(g))``, ``buf_out = Where(found_inf, buf, 0.9*buf + g)``, ``p_out =
    Where(found_inf, p, p - 0.1*(0.9*buf + g))``. The guard reads the gradient, so optimize's slice computes
    it, Conv included."""
    n = helper.make_node
    nodes = [
        n("Reshape", ["x", "image_shape"], ["image"]),
        n("Conv", ["image", "kernel"], ["convolved"], pads=[1, 1, 1, 1]),
        n("Reshape", ["convolved", "grad_shape"], ["g"]),
        n("ReduceSum", ["g"], ["total"], keepdims=0),
        n("IsInf", ["total"], ["found_inf"]),
        n("Mul", ["buf", "m"], ["buf_m"]),
        n("Add", ["buf_m", "g"], ["buf_new"]),
        n("Mul", ["buf_new", "lr"], ["step"]),
        n("Sub", ["p", "step"], ["p_new"]),
        n("Where", ["found_inf", "p", "p_new"], ["p_out"]),
        n("Where", ["found_inf", "buf", "buf_new"], ["buf_out"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array([1, 1, 4, 3], np.int64), "image_shape"),
        numpy_helper.from_array(np.array(SHAPE, np.int64), "grad_shape"),
        numpy_helper.from_array(np.linspace(-1, 1, 9, dtype=np.float32).reshape(1, 1, 3, 3), "kernel"),
        scalar("m", 0.9),
        scalar("lr", 0.1),
    ]
    return make_model(nodes, [value("p", F32, SHAPE), value("buf", F32, SHAPE), value("x", F32, SHAPE)],
                      [value("p_out", F32, SHAPE), value("buf_out", F32, SHAPE)], initializers)


def test_the_guarded_conv_step_computes_the_formula_and_fuses_verified_lifted():
    # The premise from numpy: the graph is the guarded momentum step with g the 3x3 convolution of x.
    model = _guarded_conv_step()
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("p", "buf", "x")}
    kernel = np.linspace(-1, 1, 9).reshape(3, 3)
    padded = np.pad(feeds["x"].astype(np.float64), 1)
    g = np.array([[np.sum(padded[i : i + 3, j : j + 3] * kernel) for j in range(3)] for i in range(4)])
    buf_new = 0.9 * feeds["buf"] + g
    got = runtime.run(runtime.make_session(model), feeds)
    np.testing.assert_allclose(got["buf_out"], buf_new, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["p_out"], feeds["p"] - 0.1 * buf_new, rtol=1e-5, atol=1e-6)
    result = api.optimize(model)
    assert [f.parameters_out for f in result.report.fused] == ["p_new"], result.report.refused
    (update,) = result.report.verification.updates
    assert update["passed"] and "double" in update["runs"] and NATIVE_ONLY not in update["note"], update
    assert check_models(model, result.model).passed


@pytest.mark.parametrize("what, ulps", [("learning_rate", 8), ("momentum", 4)])
def test_optimize_refuses_a_plan_a_few_ulps_off_in_the_double_run_of_a_slice_holding_a_conv(monkeypatch, what, ulps):
    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            name = plan.learning_rate_input if what == "learning_rate" else plan.momentum_input
            initializers = [numpy_helper.from_array(_nextafter(numpy_helper.to_array(t), ulps), t.name) if t.name == name else t
                            for t in plan.initializers]
            assert initializers != plan.initializers, f"the plan has no {what} initializer to change"
            return dataclasses.replace(plan, initializers=initializers)

    monkeypatch.setattr(api, "Planner", WrongPlanner)
    result = api.optimize(_guarded_conv_step())
    assert result.report.fused == []
    assert [(r.candidate, r.reason) for r in result.report.refused] == [("p_new", "verification-failed")]
    (update,) = result.report.verification.updates
    # Refused by the DOUBLE run; the native run, first, passed it (the old verification, native only here).
    assert update["message"].startswith("double"), update


# -- the reference stages ------------------------------------------------------------------------------------


def test_known_op_types_go_to_the_reference_implementation_without_asking_onnxruntime_first(monkeypatch):
    # The hint make_session_with_reference_ops takes for another part of the same model: no refused session is built.
    from sgdfuse.lift import lift_to_double

    lifted = lift_to_double(_guarded_conv_step())
    session, referenced = runtime.make_session_with_reference_ops(lifted)
    assert referenced == ["Conv"]
    built: list[int] = []
    real = runtime.make_session

    def counting(model):
        built.append(1)
        return real(model)

    monkeypatch.setattr(runtime, "make_session", counting)
    hinted, again = runtime.make_session_with_reference_ops(lifted, known=("Conv", "LayerNormalization"))
    assert again == ["Conv"]  # only the known op types the model uses
    assert isinstance(hinted, runtime.MixedSession)
    # Only the stages' own sessions (no whole-model attempt): one onnxruntime stage before the Conv, one after.
    assert len(built) == sum(1 for stage in hinted._stages if not isinstance(stage[0], runtime.ReferenceSession))
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal(SHAPE) for name in ("p", "buf", "x")}
    want, have = runtime.run(session, feeds), runtime.run(hinted, feeds)
    for name in want:
        assert want[name].dtype == np.float64 and want[name].tobytes() == have[name].tobytes()
