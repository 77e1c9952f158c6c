"""Shared PyTorch helpers of the optimizer-step generators (make_torch_default_names.py, make_torch_bf16.py).

Needs torch (the generators' venv). Every step is PyTorch's own ``torch.optim._functional.sgd`` with
``foreach=False`` on clones of its inputs, cross-checked against the ``torch.optim.SGD`` class; the
``torch.nn.Module`` wrappers stay in each generator, because their ``forward`` argument names become the
exported graphs' input names.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch
from torch.optim._functional import sgd


def hp(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False):
    """The keyword arguments of ``torch.optim.SGD`` for one case (``maximize`` off)."""
    return dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                nesterov=nesterov, maximize=False)


def functional_step(params, grads, bufs, h):
    """One step of ``torch.optim._functional.sgd`` on clones: the new parameters then the new buffers."""
    params = [p.clone() for p in params]
    bufs = [b.clone() for b in bufs]
    sgd(params, list(grads), bufs, foreach=False, weight_decay=h["weight_decay"], momentum=h["momentum"],
        lr=h["lr"], dampening=h["dampening"], nesterov=h["nesterov"], maximize=False)
    return tuple(params + bufs)


def class_step(params, grads, bufs, h):
    """The same step with the torch.optim.SGD class (momentum_buffer pre-set): the cross-check."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.SGD(ps, foreach=False, **h)
    for p, g, b in zip(ps, grads, bufs):
        p.grad = g.clone()
        opt.state[p]["momentum_buffer"] = b.clone()
    opt.step()
    return [p.detach() for p in ps] + [opt.state[p]["momentum_buffer"] for p in ps]


def export(module, args, path, dynamo):
    """``torch.onnx.export`` with the exporter's default names: dynamo (one file, no external data) or the
    TorchScript tracer; its warnings and printed progress are silenced."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, args, str(path), dynamo=True, external_data=False)
        else:
            torch.onnx.export(module, args, str(path), dynamo=False)
