"""Corpus of equivalent formulations of momentum SGD: each must fuse with the right roles and
hyper-parameters (given here from the form we wrote, not read off the matcher), and the fused model must
compute what the original computes (checked with onnxruntime directly, not through sgdfuse.verify)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import sgdfuse
from forms import SCALAR_STYLES, Builder, np_dtype, outputs_agree

LR, M, D, WD = 0.01, 0.9, 0.25, 1e-3


def _state(b: Builder):
    return b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")


def _fuses_as(model, *, lr=LR, momentum=M, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, rtol=2e-5, gradient="g", allow_rounding=False):
    result = sgdfuse.optimize(model, allow_rounding=allow_rounding)
    assert not result.report.refused, result.report
    assert len(result.report.fused) == 1, result.report
    f = result.report.fused[0]
    assert (f.parameters, f.accum, f.parameters_out, f.accum_out) == ("p", "buf", "p_new", "buf_new")
    assert f.gradient == gradient
    if isinstance(lr, str):
        assert isinstance(f.learning_rate, str) and lr in f.learning_rate
    else:
        assert f.learning_rate == pytest.approx(lr, rel=1e-5)
    assert f.momentum == pytest.approx(momentum, rel=1e-5)
    assert f.dampening == pytest.approx(dampening, rel=1e-5, abs=1e-6)
    assert f.weight_decay == pytest.approx(weight_decay, rel=1e-5, abs=1e-9)
    assert (f.nesterov, f.maximize) == (nesterov, maximize)
    assert [n.op_type for n in result.model.graph.node].count("SGD") == 1
    onnx.checker.check_model(result.model, full_check=True)
    outputs_agree(model, result.model, rtol)
    return result


def _buffer(b, p, g, buf, *, m=M, one_minus_d=1.0, wd=0.0, style="initializer", order=0):
    grad = g
    if wd:
        decay = b.mul(p, b.scalar(wd, style)) if order % 2 == 0 else b.mul(b.scalar(wd, style), p)
        grad = b.add(grad, decay) if order % 2 == 0 else b.add(decay, grad)
    scaled = grad if one_minus_d == 1.0 else b.mul(grad, b.scalar(one_minus_d, style))
    momentum = b.mul(buf, b.scalar(m, style)) if order // 2 % 2 == 0 else b.mul(b.scalar(m, style), buf)
    return b.add(momentum, scaled, out="buf_new") if order // 4 % 2 == 0 else b.add(scaled, momentum, out="buf_new"), grad


@pytest.mark.parametrize("order", range(8))
def test_sub_of_lr_times_buffer_fuses_in_every_operand_order(order):
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf, order=order)
    step = b.mul(b.scalar(LR), v) if order % 2 else b.mul(v, b.scalar(LR))
    b.sub(p, step, out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


def test_add_of_buffer_times_negative_lr_fuses():
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf)
    b.add(p, b.mul(v, b.scalar(-LR)), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


def test_add_of_negated_product_fuses():
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf)
    b.add(b.neg(b.mul(b.scalar(LR), v)), p, out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


def test_division_by_reciprocal_learning_rate_fuses():
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf)
    b.sub(p, b.div(v, b.scalar(1 / LR)), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


def test_reassociated_update_without_reading_new_buffer_fuses():
    # p' = p - (lr*m)*buf - lr*g equals p - lr*buf' algebraically, though it never reads buf'.
    b = Builder()
    p, g, buf = _state(b)
    _buffer(b, p, g, buf)
    lr_m = b.mul(b.scalar(LR), b.scalar(M))
    b.sub(b.sub(p, b.mul(lr_m, buf)), b.mul(b.scalar(LR), g), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


def test_lr_times_momentum_times_buffer_reassociated_fuses():
    # buf' = m*buf + g, p' = p - lr*(m*buf) - lr*g with lr*(m*buf) computed as (lr*m)*buf's mirror.
    b = Builder()
    p, g, buf = _state(b)
    mb = b.mul(b.scalar(M), buf)
    b.add(mb, g, out="buf_new")
    b.sub(p, b.add(b.mul(b.scalar(LR), mb), b.mul(b.scalar(LR), g)), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


def test_explicit_one_minus_dampening_sub_node_fuses():
    b = Builder()
    p, g, buf = _state(b)
    omd = b.sub(b.scalar(1.0), b.scalar(D))
    b.add(b.mul(buf, b.scalar(M)), b.mul(g, omd), out="buf_new")
    b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), dampening=D)


def test_folded_one_minus_dampening_constant_fuses():
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf, one_minus_d=1 - D)
    b.sub(p, b.mul(b.scalar(LR), v), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), dampening=D)


@pytest.mark.parametrize("order", [0, 1])
def test_weight_decay_written_either_way_fuses(order):
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf, wd=WD, one_minus_d=1 - D, order=order)
    b.sub(p, b.mul(b.scalar(LR), v), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), dampening=D, weight_decay=WD)


def test_nesterov_pytorch_form_fuses():
    # p' = p - lr*(grad + m*buf')
    b = Builder()
    p, g, buf = _state(b)
    v, grad = _buffer(b, p, g, buf, wd=WD)
    b.sub(p, b.mul(b.add(grad, b.mul(v, b.scalar(M))), b.scalar(LR)), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), weight_decay=WD, nesterov=True)


def test_nesterov_lookahead_form_fuses():
    # p' = p - lr*((1+m)*buf' - m*buf), the other published form.
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf)
    look = b.sub(b.mul(b.scalar(1 + M), v), b.mul(b.scalar(M), buf))
    b.sub(p, b.mul(b.scalar(LR), look), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), nesterov=True)


def test_maximize_negated_gradient_fuses_and_feeds_negation():
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, b.neg(g), buf)
    b.sub(p, b.mul(b.scalar(LR), v), out="p_new")
    result = _fuses_as(b.model(["p_new", "buf_new"]), maximize=True)
    assert "Neg" in [n.op_type for n in result.model.graph.node]


def test_ema_momentum_is_contract_with_dampening_equal_momentum():
    # buf = beta*buf + (1 - beta)*g. With beta = 0.5 it reads as dampening 0.5 on g; with beta = 0.9 the
    # op's g - g*0.9 would round 9 times the (1 - beta)*g it leaves, so the graph's own (1 - beta)*g value is
    # the gradient, with dampening 0.
    for beta in (0.5, 0.9):
        b = Builder()
        p, g, buf = _state(b)
        scaled = b.mul(b.sub(b.scalar(1.0), b.scalar(beta)), g)
        b.add(b.mul(buf, b.scalar(beta)), scaled, out="buf_new")
        b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
        if beta == 0.5:
            _fuses_as(b.model(["p_new", "buf_new"]), momentum=beta, dampening=beta)
        else:
            _fuses_as(b.model(["p_new", "buf_new"]), momentum=beta, dampening=0.0, gradient=scaled)


def test_scaled_gradient_accumulation_is_momentum_one():
    # buf_new = buf + 0.1*g. Read with gradient g it needs dampening 0.9, and the op forms 1 - 0.9 in float32
    # as 0.100000024 where the graph has 0.1 (3 float32 spacings off); the graph's own value 0.1*g is the
    # exact gradient, with dampening 0.
    c = 0.1
    b = Builder()
    p, g, buf = _state(b)
    scaled = b.mul(b.scalar(c), g)
    b.add(buf, scaled, out="buf_new")
    b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), momentum=1.0, dampening=0.0, gradient=scaled)


@pytest.mark.parametrize("style", SCALAR_STYLES)
def test_scalar_styles_fuse(style):
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, g, buf, wd=WD, one_minus_d=1 - D, style=style)
    b.sub(p, b.mul(b.scalar(LR, style), v), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]), dampening=D, weight_decay=WD)


def test_identity_cast_castlike_chains_fuse():
    b = Builder()
    p, g, buf = _state(b)
    v, _ = _buffer(b, p, b.identity(b.op("Cast", g, to=TensorProto.FLOAT)), b.identity(buf))
    step = b.op("CastLike", b.mul(b.scalar(LR), b.identity(v)), p)
    b.identity(b.sub(b.identity(p), step), out="p_new")
    _fuses_as(b.model(["p_new", "buf_new"]))


@pytest.mark.parametrize("shape", [(), (1,)])
def test_learning_rate_graph_input_stays_an_input(shape):
    b = Builder()
    p, g, buf = _state(b)
    lr = b.scalar_input("lr", shape=shape)
    v, _ = _buffer(b, p, g, buf)
    b.sub(p, b.mul(lr, v), out="p_new")
    result = _fuses_as(b.model(["p_new", "buf_new"]), lr="lr")
    assert [i.name for i in result.model.graph.input] == ["p", "g", "buf", "lr"]
    sgd = next(n for n in result.model.graph.node if n.op_type == "SGD")
    assert sgd.input[2] == "lr"


def test_float_learning_rate_input_cast_to_float16_parameters_fuses():
    b = Builder(dtype=TensorProto.FLOAT16)
    p, g, buf = _state(b)
    lr = b.scalar_input("lr", dtype=TensorProto.FLOAT)
    v, _ = _buffer(b, p, g, buf)
    lr16 = b.op("Cast", lr, to=TensorProto.FLOAT16)
    b.sub(p, b.mul(lr16, v), out="p_new")
    # The graph multiplies by the FLOAT16 cast of lr: that cast value is the op's learning rate, unrounded.
    _fuses_as(b.model(["p_new", "buf_new"]), lr=lr16, momentum=float(np.float16(M)), rtol=4e-3)


@pytest.mark.parametrize("momentum", [M, 0.0])
@pytest.mark.parametrize("dampening", [0.0, D])
def test_momentum_graph_input_fuses_and_keeps_the_graphs_momentum_zero_behaviour(momentum, dampening):
    # With momentum 0 the contract keeps the old buffer, while this graph writes (1-d)*g: the fused model
    # must still output what the graph outputs, for a non-zero and for a zero momentum fed at run time.
    b = Builder()
    p, g, buf = _state(b)
    m = b.scalar_input("m")
    b.add(b.mul(buf, m), b.mul(g, b.scalar(1 - dampening)), out="buf_new")
    b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
    model = b.model(["p_new", "buf_new"])
    result = sgdfuse.optimize(model)
    assert len(result.report.fused) == 1, result.report
    assert result.report.fused[0].momentum == "m"
    assert "If" in [n.op_type for n in result.model.graph.node]
    onnx.checker.check_model(result.model, full_check=True)
    outputs_agree(model, result.model, rtol=2e-5, momentum=momentum)


def _low_precision_state_float_math(dtype, lr=LR, momentum=M):
    b = Builder(dtype=dtype)
    p, g, buf = _state(b)
    f = TensorProto.FLOAT
    p32, g32, b32 = (b.op("Cast", x, to=f) for x in (p, g, buf))
    v32 = b.add(b.mul(b32, b.scalar(momentum, dtype=f)), b.mul(g32, b.scalar(1 - D, dtype=f)))
    b.op("Cast", v32, out="buf_new", to=dtype)
    b.op("Cast", b.sub(p32, b.mul(b.scalar(lr, dtype=f), v32)), out="p_new", to=dtype)
    return b.model(["p_new", "buf_new"])


@pytest.mark.parametrize(
    "dtype, lr, momentum, becomes",
    [
        (TensorProto.FLOAT16, 1e-8, M, "learning rate 9.99999994e-09 becomes 0"),  # below FLOAT16's least subnormal
        (TensorProto.BFLOAT16, LR, 0.999, "becomes 1 and the buffer would no longer decay"),  # 0.999 rounds to 1.0
        (TensorProto.FLOAT16, LR, 0.9999, "becomes 1 and the buffer would no longer decay"),
    ],
)
def test_a_rounding_that_makes_another_update_is_refused_even_when_rounding_is_allowed(dtype, lr, momentum, becomes):
    # A user trial: with --allow-rounding, lr 1e-8 fused as 0 in FLOAT16 (the weights never moved; 31% off after
    # 20 steps) and momentum 0.999 as 1.0 in BFLOAT16 (20% off after 200 steps), and both passed check.
    stored = float(np.array(momentum, np.float32).astype(np_dtype(dtype))), float(np.array(lr, np.float32).astype(np_dtype(dtype)))
    assert stored[0] == 1.0 or stored[1] == 0.0  # the premise, computed by numpy/ml_dtypes
    result = sgdfuse.optimize(_low_precision_state_float_math(dtype, lr=lr, momentum=momentum), allow_rounding=True)
    assert not result.report.fused
    [refusal] = result.report.refused
    assert refusal.reason == "hyperparameter-precision", refusal
    assert becomes in refusal.detail, refusal.detail


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_low_precision_state_with_float_constants_is_refused_as_hyperparameter_precision(dtype):
    # The graph computes in FLOAT with FLOAT lr 0.01 and momentum 0.9; the op would take both in the
    # parameters' dtype (FLOAT16 0.0099983215, BFLOAT16 0.010009765625), a change far beyond FLOAT rounding.
    result = sgdfuse.optimize(_low_precision_state_float_math(dtype))
    assert not result.report.fused
    [refusal] = result.report.refused
    assert refusal.reason == "hyperparameter-precision", refusal
    want = float(np.array(LR, dtype=np.float32).astype(np_dtype(dtype)))
    assert f"{want:.9g}"[:6] in refusal.detail, refusal.detail


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_low_precision_update_computed_in_float_between_casts_fuses_when_rounding_is_allowed(dtype):
    # One rounding at the end on both sides; FLOAT order differences may flip a half-way rounding: 1 ulp,
    # and lr/momentum in the parameters' dtype change the step by their relative rounding.
    result = _fuses_as(
        _low_precision_state_float_math(dtype), dampening=D, rtol=2e-3 if dtype == TensorProto.FLOAT16 else 1.6e-2, allow_rounding=True,
        lr=float(np.array(LR, dtype=np.float32).astype(np_dtype(dtype))), momentum=float(np.array(M, dtype=np.float32).astype(np_dtype(dtype))),
    )
    assert set(result.report.fused[0].rounded) == {"learning_rate", "momentum"}
    assert result.report.fused[0].rounded["learning_rate"] == pytest.approx(LR)


def test_float_buffer_with_float16_parameters_is_refused_as_mixed_precision():
    b = Builder(dtype=TensorProto.FLOAT16)
    p, g = b.tensor_input("p"), b.tensor_input("g")
    buf = b.tensor_input("buf", dtype=TensorProto.FLOAT)
    g32 = b.op("Cast", g, to=TensorProto.FLOAT)
    v = b.add(b.mul(buf, b.scalar(M, dtype=TensorProto.FLOAT)), g32, out="buf_new")
    b.op("Cast", b.sub(b.op("Cast", p, to=TensorProto.FLOAT), b.mul(b.scalar(LR, dtype=TensorProto.FLOAT), v)), out="p_new", to=TensorProto.FLOAT16)
    result = sgdfuse.optimize(b.model(["p_new", "buf_new"], {"buf_new": TensorProto.FLOAT}))
    assert not result.report.fused
    assert result.report.refused[0].reason == "mixed-precision"
    assert "buf" in result.report.refused[0].detail


def test_rounding_to_float16_midway_is_refused():
    b = Builder(dtype=TensorProto.FLOAT16)
    p, g, buf = _state(b)
    f = TensorProto.FLOAT
    v32 = b.add(b.mul(b.op("Cast", buf, to=f), b.scalar(M, dtype=f)), b.op("Cast", g, to=f))
    v16 = b.op("Cast", v32, out="buf_new", to=TensorProto.FLOAT16)
    step16 = b.mul(v16, b.scalar(LR))  # computed in FLOAT16 from the rounded buffer
    b.op("Cast", b.sub(b.op("Cast", p, to=f), b.op("Cast", step16, to=f)), out="p_new", to=TensorProto.FLOAT16)
    result = sgdfuse.optimize(b.model(["p_new", "buf_new"]))
    assert not result.report.fused
    assert result.report.refused[0].reason == "mixed-precision"


def _first_step_model(first_branch: str, when_true: bool = True, dampening: float = D):
    b = Builder()
    p, g, buf = _state(b)
    step = b.scalar_input("step", dtype=TensorProto.INT64)
    is_first = b.op("Equal", step, b._int64(0))
    later = b.add(b.mul(buf, b.scalar(M)), b.mul(g, b.scalar(1 - dampening)))
    first = g if first_branch == "grad" else b.add(b.mul(buf, b.scalar(M)), g)
    if when_true:
        b.op("Where", is_first, first, later, out="buf_new")
    else:
        b.op("Where", b.op("Not", is_first), later, first, out="buf_new")
    b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
    return b.model(["p_new", "buf_new"])


@pytest.mark.parametrize("when_true", [True, False])
def test_pytorch_first_step_where_fuses_exactly_even_with_nonzero_buffer(when_true):
    # The feeds give buf random non-zero values on the first step (step = 0): the fused model must still
    # reproduce buf' = grad there, which it does by feeding the contract a zeroed buffer on that step.
    result = _fuses_as(_first_step_model("grad", when_true), dampening=D)
    assert result.report.fused[0].source == "pattern with first-step Where"
    assert "step" in [i.name for i in result.model.graph.input]


def test_onnx_style_first_step_keeping_the_buffer_fuses():
    _fuses_as(_first_step_model("momentum_plus_grad"), dampening=D)


def test_first_step_with_other_rule_is_refused():
    b = Builder()
    p, g, buf = _state(b)
    step = b.scalar_input("step", dtype=TensorProto.INT64)
    is_first = b.op("Equal", step, b._int64(0))
    later = b.add(b.mul(buf, b.scalar(M)), g)
    # First step m'*buf + g with m' = 0.5: the contract's stat = 1 step is either g (buffer fed as 0) or
    # m*buf + g with the later steps' momentum 0.9; neither.
    b.op("Where", is_first, b.add(b.mul(buf, b.scalar(0.5)), g), later, out="buf_new")
    b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
    result = sgdfuse.optimize(b.model(["p_new", "buf_new"]))
    assert not result.report.fused
    assert result.report.refused[0].reason == "first-step-unsupported"
    assert "step" in result.report.refused[0].detail or "equal" in result.report.refused[0].detail.lower()


def _if_first_step_model(first_branch: str):
    from onnx import helper

    b = Builder()
    p, g, buf = _state(b)
    step = b.scalar_input("step", dtype=TensorProto.INT64)
    is_first = b.op("Equal", step, b._int64(0))
    m, omd = b.scalar(M), b.scalar(1 - D)
    shape = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [3, 2]) for name in ("buf_first", "buf_later")]
    if first_branch == "grad":
        then_nodes = [helper.make_node("Identity", [g], ["buf_first"])]
    else:
        then_nodes = [helper.make_node("Mul", [buf, m], ["then_mb"]), helper.make_node("Add", ["then_mb", g], ["buf_first"])]
    else_nodes = [
        helper.make_node("Mul", [buf, m], ["else_mb"]),
        helper.make_node("Mul", [g, omd], ["else_g"]),
        helper.make_node("Add", ["else_mb", "else_g"], ["buf_later"]),
    ]
    b.nodes.append(
        helper.make_node(
            "If", [is_first], ["buf_new"],
            then_branch=helper.make_graph(then_nodes, "first", [], [shape[0]]),
            else_branch=helper.make_graph(else_nodes, "later", [], [shape[1]]),
        )
    )
    b.sub(p, b.mul(b.scalar(LR), "buf_new"), out="p_new")
    return b.model(["p_new", "buf_new"])


@pytest.mark.parametrize("first_branch", ["grad", "momentum_plus_grad"])
def test_first_step_as_an_if_on_the_step_counter_fuses(first_branch):
    result = _fuses_as(_if_first_step_model(first_branch), dampening=D)
    assert "If" not in [n.op_type for n in result.model.graph.node]
