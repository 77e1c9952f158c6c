"""In-place state: the ``SGD`` op, the ``Variable`` ops it updates, and the order of every access to them.

The ONNX form of the fused op is functional: ``SGD(parameters, gradient, learning_rate, accum, momentum,
stat) -> (parameters_out, accum_out, stat_out)``. The GE op updates ``parameters``, ``accum`` and ``stat``
in place and declares one output, ``parameters`` (a ref of its input). Lowering turns the ONNX values back
into state, with these exact semantics:

State variables
    Each writable input (ports 0, 3, 5) of each ``SGD`` node becomes a GE ``Variable``:

    - a graph input (``w``, ``buf_w``) → a ``Variable`` with the input's name; its value persists across
      runs of the step graph and is set by the *init graph* (a second ``ModelDef``: one ``Data`` per such
      variable, named ``<name>/initial_value``, ``Assign``-ed into it);
    - an initializer → a ``Variable`` with the initializer's name, ``Assign``-ed its value by the init graph;
    - ``stat`` computed as ``ConstantOfShape(...)`` of zeros (what :mod:`sgdfuse.passes.rewrite` emits,
      ``STAT_DESCRIPTION``) → a zero-initialised ``Variable`` named after the ONNX value. This is exact, not
      an approximation: the ONNX graph feeds zeros on every step; the kernel writes ``stat <- 0`` (momentum
      != 0) or leaves it (momentum == 0), so the variable holds zeros on every step too;
    - anything else (a value computed at run time, or one state written by two ``SGD`` nodes) is refused
      with :class:`~sgdfuse.lowering.errors.InPlaceStateError`. ONNX ``Identity`` chains are looked through.

    Every other reader of a graph-input or initializer state reads the ``Variable``.

Values after the write
    - ``parameters_out`` is the ``SGD`` op's output 0 (a ref of the ``parameters`` variable).
    - ``accum_out`` / ``stat_out``, when anything reads them (a node or a graph output), are a ``TensorMove``
      (a copy) of the ``accum`` / ``stat`` variable with a control edge from the ``SGD`` op: a snapshot taken
      after the in-place write, so a later write (the next run) cannot change what was read. When nothing
      reads them nothing is emitted; the variables still hold the new values for the next run.
    - When ``momentum == 0`` at run time the kernel leaves ``accum`` and ``stat`` unchanged, and the ONNX
      function returns them unchanged: the same values.

Values before the write
    Every GE op that reads a state variable's *old* value, directly or through a chain of ops that may
    alias memory (``Identity``, ``Reshape``, ``Squeeze``, ``Unsqueeze``, ``ExpandDims``, ``Flatten``), runs
    before the write: a control edge ``reader:-1`` is added to the ``SGD`` op unless the reader already is
    one of its ancestors. A reader that cannot run before the write (it depends on the ``SGD`` op, or it is
    ``NetOutput``, which runs last) reads a ``TensorMove`` snapshot of the old value instead, and the
    snapshot gets the control edge.

Source of the op prototypes: shared/LOWERING-FACTS.md ("The operator prototypes") and the GE op IR
(``Variable``: input x, output y; ``Assign``: ref, value → ref; ``TensorMove``: x → y, "copy data from x to
y"; ``NetOutput``: dynamic input x).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from sgdfuse.contract import INPUTS, TensorSpec
from sgdfuse.fused_op import DOMAIN, OP_TYPE, read_sgd_attributes
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.context import GraphLowering, NodeLowering
from sgdfuse.lowering.errors import InPlaceStateError
from sgdfuse.lowering.graph_builder import GraphBuilder, Tensor, add_const
from sgdfuse.lowering.registry import register
from sgdfuse.passes.index import GraphIndex
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = [
    "WRITABLE_PORTS",
    "ALIAS_OP_TYPES",
    "StateVariable",
    "StatePlan",
    "plan_state",
    "add_variables",
    "order_state_access",
    "prune",
    "build_init_graph",
]

WRITABLE_PORTS: tuple[int, ...] = tuple(port.index for port in INPUTS if port.writable)
"""Contract ports the kernel writes in place: parameters (0), accum (3), stat (5)."""

ALIAS_OP_TYPES = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "ExpandDims", "Flatten"})
"""GE ops whose output may share its input's memory: a read through them is a read of the input."""

_SOURCE_INPUT, _SOURCE_INITIALIZER, _SOURCE_ZEROS = "graph input", "initializer", "zeros"


@dataclasses.dataclass(frozen=True)
class StateVariable:
    """One GE ``Variable`` standing for a writable input of an ``SGD`` node.

    Attributes:
        name: the ``Variable`` op name (the ONNX value's name).
        role: ``"parameters"``, ``"accum"`` or ``"stat"``.
        node: the ONNX ``SGD`` node's position in the graph.
        node_name: that node's name.
        onnx_value: the ONNX value the variable replaces.
        spec: shape and ONNX dtype.
        source: ``"graph input"``, ``"initializer"`` or ``"zeros"``.
        initial: the initializer's value (``source == "initializer"``), else None.
        shape_from: for ``"zeros"``, the variable (this node's ``parameters``) whose shape it takes when its
            own shape is not static.
    """

    name: str
    role: str
    node: int
    node_name: str
    onnx_value: str
    spec: TensorSpec
    source: str
    initial: np.ndarray | None = None
    shape_from: str | None = None


@dataclasses.dataclass
class StatePlan:
    """Every state variable of a graph.

    Attributes:
        variables: in graph order, per node in port order (parameters, accum, stat).
        by_port: ``(node position, port index)`` → its variable.
        readable: ONNX value name → variable, for graph-input and initializer states (their other readers
            read the variable).
    """

    variables: list[StateVariable]
    by_port: dict[tuple[int, int], StateVariable]
    readable: dict[str, StateVariable]


def _is_sgd(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def _through_identity(index: GraphIndex, value: str) -> str:
    seen = set()
    while value not in seen:
        seen.add(value)
        node = index.node(value)
        if node is None or node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            return value
        value = node.input[0]
    return value


def _zero_fill(node: onnx.NodeProto | None) -> bool:
    if node is None or node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx"):
        return False
    for attribute in node.attribute:
        if attribute.name == "value":
            return not np.any(numpy_helper.to_array(helper.get_attribute_value(attribute)).astype(np.float64))
    return True  # the default value is a float 0


def plan_state(index: GraphIndex) -> StatePlan:
    """Decide the ``Variable`` behind every writable input of every ``SGD`` node (see the module docstring).

    Raises:
        InPlaceStateError: a writable input is computed at run time (not a graph input, initializer or
            zero ``ConstantOfShape``), or one graph input/initializer is written by two ports.
    """
    variables: list[StateVariable] = []
    by_port: dict[tuple[int, int], StateVariable] = {}
    readable: dict[str, StateVariable] = {}
    writers: dict[str, str] = {}
    taken: set[str] = set()
    for position, node in enumerate(index.graph.node):
        if not _is_sgd(node):
            continue
        node_name = node.name or f"SGD_{position}"
        for port in WRITABLE_PORTS:
            role = INPUTS[port].name
            value = _through_identity(index, node.input[port]) if port < len(node.input) else ""
            subject = f"node {node_name}, input {role} ({value or 'absent'})"
            if not value:
                raise InPlaceStateError(subject, f"the {role} input is missing; the SGD op writes it in place")
            spec = index.spec(value)
            if value in index.graph_inputs:
                source, initial = _SOURCE_INPUT, None
            elif value in index.initializers:
                source, initial = _SOURCE_INITIALIZER, numpy_helper.to_array(index.initializers[value])
            elif role == "stat" and _zero_fill(index.node(value)):
                # Exact only for stat: the kernel writes 0 there or leaves it, so zeros stay zeros.
                source, initial = _SOURCE_ZEROS, None
            else:
                producer = index.node(value)
                what = f"{producer.op_type} node {producer.name!r}" if producer is not None else "nothing"
                raise InPlaceStateError(
                    subject,
                    f"is produced by {what}; the SGD op writes {role} in place, so it must be state: a graph input, "
                    "an initializer, or (stat only) zeros from ConstantOfShape",
                )
            if source != _SOURCE_ZEROS:
                if value in writers:
                    raise InPlaceStateError(subject, f"{value} is already written in place by {writers[value]}; one writer per state")
                writers[value] = f"node {node_name} ({role})"
            name = value if value not in taken else f"{node_name}/{role}"
            taken.add(name)
            variable = StateVariable(
                name=name,
                role=role,
                node=position,
                node_name=node_name,
                onnx_value=value,
                spec=TensorSpec(name, spec.shape, spec.dtype or index.spec(node.input[0]).dtype),
                source=source,
                initial=initial,
                shape_from=by_port[(position, 0)].name if source == _SOURCE_ZEROS and (position, 0) in by_port else None,
            )
            variables.append(variable)
            by_port[(position, port)] = variable
            if source != _SOURCE_ZEROS:
                readable[value] = variable
    return StatePlan(variables, by_port, readable)


def add_variables(graph: GraphLowering, plan: StatePlan) -> dict[str, str]:
    """Emit one ``Variable`` op per state variable and bind graph-input/initializer states to them.

    Returns:
        state variable name → ``Variable`` op name.
    """
    ops: dict[str, str] = {}
    for variable in plan.variables:
        record = graph.builder.add("Variable", variable.name, outputs=[("y", variable.spec)])
        record.unconnected = [("x", variable.spec)]
        ops[variable.name] = record.name
        if variable.onnx_value in plan.readable:
            graph.values[variable.onnx_value] = record.output(0)
    graph.variable_ops = ops
    graph.state = plan
    return ops


@register(OP_TYPE, domain=DOMAIN)
def lower_sgd(ctx: NodeLowering) -> None:
    """``ai.sgdfuse::SGD`` → GE ``SGD`` on the state variables (inputs in contract order, attributes
    ``dampening`` (f), ``weight_decay`` (f), ``nesterov`` (b)); ``*_out`` as described in the module
    docstring."""
    graph = ctx.graph
    plan: StatePlan = graph.state
    builder = graph.builder

    def variable(port: int) -> Tensor:
        return builder.ops[graph.variable_ops[plan.by_port[(ctx.position, port)].name]].output(0)

    attributes = read_sgd_attributes(ctx.node)
    sources = {0: variable(0), 3: variable(3), 5: variable(5)}
    inputs = [(port.name, sources[port.index] if port.writable else ctx.input(port.index)) for port in INPUTS]
    op = ctx.op(
        "SGD",
        inputs,
        [("parameters", ctx.output_spec(0))],
        {
            "dampening": float(attributes.dampening),
            "weight_decay": float(attributes.weight_decay),
            "nesterov": bool(attributes.nesterov),
            # GE marks an op whose input and output share a name as a ref op; recorded as GE records it.
            "reference": True,
        },
    )
    for port in WRITABLE_PORTS:
        graph.writers[plan.by_port[(ctx.position, port)].name] = op.name
    ctx.set_output(0, op.output(0))
    for out_index, port in ((1, 3), (2, 5)):
        value = ctx.node.output[out_index] if out_index < len(ctx.node.output) else ""
        if not value or not graph.index.is_used(value):
            continue
        role = INPUTS[port].name
        snapshot = ctx.op("TensorMove", [("x", sources[port])], [("y", ctx.output_spec(out_index))], suffix=f"{role}_after_write")
        builder.add_control(snapshot.name, op.name)
        graph.after_write.add(snapshot.name)
        ctx.set_output(out_index, snapshot.output(0))


def _alias_closure(builder: GraphBuilder, readers: dict[tuple[str, int], list[str]], start: tuple[str, int]) -> list[tuple[str, int]]:
    closure, stack = [start], [start]
    while stack:
        for reader in readers.get(stack.pop(), ()):
            record = builder.ops[reader]
            if record.type in ALIAS_OP_TYPES:
                endpoint = (reader, 0)
                if endpoint not in closure:
                    closure.append(endpoint)
                    stack.append(endpoint)
    return closure


def order_state_access(graph: GraphLowering) -> None:
    """Make every read of a state variable's old value happen before its in-place write (module docstring).
    Run after the whole graph, ``NetOutput`` included, has been built."""
    builder = graph.builder
    for variable_name, writer in graph.writers.items():
        op_name = graph.variable_ops[variable_name]
        readers = builder.readers()
        ancestors = builder.ancestors(writer)
        for endpoint in _alias_closure(builder, readers, (op_name, 0)):
            for reader in list(dict.fromkeys(readers.get(endpoint, ()))):
                if reader == writer or reader in graph.after_write or reader in ancestors:
                    continue
                record = builder.ops[reader]
                if record.type != "NetOutput" and writer not in builder.ancestors(reader):
                    builder.add_control(writer, reader)
                    ancestors |= {reader} | builder.ancestors(reader)
                    continue
                # The reader cannot run before the write: give it a copy taken before the write.
                source = builder.ops[endpoint[0]].output(endpoint[1])
                snapshot = builder.add("TensorMove", f"{op_name}/before_{writer}", [("x", source)], [("y", source.spec)])
                builder.add_control(writer, snapshot.name)
                ancestors.add(snapshot.name)
                record.inputs = [(port, snapshot.output(0) if t is not None and (t.op, t.index) == endpoint else t) for port, t in record.inputs]


def prune(builder: GraphBuilder, roots: Sequence[str] = ("NetOutput", "SGD", "Assign", "Data")) -> None:
    """Remove ops nothing needs: keep ops of the ``roots`` types (outputs, in-place writers, graph inputs)
    and everything they transitively wait for."""
    live: set[str] = set()
    stack = [name for name, record in builder.ops.items() if record.type in roots]
    while stack:
        name = stack.pop()
        if name in live:
            continue
        live.add(name)
        stack.extend(builder.predecessors(name))
    for name in [n for n in builder.ops if n not in live]:
        del builder.ops[name]


def build_init_graph(plan: StatePlan, name: str) -> tuple[GraphBuilder, list[str], dict[str, str]]:
    """The init graph: ``Assign`` each state variable its initial value.

    Returns:
        ``(builder, data op names in index order, data op name → ONNX graph input it takes)``.
    """
    builder = GraphBuilder(name)
    data_ops: list[str] = []
    feeds: dict[str, str] = {}
    assigned: dict[str, Tensor] = {}
    outputs: list[Tensor] = []
    for variable in plan.variables:
        ref = builder.add("Variable", variable.name, outputs=[("y", variable.spec)])
        ref.unconnected = [("x", variable.spec)]
        if variable.source == _SOURCE_INPUT:
            data = builder.add("Data", f"{variable.name}/initial_value", outputs=[("y", variable.spec)], attrs={"index": len(data_ops)})
            data.unconnected = [("x", variable.spec)]
            data_ops.append(data.name)
            feeds[data.name] = variable.onnx_value
            value = data.output(0)
        elif variable.source == _SOURCE_INITIALIZER:
            value = add_const(builder, f"{variable.name}/initial_value", np.asarray(variable.initial), onnx_dtype=variable.spec.dtype)
        elif variable.spec.is_static:
            zeros = np.zeros(tuple(variable.spec.shape), dtype=onnx_to_numpy_dtype(variable.spec.dtype))  # type: ignore[arg-type]
            value = add_const(builder, f"{variable.name}/zeros", zeros, onnx_dtype=variable.spec.dtype)
        else:
            # Dynamic shape (950 series): zeros shaped like the parameters assigned in this graph.
            like = assigned[variable.shape_from]  # type: ignore[index]
            dims_spec = TensorSpec(f"{variable.name}/dims", (len(like.spec.shape),) if like.spec.shape is not None else (None,), onnx.TensorProto.INT64)
            dims = builder.add("Shape", f"{variable.name}/dims", [("x", like)], [("y", dims_spec)], {"dtype": ge_ir.ONNX_TO_GE_CPP_DTYPE[onnx.TensorProto.INT64]}).output(0)
            zero = add_const(builder, f"{variable.name}/zero", np.zeros((), dtype=onnx_to_numpy_dtype(variable.spec.dtype)), onnx_dtype=variable.spec.dtype)
            value = builder.add("Fill", f"{variable.name}/zeros", [("dims", dims), ("value", zero)], [("y", variable.spec)]).output(0)
        assign = builder.add(
            "Assign",
            f"{variable.name}/assign",
            [("ref", ref.output(0)), ("value", value)],
            [("ref", variable.spec)],
            {"validate_shape": variable.spec.is_static, "use_locking": False},
        )
        assigned[variable.name] = value
        outputs.append(assign.output(0))
    builder.add("NetOutput", "NetOutput", [(f"x{k}", t) for k, t in enumerate(outputs)])
    return builder, data_ops, feeds
