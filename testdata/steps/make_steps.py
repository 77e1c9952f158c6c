#!/usr/bin/env python
"""Regenerate testdata/steps/: whole training steps exported by PyTorch's dynamo ONNX exporter.

Each model is one full step: forward, loss, ``torch.autograd.grad``, then PyTorch's own SGD code
(``torch.optim._functional.sgd(..., foreach=False)``, the single-tensor path of ``torch.optim.SGD``) with
momentum. The step is traced to an aten FX graph with ``make_fx`` and that graph is exported with
``torch.onnx.export(dynamo=True)``, the exporter's default names kept (outputs are FX names such as
``add_14``; inputs are the step function's argument names).

Workarounds (each one keeps eager PyTorch's numbers; see README.md):

* convolution written as ``F.unfold`` + matmul (the exporter has no ONNX function for
  ``aten.convolution_backward``); the backward then holds ``Col2Im``;
* ``native_batch_norm`` and ``nll_loss_forward/backward`` decomposed while tracing (exported as they are,
  the running statistics are not updated and the cross-entropy gradient is scaled wrongly), and
  ``max_pool2d_with_indices_backward`` (the exporter has no ONNX function for it);
* ``mean((2, 3))`` instead of adaptive average pooling.

Models (float32, batch 16 where BatchNorm is used):

* ``cnn_bn``: conv-BN-ReLU-maxpool-conv-BN-ReLU-mean-linear, cross-entropy, SGD momentum 0.9,
  weight decay 5e-4;
* ``cnn_clip``: the same net, gradients clipped by their global norm (``clip_grad_norm_`` logic,
  max norm 1.0), SGD momentum 0.9 with dampening 0.25;
* ``gpt_tiny``: token + position embedding, one pre-LN transformer block (causal attention, GELU MLP),
  final LayerNorm, linear head, cross-entropy; learning rate from a StepLR schedule computed in the graph
  from a ``step`` input (``lr0 * 0.5 ** floor(step / 10)``); SGD momentum 0.9, Nesterov;
* ``mlp_amp``: a loss-scaled step: loss times ``scale``, gradients unscaled by ``1 / scale``,
  ``found_inf`` from non-finite gradients, parameters and buffers kept when it is set (``torch.where``);
  SGD momentum 0.9;
* ``cnn_frozen``: frozen features written with native layers (``F.conv2d`` with bias, inference
  ``F.batch_norm``, max and average pooling; no gradient flows into them, so the exporter keeps ``Conv``,
  ``BatchNormalization``, ``MaxPool``, ``AveragePool``) and a trained linear head; SGD momentum 0.9,
  Nesterov, weight decay 1e-4;
* ``resnet_small``: ResNet-18's shape (7x7 stem, max pool, four stages of two basic blocks, 1x1
  downsampling, mean pool, linear) at 4 base channels (4, 8, 16, 32) on 16x3x16x16 inputs; SGD momentum
  0.9, weight decay 1e-4.

Each file is checked against eager PyTorch over 3 chained steps (onnxruntime gets its own outputs back as
state); inputs, the data of each step, eager PyTorch's loss at every step and all its outputs after the
last step are written to ``<model>.npz`` (kept small); ``manifest.json`` names the role of every
input and which output feeds which input on the next step.

Run with torch 2.13.0 (CPU) and onnx, onnxscript, onnxruntime in one venv:

    /work/venv-torch/bin/python testdata/steps/make_steps.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript
import torch
import torch.nn.functional as F
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.optim._functional import sgd

HERE = Path(__file__).resolve().parent
SEED = 20261201
STEPS = 3
# onnxruntime vs eager, float32, 3 chained steps: max |difference| of an output <= ATOL + RTOL * max |eager value|
# of it. Per output, not per element: through BatchNorm over a few values (the ResNet's last stages run at 1x1),
# a summation-order difference of 1e-7 grows to ~1e-4 of an output's largest value by the third step. The
# export errors this check is for (a gradient scaled by the batch size, running statistics not updated) are
# errors of order 1 (observed figures in manifest.json).
RTOL, ATOL = 1e-3, 1e-5

aten = torch.ops.aten
DECOMPOSITIONS = get_decompositions(
    [
        aten.native_batch_norm,
        aten._native_batch_norm_legit_functional,
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_no_training,
        aten.native_batch_norm_backward,
        aten.nll_loss_forward,
        aten.nll_loss_backward,
        aten.max_pool2d_with_indices_backward,
    ]
)

# Steps that keep native convolution and inference BatchNorm (nothing trains through them) keep only the loss
# decompositions, so the exporter writes Conv and BatchNormalization.
NATIVE_DECOMPOSITIONS = get_decompositions([aten.nll_loss_forward, aten.nll_loss_backward])


# ---- layers (functional; parameters are step inputs) -----------------------------------------------------


def conv2d(x: torch.Tensor, w: torch.Tensor, stride: int = 1, padding: int = 0) -> torch.Tensor:
    """``F.conv2d`` without bias, as unfold + matmul (agrees with conv2d to ~2e-7)."""
    n, _, h, width = x.shape
    out_channels, _, kh, kw = w.shape
    cols = F.unfold(x, (kh, kw), padding=padding, stride=stride)
    oh = (h + 2 * padding - kh) // stride + 1
    ow = (width + 2 * padding - kw) // stride + 1
    return (w.reshape(out_channels, -1) @ cols).reshape(n, out_channels, oh, ow)


def batch_norm(x, weight, bias, running_mean, running_var):
    """Training-mode BatchNorm; returns the output and the updated running statistics (momentum 0.1)."""
    mean, var = running_mean.clone(), running_var.clone()
    y = F.batch_norm(x, mean, var, weight, bias, training=True, momentum=0.1, eps=1e-5)
    return y, mean, var


class Spec:
    """A step's parameter and buffer layout: names, shapes, initialisers."""

    def __init__(self) -> None:
        self.params: list[tuple[str, tuple[int, ...]]] = []
        self.stats: list[tuple[str, tuple[int, ...]]] = []  # BatchNorm running statistics
        self.frozen: list[tuple[str, tuple[int, ...]]] = []  # inputs the step reads but does not train

    def param(self, name: str, shape: tuple[int, ...]) -> str:
        self.params.append((name, shape))
        return name

    def bn(self, name: str, channels: int) -> str:
        self.param(f"{name}_weight", (channels,))
        self.param(f"{name}_bias", (channels,))
        self.stats.append((f"{name}_mean", (channels,)))
        self.stats.append((f"{name}_var", (channels,)))
        return name


# ---- CNN ---------------------------------------------------------------------------------------------------


def cnn_spec() -> Spec:
    s = Spec()
    s.param("conv1", (8, 3, 3, 3))
    s.bn("bn1", 8)
    s.param("conv2", (16, 8, 3, 3))
    s.bn("bn2", 16)
    s.param("fc_weight", (10, 16))
    s.param("fc_bias", (10,))
    return s


def cnn_forward(p, st, x):
    new_stats = {}

    def bn(h, name):
        y, m, v = batch_norm(h, p[f"{name}_weight"], p[f"{name}_bias"], st[f"{name}_mean"], st[f"{name}_var"])
        new_stats[f"{name}_mean"], new_stats[f"{name}_var"] = m, v
        return y

    h = F.relu(bn(conv2d(x, p["conv1"], padding=1), "bn1"))
    h = F.max_pool2d(h, 2)
    h = F.relu(bn(conv2d(h, p["conv2"], padding=1), "bn2"))
    h = h.mean((2, 3))
    return F.linear(h, p["fc_weight"], p["fc_bias"]), new_stats


def frozen_spec() -> Spec:
    s = Spec()
    s.frozen += [("conv1", (8, 3, 3, 3)), ("conv1_bias", (8,)), ("bn1_weight", (8,)), ("bn1_bias", (8,))]
    s.frozen += [("bn1_mean", (8,)), ("bn1_var", (8,))]
    s.param("fc_weight", (10, 8))
    s.param("fc_bias", (10,))
    return s


def frozen_forward(p, st, x):
    """Frozen features (native convolution, inference BatchNorm, max and average pooling), a trained head."""
    h = F.conv2d(x, p["conv1"], p["conv1_bias"], padding=1)
    h = F.batch_norm(h, p["bn1_mean"], p["bn1_var"], p["bn1_weight"], p["bn1_bias"], training=False, eps=1e-5)
    h = F.avg_pool2d(F.max_pool2d(F.relu(h), 2), 2)
    return F.linear(h.mean((2, 3)), p["fc_weight"], p["fc_bias"]), {}


# ---- ResNet-18 shape ----------------------------------------------------------------------------------------


RESNET_WIDTHS = (4, 8, 16, 32)


def resnet_spec() -> Spec:
    s = Spec()
    s.param("conv1", (RESNET_WIDTHS[0], 3, 7, 7))
    s.bn("bn1", RESNET_WIDTHS[0])
    in_ch = RESNET_WIDTHS[0]
    for stage, width in enumerate(RESNET_WIDTHS, start=1):
        for block in range(2):
            prefix = f"layer{stage}_{block}"
            stride = 2 if stage > 1 and block == 0 else 1
            s.param(f"{prefix}_conv1", (width, in_ch, 3, 3))
            s.bn(f"{prefix}_bn1", width)
            s.param(f"{prefix}_conv2", (width, width, 3, 3))
            s.bn(f"{prefix}_bn2", width)
            if stride != 1 or in_ch != width:
                s.param(f"{prefix}_down", (width, in_ch, 1, 1))
                s.bn(f"{prefix}_downbn", width)
            in_ch = width
    s.param("fc_weight", (10, in_ch))
    s.param("fc_bias", (10,))
    return s


def resnet_forward(p, st, x):
    new_stats = {}

    def bn(h, name):
        y, m, v = batch_norm(h, p[f"{name}_weight"], p[f"{name}_bias"], st[f"{name}_mean"], st[f"{name}_var"])
        new_stats[f"{name}_mean"], new_stats[f"{name}_var"] = m, v
        return y

    h = F.relu(bn(conv2d(x, p["conv1"], stride=2, padding=3), "bn1"))
    h = F.max_pool2d(h, 3, stride=2, padding=1)
    for stage, width in enumerate(RESNET_WIDTHS, start=1):
        for block in range(2):
            prefix = f"layer{stage}_{block}"
            stride = 2 if stage > 1 and block == 0 else 1
            out = F.relu(bn(conv2d(h, p[f"{prefix}_conv1"], stride=stride, padding=1), f"{prefix}_bn1"))
            out = bn(conv2d(out, p[f"{prefix}_conv2"], padding=1), f"{prefix}_bn2")
            shortcut = h
            if f"{prefix}_down" in p:
                shortcut = bn(conv2d(h, p[f"{prefix}_down"], stride=stride), f"{prefix}_downbn")
            h = F.relu(out + shortcut)
    h = h.mean((2, 3))
    return F.linear(h, p["fc_weight"], p["fc_bias"]), new_stats


# ---- tiny GPT -------------------------------------------------------------------------------------------------

VOCAB, SEQ, DIM, HEADS = 32, 8, 16, 2


def gpt_spec() -> Spec:
    s = Spec()
    s.param("wte", (VOCAB, DIM))
    s.param("wpe", (SEQ, DIM))
    s.param("ln1_weight", (DIM,))
    s.param("ln1_bias", (DIM,))
    s.param("attn_weight", (3 * DIM, DIM))
    s.param("attn_bias", (3 * DIM,))
    s.param("proj_weight", (DIM, DIM))
    s.param("proj_bias", (DIM,))
    s.param("ln2_weight", (DIM,))
    s.param("ln2_bias", (DIM,))
    s.param("fc_weight", (4 * DIM, DIM))
    s.param("fc_bias", (4 * DIM,))
    s.param("fc2_weight", (DIM, 4 * DIM))
    s.param("fc2_bias", (DIM,))
    s.param("lnf_weight", (DIM,))
    s.param("lnf_bias", (DIM,))
    s.param("head_weight", (VOCAB, DIM))
    return s


def gpt_forward(p, st, tokens):
    b, t = tokens.shape
    h = F.embedding(tokens, p["wte"]) + p["wpe"][:t]
    a = F.layer_norm(h, (DIM,), p["ln1_weight"], p["ln1_bias"])
    q, k, v = F.linear(a, p["attn_weight"], p["attn_bias"]).split(DIM, dim=2)
    q, k, v = (z.reshape(b, t, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / (DIM // HEADS) ** 0.5)
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    scores = scores.masked_fill(~causal, float("-inf"))
    y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, DIM)
    h = h + F.linear(y, p["proj_weight"], p["proj_bias"])
    m = F.layer_norm(h, (DIM,), p["ln2_weight"], p["ln2_bias"])
    h = h + F.linear(F.gelu(F.linear(m, p["fc_weight"], p["fc_bias"])), p["fc2_weight"], p["fc2_bias"])
    h = F.layer_norm(h, (DIM,), p["lnf_weight"], p["lnf_bias"])
    return F.linear(h, p["head_weight"]).reshape(b * t, VOCAB), {}


# ---- MLP for the loss-scaled step -------------------------------------------------------------------------


def mlp_spec() -> Spec:
    s = Spec()
    s.param("w1", (16, 8))
    s.param("b1", (16,))
    s.param("w2", (4, 16))
    s.param("b2", (4,))
    return s


def mlp_forward(p, st, x):
    return F.linear(torch.tanh(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"]), {}


# ---- the step -------------------------------------------------------------------------------------------------


MODELS = {
    "cnn_bn": dict(spec=cnn_spec, forward=cnn_forward, data=((16, 3, 8, 8), 10),
                   hp=dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=5e-4, nesterov=False)),
    "cnn_clip": dict(spec=cnn_spec, forward=cnn_forward, data=((16, 3, 8, 8), 10), clip=1.0,
                     hp=dict(lr=0.05, momentum=0.9, dampening=0.25, weight_decay=0.0, nesterov=False)),
    "gpt_tiny": dict(spec=gpt_spec, forward=gpt_forward, data=((4, SEQ), VOCAB), schedule=True,
                     hp=dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)),
    "mlp_amp": dict(spec=mlp_spec, forward=mlp_forward, data=((8, 8), 4), amp=True,
                    hp=dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)),
    "cnn_frozen": dict(spec=frozen_spec, forward=frozen_forward, data=((16, 3, 8, 8), 10), native=True,
                       hp=dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True)),
    "resnet_small": dict(spec=resnet_spec, forward=resnet_forward, data=((16, 3, 16, 16), 10),
                         hp=dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=False)),
}


def input_names(name: str) -> list[str]:
    cfg = MODELS[name]
    spec = cfg["spec"]()
    names = ["x", "target"] + [n for n, _ in spec.params] + [f"buf_{n}" for n, _ in spec.params] + [n for n, _ in spec.stats]
    names += [n for n, _ in spec.frozen]
    if cfg.get("schedule"):
        names.append("step")
    if cfg.get("amp"):
        names.append("scale")
    return names


def make_step(name: str):
    """The whole step of model ``name`` as a function of its flat inputs (``input_names`` order)."""
    cfg = MODELS[name]
    spec = cfg["spec"]()
    param_names = [n for n, _ in spec.params]
    stat_names = [n for n, _ in spec.stats]
    h = cfg["hp"]

    def step(*args):
        it = iter(args)
        x, target = next(it), next(it)
        params = [next(it) for _ in param_names]
        bufs = [next(it) for _ in param_names]
        stats = {n: next(it) for n in stat_names}
        frozen = {n: next(it) for n, _ in spec.frozen}
        step_count = next(it) if cfg.get("schedule") else None
        scale = next(it) if cfg.get("amp") else None
        with torch.enable_grad():
            leaves = [q.detach().requires_grad_(True) for q in params]
            logits, new_stats = cfg["forward"](dict(zip(param_names, leaves)) | frozen, stats, x)
            loss = F.cross_entropy(logits, target)
            scaled = loss * scale if scale is not None else loss
            grads = list(torch.autograd.grad(scaled, leaves))
        grads = [g.detach() for g in grads]
        found_inf = None
        if scale is not None:  # GradScaler.unscale_: multiply by 1/scale, found_inf from non-finite values
            inv = scale.double().reciprocal().float()
            grads = [g * inv for g in grads]
            found_inf = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
        if cfg.get("clip"):  # clip_grad_norm_: total 2-norm over all gradients, clip coefficient clamped at 1
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2) for g in grads]), 2)
            coef = torch.clamp(cfg["clip"] / (total + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        new_params = [q.detach().clone() for q in params]
        new_bufs = [b.clone() for b in bufs]
        if step_count is not None:  # StepLR(step_size=10, gamma=0.5) as a function of the step number
            lr = h["lr"] * torch.pow(torch.tensor(0.5), torch.floor(step_count / 10.0))
            lr = lr.detach().requires_grad_(True)  # torch's tensor-lr path: param.addcmul_(grad, lr, value=-1)
        else:
            lr = h["lr"]
        sgd(new_params, grads, new_bufs, foreach=False, weight_decay=h["weight_decay"], momentum=h["momentum"],
            lr=lr, dampening=h["dampening"], nesterov=h["nesterov"], maximize=False)
        new_params = [q.detach() for q in new_params]
        if found_inf is not None:  # the skipped step: keep the old values when found_inf
            new_params = [torch.where(found_inf, q, n) for q, n in zip(params, new_params)]
            new_bufs = [torch.where(found_inf, b, n) for b, n in zip(bufs, new_bufs)]
        return (loss.detach(), *new_params, *new_bufs, *[new_stats[n] for n in stat_names])

    return step


def output_roles(name: str) -> list[tuple[str, str | None]]:
    """(role, the input this output feeds on the next step) for every output, in order."""
    spec = MODELS[name]["spec"]()
    roles: list[tuple[str, str | None]] = [("loss", None)]
    roles += [("parameter", n) for n, _ in spec.params]
    roles += [("momentum_buffer", f"buf_{n}") for n, _ in spec.params]
    roles += [("running_stat", n) for n, _ in spec.stats]
    return roles


def initial_inputs(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    cfg = MODELS[name]
    spec = cfg["spec"]()
    values: dict[str, np.ndarray] = {}
    values.update(batch(name, rng))
    for n, shape in spec.params + spec.frozen:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if n.endswith("_weight") and len(shape) == 1:  # norm scale
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif n.endswith("_var"):  # frozen running variance
            value = 1.0 + 0.5 * rng.random(shape)
        elif len(shape) == 1:
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(fan_in)
        values[n] = value.astype(np.float32)
    for n, shape in spec.params:
        values[f"buf_{n}"] = (0.01 * rng.standard_normal(shape)).astype(np.float32)
    for n, shape in spec.stats:
        values[n] = (np.ones(shape) if n.endswith("_var") else np.zeros(shape)).astype(np.float32)
    if cfg.get("schedule"):
        values["step"] = np.array(9.0, np.float32)  # steps 9, 10, 11: the schedule halves in between
    if cfg.get("amp"):
        values["scale"] = np.array(1024.0, np.float32)
    return values


def batch(name: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape, classes = MODELS[name]["data"]
    if name == "gpt_tiny":
        x = rng.integers(0, VOCAB, size=shape).astype(np.int64)
        return {"x": x, "target": rng.integers(0, VOCAB, size=shape[0] * shape[1]).astype(np.int64)}
    return {"x": rng.standard_normal(shape).astype(np.float32), "target": rng.integers(0, classes, size=shape[0]).astype(np.int64)}


# ---- export and checks ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet():
    """Silence exporter chatter (Python and C++ levels)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [devnull]:
            os.close(fd)


def wrapper(gm: torch.fx.GraphModule, names: list[str]) -> torch.nn.Module:
    """A module whose ``forward`` has the step's argument names (the exporter names inputs after them)."""
    source = f"def forward(self, {', '.join(names)}):\n    return tuple(self.gm({', '.join(names)}))\n"
    scope: dict = {}
    exec(source, scope)  # noqa: S102 - a generated signature, nothing else
    cls = type("Step", (torch.nn.Module,), {"forward": scope["forward"]})
    module = cls()
    module.gm = gm
    return module


def export(name: str, step, args: list[torch.Tensor], names: list[str], path: Path) -> None:
    native = MODELS[name].get("native")
    gm = make_fx(step, decomposition_table=NATIVE_DECOMPOSITIONS if native else DECOMPOSITIONS)(*args)
    with quiet():
        torch.onnx.export(wrapper(gm, names), tuple(args), str(path), dynamo=True, external_data=False)
    model = onnx.load(str(path))
    for node in model.graph.node:  # stack traces name this machine's paths; the graph does not need them
        del node.metadata_props[:]
    onnx.save(model, str(path))


def chained(name: str, run, values: dict[str, np.ndarray], names: list[str], rng_batches: list[dict]) -> list[list[np.ndarray]]:
    """Outputs of ``run`` over STEPS chained steps (state fed back, fresh batches, step counter + 1)."""
    roles = output_roles(name)
    feeds = dict(values)
    results = []
    for k in range(STEPS):
        feeds.update(rng_batches[k])
        outputs = run([feeds[n] for n in names])
        results.append(outputs)
        for (role, target), value in zip(roles, outputs):
            if target is not None:
                feeds[target] = value
        if "step" in feeds:
            feeds["step"] = np.array(feeds["step"] + 1, np.float32)
    return results


def native_conv_attempt() -> str:
    """Whether the exporter manages a step with native ``F.conv2d`` (kept only as a note)."""

    def step(x, w):
        with torch.enable_grad():
            leaf = w.detach().requires_grad_(True)
            loss = F.conv2d(x, leaf, padding=1).square().mean()
            (g,) = torch.autograd.grad(loss, [leaf])
        return loss.detach(), g

    args = (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
    path = HERE / "_native_conv_attempt.onnx"
    try:
        gm = make_fx(step, decomposition_table=DECOMPOSITIONS)(*args)
        with quiet():
            torch.onnx.export(wrapper(gm, ["x", "w"]), args, str(path), dynamo=True, external_data=False)
        ops = sorted({n.op_type for n in onnx.load(str(path)).graph.node})
        return f"exported; op types {ops}"
    except Exception as error:  # noqa: BLE001 - recorded, not handled
        text = str(error).replace("\x1b[96m", "").replace("\x1b[0m", "")
        summary = re.search(r"## Exception summary\s*\n\s*\n(.*?)(\n\n|$)", text, re.S)
        first = (summary.group(1) if summary else text).strip().splitlines()[0] if text.strip() else ""
        return f"{type(error).__name__}: {first[:400]}"
    finally:
        for leftover in HERE.glob("_native_conv_attempt.onnx*"):
            leftover.unlink()


def main() -> None:
    torch.manual_seed(SEED)
    manifest: dict = {
        "generator": "testdata/steps/make_steps.py",
        "versions": versions(),
        "tolerance_vs_eager": {"rtol": RTOL, "atol": ATOL, "steps": STEPS},
        "native_conv_export": native_conv_attempt(),
        "models": [],
    }
    only = set(sys.argv[1:])
    for position, name in enumerate(MODELS):
        if only and name not in only:
            continue
        rng = np.random.default_rng(SEED + position)
        names = input_names(name)
        values = initial_inputs(name, rng)
        batches = [batch(name, rng) for _ in range(STEPS)]
        batches[0] = {k: values[k] for k in ("x", "target")}
        step = make_step(name)
        path = HERE / f"{name}.onnx"
        export(name, step, [torch.from_numpy(values[n]) for n in names], names, path)
        model = onnx.load(str(path))
        graph_inputs = [i.name for i in model.graph.input]
        assert graph_inputs == names, (name, graph_inputs)
        eager = chained(name, lambda a: [t.detach().numpy() for t in step(*[torch.from_numpy(np.asarray(v)) for v in a])], values, names, batches)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        onnx_out = chained(name, lambda a: session.run(None, dict(zip(names, a))), values, names, batches)
        worst = 0.0
        for k, (want, got) in enumerate(zip(eager, onnx_out)):
            for i, (w, g) in enumerate(zip(want, got)):
                difference = float(np.max(np.abs(g.astype(np.float64) - w), initial=0.0))
                bound = ATOL + RTOL * float(np.max(np.abs(w), initial=0.0))
                assert difference <= bound, f"{name} step {k} output {i}: max |ort - eager| {difference:.3g} > {bound:.3g}"
                worst = max(worst, difference)
        outputs = [o.name for o in model.graph.output]
        roles = output_roles(name)
        arrays = {f"input/{n}": v for n, v in values.items()}
        for k in range(STEPS):
            for n in ("x", "target"):
                arrays[f"step{k}/{n}"] = batches[k][n]
            for o, value in zip(outputs, eager[k]):
                if k == STEPS - 1 or o == outputs[0]:
                    arrays[f"step{k}/eager/{o}"] = value
        np.savez_compressed(HERE / f"{name}.npz", **arrays)
        cfg = MODELS[name]
        ops = Counter(n.op_type for n in model.graph.node)
        manifest["models"].append(
            {
                "file": path.name,
                "inputs": names,
                "data_inputs": ["x", "target"],
                "counter_inputs": ["step"] if cfg.get("schedule") else [],
                "outputs": [{"name": o, "role": role, "feeds": target} for o, (role, target) in zip(outputs, roles)],
                "sgd": cfg["hp"] | {"maximize": False, "lr_schedule": "lr * 0.5 ** floor(step / 10)" if cfg.get("schedule") else None},
                "clip_grad_norm": cfg.get("clip"),
                "loss_scaled": bool(cfg.get("amp")),
                "expected_momentum_updates": len(cfg["spec"]().params),
                "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                "nodes": len(model.graph.node),
                "bytes": path.stat().st_size,
                "op_types": dict(sorted(ops.items())),
                "max_abs_difference_vs_eager": worst,
            }
        )
        print(f"{name}: {len(model.graph.node)} nodes, {path.stat().st_size} bytes, max |ort - eager| {worst:.2e}")
    path = HERE / "manifest.json"
    if only and path.exists():  # a partial run updates its models' entries and keeps the others
        fresh = {entry["file"]: entry for entry in manifest["models"]}
        kept = json.loads(path.read_text())["models"]
        merged = [fresh.pop(entry["file"], entry) for entry in kept] + list(fresh.values())
        order = {f"{model}.onnx": k for k, model in enumerate(MODELS)}
        manifest["models"] = sorted(merged, key=lambda entry: order.get(entry["file"], len(order)))
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    (HERE / "VERSIONS.txt").write_text("".join(f"{k} {v}\n" for k, v in manifest["versions"].items()))


def versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
    }


if __name__ == "__main__":
    main()
