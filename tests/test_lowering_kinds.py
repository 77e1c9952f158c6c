"""Ops of one class are encoded once and instantiated per member (graph_builder.OpKind, GraphWriter): a
member gets its own values wherever its class lets them differ, and the shared tail only where nothing
differs.

The byte comparison against the lowering before op kinds (every testdata model and the benches) cannot show
a template reused across members that differ, when no such pair happens to be in those models. Here the
updates differ in exactly one thing each (a hyper-parameter, a shape, a dtype, an initial value), and each
GE op must carry its own: the attribute values the operator contract stores (docs/contract.md,
"Attributes": dampening and weight_decay as FLOAT, i.e. fp32, nesterov as bool), the update's own shape and
dtype in its descriptors, its own index among the graph's Data ops and its own initial value in the init
graph, and the numbers onnxruntime computes from the contract's function body.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.contract import SgdAttributes
from sgdfuse.fused_op import ensure_sgd_function, make_sgd_node
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.graph_builder import _Encoder, _len, _OP_ATTR, attr_value
from sgdfuse.runtime import onnx_to_numpy_dtype
from test_lowering_support import run_both

# One (attributes, dtype, shape) per update; neighbours differ in one thing only.
UPDATES = [
    (SgdAttributes(0.25, 1e-4, False), TensorProto.FLOAT, (4, 3)),
    (SgdAttributes(0.5, 1e-4, False), TensorProto.FLOAT, (4, 3)),  # dampening
    (SgdAttributes(0.5, 1e-3, False), TensorProto.FLOAT, (4, 3)),  # weight decay
    (SgdAttributes(0.0, 1e-3, False), TensorProto.FLOAT, (4, 3)),  # dampening 0
    (SgdAttributes(0.0, 1e-3, True), TensorProto.FLOAT, (4, 3)),  # nesterov
    (SgdAttributes(0.0, 1e-3, True), TensorProto.FLOAT, (3, 4)),  # shape
    (SgdAttributes(0.0, 1e-3, True), TensorProto.FLOAT16, (3, 4)),  # dtype
    (SgdAttributes(0.25, 1e-4, False), TensorProto.FLOAT, (4, 3)),  # the first again: one class with it
]


def _updates_model(updates=UPDATES, *, initializer_state: bool = False, seed: int = 0) -> onnx.ModelProto:
    """A fused model of one SGD node per entry of ``updates``, as ``sgdfuse optimize`` writes them (stat from
    ``ConstantOfShape`` zeros); parameters and buffers are graph inputs, or initializers of distinct random
    values with ``initializer_state``. Learning rate 0.1 and momentum 0.9 per dtype, shared."""
    rng = np.random.default_rng(seed)
    nodes, inputs, outputs, initializers = [], [], [], []
    shared: dict[int, tuple[str, str]] = {}
    for k, (attributes, dtype, shape) in enumerate(updates):
        np_dtype = onnx_to_numpy_dtype(dtype)
        if dtype not in shared:
            lr, momentum = f"lr_{dtype}", f"momentum_{dtype}"
            initializers += [numpy_helper.from_array(np.array(0.1, dtype=np_dtype), lr), numpy_helper.from_array(np.array(0.9, dtype=np_dtype), momentum)]
            shared[dtype] = (lr, momentum)
        lr, momentum = shared[dtype]
        w, g, buf = f"w{k}", f"grad_w{k}", f"buf_w{k}"
        if initializer_state:
            initializers += [numpy_helper.from_array(rng.standard_normal(shape).astype(np_dtype), name) for name in (w, buf)]
            inputs.append(helper.make_tensor_value_info(g, dtype, list(shape)))
        else:
            inputs += [helper.make_tensor_value_info(name, dtype, list(shape)) for name in (w, g, buf)]
        zero = numpy_helper.from_array(np.zeros((1,), dtype=np_dtype), "value")
        nodes += [
            helper.make_node("Shape", [w], [f"stat_shape{k}"], name=f"stat{k}/Shape"),
            helper.make_node("ConstantOfShape", [f"stat_shape{k}"], [f"stat{k}"], name=f"stat{k}/ConstantOfShape", value=zero),
            make_sgd_node((w, g, lr, buf, momentum, f"stat{k}"), (f"{w}_out", f"{buf}_out", f"stat{k}_out"), attributes, name=f"update{k}/SGD"),
        ]
        outputs += [helper.make_tensor_value_info(name, dtype, list(shape)) for name in (f"{w}_out", f"{buf}_out")]
    graph = helper.make_graph(nodes, "updates", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    ensure_sgd_function(model)
    return model


def _ops(model_def, op_type: str) -> list:
    return [op for op in model_def.graph[0].op if op.type == op_type]


def test_each_sgd_op_holds_its_own_update_s_attributes_as_the_contract_stores_them():
    lowered = sgdfuse.lower(_updates_model(), soc="Ascend910B2")
    ops = _ops(lowered.model, "SGD")
    assert len(ops) == len(UPDATES)
    for op, (attributes, _, _) in zip(ops, UPDATES):
        # The contract stores dampening and weight_decay as fp32 (AttrDef.f is a float) and nesterov as bool.
        assert op.attr["dampening"].f == np.float32(attributes.dampening), op.name
        assert op.attr["weight_decay"].f == np.float32(attributes.weight_decay), op.name
        assert op.attr["nesterov"].b is attributes.nesterov, op.name


def test_each_sgd_op_describes_its_own_update_s_shape_and_dtype():
    lowered = sgdfuse.lower(_updates_model(), soc="Ascend910B2")
    for op, (_, dtype, shape) in zip(_ops(lowered.model, "SGD"), UPDATES):
        for port, desc in zip(("parameters", "gradient", "accum", "stat"), (op.input_desc[i] for i in (0, 1, 3, 5))):
            assert list(desc.shape.dim) == list(shape), (op.name, port)
            assert desc.dtype == ge_ir.ge_dtype(dtype), (op.name, port)
        assert list(op.output_desc[0].shape.dim) == list(shape)
        for i in (2, 4):  # learning rate and momentum: one element of the parameters' dtype
            assert op.input_desc[i].dtype == ge_ir.ge_dtype(dtype)


def test_updates_that_differ_in_one_thing_each_compute_their_own_numbers():
    # onnxruntime runs each SGD node's function body, the contract's formula with that node's attributes; a
    # GE op that took another member's attributes or shape would differ from it.
    model = _updates_model()
    run_both(model, sgdfuse.lower(model, soc="Ascend910B2"), steps=3)


def test_each_data_op_holds_its_own_place_among_the_graph_s_inputs():
    # GE feeds a graph's Data ops by their "index": the k-th runtime input of the step graph has index k
    # (docs/lowering.md, "What is written"), although every gradient's Data op is of one class.
    model = _updates_model()
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    data = _ops(lowered.model, "Data")
    assert [op.name for op in data] == lowered.inputs
    assert [op.attr["index"].i for op in data] == list(range(len(data)))
    init_data = _ops(lowered.init_model, "Data")
    assert [op.attr["index"].i for op in init_data] == list(range(len(init_data)))


def test_each_initializer_state_is_assigned_its_own_initial_value():
    # State held in initializers gets a Const of its value in the init graph; the Consts of one shape and
    # dtype are one class whose value is each op's own (and is never cached by identity: the init graph keeps
    # no record of an op once it is written).
    updates = [(SgdAttributes(0.0, 0.0, False), TensorProto.FLOAT, (4, 3))] * 30 + [(SgdAttributes(0.0, 0.0, False), TensorProto.FLOAT16, (2, 5))] * 5
    model = _updates_model(updates, initializer_state=True)
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    consts = {op.name: op for op in _ops(lowered.init_model, "Const")}
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    checked = 0
    for variable in lowered.state:
        if variable.source != "initializer":
            continue
        value = consts[f"{variable.name}/initial_value"].attr["value"].t
        expected = initializers[variable.onnx_value]
        assert list(value.desc.shape.dim) == list(expected.shape)
        assert value.data == expected.astype(expected.dtype.newbyteorder("<")).tobytes(), variable.name
        checked += 1
    assert checked == 2 * len(updates)


def test_zero_initial_values_follow_each_variable_s_shape_and_dtype():
    lowered = sgdfuse.lower(_updates_model(), soc="Ascend910B2")
    consts = {op.name: op for op in _ops(lowered.init_model, "Const")}
    for variable in lowered.state:
        if variable.source != "zeros":
            continue
        value = consts[f"{variable.name}/zeros"].attr["value"].t
        expected = np.zeros(variable.spec.shape, dtype=onnx_to_numpy_dtype(variable.spec.dtype))
        assert list(value.desc.shape.dim) == list(expected.shape) and value.desc.dtype == ge_ir.ge_dtype(variable.spec.dtype)
        assert value.data == expected.tobytes()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**31, 2**63 - 1, -1, -(2**63)])
def test_an_own_int_attribute_is_written_as_protobuf_writes_the_attr_def(value):
    # The init graph's Data ops are written without an AttrDef for their index; the bytes must be the entry
    # protobuf writes for AttrDef(i=value).
    assert _Encoder()._own("index", value) == _len(_OP_ATTR, _Encoder().map_entry("index", attr_value(value)))
