"""Building one GE ``GraphDef``: ops with named ports, tensor descriptors, attributes, data and control edges.

Wire conventions (shared/LOWERING-FACTS.md, "How GE writes them"):

- ``OpDef.input`` lists ``"src_op:out_index"`` per data input, then ``"src_op:-1"`` per control edge;
  ``""`` stands for an absent optional input that is followed by a present one (absent trailing optional
  inputs are simply not written).
- ``OpDef.input_desc``/``output_desc`` carry one ``TensorDescriptor`` per port, named after the port, with
  ``layout`` ``"ND"`` and the descriptor attributes GE's own writer adds: ``origin_format`` (s),
  ``origin_data_type`` (s, e.g. ``"DT_FLOAT"``), ``origin_shape`` (list of int), ``origin_shape_initialized``
  (b). Shapes: -1 for an unknown dimension, ``[-2]`` for an unknown rank, no dims for a scalar.
- Port names travel in the op attributes ``_input_name_key``/``_input_name_value`` and
  ``_output_name_key``/``_output_name_value`` (list of strings / list of ints).
- ``GraphDef.input`` holds ``"data_op:0"`` per graph input, ``GraphDef.output`` the ``"op:index"`` of each
  graph output.

Tensors are described with :class:`sgdfuse.contract.TensorSpec` (ONNX element types); the conversion to GE
numbering happens only here.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from sgdfuse.contract import TensorSpec
from sgdfuse.lowering import ge_ir
from sgdfuse.runtime import numpy_to_onnx_dtype

__all__ = [
    "Tensor",
    "OpRecord",
    "GraphBuilder",
    "attr_value",
    "ints",
    "floats",
    "strings",
    "tensor_def",
    "add_const",
    "descriptor",
    "ge_shape",
    "ND",
]

ND = "ND"
_LIST = ge_ir.AttrDef.DESCRIPTOR.nested_types_by_name["ListValue"].enum_types_by_name["ListValueType"]
VT_LIST_STRING = _LIST.values_by_name["VT_LIST_STRING"].number
VT_LIST_INT = _LIST.values_by_name["VT_LIST_INT"].number
VT_LIST_FLOAT = _LIST.values_by_name["VT_LIST_FLOAT"].number
VT_LIST_BOOL = _LIST.values_by_name["VT_LIST_BOOL"].number


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One output of one GE op: what a data edge carries.

    Attributes:
        op: the producing op's name.
        index: the output index on that op.
        spec: shape and ONNX element type (``spec.name`` is the ONNX value it stands for, or a new name).
    """

    op: str
    index: int
    spec: TensorSpec

    @property
    def edge(self) -> str:
        """The ``"op:index"`` string GE writes for a data edge from this output."""
        return f"{self.op}:{self.index}"


@dataclasses.dataclass
class OpRecord:
    """One op while the graph is being built.

    Attributes:
        name, type: op name (unique in the graph) and GE op type.
        inputs: ``(port name, tensor or None for an absent optional input)`` in port order.
        outputs: ``(port name, spec)`` in port order.
        attrs: attribute name → ``AttrDef``.
        controls: names of ops that must finish before this one (control edges ``"src:-1"``).
        position: creation order, the tie-breaker of the final topological order.
        unconnected: input ports that have a descriptor but never an edge (``Data``'s and ``Variable``'s
            ``x``, as GE writes them).
    """

    name: str
    type: str
    inputs: list[tuple[str, Tensor | None]]
    outputs: list[tuple[str, TensorSpec]]
    attrs: dict[str, object]
    controls: list[str]
    position: int
    unconnected: list[tuple[str, TensorSpec]] = dataclasses.field(default_factory=list)

    def output(self, index: int = 0) -> Tensor:
        return Tensor(self.name, index, self.outputs[index][1])


def ints(values: Iterable[int]):
    """A list-of-int attribute (``VT_LIST_INT``), also when empty."""
    attr = ge_ir.AttrDef()
    attr.list.val_type = VT_LIST_INT
    attr.list.i.extend(int(v) for v in values)
    return attr


def floats(values: Iterable[float]):
    """A list-of-float attribute (``VT_LIST_FLOAT``)."""
    attr = ge_ir.AttrDef()
    attr.list.val_type = VT_LIST_FLOAT
    attr.list.f.extend(float(v) for v in values)
    return attr


def strings(values: Iterable[str]):
    """A list-of-string attribute (``VT_LIST_STRING``), also when empty."""
    attr = ge_ir.AttrDef()
    attr.list.val_type = VT_LIST_STRING
    attr.list.s.extend(v.encode() for v in values)
    return attr


def ge_shape(shape: tuple | None) -> list[int]:
    """GE dims of a :class:`TensorSpec` shape: -1 per unknown dimension, ``[-2]`` for an unknown rank."""
    if shape is None:
        return [-2]
    return [d if isinstance(d, int) else -1 for d in shape]


def descriptor(port: str, spec: TensorSpec | None):
    """The ``TensorDescriptor`` GE writes for one port (see the module docstring)."""
    desc = ge_ir.TensorDescriptor(name=port)
    if spec is None:  # an absent optional input
        return desc
    dims = ge_shape(spec.shape)
    desc.dtype = ge_ir.ge_dtype(spec.dtype)
    desc.shape.SetInParent()  # a scalar still has a (dimensionless) shape
    desc.shape.dim.extend(dims)
    desc.layout = ND
    desc.attr["origin_format"].s = ND.encode()
    if desc.dtype:
        desc.attr["origin_data_type"].s = ge_ir.GE_DTYPE_NAMES[desc.dtype].encode()
    desc.attr["origin_shape"].CopyFrom(ints(dims))
    desc.attr["origin_shape_initialized"].b = True
    return desc


def tensor_def(array: np.ndarray, *, onnx_dtype: int | None = None):
    """A ``TensorDef`` holding ``array`` (raw little-endian bytes, row-major)."""
    array = np.array(array, order="C", copy=True)  # not ascontiguousarray: it turns a scalar into shape [1]
    dtype = onnx_dtype if onnx_dtype is not None else numpy_to_onnx_dtype(array.dtype)
    value = ge_ir.TensorDef()
    value.desc.CopyFrom(descriptor("y", TensorSpec("value", tuple(int(d) for d in array.shape), dtype)))
    value.data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    return value


def add_const(builder: "GraphBuilder", name: str, array: np.ndarray, *, onnx_dtype: int | None = None, spec_name: str | None = None) -> Tensor:
    """Add a ``Const`` op (output ``y``, attribute ``value``) holding ``array``; return its output."""
    array = np.asarray(array)
    dtype = onnx_dtype or numpy_to_onnx_dtype(array.dtype)
    value = ge_ir.AttrDef()
    value.t.CopyFrom(tensor_def(array, onnx_dtype=dtype))
    spec = TensorSpec(spec_name or name, tuple(int(d) for d in array.shape), dtype)
    return builder.add("Const", name, outputs=[("y", spec)], attrs={"value": value}).output(0)


def attr_value(value: object):
    """An ``AttrDef`` for a Python value: bool → b, int → i, float → f, str/bytes → s, ndarray → t (tensor),
    non-empty list of int/float/str/bool → the matching list kind; an ``AttrDef`` is taken as is."""
    if isinstance(value, ge_ir.AttrDef):
        return value
    attr = ge_ir.AttrDef()
    if isinstance(value, (bool, np.bool_)):
        attr.b = bool(value)
    elif isinstance(value, (int, np.integer)):
        attr.i = int(value)
    elif isinstance(value, (float, np.floating)):
        attr.f = float(value)
    elif isinstance(value, str):
        attr.s = value.encode()
    elif isinstance(value, bytes):
        attr.s = value
    elif isinstance(value, np.ndarray):
        attr.t.CopyFrom(tensor_def(value))
    elif isinstance(value, (list, tuple)) and value:
        if all(isinstance(v, (bool, np.bool_)) for v in value):
            attr.list.val_type = VT_LIST_BOOL
            attr.list.b.extend(bool(v) for v in value)
        elif all(isinstance(v, (int, np.integer)) for v in value):
            return ints(value)
        elif all(isinstance(v, (int, float, np.integer, np.floating)) for v in value):
            return floats(value)
        elif all(isinstance(v, str) for v in value):
            return strings(value)
        else:
            raise TypeError(f"mixed list attribute value {value!r}")
    else:
        raise TypeError(f"no GE attribute kind for {value!r}; use ints()/strings() for empty lists")
    return attr


class GraphBuilder:
    """Collects ops, then writes them as one ``GraphDef`` in a topological order (data and control edges;
    ties keep creation order)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: dict[str, OpRecord] = {}
        self._taken: set[str] = set()

    def unique(self, base: str) -> str:
        """An op name not used yet in this graph, ``base`` itself when free. ``:`` is replaced because GE
        splits edges at the last ``:``."""
        base = (base or "op").replace(":", "_")
        name, counter = base, 1
        while name in self._taken:
            name = f"{base}_{counter}"
            counter += 1
        self._taken.add(name)
        return name

    def add(
        self,
        op_type: str,
        name: str,
        inputs: Sequence[tuple[str, Tensor | None]] = (),
        outputs: Sequence[tuple[str, TensorSpec]] = (),
        attrs: Mapping[str, object] | None = None,
    ) -> OpRecord:
        """Add an op (``name`` is made unique) and return its record; ``record.output(i)`` are its outputs."""
        record = OpRecord(
            name=self.unique(name),
            type=op_type,
            inputs=list(inputs),
            outputs=list(outputs),
            attrs={k: attr_value(v) for k, v in (attrs or {}).items()},
            controls=[],
            position=len(self.ops),
        )
        self.ops[record.name] = record
        return record

    def add_control(self, op: str, after: str) -> None:
        """Make ``op`` wait for ``after`` (a control edge ``after:-1`` on ``op``), once."""
        record = self.ops[op]
        if after != op and after not in record.controls:
            record.controls.append(after)

    def data_predecessors(self, op: str) -> list[str]:
        return [t.op for _, t in self.ops[op].inputs if t is not None]

    def predecessors(self, op: str) -> list[str]:
        return self.data_predecessors(op) + list(self.ops[op].controls)

    def ancestors(self, op: str) -> set[str]:
        """Every op ``op`` transitively waits for (data and control edges)."""
        seen: set[str] = set()
        stack = [op]
        while stack:
            for source in self.predecessors(stack.pop()):
                if source not in seen:
                    seen.add(source)
                    stack.append(source)
        return seen

    def readers(self) -> dict[tuple[str, int], list[str]]:
        """``(op, output index)`` → names of the ops reading that output through a data edge."""
        result: dict[tuple[str, int], list[str]] = {}
        for record in self.ops.values():
            for _, tensor in record.inputs:
                if tensor is not None:
                    result.setdefault((tensor.op, tensor.index), []).append(record.name)
        return result

    def _order(self) -> list[OpRecord]:
        waiting = {name: 0 for name in self.ops}
        dependants: dict[str, list[str]] = {}
        for name in self.ops:
            for source in set(self.predecessors(name)):
                waiting[name] += 1
                dependants.setdefault(source, []).append(name)
        ready = [(self.ops[n].position, n) for n, count in waiting.items() if count == 0]
        heapq.heapify(ready)
        order: list[OpRecord] = []
        while ready:
            _, name = heapq.heappop(ready)
            order.append(self.ops[name])
            for dependant in dependants.get(name, ()):
                waiting[dependant] -= 1
                if waiting[dependant] == 0:
                    heapq.heappush(ready, (self.ops[dependant].position, dependant))
        if len(order) != len(self.ops):
            stuck = sorted(n for n, count in waiting.items() if count)
            raise ValueError(f"graph {self.name} has a cycle through {stuck[:5]}; this is a bug in sgdfuse")
        return order

    def to_graph_def(self, *, inputs: Sequence[str] = (), outputs: Sequence[Tensor] = (), attrs: Mapping[str, object] | None = None):
        """The ``GraphDef``: ``inputs`` are Data op names (written ``"name:0"``), ``outputs`` the tensors the
        graph returns."""
        graph = ge_ir.GraphDef(name=self.name)
        graph.input.extend(f"{name}:0" for name in inputs)
        graph.output.extend(t.edge for t in outputs)
        for key, value in (attrs or {}).items():
            graph.attr[key].CopyFrom(attr_value(value))
        for record in self._order():
            graph.op.append(_op_def(record))
        return graph


def _op_def(record: OpRecord):
    op = ge_ir.OpDef(name=record.name, type=record.type)
    last_present = max((i for i, (_, t) in enumerate(record.inputs) if t is not None), default=-1)
    ports = record.inputs[: last_present + 1]
    op.input.extend(t.edge if t is not None else "" for _, t in ports)
    op.input.extend(f"{source}:-1" for source in record.controls)
    op.input_desc.extend(descriptor(port, t.spec if t is not None else None) for port, t in ports)
    op.input_desc.extend(descriptor(port, spec) for port, spec in record.unconnected)
    port_names = [port for port, _ in ports] + [port for port, _ in record.unconnected]
    op.output_desc.extend(descriptor(port, spec) for port, spec in record.outputs)
    op.attr["_input_name_key"].CopyFrom(strings(port_names))
    op.attr["_input_name_value"].CopyFrom(ints(range(len(port_names))))
    op.attr["_output_name_key"].CopyFrom(strings(port for port, _ in record.outputs))
    op.attr["_output_name_value"].CopyFrom(ints(range(len(record.outputs))))
    for key, value in record.attrs.items():
        op.attr[key].CopyFrom(value)
    return op
