"""bughunt10: public bug reports of momentum-SGD steps, rebuilt as small dynamo-style ONNX graphs.

Each graph is written with the dynamo exporter's default names (``p0, g0, b0`` inputs, ``mul``, ``add_1``,
``where`` values, ``val_N`` constants; ``tests/hunt_graphs.Exported``). The expected numbers come from
``torch.optim.SGD``'s documented formula in float64 numpy (:func:`_torch_sgd`), never from sgdfuse.

Reports:

- ml-explore/mlx#473 (first-step dampening): the fix discussed there starts the buffer at ``(d/m)*g`` when
  there is none, so that ``m*v + (1-d)*g = g`` on the first step. sgdfuse reads that step as buffer ``g0``
  (momentum 1-d, gradient the ``Where``), whose gradient reads the tensor it takes as the buffer: refused
  (``gradient-reads-buffer``), so the gradient stays a runtime input of the GE graph.
- an unrolled inner loop (two optimizer steps in one graph, as entrenar#314's tied weight stepped twice):
  ``add_2 = 0.9*add + g1`` read as an update of *parameters* ``g1`` with learning rate -0.9 claims the buffer
  ``b0`` that ``add_1`` updates, and an ascending claim beside another refuses every claim (``shared-state``):
  nothing fuses, and the second gradient stays a runtime input.
- entrenar#314 (a tied weight stepped by two updates in sequence): both updates are refused
  ``state-stepped-twice``, naming the first update's new weights that the second steps again.
- pytorch/pytorch#152833 (dampening skipped on the first step, here as an ``If`` on a rank-0 flag, with
  momentum 1e-4 and weight decay 1e-6), NVIDIA/apex#507 (FP32 master weights, FP16 gradients unscaled by a
  runtime ``inv_scale``, an FP16 copy of the weights as output) and a Nesterov + maximize step whose learning
  rate and momentum share one rank-0 constant through ``Identity``/``CastLike``: fused, and the numbers are
  torch's (regression guards).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hunt_graphs import Exported  # noqa: E402

import sgdfuse  # noqa: E402

F32 = TensorProto.FLOAT
S = (4, 3)


def _torch_sgd(p, g, buf, *, lr, m, d=0.0, wd=0.0, nesterov=False, maximize=False, first=False):
    """One ``torch.optim.SGD`` step in float64 (its documented algorithm): returns (new p, new buf)."""
    p, g = np.float64(p), np.float64(g)
    g = -g if maximize else g
    g = g + wd * p if wd else g
    buf = g.copy() if first else m * np.float64(buf) + (1 - d) * g
    return p - lr * (g + m * buf if nesterov else buf), buf


def _run(model: onnx.ModelProto, feeds: dict) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _rand(rng):
    return rng.standard_normal(S).astype(np.float32)


def _mlx_first_step_init(m=0.9, d=0.25, lr=0.1) -> onnx.ModelProto:
    """mlx#473: ``v = where(is_first, (d/m)*g, buf); v = m*v + (1-d)*g; p = p - lr*v`` (first step: v = g)."""
    b = Exported()
    p, g, buf = b.input("p0", F32, S), b.input("g0", F32, S), b.input("b0", F32, S)
    first = b.input("is_first", TensorProto.BOOL)
    v0 = b.op("Where", [first, b.op("Mul", [g, b.const(d / m)], "mul"), buf], "where")
    new_buf = b.op("Add", [b.op("Mul", [v0, b.const(m)], "mul"), b.op("Mul", [g, b.const(1 - d)], "mul")], "add")
    new_p = b.op("Add", [p, b.op("Mul", [new_buf, b.const(-lr)], "mul")], "add")
    return b.model([(new_p, S), (new_buf, S)])


def _unrolled_two_steps(m=0.9, lr=0.1) -> onnx.ModelProto:
    """Two SGD steps in one graph: ``add = m*b0 + g0; add_1 = p0 - lr*add; add_2 = m*add + g1;
    add_3 = add_1 - lr*add_2``; every step's values are outputs (the state is p0 -> add_3, b0 -> add_2)."""
    b = Exported()
    p, g0, g1, buf = b.input("p0", F32, S), b.input("g0", F32, S), b.input("g1", F32, S), b.input("b0", F32, S)
    nb1 = b.op("Add", [b.op("Mul", [buf, b.const(m)], "mul"), g0], "add")
    p1 = b.op("Add", [p, b.op("Mul", [nb1, b.const(-lr)], "mul")], "add")
    nb2 = b.op("Add", [b.op("Mul", [nb1, b.const(m)], "mul"), g1], "add")
    p2 = b.op("Add", [p1, b.op("Mul", [nb2, b.const(-lr)], "mul")], "add")
    return b.model([(p2, S), (nb2, S), (p1, S), (nb1, S)])


def _tied_stepped_twice(m=0.9, lr=0.1) -> onnx.ModelProto:
    """entrenar#314: one weight, two updates with two buffers: ``add_1 = p0 - lr*(m*b0 + g0)``, then
    ``add_3 = add_1 - lr*add_2`` with ``add_2 = m*b1 + g1``; outputs add_3, add, add_2, add_1."""
    b = Exported()
    p, g0, g1 = b.input("p0", F32, S), b.input("g0", F32, S), b.input("g1", F32, S)
    b0, b1 = b.input("b0", F32, S), b.input("b1", F32, S)
    nb0 = b.op("Add", [b.op("Mul", [b0, b.const(m)], "mul"), g0], "add")
    p1 = b.op("Add", [p, b.op("Mul", [nb0, b.const(-lr)], "mul")], "add")
    nb1 = b.op("Add", [b.op("Mul", [b1, b.const(m)], "mul"), g1], "add")
    p2 = b.op("Add", [p1, b.op("Mul", [nb1, b.const(-lr)], "mul")], "add")
    return b.model([(p2, S), (nb0, S), (nb1, S), (p1, S)])


def _if_first_step(m=1e-4, d=0.1, wd=1e-6, lr=0.1) -> onnx.ModelProto:
    """pytorch#152833: ``buf = g_wd if is_first else m*buf + (1-d)*g_wd`` as an ``If`` on a rank-0 BOOL."""
    b = Exported()
    p, g, buf = b.input("p0", F32, S), b.input("g0", F32, S), b.input("b0", F32, S)
    first = b.input("is_first", TensorProto.BOOL)
    g_wd = b.op("Add", [g, b.op("Mul", [p, b.const(wd)], "mul")], "add")
    then_branch = helper.make_graph([helper.make_node("Identity", [g_wd], ["then_out"])], "then", [], [helper.make_tensor_value_info("then_out", F32, list(S))])
    else_branch = helper.make_graph(
        [helper.make_node("Mul", [buf, "c_m"], ["e_mul"]), helper.make_node("Mul", [g_wd, "c_d"], ["e_mul_1"]), helper.make_node("Add", ["e_mul", "e_mul_1"], ["else_out"])],
        "else", [], [helper.make_tensor_value_info("else_out", F32, list(S))],
        [numpy_helper.from_array(np.array(m, np.float32), "c_m"), numpy_helper.from_array(np.array(1 - d, np.float32), "c_d")],
    )
    new_buf = b.name("cond")
    b.nodes.append(helper.make_node("If", [first], [new_buf], name="node_cond", then_branch=then_branch, else_branch=else_branch))
    new_p = b.op("Add", [p, b.op("Mul", [new_buf, b.const(-lr)], "mul")], "add")
    return b.model([(new_p, S), (new_buf, S)])


def _master_weights(wd=1e-6, m=0.9, lr=0.1) -> onnx.ModelProto:
    """apex#507: FP32 master p0, FP16 gradient cast up and unscaled (runtime ``inv_scale``), FP16 copy out."""
    b = Exported()
    p, g16, buf = b.input("p0", F32, S), b.input("g0", TensorProto.FLOAT16, S), b.input("b0", F32, S)
    inv = b.input("inv_scale", F32)
    g = b.op("Mul", [b.op("Cast", [g16], "_to_copy", to=F32), inv], "mul")
    g_wd = b.op("Add", [g, b.op("Mul", [p, b.const(wd)], "mul")], "add")
    new_buf = b.op("Add", [b.op("Mul", [buf, b.const(m)], "mul"), g_wd], "add")
    new_p = b.op("Add", [p, b.op("Mul", [new_buf, b.const(-lr)], "mul")], "add")
    p16 = b.op("Cast", [new_p], "_to_copy", to=TensorProto.FLOAT16)
    outputs = [helper.make_tensor_value_info(new_p, F32, S), helper.make_tensor_value_info(new_buf, F32, S), helper.make_tensor_value_info(p16, TensorProto.FLOAT16, S)]
    graph = helper.make_graph(b.nodes, "main_graph", b.inputs, outputs, b.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10, producer_name="pytorch")


def _nesterov_maximize_shared(wd=1e-6) -> onnx.ModelProto:
    """``maximize=True, nesterov=True``, lr = momentum = 0.5 from one rank-0 constant read through
    ``Identity`` (momentum) and ``CastLike`` (learning rate)."""
    b = Exported()
    p, g, buf = b.input("p0", F32, S), b.input("g0", F32, S), b.input("b0", F32, S)
    half = b.const(0.5)
    m, lr = b.op("Identity", [half], "val"), b.op("CastLike", [half, p], "val")
    g_eff = b.op("Add", [b.op("Neg", [g], "neg"), b.op("Mul", [p, b.const(wd)], "mul")], "add")
    new_buf = b.op("Add", [b.op("Mul", [buf, m], "mul"), g_eff], "add")
    step = b.op("Add", [g_eff, b.op("Mul", [new_buf, m], "mul")], "add")
    new_p = b.op("Sub", [p, b.op("Mul", [step, lr], "mul")], "sub")
    return b.model([(new_p, S), (new_buf, S)])


# --- wrong roles: a gradient input written in place --------------------------------------------------------


def test_mlx_first_step_init_fuses_with_the_torch_numbers():
    """Whatever sgdfuse makes of mlx#473's step, the written model computes torch's first and later steps."""
    rng = np.random.default_rng(473)
    fused = sgdfuse.optimize(_mlx_first_step_init()).model
    for first in (True, False):
        p, g, buf = _rand(rng), _rand(rng), _rand(rng)
        out = _run(fused, {"p0": p, "g0": g, "b0": buf, "is_first": np.array(first)})
        want_p, want_buf = _torch_sgd(p, g, buf, lr=0.1, m=0.9, d=0.25, first=first)
        np.testing.assert_allclose(out["add_1"], want_p, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["add"], want_buf, rtol=1e-5, atol=1e-6)


def test_mlx_first_step_init_does_not_take_the_gradient_as_the_buffer():
    model = _mlx_first_step_init()
    report = sgdfuse.optimize(model).report
    assert all(f.accum == "b0" for f in report.fused), [(f.parameters, f.accum, f.gradient, f.roles_from) for f in report.fused]
    ge = sgdfuse.lower(model, soc="Ascend910B2")
    assert "g0" in set(ge.input_names.values()), f"the gradient g0 is not a runtime input of the GE graph: {sorted(ge.input_names.values())}"


def test_unrolled_steps_keep_the_second_gradient_a_runtime_input():
    model = _unrolled_two_steps()
    report = sgdfuse.optimize(model).report
    assert not {f.parameters for f in report.fused} & {"g0", "g1"}, [(f.parameters, f.accum, f.learning_rate) for f in report.fused]
    ge = sgdfuse.lower(model, soc="Ascend910B2")
    assert {"g0", "g1"} <= set(ge.input_names.values()), sorted(ge.input_names.values())


def test_unrolled_steps_numbers_are_two_torch_steps():
    rng = np.random.default_rng(2)
    p, g0, g1, buf = (_rand(rng) for _ in range(4))
    out = _run(sgdfuse.optimize(_unrolled_two_steps()).model, {"p0": p, "g0": g0, "g1": g1, "b0": buf})
    p1, b1 = _torch_sgd(p, g0, buf, lr=0.1, m=0.9)
    p2, b2 = _torch_sgd(p1, g1, b1, lr=0.1, m=0.9)
    for name, want in (("add_3", p2), ("add_2", b2), ("add_1", p1), ("add", b1)):
        np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_tied_weight_second_update_refusal_names_its_computed_parameters():
    report = sgdfuse.optimize(_tied_stepped_twice()).report
    refusal = next(r for r in report.refused if r.candidate == "add_3")
    assert refusal.reason != "no-momentum-buffer" and "add_1" in refusal.detail, (refusal.reason, refusal.detail)


# --- fused and right: regression guards ---------------------------------------------------------------------


@pytest.mark.parametrize("first", [True, False])
def test_if_first_step_with_small_terms_is_torch_sgd(first):
    rng = np.random.default_rng(152833)
    result = sgdfuse.optimize(_if_first_step())
    assert [f.parameters for f in result.report.fused] == ["p0"]
    p, g, buf = _rand(rng), _rand(rng), _rand(rng)
    out = _run(result.model, {"p0": p, "g0": g, "b0": buf, "is_first": np.array(first)})
    want_p, want_buf = _torch_sgd(p, g, buf, lr=0.1, m=1e-4, d=0.1, wd=1e-6, first=first)
    np.testing.assert_allclose(out["add_1"], want_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["cond"], want_buf, rtol=1e-6, atol=1e-7)


def test_master_weights_with_fp16_gradient_are_torch_sgd():
    rng = np.random.default_rng(507)
    result = sgdfuse.optimize(_master_weights())
    assert [(f.parameters, f.accum) for f in result.report.fused] == [("p0", "b0")]
    p, buf, g16 = _rand(rng), _rand(rng), _rand(rng).astype(np.float16)
    inv = np.array(1 / 1024, np.float32)
    out = _run(result.model, {"p0": p, "g0": g16, "b0": buf, "inv_scale": inv})
    want_p, want_buf = _torch_sgd(p, np.float64(g16) * np.float64(inv), buf, lr=0.1, m=0.9, wd=1e-6)
    np.testing.assert_allclose(out["add_2"], want_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out["add_1"], want_buf, rtol=1e-6, atol=1e-7)


def test_nesterov_maximize_with_one_shared_constant_is_torch_sgd():
    rng = np.random.default_rng(8)
    result = sgdfuse.optimize(_nesterov_maximize_shared())
    [fused] = result.report.fused
    assert (fused.nesterov, fused.maximize, fused.learning_rate, fused.momentum) == (True, True, 0.5, 0.5)
    p, g, buf = _rand(rng), _rand(rng), _rand(rng)
    out = _run(result.model, {"p0": p, "g0": g, "b0": buf})
    want_p, want_buf = _torch_sgd(p, g, buf, lr=0.5, m=0.5, wd=1e-6, nesterov=True, maximize=True)
    np.testing.assert_allclose(out["sub"], want_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["add_1"], want_buf, rtol=1e-6, atol=1e-6)
