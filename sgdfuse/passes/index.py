"""A light index of an ONNX graph, built in one sweep over the ``GraphProto``.

The pass works on the ``ModelProto`` itself, never on an object IR (docs/design.md,
"Performance"): this index maps value names to their producer, consumers, initializer, ``Constant`` value and
static type, so that every later question is a dictionary look-up.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import signal
import sys
import threading
import warnings

import numpy as np
import onnx

from sgdfuse.errors import DuplicateValueError, GraphCycleError, ModelNameError

from sgdfuse.contract import TensorSpec
from sgdfuse.external_data import tensor_to_array
from sgdfuse.passes.scan import NodeTable, ScanError, graph_node_table, node_table
from sgdfuse.passes import value_scan
from sgdfuse.passes.value_scan import INPUT, OUTPUT, VALUE_INFO, ScannedInfos, inference_bytes, native_available, scan_value_infos

__all__ = ["GraphIndex", "NodeFacts", "build_index", "require_text_names", "SMALL_CONSTANT_ELEMENTS", "OWN_PREFIX", "tensor_type_of"]

logger = logging.getLogger(__name__)

SMALL_CONSTANT_ELEMENTS = 64
"""Initializers and ``Constant`` values up to this many elements are read (to find scalar coefficients);
larger ones are never loaded, so external tensor data stays on disk."""


OWN_PREFIX = "sgdfuse/"
"""The prefix of every value and node name sgdfuse makes in a graph (:class:`sgdfuse.passes.rewrite.Planner`)."""


NodeFacts = tuple[str, str, tuple[str, ...], tuple[str, ...], bool, bool]
"""What the pass reads of every node: ``(op_type, domain, inputs, outputs, has subgraph, has attributes)``,
``NodeProto`` fields 4, 7, 1 and 2 (empty input and output names kept, every name interned), and whether its
attributes (field 5) hold a ``GRAPH``/``GRAPHS`` value or are present at all."""


@dataclasses.dataclass
class GraphIndex:
    """Look-up tables over one ``GraphProto`` (the main graph; subgraphs are opaque).

    Attributes:
        graph: the indexed graph (not copied; never mutated by the index).
        producer: value name → index of the node that outputs it.
        consumers: value name → indices of the nodes that read it (in node order).
        initializers: name → ``TensorProto`` of every initializer.
        graph_inputs: names of the graph inputs, in order.
        graph_outputs: names of the graph outputs, in order.
        specs: value name → :class:`TensorSpec` (shape and dtype), from inputs, outputs, ``value_info``,
            initializers and shape inference.
        subgraph_reads: names read from the outer scope by any subgraph (``If``/``Loop``/``Scan`` bodies):
            such values are used even though no top-level node lists them.
        subgraph_nodes: indices of the nodes that hold a subgraph attribute, in node order.
        nodes: per node of the graph, in order, the :data:`NodeFacts` read from it once (op type, domain,
            inputs, outputs, whether it holds a subgraph, whether it has attributes): every later sweep reads
            these, not the protobuf (a read of every node through protobuf costs about a load of the model).
        own_node_names: the names of the graph's nodes that start with :data:`OWN_PREFIX` (every name sgdfuse
            makes does, so no other node name can equal one), read with the node table; None when not read
            (an index made by hand): then ask the graph.
        in_order: every node comes after the producers of what it reads (the order ONNX requires); False
            for a graph merely out of that order (accepted: the rewrite writes it sorted).
    """

    graph: onnx.GraphProto
    producer: dict[str, int]
    consumers: dict[str, list[int]]
    initializers: dict[str, onnx.TensorProto]
    graph_inputs: list[str]
    graph_outputs: list[str]
    specs: dict[str, TensorSpec]
    subgraph_reads: set[str]
    subgraph_nodes: list[int] = dataclasses.field(default_factory=list)
    nodes: list[NodeFacts] = dataclasses.field(default_factory=list)
    own_node_names: frozenset[str] | None = None
    in_order: bool = True
    _constants: dict[str, np.ndarray | None] = dataclasses.field(default_factory=dict)

    def node(self, value: str) -> onnx.NodeProto | None:
        """The node that produces ``value``, or None for graph inputs, initializers and unknown names."""
        index = self.producer.get(value)
        return None if index is None else self.graph.node[index]

    def spec(self, value: str) -> TensorSpec:
        """Static shape and dtype of ``value`` (shape None and dtype 0 when unknown)."""
        return self.specs.get(value) or TensorSpec(value, None, 0)

    def constant(self, value: str) -> np.ndarray | None:
        """The value of a small compile-time constant: an initializer that is not a graph input, or a
        ``Constant`` node's output, holding at most :data:`SMALL_CONSTANT_ELEMENTS` elements; else None.

        An initializer that is also a graph input is overridable at run time, so it is not a constant.
        """
        if value in self._constants:
            return self._constants[value]
        result = self._read_constant(value)
        self._constants[value] = result
        return result

    def _read_constant(self, value: str) -> np.ndarray | None:
        tensor = self.initializers.get(value)
        if tensor is not None:
            if value in self._input_set:
                return None
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                return None
            if math.prod(tensor.dims) > SMALL_CONSTANT_ELEMENTS:
                return None
            return tensor_to_array(tensor)
        node = self.node(value)
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        for attribute in node.attribute:
            if attribute.ref_attr_name:
                return None
            if attribute.name == "value":
                if math.prod(attribute.t.dims) > SMALL_CONSTANT_ELEMENTS:
                    return None
                if attribute.t.data_location == onnx.TensorProto.EXTERNAL:
                    return None  # never read here: external data is read only through sgdfuse.external_data
                return tensor_to_array(attribute.t)
            if attribute.name == "value_float":
                return np.array(attribute.f, dtype=np.float32)
            if attribute.name == "value_floats":
                return np.array(list(attribute.floats), dtype=np.float32)
            if attribute.name == "value_int":
                return np.array(attribute.i, dtype=np.int64)
            if attribute.name == "value_ints":
                return np.array(list(attribute.ints), dtype=np.int64)
        return None

    @property
    def _input_set(self) -> set[str]:
        cached = self.__dict__.get("_input_set_cache")
        if cached is None:
            cached = set(self.graph_inputs)
            self.__dict__["_input_set_cache"] = cached
        return cached

    def is_input_name(self, value: str) -> bool:
        """True when ``value`` is listed as a graph input (initializer or not)."""
        return value in self._input_set

    @property
    def state_names(self) -> set[str]:
        """Graph inputs and initializers: the names a state output can be the next value of."""
        cached = self.__dict__.get("_state_names_cache")
        if cached is None:
            cached = self._input_set | set(self.initializers)
            self.__dict__["_state_names_cache"] = cached
        return cached

    def is_output_name(self, value: str) -> bool:
        """True when ``value`` is a graph output of the main graph."""
        return value in self._output_set

    def is_used(self, value: str) -> bool:
        """True when a node, a subgraph or a graph output reads ``value``."""
        return bool(self.consumers.get(value)) or value in self.subgraph_reads or value in self._output_set

    @property
    def _output_set(self) -> set[str]:
        cached = self.__dict__.get("_output_set_cache")
        if cached is None:
            cached = set(self.graph_outputs)
            self.__dict__["_output_set_cache"] = cached
        return cached


def build_index(model: onnx.ModelProto, *, infer_shapes: bool = True) -> GraphIndex:
    """Index ``model.graph`` in one sweep.

    Shapes and dtypes come from the graph's declarations and, when ``infer_shapes``, from ONNX shape
    inference run on the model with initializer data stripped (so no weight bytes are copied or read).
    Inference is skipped when it could add nothing (:func:`_inference_adds_nothing`: every value already has
    a declared shape and there is no subgraph). Inference failures are logged and tolerated: unknown shapes
    only make the matcher more careful. For a large graph inference runs in a forked child beside the rest
    of the index (:class:`_ForkedInference`; the same result, else it runs here as before; ``$SGDFUSE_INFERENCE_FORK=0``
    keeps it here).

    Raises:
        ModelNameError: a name :func:`require_text_names` refuses (a value's, a node's, an attribute's, an op
            type, a domain, the model's own strings), named by what carries it (a node by position and op type).
        GraphCycleError, DuplicateValueError: the graph is not a valid ONNX graph.
    """
    # One serialisation of the model serves the node table, the declared value infos and, when no
    # initializer needs stripping, shape inference (which would serialise it again); without the native
    # scanners every one of them is read through protobuf's Python API as before.
    data = _serialised(model) if native_available() else None
    # Inference starts now, in a child process where one can be forked (_ForkedInference), and runs beside
    # the rest of the index; its result is read where it is needed, below, if it is the one wanted.
    child = _ForkedInference.start(model, data) if infer_shapes else None
    try:
        return _index(model, data, infer_shapes, child)
    finally:
        if child is not None:
            child.close()


def _index(model: onnx.ModelProto, data: bytes | None, infer_shapes: bool, child: "_ForkedInference | None") -> GraphIndex:
    """:func:`build_index` of ``model`` (``data``: its bytes, None to read it through protobuf; ``child``:
    inference running in a child process, or None)."""
    graph = model.graph
    nodes, own_node_names, non_text_name = _nodes_read(model, data)
    producer, consumers, subgraph_reads, subgraph_nodes, holders, text = _sweep(graph, nodes)
    in_order = _require_acyclic(nodes, producer, consumers)
    if not text:  # the native sweep checked them as it read them (sweep_nodes)
        _require_text_names(graph, nodes, producer, consumers)
    # A node's or an attribute's name, as check and lower refuse it (require_text_names): the rewrite copies
    # the node into its output, which onnxruntime and lowering then fail on.
    op_type_of = lambda k: nodes[k][0]
    _require_node_names(graph, non_text_name, op_type_of)
    # The same names in every graph nested in it (If branches, Loop/Scan bodies) and in the model's functions.
    _require_nested_names(model, holders, op_type_of)
    _require_model_text(model)
    specs: dict[str, TensorSpec] = {}
    types: dict[bytes, tuple | None] = {}
    declared = _scanned(data, INPUT | OUTPUT | VALUE_INFO, len(graph.node))
    if declared is None:
        _add_specs(specs, graph.input, types)
        _add_specs(specs, graph.output, types)
        _add_specs(specs, graph.value_info, types)
    else:
        for slot in range(3):
            _add_scanned_specs(specs, declared.names[slot], declared.type_ids[slot], declared.types, types)
    initializers = {t.name: t for t in graph.initializer}
    if infer_shapes and not _inference_adds_nothing(graph, specs, producer, initializers, subgraph_nodes):
        data_propagation = _needs_data_propagation(model, nodes, producer, subgraph_nodes)
        # The child's bytes are what the call here returns when it would run as the child did: on the same
        # bytes, without data propagation, for a graph without subgraphs (whose value infos are scanned).
        wanted = child is not None and not data_propagation and not subgraph_nodes
        result = child.result() if wanted else None
        if result is not None:
            inferred = _read_inferred(model, subgraph_nodes, result)
        else:  # no child, another run wanted, or the child failed: here, as before
            inferred = _inferred_value_infos(model, subgraph_nodes, data, data_propagation=data_propagation)
        _add_inferred(specs, inferred, types)
        _return_freed_heap()
    for name, tensor in initializers.items():
        specs[name] = TensorSpec(name, tuple(int(d) for d in tensor.dims), tensor.data_type)

    graph_inputs = [i.name for i in graph.input]
    graph_outputs = [o.name for o in graph.output]
    for names, role in ((initializers, "an initializer"), (graph_inputs, "a graph input"), (graph_outputs, "a graph output")):
        _require_text(names, role)
    return GraphIndex(
        graph=graph,
        producer=producer,
        consumers=consumers,
        initializers=initializers,
        graph_inputs=graph_inputs,
        graph_outputs=graph_outputs,
        specs=specs,
        subgraph_reads=subgraph_reads,
        subgraph_nodes=subgraph_nodes,
        nodes=nodes,
        own_node_names=own_node_names,
        in_order=in_order,
    )


def _return_freed_heap() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``; nothing elsewhere).

    ONNX shape inference builds its own C++ copy of the model and frees it on return (at 50,000 updates about
    430 MB, more than the parsed model). glibc keeps freed heap for reuse, but the Python objects the passes make
    next live in the interpreter's own arenas, so without this the freed inference heap stays resident and adds
    to the peak of every later stage (measured: the peak of ``optimize --no-verify`` at 50,000 updates went
    from 1,403 to 1,347 MB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` (ctypes), None where the C library has none (musl, macOS, Windows)."""
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _inference_adds_nothing(
    graph: onnx.GraphProto, specs: dict[str, TensorSpec], producer: dict[str, int], initializers: dict[str, onnx.TensorProto], subgraph_nodes: list[int]
) -> bool:
    """True when ONNX shape inference cannot change ``specs`` (the declared ones): there is no subgraph (whose
    value infos it would add) and every name it could report has a declared shape already or is an
    initializer.

    Inference reports, in the main graph's ``value_info``, the declared value infos (refined in place) and one
    entry per node output it types that is declared nowhere (onnx/shape_inference/implementation.cc: a
    declared type is merged, an undeclared one added). :func:`_add_specs` keeps the first spec with a shape,
    and an initializer's own spec replaces any: so when every node output and every declared value info
    already has a shape (or is an initializer), nothing inferred is taken, and running it would only cost
    time and memory (the C++ pass holds many times the model's size)."""
    if subgraph_nodes:
        return False
    for names in (producer, (info.name for info in graph.value_info)):
        for name in names:
            known = specs.get(name)
            if (known is None or known.shape is None) and name not in initializers:
                return False
    return True


def _node_facts(model: onnx.ModelProto, data: bytes | None = None) -> list[NodeFacts]:
    """:data:`NodeFacts` of every node of the main graph, in order, read once (natively where the scanner
    builds: :func:`sgdfuse.passes.scan.node_table`, from ``data``, ``model`` serialised, when given)."""
    return _nodes_read(model, data)[0]


def _nodes_read(model: onnx.ModelProto, data: bytes | None = None) -> tuple[list[NodeFacts], frozenset[str], int]:
    """:func:`_node_facts`, the node names that start with :data:`OWN_PREFIX` (read in the same pass), and
    :attr:`NodeTable.non_text_name` (-1 when every node's and attribute's name is text)."""
    table = node_table(model, data, name_prefix=OWN_PREFIX)
    facts = list(zip(table.op_types, table.domains, table.inputs, table.outputs, table.has_subgraph, table.has_attributes))
    return facts, frozenset(table.prefixed_names or ()), table.non_text_name


_GRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _sweep_nodes(graph: onnx.GraphProto, nodes: list[NodeFacts]) -> tuple[dict[str, int], dict[str, list[int]], set[str], list[int], list[int]]:
    """Producer, consumers, outer-scope reads of subgraphs and the nodes holding subgraphs (GraphIndex), from
    the node facts of ``graph`` (its protobuf is read only for the subgraphs), and last the nodes whose facts
    say they hold one (an attribute typed GRAPH or GRAPHS, or a ``g`` or ``graphs`` field: those whose names
    :func:`_require_nested_names` reads)."""
    return _sweep(graph, nodes)[:5]


def _sweep(graph: onnx.GraphProto, nodes: list[NodeFacts]) -> tuple[dict[str, int], dict[str, list[int]], set[str], list[int], list[int], bool | None]:
    """:func:`_sweep_nodes`, and whether every op type, domain and non-empty name of a node is a ``str`` (None
    when not looked at: without the native sweep)."""
    if native_available():
        producer, consumers, holders, defined, text = value_scan.sweep_nodes(nodes)  # the loop below, natively
    else:
        producer, consumers, holders, defined = _sweep_python(nodes)
        text = None
    subgraph_reads: set[str] = set()
    subgraph_nodes: list[int] = []
    for index in holders:  # an attribute typed GRAPH or GRAPHS; one holding no graph reads nothing
        held = False
        for attribute in graph.node[index].attribute:
            for sub in _subgraphs(attribute):
                subgraph_reads.update(_outer_reads(sub))
                held = True
        if held:
            subgraph_nodes.append(index)
    if defined != len(producer):
        _raise_defined_twice(graph, nodes)
    return producer, consumers, subgraph_reads, subgraph_nodes, holders, text


def _sweep_python(nodes: list[NodeFacts]) -> tuple[dict[str, int], dict[str, list[int]], list[int], int]:
    """:func:`sgdfuse.passes.value_scan.sweep_nodes` in Python (where the scanner does not build): producer,
    consumers, the nodes whose facts say they hold a subgraph, and the number of non-empty output names."""
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    holders: list[int] = []
    readers_of = consumers.get
    defined = 0
    for index, (_, _, inputs, outputs, subgraph, _) in enumerate(nodes):
        for name in outputs:
            if name:
                producer[name] = index
                defined += 1
        for name in inputs:
            if name:
                readers = readers_of(name)
                if readers is None:
                    consumers[name] = [index]
                else:
                    readers.append(index)
        if subgraph:
            holders.append(index)
    return producer, consumers, holders, defined


def _raise_defined_twice(graph: onnx.GraphProto, nodes: list[NodeFacts]) -> None:
    """Raise :class:`~sgdfuse.errors.DuplicateValueError` for the first value two nodes output."""
    first: dict[str, int] = {}
    for k, facts in enumerate(nodes):
        for name in facts[3]:
            if name and name in first:
                label = lambda j: graph.node[j].name or f"#{j} ({nodes[j][0]})"
                raise DuplicateValueError(name, label(first[name]), label(k))
            if name:
                first[name] = k


def _require_acyclic(nodes: list[NodeFacts], producer: dict[str, int], consumers: dict[str, list[int]]) -> bool:
    """Raise :class:`~sgdfuse.errors.GraphCycleError` when the main graph's nodes form a cycle; return whether
    they are in topological order (True) or merely out of it (False). A graph whose
    every read comes after its value's producer (ONNX requires that order) has none: one pass over the
    readers' lists (each in node order, so its first entry is its earliest reader). Only a graph out of
    that order is sorted (Kahn's algorithm) to find out: a graph merely out of order is accepted (the
    rewrite writes it sorted); the walks of the matcher would not end on a cycle."""
    get = producer.get
    if all(readers[0] > get(name, -1) for name, readers in consumers.items()):
        return True
    pending = [0] * len(nodes)
    for name, readers in consumers.items():
        if name in producer:
            for k in readers:
                pending[k] += 1
    ready = [k for k, count in enumerate(pending) if count == 0]
    done = 0
    while ready:
        k = ready.pop()
        done += 1
        for name in nodes[k][3]:
            for reader in consumers.get(name, ()) if name else ():
                pending[reader] -= 1
                if pending[reader] == 0:
                    ready.append(reader)
    if done < len(nodes):
        # A node left is on a cycle or after one; walking back through producers left too ends on the cycle.
        k = next(k for k, count in enumerate(pending) if count > 0)
        seen: set[int] = set()
        while k not in seen:
            seen.add(k)
            k = next(producer[name] for name in nodes[k][2] if name in producer and pending[producer[name]] > 0)
        raise GraphCycleError(next((o for o in nodes[k][3] if o), f"node #{k}"))
    return False


def _require_text_names(graph: onnx.GraphProto, nodes: list[NodeFacts], producer: dict, consumers: dict) -> None:
    """Raise :class:`~sgdfuse.errors.ModelNameError` for the first name of the main graph that is not valid
    UTF-8 (protobuf hands it out as ``bytes``) among the values nodes read and write: one pass over the keys of
    the tables just built, a few milliseconds per 100,000 names. Graph inputs, outputs and initializers are
    checked as their tables are made (:func:`_require_text`), value infos where they are read
    (:func:`_add_specs`)."""
    for table, role in ((producer, "an output"), (consumers, "an input")):
        if not all(type(name) is str for name in table):
            name = next(name for name in table if type(name) is not str)
            k = producer[name] if role == "an output" else consumers[name][0]
            node = graph.node[k]
            label = node.name if type(node.name) is str and node.name else f"#{k} ({nodes[k][0]})"
            raise ModelNameError(name, f"{role} of node {label}")
    for k, (op_type, domain, *_) in enumerate(nodes):
        if type(op_type) is not str or type(domain) is not str:
            raise ModelNameError(op_type if type(op_type) is not str else domain, f"the {'op type' if type(op_type) is not str else 'domain'} of node #{k}")


def require_text_names(model: onnx.ModelProto, *, table: NodeTable | None = None) -> None:
    """Check that every name of ``model``'s main graph is valid UTF-8: the values its nodes read and write, its
    graph inputs, outputs, initializers, value infos, nodes (a node's name becomes a GE op's) and attributes, op
    types and domains of the nodes, and the model's own strings (protobuf hands a ``string`` field holding other bytes
    out as ``bytes``, which onnxruntime, onnx's checker and every name table here then fail on). For commands
    that read a model without indexing it first (``check``, ``lower`` of a fused model); :func:`build_index`
    checks the same names as it reads them (``optimize`` and ``inspect`` refuse what ``check`` and ``lower`` do).

    ``table``: ``node_table(model)``, when the caller has it (it is then not read again; made with
    ``name_prefix=""``, its names are those of the nodes).

    Raises:
        ModelNameError: the first such name, with what carries it.
    """
    graph = model.graph
    _require_model_text(model)
    if table is None:
        table = node_table(model)
    _require_text(table.op_types, "a node's op type")
    _require_text(table.domains, "a node's domain")
    for names_per_node, role in ((table.outputs, "an output"), (table.inputs, "an input")):
        for k, names in enumerate(names_per_node):
            if not all(type(name) is str for name in names):
                label = graph.node[k].name if type(graph.node[k].name) is str and graph.node[k].name else f"#{k} ({table.op_types[k]})"
                raise ModelNameError(next(name for name in names if type(name) is not str), f"{role} of node {label}")
    for values, role in ((graph.input, "a graph input"), (graph.output, "a graph output"), (graph.initializer, "an initializer"),
                         (graph.value_info, "a value info")):
        _require_text([value.name for value in values], role)
    op_type_of = table.op_types.__getitem__
    _require_node_names(graph, table.non_text_name, op_type_of)
    holders = [k for k, held in enumerate(table.has_subgraph) if held] if True in table.has_subgraph else ()
    _require_nested_names(model, holders, op_type_of)


def _require_nested_names(model: onnx.ModelProto, holders, op_type_of) -> None:
    """Raise :class:`~sgdfuse.errors.ModelNameError` for the first name that is not text in a graph nested in
    the model: the subgraphs (attributes ``g`` and ``graphs``: ``If`` branches, ``Loop`` and ``Scan`` bodies, at
    any depth) of the main graph's nodes ``holders`` (those the node table marks as holding one), and the
    model-local functions' bodies. Each is held to what the main graph is: its name, its inputs, outputs,
    initializers and value infos, and its nodes' names, op types, domains, inputs, outputs and attribute
    names; onnxruntime decodes them all and the rewrite copies them into its output.

    Each nested graph's nodes are read by the native node scanner (:func:`graph_node_table`, about 2 us a node;
    protobuf's Python API took 12); only a graph it flags is read again through protobuf, to name the node.
    Nothing is read for a model without subgraphs or functions.
    ``op_type_of``: the op type of the main graph's node at a position (for the error's label)."""
    _require_subgraphs_text(model.graph.node, holders, lambda k: f"node #{k} ({op_type_of(k)})")
    for j, function in enumerate(model.functions):  # a few small bodies (the SGD op's own, in a fused model)
        where = f"model function #{j}"
        _require_text([function.name, function.domain, function.overload], f"the name or domain of {where}")
        label = f"{where} ({function.domain}::{function.name})"
        for names, role in ((function.input, "an input"), (function.output, "an output"), (function.attribute, "an attribute")):
            _require_text(names, f"{role} of {label}")
        _require_text([info.name for info in function.value_info], f"a value info of {label}")
        _require_nodes_text(function.node, f"the body of {label}")
        _require_subgraphs_text(function.node, range(len(function.node)), lambda k: f"node #{k} ({function.node[k].op_type}) in the body of {label}")


def _require_subgraphs_text(nodes, positions, label_of) -> None:
    """:func:`_require_graph_text` for every graph held by the node at each of ``positions`` in ``nodes``;
    ``label_of``: a node's label by its position (for the error)."""
    for k in positions:
        for attribute in nodes[k].attribute:
            for sub in _held_graphs(attribute):
                _require_graph_text(sub, f"the {attribute.name} of {label_of(k)}")


def _require_graph_text(graph: onnx.GraphProto, where: str) -> None:
    """:func:`_require_nested_names` for one nested ``graph`` and the graphs nested in it; ``where``: what
    holds it (for the error)."""
    _require_text([graph.name], f"the name of {where}")
    for values, role in ((graph.input, "a graph input"), (graph.output, "a graph output"), (graph.initializer, "an initializer"),
                         (graph.sparse_initializer, "a sparse initializer"), (graph.value_info, "a value info")):
        if values:
            names = [value.values.name for value in values] if role == "a sparse initializer" else [value.name for value in values]
            _require_text(names, f"{role} of {where}")
    table = graph_node_table(graph)
    text = table.non_text_name < 0 and all(type(name) is str for name in table.op_types) and all(type(name) is str for name in table.domains)
    if not (text and all(type(name) is str for names in table.inputs for name in names)
            and all(type(name) is str for names in table.outputs for name in names)):
        _require_nodes_text(graph.node, where)
    if True in table.has_subgraph:
        nodes = graph.node
        _require_subgraphs_text(nodes, [k for k, held in enumerate(table.has_subgraph) if held], lambda k: f"node #{k} ({nodes[k].op_type}) in {where}")


def _require_nodes_text(nodes, where: str) -> None:
    """Raise :class:`~sgdfuse.errors.ModelNameError` for the first name of ``nodes`` (a nested graph's or a
    function's, ``where``) that is not text: a node's op type, domain, name, input, output or attribute name
    (their subgraphs are :func:`_require_subgraphs_text`'s)."""
    for j, node in enumerate(nodes):
        attributes = node.attribute
        if all(type(name) is str for name in (node.op_type, node.domain, node.name, *node.input, *node.output, *(a.name for a in attributes))):
            continue
        _require_text([node.op_type, node.domain], f"the op type or domain of node #{j} in {where}")
        label = f"node #{j} ({node.op_type}) in {where}"
        _require_text([node.name], f"the name of {label}")
        _require_text(node.input, f"an input of {label}")
        _require_text(node.output, f"an output of {label}")
        _require_text([a.name for a in attributes], f"an attribute of {label}")


def _held_graphs(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    """Every graph ``attribute`` holds, whatever its ``type`` says (the fields ``g`` and ``graphs``, as the node
    scanner's ``has_subgraph``): a graph the type hides is still in the model the rewrite writes."""
    return ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)


def _require_node_names(graph: onnx.GraphProto, k: int, op_type_of) -> None:
    """Raise :class:`~sgdfuse.errors.ModelNameError` naming node ``k`` by its position and op type when its
    name or one of its attributes' names is not text; ``k``: :attr:`NodeTable.non_text_name` (-1: none);
    ``op_type_of``: the op type of the node at a position."""
    if k >= 0:
        node = graph.node[k]
        _require_text([node.name], f"the name of node #{k} ({op_type_of(k)})")
        # onnxruntime decodes every attribute name (it failed with four lines of its own first)
        _require_text([a.name for a in node.attribute], f"an attribute of node #{k} ({op_type_of(k)})")


def _require_model_text(model: onnx.ModelProto) -> None:
    """The model's own strings (``producer_name``, ``producer_version``, ``domain``, the graph's name, the opset
    domains) are text: the rewrite copies them into its output (found by a fresh trial: a producer name in other
    bytes stopped ``optimize`` with an internal error)."""
    for value, role in ((model.producer_name, "the model's producer_name"), (model.producer_version, "the model's producer_version"),
                        (model.domain, "the model's domain"), (model.graph.name, "the graph")):
        if type(value) is not str:
            raise ModelNameError(value, role)
    _require_text([o.domain for o in model.opset_import], "an opset import's domain")


def _require_text(names, role: str) -> None:
    """Raise :class:`~sgdfuse.errors.ModelNameError` for the first of ``names`` that is not ``str``."""
    if not all(type(name) is str for name in names):
        raise ModelNameError(next(name for name in names if type(name) is not str), role)


def _add_specs(specs: dict[str, TensorSpec], infos, types: dict[bytes, tuple | None]) -> None:
    """Add the tensor types of ``infos`` to ``specs``: the first spec with a shape wins (declarations are
    added before inference). ``types`` caches each distinct serialised type's (shape, dtype): a training
    graph has tens of thousands of values but a few dozen types, and equal shapes are then one tuple."""
    known_spec = specs.get
    cached = types.get
    for info in infos:
        name = info.name
        if type(name) is not str:
            raise ModelNameError(name, "a value info")
        known = known_spec(name)
        if known is not None and known.shape is not None:
            continue
        type_proto = info.type
        key = type_proto.SerializeToString()
        found = cached(key, _UNREAD)
        if found is _UNREAD:
            found = types[key] = tensor_type_of(type_proto)
        if found is not None:
            name = sys.intern(name)
            specs[name] = TensorSpec(name, found[0], found[1])


def _serialised(model: onnx.ModelProto) -> bytes | None:
    """``model.SerializeToString()``, or None when protobuf refuses (a model over its 2 GB limit): then every
    reader falls back to protobuf's Python API, as without the scanners."""
    try:
        return model.SerializeToString()
    except Exception as error:  # protobuf raises ValueError (upb) or EncodeError past 2 GB
        logger.debug("the model does not serialise (%s); reading it through protobuf", error)
        return None


def _scanned(data: bytes | None, fields: int, node_count: int) -> ScannedInfos | None:
    """The value infos in ``fields`` of the serialised model ``data`` (:func:`sgdfuse.passes.value_scan.scan_value_infos`),
    or None when there are no bytes, the scanner refuses them (then protobuf reads the model, as before), or
    they hold another number of nodes than ``node_count`` (the model they were taken for)."""
    if data is None:
        return None
    try:
        scanned = scan_value_infos(data, fields)
    except ScanError as error:
        logger.debug("native value-info scanner refused the bytes, reading value infos through protobuf: %s", error)
        return None
    return scanned if scanned.node_count == node_count else None


def _add_scanned_specs(specs: dict[str, TensorSpec], names: list[str], type_ids: list[int], type_bytes: list[bytes], types: dict[bytes, tuple | None]) -> None:
    """:func:`_add_specs` for scanned value infos: ``names[i]`` has the type serialised in ``type_bytes[type_ids[i]]``
    (:class:`~sgdfuse.passes.value_scan.ScannedInfos`), the same first-spec-with-a-shape rule and the same
    ``types`` cache (keyed by bytes that parse to the type: a scanned type's bytes and its canonical
    serialisation both map to one entry, so equal shapes stay one tuple)."""
    found_of: list[tuple | None] = []
    for raw in type_bytes:
        found = types.get(raw, _UNREAD)
        if found is _UNREAD:
            type_proto = onnx.TypeProto.FromString(raw)
            canonical = type_proto.SerializeToString()
            found = types.get(canonical, _UNREAD)
            if found is _UNREAD:
                found = types[canonical] = tensor_type_of(type_proto)
            types[raw] = found
        found_of.append(found)
    if native_available():
        value_scan.add_specs(specs, names, type_ids, found_of, TensorSpec)  # the loop below, natively
        return
    known_spec = specs.get
    for name, type_id in zip(names, type_ids):
        known = known_spec(name)
        if known is not None and known.shape is not None:
            continue
        found = found_of[type_id]
        if found is not None:
            specs[name] = TensorSpec(name, found[0], found[1])  # the scanner's names are interned


def _add_inferred(specs: dict[str, TensorSpec], inferred: list[onnx.ValueInfoProto] | ScannedInfos, types: dict[bytes, tuple | None]) -> None:
    """Add inference's value infos (:func:`_inferred_value_infos`), parsed or scanned, as :func:`_add_specs`."""
    if isinstance(inferred, ScannedInfos):
        # Inference writes what it finds of a graph output into the output itself, not a value info: an
        # output declared without a shape gets its shape there (the declared shapes still come first).
        for slot in (2, 1):
            if inferred.names[slot]:
                _add_scanned_specs(specs, inferred.names[slot], inferred.type_ids[slot], inferred.types, types)
    else:
        _add_specs(specs, inferred, types)


_UNREAD = object()
"""A type not yet in the cache of :func:`_add_specs` (None there is a type that is not a tensor's)."""


def tensor_type_of(type_proto: onnx.TypeProto) -> tuple[tuple[int | str | None, ...] | None, int] | None:
    """``(shape, dtype)`` of a tensor type in :class:`~sgdfuse.contract.TensorSpec` terms (``TypeProto.tensor_type``:
    ``elem_type``, and per ``shape.dim`` its ``dim_value``, ``dim_param`` or None; shape None without a
    ``shape`` field), None for other types."""
    if not type_proto.HasField("tensor_type"):
        return None
    tensor_type = type_proto.tensor_type
    shape: tuple[int | str | None, ...] | None = None
    if tensor_type.HasField("shape"):
        dims: list[int | str | None] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        shape = tuple(dims)
    return shape, tensor_type.elem_type


def _inferred_value_infos(
    model: onnx.ModelProto, subgraph_nodes: list[int], data: bytes | None = None, *, data_propagation: bool = True
) -> list[onnx.ValueInfoProto] | ScannedInfos:
    """The value infos ONNX shape inference finds for ``model`` (main graph and every subgraph); empty when
    it fails. ``subgraph_nodes`` are the main graph's nodes that hold subgraphs (inference keeps the order);
    ``data`` is ``model`` serialised, when the caller has it; ``data_propagation`` is inference's
    ``data_prop`` option (off only where it cannot change the result: :func:`_needs_data_propagation`).

    Without subgraphs, and where the native scanner builds, the inferred model's bytes are not parsed: the
    main graph's value infos are scanned from them (:class:`~sgdfuse.passes.value_scan.ScannedInfos`, the same
    names and types; parsing the inferred model and reading every value info through protobuf's Python API
    cost about four times the scan). Otherwise the parsed value infos."""
    try:
        data, refusal = _inference_input(model, data)
        if refusal is not None:
            logger.debug("inference runs on the whole model: the stripper refused its bytes (%s)", refusal)
        # What onnx.shape_inference.infer_shapes runs on the bytes it serialises, before parsing the result.
        result = onnx.shape_inference.C.infer_shapes(data, False, False, data_propagation)  # check_type, strict_mode, data_prop
    except Exception as error:  # inference is advisory; the matcher treats unknown shapes as unproven
        logger.warning("shape inference failed, continuing with declared shapes only: %s", error)
        return []
    return _read_inferred(model, subgraph_nodes, result)


def _inference_input(model: onnx.ModelProto, data: bytes | None) -> tuple[bytes, ScanError | None]:
    """The bytes :func:`_inferred_value_infos` runs inference on (``model`` without its large initializers'
    data, :func:`_stripped`, and without node names and metadata, :func:`~sgdfuse.passes.value_scan.inference_bytes`,
    where the stripper builds), and the stripper's refusal (then the names are kept), or None."""
    stripped = _stripped(model)
    if data is None or stripped is not model:
        data = stripped.SerializeToString()
    if native_available():
        try:
            return inference_bytes(data), None  # without node names and metadata: the same types, less to parse and copy
        except ScanError as error:
            return data, error
    return data, None


def _read_inferred(model: onnx.ModelProto, subgraph_nodes: list[int], result: bytes | bytearray) -> list[onnx.ValueInfoProto] | ScannedInfos:
    """The value infos in ``result``, the bytes ONNX shape inference returned for ``model``
    (:func:`_inferred_value_infos`): scanned where the scanner builds and there is no subgraph, else parsed;
    empty (with a warning) when they do not parse."""
    try:
        if not subgraph_nodes and native_available():
            scanned = _scanned(result, VALUE_INFO | OUTPUT, len(model.graph.node))  # inference adds and moves no node
            if scanned is not None:
                return scanned
        inferred = onnx.load_from_string(bytes(result))
    except Exception as error:  # inference is advisory; the matcher treats unknown shapes as unproven
        logger.warning("shape inference failed, continuing with declared shapes only: %s", error)
        return []
    same_nodes = len(inferred.graph.node) == len(model.graph.node)  # inference adds and moves no node
    return _value_infos(inferred, subgraph_nodes if same_nodes else None)


FORK_MIN_NODES = 20_000
"""Graphs with at least this many nodes have shape inference run in a forked child (:class:`_ForkedInference`);
below it the fork and the copy of its result cost about what the overlap saves."""

FORK_ENV = "SGDFUSE_INFERENCE_FORK"
"""``0`` in this environment variable keeps shape inference in-process (no child is forked; the same result)."""


class _ForkedInference:
    """ONNX shape inference for :func:`build_index`, run in a child process (``os.fork``) from the start of the
    index, while the parent builds the rest of it: the inference :func:`_inferred_value_infos` runs
    (:func:`_inference_input`, then ``onnx.shape_inference.C.infer_shapes``) on the same bytes, in a copy of
    the same process, without data propagation, so the child's result is byte for byte what the parent would
    get whenever it would run it so (:func:`_needs_data_propagation` false, no subgraph: the caller checks
    both, and otherwise stops the child and runs inference itself, as before). The child sends the result
    back through a pipe (length first) and exits. At 50,000 updates inference is 2.3 s of the index's 4 s, and
    the node table, the sweep and the declared specs (1.5 s) overlap it on a second core.

    Forked only where that is safe and pays: on Linux, for a graph of at least :data:`FORK_MIN_NODES` nodes,
    from a process whose only Python thread is the running one (:func:`_single_threaded`). :meth:`result` is
    None whenever the child did not return a whole result the clean way (no fork, the stripper refused the
    bytes, inference raised, the child died or was killed): the caller then runs inference in-process, as
    without the child, so every warning and every result is what it was."""

    def __init__(self, pid: int, reader: int):
        self.pid = pid
        self.reader = reader
        self.status: int | None = None

    @classmethod
    def start(cls, model: onnx.ModelProto, data: bytes | None) -> "_ForkedInference | None":
        """The child running inference for ``model`` (``data``: its bytes), or None where none is forked."""
        if (data is None or len(model.graph.node) < FORK_MIN_NODES or os.environ.get(FORK_ENV, "").strip() == "0"
                or not sys.platform.startswith("linux")
                or not hasattr(os, "fork") or not native_available() or not _single_threaded()):
            return None
        try:
            reader, writer = os.pipe()
        except OSError:
            return None
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns of forking beside native threads (see _single_threaded)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as error:
            logger.debug("shape inference runs in-process: fork failed (%s)", error)
            os.close(reader)
            os.close(writer)
            return None
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(reader)
                code = _infer_to(writer, model, data)
            finally:
                os._exit(code)
        os.close(writer)
        return cls(pid, reader)

    def result(self) -> bytearray | None:
        """The bytes inference returned in the child (waiting for them), or None when it gave none."""
        try:
            head = self._read(8)
            if head is None:
                return None
            size = int.from_bytes(head, "little")
            body = self._read(size)
        finally:
            self._reap()
        return body if self.status == 0 and body is not None else None

    def _read(self, size: int) -> bytearray | None:
        buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            try:
                count = os.readv(self.reader, [view[done:]])
            except InterruptedError:
                continue
            if count == 0:
                return None  # the child ended before it wrote everything
            done += count
        return buffer

    def _reap(self) -> None:
        if self.status is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.status = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.status = -1

    def close(self) -> None:
        """Stop the child if it still runs (its result not wanted) and release it."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reap()
        if self.reader >= 0:
            os.close(self.reader)
            self.reader = -1


def _infer_to(writer: int, model: onnx.ModelProto, data: bytes) -> int:
    """In the child of :class:`_ForkedInference`: run inference as :func:`_inferred_value_infos` would without
    data propagation and write its result's length (8 bytes, little-endian) and bytes to ``writer``; the exit
    code (0 only when all is written; 1 where the parent must run inference itself, which then logs what
    happened)."""
    try:
        payload, refusal = _inference_input(model, data)
        if refusal is not None:
            return 1
        result = onnx.shape_inference.C.infer_shapes(payload, False, False, False)  # check_type, strict_mode, data_prop
        for part in (len(result).to_bytes(8, "little"), result):
            view = memoryview(part)
            while view:
                view = view[os.write(writer, view):]
        return 0
    except BaseException:
        return 1


_PARKED = (threading.Condition.wait.__code__, threading.Thread._wait_for_tstate_lock.__code__)
"""Where a Python thread waits in ``threading`` (``Event.wait``, ``Condition.wait``, ``Thread.join``): blocked
on a lock of its own, inside no code that a forked child of :class:`_ForkedInference` runs."""


def _single_threaded() -> bool:
    """True when every Python thread but the running one waits in ``threading`` (:data:`_PARKED`): the CLI's
    progress display (rich's refresh thread) does between its refreshes.

    A thread running elsewhere could be inside code the child runs (onnx's C++ inference, protobuf,
    sgdfuse's scanner) without the GIL, holding a lock that would stay held in the child forever. Native
    threads are not Python threads: numpy's BLAS pool and onnxruntime start idle workers on import, so every
    sgdfuse process has some; they run none of that code either (glibc's allocator takes its own locks
    across a fork)."""
    me = threading.get_ident()
    return all(ident == me or frame.f_code in _PARKED for ident, frame in sys._current_frames().items())


SHAPE_OPERANDS = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "AffineGrid": 1, "Resize": 3}
"""Default-domain ops whose type inference reads the value of an operand (by position) as a shape: the
only readers of what ONNX's data propagation computes (``getShapeInput`` in onnx/defs/shape_inference.cc
is the one caller of ``InferenceContext::getSymbolicInput``; it reads an initializer's or a ``Constant``'s
data first, the propagated value only for a computed operand)."""


def _needs_data_propagation(model: onnx.ModelProto, nodes: list[NodeFacts], producer: dict[str, int], subgraph_nodes: list[int]) -> bool:
    """Whether ONNX shape inference's data propagation (``data_prop``) can change what it infers for
    ``model``; when not, inference runs without it, at about 60 % of the cost.

    Data propagation (onnx/shape_inference/implementation.cc, ``Process``) runs an op's
    ``PartialDataPropagationFunction`` after its type inference and keeps the result (a value as a
    ``TensorShapeProto``) for later nodes; the only type inference that reads it is that of a
    :data:`SHAPE_OPERANDS` op for its shape operand. So it changes nothing when no such operand is computed
    by an op that has a data propagation function (``OpSchema.has_data_propagation_function``: Shape, Size,
    Gather, Concat, Slice, Squeeze, Unsqueeze, Cast, Add, Sub, Mul), and no inference runs through a body
    this reading cannot see. A model-local function's body is read by the same rule (inference runs it at
    each call, with the caller's propagated values bound to its inputs, so a shape operand that is a formal
    input counts as computed). It is kept, conservatively, for a model with subgraphs, for a node whose op
    has no inference function of its own (ONNX then infers through the op's function body:
    ``GroupNormalization``, ``GreaterOrEqual`` at opset 12), and for a default-domain op onnx does not know
    at the model's opset."""
    if subgraph_nodes:
        return True
    functions: dict[tuple[str, str], list[onnx.FunctionProto]] = {}
    for function in model.functions:  # every overload of a name (IR 10) is one body to read
        functions.setdefault((function.domain, function.name), []).append(function)
    schemas: dict[tuple[str, str, int], onnx.defs.OpSchema | None] = {}

    def schema(op: str, domain: str, versions: dict[str, int]) -> onnx.defs.OpSchema | None:
        version = versions.get("ai.onnx" if domain == "" else domain)
        key = (op, domain, version)
        if key not in schemas:
            try:
                schemas[key] = None if version is None else onnx.defs.get_schema(op, version, "" if domain == "ai.onnx" else domain)
            except (onnx.defs.SchemaError, TypeError, OverflowError):  # an opset version outside int32: unknown
                schemas[key] = None
        return schemas[key]

    def needs(rows, produced: dict[str, int], formal: frozenset[str], versions: dict[str, int], calling: frozenset) -> bool:
        for op, domain in {(row[0], row[1]) for row in rows}:
            called = functions.get((domain, op))
            if called is not None:
                if (domain, op) in calling or any(_body_needs(f, calling | {(domain, op)}) for f in called):
                    return True  # a recursive call included: nothing to reason about
                continue
            found = schema(op, domain, versions)
            if found is None:
                if domain in ("", "ai.onnx"):
                    return True  # an op onnx does not know here: no rule to read it by
                continue  # a custom op: inference types none of its outputs, with or without propagation
            if not found.has_type_and_shape_inference_function:
                return True
        for op, domain, inputs, *_ in rows:
            position = SHAPE_OPERANDS.get(op)
            if position is None or domain not in ("", "ai.onnx") or len(inputs) <= position or not inputs[position]:
                continue
            operand = inputs[position]
            if operand in formal:
                return True  # a function's input: the caller's propagated value is bound to it
            k = produced.get(operand)
            if k is None:
                continue  # a graph input or an initializer: its data, or nothing, either way
            maker = rows[k]
            if (maker[1], maker[0]) in functions:
                return True  # returned from a call: the body's propagated value comes back with it
            found = schema(maker[0], maker[1], versions)
            if found is None or found.has_data_propagation_function:
                return True
        return False

    def _body_needs(function: onnx.FunctionProto, calling: frozenset) -> bool:
        rows = [(n.op_type, n.domain, tuple(n.input), tuple(n.output)) for n in function.node]
        if any(a.type in _GRAPH_TYPES for n in function.node for a in n.attribute):
            return True
        produced = {name: k for k, row in enumerate(rows) for name in row[3] if name}
        own = {("ai.onnx" if o.domain == "" else o.domain): o.version for o in function.opset_import}
        return needs(rows, produced, frozenset(function.input), {**versions, **own}, calling)

    versions = {("ai.onnx" if o.domain == "" else o.domain): o.version for o in model.opset_import}
    return needs(nodes, producer, frozenset(), versions, frozenset())


def _stripped(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every initializer of more than :data:`SMALL_CONSTANT_ELEMENTS` elements replaced by a
    dataless one of its type and shape (a copy; ``model`` itself when there is none such)."""
    # Shape inference needs initializer shapes, not their bytes.
    if not any(_is_large(t) for t in model.graph.initializer):
        return model
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    for tensor in stripped.graph.initializer:
        _strip_data(tensor)
    return stripped


def _value_infos(inferred: onnx.ModelProto, subgraph_nodes: list[int] | None) -> list[onnx.ValueInfoProto]:
    """The value infos and outputs of ``inferred``'s main graph, then of its subgraphs; ``subgraph_nodes`` (the main
    graph's nodes that hold one; None: look at every node) saves a walk over the others."""
    infos = list(inferred.graph.value_info) + list(inferred.graph.output)  # an output's inferred shape is in the output
    # Value names are unique across scopes (SSA), so the types inferred inside If/Loop bodies join the
    # same table: the matcher reads If branches that select a first step.
    main = inferred.graph.node
    stack: list[onnx.GraphProto | None] = [None]  # None: the main graph
    while stack:
        graph = stack.pop()
        if graph is None:
            nodes = main if subgraph_nodes is None else [main[i] for i in subgraph_nodes]
        else:
            nodes = graph.node
        for node in nodes:
            for attribute in node.attribute:
                for sub in _subgraphs(attribute):
                    infos.extend(sub.value_info)
                    infos.extend(sub.output)
                    stack.append(sub)
    return infos


def _is_large(tensor: onnx.TensorProto) -> bool:
    return math.prod(tensor.dims) > SMALL_CONSTANT_ELEMENTS


def _strip_data(tensor: onnx.TensorProto) -> None:
    if not _is_large(tensor):
        return
    dims, dtype, name = list(tensor.dims), tensor.data_type, tensor.name
    tensor.Clear()
    tensor.name = name
    tensor.data_type = dtype
    tensor.dims.extend(dims)
    # An external reference to nothing: the shape is declared, no bytes are read.
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "__sgdfuse_stripped__"


def _subgraphs(attribute: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attribute.type == onnx.AttributeProto.GRAPH:
        return [attribute.g]
    if attribute.type == onnx.AttributeProto.GRAPHS:
        return list(attribute.graphs)
    return []


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads that it does not define itself (its outer-scope references)."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    reads: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                reads.add(name)
        for attribute in node.attribute:
            for sub in _subgraphs(attribute):
                reads.update(r for r in _outer_reads(sub) if r not in defined)
        defined.update(o for o in node.output if o)
    for output in graph.output:
        if output.name not in defined:
            reads.add(output.name)
    return reads
