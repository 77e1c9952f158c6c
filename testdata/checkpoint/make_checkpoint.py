"""Generate the resume-from-checkpoint test data (needs torch; CI reads only the committed files).

What it writes into ``testdata/checkpoint/``:

- ``step.onnx``: one optimizer step of the model below, exported by ``torch.onnx.export`` (TorchScript
  exporter) from PyTorch's own functional SGD (``torch.optim._functional.sgd``, single-tensor path):
  inputs, in order, the parameters (named as in ``model.state_dict()``: ``fc1.weight`` ...), their gradients
  (``grad.<name>``) and their momentum buffers (``buf.<name>``); outputs ``<name>.out`` and ``buf.<name>.out``.
  Two parameter groups: ``fc1.*`` lr 0.1, momentum 0.9, dampening 0.25, weight decay 1e-4; ``fc2.*`` and
  ``gate`` lr 0.05, momentum 0.8, Nesterov.
- ``checkpoint.npz`` and ``checkpoint.safetensors``: the state after K eager steps of ``torch.optim.SGD``
  (``foreach=False``) in sgdfuse's flat checkpoint layout: every ``model.state_dict()`` tensor under its key,
  and each ``optimizer.state[p]["momentum_buffer"]`` under ``<name>/momentum_buffer``. ``gate`` is not used
  by the loss during those K steps, so its gradient is ``None``, ``torch.optim.SGD`` skips it and it has no
  momentum buffer yet (its next step is its first).
- ``expected.npz``: the N eager steps that follow (the loss now uses ``gate``): ``grad/<t>/<name>`` the
  gradients fed at step t (0-based), ``param/<t>/<name>`` and ``buf/<t>/<name>`` the parameters and buffers
  after it.
- ``manifest.json``: K, N, the groups' hyper-parameters and the versions used.

Run: ``/path/to/venv-with-torch/bin/python testdata/checkpoint/make_checkpoint.py`` (torch 2.13.0 CPU, onnx,
numpy, safetensors). Seeded: two runs give the same arrays, the same ``step.onnx`` bytes and manifest (the
``.npz`` zip headers carry the write time). ``checkpoint.pt`` (``torch.save`` of both state dicts, for trying
the torch reader) is written too and not committed: CI has no torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from safetensors.numpy import save_file
from torch.optim._functional import sgd

OUT = Path(__file__).resolve().parent
K, N = 3, 3
SEED = 20261201
GROUPS = [
    dict(names=["fc1.weight", "fc1.bias"], lr=0.1, momentum=0.9, dampening=0.25, weight_decay=1e-4, nesterov=False),
    dict(names=["fc2.weight", "fc2.bias", "gate"], lr=0.05, momentum=0.8, dampening=0.0, weight_decay=0.0, nesterov=True),
]


class Net(torch.nn.Module):
    """Linear(4,8)-ReLU-Linear(8,2), scaled by (1 + gate) once ``use_gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)
        self.gate = torch.nn.Parameter(torch.zeros(2))
        self.use_gate = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        return out * (1 + self.gate) if self.use_gate else out


class Step(torch.nn.Module):
    """forward(*params, *grads, *buffers) -> (*new params, *new buffers): one torch functional SGD step."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.names)
        params = {k: t.clone() for k, t in zip(self.names, inputs[:n])}
        grads = dict(zip(self.names, inputs[n : 2 * n]))
        bufs = {k: t.clone() for k, t in zip(self.names, inputs[2 * n :])}
        for group in GROUPS:
            ns = group["names"]
            sgd([params[k] for k in ns], [grads[k] for k in ns], [bufs[k] for k in ns], foreach=False,
                weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=False)
        return (*[params[k] for k in self.names], *[bufs[k] for k in self.names])


def batch(rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 4, generator=rng), torch.randn(6, 2, generator=rng)


def train_step(net: Net, opt: torch.optim.Optimizer, rng: torch.Generator) -> dict[str, np.ndarray]:
    """One eager step; returns the gradients it applied (None-gradient parameters left out)."""
    x, y = batch(rng)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(net(x), y).backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in net.named_parameters() if p.grad is not None}
    opt.step()
    return grads


def flat_checkpoint(net: Net, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """sgdfuse's flat layout: state_dict tensors by key, momentum buffers under ``<name>/momentum_buffer``."""
    flat = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    for name, p in net.named_parameters():
        buffer = opt.state.get(p, {}).get("momentum_buffer")
        if buffer is not None:
            flat[f"{name}/momentum_buffer"] = buffer.detach().numpy().copy()
    return flat


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def export_step(names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    args = tuple(torch.randn(shapes[k]) for k in names) * 3
    in_names = names + [f"grad.{k}" for k in names] + [f"buf.{k}" for k in names]
    out_names = [f"{k}.out" for k in names] + [f"buf.{k}.out" for k in names]
    with quiet():
        torch.onnx.export(Step(names), args, str(OUT / "step.onnx"), dynamo=False, input_names=in_names, output_names=out_names)
    model = onnx.load(str(OUT / "step.onnx"))
    assert [i.name for i in model.graph.input] == in_names, [i.name for i in model.graph.input]
    # The step module in eager equals torch.optim.SGD (checked on the data below, see main).
    return None


def main() -> None:
    torch.manual_seed(SEED)
    rng = torch.Generator().manual_seed(SEED)
    net = Net()
    with torch.no_grad():
        net.gate.copy_(torch.randn(2, generator=rng) * 0.1)
    named = dict(net.named_parameters())
    # Named parameter groups: the optimizer's state_dict then carries param_names (torch >= 2.5).
    opt = torch.optim.SGD(
        [dict(params=[(k, named[k]) for k in g["names"]], **{h: g[h] for h in ("lr", "momentum", "dampening", "weight_decay", "nesterov")}) for g in GROUPS],
        foreach=False,
    )
    for _ in range(K):
        grads = train_step(net, opt, rng)
        assert "gate" not in grads
    flat = flat_checkpoint(net, opt)
    assert "gate/momentum_buffer" not in flat and "fc1.weight/momentum_buffer" in flat
    np.savez(OUT / "checkpoint.npz", **flat)
    save_file(flat, str(OUT / "checkpoint.safetensors"))
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, OUT / "checkpoint.pt")

    names = [k for k, _ in net.named_parameters()]
    export_step(names, {k: tuple(p.shape) for k, p in net.named_parameters()})

    # N more eager steps with gate in the loss; the exported step, run eagerly on the same gradients, must
    # give torch.optim.SGD's numbers (gate's first step: torch sets buf = grad, the step gets a zero buffer).
    step = Step(names)
    state = {k: torch.from_numpy(flat[k]) for k in names}
    bufs = {k: torch.from_numpy(flat.get(f"{k}/momentum_buffer", np.zeros_like(flat[k]))) for k in names}
    net.use_gate = True
    expected: dict[str, np.ndarray] = {}
    for t in range(N):
        grads = train_step(net, opt, rng)
        assert set(grads) == set(names)
        out = step(*[state[k] for k in names], *[torch.from_numpy(grads[k]) for k in names], *[bufs[k] for k in names])
        state = dict(zip(names, out[: len(names)]))
        bufs = dict(zip(names, out[len(names) :]))
        for k, p in net.named_parameters():
            expected[f"grad/{t}/{k}"] = grads[k]
            expected[f"param/{t}/{k}"] = p.detach().numpy().copy()
            expected[f"buf/{t}/{k}"] = opt.state[p]["momentum_buffer"].detach().numpy().copy()
            torch.testing.assert_close(state[k], p.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(bufs[k], opt.state[p]["momentum_buffer"], rtol=1e-6, atol=1e-7)
    np.savez(OUT / "expected.npz", **expected)

    import onnx as _onnx, safetensors as _st

    manifest = dict(
        generator="testdata/checkpoint/make_checkpoint.py",
        k=K, n=N, seed=SEED, groups=GROUPS,
        no_buffer=["gate"],
        versions=dict(python=sys.version.split()[0], torch=torch.__version__, onnx=_onnx.__version__,
                      numpy=np.__version__, safetensors=_st.__version__),
    )
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print("wrote", ", ".join(sorted(p.name for p in OUT.iterdir() if p.suffix != ".py")))


if __name__ == "__main__":
    main()
