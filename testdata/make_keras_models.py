#!/usr/bin/env python
"""Regenerate testdata/keras/: Keras 3 SGD steps (TensorFlow backend) exported with tf2onnx.

Keras's SGD (keras/src/optimizers/sgd.py, ``SGD.update_step``) is the velocity form:

    m' = momentum * m - lr * g
    w' = w + m'                                   (plain)
    w' = w + momentum * m' - lr * g               (nesterov=True)

tf2onnx cannot freeze a stateful ``tf.function`` that calls ``apply_gradients`` (it fails on the
resource variables), and Keras's ``stateless_apply`` is not available on the TensorFlow backend. So the
exported step runs Keras's own ``SGD.update_step`` on plain tensors: a subclass replaces only
``assign``/``assign_add``/``assign_sub`` (the variable writes) and ``_get_variable_index`` (the slot
lookup) so that they rebind Python-side holders instead of writing tf.Variables. All update arithmetic
is Keras's. The eager reference is the real thing: ``keras.Variable`` parameters, a real
``keras.optimizers.SGD`` with its momentum slots set from the inputs, and ``apply_gradients``; the whole
step computes gradients with ``tf.GradientTape`` on the same forward.

Two kinds of step, each with params, momentum slots (and gradients or data, and ``lr`` when it is an
input) as graph inputs, and new params and new slots as outputs:

* ``keras_opt_*``: optimizer only, parameters ``w`` [4,3] and ``b`` [3], gradients are inputs.
* ``keras_mlp_*``: a whole step of a 2-layer MLP (x [8,4] -> 8 ReLU -> 3 logits), loss = mean
  log-softmax cross-entropy against one-hot ``y`` (written with ``tf.nn.log_softmax``: tf2onnx fails on
  ``softmax_cross_entropy_with_logits``), gradients by ``tf.GradientTape``; gradients are internal.

The momentum slots start at zero (as Keras initialises them), so the first step's slot is exactly
-lr*g and small learning rates stay visible in float32. The ``lr1e-6``/``lr1e-8`` optimizer-only
steps draw parameters at scale 1e-6 for the same reason.

    /work/venv-tf/bin/python testdata/make_keras_models.py
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

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

import keras  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402

_spec = importlib.util.spec_from_file_location("corpus_common", HERE / "corpus_common.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

OUT = HERE / "keras"
SEED = 20261202

OPT_PARAMS = [("w", (4, 3)), ("b", (3,))]
MLP_PARAMS = [("w1", (4, 8)), ("b1", (8,)), ("w2", (8, 3)), ("b2", (3,))]
MLP_DATA = [("x", (8, 4)), ("y", (8, 3))]

# (kind, nesterov, lr) - lr None means lr is the graph input "lr" (float32, shape []).
CASES = [
    ("opt", False, 0.1), ("opt", True, 0.1), ("opt", False, 1e-3), ("opt", True, 1e-6),
    ("opt", False, 1e-8), ("opt", True, 1e-8), ("opt", False, None), ("opt", True, None),
    ("mlp", False, 0.1), ("mlp", True, 1e-3), ("mlp", False, 1e-6), ("mlp", True, None),
]
MOMENTUM = 0.9
LR_INPUT_VALUES = {1: 0.05, 2: 0.02, 3: 0.01}  # the runtime learning rate fed at steps 1, 2, 3


class _Holder:
    """A Python-side stand-in for a Keras variable: the current value (a tf tensor) and its slot index."""

    def __init__(self, value, index):
        self.value = value
        self.index = index

    @property
    def dtype(self):
        return self.value.dtype

    @property
    def shape(self):
        return self.value.shape


tf.register_tensor_conversion_function(
    _Holder, lambda h, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(h.value, dtype=dtype)
)


class TensorSGD(keras.optimizers.SGD):
    """keras.optimizers.SGD whose variable writes rebind _Holder values (traceable, stateless)."""

    def assign(self, variable, value):
        variable.value = tf.cast(value, variable.dtype)

    def assign_add(self, variable, value):
        variable.value = variable.value + tf.cast(value, variable.dtype)

    def assign_sub(self, variable, value):
        variable.value = variable.value - tf.cast(value, variable.dtype)

    def _get_variable_index(self, variable):
        return variable.index


def keras_update(opt, params, grads, slots, lr):
    """Keras's SGD.update_step (of ``opt``, a TensorSGD) on tensors: returns (new params, new slots)."""
    ps = [_Holder(p, i) for i, p in enumerate(params)]
    opt.momentums = [_Holder(m, i) for i, m in enumerate(slots)]
    for p, g in zip(ps, grads):
        opt.update_step(g, p, lr)
    return [p.value for p in ps], [m.value for m in opt.momentums]


def mlp_loss(x, y, w1, b1, w2, b2):
    # ReLU written as maximum(z, 0): tf.nn.relu's gradient op ReluGrad has no tf2onnx handler (the export
    # then holds a ReluGrad node no runtime knows); Maximum's gradient is ordinary ops (GreaterEqual, Select).
    hidden = tf.maximum(tf.matmul(x, w1) + b1, 0.0)
    logits = tf.matmul(hidden, w2) + b2
    return -tf.reduce_mean(tf.reduce_sum(y * tf.nn.log_softmax(logits), axis=1))


def names(kind):
    params = [n for n, _ in (OPT_PARAMS if kind == "opt" else MLP_PARAMS)]
    return params, [f"m_{n}" for n in params]


def traced_step(kind, nesterov, lr):
    """The tf.function to export, with its input signature (names are the graph input names)."""
    params, slots = names(kind)
    shapes = dict(OPT_PARAMS + MLP_PARAMS + MLP_DATA)
    spec = lambda n, s: tf.TensorSpec(s, tf.float32, name=n)  # noqa: E731
    signature = [spec(n, shapes[n]) for n in params] + [spec(s, shapes[n]) for s, n in zip(slots, params)]
    if kind == "opt":
        signature += [spec(f"g_{n}", shapes[n]) for n in params]
    else:
        signature += [spec(n, s) for n, s in MLP_DATA]
    if lr is None:
        signature.append(spec("lr", ()))
    k = len(params)
    # Created outside the traced function: a Keras optimizer creates tf.Variables (its iteration count).
    # Its learning_rate is unused: update_step gets the step's rate as an argument.
    opt = TensorSGD(learning_rate=0.01, momentum=MOMENTUM, nesterov=nesterov)

    def step(*args):
        p, m = list(args[:k]), list(args[k:2 * k])
        rate = args[-1] if lr is None else lr
        if kind == "opt":
            grads = list(args[2 * k:3 * k])
            loss = None
        else:
            x, y = args[2 * k], args[2 * k + 1]
            with tf.GradientTape() as tape:
                tape.watch(p)
                loss = mlp_loss(x, y, *p)
            grads = tape.gradient(loss, p)
        new_p, new_m = keras_update(opt, p, grads, m, rate)
        return tuple(new_p + new_m + ([loss] if loss is not None else []))

    return step, signature


def eager_keras(kind, nesterov, lr, feeds, out_names):
    """The real Keras step: keras.Variables, keras.optimizers.SGD with its slots set, apply_gradients."""
    params, slots = names(kind)
    rate = float(feeds["lr"]) if lr is None else lr
    variables = [keras.Variable(feeds[n], name=n) for n in params]
    opt = keras.optimizers.SGD(learning_rate=rate, momentum=MOMENTUM, nesterov=nesterov)
    opt.build(variables)
    for slot, s in zip(opt.momentums, slots):
        slot.assign(feeds[s])
    loss = None
    if kind == "opt":
        grads = [tf.constant(feeds[f"g_{n}"]) for n in params]
    else:
        with tf.GradientTape() as tape:
            loss = mlp_loss(tf.constant(feeds["x"]), tf.constant(feeds["y"]), *[v.value for v in variables])
        grads = tape.gradient(loss, [v.value for v in variables])
    opt.apply_gradients(zip(grads, variables))
    values = [v.numpy() for v in variables] + [m.numpy() for m in opt.momentums]
    if loss is not None:
        values.append(loss.numpy())
    return dict(zip(out_names, values))


def case_name(kind, nesterov, lr):
    rate = "lr_input" if lr is None else f"lr{lr:g}"
    return f"keras_{kind}_{'nesterov' if nesterov else 'momentum'}_{rate}"


def draw_inputs(rng, kind, lr, signature):
    params, slots = names(kind)
    scale = 1e-6 if kind == "opt" and lr is not None and lr <= 1e-6 else 1.0
    feeds = {}
    for spec in signature:
        n, shape = spec.name, tuple(spec.shape)
        if n in slots:
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
        name = case_name(kind, nesterov, lr)
        path = OUT / f"{name}.onnx"
        step, signature = traced_step(kind, nesterov, lr)
        model, _ = tf2onnx.convert.from_function(tf.function(step), input_signature=signature)
        onnx.save(model, str(path))
        ins = [i.name for i in model.graph.input]
        outs = [o.name for o in model.graph.output]
        assert ins == [s.name for s in signature], (ins, signature)
        params, slots = names(kind)
        k = len(params)
        p_out, m_out = outs[:k], outs[k:2 * k]
        state = dict(zip(p_out, params)) | dict(zip(m_out, slots))
        first = draw_inputs(rng, kind, lr, signature)

        def fresh(s, kind=kind, lr=lr, signature=signature):
            new = draw_inputs(rng, kind, lr, signature)
            new = {n: v for n, v in new.items() if n not in params and n not in slots}
            if "lr" in new:
                new["lr"] = np.array(LR_INPUT_VALUES[s], np.float32)
            return new

        steps = cc.eager_chain(
            lambda feeds, kind=kind, nesterov=nesterov, lr=lr, outs=outs: eager_keras(kind, nesterov, lr, feeds, outs),
            first, state, fresh,
        )
        # The traced (tensor) update equals the real Keras step bit for bit when run eagerly.
        got = step(*[tf.constant(steps[0][0][s.name]) for s in signature])
        for n, g in zip(outs, got):
            np.testing.assert_allclose(g.numpy(), steps[0][1][n], rtol=1e-6, atol=0, err_msg=f"{name} {n}")
        entry = cc.check_and_save(path, steps, state)
        lr_field = "input:lr" if lr is None else lr
        entry.update(
            framework="keras", exporter="tf2onnx.convert.from_function (default opset)", dtype="float32",
            optimizer=f"keras.optimizers.SGD(momentum={MOMENTUM}, nesterov={nesterov}).update_step",
            kind="optimizer-only" if kind == "opt" else "whole step (forward, log-softmax CE loss, GradientTape, SGD)",
            updates=[
                dict(
                    parameter=params[i], gradient=f"g_{params[i]}" if kind == "opt" else None,
                    momentum_buffer=slots[i], parameter_out=p_out[i], momentum_buffer_out=m_out[i],
                    form="keras-velocity", lr=lr_field, momentum=MOMENTUM, nesterov=nesterov,
                    dampening=0.0, weight_decay=0.0, maximize=False,
                    sgd_operator=dict(
                        gradient="lr*g (the graph's own product of the gradient and the learning rate)",
                        learning_rate=-1.0, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
                        nesterov=nesterov, maximize=True,
                    ),
                )
                for i in range(k)
            ],
            expected_momentum_updates=k,
            notes=(
                "Keras velocity form m' = mu*m - lr*g, w' = w + m' (nesterov: w' = w + mu*m' - lr*g). "
                "In the SGD operator's terms (accum' = mu*accum + G~, G~ = -G when maximize; w' = w - LR*u with "
                "u = accum' or G~ + mu*accum' when nesterov) the buffer stays the Keras slot only as: gradient "
                "G = lr*g, maximize, learning_rate -1, dampening 0. The other way, gradient g with learning rate "
                "lr, needs the buffer scaled: accum = -m/lr (then accum' = mu*accum + g = -m'/lr and "
                "w' = w - lr*accum' = w + m'), so the graph's slot output is not the operator's accum."
                + (" Parameters drawn at scale 1e-6 so the update is visible in float32." if kind == "opt" and lr is not None and lr <= 1e-6 else "")
                + (f" lr fed at steps 1,2,3: {list(LR_INPUT_VALUES.values())}." if lr is None else "")
            ),
        )
        models.append(entry)
        print(f"{path.name}: inputs {ins} outputs {outs} onnx-vs-eager {entry['onnx_vs_eager_max_normwise_difference']:.3g}"
              f" ({entry['onnx_vs_eager_max_difference_ulps_of_output_max']} ulps of max)")
    versions = {
        "python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
        "tf2onnx": tf2onnx.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
    }
    cc.write_manifest(OUT / "manifest.json", {
        "generator": "testdata/make_keras_models.py", "versions": versions,
        "data_layout": "s{step}_in_{i} = inputs[i] fed at step (1..3), s{step}_out_{j} = outputs[j] from eager Keras",
        "models": models,
    })
    (OUT / "VERSIONS.txt").write_text("".join(f"{k} {v}\n" for k, v in versions.items()))


if __name__ == "__main__":
    main()
