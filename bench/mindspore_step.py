#!/usr/bin/env python
"""Step time of a ``mindspore.mint.optim.SGD`` train step with and without the sgdfuse pass (CPU).

Two identical MLPs with many parameters are compiled in one process: one under
:func:`sgdfuse.mindspore.paused` (mint's unfused graph: per parameter a ``step_t == 0`` Switch between two
branch graphs, InplaceMuls + InplaceAddExt, the weight-decay AddExt and the InplaceAddExt update) and one
with the pass (one ``SGD`` per parameter). Two things are timed, interleaved round by round so that machine
noise hits both alike, and the medians (and 90th percentiles) are reported:

* update: a jit function that only runs ``opt(grads)`` on fixed gradients -- the optimizer update itself;
* step:   forward + backward + update, the whole train step.

Usage (figures in the issue note came from this command):

    /work/venvs/ms/bin/python bench/mindspore_step.py --layers 50 --width 256

Prints a table and, last, one JSON line with every figure.

The first calls of a compiled graph are slower while MindSpore's CPU kernels tune their thread split
(seen here: the fused graph's first ~30 steps, longer when other processes load the 2 cores), hence
``--warmup``. Timings on a shared machine are noisy: compare variants within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=50, help="Dense layers (2 parameters each)")
    parser.add_argument("--width", type=int, default=256, help="features per layer")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=50, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per variant first (kernel thread tuning)")
    args = parser.parse_args()

    import mindspore as ms
    from mindspore import mint, nn

    import sgdfuse.mindspore as sm

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    start = time.perf_counter()
    registration = sm.register("cpu")
    build_seconds = time.perf_counter() - start

    def make():
        layers = []
        for _ in range(args.layers):
            layers += [nn.Dense(args.width, args.width), nn.ReLU()]
        net = nn.SequentialCell(layers)
        opt = mint.optim.SGD(net.trainable_params(), lr=0.01, momentum=0.9, dampening=0.25, weight_decay=1e-4)

        def forward(x, y):
            return ((net(x) - y) ** 2).mean()

        grad_fn = ms.value_and_grad(forward, None, opt.parameters)

        @ms.jit
        def step(x, y):
            loss, grads = grad_fn(x, y)
            opt(grads)
            return loss

        @ms.jit
        def update(grads):
            opt(grads)
            return grads[0]

        return net, opt, step, update

    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((args.batch, args.width)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((args.batch, args.width)).astype(np.float32))

    variants = {}
    for label in ("unfused", "fused"):
        net, opt, step, update = make()
        grads = tuple(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32) * 1e-3) for p in opt.parameters)
        t0 = time.perf_counter()
        if label == "unfused":
            with sm.paused():
                step(x, y).asnumpy()
                update(grads).asnumpy()
        else:
            step(x, y).asnumpy()
            update(grads).asnumpy()
        compile_seconds = time.perf_counter() - t0
        variants[label] = {"step": step, "update": update, "grads": grads, "compile_s": compile_seconds, "times": {"step": [], "update": []}}
    fused_graphs = [r for r in registration.records() if r.get("event") == "graph"]
    params = 2 * args.layers
    elements = params and sum(int(np.prod(p.shape)) for p in make()[1].parameters)

    def timed(fn, *fn_args):
        t = time.perf_counter()
        fn(*fn_args).asnumpy()
        return time.perf_counter() - t

    for _ in range(args.warmup):
        for v in variants.values():
            timed(v["update"], v["grads"])
            timed(v["step"], x, y)
    for _ in range(args.rounds):
        for v in variants.values():
            v["times"]["update"].append(timed(v["update"], v["grads"]))
            v["times"]["step"].append(timed(v["step"], x, y))

    figures = {
        "parameters": params,
        "elements": elements,
        "plugin_build_or_cache_s": round(build_seconds, 2),
        "fused_updates": sum(g["fused"] for g in fused_graphs),
    }
    print(f"{params} parameters ({elements:,} elements), batch {args.batch}, {args.rounds} rounds, medians:")
    print(f"{'':10}{'update ms':>12}{'(p90)':>8}{'step ms':>12}{'(p90)':>8}{'compile s':>12}")
    for label, v in variants.items():
        med = {k: statistics.median(t) * 1e3 for k, t in v["times"].items()}
        p90 = {k: float(np.percentile(t, 90)) * 1e3 for k, t in v["times"].items()}
        figures[label] = {k: round(m, 3) for k, m in med.items()} | {f"{k}_p90": round(m, 3) for k, m in p90.items()}
        figures[label]["compile_s"] = round(v["compile_s"], 2)
        print(f"{label:10}{med['update']:12.2f}{p90['update']:8.2f}{med['step']:12.2f}{p90['step']:8.2f}{v['compile_s']:12.2f}")
    for what in ("update", "step"):
        figures[f"{what}_speedup"] = round(figures["unfused"][what] / figures["fused"][what], 2)
    print(f"speed-up: update x{figures['update_speedup']}, step x{figures['step_speedup']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
