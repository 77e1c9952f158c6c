#!/usr/bin/env python
"""Regenerate testdata/jax/: optax ``sgd(momentum=...)`` steps written in JAX, exported with jax2onnx.

optax.sgd(learning_rate, momentum, nesterov) is ``chain(trace(decay=momentum, nesterov),
scale_by_learning_rate(learning_rate))``: the trace (momentum buffer) is

    t' = g + momentum * t
    u  = t'                    (nesterov: u = g + momentum * t')
    p' = p - lr * u            (optax.apply_updates(p, -lr * u))

which is PyTorch's form with dampening 0 (the trace starts at zero, so the first step gives t' = g,
as PyTorch's first step does). Every number comes from optax; nothing is written by hand.

Kinds (params, traces, and gradients or data, and ``lr`` when it is an input, are graph inputs; new
params and new traces, then the loss, are outputs; names given with input_names/output_names):

* ``jax_opt_*``: optimizer only, parameters ``w`` [4,3], ``b`` [3].
* ``jax_mlp_*``: a whole step of a 2-layer MLP (x [8,4] -> 8 ReLU -> 3 logits), mean log-softmax
  cross-entropy against one-hot ``y``, gradients by ``jax.value_and_grad``, then the optax update.

The eager reference is the same function run by JAX itself (not jitted); the ONNX file is checked
against it over three chained steps (corpus_common.check_and_save). Traces start at zero (optax's
``init``).

    /work/venv-jax/bin/python testdata/make_jax_models.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.metadata
import importlib.util
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# testdata/ holds folders named keras/, jax/ and torch/. Python puts the script's folder first on sys.path,
# where such a folder imports as an empty namespace package wherever the real package is not installed
# (Keras probes for jax, for one). Keep the folder off the path; corpus_common is loaded from it by file.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax2onnx  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime  # noqa: E402
import optax  # noqa: E402

_spec = importlib.util.spec_from_file_location("corpus_common", HERE / "corpus_common.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

OUT = HERE / "jax"
SEED = 20261203

OPT_PARAMS = [("w", (4, 3)), ("b", (3,))]
MLP_PARAMS = [("w1", (4, 8)), ("b1", (8,)), ("w2", (8, 3)), ("b2", (3,))]
MLP_DATA = [("x", (8, 4)), ("y", (8, 3))]
MOMENTUM = 0.9
LR_INPUT_VALUES = {1: 0.05, 2: 0.02, 3: 0.01}

# (kind, nesterov, lr); lr None: the graph input "lr" (float32, shape []).
CASES = [
    ("opt", False, 0.1), ("opt", True, 1e-3), ("opt", False, 1e-8), ("opt", False, None), ("opt", True, None),
    ("mlp", False, 0.05), ("mlp", True, 1e-3),
]


def mlp_loss(params, x, y):
    w1, b1, w2, b2 = params
    # Products written as broadcast multiply + sum: jax2onnx writes the weight gradient's dot_general
    # (contracting the leading batch axes of both operands) as a Gemm without transA, which onnxruntime
    # refuses to load ("Dimension mismatch in unification"); a unit batch dimension did not avoid it here.
    hidden = jnp.maximum(jnp.sum(x[:, :, None] * w1[None, :, :], axis=1) + b1, 0.0)
    logits = jnp.sum(hidden[:, :, None] * w2[None, :, :], axis=1) + b2
    return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), axis=1))


def names(kind):
    params = [n for n, _ in (OPT_PARAMS if kind == "opt" else MLP_PARAMS)]
    return params, [f"trace_{n}" for n in params]


def make_step(kind, nesterov, lr):
    """step(*params, *traces, *(grads | x, y), [lr]) -> (*new params, *new traces, [loss])."""
    params, _ = names(kind)
    k = len(params)

    def step(*args):
        p, t = tuple(args[:k]), tuple(args[k:2 * k])
        rate = args[-1] if lr is None else lr
        opt = optax.sgd(learning_rate=rate, momentum=MOMENTUM, nesterov=nesterov)
        state = opt.init(p)
        state = (state[0]._replace(trace=t),) + tuple(state[1:])
        if kind == "opt":
            grads, loss = tuple(args[2 * k:3 * k]), None
        else:
            loss, grads = jax.value_and_grad(mlp_loss)(p, args[2 * k], args[2 * k + 1])
        updates, new_state = opt.update(grads, state, p)
        new_p = optax.apply_updates(p, updates)
        return tuple(new_p) + tuple(new_state[0].trace) + ((loss,) if loss is not None else ())

    return step


def signature(kind, lr):
    params, traces = names(kind)
    shapes = dict(OPT_PARAMS + MLP_PARAMS + MLP_DATA)
    spec = [(n, shapes[n]) for n in params] + [(t, shapes[n]) for t, n in zip(traces, params)]
    spec += [(f"g_{n}", shapes[n]) for n in params] if kind == "opt" else list(MLP_DATA)
    if lr is None:
        spec.append(("lr", ()))
    return spec


def output_names(kind):
    params, traces = names(kind)
    return [f"{n}_new" for n in params] + [f"{t}_new" for t in traces] + ([] if kind == "opt" else ["loss"])


def draw(rng, kind, spec, lr):
    params, traces = names(kind)
    # Parameters at scale 1e-6 when lr <= 1e-6, so that their update stays visible in float32.
    scale = 1e-6 if kind == "opt" and lr is not None and lr <= 1e-6 else 1.0
    feeds = {}
    for n, shape in spec:
        if n in traces:
            feeds[n] = np.zeros(shape, np.float32)
        elif n == "lr":
            feeds[n] = np.array(LR_INPUT_VALUES[1], np.float32)
        elif n == "y":
            feeds[n] = np.eye(shape[1], dtype=np.float32)[rng.integers(0, shape[1], shape[0])]
        elif n in params:
            feeds[n] = (scale * rng.standard_normal(shape)).astype(np.float32)
        else:
            feeds[n] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    rng = np.random.default_rng(SEED)
    models = []
    for kind, nesterov, lr in CASES:
        rate = "lr_input" if lr is None else f"lr{lr:g}"
        name = f"jax_{kind}_{'nesterov' if nesterov else 'momentum'}_{rate}"
        path = OUT / f"{name}.onnx"
        step = make_step(kind, nesterov, lr)
        spec = signature(kind, lr)
        ins = [n for n, _ in spec]
        outs = output_names(kind)
        model = jax2onnx.to_onnx(
            step, [jax.ShapeDtypeStruct(s, jnp.float32) for _, s in spec], model_name=name,
            input_names=ins, output_names=outs,
        )
        onnx.save(model, str(path))
        assert [i.name for i in model.graph.input] == ins and [o.name for o in model.graph.output] == outs
        params, traces = names(kind)
        k = len(params)
        state = dict(zip(outs[:k], params)) | dict(zip(outs[k:2 * k], traces))
        first = draw(rng, kind, spec, lr)

        def fresh(s, kind=kind, spec=spec, params=params, traces=traces, lr=lr):
            new = {n: v for n, v in draw(rng, kind, spec, lr).items() if n not in params and n not in traces}
            if "lr" in new:
                new["lr"] = np.array(LR_INPUT_VALUES[s], np.float32)
            return new

        def eager(feeds, step=step, ins=ins, outs=outs):
            with jax.disable_jit():
                result = step(*[jnp.asarray(feeds[n]) for n in ins])
            return {n: np.asarray(r) for n, r in zip(outs, result)}

        steps = cc.eager_chain(eager, first, state, fresh)
        entry = cc.check_and_save(path, steps, state)
        lr_field = "input:lr" if lr is None else lr
        entry.update(
            framework="jax", exporter="jax2onnx.to_onnx (default opset)", dtype="float32",
            optimizer=f"optax.sgd(momentum={MOMENTUM}, nesterov={nesterov})",
            kind="optimizer-only" if kind == "opt" else "whole step (forward, log-softmax CE loss, value_and_grad, optax)",
            updates=[
                dict(parameter=params[i], gradient=f"g_{params[i]}" if kind == "opt" else None,
                     momentum_buffer=traces[i], parameter_out=outs[i], momentum_buffer_out=outs[k + i],
                     form="optax-trace", lr=lr_field, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
                     nesterov=nesterov, maximize=False)
                for i in range(k)
            ],
            expected_momentum_updates=k,
            notes=("optax trace t' = g + mu*t, p' = p - lr*t' (nesterov: p' = p - lr*(g + mu*t')): the SGD "
                   "operator with gradient g, learning rate lr, dampening 0, traces starting at zero."
                   + (" Parameters drawn at scale 1e-6 so the update is visible in float32."
                      if kind == "opt" and lr is not None and lr <= 1e-6 else "")
                   + (f" lr fed at steps 1,2,3: {list(LR_INPUT_VALUES.values())}." if lr is None else "")),
        )
        models.append(entry)
        print(f"{path.name}: onnx-vs-eager {entry['onnx_vs_eager_max_normwise_difference']:.3g} "
              f"({entry['onnx_vs_eager_max_difference_ulps_of_output_max']} ulps of max), opset {entry['opset']}")
    versions = {
        "python": platform.python_version(), "jax": jax.__version__, "optax": optax.__version__,
        "jax2onnx": importlib.metadata.version("jax2onnx"), "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
    }
    cc.write_manifest(OUT / "manifest.json", {
        "generator": "testdata/make_jax_models.py", "versions": versions,
        "data_layout": "s{step}_in_{i} = inputs[i] fed at step (1..3), s{step}_out_{j} = outputs[j] from eager JAX",
        "models": models,
    })
    (OUT / "VERSIONS.txt").write_text("".join(f"{k} {v}\n" for k, v in versions.items()))


if __name__ == "__main__":
    main()
