"""What a lowering rule sees: the graph being built and one ONNX node at a time.

:class:`GraphLowering` holds the state of lowering one ONNX graph: the :class:`GraphBuilder`, the map from
ONNX value names to GE tensors, static shapes (:mod:`sgdfuse.passes.index`, with ONNX shape inference)
and small compile-time constant folding for the inputs rules need as attributes (axes, shapes, perms).
:class:`NodeLowering` is the per-node view handed to a rule.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
from onnx import helper

from sgdfuse.contract import TensorSpec
from sgdfuse.external_data import tensor_to_array
from sgdfuse.lowering.errors import LoweringError
from sgdfuse.lowering.graph_builder import GraphBuilder, OpRecord, Tensor, add_const
from sgdfuse.passes.index import GraphIndex
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = ["GraphLowering", "NodeLowering"]

logger = logging.getLogger(__name__)


_INTEGER_ARITHMETIC = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}
"""ONNX ops folded on integer constants (shape arithmetic an exporter writes around a ``Shape``)."""


class GraphLowering:
    """The state of lowering one ONNX graph into one GE graph.

    Attributes:
        index: the ONNX graph's index (producers, consumers, initializers, inferred specs).
        builder: the GE graph being built.
        values: ONNX value name → the GE tensor that holds it.
        opset: the model's default-domain opset version.
        after_write: names of GE ops that read a state variable on purpose *after* its in-place write
            (snapshots of ``accum``/``stat`` for their ``*_out`` readers, and of a guarded update's
            ``parameters_out``); the ordering pass leaves them alone.
        writers: state variable name → the GE ops writing it in place, in the order they run (a step
            ``Assign`` of a computed input, then the ``SGD`` op).
        sgd_ops: names of the GE ``SGD`` ops, in creation order.
        scoped_producers, scoped_initializers: nodes and initializers of subgraphs being inlined (``If``
            branches), which the main graph's index does not hold (their value types it does hold).
    """

    def __init__(self, index: GraphIndex, builder: GraphBuilder, opset: int) -> None:
        self.index = index
        self.builder = builder
        self.opset = opset
        self.values: dict[str, Tensor] = {}
        self.after_write: set[str] = set()
        self.after_write_of: dict[str, list[str]] = {}  # state variable name -> its after-write snapshots
        self.state = None  # the StatePlan, set by sgdfuse.lowering.state.add_variables
        self.variable_ops: dict[str, str] = {}
        self.writers: dict[str, list[str]] = {}
        self.sgd_ops: list[str] = []
        self.scoped_producers: dict[str, onnx.NodeProto] = {}
        self.scoped_initializers: dict[str, onnx.TensorProto] = {}
        self._folded: dict[str, np.ndarray | None] = {}

    def spec(self, name: str) -> TensorSpec:
        """Static shape and ONNX dtype of an ONNX value."""
        return self.index.spec(name)

    def producer(self, name: str) -> onnx.NodeProto | None:
        """The node producing ONNX value ``name`` (main graph or an inlined subgraph), or None."""
        return self.scoped_producers.get(name) or self.index.node(name)

    def tensor(self, name: str, *, reader: str) -> Tensor:
        """The GE tensor holding ONNX value ``name``; an initializer becomes a ``Const`` op on first use.

        Raises:
            LoweringError: ``name`` is produced by nothing lowered so far.
        """
        found = self.values.get(name)
        if found is not None:
            return found
        initializer = self.scoped_initializers.get(name) or self.index.initializers.get(name)
        if initializer is not None:
            tensor = self.const(tensor_to_array(initializer), name, onnx_dtype=initializer.data_type, spec_name=name)
            self.values[name] = tensor
            return tensor
        raise LoweringError(f"node {reader}", f"reads value {name!r}, which no graph input, initializer or earlier node provides")

    def const(self, array: np.ndarray, name: str, *, onnx_dtype: int | None = None, spec_name: str | None = None) -> Tensor:
        """Emit a ``Const`` op holding ``array``."""
        return add_const(self.builder, name, array, onnx_dtype=onnx_dtype, spec_name=spec_name)

    def constant_value(self, name: str) -> np.ndarray | None:
        """The compile-time value of ONNX value ``name``, or None when it is only known at run time.

        Known: initializers that are not graph inputs, ``Constant`` outputs, and ``Identity``, ``Cast``,
        ``Concat``, ``Unsqueeze``/``Squeeze`` (constant axes), integer ``Add``/``Sub``/``Mul`` of known values, and ``Shape`` of a tensor whose
        shape is static. This is what exporters use to build the shape, axes and perm operands that GE wants
        as constants.
        """
        if not name:
            return None
        if name not in self._folded:
            self._folded[name] = self._fold(name)
        return self._folded[name]

    def _fold(self, name: str) -> np.ndarray | None:
        initializer = self.scoped_initializers.get(name)
        if initializer is not None:
            return tensor_to_array(initializer)
        initializer = self.index.initializers.get(name)
        if initializer is not None:
            return None if self.index.is_input_name(name) else tensor_to_array(initializer)
        node = self.producer(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            return constant_node_value(node)
        if node.op_type == "Shape":
            spec = self.spec(node.input[0])
            if not spec.is_static:
                return None
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            dims = list(spec.shape)[attrs.get("start", 0) : attrs.get("end", None)]  # type: ignore[index]
            return np.array(dims, dtype=np.int64)
        inputs = [self.constant_value(i) if i else None for i in node.input]
        if any(v is None for v, i in zip(inputs, node.input) if i):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Identity":
            return inputs[0]
        if node.op_type == "Cast":
            return inputs[0].astype(onnx_to_numpy_dtype(attrs["to"]))
        if node.op_type in _INTEGER_ARITHMETIC and all(np.asarray(v).dtype.kind in "iu" for v in inputs if v is not None):
            # Shape arithmetic (Shape(x) + 0, Shape(x) * 2): integers only, so folding is exact.
            return np.asarray(_INTEGER_ARITHMETIC[node.op_type](*inputs)).astype(inputs[0].dtype)
        if node.op_type == "Concat":
            return np.concatenate([v for v in inputs if v is not None], axis=attrs["axis"])
        if node.op_type in ("Unsqueeze", "Squeeze"):
            axes = attrs.get("axes", inputs[1] if len(inputs) > 1 else None)
            value = inputs[0]
            if node.op_type == "Squeeze":
                return np.squeeze(value, axis=None if axes is None else tuple(int(a) for a in np.ravel(axes)))
            for axis in sorted(int(a) % (value.ndim + len(np.ravel(axes))) for a in np.ravel(axes)):
                value = np.expand_dims(value, axis)
            return value
        return None


class NodeLowering:
    """One ONNX node as a rule sees it.

    Attributes:
        node: the ONNX ``NodeProto``.
        name: the base name for the GE ops of this node (``name`` if given, else the ONNX node name, else
            ``OpType_position``).
        position: the node's index in the ONNX graph (for a node of an inlined ``If`` branch, the ``If``'s).
        graph: the :class:`GraphLowering` of the whole graph.
    """

    def __init__(self, graph: GraphLowering, node: onnx.NodeProto, position: int, *, name: str | None = None) -> None:
        self.graph = graph
        self.node = node
        self.position = position
        self.name = name or node.name or f"{node.op_type}_{position}"
        self._attrs: dict[str, onnx.AttributeProto] | None = None  # read on the first attr(): most rules read none

    @property
    def opset(self) -> int:
        """The model's default-domain opset version."""
        return self.graph.opset

    def has_input(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])

    def input(self, i: int) -> Tensor | None:
        """The GE tensor of ONNX input ``i``, None when absent (optional input omitted)."""
        if not self.has_input(i):
            return None
        return self.graph.tensor(self.node.input[i], reader=self.name)

    def inputs(self) -> list[Tensor]:
        """GE tensors of every present input, in order."""
        return [t for t in (self.input(i) for i in range(len(self.node.input))) if t is not None]

    def input_spec(self, i: int) -> TensorSpec:
        return self.graph.spec(self.node.input[i])

    def output_spec(self, i: int = 0) -> TensorSpec:
        return self.graph.spec(self.node.output[i])

    def attr(self, name: str, default: Any = None) -> Any:
        """An ONNX attribute value (int, float, str, list, numpy array for tensors), or ``default``."""
        if self._attrs is None:
            self._attrs = {a.name: a for a in self.node.attribute}
        attribute = self._attrs.get(name)
        if attribute is None:
            return default
        if attribute.ref_attr_name:
            raise self.error(f"attribute {name} refers to an enclosing function's attribute; lower the inlined model")
        value = helper.get_attribute_value(attribute)
        if isinstance(value, onnx.TensorProto):
            return tensor_to_array(value)
        if isinstance(value, bytes):
            return value.decode()
        return value

    def constant(self, i: int) -> np.ndarray | None:
        """The compile-time value of input ``i`` (see :meth:`GraphLowering.constant_value`), else None."""
        return self.graph.constant_value(self.node.input[i]) if self.has_input(i) else None

    def const(self, array: np.ndarray, suffix: str, *, onnx_dtype: int | None = None) -> Tensor:
        """Emit a ``Const`` op named ``<node>/<suffix>``."""
        return self.graph.const(array, f"{self.name}/{suffix}", onnx_dtype=onnx_dtype)

    def op(
        self,
        ge_type: str,
        inputs: list[tuple[str, Tensor | None]],
        outputs: list[tuple[str, TensorSpec]],
        attrs: dict[str, object] | None = None,
        *,
        suffix: str | None = None,
    ) -> OpRecord:
        """Emit one GE op for this node, named after it (``<node>/<suffix>`` for helper ops)."""
        name = self.name if suffix is None else f"{self.name}/{suffix}"
        return self.graph.builder.add(ge_type, name, inputs, outputs, attrs)

    def set_output(self, i: int, tensor: Tensor) -> None:
        """Bind ONNX output ``i`` to ``tensor``."""
        if i < len(self.node.output) and self.node.output[i]:
            self.graph.values[self.node.output[i]] = tensor

    def error(self, message: str) -> LoweringError:
        """A :class:`LoweringError` about this node (raise it)."""
        return LoweringError(f"node {self.name} ({self.node.op_type})", message)


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of an ONNX ``Constant`` node (any of its value attributes), or None."""
    for attribute in node.attribute:
        if attribute.ref_attr_name:
            return None
        value = helper.get_attribute_value(attribute)
        if attribute.name == "value":
            return tensor_to_array(value)
        if attribute.name == "value_float":
            return np.array(value, dtype=np.float32)
        if attribute.name == "value_floats":
            return np.array(list(value), dtype=np.float32)
        if attribute.name == "value_int":
            return np.array(value, dtype=np.int64)
        if attribute.name == "value_ints":
            return np.array(list(value), dtype=np.int64)
    return None
