"""Synthetic training-update graphs for the sgdfuse benchmark (issue 7).

Each file holds N momentum-SGD updates written the way PyTorch 2.13's exporters write them (see
testdata/README.md, "Op types in the update sub-graphs", and the committed testdata/torch/*.onnx), mixed in one
graph, plus nodes that must not fuse:

Exporter families (one parameter update each):

- ``dynamo``  (torch.onnx.export(dynamo=True), optimize=True): scalars are rank-0 initializers shared by every
  update in the graph (one per distinct (dtype, value)); ``Mul(buf, m)``, ``Add(., g)`` -> ``buf_out``;
  ``Mul(buf_out, -lr)``, ``Add(p, .)`` -> ``p_out``. value_info for the intermediates, a ``namespace``
  metadata entry per node.
- ``legacy``  (TorchScript exporter): the same arithmetic with one rank-0 ``Constant`` node per use, names
  ``/Mul_3``, ``/Constant_3_output_0``; no value_info.
- ``noopt``   (dynamo, optimize=False): ``Identity`` clones of the parameter and buffer, one ``Constant`` per
  distinct float32 value shared graph-wide, ``CastLike(const, other operand)`` before every scalar ``Mul``
  except the buffer's momentum ``Mul`` (direct, or ``Cast(to=FLOAT16)`` in fp16), ``Identity`` on the outputs
  (emitted at the end of the graph, as the exporter does).

Variants (hyper-parameters as in testdata/README.md's cases): ``plain`` (m, d=0, wd=0), ``wd``, ``damp``
(d=0.25, with wd, as the MLP's group A), ``damp_eq_m`` (d=0.1 so 1-d == m == 0.9, with wd: one shared
initializer feeding both Muls in dynamo), ``nesterov_wd``, ``maximize`` (``Neg(g)``), ``fp16_wd`` (float16 state;
fp16 constants in dynamo/legacy, float32 constants + casts in noopt), ``lr_tensor`` (lr a graph input: dynamo's
shared ``Neg -> Reshape([-1]) -> Gather(0)``, legacy's shared ``Neg``, noopt's per-use chain + ``Cast`` +
``CastLike``). Three param groups: (lr 0.1, m 0.9), (lr 0.05, m 0.8), (lr 0.01, m 0.9).

Internal gradients: forward chains ``h = Tanh(MatMul(h, W_k))`` of ``CHAIN_DEPTH`` layers from the input, each
ending in a ``ReduceMean`` loss output, over [4, 4] weights that are themselves updated (dynamo plain/wd updates)
with gradient ``MatMul(Transpose(h_{k-1}), h_k)`` computed in the graph, as in the MLP training step.

Nodes that must not fuse (all left untouched by a correct pass): the forward chain, the gradient MatMuls, a
``ReduceMean`` loss, BatchNorm-style running statistics ``rs_out = 0.9*rs + 0.1*x`` (an EMA, no parameter),
plain SGD without momentum ``q_out = q + (-lr)*g`` (testdata case 10), and a few elementwise metric outputs.

Parameter shapes are small ([8], [4, 4], [2, 3], [16]) so a 50k-update file stays around 30 MB.
Deterministic: the same (N, seed) gives byte-identical files.

Each ``<name>.onnx`` gets a ``<name>.manifest.json`` beside it: the expected updates (parameter/buffer outputs,
family, variant) and the names of the nodes that must be left untouched; ``bench/run.py`` checks the output of
``sgdfuse optimize`` against it.

Usage:
    python bench/generate.py OUT_DIR [--sizes 1000 10000 50000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, FLOAT16, INT64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
NP = {FLOAT: np.float32, FLOAT16: np.float16, INT64: np.int64}

FAMILIES = (("dynamo", 5), ("legacy", 3), ("noopt", 2))
VARIANTS = (
    ("plain", 4),
    ("wd", 3),
    ("damp", 1),
    ("damp_eq_m", 1),
    ("nesterov_wd", 1),
    ("maximize", 1),
    ("fp16_wd", 1),
    ("lr_tensor", 1),
)
GROUPS = ((0.1, 0.9), (0.05, 0.8), (0.01, 0.9))  # (lr, momentum)
SHAPES = ((8,), (4, 4), (2, 3), (16,))
WEIGHT_DECAY = 1e-4
BATCH = 8
CHAIN_DEPTH = 4
"""Layers per forward chain (each starts from the input ``x`` and ends in a loss output)."""
OPSET = 20


def _pick(rng: random.Random, table):
    names = [n for n, _ in table]
    weights = [w for _, w in table]
    return rng.choices(names, weights)[0]


class Builder:
    """Accumulates one GraphProto's pieces; names are unique by construction."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.tail: list[onnx.NodeProto] = []  # noopt output Identities, emitted last
        self.inputs: dict[str, list[onnx.ValueInfoProto]] = {"data": [], "param": [], "grad": [], "buf": [], "other": []}
        self.outputs: dict[str, list[onnx.ValueInfoProto]] = {"loss": [], "param": [], "buf": [], "other": []}
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.counters: dict[str, int] = {}
        self.shared_init: dict[tuple[int, float], str] = {}
        self.shared_noopt_const: dict[float, str] = {}
        self.lr_input: str | None = None
        self.shared_neg_lr: dict[str, str] = {}
        self.array_inits: set[str] = set()
        self.unrelated: list[str] = []  # names of nodes that must be left as they are

    # -- names -------------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        k = self.counters.get(base, 0)
        self.counters[base] = k + 1
        return base if k == 0 else f"{base}_{k}"

    # -- nodes -------------------------------------------------------------------------------------
    def node(self, family: str, op: str, inputs, *, out: str | None = None, tail=False, unrelated=False, vi=None, **attrs) -> str:
        if family == "legacy":
            name = self.fresh(f"/{op}")
            out = out or f"{name}_output_0"
        else:
            base = op.lower() if op in ("Mul", "Add", "Neg", "Identity") else op
            out = out or self.fresh(f"{family[0]}{base}")
            name = self.fresh(f"node_{op}")
        n = helper.make_node(op, list(inputs), [out], name=name, **attrs)
        if family != "legacy":
            entry = n.metadata_props.add()
            entry.key, entry.value = "namespace", f": SGDStep/{out}: aten.{op.lower()}.Tensor"
        (self.tail if tail else self.nodes).append(n)
        if unrelated:
            self.unrelated.append(name)
        if vi is not None and family != "legacy":
            self.value_info.append(helper.make_tensor_value_info(out, vi[0], list(vi[1])))
        return out

    def add_input(self, kind: str, name: str, dtype: int, shape) -> str:
        self.inputs[kind].append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def add_output(self, kind: str, name: str, dtype: int, shape) -> None:
        self.outputs[kind].append(helper.make_tensor_value_info(name, dtype, list(shape)))

    # -- scalars, the way each exporter writes them ---------------------------------------------------
    def init_scalar(self, value: float, dtype: int) -> str:
        key = (dtype, float(NP[dtype](value)))
        name = self.shared_init.get(key)
        if name is None:
            name = f"val_{len(self.shared_init)}"
            self.initializers.append(numpy_helper.from_array(np.array(value, dtype=NP[dtype]), name))
            self.shared_init[key] = name
        return name

    def legacy_constant(self, value: float, dtype: int, unrelated: bool = False) -> str:
        name = self.fresh("/Constant")
        out = f"{name}_output_0"
        if unrelated:
            self.unrelated.append(name)
        self.nodes.append(
            helper.make_node("Constant", [], [out], name=name, value=numpy_helper.from_array(np.array(value, dtype=NP[dtype]), "value"))
        )
        return out

    def noopt_constant(self, value: float) -> str:
        name = self.shared_noopt_const.get(value)
        if name is None:
            name = self.fresh("nconst")
            n = helper.make_node(
                "Constant", [], [name], name=self.fresh("node_Constant"), value=numpy_helper.from_array(np.array(value, dtype=np.float32), "value")
            )
            entry = n.metadata_props.add()
            entry.key, entry.value = "namespace", ": SGDStep"
            self.nodes.append(n)
            self.shared_noopt_const[value] = name
        return name

    def scalar(self, family: str, value: float, dtype: int, like: str, *, buffer_momentum: bool = False) -> str:
        """The scalar operand of ``Mul(like, scalar)`` as ``family`` writes it."""
        if family == "dynamo":
            return self.init_scalar(value, dtype)
        if family == "legacy":
            return self.legacy_constant(value, dtype)
        const = self.noopt_constant(value)
        if buffer_momentum:
            if dtype == FLOAT:
                return const  # Mul(clone_buf, val) with no CastLike
            return self.node(family, "Cast", [const], to=dtype)
        return self.node(family, "CastLike", [const, like])

    def neg_lr_tensor(self, family: str, like: str) -> str:
        """-lr for an lr given as graph input ``lr`` (float32 shape [])."""
        if self.lr_input is None:
            self.lr_input = self.add_input("other", "lr", FLOAT, [])
        if family in self.shared_neg_lr:
            return self.shared_neg_lr[family]
        neg = self.node(family, "Neg", [self.lr_input], vi=(FLOAT, []))
        if family == "legacy":
            self.shared_neg_lr[family] = neg
            return neg
        if family == "dynamo":
            shape = self.init_const_array("val_m1", np.array([-1], dtype=np.int64))
            zero = self.init_const_array("val_i0", np.array(0, dtype=np.int64))
            flat = self.node(family, "Reshape", [neg, shape], allowzero=0)
            out = self.node(family, "Gather", [flat, zero], axis=0)
            self.shared_neg_lr[family] = out
            return out
        # noopt: the chain again for every use, then Cast(to=FLOAT) and CastLike
        shape = self.node(family, "Constant", [], value=numpy_helper.from_array(np.array([-1], dtype=np.int64), "value"))
        flat = self.node(family, "Reshape", [neg, shape], allowzero=0)
        zero = self.node(family, "Constant", [], value=numpy_helper.from_array(np.array(0, dtype=np.int64), "value"))
        gathered = self.node(family, "Gather", [flat, zero], axis=0)
        dense = self.node(family, "Cast", [gathered], to=FLOAT, vi=(FLOAT, []))
        return self.node(family, "CastLike", [dense, like])

    def init_const_array(self, name: str, array: np.ndarray) -> str:
        if name not in self.array_inits:
            self.initializers.append(numpy_helper.from_array(array, name))
            self.array_inits.add(name)
        return name


def emit_update(b: Builder, i: int, family: str, variant: str, group: int, shape, grad: str | None = None, pname: str | None = None) -> dict:
    """One parameter's update, as ``family`` exports ``torch.optim._functional.sgd`` for ``variant``."""
    lr, m = GROUPS[group]
    dtype = FLOAT16 if variant == "fp16_wd" else FLOAT
    wd = WEIGHT_DECAY if variant in ("wd", "damp", "damp_eq_m", "nesterov_wd", "fp16_wd") else 0.0
    d = {"damp": 0.25, "damp_eq_m": 0.1}.get(variant, 0.0)
    if variant == "damp_eq_m":
        m = 0.9
    nesterov = variant == "nesterov_wd"
    maximize = variant == "maximize"
    vi = (dtype, shape)

    p = pname or b.add_input("param", f"p{i}", dtype, shape)
    g = grad or b.add_input("grad", f"grad_p{i}", dtype, shape)
    buf = b.add_input("buf", f"buf_p{i}", dtype, shape)
    p_out, buf_out = f"{p}_out", f"{buf}_out"
    b.add_output("param", p_out, dtype, shape)
    b.add_output("buf", buf_out, dtype, shape)
    direct = family != "noopt"  # dynamo/legacy name the final Adds after the graph outputs

    P, B = p, buf
    if family == "noopt":
        P = b.node(family, "Identity", [p], vi=vi)
        B = b.node(family, "Identity", [buf], vi=vi)
    G = g
    if maximize:
        G = b.node(family, "Neg", [g], vi=vi)
    if wd:
        G = b.node(family, "Add", [G, b.node(family, "Mul", [P, b.scalar(family, wd, dtype, P)])], vi=vi)
    mb = b.node(family, "Mul", [B, b.scalar(family, m, dtype, B, buffer_momentum=True)], vi=vi)
    gd = b.node(family, "Mul", [G, b.scalar(family, 1.0 - d, dtype, G)]) if d else G
    new_buf = b.node(family, "Add", [mb, gd], out=buf_out if direct else None, vi=None if direct else vi)
    step = new_buf
    if nesterov:
        step = b.node(family, "Add", [G, b.node(family, "Mul", [new_buf, b.scalar(family, m, dtype, new_buf)])], vi=vi)
    if variant == "lr_tensor":
        neg_lr = b.neg_lr_tensor(family, step)
    else:
        neg_lr = b.scalar(family, -lr, dtype, step)
    new_p = b.node(family, "Add", [P, b.node(family, "Mul", [step, neg_lr])], out=p_out if direct else None, vi=None if direct else vi)
    if family == "noopt":
        b.node(family, "Identity", [new_p], out=p_out, tail=True)
        b.node(family, "Identity", [new_buf], out=buf_out, tail=True)
    return {
        "parameters": p,
        "parameters_out": p_out,
        "accum": buf,
        "accum_out": buf_out,
        "family": family,
        "variant": variant,
        "lr": "input:lr" if variant == "lr_tensor" else lr,
        "momentum": m,
        "dampening": d,
        "weight_decay": wd,
        "nesterov": nesterov,
        "maximize": maximize,
        "dtype": "float16" if dtype == FLOAT16 else "float32",
        "shape": list(shape),
        "gradient": grad or g,
    }


def build(n_updates: int, seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """A model with ``n_updates`` momentum-SGD updates and the unrelated nodes; and its manifest."""
    rng = random.Random(seed)
    b = Builder()
    updates: list[dict] = []
    n_forward = max(2, n_updates // 50)
    n_decoys = max(2, n_updates // 100)

    # Forward chains over updated [4, 4] weights; gradients of those weights computed in the graph. Each chain
    # is CHAIN_DEPTH layers from the input, with a loss of its own: one chain of hundreds of plain ReLU layers
    # goes dead on any random data within about 14 layers, which no real network does (normalisation and
    # skip connections keep them alive), and `check` then cannot compare the dead layers' updates. Even chains
    # of 4 ReLU layers over [4, 4] weights die on some random draws (8 of 1,000 layers at 50k under `check`, one
    # at 10k under `lower`'s check): Tanh never outputs an exact zero, so every gradient stays live.
    x = b.add_input("data", "x", FLOAT, [BATCH, 4])
    h = x
    layers = []
    for k in range(n_forward):
        w = b.add_input("param", f"fc{k}.weight", FLOAT, [4, 4])
        mm = b.node("dynamo", "MatMul", [h, w], unrelated=True, vi=(FLOAT, [BATCH, 4]))
        h_next = b.node("dynamo", "Tanh", [mm], unrelated=True, vi=(FLOAT, [BATCH, 4]))
        layers.append((w, h, h_next))
        h = h_next
        if (k + 1) % CHAIN_DEPTH == 0 or k == n_forward - 1:
            name = "loss" if k < CHAIN_DEPTH else f"loss_{k // CHAIN_DEPTH}"
            loss = b.node("dynamo", "ReduceMean", [h], out=name, unrelated=True, keepdims=0)
            b.add_output("loss", loss, FLOAT, [])
            if k < n_forward - 1:
                h = x  # the next chain starts again from the input; the last chain's end feeds the metrics
    grads = []
    for w, h_prev, h_next in layers:
        t = b.node("dynamo", "Transpose", [h_prev], unrelated=True, perm=[1, 0], vi=(FLOAT, [4, BATCH]))
        grads.append(b.node("dynamo", "MatMul", [t, h_next], unrelated=True, vi=(FLOAT, [4, 4])))

    for k, (w, _, _) in enumerate(layers):
        variant = "plain" if k % 2 == 0 else "wd"
        updates.append(emit_update(b, k, "dynamo", variant, k % len(GROUPS), (4, 4), grad=grads[k], pname=w))
    for i in range(n_forward, n_updates):
        family = _pick(rng, FAMILIES)
        variant = _pick(rng, VARIANTS)
        group = rng.randrange(len(GROUPS))
        shape = SHAPES[rng.randrange(len(SHAPES))]
        updates.append(emit_update(b, i, family, variant, group, shape))

    # Must not fuse: EMA running statistics, momentum-free SGD, metrics.
    for k in range(n_decoys):
        family = "dynamo" if k % 2 else "legacy"
        rs = b.add_input("other", f"bn{k}.running_mean", FLOAT, [8])
        batch_mean = b.add_input("other", f"bn{k}.batch_mean", FLOAT, [8])
        if family == "dynamo":
            c_old, c_new = b.init_scalar(0.9, FLOAT), b.init_scalar(0.1, FLOAT)
        else:
            c_old, c_new = b.legacy_constant(0.9, FLOAT, unrelated=True), b.legacy_constant(0.1, FLOAT, unrelated=True)
        a = b.node(family, "Mul", [rs, c_old], unrelated=True)
        c = b.node(family, "Mul", [batch_mean, c_new], unrelated=True)
        b.node(family, "Add", [a, c], out=f"{rs}_out", unrelated=True)
        b.add_output("other", f"{rs}_out", FLOAT, [8])

        q = b.add_input("other", f"frozen{k}", FLOAT, [4, 4])
        gq = b.add_input("other", f"grad_frozen{k}", FLOAT, [4, 4])
        neg = b.init_scalar(-0.1, FLOAT) if family == "dynamo" else b.legacy_constant(-0.1, FLOAT, unrelated=True)
        s = b.node(family, "Mul", [gq, neg], unrelated=True)
        b.node(family, "Add", [q, s], out=f"{q}_out", unrelated=True)
        b.add_output("other", f"{q}_out", FLOAT, [4, 4])
    for name in ("metric_a", "metric_b"):
        s = b.node("dynamo", "Sub", [h, x], unrelated=True, vi=(FLOAT, [BATCH, 4]))
        sq = b.node("dynamo", "Mul", [s, s], unrelated=True, vi=(FLOAT, [BATCH, 4]))
        b.node("dynamo", "Sigmoid", [sq], out=name, unrelated=True)
        b.add_output("other", name, FLOAT, [BATCH, 4])

    graph = helper.make_graph(
        b.nodes + b.tail,
        "sgd_bench_train_step",
        b.inputs["data"] + b.inputs["param"] + b.inputs["grad"] + b.inputs["buf"] + b.inputs["other"],
        b.outputs["loss"] + b.outputs["param"] + b.outputs["buf"] + b.outputs["other"],
        initializer=b.initializers,
        value_info=b.value_info,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="sgdfuse-bench", producer_version="1")
    model.ir_version = 10
    counts: dict[str, int] = {}
    for u in updates:
        key = f"{u['family']}/{u['variant']}"
        counts[key] = counts.get(key, 0) + 1
    manifest = {
        "generator": "bench/generate.py",
        "seed": seed,
        "momentum_updates": len(updates),
        "nodes": len(graph.node),
        "forms": dict(sorted(counts.items())),
        "updates": updates,
        "unrelated_nodes": b.unrelated,
    }
    return model, manifest


def write(out_dir: str, n_updates: int, seed: int = 0) -> str:
    """Write ``sgd_bench_<N>.onnx`` and its manifest into ``out_dir``; return the model path."""
    os.makedirs(out_dir, exist_ok=True)
    model, manifest = build(n_updates, seed)
    path = os.path.join(out_dir, f"sgd_bench_{n_updates}.onnx")
    onnx.save(model, path)
    with open(path[: -len(".onnx")] + ".manifest.json", "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000], help="momentum updates per file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="also run onnx.checker on each file")
    args = parser.parse_args(argv)
    for n in args.sizes:
        start = time.perf_counter()
        path = write(args.out_dir, n, args.seed)
        if args.check:
            onnx.checker.check_model(path)
        print(f"{path}: {n} updates, {os.path.getsize(path) / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
