"""Generate the MindSpore resume test data (needs MindSpore 2.10; the test only reads the files).

The network mirrors make_checkpoint.py's (``fc1`` Linear(4,8), ReLU, ``fc2`` Linear(8,2), scaled by
``1 + gate``), with the same parameter names and shapes and the same two groups of ``mindspore.mint.optim.SGD``
(fc1: lr 0.1, momentum 0.9, dampening 0.25, weight decay 1e-4; fc2 and gate: lr 0.05, momentum 0.8,
Nesterov), so its checkpoint maps onto the PyTorch-exported step ``step.onnx`` by name.

Writes into ``testdata/checkpoint/``:

- ``mindspore_step0.ckpt``: the optimizer's parameters before any step (``step_t`` 0: the buffers are zeros
  that the first step overwrites with the gradient);
- ``mindspore.ckpt``: ``mindspore.save_checkpoint(optimizer)`` after K steps: the parameters, the buffers
  ``momentum_buf.<name>`` and ``step_t``;
- ``mindspore_expected.npz``: the next step: ``grad/<name>`` the gradients it applied, ``param/<name>`` and
  ``buf/<name>`` the state after it.

Run: ``python testdata/checkpoint/make_mindspore_checkpoint.py`` (MindSpore 2.10 CPU, graph mode).
"""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn

OUT = Path(__file__).resolve().parent
K = 2
SEED = 20261201


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = mint.nn.Linear(4, 8)
        self.fc2 = mint.nn.Linear(8, 2)
        self.gate = Parameter(Tensor(np.full(2, 0.05, np.float32)), name="gate")

    def construct(self, x):
        return self.fc2(mint.nn.functional.relu(self.fc1(x))) * (1 + self.gate)


def main() -> None:
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(SEED)
    net = Net()
    params = net.trainable_params()
    opt = mint.optim.SGD(
        [
            {"params": [p for p in params if p.name.startswith("fc1.")], "lr": 0.1, "momentum": 0.9, "dampening": 0.25, "weight_decay": 1e-4},
            {"params": [p for p in params if not p.name.startswith("fc1.")], "lr": 0.05, "momentum": 0.8, "nesterov": True},
        ],
        lr=0.1,
    )
    # The CPU backend has no MSELossGradExt kernel: the loss is written out.
    def loss_fn(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(loss_fn, None, opt.parameters)

    @ms.jit
    def step(x, y):
        _, grads = grad_fn(x, y)
        opt(grads)
        return grads

    rng = np.random.default_rng(SEED)

    def batch():
        return Tensor(rng.standard_normal((6, 4)).astype(np.float32)), Tensor(rng.standard_normal((6, 2)).astype(np.float32))

    ms.save_checkpoint(opt, str(OUT / "mindspore_step0.ckpt"))
    for _ in range(K):
        step(*batch())
    ms.save_checkpoint(opt, str(OUT / "mindspore.ckpt"))
    grads = step(*batch())
    names = [p.name for p in opt.parameters]
    expected = {f"grad/{n}": g.asnumpy() for n, g in zip(names, grads)}
    expected |= {f"param/{p.name}": p.asnumpy() for p in opt.parameters}
    expected |= {f"buf/{n}": b.asnumpy() for n, b in zip(names, opt.momentum_buf)}
    np.savez(OUT / "mindspore_expected.npz", **expected)
    print("wrote mindspore_step0.ckpt, mindspore.ckpt, mindspore_expected.npz; step_t =", int(opt.step_t.asnumpy()))


if __name__ == "__main__":
    main()
