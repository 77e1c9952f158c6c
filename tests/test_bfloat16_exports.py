"""PyTorch's own SGD on BFLOAT16 state, exported by both of its exporters with default names
(testdata/torch_bf16, written by testdata/make_torch_bf16.py from the PyTorch-side configuration): every op
of each update computes in BFLOAT16. onnxruntime's CPU provider cannot run such a graph as it is, so these
pin that the default path (verification on), ``check`` and ``lower`` run it (``sgdfuse.runtime`` computes
the ops it lacks in FLOAT between Casts), and that it stays sound:

- the manifest's updates fuse with its roles and hyper-parameters, every one verified; one that does not is
  refused with a reason (the dampened legacy export reads as two updates, as in FLOAT: ambiguous-roles);
- the fused model, run by ONNX's own reference evaluator (independent of onnxruntime and of sgdfuse) with
  the SGD nodes writing their state in place, gives PyTorch's numbers over the three chained steps; the
  same comparison tells a learning rate off by a quarter apart;
- ``check`` passes the fused model and fails it with a wrong learning rate; ``lower`` verifies its GE graph.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import sgdfuse
from sgdfuse.fused_op import DOMAIN, OP_TYPE
from sgdfuse.lowering import lower, verify_lowering
from sgdfuse.verify import check_models

DATA = Path(__file__).resolve().parent.parent / "testdata" / "torch_bf16"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
MODELS = [pytest.param(entry, id=entry["file"][: -len(".onnx")]) for entry in MANIFEST["models"]]
EPS_BF16 = 2.0 ** -7
# The fused op computes each update in FLOAT and rounds once; PyTorch rounds after every op (up to five per
# step), in places where the values cancel, and the differences add up over three chained steps: at most 1.3
# BFLOAT16 ulps of the array's largest value were seen, so 4. A learning rate off by a quarter moves the
# parameters by a quarter of lr*buf: 7.9 to 14.5 such ulps (the negative control below).
ULPS = 4


@functools.lru_cache(maxsize=None)
def _fused(file: str) -> sgdfuse.OptimizeResult:
    return sgdfuse.optimize(DATA / file)


def _steps(entry: dict) -> list[tuple[dict, dict]]:
    with np.load(DATA / entry["data"]) as arrays:
        return [
            ({n: arrays[f"s{s}_in_{i}"].view(ml_dtypes.bfloat16) for i, n in enumerate(entry["inputs"])},
             {n: arrays[f"s{s}_out_{j}"].view(ml_dtypes.bfloat16) for j, n in enumerate(entry["outputs"])})
            for s in (1, 2, 3)
        ]


def _in_place_run(model: onnx.ModelProto, entry: dict) -> list[dict[str, np.ndarray]]:
    """The fused model over the chained steps in ONNX's reference evaluator, each SGD node's outputs fed back
    to its parameters and buffer inputs (what the op writes in place), the other inputs PyTorch's."""
    sgd_nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    written = {}  # state input -> the output carrying its next value
    for node in sgd_nodes:
        written[node.input[0]] = node.output[0]  # parameters (INPUT_NAMES: parameters, gradient, lr, accum, ...)
        written[node.input[3]] = node.output[1]
    wanted = list(dict.fromkeys([o.name for o in model.graph.output] + list(written.values())))
    evaluator = ReferenceEvaluator(model)
    feeds = dict(_steps(entry)[0][0])
    results = []
    for s, (eager_in, _) in enumerate(_steps(entry)):
        if s:
            feeds.update({n: v for n, v in eager_in.items() if n not in written})
        out = dict(zip(wanted, evaluator.run(wanted, feeds)))
        results.append(out)
        feeds = dict(feeds, **{state: out[name] for state, name in written.items()})
    return results


def _within(have: np.ndarray, want: np.ndarray) -> bool:
    h, w = np.asarray(have, np.float64), np.asarray(want, np.float64)
    return bool(np.all(np.abs(h - w) <= ULPS * EPS_BF16 * float(np.abs(w).max())))


@pytest.mark.parametrize("entry", MODELS)
def test_the_manifest_updates_fuse_verified_with_their_roles_and_hyperparameters(entry):
    result = _fused(entry["file"])
    report = result.report
    fused = {f.parameters: f for f in report.fused}
    refused = {r.candidate: r for r in report.refused}
    assert set(fused) <= {u["parameter"] for u in entry["updates"]}
    for update in entry["updates"]:
        f = fused.get(update["parameter"])
        if f is None:
            assert refused[update["parameter_out"]].reason, update  # not fused, and says why
            continue
        assert (f.gradient, f.accum, f.parameters_out, f.accum_out) == (
            update["gradient"], update["momentum_buffer"], update["parameter_out"], update["momentum_buffer_out"])
        # BFLOAT16 constants: the graph's values are PyTorch's rounded to BFLOAT16 (relative 2^-8 at most).
        for ours, theirs in ((f.learning_rate, update["lr"]), (f.momentum, update["momentum"]),
                             (f.dampening, update["dampening"]), (f.weight_decay, update["weight_decay"])):
            assert float(ours) == pytest.approx(theirs, rel=2.0 ** -8, abs=1e-12)
        assert f.nesterov == update["nesterov"]
    assert len(report.verification.updates) == len(fused)
    assert all(u["passed"] for u in report.verification.updates)
    fusing = [e for e in MANIFEST["models"] if _fused(e["file"]).report.fused]
    assert len(fusing) >= len(MANIFEST["models"]) - 1  # all but the ambiguous dampened legacy export


@pytest.mark.parametrize("entry", MODELS)
def test_the_fused_model_gives_pytorchs_numbers_in_onnxs_reference_evaluator(entry):
    model = _fused(entry["file"]).model
    for s, ((_, eager_out), ours) in enumerate(zip(_steps(entry), _in_place_run(model, entry)), start=1):
        for name in entry["outputs"]:
            assert _within(ours[name], eager_out[name]), (entry["file"], s, name)


def _with_learning_rate_times(model: onnx.ModelProto, factor: float) -> onnx.ModelProto:
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    for tensor in wrong.graph.initializer:
        if tensor.name.startswith("sgdfuse/learning_rate"):
            value = numpy_helper.to_array(tensor)
            tensor.CopyFrom(numpy_helper.from_array((value.astype(np.float64) * factor).astype(value.dtype), tensor.name))
    return wrong


@pytest.mark.parametrize("entry", [m for m in MODELS if "dampening_legacy" not in m.id])
def test_a_learning_rate_off_by_a_quarter_is_outside_the_comparison(entry):
    wrong = _with_learning_rate_times(_fused(entry["file"]).model, 1.25)
    last = _in_place_run(wrong, entry)[-1]
    eager_out = _steps(entry)[-1][1]
    assert not all(_within(last[n], eager_out[n]) for n in entry["outputs"])


@pytest.mark.parametrize("entry", MODELS)
def test_check_passes_the_fused_model_and_fails_a_wrong_learning_rate(entry):
    original = onnx.load(DATA / entry["file"])
    fused = _fused(entry["file"]).model
    assert check_models(original, fused, steps=3).passed
    if _fused(entry["file"]).report.fused:
        assert not check_models(original, _with_learning_rate_times(fused, 1.25), steps=3).passed


@pytest.mark.parametrize("entry", MODELS[::3])
def test_the_lowered_graph_verifies_against_the_fused_model(entry):
    fused = _fused(entry["file"]).model
    lowered = lower(fused, soc="Ascend910B2", optimise=False)
    assert verify_lowering(fused, lowered, steps=3).passed
