"""A small builder for synthetic update graphs, used by the formulation corpora and the generator.

Each builder call appends ONNX nodes; scalars can be written in every style exporters use (initializer,
Constant node, graph input, shape [] or [1], Expand/Reshape/Unsqueeze/Gather of a scalar, Cast/CastLike).
The expected hyper-parameters of a form are given by the test that builds it, never read off our matcher.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sgdfuse.runtime import make_session, run

SHAPE = [3, 2]
SCALAR_STYLES = ("initializer", "initializer1", "constant", "expand", "reshape", "unsqueeze", "gather", "cast", "castlike")


def np_dtype(dtype: int):
    return {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}[dtype]


class Builder:
    """Appends nodes to one graph; every method returns the name of the value it made."""

    def __init__(self, dtype: int = TensorProto.FLOAT, shape=None, opset: int = 18) -> None:
        self.dtype = dtype
        self.shape = list(shape or SHAPE)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self._count = itertools.count()

    def _name(self, base: str) -> str:
        return f"{base}_{next(self._count)}"

    # -- inputs and scalars ---------------------------------------------------------------------------
    def tensor_input(self, name: str, dtype: int | None = None, shape=None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype or self.dtype, list(shape or self.shape)))
        return name

    def scalar_input(self, name: str, dtype: int | None = None, shape=()) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype or self.dtype, list(shape)))
        return name

    def scalar(self, value: float, style: str = "initializer", dtype: int | None = None) -> str:
        """A value every element of which is ``value``, written in ``style``."""
        dtype = dtype or self.dtype
        array = np.array(value, dtype=np.float32).astype(np_dtype(dtype))
        name = self._name("s")
        if style == "initializer":
            self.initializers.append(numpy_helper.from_array(array, name))
        elif style == "initializer1":
            self.initializers.append(numpy_helper.from_array(array.reshape(1), name))
        elif style == "constant":
            self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, "value")))
        elif style == "expand":
            base = self.scalar(value, "initializer", dtype)
            shape = self._int64(self.shape)
            self.nodes.append(helper.make_node("Expand", [base, shape], [name]))
        elif style == "reshape":
            base = self.scalar(value, "initializer1", dtype)
            self.nodes.append(helper.make_node("Reshape", [base, self._int64([])], [name]))
        elif style == "unsqueeze":
            base = self.scalar(value, "initializer", dtype)
            self.nodes.append(helper.make_node("Unsqueeze", [base, self._int64([0])], [name]))
        elif style == "gather":
            vector = self._name("v")
            self.initializers.append(numpy_helper.from_array(np.full((4,), value, dtype=np.float32).astype(np_dtype(dtype)), vector))
            self.nodes.append(helper.make_node("Gather", [vector, self._int64(0)], [name], axis=0))
        elif style == "cast":
            base = self.scalar(value, "initializer", TensorProto.FLOAT)
            self.nodes.append(helper.make_node("Cast", [base], [name], to=dtype))
        elif style == "castlike":
            base = self.scalar(value, "constant", TensorProto.FLOAT)
            like = self.scalar(0.0, "initializer", dtype)
            self.nodes.append(helper.make_node("CastLike", [base, like], [name]))
        else:
            raise ValueError(style)
        return name

    def _int64(self, values) -> str:
        name = self._name("i")
        self.initializers.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
        return name

    # -- ops ---------------------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, out: str | None = None, **attributes) -> str:
        name = out or self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], **attributes))
        return name

    def add(self, a, b, out=None):
        return self.op("Add", a, b, out=out)

    def sub(self, a, b, out=None):
        return self.op("Sub", a, b, out=out)

    def mul(self, a, b, out=None):
        return self.op("Mul", a, b, out=out)

    def div(self, a, b, out=None):
        return self.op("Div", a, b, out=out)

    def neg(self, a, out=None):
        return self.op("Neg", a, out=out)

    def identity(self, a, out=None):
        return self.op("Identity", a, out=out)

    # -- model ---------------------------------------------------------------------------------------------
    def model(self, outputs: list[str], output_dtypes: dict[str, int] | None = None) -> onnx.ModelProto:
        output_dtypes = output_dtypes or {}
        graph = helper.make_graph(
            self.nodes,
            "update",
            self.inputs,
            [helper.make_tensor_value_info(o, output_dtypes.get(o, self.dtype), self.shape) for o in outputs],
            initializer=self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 9
        onnx.checker.check_model(model)
        return model


def outputs_agree(original: onnx.ModelProto, fused: onnx.ModelProto, rtol: float, steps: int = 3, lr: float = 0.01, momentum: float = 0.9) -> None:
    """Run both in onnxruntime on seeded inputs, feeding the original's new state back for 3 steps."""
    rng = np.random.default_rng(1)
    names = [i.name for i in original.graph.input]
    types = {i.name: i.type.tensor_type for i in original.graph.input}
    feeds = {}
    for name in names:
        t = types[name]
        shape = [d.dim_value for d in t.shape.dim]
        dtype = np_dtype(t.elem_type) if t.elem_type != TensorProto.INT64 else np.int64
        if t.elem_type == TensorProto.INT64:
            feeds[name] = np.zeros(shape, dtype=np.int64)
        elif name in ("lr", "m"):
            feeds[name] = np.full(shape, lr if name == "lr" else momentum, dtype=np.float32).astype(dtype)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    a, b = make_session(original), make_session(fused)
    outputs = [o.name for o in original.graph.output]
    for step in range(steps):
        want, have = run(a, feeds, outputs), run(b, feeds, outputs)
        for name in outputs:
            np.testing.assert_allclose(
                np.asarray(have[name], np.float64), np.asarray(want[name], np.float64), rtol=rtol, atol=rtol, err_msg=f"{name} step {step}"
            )
        feeds["p"], feeds["buf"] = want["p_new"], want["buf_new"]
        feeds["g"] = rng.standard_normal(feeds["g"].shape).astype(np.float32).astype(feeds["g"].dtype)
        if "step" in feeds:
            feeds["step"] = np.full(feeds["step"].shape, step + 1, dtype=np.int64)
