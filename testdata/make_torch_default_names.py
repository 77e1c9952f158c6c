#!/usr/bin/env python
"""Regenerate testdata/torch_default_names/: PyTorch optimizer-only SGD steps exported with the
exporters' DEFAULT tensor names.

Unlike testdata/torch/ (exported with ``input_names``/``output_names``), nothing here is named by hand:

* ``*_dynamo.onnx``: ``torch.onnx.export(module, args, dynamo=True)``: inputs are named after the
  ``forward`` arguments (``p0, p1, g0, g1, b0, b1``), outputs after the FX nodes (``add``, ``add_1``...).
* ``*_legacy.onnx``: ``torch.onnx.export(module, args, dynamo=False)`` (TorchScript): whatever names
  the tracer gives (numbers such as ``11`` for outputs, ``onnx::...`` for values).

Every update is PyTorch's own ``torch.optim._functional.sgd(..., foreach=False)`` on clones of the
inputs, with real momentum buffers (a step after the first: ``buf = m*buf + (1-d)*g``). The eager
functional step is checked against ``torch.optim.SGD`` with pre-set ``momentum_buffer`` state; the
ONNX files against eager PyTorch over three chained steps (corpus_common.check_and_save).

The manifest's role names are read back from each file by POSITION (the forward signature fixes the
input order, the return tuple the output order), never by analysing the graph.

    /work/venv-torch/bin/python testdata/make_torch_default_names.py
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import sys
from pathlib import Path

# testdata/ holds folders named keras/, jax/ and torch/. Python puts the script's folder first on sys.path,
# where such a folder imports as an empty namespace package wherever the real package is not installed
# (Keras probes for jax, for one). Keep the folder off the path; corpus_common is loaded from it by file.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import numpy as np
import onnx
import onnxruntime
import onnxscript
import torch

_spec = importlib.util.spec_from_file_location("corpus_common", HERE / "corpus_common.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)
_tc_spec = importlib.util.spec_from_file_location("torch_common", HERE / "torch_common.py")
tc = importlib.util.module_from_spec(_tc_spec)
_tc_spec.loader.exec_module(tc)
hp, functional_step, class_step, export = tc.hp, tc.functional_step, tc.class_step, tc.export

OUT = HERE / "torch_default_names"
TORCH_VERSION_REQUIRED = "2.13.0"
SEED = 20261201


TWO = [(4, 3), (3,)]
THREE = [(4, 3), (3,), (2, 5)]
CASES = [
    dict(name="sgd_momentum", shapes=TWO, hp=hp(), notes="momentum 0.9"),
    dict(name="sgd_dampening", shapes=TWO, hp=hp(dampening=0.25), notes="momentum 0.9, dampening 0.25"),
    dict(name="sgd_wd", shapes=TWO, hp=hp(weight_decay=1e-4), notes="momentum 0.9, weight_decay 1e-4"),
    dict(name="sgd_nesterov", shapes=TWO, hp=hp(nesterov=True), notes="nesterov, momentum 0.9"),
    dict(name="sgd_multi", shapes=THREE, hp=hp(lr=0.01, momentum=0.8, weight_decay=5e-4),
         notes="three parameters, lr 0.01, momentum 0.8, weight_decay 5e-4"),
]


class Step2(torch.nn.Module):
    """forward(p0, p1, g0, g1, b0, b1) -> (p0', p1', b0', b1')."""

    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, p0, p1, g0, g1, b0, b1):
        return functional_step([p0, p1], [g0, g1], [b0, b1], self.h)


class Step3(torch.nn.Module):
    """forward(p0, p1, p2, g0, g1, g2, b0, b1, b2) -> (p0', p1', p2', b0', b1', b2')."""

    def __init__(self, h):
        super().__init__()
        self.h = h

    def forward(self, p0, p1, p2, g0, g1, g2, b0, b1, b2):
        return functional_step([p0, p1, p2], [g0, g1, g2], [b0, b1, b2], self.h)


def main() -> None:
    assert torch.__version__.split("+")[0] == TORCH_VERSION_REQUIRED, torch.__version__
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    rng = np.random.default_rng(SEED)
    models = []
    for case in CASES:
        n = len(case["shapes"])
        h = case["hp"]
        module = (Step2 if n == 2 else Step3)(h)

        def draw(shapes=case["shapes"]):
            return [rng.standard_normal(s).astype(np.float32) for s in shapes]

        params, grads, bufs = draw(), draw(), draw()
        grads_later = {s: draw() for s in (2, 3)}

        # the eager functional step equals the torch.optim.SGD class step
        t = lambda xs: [torch.from_numpy(x) for x in xs]  # noqa: E731
        got = functional_step(t(params), t(grads), t(bufs), h)
        want = class_step(t(params), t(grads), t(bufs), h)
        for a, b in zip(got, want):
            assert torch.equal(a, b), case["name"]

        args = tuple(t(params) + t(grads) + t(bufs))
        for exporter in ("dynamo", "legacy"):
            path = OUT / f"{case['name']}_{exporter}.onnx"
            export(module, args, path, exporter == "dynamo")
            model = onnx.load(str(path))
            ins = [i.name for i in model.graph.input]
            outs = [o.name for o in model.graph.output]
            assert len(ins) == 3 * n and len(outs) == 2 * n, (path.name, ins, outs)
            p_in, g_in, b_in = ins[:n], ins[n:2 * n], ins[2 * n:]
            p_out, b_out = outs[:n], outs[n:]
            state = dict(zip(p_out, p_in)) | dict(zip(b_out, b_in))

            def eager(feeds, ins=ins, outs=outs):
                result = module(*[torch.from_numpy(feeds[k]) for k in ins])
                return {name: r.detach().numpy() for name, r in zip(outs, result)}

            first = dict(zip(ins, params + grads + bufs))
            steps = cc.eager_chain(eager, first, state, lambda s, g_in=g_in: dict(zip(g_in, grads_later[s])))
            entry = cc.check_and_save(path, steps, state)
            entry.update(
                framework="torch", exporter=f"torch.onnx.export(dynamo={exporter == 'dynamo'})",
                exporter_defaults="no input_names/output_names; dynamo: optimize=True (default)",
                dtype="float32", optimizer="torch.optim._functional.sgd (foreach=False)",
                updates=[
                    dict(parameter=p_in[k], gradient=g_in[k], momentum_buffer=b_in[k], parameter_out=p_out[k],
                         momentum_buffer_out=b_out[k], **h)
                    for k in range(n)
                ],
                expected_momentum_updates=n, notes=case["notes"],
            )
            models.append(entry)
            print(f"{path.name}: inputs {ins} outputs {outs} onnx-vs-eager {entry['onnx_vs_eager_max_normwise_difference']:.3g}")
    versions = {
        "python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
    }
    cc.write_manifest(OUT / "manifest.json", {
        "generator": "testdata/make_torch_default_names.py", "versions": versions,
        "data_layout": "s{step}_in_{i} = inputs[i] fed at step (1..3), s{step}_out_{j} = outputs[j] from eager torch",
        "models": models,
    })
    (OUT / "VERSIONS.txt").write_text("".join(f"{k} {v}\n" for k, v in versions.items()))


if __name__ == "__main__":
    main()
