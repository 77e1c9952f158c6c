"""The output guard at the cost of what the rewrite changed (docs/design.md, "Performance").

``optimize`` never returns a model that ``onnx.checker`` (full check) rejects because of sgdfuse. Running the
checker on the whole output costs as much as a load and a save again; this module proves the same verdict
from the parts that changed, and says why when it cannot (the caller then runs the full check):

1. Versions: every opset import and every model-local function of the input are kept; only the
   ``ai.sgdfuse`` import and its SGD functions are added; the IR version is kept or raised within 4 to 12,
   whose changes only add to what is valid.
2. Structure, over the whole output graph in one pass: every value is defined once (single assignment),
   every value a node or a subgraph reads is defined before it, every graph output is defined. This is what
   removing and reordering nodes can break.
3. The new nodes, by class: plans whose nodes are the same up to names, reading values of the same types
   (and the same small constants), are one class; one plan per class goes into a small model (its nodes,
   the functions they call, typed graph inputs for the values they read) that must pass the full check.
4. Every value a new node produces in place of an old one (the update's outputs) gets exactly the type the
   input's shape inference gave it, so the unchanged nodes reading it see what they saw in the input.

Unchanged nodes then read values of unchanged types in a valid order, so the checker's verdict on them is
the input's: whatever it rejects was already in the input, and sgdfuse made nothing invalid.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import onnx
from onnx import helper

from sgdfuse.fused_op import DOMAIN, OP_TYPE
from sgdfuse.passes.index import SMALL_CONSTANT_ELEMENTS, GraphIndex, _outer_reads, _subgraphs, tensor_type_of
from sgdfuse.passes import value_scan
from sgdfuse.passes.scan import NodeDetails, NodeTable, ScanError, native_available, native_structure, node_table, python_node_details

__all__ = ["unproven"]

logger = logging.getLogger(__name__)


def unproven(output: onnx.ModelProto, source: onnx.ModelProto, index: GraphIndex, plans: Sequence) -> str | None:
    """Why the rewrite of ``source`` into ``output`` is not proven to keep ``onnx.checker`` (full check)
    from finding anything new, or None when it is (steps 1-4 of this module's description).

    Args:
        output: the rewritten model (:func:`sgdfuse.passes.rewrite.apply_plans` of ``plans``).
        source: the model the plans were applied to; ``index`` is its :class:`GraphIndex`.
        plans: the applied :class:`~sgdfuse.passes.rewrite.Plan` s.

    Returns:
        None, or a short reason (for the log) why the caller must run the full check instead.
    """
    reason = _versions(output, source)
    if reason:
        return reason
    # The output serialised once for the native scanners: its nodes and its declared value infos are read there.
    data = _serialised(output)
    # The new nodes are found in the output by their first output (a name defined once there).
    wanted: list[str | None] = []
    sizes: list[int] = []
    for plan in plans:
        # The plans' own names (a replayed plan's from its template, its nodes not made: Plan.first_outputs).
        first = plan.first_outputs()
        sizes.append(len(first))
        wanted.extend(first)
    new = _natively(output, data, wanted, sizes) if data is not None and native_available() else None
    if new is None:
        new = _through_the_table(output, data, wanted, sizes)
    if isinstance(new, str):
        return new
    names = {t.name for plan in plans for t in plan.initializers}
    new_initializers = {t.name: t for t in output.graph.initializer if t.name in names}
    if len(new_initializers) != len(names):
        return "a planned initializer is not in the output"
    return _new_nodes(output, index, new, new_initializers, data)


@dataclasses.dataclass
class _NewNodes:
    """The plans' nodes as the output holds them: per plan, their positions and what the checker sees of them
    (:data:`~sgdfuse.passes.scan.GroupSummary`: from the native pass, or made here, either way equal exactly for
    nodes equal up to names); per position of a new node holding a subgraph, what each subgraph reads from outside
    (sorted)."""

    positions: list[list[int]]
    summaries: list[tuple]
    outer: dict[int, list[list[str]]]


def _outer_lists(graph: onnx.GraphProto, position: int) -> list[list[str]]:
    """Per subgraph of the node at ``position``, the names it reads from outside, sorted."""
    return [sorted(_outer_reads(sub)) for attribute in graph.node[position].attribute for sub in _subgraphs(attribute)]


def _natively(output: onnx.ModelProto, data: bytes, wanted: list[str | None], sizes: list[int]) -> _NewNodes | str | None:
    """Steps 2 and the finding of the new nodes in one native pass over ``data``
    (:func:`~sgdfuse.passes.scan.native_structure`, whose Python reference is :func:`_structure`): a reason, the
    new nodes, or None when the scanner refuses the bytes (then the table is read)."""
    graph = output.graph
    outer: dict[int, list[list[str]]] = {}

    def outer_of(position: int) -> list[list[str]]:
        outer[position] = lists = _outer_lists(graph, position)
        return lists

    try:
        scanned = native_structure(data, wanted, sizes, outer_of)
    except ScanError as error:
        logger.debug("native structure pass refused the output, reading its node table: %s", error)
        return None
    if scanned.error is not None:
        kind, names = scanned.error
        return _STRUCTURE_REASONS[kind](sorted(names)[0] if kind == "subgraph" else names[0])
    found = scanned.found
    if -1 in found:
        return "a planned node is not in the output"
    positions, first = [], 0
    for size in sizes:
        positions.append(found[first:first + size])
        first += size
    held = {found[k] for k, subgraph in enumerate(scanned.subgraph) if subgraph}
    return _NewNodes(positions, scanned.groups, {k: lists for k, lists in outer.items() if k in held})


_STRUCTURE_REASONS = {
    "read": lambda name: f"{name!r} is read before it is defined",
    "subgraph": lambda name: f"{name!r} is read by a subgraph before it is defined",
    "twice": lambda name: f"{name!r} is defined twice",
    "output": lambda name: f"graph output {name!r} is not defined",
}


def _through_the_table(output: onnx.ModelProto, data: bytes | None, wanted: list[str | None], sizes: list[int]) -> _NewNodes | str:
    """:func:`_natively` through the output's node table (:func:`_structure`, the reference) and protobuf."""
    table = node_table(output, data)
    by_name: dict[str, tuple[int, int]] = {}
    flat = 0
    for i, size in enumerate(sizes):
        for j in range(size):
            if wanted[flat] is not None:
                by_name[wanted[flat]] = (i, j)  # type: ignore[index]
            flat += 1
    found: dict[tuple[int, int], int] = {}
    reason = _structure(output.graph, table, by_name, found)
    if reason:
        return reason
    if len(found) != flat:
        return "a planned node is not in the output"
    positions = [[found[(i, j)] for j in range(size)] for i, size in enumerate(sizes)]
    ordered = sorted({k for plan in positions for k in plan})
    details = dict(zip(ordered, python_node_details(output, ordered)))
    summaries = [_summary(plan, table, details) for plan in positions]
    outer = {k: _outer_lists(output.graph, k) for k in ordered if table.has_subgraph[k]}
    return _NewNodes(positions, summaries, outer)


def _summary(positions: list[int], table: NodeTable, details: dict[int, NodeDetails]) -> tuple:
    """What :func:`~sgdfuse.passes.scan.native_structure` summarises of one plan's nodes (a
    :data:`~sgdfuse.passes.scan.GroupSummary`), from the node table and protobuf: per node its domain, op type,
    overload, attributes' bytes and numbers of inputs and outputs, then the pattern of names (the place each
    first stands in the sequence of every node's inputs then outputs, -1 for ``""``); the distinct names, their
    places, and whether the nodes output them."""
    inputs, outputs = table.inputs, table.outputs
    sequence: tuple[str, ...] = ()
    written: set[str] = set()
    parts: list = []
    for k in positions:
        sequence += inputs[k] + outputs[k]
        written.update(outputs[k])
        parts.append((table.domains[k], table.op_types[k], details[k], len(inputs[k]), len(outputs[k])))
    parts.append(tuple(-1 if not name else sequence.index(name) for name in sequence))
    places = [place for place, name in enumerate(sequence) if name and sequence.index(name) == place]
    names = tuple(sequence[place] for place in places)
    return tuple(parts), names, tuple(places), tuple(name in written for name in names)


def _versions(output: onnx.ModelProto, source: onnx.ModelProto) -> str | None:
    # IR versions 4 to 12 only add types, fields and message kinds and relax rules (the version history in
    # onnx.proto): what passes at one passes at a later one. The rewrite raises it to 8 or 10 at most.
    if output.ir_version != source.ir_version and not (4 <= source.ir_version < output.ir_version <= 12):
        return f"the IR version changed ({source.ir_version} to {output.ir_version})"
    before = [(o.domain, o.version) for o in source.opset_import]
    after = [(o.domain, o.version) for o in output.opset_import]
    if after[: len(before)] != before or any(domain != DOMAIN for domain, _ in after[len(before) :]):
        return "an opset import other than ai.sgdfuse changed"
    kept = len(source.functions)
    if len(output.functions) < kept or any(
        (f.domain, f.name, f.overload) != (g.domain, g.name, g.overload) for f, g in zip(source.functions, output.functions)
    ):
        return "the model-local functions of the input changed"
    if any((f.domain, f.name) != (DOMAIN, OP_TYPE) for f in output.functions[kept:]):
        return "a function other than ai.sgdfuse::SGD was added"
    return None


def _structure(graph: onnx.GraphProto, table: NodeTable, wanted: dict[str, tuple[int, int]], found: dict) -> str | None:
    """Single assignment and definition before use over the whole graph (one pass over its node table, the
    protobuf read only for subgraphs), collecting into ``found`` the positions of the nodes whose first output
    is a key of ``wanted`` (under its value)."""
    defined = {i.name for i in graph.input}
    defined.update(t.name for t in graph.initializer)
    defined.update(s.values.name for s in graph.sparse_initializer)
    defined.add("")  # an empty input name is an omitted optional input
    issuperset, isdisjoint, define = defined.issuperset, defined.isdisjoint, defined.update
    for position, (inputs, outputs, subgraph) in enumerate(zip(table.inputs, table.outputs, table.has_subgraph)):
        if not issuperset(inputs):  # set operations: this runs for every node of the graph
            name = next(n for n in inputs if n not in defined)
            return f"{name!r} is read before it is defined"
        if subgraph:
            for attribute in graph.node[position].attribute:
                for sub in _subgraphs(attribute):
                    missing = _outer_reads(sub) - defined
                    if missing:
                        return f"{sorted(missing)[0]!r} is read by a subgraph before it is defined"
        if not outputs:
            continue
        named = [name for name in outputs if name] if "" in outputs else outputs
        # (A set of the outputs only for nodes with several: most nodes have one.)
        if not isdisjoint(named) or (len(named) > 1 and len(set(named)) != len(named)):
            name = next(n for k, n in enumerate(named) if n in defined or n in named[:k])
            return f"{name!r} is defined twice"
        define(named)
        if outputs[0] in wanted:
            found[wanted[outputs[0]]] = position
    for value in graph.output:
        if value.name not in defined:
            return f"graph output {value.name!r} is not defined"
    return None


def _serialised(model: onnx.ModelProto) -> bytes | None:
    """``model`` serialised for the native scanners, or None without them (nothing is serialised then) or when
    protobuf refuses (past its 2 GB limit): the readers fall back to protobuf's Python API."""
    if not (native_available() or value_scan.native_available()):
        return None
    try:
        return model.SerializeToString()
    except Exception as error:  # protobuf raises ValueError (upb) or EncodeError past 2 GB
        logger.debug("the output does not serialise (%s); reading it through protobuf", error)
        return None


def _declarations(output: onnx.ModelProto, data: bytes | None, produced: set[str]) -> dict[str, tuple[bytes, ...]]:
    """Per name in ``produced`` that ``output.graph.value_info`` declares, the serialised types of its entries in
    order (natively: their bytes in ``data``; through protobuf: each type serialised again). Equal bytes are
    equal types."""
    scanned = None
    if data is not None and value_scan.native_available():
        try:
            scanned = value_scan.scan_value_infos(data, value_scan.VALUE_INFO)
        except ScanError as error:
            logger.debug("native value-info scanner refused the output, reading its value infos through protobuf: %s", error)
    declared: dict[str, tuple[bytes, ...]] = {}
    if scanned is not None and scanned.node_count == len(output.graph.node):
        types = scanned.types
        for name, number in zip(scanned.names[2], scanned.type_ids[2]):
            if name in produced:
                declared[name] = declared.get(name, ()) + (types[number],)
        return declared
    for info in output.graph.value_info:
        name = info.name
        if name in produced:
            declared[name] = declared.get(name, ()) + (info.type.SerializeToString(),)
    return declared


def _new_nodes(
    output: onnx.ModelProto, index: GraphIndex, new: _NewNodes, new_initializers: dict[str, onnx.TensorProto], data: bytes | None = None,
) -> str | None:
    """Steps 3 and 4: one plan (its new nodes, by position in ``output``, in order) per class checked in a small
    model. ``data``: the output serialised (:func:`_serialised`), or None."""
    classes: dict[tuple, list[int]] = {}
    read_keys: dict[str, tuple | str] = {}
    graph_nodes = output.graph.node
    # The output's value infos for what the new nodes produce: inference must give those types (strict mode).
    produced = {name for _, names, _, outputs in new.summaries for name, out in zip(names, outputs) if out}
    declared = _declarations(output, data, produced)
    outer = new.outer
    for positions, summary in zip(new.positions, new.summaries):
        outer_names = [name for k in positions if k in outer for names in outer[k] for name in names] if outer else ()
        key = _class_key(summary, outer_names, declared, index, new_initializers, read_keys)
        if isinstance(key, str):
            return key
        classes.setdefault(key, positions)
    representatives = [[graph_nodes[k] for k in positions] for positions in classes.values()]
    small, replaced = _small_model(output, index, representatives, new_initializers, declared)
    try:
        onnx.checker.check_model(small, full_check=True)
        inferred = onnx.shape_inference.infer_shapes(small, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        text = str(error).strip()
        return f"the rewritten nodes fail the check ({text.splitlines()[0] if text else type(error).__name__})"
    types = {info.name: _type_of(info) for info in inferred.graph.value_info if info.name in replaced}
    for name in replaced:
        spec = index.spec(name)
        if types.get(name) != (spec.dtype, spec.shape):
            return f"{name!r} is typed {types.get(name)} after the rewrite, {(spec.dtype, spec.shape)} before"
    logger.debug("output check: %d plans in %d classes", len(new.positions), len(representatives))
    return None


def _class_key(
    summary: tuple, outer_names: Sequence[str], declared: dict[str, tuple[bytes, ...]], index: GraphIndex,
    new_initializers: dict[str, onnx.TensorProto], read_keys: dict[str, tuple | str],
) -> tuple | str:
    """What the checker sees of one plan's nodes, with names replaced by the places they first stand: two plans
    with one key get one verdict. A reason string when a value read cannot be typed here.

    ``summary`` (:class:`_NewNodes`) holds the nodes' bytes but names (equal exactly for nodes equal up to a
    renaming that keeps ``""``) and their names; ``outer_names`` what their subgraphs read from outside (a
    subgraph keeps its names in its attribute's bytes: plans with one share a class only by name);
    ``declared`` the output's declarations of what the nodes produce (:func:`_declarations`). ``read_keys``
    caches :func:`_read_key` per name read by more than one plan's nodes: the initializers (a shared learning rate
    is read by many plans)."""
    nodes, names, places, outputs = summary
    key: list = [nodes]
    append = key.append
    producer, specs, initializers = index.producer, index.specs, index.initializers
    # The values read and produced, each once with the place it first stands: how the small model provides
    # what is read, and the types what is produced must have.
    named = zip(places, names, outputs)
    if outer_names:
        named = [*named, *((places[names.index(n)], n, outputs[names.index(n)]) if n in names else (n, n, False) for n in outer_names)]
    declared_get = declared.get
    for place, name, produced in named:
        if produced:
            if name in producer:  # an old value the plan now produces: its type must not change
                spec = specs.get(name)
                if spec is None or not spec.dtype:
                    return f"{name!r}, which the rewrite produces anew, had no known type"
                append(("replaced", place, spec.dtype, spec.shape))
            types = declared_get(name)
            if types is not None:
                append(("declared", place, types))
            continue
        if name in new_initializers or name in initializers:
            typed = read_keys.get(name)
            if typed is None:
                typed = read_keys[name] = _read_key(name, index, new_initializers)
        else:
            # _read_key's last case inlined (most reads: a plan's parameters, gradient and buffer): a typed
            # value of known dtype whose known element count is above SMALL_CONSTANT_ELEMENTS (then it is never
            # asked whether a Constant makes it); every other read through _read_key.
            spec = specs.get(name)
            typed = None
            if spec is not None and spec.dtype:
                count = spec.num_elements()
                if count is not None and count > SMALL_CONSTANT_ELEMENTS:
                    typed = ("typed", spec.dtype, spec.shape)
            if typed is None:
                typed = _read_key(name, index, new_initializers)
        if isinstance(typed, str):
            return typed
        append((place, typed))
    return tuple(key)



def _read_key(name: str, index: GraphIndex, new_initializers: dict[str, onnx.TensorProto]) -> tuple | str:
    """How the small model provides the value ``name`` a new node reads (a class-key part)."""
    if name in new_initializers:
        return ("new initializer", name)  # one tensor per name in the whole output
    tensor = index.initializers.get(name)
    if tensor is not None:
        if _small(tensor):
            return ("initializer", name, index.is_input_name(name))
        return ("typed", tensor.data_type, tuple(tensor.dims), index.is_input_name(name))
    spec = index.spec(name)
    count = spec.num_elements()
    if count is None or count <= SMALL_CONSTANT_ELEMENTS:  # large values are never shapes (as initializers)
        # The producer's op type from the index's facts (as protobuf gives it), not read from its node again.
        producer = index.producer.get(name)
        if producer is not None and index.nodes[producer][0] == "Constant":
            return f"a new node reads the Constant {name!r}, whose value inference may use"
    if not spec.dtype:
        return f"{name!r}, read by a new node, has no known type"
    return ("typed", spec.dtype, spec.shape)


def _small(tensor: onnx.TensorProto) -> bool:
    count = 1
    for d in tensor.dims:
        count *= d
    return count <= SMALL_CONSTANT_ELEMENTS and tensor.data_location != onnx.TensorProto.EXTERNAL


def _small_model(
    output: onnx.ModelProto, index: GraphIndex, plans: list[list[onnx.NodeProto]], new_initializers: dict[str, onnx.TensorProto],
    declared: dict[str, tuple[bytes, ...]] | None = None,
) -> tuple[onnx.ModelProto, list[str]]:
    """The representatives' nodes in a model of their own: the values they read are graph inputs of their
    types (initializers for small constants: inference may read their values), what they produce is declared
    as the output declares it (``declared``: its value infos, which inference in strict mode must meet), and
    each value they produce in place of an old one is passed through an ``Identity`` to a graph output of the
    old type (the checker wants a shape there), so that its own inferred type shows in ``value_info``. Returns
    the model and those replaced names."""
    nodes: list[onnx.NodeProto] = []
    produced: set[str] = set()
    for plan_nodes in plans:
        nodes.extend(plan_nodes)
        produced.update(n for node in plan_nodes for n in node.output if n)
    reads: dict[str, None] = {}
    for node in nodes:
        for name in node.input:
            if name and name not in produced:
                reads.setdefault(name)
        for attribute in node.attribute:
            for sub in _subgraphs(attribute):
                for name in sorted(_outer_reads(sub)):
                    if name not in produced:
                        reads.setdefault(name)
    inputs: list[onnx.ValueInfoProto] = []
    initializers: list[onnx.TensorProto] = []
    for name in reads:
        tensor = new_initializers.get(name) or index.initializers.get(name)
        if tensor is not None and (name in new_initializers or _small(tensor)):
            initializers.append(tensor)
            if not index.is_input_name(name) or name in new_initializers:
                continue
        spec = index.spec(name)
        shape = None if spec.shape is None else list(spec.shape)
        inputs.append(helper.make_tensor_value_info(name, spec.dtype, shape))
    replaced = sorted(name for name in produced if name in index.producer)
    outputs = []
    for k, name in enumerate(replaced):
        shown = f"sgdfuse_check/{k}"
        while shown in produced or shown in reads:
            shown += "_"
        nodes.append(helper.make_node("Identity", [name], [shown]))
        spec = index.spec(name)
        outputs.append(helper.make_tensor_value_info(shown, spec.dtype, None if spec.shape is None else list(spec.shape)))
    value_info = []
    for plan_nodes in plans:
        for node in plan_nodes:
            for name in node.output:
                for typed in (declared or {}).get(name, ()):
                    info = onnx.ValueInfoProto(name=name)
                    info.type.ParseFromString(typed)
                    value_info.append(info)
    graph = helper.make_graph(nodes, "sgdfuse_rewritten_nodes", inputs, outputs, initializer=initializers, value_info=value_info)
    model = helper.make_model(graph, opset_imports=list(output.opset_import), ir_version=output.ir_version)
    model.functions.extend(_called_functions(output, nodes))
    return model, replaced


def _called_functions(output: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> list[onnx.FunctionProto]:
    """The model-local functions ``nodes`` call, directly or through other functions, in model order."""
    by_key = {(f.domain, f.name, f.overload): f for f in output.functions}
    wanted: set[tuple[str, str, str]] = set()
    stack = [(n.domain, n.op_type, n.overload) for n in nodes]
    while stack:
        key = stack.pop()
        if key in by_key and key not in wanted:
            wanted.add(key)
            stack.extend((n.domain, n.op_type, n.overload) for n in by_key[key].node)
    return [f for f in output.functions if (f.domain, f.name, f.overload) in wanted]


def _type_of(info: onnx.ValueInfoProto) -> tuple[int, tuple | None] | None:
    """(dtype, shape) in :class:`~sgdfuse.contract.TensorSpec` terms, or None for a non-tensor type."""
    found = tensor_type_of(info.type)
    return None if found is None else (found[1], found[0])
