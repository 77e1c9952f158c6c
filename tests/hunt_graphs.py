"""Momentum-SGD steps in the shape PyTorch's dynamo exporter writes them, for formulations a public-bug-report
hunt found refused although they are momentum SGD (or refused for a wrong reason).

Names are the exporter's defaults (inputs after the step function's arguments ``p0, g0, b0, ...``; values after
the FX nodes, ``mul``, ``add_1``, ``where_2``; constants ``val_N``), opset 20, IR 10, FLOAT. Each update is
``torch.optim._functional.sgd``'s single-tensor path after the first step, ``buf = m*buf + (1-d)*g`` and
``p = p - lr*buf`` (``Add(p, Mul(buf, -lr))`` as the exporter folds it), around which each builder writes the
feature named: a loss scaler's skip (``torch.where``), a clip factor, an FP16 round trip of the gradient, a
first-step ``torch.where`` on a broadcast condition.

The expected numbers of a test come from numpy (``tests/test_hunt_formulations.py``), never from these graphs.

Write every graph to a folder, to run ``sgdfuse optimize`` on them::

    python tests/hunt_graphs.py /tmp/hunt
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["LR", "MOMENTUM", "DAMPENING", "SHAPES", "GUARD_FORMS", "Exported", "loss_scaled", "clipped", "fp16_round_trip", "broadcast_first_step", "reads_fused_update", "READER_GRADIENTS", "ALL"]

LR, MOMENTUM, DAMPENING = 0.1, 0.9, 0.25
SHAPES = ((4, 3), (4, 3), (3,))
"""Two parameters of one shape (one structural class) and one of another."""

F32 = TensorProto.FLOAT


class Exported:
    """Appends nodes named the way the dynamo exporter names them: ``base``, ``base_1``, ``base_2``..."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self._taken: dict[str, int] = {}

    def name(self, base: str) -> str:
        count = self._taken.get(base, -1) + 1
        self._taken[base] = count
        return base if count == 0 else f"{base}_{count}"

    def op(self, op_type: str, inputs: Sequence[str], base: str, **attributes) -> str:
        out = self.name(base)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"node_{out}", **attributes))
        return out

    def const(self, number, dtype=np.float32, shape=()) -> str:
        out = self.name("val")
        self.initializers.append(numpy_helper.from_array(np.full(shape, number, dtype=dtype), out))
        return out

    def input(self, name: str, dtype: int = F32, shape: Sequence[int] = ()) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def model(self, outputs: Sequence[tuple[str, Sequence[int]]]) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, "main_graph", self.inputs, [helper.make_tensor_value_info(o, F32, list(s)) for o, s in outputs], self.initializers
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10, producer_name="pytorch")
        onnx.checker.check_model(model, full_check=True)
        return model

    def state(self, shapes: Sequence[Sequence[int]]) -> tuple[list[str], list[str], list[str]]:
        """Inputs ``p0.., g0.., b0..`` (the forward signature's order: parameters, gradients, buffers)."""
        groups = [[self.input(f"{kind}{i}", F32, s) for i, s in enumerate(shapes)] for kind in "pgb"]
        return groups[0], groups[1], groups[2]

    def momentum(self, buf: str, grad: str, *, one_minus_d: float = 1 - DAMPENING) -> str:
        """``buf*m + grad*(1-d)`` (``torch.optim.sgd``: ``buf.mul_(m).add_(grad, alpha=1 - d)``)."""
        scaled = self.op("Mul", [buf, self.const(MOMENTUM)], "mul")
        damped = grad if one_minus_d == 1.0 else self.op("Mul", [grad, self.const(one_minus_d)], "mul")
        return self.op("Add", [scaled, damped], "add")

    def step(self, param: str, buf: str, *, lr: float = LR) -> str:
        """``p + buf*(-lr)`` (``p.add_(buf, alpha=-lr)``)."""
        return self.op("Add", [param, self.op("Mul", [buf, self.const(-lr)], "mul")], "add")

    def isfinite_all(self, grads: Sequence[str]) -> str:
        """``torch.stack([torch.isfinite(g).all() for g in grads]).all()`` as dynamo decomposes it: ``isfinite``
        is ``|g| != inf and g == g``, ``all`` a ``ReduceMin`` over INT32."""
        alls = []
        for g in grads:
            finite_ne = self.op("Not", [self.op("Equal", [self.op("Abs", [g], "abs"), self.const(np.inf)], "val")], "ne")
            finite = self.op("And", [self.op("Equal", [g, g], "eq"), finite_ne], "logical_and")
            reduced = self.op("ReduceMin", [self.op("Cast", [finite], "val", to=TensorProto.INT32)], "val", keepdims=0)
            alls.append(self.op("Cast", [reduced], "all", to=TensorProto.BOOL))
        axis = self.const(0, np.int64, (1,))
        stacked = self.op("Concat", [self.op("Unsqueeze", [a, axis], "val") for a in alls], "stack", axis=0)
        reduced = self.op("ReduceMin", [self.op("Cast", [stacked], "val", to=TensorProto.INT32)], "val", keepdims=0)
        return self.op("Cast", [reduced], "all", to=TensorProto.BOOL)

    def nonfinite_any(self, grads: Sequence[str]) -> str:
        """``torch.stack([(g.isinf() | g.isnan()).any() for g in grads]).any()``."""
        anys = []
        for g in grads:
            bad = self.op("Or", [self.op("IsInf", [g], "isinf"), self.op("IsNaN", [g], "isnan")], "bitwise_or")
            reduced = self.op("ReduceMax", [self.op("Cast", [bad], "val", to=TensorProto.INT32)], "val", keepdims=0)
            anys.append(self.op("Cast", [reduced], "any", to=TensorProto.BOOL))
        axis = self.const(0, np.int64, (1,))
        stacked = self.op("Concat", [self.op("Unsqueeze", [a, axis], "val") for a in anys], "stack", axis=0)
        reduced = self.op("ReduceMax", [self.op("Cast", [stacked], "val", to=TensorProto.INT32)], "val", keepdims=0)
        return self.op("Cast", [reduced], "any", to=TensorProto.BOOL)


GUARD_FORMS = ("not_per_where", "mixed_polarity", "expand", "detach", "isfinite_all", "nonfinite_any")


def loss_scaled(form: str, *, guarded: str = "both", shapes=SHAPES) -> onnx.ModelProto:
    """A loss scaler's skipped step: each state's output is ``torch.where`` of its update and its old value.

    ``form`` says how the skip is written:

    * ``not_per_where``: ``torch.where(~found_inf, new, old)`` for every state, so that each ``Where`` reads a
      ``Not`` of its own (dynamo does not share them), ``found_inf`` a BOOL input;
    * ``mixed_polarity``: the parameters ``torch.where(found_inf, p, new)``, the buffers
      ``torch.where(~found_inf, new, b)``;
    * ``expand``: ``jnp.where(finite, new, old)`` as JAX writes it, the predicate broadcast to the state's shape
      (``Expand``), ``finite`` a BOOL input;
    * ``detach``: ``torch.where(found_inf, p.detach(), new)`` (the kept value an ``Identity`` of the state);
    * ``isfinite_all``: ``torch.where(finite, new, old)``, ``finite`` computed from the gradients;
    * ``nonfinite_any``: ``torch.where(found_inf, old, new)``, ``found_inf = any(isinf(g) | isnan(g))``.

    ``guarded``: ``"both"``, or ``"parameters"`` / ``"buffer"`` to guard that state only (the other's output
    is its update on every step). Outputs: the parameters' next values, then the buffers'.
    """
    b = Exported()
    params, grads, bufs = b.state(shapes)
    if form in ("isfinite_all", "nonfinite_any"):
        flag = b.isfinite_all(grads) if form == "isfinite_all" else b.nonfinite_any(grads)
        keep_when = form == "nonfinite_any"
    else:
        flag = b.input("finite" if form == "expand" else "found_inf", TensorProto.BOOL)
        keep_when = form != "expand"
    new_params, new_bufs = [], []
    for p, g, buf in zip(params, grads, bufs):
        new_buf = b.momentum(buf, g)
        new_bufs.append(new_buf)
        new_params.append(b.step(p, new_buf))

    def where(new: str, old: str, shape, kind: str) -> str:
        if form == "not_per_where" or (form == "mixed_polarity" and kind == "buffer"):
            return b.op("Where", [b.op("Not", [flag], "bitwise_not"), new, old], "where")
        if form == "expand":
            return b.op("Where", [b.op("Expand", [flag, b.const(shape, np.int64, (len(shape),))], "expand"), new, old], "where")
        if form == "detach":
            old = b.op("Identity", [old], "detach")
        return b.op("Where", [flag, old, new] if keep_when else [flag, new, old], "where")

    outputs = []
    for kind, news, olds in (("parameters", new_params, params), ("buffer", new_bufs, bufs)):
        for new, old, shape in zip(news, olds, shapes):
            outputs.append((where(new, old, shape, kind) if guarded in ("both", kind) else new, shape))
    return b.model(outputs)


def clipped(*, first_step: bool = True, first_unclipped: bool = False, shapes=SHAPES) -> onnx.ModelProto:
    """``clip_grad_norm_`` then SGD with dampening 0.25: ``clip_coef = min(1, 1.0 / (total_norm + 1e-6))``
    computed in the graph (``ReduceL2`` per gradient, stacked, ``ReduceL2`` again), ``g_c = g * clip_coef``;
    with ``first_step``, ``buf = torch.where(step == 0, g_c, m*buf + (1-d)*g_c)`` on an INT64 ``step`` input
    (``momentum_buffer is None`` written as a step test). ``first_unclipped``: the first step takes the
    unclipped ``g`` (a different gradient on the first step: not one SGD update)."""
    b = Exported()
    params, grads, bufs = b.state(shapes)
    step = b.input("step", TensorProto.INT64) if first_step else None
    axis = b.const(0, np.int64, (1,))
    norms = [b.op("Unsqueeze", [b.op("ReduceL2", [g], "linalg_vector_norm", keepdims=0), axis], "val") for g in grads]
    total = b.op("ReduceL2", [b.op("Concat", norms, "stack", axis=0)], "linalg_vector_norm", keepdims=0)
    coef = b.op("Div", [b.const(1.0), b.op("Add", [total, b.const(1e-6)], "add")], "div")
    clamped = b.op("Min", [coef, b.const(1.0)], "clamp")
    new_params, new_bufs = [], []
    for p, g, buf in zip(params, grads, bufs):
        clipped_g = b.op("Mul", [g, clamped], "mul")
        new_buf = b.momentum(buf, clipped_g)
        if step is not None:
            first = b.op("Equal", [step, b.const(0, np.int64)], "eq")
            new_buf = b.op("Where", [first, g if first_unclipped else clipped_g, new_buf], "where")
        new_bufs.append(new_buf)
        new_params.append(b.step(p, new_buf))
    return b.model([*zip(new_params, shapes), *zip(new_bufs, shapes)])


def fp16_round_trip(*, mixed: bool = False, shapes=SHAPES) -> onnx.ModelProto:
    """Gradient compression: ``g_c = g.half().float()`` (``Cast`` to FLOAT16 and back, ``_to_copy``), then SGD
    with dampening 0.25 on ``g_c``. ``mixed``: the buffer adds half of ``g_c`` and half of the exact ``g``
    (``(m*buf + 0.375*g_c) + 0.375*g``): no one value holds the gradient term, and reading it as ``g_c`` or ``g``
    would be wrong by the rounding."""
    b = Exported()
    params, grads, bufs = b.state(shapes)
    new_params, new_bufs = [], []
    for p, g, buf in zip(params, grads, bufs):
        g16 = b.op("Cast", [b.op("Cast", [g], "_to_copy", to=TensorProto.FLOAT16)], "_to_copy", to=F32)
        if mixed:
            half = (1 - DAMPENING) / 2
            partial = b.op("Add", [b.op("Mul", [buf, b.const(MOMENTUM)], "mul"), b.op("Mul", [g16, b.const(half)], "mul")], "add")
            new_buf = b.op("Add", [partial, b.op("Mul", [g, b.const(half)], "mul")], "add")
        else:
            new_buf = b.momentum(buf, g16)
        new_bufs.append(new_buf)
        new_params.append(b.step(p, new_buf))
    return b.model([*zip(new_params, shapes), *zip(new_bufs, shapes)])


def broadcast_first_step(*, per_element: bool = False, shapes=SHAPES) -> onnx.ModelProto:
    """PyTorch's first step (``buf = g`` when there is no buffer yet) written as a ``where`` whose condition is
    ``step == 0`` broadcast to the parameter's shape (``Expand``, as JAX's ``jnp.where`` and
    ``torch.where(cond.expand_as(g), ...)`` write it), dampening 0.25. ``per_element``: the condition is
    ``steps == 0`` on an INT64 tensor of the parameter's shape (per-element step counts; not one boolean)."""
    b = Exported()
    params, grads, bufs = b.state(shapes)
    step = None if per_element else b.input("step", TensorProto.INT64)
    new_params, new_bufs = [], []
    for i, (p, g, buf) in enumerate(zip(params, grads, bufs)):
        later = b.momentum(buf, g)
        if per_element:
            first = b.op("Equal", [b.input(f"steps{i}", TensorProto.INT64, shapes[i]), b.const(0, np.int64)], "eq")
        else:
            shape = b.const(shapes[i], np.int64, (len(shapes[i]),))
            first = b.op("Expand", [b.op("Equal", [step, b.const(0, np.int64)], "eq"), shape], "expand")
        new_buf = b.op("Where", [first, g, later], "where")
        new_bufs.append(new_buf)
        new_params.append(b.step(p, new_buf))
    return b.model([*zip(new_params, shapes), *zip(new_bufs, shapes)])


READER_GRADIENTS = ("twice_new_weights", "new_weights_times_c", "twice_new_buffer", "new_weights_plus_input")
"""How :func:`reads_fused_update`'s second update computes its gradient from the first one's new values."""


def reads_fused_update(gradient: str = "twice_new_weights", *, first_step: bool = True, chain: int = 2, decoupled_decay: bool = False,
                       shape=(4, 3), dampening: float = DAMPENING, lr: float = LR) -> onnx.ModelProto:
    """``chain`` momentum-SGD updates in which update ``i + 1``'s gradient is computed elementwise from update
    ``i``'s *new* values (update 0 reads the input ``g0``), dampening ``dampening`` (0.25; 0 writes no
    ``Mul`` by ``1 - d``), learning rate ``lr``, PyTorch's first step ``buf = g`` as
    ``where(step == 0, g, m*buf + (1-d)*g)`` broadcast with ``Expand`` when ``first_step``::

        twice_new_weights:      g_{i+1} = 2 * p_i_new         (Mul by a constant initializer)
        new_weights_times_c:    g_{i+1} = p_i_new * c         (c = 0.5, operands swapped: Mul(c, p_i_new))
        twice_new_buffer:       g_{i+1} = 2 * buf_i_new
        new_weights_plus_input: g_{i+1} = 2 * p_i_new + h_{i+1}   (h an input)
        twice_step:             g_{i+1} = 2 * (buf_i_new * -lr)   (the step update i subtracts; not in READER_GRADIENTS)

    ``decoupled_decay``: the last update is ``p - lr*buf - 0.01*p`` (decoupled weight decay, not momentum
    SGD: ``extra-term``). The outputs are each update's new parameters and new buffer, in update order."""
    b = Exported()
    params = [b.input(f"p{i}", F32, shape) for i in range(chain)]
    bufs = [b.input(f"b{i}", F32, shape) for i in range(chain)]
    grad = b.input("g0", F32, shape)
    step = b.input("step", TensorProto.INT64) if first_step else None
    outputs = []
    for i in range(chain):
        later = b.momentum(bufs[i], grad, one_minus_d=1 - dampening)
        if first_step:
            first = b.op("Expand", [b.op("Equal", [step, b.const(0, np.int64)], "eq"), b.const(shape, np.int64, (len(shape),))], "expand")
            new_buf = b.op("Where", [first, grad, later], "where")
        else:
            new_buf = later
        new_p = b.step(params[i], new_buf, lr=lr)
        if decoupled_decay and i == chain - 1:
            new_p = b.op("Sub", [new_p, b.op("Mul", [params[i], b.const(0.01)], "mul")], "sub")
        outputs += [(new_p, shape), (new_buf, shape)]
        if gradient == "twice_new_weights":
            grad = b.op("Mul", [new_p, b.const(2.0)], "mul")
        elif gradient == "new_weights_times_c":
            grad = b.op("Mul", [b.const(0.5), new_p], "mul")
        elif gradient == "twice_new_buffer":
            grad = b.op("Mul", [new_buf, b.const(2.0)], "mul")
        elif gradient == "new_weights_plus_input":
            grad = b.op("Add", [b.op("Mul", [new_p, b.const(2.0)], "mul"), b.input(f"h{i + 1}", F32, shape)], "add")
        elif gradient == "twice_step" and not decoupled_decay:
            step_taken = next(node for node in b.nodes if node.output[0] == new_p).input[1]  # Mul(new_buf, -lr)
            grad = b.op("Mul", [step_taken, b.const(2.0)], "mul")
        else:
            raise ValueError(f"unknown gradient form {gradient!r}; one of {READER_GRADIENTS + ('twice_step',)}")
    return b.model(outputs)


ALL = {
    **{f"loss_scaled_{form}": (lambda form=form: loss_scaled(form)) for form in GUARD_FORMS},
    "loss_scaled_parameters_only": lambda: loss_scaled("isfinite_all", guarded="parameters"),
    "loss_scaled_buffer_only": lambda: loss_scaled("nonfinite_any", guarded="buffer"),
    "clipped_first_step": clipped,
    "clipped_no_first_step": lambda: clipped(first_step=False),
    "clipped_first_step_unclipped": lambda: clipped(first_unclipped=True),
    "fp16_round_trip": fp16_round_trip,
    "fp16_round_trip_mixed": lambda: fp16_round_trip(mixed=True),
    "broadcast_first_step": broadcast_first_step,
    "per_element_first_step": lambda: broadcast_first_step(per_element=True),
    **{f"reads_fused_{form}": (lambda form=form: reads_fused_update(form)) for form in READER_GRADIENTS},
    "reads_fused_chain_of_three": lambda: reads_fused_update(chain=3),
    "reads_fused_decoupled_decay": lambda: reads_fused_update(decoupled_decay=True),
}
"""Every graph of this module by file stem."""


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    folder.mkdir(parents=True, exist_ok=True)
    for stem, build in ALL.items():
        onnx.save(build(), folder / f"{stem}.onnx")
        print(folder / f"{stem}.onnx")
