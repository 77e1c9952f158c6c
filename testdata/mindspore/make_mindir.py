#!/usr/bin/env python
"""Regenerate testdata/mindspore/*.mindir: real MindSpore train steps using ``mindspore.mint.optim.SGD``.

Each file is ``mindspore.export(TrainStep, x, y, file_format="MINDIR")`` of a small MLP whose update is
MindSpore's own ``mint.optim.SGD`` code (no update math written here). The optimizer's lr is made a Cell
attribute (``self.lr0``): without it export fails with "Parameter that wasn't created in nn.Cell ...
learning_rate_group_0" (docs/mindspore.md).

Every file is checked before it is kept: ``mindspore.load`` + ``nn.GraphCell`` runs it for 3 chained steps
and must reproduce the losses, parameters and momentum buffers of the same TrainStep run as a GRAPH_MODE
Cell (rtol 1e-6) -- the exported graph is the train step.

Outputs (under testdata/mindspore/):
    train_step_sgd.mindir        momentum 0.9, dampening 0.25, weight decay 1e-4, lr 0.1
    train_step_nesterov.mindir   momentum 0.9, Nesterov, weight decay 1e-4, lr 0.1
    train_step_shared.mindir     as train_step_sgd, six layers, five of one shape: the updates sit in
                                 functions MindSpore shares between same-shaped parameters
    manifest.json                the oracle: per file, the parameters, their buffers and the hyper-parameters,
                                 written from the configuration below, never read back from the graphs
    VERSIONS.txt                 tool versions

Run (about 20 s):

    /work/venvs/ms/bin/python testdata/mindspore/make_mindir.py
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import mindspore as ms
from mindspore import mint, nn, ops

HERE = Path(__file__).resolve().parent
BATCH, IN, HIDDEN, OUT = 8, 4, 3, 2
CONFIGS = {
    "train_step_sgd": {"lr": 0.1, "momentum": 0.9, "dampening": 0.25, "weight_decay": 1e-4, "nesterov": False},
    "train_step_nesterov": {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 1e-4, "nesterov": True},
    # Five same-shaped layers: MindSpore then keeps one update function per parameter shape and calls it
    # once per parameter (the form large models take) instead of inlining every update.
    "train_step_shared": {"lr": 0.1, "momentum": 0.9, "dampening": 0.25, "weight_decay": 1e-4, "nesterov": False, "same_layers": 5},
}


class Mlp(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Dense(IN, HIDDEN)
        self.l2 = nn.Dense(HIDDEN, OUT)

    def construct(self, x):
        return self.l2(ops.relu(self.l1(x)))


class SameLayers(nn.Cell):
    def __init__(self, count: int) -> None:
        super().__init__()
        layers = [nn.Dense(IN, IN)]
        for _ in range(count - 1):
            layers += [nn.ReLU(), nn.Dense(IN, IN)]
        self.body = nn.SequentialCell(layers + [nn.ReLU(), nn.Dense(IN, OUT)])

    def construct(self, x):
        return self.body(x)


class TrainStep(nn.Cell):
    def __init__(self, net: nn.Cell, opt) -> None:
        super().__init__()
        self.net = net
        self.opt = opt
        self.lr0 = opt.param_groups[0]["lr"]  # export needs the lr as a Cell attribute
        self.grad_fn = ms.value_and_grad(self.forward, None, opt.parameters)

    def forward(self, x, y):
        return ((self.net(x) - y) ** 2).mean()

    def construct(self, x, y):
        loss, grads = self.grad_fn(x, y)
        self.opt(grads)
        return loss


def build(config: dict, seed: int = 0) -> TrainStep:
    ms.set_seed(seed)
    net = SameLayers(config["same_layers"]) if config.get("same_layers") else Mlp()
    rng = np.random.default_rng(seed)
    for p in net.trainable_params():  # deterministic initial values, independent of MindSpore's RNG
        p.set_data(ms.Tensor(rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)))
    opt = mint.optim.SGD(
        net.trainable_params(), lr=config["lr"], momentum=config["momentum"], dampening=config["dampening"],
        weight_decay=config["weight_decay"], nesterov=config["nesterov"],
    )
    return TrainStep(net, opt)


def batches(steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((BATCH, IN)).astype(np.float32), rng.standard_normal((BATCH, OUT)).astype(np.float32))
        for _ in range(steps)
    ]


def state(params) -> dict:
    return {p.name.removeprefix("opt."): p.asnumpy().copy() for p in params}


def check(path: Path, config: dict) -> None:
    data = batches(3)
    cell = build(config)
    expected_losses = [float(cell(ms.Tensor(x), ms.Tensor(y)).asnumpy()) for x, y in data]
    expected = state(cell.opt.parameters) | state(cell.opt.momentum_buf)
    graph = nn.GraphCell(ms.load(str(path)))
    losses = [float(graph(ms.Tensor(x), ms.Tensor(y)).asnumpy()) for x, y in data]
    got = state(graph.get_parameters())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6, err_msg=f"{path.name}: losses")
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=f"{path.name}: {name}")
    assert int(got["step_t"]) == 3, got["step_t"]


def main() -> None:
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    manifest = {}
    digest = hashlib.sha256()
    for name, config in CONFIGS.items():
        cell = build(config)
        x, y = (ms.Tensor(a) for a in batches(1)[0])
        for old in HERE.glob(f"{name}.mindir"):
            old.chmod(0o644)
            old.unlink()
        ms.export(cell, x, y, file_name=str(HERE / name), file_format="MINDIR")
        path = HERE / f"{name}.mindir"
        path.chmod(0o644)  # MindSpore writes it read-only
        check(path, config)
        params = [p.name.removeprefix("opt.") for p in cell.opt.parameters]
        manifest[path.name] = {
            "optimizer": "mindspore.mint.optim.SGD",
            **{k: v for k, v in config.items() if k != "same_layers"},
            "parameters": params,
            "buffers": {p: f"momentum_buf.{p}" for p in params},
            "step": "step_t",
            "inputs": {"x": [BATCH, IN], "y": [BATCH, OUT]},
        }
        digest.update(path.read_bytes())
        print(f"{path.name}: {path.stat().st_size} bytes, checked against the Cell for 3 steps")
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (HERE / "VERSIONS.txt").write_text(
        f"python {platform.python_version()}\nmindspore {ms.__version__}\nnumpy {np.__version__}\n"
        f"platform {platform.machine()} {platform.system()}\n"
    )
    print("sha256", digest.hexdigest(), file=sys.stderr)


if __name__ == "__main__":
    main()
