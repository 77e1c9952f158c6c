"""Small synthetic ONNX training-step graphs for tests, built with ``onnx.helper``.

Every builder returns a checked ``ModelProto`` (default-domain opset 18, IR 8) whose update is written the
way the docstring's equation reads, so a test reads as the math it feeds the pass. Values are FLOAT tensors
of shape [2, 3] unless a test asks otherwise; scalars are rank-0 initializers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "bench_generator",
    "F32",
    "F16",
    "SHAPE",
    "OPSET",
    "value",
    "scalar",
    "make_model",
    "momentum_sgd",
    "random_feeds",
]

F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
SHAPE = [2, 3]
OPSET = 18


def value(name: str, dtype: int = F32, shape: Sequence[int] | None = SHAPE) -> onnx.ValueInfoProto:
    """A graph input/output declaration."""
    return helper.make_tensor_value_info(name, dtype, None if shape is None else list(shape))


def scalar(name: str, number: float, dtype: int = F32) -> onnx.TensorProto:
    """A rank-0 initializer holding ``number``."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    return numpy_helper.from_array(np.array(number, dtype=np_dtype), name=name)


def make_model(
    nodes: Iterable[onnx.NodeProto],
    inputs: Iterable[onnx.ValueInfoProto],
    outputs: Iterable[onnx.ValueInfoProto],
    initializers: Iterable[onnx.TensorProto] = (),
    *,
    name: str = "step",
) -> onnx.ModelProto:
    """A model of ``nodes`` at opset :data:`OPSET`, checked with ``onnx.checker`` (full check)."""
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def momentum_sgd(
    *,
    lr: float = 0.1,
    momentum: float = 0.9,
    parameters_as_initializer: bool = False,
    buffer_as_initializer: bool = False,
    extra_outputs: Sequence[onnx.ValueInfoProto] = (),
    extra_nodes: Sequence[onnx.NodeProto] = (),
) -> onnx.ModelProto:
    """The plain momentum-SGD step, PyTorch's (dampening 0, weight decay 0)::

        buf_out = momentum*buf + g
        p_out   = p - lr*buf_out

    ``parameters_as_initializer`` / ``buffer_as_initializer`` make ``p`` / ``buf`` constants of the model
    instead of graph inputs. ``extra_nodes`` and ``extra_outputs`` add readers of the update's values.
    """
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Mul", ["buf", "m"], ["buf_scaled"], name="mul_momentum"),
        helper.make_node("Add", ["buf_scaled", "g"], ["buf_out"], name="add_gradient"),
        helper.make_node("Mul", ["buf_out", "lr"], ["step"], name="mul_lr"),
        helper.make_node("Sub", ["p", "step"], ["p_out"], name="sub_step"),
        *extra_nodes,
    ]
    initializers = [scalar("m", momentum), scalar("lr", lr)]
    inputs = [value("g")]
    for name, constant in (("p", parameters_as_initializer), ("buf", buffer_as_initializer)):
        if constant:
            initializers.append(numpy_helper.from_array(rng.standard_normal(SHAPE).astype(np.float32), name=name))
        else:
            inputs.append(value(name))
    outputs = [value("p_out"), value("buf_out"), *extra_outputs]
    return make_model(nodes, inputs, outputs, initializers)


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded standard-normal feeds for every graph input that is not an initializer (scalars in
    [0.01, 0.1], like a learning rate), shapes from the declarations."""
    rng = np.random.default_rng(seed)
    initialized = {t.name for t in model.graph.initializer}
    feeds = {}
    for info in model.graph.input:
        if info.name in initialized:
            continue
        tensor_type = info.type.tensor_type
        shape = [d.dim_value for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if int(np.prod(shape)) == 1:
            feeds[info.name] = rng.uniform(0.01, 0.1, size=shape).astype(dtype)
        else:
            feeds[info.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def bench_generator():
    """``bench/generate.py`` loaded as a module (it is a script, not a package): its ``build(size, seed=0)``
    returns a synthetic training-update graph and its manifest."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_generate", Path(__file__).resolve().parent.parent / "bench" / "generate.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
