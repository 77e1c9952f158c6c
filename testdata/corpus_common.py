"""Shared helpers of the exported-corpus generators (make_keras_models.py, make_jax_models.py,
make_torch_default_names.py).

Only numpy, onnx and onnxruntime are used here, so every framework's venv can import this file. Each
generator runs its framework eagerly for three chained training steps, exports the step to ONNX, and
then calls :func:`check_and_save`, which

1. runs the ONNX model in onnxruntime on the same inputs for the same three chained steps (each step's
   state inputs are the ONNX model's own previous outputs, the other inputs are the eager run's),
2. compares every output with the eager framework's and raises if any differs by more than
   :func:`tolerance` allows,
3. writes ``<model>.npz`` with the eager inputs and outputs of the three steps.

Layout of the ``.npz`` (names in the ONNX graph can hold ``:`` and ``/``, so arrays are keyed by
position): ``s{step}_in_{i}`` is graph input ``i`` (the manifest's ``inputs[i]``) fed at step ``step``
(1, 2, 3) and ``s{step}_out_{j}`` is graph output ``j`` (``outputs[j]``) as the framework computed it.
The state inputs of step ``s + 1`` equal the framework's state outputs of step ``s``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

STEPS = 3

# Every compared value is computed by both sides from the same float32 inputs with a few dozen float32
# roundings per step (a matmul over at most 16 terms, the loss, a handful of elementwise update ops),
# in a different order, over three chained steps. 64 float32 ulps of the largest value of the array,
# plus 64 ulps of the element itself, bounds that with room to spare; a wrongly fused update (a wrong
# sign, a missing or extra factor lr, a wrong momentum) moves values by far more unless the framework's
# own float32 arithmetic cannot see the difference either.
ULPS = 64
EPS32 = float(np.finfo(np.float32).eps)


def tolerance(expected: np.ndarray) -> np.ndarray:
    """Per-element allowed |actual - expected| for one output array (float64)."""
    e = np.abs(expected.astype(np.float64))
    scale = float(e.max()) if e.size else 0.0
    return ULPS * EPS32 * (e + scale)


def normwise_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|actual - expected| / max|expected| (0 when both are all zero)."""
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    diff = float(np.abs(a - e).max()) if e.size else 0.0
    scale = float(np.abs(e).max()) if e.size else 0.0
    return diff / scale if scale else diff


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def eager_chain(
    step: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    first: dict[str, np.ndarray],
    state: dict[str, str],
    fresh: Callable[[int], dict[str, np.ndarray]],
) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """Run ``step`` (the framework, eagerly) for STEPS chained steps.

    ``first``: every input of step 1 by ONNX input name; ``state``: ONNX output name -> the input it is
    fed back to; ``fresh(s)``: the non-state inputs of step ``s`` (2, 3), e.g. new gradients or data.
    Returns [(inputs, outputs)] per step, all by ONNX name.
    """
    steps = []
    feeds = dict(first)
    for s in range(1, STEPS + 1):
        if s > 1:
            feeds = dict(feeds)
            feeds.update(fresh(s))
            for out, inp in state.items():
                feeds[inp] = steps[-1][1][out]
        outs = step(dict(feeds))
        steps.append((dict(feeds), {k: np.asarray(v) for k, v in outs.items()}))
    return steps


def check_and_save(
    path: Path,
    steps: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
    state: dict[str, str],
) -> dict:
    """Check the ONNX file against the eager steps, write ``<path>.npz``; return manifest fields.

    Raises AssertionError when onnxruntime differs from the framework beyond :func:`tolerance`.
    """
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    sess = session(path)
    inputs = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]
    assert sorted(inputs) == sorted(steps[0][0]), (inputs, sorted(steps[0][0]))
    assert sorted(outputs) == sorted(steps[0][1]), (outputs, sorted(steps[0][1]))
    worst = 0.0
    worst_ulps = 0.0
    feeds = dict(steps[0][0])
    arrays = {}
    for s, (eager_in, eager_out) in enumerate(steps, start=1):
        if s > 1:
            feeds = dict(eager_in)
            for out, inp in state.items():
                feeds[inp] = got[out]  # noqa: F821 - the ONNX model's own previous output
        got = dict(zip(outputs, sess.run(outputs, {k: feeds[k] for k in inputs})))
        for name in outputs:
            want = eager_out[name]
            have = got[name]
            assert have.shape == want.shape and have.dtype == want.dtype, (path.name, name, have.shape, want.shape)
            bound = tolerance(want)
            diff = np.abs(have.astype(np.float64) - want.astype(np.float64))
            assert np.all(diff <= bound), (path.name, name, s, float(diff.max()), float(bound.min()))
            worst = max(worst, normwise_difference(have, want))
            scale = float(np.abs(want.astype(np.float64)).max()) or 1.0
            worst_ulps = max(worst_ulps, float(diff.max()) / (EPS32 * scale))
        for i, name in enumerate(inputs):
            arrays[f"s{s}_in_{i}"] = eager_in[name]
        for j, name in enumerate(outputs):
            arrays[f"s{s}_out_{j}"] = eager_out[name]
    data = path.with_suffix(".npz")
    np.savez_compressed(data, **arrays)
    return {
        "file": path.name,
        "data": data.name,
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "ir_version": model.ir_version,
        "inputs": inputs,
        "outputs": outputs,
        "state": state,
        "onnx_vs_eager_max_normwise_difference": worst,
        "onnx_vs_eager_max_difference_ulps_of_output_max": round(worst_ulps, 3),
    }


def write_manifest(path: Path, manifest: dict) -> None:
    path.write_text(json.dumps(manifest, indent=1) + "\n")
