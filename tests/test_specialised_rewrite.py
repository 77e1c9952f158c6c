"""The rewrite gives each fused node the specialised body (function overload) of what it proved, and no more.

- the overload spells the match's dtype, attributes, a non-zero constant momentum (``mconst``) or a runtime
  one (``mruntime``), and ``stat0`` when the graph has no first-step rule (``statany`` with one);
- ``stat`` zeros of a static shape come from ``ConstantOfShape`` of a shape initializer (no ``Shape`` node);
  a dynamic shape keeps ``Shape(parameters)``;
- onnxruntime running the fused model gives what :func:`sgdfuse.reference.sgd` gives for the node's inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import sgdfuse
from sgdfuse.fused_op import Specialisation, is_sgd_node, read_sgd_attributes
from sgdfuse.reference import sgd
from sgdfuse.runtime import make_session, run
from tests.forms import Builder, np_dtype

F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
LR, M, D, WD = 0.01, 0.9, 0.25, 0.5


def _update(dtype=F, *, dampening=0.0, weight_decay=0.0, nesterov=False, runtime_momentum=False, first_step=False,
            lr_shape=None, shape=(3, 2)) -> onnx.ModelProto:
    """``grad = g + wd*p``; ``buf_out = m*buf + (1-d)*grad`` (``grad`` on the first step);
    ``p_out = p - lr*(grad + m*buf_out if nesterov else buf_out)``, in ``dtype``."""
    b = Builder(dtype=dtype, shape=list(shape))
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    m = b.scalar_input("m") if runtime_momentum else b.scalar(M)
    lr = b.scalar_input("lr", shape=lr_shape) if lr_shape is not None else b.scalar(LR)
    grad = b.add(g, b.mul(p, b.scalar(WD))) if weight_decay else g
    later = b.add(b.mul(buf, m), b.mul(grad, b.scalar(1 - dampening)) if dampening else grad)
    buffer = later
    if first_step:
        buffer = b.op("Where", b.op("Equal", b.scalar_input("step", dtype=TensorProto.INT64), b._int64(0)), grad, later)
    b.identity(buffer, out="buf_out")
    step = b.add(grad, b.mul(m, buffer)) if nesterov else buffer
    b.sub(p, b.mul(lr, step), out="p_out")
    return b.model(["p_out", "buf_out"])


def _fused(model: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.NodeProto]:
    result = sgdfuse.optimize(model, verify=False)
    assert len(result.report.fused) == 1 and not result.report.refused, result.report
    [node] = [n for n in result.model.graph.node if is_sgd_node(n)]
    return result.model, node


@pytest.mark.parametrize(
    ("kwargs", "overload"),
    [
        (dict(), "f32_plain_nodamp_nowd_mconst_stat0"),
        (dict(dampening=D, weight_decay=WD), "f32_plain_damp_wd_mconst_stat0"),
        (dict(nesterov=True, weight_decay=WD), "f32_nesterov_nodamp_wd_mconst_stat0"),
        (dict(runtime_momentum=True), "f32_plain_nodamp_nowd_mruntime_stat0"),
        (dict(dampening=D, first_step=True), "f32_plain_damp_nowd_mconst_statany"),
        (dict(dtype=F16, dampening=D), "f16_plain_damp_nowd_mconst_stat0"),
        (dict(lr_shape=[1]), "f32_plain_nodamp_nowd_mconst_stat0"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_fused_node_calls_the_overload_of_what_the_rewrite_proved(kwargs, overload):
    model, node = _fused(_update(**kwargs))
    assert node.overload == overload
    Specialisation.from_overload(overload).check(read_sgd_attributes(node), subject=node.name)
    assert [(f.name, f.overload) for f in model.functions] == [("SGD", overload)]
    assert model.ir_version >= 10
    onnx.checker.check_model(model, full_check=True)


def test_zero_stat_of_a_static_shape_is_built_from_a_shape_initializer_not_a_shape_node():
    model, node = _fused(_update(dampening=D))
    producer = next(n for n in model.graph.node if node.input[5] in n.output)
    assert producer.op_type == "ConstantOfShape"
    shape = next(t for t in model.graph.initializer if t.name == producer.input[0])
    assert numpy_helper.to_array(shape).tolist() == [3, 2]
    assert "Shape" not in {n.op_type for n in model.graph.node}


def test_zero_stat_of_a_dynamic_shape_is_built_from_the_parameters_shape():
    model, node = _fused(_update(dampening=D, shape=("N", 2)))
    producer = next(n for n in model.graph.node if node.input[5] in n.output)
    assert producer.op_type == "ConstantOfShape"
    assert next(n for n in model.graph.node if producer.input[0] in n.output).op_type == "Shape"


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(dampening=D, weight_decay=WD), dict(nesterov=True, weight_decay=WD), dict(dtype=F16, dampening=D, weight_decay=WD)],
    ids=["plain", "damp-wd", "nesterov-wd", "f16-damp-wd"],
)
def test_onnxruntime_runs_the_fused_step_to_the_reference_values(kwargs):
    model, node = _fused(_update(**kwargs))
    dtype = np_dtype(kwargs.get("dtype", F))
    rng = np.random.default_rng(3)
    feeds = {name: rng.standard_normal((3, 2)).astype(np.float32).astype(dtype) for name in ("p", "g", "buf")}
    got = run(make_session(model), feeds, ["p_out", "buf_out"])
    attributes = read_sgd_attributes(node)
    one = lambda v: np.array([v], dtype=np.float32).astype(dtype)  # noqa: E731 (the op takes lr, m in the dtype)
    want = sgd(feeds["p"], feeds["g"], one(LR), feeds["buf"], one(M), np.zeros((3, 2), dtype),
               dampening=attributes.dampening, weight_decay=attributes.weight_decay, nesterov=attributes.nesterov)
    np.testing.assert_array_equal(got["p_out"].view(np.uint8), want[0].view(np.uint8))
    np.testing.assert_array_equal(got["buf_out"].view(np.uint8), want[1].view(np.uint8))
