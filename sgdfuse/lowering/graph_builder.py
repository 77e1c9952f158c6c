"""Building one GE ``GraphDef``: ops with named ports, tensor descriptors, attributes, data and control edges.

Wire conventions (docs/lowering.md, "The GE IR schema"):

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
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from sgdfuse.contract import TensorSpec
from sgdfuse.lowering import ge_ir
from sgdfuse.runtime import numpy_to_onnx_dtype

__all__ = [
    "Tensor",
    "OpKind",
    "OpRecord",
    "GraphBuilder",
    "GraphWriter",
    "WrittenOp",
    "attr_value",
    "ints",
    "floats",
    "strings",
    "tensor_def",
    "add_const",
    "descriptor",
    "ge_shape",
    "model_def_bytes",
    "ND",
    "encode_varint",
]

ND = "ND"
_LIST = ge_ir.AttrDef.DESCRIPTOR.nested_types_by_name["ListValue"].enum_types_by_name["ListValueType"]
VT_LIST_STRING = _LIST.values_by_name["VT_LIST_STRING"].number
VT_LIST_INT = _LIST.values_by_name["VT_LIST_INT"].number
VT_LIST_FLOAT = _LIST.values_by_name["VT_LIST_FLOAT"].number
VT_LIST_BOOL = _LIST.values_by_name["VT_LIST_BOOL"].number


@dataclasses.dataclass(frozen=True, slots=True)
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


@dataclasses.dataclass(eq=False, slots=True)
class OpKind:
    """A class of ops that hold the same bytes after their names and edges: one op type, the same ports (names,
    which inputs are present, each port's dtype and shape) and the same attribute values, except the
    attributes named in ``own``, whose values are each op's own (a ``Data`` op's index, a ``Const``'s value).

    Made by ``kind()`` of a :class:`GraphBuilder` or :class:`GraphWriter` for a caller that adds many ops of
    one class (the state variables, the graph inputs, the ``SGD`` ops of one hyper-parameter set): the caller
    keys its kinds by everything the ops' tails depend on, and the encoder writes the shared part once per
    kind instead of deriving it from each op's ports. Compared by identity.

    Attributes:
        type: the GE op type.
        attrs: attribute name → ``AttrDef``, shared by every op of the kind (the ``own`` ones absent).
        own: names of the attributes whose values each op gives itself.
        template: set by the encoder from the first op of the kind: its tail, with each ``own`` attribute as its
            name (str) in place of its field, the rest wire bytes (docs/lowering.md, "The GE IR schema").
    """

    type: str
    attrs: dict[str, object]
    own: tuple[str, ...] = ()
    template: list[bytes | str] | None = None


@dataclasses.dataclass(slots=True)
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
        kind: the :class:`OpKind` the op was added as, or None (the encoder then reads its tail from its ports).
    """

    name: str
    type: str
    inputs: list[tuple[str, Tensor | None]]
    outputs: list[tuple[str, TensorSpec]]
    attrs: dict[str, object]
    controls: list[str]
    position: int
    unconnected: list[tuple[str, TensorSpec]] = dataclasses.field(default_factory=list)
    kind: OpKind | None = None

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
    shape = tuple(int(d) for d in array.shape)
    kind = builder.kind("const", (dtype, shape), "Const", own=("value",))  # the value is each Const's own
    return builder.add("Const", name, outputs=[("y", TensorSpec(spec_name or name, shape, dtype))], attrs={"value": value}, kind=kind).output(0)


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


class _Graph:
    """What :class:`GraphBuilder` and :class:`GraphWriter` share: unique op names, attribute values converted
    once per distinct plain value, the op kinds (:class:`OpKind`) their callers key, and the records the ops
    are described by when they are added."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._taken: set[str] = set()
        self._next_suffix: dict[str, int] = {}
        self._next_position = 0  # never reused, also after ops are pruned
        self._attr_cache: dict[tuple[type, str], object] = {}
        self._kinds: dict[tuple[str, str, tuple[str, ...], Hashable], OpKind] = {}

    def unique(self, base: str) -> str:
        """An op name not used yet in this graph, ``base`` itself when free. ``:`` is replaced because GE
        splits edges at the last ``:``."""
        base = (base or "op").replace(":", "_")
        name, counter = base, self._next_suffix.get(base, 1)
        if name in self._taken:
            name = f"{base}_{counter}"
            while name in self._taken:
                counter += 1
                name = f"{base}_{counter}"
            self._next_suffix[base] = counter + 1
        self._taken.add(name)
        return name

    def _attr(self, value: object):
        # Equal plain values share one AttrDef (and so one encoding); tensors and AttrDefs are taken as is.
        # The key is the repr, so that -0.0 and 0.0 stay apart.
        kind = type(value)
        if kind is bool or kind is int or kind is str:
            key = (kind, value)  # equal values of these exact types have equal reprs: no repr needed
        elif isinstance(value, (bool, int, float, str, list, tuple)):
            key = (kind, repr(value))
        else:
            return attr_value(value)
        found = self._attr_cache.get(key)
        if found is None:
            found = self._attr_cache[key] = attr_value(value)
        return found

    def kind(self, site: str, key: Hashable, op_type: str, attrs: Mapping[str, object] | None = None, own: Sequence[str] = ()) -> OpKind:
        """The :class:`OpKind` that the caller named ``site`` keys by ``key``, made on first use with the op
        type ``op_type``, the shared attribute values ``attrs`` (plain values converted as :meth:`add`
        converts them) and the per-op attributes ``own``, and returned as it was made on every later call.

        ``key`` must cover everything the ops' tails depend on but ``own``: the dtype and shape of every port
        and every value in ``attrs`` (the ``attrs`` of a later call are not read). ``site`` keeps the kinds
        of different callers apart: a ``Const`` of zeros shared by its class and a ``Const`` whose value is its
        own are keyed alike (dtype and shape) but are not one kind."""
        cache_key = (site, op_type, tuple(own), key)
        found = self._kinds.get(cache_key)
        if found is None:
            found = self._kinds[cache_key] = OpKind(op_type, {k: self._attr(v) for k, v in (attrs or {}).items()}, tuple(own))
        return found

    def _record(
        self,
        op_type: str,
        name: str,
        inputs: Sequence[tuple[str, Tensor | None]],
        outputs: Sequence[tuple[str, TensorSpec]],
        attrs: Mapping[str, object] | None,
        kind: OpKind | None,
        unconnected: Sequence[tuple[str, TensorSpec]],
    ) -> OpRecord:
        if kind is None:
            converted = {k: self._attr(v) for k, v in (attrs or {}).items()}
        elif attrs:
            converted = {**kind.attrs, **{k: self._attr(v) for k, v in attrs.items()}}
        else:
            converted = kind.attrs  # shared: nothing changes a record's attributes after it is added
        record = OpRecord(
            name=self.unique(name),
            type=op_type,
            inputs=list(inputs),
            outputs=list(outputs),
            attrs=converted,
            controls=[],
            position=self._next_position,
            unconnected=list(unconnected),
            kind=kind,
        )
        self._next_position += 1
        return record


class GraphBuilder(_Graph):
    """Collects ops, then writes them as one ``GraphDef`` in a topological order (data and control edges;
    ties keep creation order).

    Writing is linear in the graph: each op's ``OpDef`` is encoded straight to protobuf wire bytes from
    cached pieces (a graph has few distinct descriptors, attribute values and port-name lists; an op added
    as an :class:`OpKind` takes its kind's whole tail), and the ``GraphDef`` is never built as a message.
    Building ``OpDef`` messages field by field from Python instead cost about 100 µs an op.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ops: dict[str, OpRecord] = {}

    def add(
        self,
        op_type: str,
        name: str,
        inputs: Sequence[tuple[str, Tensor | None]] = (),
        outputs: Sequence[tuple[str, TensorSpec]] = (),
        attrs: Mapping[str, object] | None = None,
        *,
        kind: OpKind | None = None,
        unconnected: Sequence[tuple[str, TensorSpec]] = (),
    ) -> OpRecord:
        """Add an op (``name`` is made unique) and return its record; ``record.output(i)`` are its outputs.

        With ``kind`` (:meth:`kind`), ``attrs`` holds only the kind's ``own`` attributes and the op takes the
        kind's others; the caller vouches that the op's ports, dtypes and shapes are those of every other op of
        the kind (its key for the kind covers them)."""
        record = self._record(op_type, name, inputs, outputs, attrs, kind, unconnected)
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
        """Every op ``op`` transitively waits for (data and control edges). A whole-graph walk: for one-off
        questions; repeated reachability questions go through :class:`sgdfuse.lowering.dag.OpOrder`."""
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
        """The order the graph is written in: creation order when that is topological (as rules build graphs),
        else :meth:`_sorted`."""
        written: set[str] = set()
        for record in self.ops.values():
            if not _reads_written(record, written):
                return self._sorted()
            written.add(record.name)
        return list(self.ops.values())

    def _sorted(self) -> list[OpRecord]:
        """Every op in a topological order, ties broken by creation order (Kahn's algorithm with a heap).

        Raises:
            ValueError: the graph has a cycle (a bug in sgdfuse).
        """
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

    def _graph_def_pieces(self, inputs: Sequence[str], outputs: Sequence[Tensor], attrs: Mapping[str, object] | None) -> tuple[list[bytes], int]:
        """The pieces of the serialised ``GraphDef`` and their total length (see :meth:`to_graph_def_bytes`)."""
        encoder = _Encoder()
        ops: list[bytes] = []
        # Creation order when it is topological (as rules build graphs: what the sort would return, at a
        # fraction of the cost), checked op by op while the ops are encoded; else the sorted order.
        size = encoder.ops_in_order(self.ops.values(), ops)
        if size is None:
            ops.clear()
            size = encoder.ops_in_order(self._sorted(), ops, checked=False)
        return _graph_fields(encoder, self.name, inputs, outputs, attrs, ops, size)  # type: ignore[arg-type]

    def to_graph_def_bytes(self, *, inputs: Sequence[str] = (), outputs: Sequence[Tensor] = (), attrs: Mapping[str, object] | None = None) -> bytes:
        """The serialised ``GraphDef`` (see :meth:`to_graph_def`): fields in number order, map entries sorted by
        key, as protobuf's deterministic serialisation writes them (tests/test_lowering_schema.py checks it)."""
        return b"".join(self._graph_def_pieces(inputs, outputs, attrs)[0])

    def to_model_def_bytes(
        self,
        model_name: str,
        model_attrs: Mapping[str, object],
        *,
        inputs: Sequence[str] = (),
        outputs: Sequence[Tensor] = (),
        attrs: Mapping[str, object] | None = None,
    ) -> bytes:
        """:func:`model_def_bytes` of this one graph (:meth:`to_graph_def_bytes`), joined once: the graph's
        bytes (about 40 MB at 10,000 updates) are never copied into the model's."""
        pieces, size = self._graph_def_pieces(inputs, outputs, attrs)
        return b"".join(_model_def_pieces(model_name, [(pieces, size)], model_attrs))

    def to_graph_def(self, *, inputs: Sequence[str] = (), outputs: Sequence[Tensor] = (), attrs: Mapping[str, object] | None = None):
        """The ``GraphDef``: ``inputs`` are Data op names (written ``"name:0"``), ``outputs`` the tensors the
        graph returns."""
        return ge_ir.GraphDef.FromString(self.to_graph_def_bytes(inputs=inputs, outputs=outputs, attrs=attrs))


@dataclasses.dataclass(slots=True)
class WrittenOp:
    """An op :class:`GraphWriter` has written: its name and its output ports with their specs, as given to
    :meth:`GraphWriter.add` (not frozen: a frozen dataclass costs about three times as much to make, and the
    writer makes one per op)."""

    name: str
    outputs: Sequence[tuple[str, TensorSpec]]

    def output(self, index: int = 0) -> Tensor:
        return Tensor(self.name, index, self.outputs[index][1])


class GraphWriter(_Graph):
    """A ``GraphDef`` written op by op as the ops are added: for a graph that no pass edits after an op is
    added (the init graph), so no :class:`OpRecord` is kept. :meth:`add` takes what
    :meth:`GraphBuilder.add` takes and gives the same bytes; an op of a kind whose template the encoder
    already holds is written from its name, its edges and the template alone. Every edge comes from an op
    added before (a :class:`WrittenOp`'s output), so creation order is the graph's topological order."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._encoder = _Encoder()
        self._ops: list[bytes] = []
        self._size = 0
        self._records: list[OpRecord] = []

    def add(
        self,
        op_type: str,
        name: str,
        inputs: Sequence[tuple[str, Tensor | None]] = (),
        outputs: Sequence[tuple[str, TensorSpec]] = (),
        attrs: Mapping[str, object] | None = None,
        *,
        kind: OpKind | None = None,
        unconnected: Sequence[tuple[str, TensorSpec]] = (),
    ) -> WrittenOp:
        """Write an op (``name`` made unique; arguments as for :meth:`GraphBuilder.add`) and return it."""
        if kind is not None and kind.template is not None:
            unique = self.unique(name)
            # Own ints (a Data op's index) stay ints: the encoder writes them without an AttrDef.
            own = {k: v if type(v) is int else self._attr(v) for k, v in attrs.items()} if attrs else None
            self._size += self._encoder.kind_op(kind, unique, inputs, own, self._ops)
            self._next_position += 1
        else:  # the first op of its kind, or an op of no kind: encoded from its record
            record = self._record(op_type, name, inputs, outputs, attrs, kind, unconnected)
            unique = record.name
            self._size += self._encoder.op(record, self._ops)
            # Kept: the encoder caches attribute bytes by the values' identity, which must not be reused by
            # another value while this graph is written (a few records: one per kind, and the odd op).
            self._records.append(record)
        return WrittenOp(unique, outputs)

    def to_model_def_bytes(
        self,
        model_name: str,
        model_attrs: Mapping[str, object],
        *,
        inputs: Sequence[str] = (),
        outputs: Sequence[Tensor] = (),
        attrs: Mapping[str, object] | None = None,
    ) -> bytes:
        """As :meth:`GraphBuilder.to_model_def_bytes`, of the ops written so far in the order they were added."""
        parts, size = _graph_fields(self._encoder, self.name, inputs, outputs, attrs, self._ops, self._size)
        return b"".join(_model_def_pieces(model_name, [(parts, size)], model_attrs))


def _graph_fields(
    encoder: "_Encoder", name: str, inputs: Sequence[str], outputs: Sequence[Tensor], attrs: Mapping[str, object] | None, ops: list[bytes], ops_size: int
) -> tuple[list[bytes], int]:
    """The pieces of a serialised ``GraphDef`` (name, inputs, outputs, the encoded ``ops`` of total length
    ``ops_size``, attributes: fields in number order) and their total length."""
    head = [_len(_GRAPH_NAME, name.encode())]
    head.extend(_len(_GRAPH_INPUT, f"{data_op}:0".encode()) for data_op in inputs)
    head.extend(_len(_GRAPH_OUTPUT, t.edge.encode()) for t in outputs)
    tail = [_len(_GRAPH_ATTR, encoder.map_entry(key, attr_value(value))) for key, value in sorted((attrs or {}).items(), key=lambda item: item[0].encode())]
    return head + ops + tail, sum(map(len, head)) + ops_size + sum(map(len, tail))


def _reads_written(record: OpRecord, written: set[str]) -> bool:
    """True when every op ``record`` reads (data and control edges) is in ``written``."""
    for _, tensor in record.inputs:
        if tensor is not None and tensor.op not in written:
            return False
    for source in record.controls:
        if source not in written:
            return False
    return True


def model_def_bytes(name: str, graphs: Sequence[bytes], attrs: Mapping[str, object]) -> bytes:
    """A serialised ``ModelDef`` named ``name`` holding the serialised ``GraphDef`` s ``graphs`` and the
    attributes ``attrs`` (values as :func:`attr_value` takes them), canonical as
    :meth:`GraphBuilder.to_graph_def_bytes`: parsing it and serialising it deterministically gives it back."""
    return b"".join(_model_def_pieces(name, [([graph], len(graph)) for graph in graphs], attrs))


def _model_def_pieces(name: str, graphs: Sequence[tuple[list[bytes], int]], attrs: Mapping[str, object]) -> list[bytes]:
    """The pieces of a ``ModelDef`` whose graphs are given as ``(pieces, total length)``."""
    encoder = _Encoder()
    parts = [_len(_MODEL_NAME, name.encode())] if name else []
    for pieces, size in graphs:
        parts += (_MODEL_GRAPH, encode_varint(size))
        parts += pieces
    parts.extend(_len(_MODEL_ATTR, encoder.map_entry(key, attr_value(value))) for key, value in sorted(attrs.items(), key=lambda item: item[0].encode()))
    return parts


# ---- wire encoding ------------------------------------------------------------------------------------


def _tag(message, field: str) -> bytes:
    """The key of a length-delimited field (wire type 2)."""
    return encode_varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def encode_varint(value: int) -> bytes:
    """``value`` (non-negative) as a protobuf varint (base-128, least significant group first)."""
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(0x80)]


def _len(tag: bytes, payload: bytes) -> bytes:
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else encode_varint(n)) + payload


def _varint(value: int) -> bytes:
    """:func:`encode_varint`, one look-up for the lengths of names and edges (nearly all below 128)."""
    return _SMALL[value] if value < 0x80 else encode_varint(value)


_GRAPH_NAME, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_OP, _GRAPH_ATTR = (_tag(ge_ir.GraphDef, f) for f in ("name", "input", "output", "op", "attr"))
_MODEL_NAME, _MODEL_GRAPH, _MODEL_ATTR = (_tag(ge_ir.ModelDef, f) for f in ("name", "graph", "attr"))
_OP_NAME, _OP_TYPE, _OP_INPUT, _OP_ATTR, _OP_INPUT_DESC, _OP_OUTPUT_DESC = (
    _tag(ge_ir.OpDef, f) for f in ("name", "type", "input", "attr", "input_desc", "output_desc")
)
_MAP_KEY, _MAP_VALUE = b"\x0a", b"\x12"  # a map entry is a message {key = 1; value = 2}
_ATTR_INT = encode_varint(ge_ir.AttrDef.DESCRIPTOR.fields_by_name["i"].number << 3)  # the int64 member (wire type 0)
_UINT64 = (1 << 64) - 1  # a negative int64 is written as its two's complement, ten bytes
_ABSENT_INPUT = _len(_OP_INPUT, b"")
_DESC_NAME = _tag(ge_ir.TensorDescriptor, "name")
_UNSHARED_TAILS = frozenset({"Const", "Data"})


class _Encoder:
    """``OpDef`` wire bytes from cached pieces: the fields :func:`_op_def` sets (the reference), each
    descriptor, attribute and port-name list encoded once per graph."""

    def __init__(self) -> None:
        self._descriptors: dict[tuple, bytes] = {}
        self._bodies: dict[tuple, bytes] = {}
        self._attrs: dict[tuple[str, int], bytes] = {}
        self._port_names: dict[tuple[str, tuple[str, ...]], list[tuple[str, bytes]]] = {}
        self._types: dict[str, bytes] = {}
        self._templates: dict[tuple, list[bytes | str]] = {}
        self._tails: dict[tuple, bytes] = {}
        self._int_keys: dict[str, bytes] = {}  # an own int attribute's key field, then its value's tag

    def descriptor(self, tag: bytes, port: str, spec: TensorSpec | None) -> bytes:
        """The whole ``input_desc``/``output_desc`` field (tag, length, descriptor)."""
        key = (tag, port, None, None) if spec is None else (tag, port, spec.dtype, spec.shape)
        found = self._descriptors.get(key)
        if found is None:
            # The port name is field 1; the rest depends only on the spec (NetOutput alone has a port per
            # graph output, x0, x1, ..., all with the same few specs).
            body_key = key[2:]
            body = self._bodies.get(body_key)
            if body is None:
                body = self._bodies[body_key] = descriptor("", spec).SerializeToString(deterministic=True)
            found = self._descriptors[key] = _len(tag, _len(_DESC_NAME, port.encode()) + body)
        return found

    def map_entry(self, key: str, value) -> bytes:
        return _len(_MAP_KEY, key.encode()) + _len(_MAP_VALUE, value.SerializeToString(deterministic=True))

    def attr(self, key: str, value) -> bytes:
        # AttrDef objects are shared between ops for equal plain values (GraphBuilder._attr); the records
        # being encoded keep them alive, so their ids are stable keys (never pass a temporary here).
        cache_key = (key, id(value))
        found = self._attrs.get(cache_key)
        if found is None:
            found = self._attrs[cache_key] = _len(_OP_ATTR, self.map_entry(key, value))
        return found

    def port_names(self, direction: str, names: tuple[str, ...]) -> list[tuple[str, bytes]]:
        """The two attribute entries naming the ports, ``(key, field bytes)`` each."""
        found = self._port_names.get((direction, names))
        if found is None:
            # Not through attr(): these AttrDefs are temporaries, so their ids would be reused.
            key, value = f"_{direction}_name_key", f"_{direction}_name_value"
            found = self._port_names[(direction, names)] = [
                (key, _len(_OP_ATTR, self.map_entry(key, strings(names)))),
                (value, _len(_OP_ATTR, self.map_entry(value, ints(range(len(names)))))),
            ]
        return found

    def ops_in_order(self, records: Iterable[OpRecord], out: list[bytes], *, checked: bool = True) -> int | None:
        """Append the ``GraphDef.op`` fields of ``records`` in their order to ``out`` and return their total
        length; with ``checked``, None as soon as an op reads an op (data or control edge) not written before
        it (``out`` then holds a partial graph)."""
        size = 0
        written: set[str] | None = set() if checked else None
        for record in records:
            written_size = self.op(record, out, written)
            if written_size < 0:
                return None
            size += written_size
        return size

    def op(self, record: OpRecord, out: list[bytes], written: set[str] | None = None) -> int:
        """Append ``record``'s whole ``GraphDef.op`` field (tag, length, ``OpDef``) to ``out`` as one bytes
        object, to be joined once with the rest of the graph, and return its length. With ``written`` (the
        ops written so far, to which ``record`` is added), -1 and nothing appended when ``record`` reads an
        op not in it."""
        inputs = record.inputs
        count = len(inputs)
        while count and inputs[count - 1][1] is None:  # absent trailing optional inputs are not written
            count -= 1
        if written is not None:
            if not _reads_written(record, written):
                return -1
            written.add(record.name)
        kind = record.kind
        if kind is not None:
            if kind.template is None:
                kind.template = self._kind_template(record, count)
            return self.kind_op(kind, record.name, inputs, record.attrs, out, record.controls)
        op_type = self._types.get(record.type)
        if op_type is None:
            op_type = self._types[record.type] = _len(_OP_TYPE, record.type.encode())
        name = record.name.encode()
        # Slots 0 and 1 take the field's tag and length once the payload is known (_framed).
        pieces = [_GRAPH_OP, b"", _OP_NAME, _varint(len(name)), name, op_type]
        # The key of everything after the edges (attributes, descriptors): the ports with their specs'
        # dtypes and shapes, then the attribute names, the groups kept apart by int markers (ports are str
        # or tuples). Not the op's name or edges: a graph of N updates has a few hundred distinct keys.
        key: list[object] = []
        for k in range(count):
            port, tensor = inputs[k]
            if tensor is None:
                pieces.append(_ABSENT_INPUT)
                key.append(port)
            else:
                edge = f"{tensor.op}:{tensor.index}".encode()
                pieces += (_OP_INPUT, _varint(len(edge)), edge)
                spec = tensor.spec
                key.append((port, spec.dtype, spec.shape))
        for source in record.controls:
            edge = f"{source}:-1".encode()
            pieces += (_OP_INPUT, _varint(len(edge)), edge)
        key.append(0)
        for port, spec in record.unconnected:
            key.append((port, spec.dtype, spec.shape))
        key.append(1)
        for port, spec in record.outputs:
            key.append((port, spec.dtype, spec.shape))
        key.append(2)
        attrs = record.attrs
        key.extend(attrs)
        frame = tuple(key)
        template = self._templates.get(frame)
        if template is None:
            template = self._templates[frame] = self._template(record, count)
        if not attrs:
            pieces += template
        elif record.type in _UNSHARED_TAILS:
            # A Const's value is its own and a Data op's index differs from every other's: the tail is
            # assembled from the template per op, never cached whole.
            pieces += [piece if type(piece) is bytes else self.attr(piece, attrs[piece]) for piece in template]
        else:
            # Attribute values are keyed by identity (shared for equal plain values, GraphBuilder._attr).
            tail_key = (frame, *map(id, attrs.values()))
            tail = self._tails.get(tail_key)
            if tail is None:
                tail = self._tails[tail_key] = b"".join([piece if type(piece) is bytes else self.attr(piece, attrs[piece]) for piece in template])
            pieces.append(tail)
        return self._framed(pieces, out)

    @staticmethod
    def _framed(pieces: list[bytes], out: list[bytes]) -> int:
        """Append ``pieces`` (two slots for the tag and length, then the payload) to ``out`` as one bytes
        object, the whole ``GraphDef.op`` field, and return its length. One object per op: joining the graph
        from a few pieces per op cost more than these joins (the pieces of a large graph are scattered over
        memory when the graph is joined; here they were just made)."""
        payload = sum(map(len, pieces)) - 1
        pieces[1] = length = _varint(payload)
        out.append(b"".join(pieces))
        return 1 + len(length) + payload

    def kind_op(
        self,
        kind: OpKind,
        name: str,
        inputs: Sequence[tuple[str, Tensor | None]],
        attrs: Mapping[str, object] | None,
        out: list[bytes],
        controls: Sequence[str] = (),
    ) -> int:
        """Append the ``GraphDef.op`` field of an op of ``kind`` (its template set) named ``name`` reading
        ``inputs`` and waiting for ``controls``, its ``own`` attributes in ``attrs`` (``AttrDef`` s, or
        plain ints), and return its length: the op's name and edges, then the kind's template."""
        op_type = self._types.get(kind.type)
        if op_type is None:
            op_type = self._types[kind.type] = _len(_OP_TYPE, kind.type.encode())
        encoded = name.encode()
        pieces = [_GRAPH_OP, b"", _OP_NAME, _varint(len(encoded)), encoded, op_type]
        count = len(inputs)
        while count and inputs[count - 1][1] is None:  # absent trailing optional inputs are not written
            count -= 1
        for k in range(count):
            tensor = inputs[k][1]
            if tensor is None:
                pieces.append(_ABSENT_INPUT)
            else:
                edge = f"{tensor.op}:{tensor.index}".encode()
                pieces += (_OP_INPUT, _varint(len(edge)), edge)
        for source in controls:
            edge = f"{source}:-1".encode()
            pieces += (_OP_INPUT, _varint(len(edge)), edge)
        template: list[bytes | str] = kind.template  # type: ignore[assignment]
        if len(template) == 1:
            pieces += template  # type: ignore[arg-type]
        else:
            # An own value is encoded each time, never cached by identity: a GraphWriter keeps no record, so
            # the value may be freed and its id reused by the next op's.
            own = attrs or {}
            pieces += [piece if type(piece) is bytes else self._own(piece, own[piece]) for piece in template]  # type: ignore[misc]
        return self._framed(pieces, out)

    def _own(self, key: str, value) -> bytes:
        """The ``attr`` field of an op's own attribute: an ``AttrDef``, or a plain int written as the
        ``AttrDef`` holding it as ``i`` (one varint field) without making the message."""
        if type(value) is not int:
            return _len(_OP_ATTR, self.map_entry(key, value))
        head = self._int_keys.get(key)
        if head is None:
            head = self._int_keys[key] = _len(_MAP_KEY, key.encode()) + _MAP_VALUE
        value_bytes = encode_varint(value & _UINT64)
        entry = head + _SMALL[len(value_bytes) + 1] + _ATTR_INT + value_bytes  # an AttrDef of at most 11 bytes
        return _OP_ATTR + _varint(len(entry)) + entry

    def _kind_template(self, record: OpRecord, count: int) -> list[bytes | str]:
        """The tail of every op of ``record``'s kind, from ``record``: wire bytes, joined between the
        ``own`` attributes (left as their names), so an op whose kind has none appends one piece."""
        own = record.kind.own
        merged: list[bytes | str] = []
        for piece in self._template(record, count):
            if type(piece) is not bytes:
                if piece in own:
                    merged.append(piece)
                    continue
                piece = self.attr(piece, record.attrs[piece])
            if merged and type(merged[-1]) is bytes:
                merged[-1] += piece
            else:
                merged.append(piece)
        return merged

    def _template(self, record: OpRecord, count: int) -> list[bytes | str]:
        """The attribute and descriptor fields of ``record`` (its first ``count`` inputs written), in wire
        order, with each of its own attributes as its key (str) in place of its field."""
        descriptors = []
        ports = []
        for port, tensor in record.inputs[:count]:
            descriptors.append(self.descriptor(_OP_INPUT_DESC, port, None if tensor is None else tensor.spec))
            ports.append(port)
        for port, spec in record.unconnected:
            descriptors.append(self.descriptor(_OP_INPUT_DESC, port, spec))
            ports.append(port)
        outputs = []
        for port, spec in record.outputs:
            descriptors.append(self.descriptor(_OP_OUTPUT_DESC, port, spec))
            outputs.append(port)
        # Fields in number order (name, type, input, attr, input_desc, output_desc) and map entries sorted
        # by key: the bytes protobuf's deterministic serialisation writes, so they can be saved unparsed.
        named: list[tuple[str, bytes | str]] = self.port_names("input", tuple(ports)) + self.port_names("output", tuple(outputs))
        named.extend((key, key) for key in record.attrs)
        named.sort(key=lambda item: item[0].encode())
        template: list[bytes | str] = [field for _, field in named]
        template.append(b"".join(descriptors))
        return template


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
