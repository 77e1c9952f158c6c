"""hunt9: ``sgdfuse check`` against hand-edited fused models that are subtly wrong.

Each edit below makes the fused model compute another update than the original (confirmed with numpy, not
with the code under test), so check must fail. The weight-decay case was a gap: a small term's coefficient error hid under the
coefficient allowance of the larger terms of the same element, until check's isolating steps
(``sgdfuse.verify.ISOLATING_KINDS``: zero gradient and buffer, so ``wd·p`` stands alone) held it to its own;
tests/test_check_isolated_terms.py covers the kind (weight decay, momentum, dampening, learning rate).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.verify import check_models

F = TensorProto.FLOAT
SHAPE = [4, 3]


def _vi(name, shape=SHAPE):
    return helper.make_tensor_value_info(name, F, shape)


def _step(*, lr: float, m: float, wd: float = 0.0) -> onnx.ModelProto:
    """torch.optim.SGD after its first step in dynamo-style names: ``add_wd = g0 + wd*p0``,
    ``add = b0*m + add_wd``, ``add_1 = p0 + add*(-lr)``."""
    nodes, inits, g = [], [numpy_helper.from_array(np.array(m, np.float32), "val"),
                           numpy_helper.from_array(np.array(-lr, np.float32), "val_1")], "g0"
    if wd:
        nodes += [helper.make_node("Mul", ["p0", "val_2"], ["mul_2"]), helper.make_node("Add", ["g0", "mul_2"], ["add_2"])]
        inits.append(numpy_helper.from_array(np.array(wd, np.float32), "val_2"))
        g = "add_2"
    nodes += [helper.make_node("Mul", ["b0", "val"], ["mul"]), helper.make_node("Add", ["mul", g], ["add"]),
              helper.make_node("Mul", ["add", "val_1"], ["mul_1"]), helper.make_node("Add", ["p0", "mul_1"], ["add_1"])]
    graph = helper.make_graph(nodes, "main_graph", [_vi("p0"), _vi("g0"), _vi("b0")], [_vi("add_1"), _vi("add")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _fused(original):
    result = sgdfuse.optimize(original)
    assert [u.parameters for u in result.report.fused] == ["p0"]
    return result.model


def _sgd(model):
    return next(n for n in model.graph.node if n.op_type == "SGD")


def _with_attribute(model, name, value):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    node = _sgd(copy)
    attribute = next(a for a in node.attribute if a.name == name)
    attribute.f = value
    return copy


def _with_learning_rate(model, lr):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    name = _sgd(copy).input[2]
    tensor = next(t for t in copy.graph.initializer if t.name == name)
    tensor.CopyFrom(numpy_helper.from_array(np.full(numpy_helper.to_array(tensor).shape, lr, np.float32), name))
    return copy


def _numpy_step(p, g, b, *, lr, m, wd):
    """The update in float64 (torch.optim.SGD's formula, written out)."""
    buf = m * b + g + wd * p
    return p - lr * buf, buf


def test_a_tiny_learning_rate_doubled_fails():
    # lr 1e-12: p - lr*buf rounds to p in FLOAT, so only the lifted DOUBLE run can tell 2e-12 from 1e-12.
    original = _step(lr=1e-12, m=0.9)
    rng = np.random.default_rng(0)
    p, g, b = (rng.standard_normal(SHAPE) for _ in range(3))
    assert not np.array_equal(_numpy_step(p, g, b, lr=1e-12, m=0.9, wd=0)[0], _numpy_step(p, g, b, lr=2e-12, m=0.9, wd=0)[0])
    fused = _fused(original)
    assert check_models(original, fused).passed
    assert not check_models(original, _with_learning_rate(fused, 2e-12)).passed


def test_weight_decay_a_thousandth_off_fails():
    original = _step(lr=0.1, m=0.9, wd=5e-4)
    fused = _fused(original)
    assert check_models(original, fused).passed
    assert not check_models(original, _with_attribute(fused, "weight_decay", 5e-4 * 1.001)).passed


def test_a_small_weight_decay_one_percent_off_fails():
    wd = 1e-6
    original = _step(lr=0.1, m=0.9, wd=wd)
    rng = np.random.default_rng(0)
    p, g, b = (rng.standard_normal(SHAPE) for _ in range(3))
    want, _ = _numpy_step(p, g, b, lr=0.1, m=0.9, wd=wd)
    have, _ = _numpy_step(p, g, b, lr=0.1, m=0.9, wd=wd * 1.01)
    assert np.max(np.abs(want - have)) > 1e-12  # the premise: another update, visible in DOUBLE
    fused = _fused(original)
    assert check_models(original, fused).passed
    assert not check_models(original, _with_attribute(fused, "weight_decay", wd * 1.01)).passed
