"""Redo the Keras table of the issue "Never wrong numbers" on the committed tf2onnx exports.

For each optimizer-only Keras export in testdata/keras (velocity form ``m' = 0.9*m - lr*g; w' = w + m'``),
fuse it with sgdfuse and run original and fused models in onnxruntime from Keras's own initial state (zero
momentum slots), feeding the new slot back in place, and report the dampening written and the largest
relative difference of the new slots and weights after 1 and 3 steps.

    python bench/keras_exactness.py
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import onnx

import sgdfuse
from sgdfuse.runtime import make_session, run

HERE = os.path.dirname(os.path.abspath(__file__))
KERAS = os.path.join(HERE, "..", "testdata", "keras")


def _relative(have: np.ndarray, want: np.ndarray) -> float:
    have, want = np.asarray(have, np.float64), np.asarray(want, np.float64)
    scale = np.maximum(np.abs(want), 1e-300)
    return float(np.max(np.abs(have - want) / scale))


def main() -> None:
    manifest = json.load(open(os.path.join(KERAS, "manifest.json")))
    entries = manifest["models"] if isinstance(manifest, dict) else manifest
    print("| model | lr | dampening written | new slot, 1 step | weights, 3 steps |")
    print("|---|---|---|---|---|")
    for entry in entries:
        if "opt_" not in entry["file"]:
            continue
        path = os.path.join(KERAS, entry["file"])
        original = onnx.load(path)
        result = sgdfuse.optimize(original)
        state = entry["state"]  # output -> input
        so, sf = make_session(original), make_session(result.model)
        rng = np.random.default_rng(0)
        slots = {u["momentum_buffer"] for u in entry["updates"]}
        lr = entry["updates"][0]["lr"]
        feeds = {}
        for info in original.graph.input:
            shape = [d.dim_value for d in info.type.tensor_type.shape.dim]
            if info.name in slots:
                feeds[info.name] = np.zeros(shape, np.float32)  # Keras's own initial slots
            elif int(np.prod(shape)) == 1:
                feeds[info.name] = np.full(shape, 0.01 if not isinstance(lr, float) else lr, np.float32)
            else:
                feeds[info.name] = rng.standard_normal(shape).astype(np.float32)
        fo, ff = dict(feeds), dict(feeds)
        first_slot = weights3 = 0.0
        for step in range(3):
            a, b = run(so, fo), run(sf, ff)
            for out, inp in state.items():
                if step == 0 and inp in slots:
                    first_slot = max(first_slot, _relative(b[out], a[out]))
                if step == 2 and inp not in slots:
                    weights3 = max(weights3, _relative(b[out], a[out]))
                fo[inp], ff[inp] = a[out], b[out]
        damp = sorted({f.dampening for f in result.report.fused}) or ["(refused)"]
        print(f"| {entry['file']} | {lr} | {', '.join(map(str, damp))} | {first_slot:.2g} | {weights3:.2g} |")


if __name__ == "__main__":
    main()
