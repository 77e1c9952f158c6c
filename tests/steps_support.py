"""Shared helpers of the whole-step tests (no tests here): the committed PyTorch whole training steps of
testdata/steps (manifest, inputs and eager outputs), and their run in onnxruntime and in the GE executor
over chained steps."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import onnx

from sgdfuse import runtime
from sgdfuse.lowering.lower import fused_model
from test_lowering_support import assert_agree

STEPS_DIR = Path(__file__).resolve().parent.parent / "testdata" / "steps"
MANIFEST = json.loads((STEPS_DIR / "manifest.json").read_text())
ENTRIES = {Path(entry["file"]).stem: entry for entry in MANIFEST["models"]}
STEP_NAMES = sorted(ENTRIES)


@functools.lru_cache(maxsize=None)
def fused_step(name: str) -> onnx.ModelProto:
    """The committed step, fused (cached)."""
    return fused_model(STEPS_DIR / ENTRIES[name]["file"])


@functools.lru_cache(maxsize=None)
def arrays(name: str) -> dict[str, np.ndarray]:
    with np.load(STEPS_DIR / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


def step_feeds(name: str) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Initial inputs and the data inputs of each recorded step."""
    data = arrays(name)
    initial = {key[len("input/") :]: value for key, value in data.items() if key.startswith("input/")}
    steps = len([key for key in data if key.endswith("/x") and key.startswith("step")])
    batches = [{n: data[f"step{k}/{n}"] for n in ENTRIES[name]["data_inputs"]} for k in range(steps)]
    return initial, batches


# How far the executor may be from onnxruntime on one output of a whole step: within the per-element
# tolerance of the other lowering tests (assert_agree, rtol/atol 1e-5), or, for the output as a whole, within
# CONDITIONING_FACTOR times how far onnxruntime's own output moves when the float data input is scaled by
# 1 + 2**-22 (two units in the last place) on every step of a second chain of its own. The two runtimes differ by about one rounding per op (summation
# order); what that becomes at an output is set by the step's conditioning, which the perturbed run measures.
# Through the ResNet's BatchNorms at 1x1 spatial size a relative 1e-7 becomes ~1e-5 on momentum buffers; the
# executor's difference was at most 3.4 times the perturbed chain's (83 outputs beyond 1e-5, 3 steps).
CONDITIONING_FACTOR = 16
PERTURBATION = 2.0**-22


def agree_within_conditioning(label: str, expected: np.ndarray, actual: np.ndarray, perturbed: np.ndarray) -> float:
    """Assert ``actual`` agrees with ``expected`` (see CONDITIONING_FACTOR); return the max |difference|."""
    try:
        return assert_agree(label, expected, actual)
    except AssertionError:
        difference = float(np.max(np.abs(expected.astype(np.float64) - actual.astype(np.float64))))
        sensitivity = float(np.max(np.abs(expected.astype(np.float64) - perturbed.astype(np.float64))))
        assert difference <= CONDITIONING_FACTOR * sensitivity, (
            f"{label}: max |difference| {difference:.3g} beyond rtol/atol 1e-5 and beyond {CONDITIONING_FACTOR} x "
            f"{sensitivity:.3g}, onnxruntime's own change for a 2-ulp change of the data"
        )
        return difference


def run_chained(name: str, ge_model, *, steps: int = 3) -> list[dict[str, float]]:
    """Run the fused step in onnxruntime and the lowered graph in the executor over ``steps`` chained steps
    (onnxruntime gets its own outputs back as state per the manifest; the GE graph keeps state in its
    variables) and assert every output agrees (:func:`agree_within_conditioning`); return the per step max
    |difference| per output."""
    entry = ENTRIES[name]
    model = fused_step(name)
    feeds, batches = step_feeds(name)
    session = runtime.make_session(model)
    runner = ge_model.runner()
    runner.initialise({n: feeds[n] for n in ge_model.init_inputs.values()})
    nudged = dict(feeds)
    report = []
    for k in range(steps):
        feeds.update(batches[k])
        nudged.update(batches[k])
        for data in entry["data_inputs"]:
            if feeds[data].dtype.kind == "f":
                nudged[data] = (feeds[data] * (1 + PERTURBATION)).astype(feeds[data].dtype)
        expected = runtime.run(session, feeds)
        actual = runner.step(feeds)
        perturbed = runtime.run(session, nudged)
        report.append({o: agree_within_conditioning(f"{name} step {k} {o}", expected[o], actual[o], perturbed[o]) for o in ge_model.outputs})
        for chain, results in ((feeds, expected), (nudged, perturbed)):
            for output in entry["outputs"]:
                if output["feeds"]:
                    chain[output["feeds"]] = results[output["name"]]
            for counter in entry["counter_inputs"]:
                chain[counter] = np.asarray(chain[counter] + 1, dtype=chain[counter].dtype)
    return report
