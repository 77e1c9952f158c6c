#!/usr/bin/env python
"""Regenerate testdata/torch_bf16/: PyTorch optimizer-only SGD steps on BFLOAT16 parameters, gradients and
momentum buffers, exported with the exporters' default tensor names.

Every update is PyTorch's own ``torch.optim._functional.sgd(..., foreach=False)`` on clones of the
inputs, with real momentum buffers, run on ``torch.bfloat16`` tensors: every op of the update computes in
BFLOAT16 (PyTorch rounds each op's result to BFLOAT16), and so does the exported graph.

* ``*_dynamo.onnx``: ``torch.onnx.export(module, args, dynamo=True)`` (inputs named after ``forward``'s
  arguments, outputs after the FX nodes);
* ``*_legacy.onnx``: ``torch.onnx.export(module, args, dynamo=False)`` (TorchScript tracer names).

onnxruntime's CPU provider has no BFLOAT16 ``Mul`` or ``Add``, so each file is checked against eager PyTorch
over three chained steps with ONNX's own reference evaluator (``onnx.reference.ReferenceEvaluator``), within
eight BFLOAT16 ulps of each output's largest value: PyTorch's ``add_(g, alpha=a)`` rounds ``buf + a*g`` once,
the exported ``Mul`` then ``Add`` round twice, and the difference grows over the chained steps (3.2 ulps seen
with dampening). The eager functional step is checked against
``torch.optim.SGD`` with pre-set ``momentum_buffer`` state, bit for bit.

The manifest's role names are read back from each file by POSITION (the forward signature fixes the input
order, the return tuple the output order), never by analysing the graph. The ``.npz`` beside each model has
the layout of the other corpora (``s{step}_in_{i}``, ``s{step}_out_{j}``, testdata/corpus_common.py), with
each array the BFLOAT16 values' bits as ``uint16`` (numpy has no BFLOAT16 type of its own; view them as
``ml_dtypes.bfloat16``).

    /work/venv-torch/bin/python testdata/make_torch_bf16.py
"""

from __future__ import annotations

import importlib.util
import json
import platform
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # see make_torch_default_names.py

import ml_dtypes
import numpy as np
import onnx
import onnxscript
import torch
from onnx.reference import ReferenceEvaluator

_tc_spec = importlib.util.spec_from_file_location("torch_common", HERE / "torch_common.py")
tc = importlib.util.module_from_spec(_tc_spec)
_tc_spec.loader.exec_module(tc)
hp, functional_step, class_step, export = tc.hp, tc.functional_step, tc.class_step, tc.export

OUT = HERE / "torch_bf16"
TORCH_VERSION_REQUIRED = "2.13.0"
SEED = 20261202
STEPS = 3
ULPS = 8
EPS_BF16 = 2.0 ** -7  # BFLOAT16's machine epsilon (8-bit significand)


SHAPES = [(4, 3), (3,)]
CASES = [
    dict(name="sgd_momentum", hp=hp(), notes="momentum 0.9"),
    dict(name="sgd_wd", hp=hp(weight_decay=1e-4), notes="momentum 0.9, weight_decay 1e-4"),
    dict(name="sgd_dampening", hp=hp(dampening=0.25), notes="momentum 0.9, dampening 0.25"),
    dict(name="sgd_nesterov", hp=hp(lr=0.05, momentum=0.8, nesterov=True), notes="nesterov, lr 0.05, momentum 0.8"),
]


class Step(torch.nn.Module):
    """forward(p0, p1, g0, g1, b0, b1) -> (p0', p1', b0', b1')."""

    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, p0, p1, g0, g1, b0, b1):
        return functional_step([p0, p1], [g0, g1], [b0, b1], self.h)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().view(torch.int16).numpy().view(np.uint16).view(ml_dtypes.bfloat16)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)


def check_and_save(path, module, ins, outs, state, first, later) -> tuple[float, dict]:
    """Three chained steps, eager and in ONNX's reference evaluator (each fed its own previous state);
    write the ``.npz``; return the worst difference in BFLOAT16 ulps of each output's largest value."""
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    evaluator = ReferenceEvaluator(model)
    eager_feeds, onnx_feeds = dict(first), dict(first)
    arrays, worst = {}, 0.0
    for s in range(1, STEPS + 1):
        if s > 1:
            eager_feeds.update(later[s])
            onnx_feeds.update(later[s])
        eager_out = dict(zip(outs, (to_numpy(t) for t in module(*[from_numpy(eager_feeds[k]) for k in ins]))))
        onnx_out = dict(zip(outs, evaluator.run(outs, {k: onnx_feeds[k] for k in ins})))
        for name in outs:
            want, have = eager_out[name].astype(np.float64), np.asarray(onnx_out[name]).astype(np.float64)
            assert have.shape == want.shape and onnx_out[name].dtype == ml_dtypes.bfloat16, (path.name, name)
            scale = float(np.abs(want).max()) or 1.0
            ulps = float(np.abs(have - want).max()) / (EPS_BF16 * scale)
            assert ulps <= ULPS, (path.name, name, s, ulps)
            worst = max(worst, ulps)
        for i, name in enumerate(ins):
            arrays[f"s{s}_in_{i}"] = eager_feeds[name].view(np.uint16)
        for j, name in enumerate(outs):
            arrays[f"s{s}_out_{j}"] = eager_out[name].view(np.uint16)
        eager_feeds = dict(eager_feeds, **{state[o]: eager_out[o] for o in state})
        onnx_feeds = dict(onnx_feeds, **{state[o]: np.asarray(onnx_out[o]) for o in state})
    np.savez_compressed(path.with_suffix(".npz"), **arrays)
    return worst, {
        "file": path.name, "data": path.with_suffix(".npz").name,
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "ir_version": model.ir_version, "inputs": ins, "outputs": outs, "state": state,
        "onnx_vs_eager_max_difference_bf16_ulps_of_output_max": round(worst, 3),
    }


def main() -> None:
    assert torch.__version__.split("+")[0] == TORCH_VERSION_REQUIRED, torch.__version__
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    rng = np.random.default_rng(SEED)
    models = []
    for case in CASES:
        h = case["hp"]
        module = Step(h)

        def draw():
            return [rng.standard_normal(s).astype(np.float32).astype(ml_dtypes.bfloat16) for s in SHAPES]

        params, grads, bufs = draw(), draw(), draw()
        grads_later = {s: draw() for s in (2, 3)}

        t = lambda xs: [from_numpy(x) for x in xs]  # noqa: E731
        for a, b in zip(functional_step(t(params), t(grads), t(bufs), h), class_step(t(params), t(grads), t(bufs), h)):
            assert torch.equal(a, b), case["name"]

        args = tuple(t(params) + t(grads) + t(bufs))
        for exporter in ("dynamo", "legacy"):
            path = OUT / f"{case['name']}_{exporter}.onnx"
            export(module, args, path, exporter == "dynamo")
            model = onnx.load(str(path))
            ins = [i.name for i in model.graph.input]
            outs = [o.name for o in model.graph.output]
            assert len(ins) == 6 and len(outs) == 4, (path.name, ins, outs)
            p_in, g_in, b_in = ins[:2], ins[2:4], ins[4:]
            p_out, b_out = outs[:2], outs[2:]
            state = dict(zip(p_out, p_in)) | dict(zip(b_out, b_in))
            first = dict(zip(ins, params + grads + bufs))
            later = {s: dict(zip(g_in, grads_later[s])) for s in (2, 3)}
            worst, entry = check_and_save(path, module, ins, outs, state, first, later)
            entry.update(
                framework="torch", exporter=f"torch.onnx.export(dynamo={exporter == 'dynamo'})",
                exporter_defaults="no input_names/output_names; dynamo: optimize=True (default)",
                dtype="bfloat16", optimizer="torch.optim._functional.sgd (foreach=False)",
                updates=[
                    dict(parameter=p_in[k], gradient=g_in[k], momentum_buffer=b_in[k], parameter_out=p_out[k],
                         momentum_buffer_out=b_out[k], **h)
                    for k in range(2)
                ],
                expected_momentum_updates=2, notes=case["notes"],
            )
            models.append(entry)
            print(f"{path.name}: inputs {ins} outputs {outs} reference-vs-eager {worst:.3g} BFLOAT16 ulps")
    versions = {
        "python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__, "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
    }
    manifest = {
        "generator": "testdata/make_torch_bf16.py", "versions": versions,
        "data_layout": "s{step}_in_{i} = inputs[i] fed at step (1..3), s{step}_out_{j} = outputs[j] from eager torch; "
                       "each array holds the BFLOAT16 values' bits as uint16",
        "models": models,
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (OUT / "VERSIONS.txt").write_text("".join(f"{k} {v}\n" for k, v in versions.items()))


if __name__ == "__main__":
    main()
