"""In-place state: the ``SGD`` op, the ``Variable`` ops it updates, and the order of every access to them.

The ONNX form of the fused op is functional: ``SGD(parameters, gradient, learning_rate, accum, momentum,
stat) -> (parameters_out, accum_out, stat_out)``. The GE op updates ``parameters``, ``accum`` and ``stat``
in place and declares one output, ``parameters`` (a ref of its input). Lowering turns the ONNX values back
into state, with these exact semantics:

State variables
    Each writable input (ports 0, 3, 5) of each ``SGD`` node becomes a GE ``Variable`` (ONNX ``Identity``
    chains are looked through):

    - ``stat`` is never fed state (the ONNX step feeds it a value of its own every step, and drops the
      kernel's write of it); see the two ``stat`` cases below. ``parameters`` and ``accum``:
    - a graph input (``w``, ``buf_w``) → a ``Variable`` with the input's name; its value persists across
      runs of the step graph and is set by the *init graph* (a second ``ModelDef``: one ``Data`` per such
      variable, named ``<name>/initial_value``, ``Assign``-ed into it);
    - an initializer → a ``Variable`` with the initializer's name, ``Assign``-ed its value by the init graph;
    - ``stat`` that is zeros — ``ConstantOfShape`` of zeros, possibly through ``Cast``/``CastLike`` (what
      :mod:`sgdfuse.passes.rewrite` emits, in FLOAT then cast for BFLOAT16) → a zero-initialised
      ``Variable`` named after the ONNX value, never assigned by the step graph. This is exact: the ONNX
      graph feeds zeros on every step; the kernel writes ``stat <- 0`` (momentum != 0) or leaves it
      (momentum == 0), so the variable holds zeros on every step too;
    - any other ``stat`` (``Expand(Cast(first_step), Shape(parameters))`` from the rewrite, a graph input
      fed at run time, a non-zero initializer) → a fresh zero-initialised ``Variable`` of its own, named
      after the ONNX value (after the port, ``<node>/stat``, when that value is a graph input or an
      initializer, which stays a ``Data`` op or a ``Const``), ``Assign``-ed the value before every update;
    - a ``parameters``/``accum`` value computed in the step (what the rewrite inserts:
      ``accum = Where(first_step, 0, buf)``, and casts of it) → the ``Variable`` of the state it is computed
      from, or a fresh one, plus an ``Assign(variable, computed value)`` that runs before the ``SGD`` op (a
      control edge), so the op still writes the variable in place. "The state it is computed from" is the
      one graph input or initializer of the port's shape and dtype whose *elements* reach the value through
      values of the port's shape only (a reduction, a ``Shape`` or a scalar condition breaks the path, so
      ``Where(step + ReduceSum(g * 0) == 0, 0, buf)`` is computed from ``buf``, not ``g``):
      ``accum = Where(first, 0, buf)`` becomes ``Assign(buf, SelectV2(first, 0, buf))`` then
      ``SGD(..., buf, ...)``. With no such source the variable is named after the ONNX value,
      zero-initialised by the init graph and assigned on every step. Exact because
      the ONNX step feeds the computed value to the op and, as everywhere here, the variable after the step
      holds the op's result, the next step's state. Refused: a value computed from two or more candidate
      states (which one the op replaces is ambiguous) or from the result of an ``SGD`` node;
    - one state written by two ports (``SGD`` nodes, or ports of one node) is refused.

    All refusals are :class:`~sgdfuse.lowering.errors.InPlaceStateError`. Every other reader of a
    graph-input or initializer state reads the ``Variable``.

Values after the write
    - ``parameters_out`` is the ``SGD`` op's output 0 (a ref of the ``parameters`` variable).
    - ``accum_out`` / ``stat_out``, when anything reads them (a node or a graph output), are a ``TensorMove``
      (a copy) of the ``accum`` / ``stat`` variable with a control edge from the ``SGD`` op: a snapshot taken
      after the in-place write, so a later write (the next run) cannot change what was read. When nothing
      reads them nothing is emitted; the variables still hold the new values for the next run.
    - When ``momentum == 0`` at run time the kernel leaves ``accum`` and ``stat`` unchanged, and the ONNX
      function returns them unchanged: the same values (for an assigned variable: the assigned value, which
      is the ONNX op's input).
    - The buffer of an update with a runtime momentum: ``sgdfuse optimize`` gives the graph's buffer output
      to an ``If(Equal(momentum, 0))`` that selects between the buffer the original graph computes for
      momentum 0 and the op's ``accum_out`` (the contract keeps the old buffer when momentum is 0, the graph
      does not). That ``If``'s output, not ``accum_out``, is then the buffer's next value, so after the
      ``SGD`` op the variable is ``Assign``-ed the selected value (a *write-back*, ordered after the op and
      after its after-write snapshots of the variable). With momentum != 0 the selected value is
      ``accum_out`` itself and the write-back stores what the variable already holds. Only the rewrite's own
      ``If`` is recognised, by all it writes (a node named ``sgdfuse/...``, branches named
      ``.../momentum_zero`` and ``.../momentum_nonzero``, an else branch that is exactly
      ``Identity(accum_out)``, a condition ``Equal`` reading the node's ``momentum``); a user's ``If`` that
      selects on the momentum is an ordinary node whose result is never written into the buffer.

Guarded updates
    A fused update whose state outputs the graph selects under a guard — ``p_out = Where(found_inf, p,
    p_new)`` and ``buf_out = Where(found_inf, buf, buf_new)`` (a loss-scaling overflow skip), or
    ``Where(has_grad, new, old)`` — keeps those ``Where`` nodes, reading the ``SGD`` node's outputs; in ONNX
    (values) that is exact. GE's ``SGD`` has no condition and writes ``parameters`` and ``accum`` in place on
    every step, so the guard's output is made the variable's next value (:attr:`StateVariable.next_value`,
    with :attr:`StateVariable.guarded_by` naming the condition) and written back after the op, as for the
    runtime momentum above:

    - the ``Where`` reads the variable's old value, and it depends on the op, so it reads a ``TensorMove``
      snapshot taken before the first write (the ordering rule below); its other branch is the op's result
      (``parameters_out``, or ``accum_out``'s after-write copy, or the runtime-momentum ``If``'s output);
    - after the op the variable is ``Assign``-ed the ``Where``'s result: on a skipped step the old value,
      bit for bit; on the others the value the op wrote;
    - ``parameters_out`` is a ref of the variable, which the write-back overwrites: when anything besides the
      guard reads it (``delta = p_new - p``), its readers read a ``TensorMove`` copy taken after the op, and
      the write-back waits for that copy. When the guard is its only reader, the ``Where`` reads the ref
      directly (a data edge orders it before the write-back);
    - ``stat`` needs nothing: its variable is never the graph's state (zeros stay zeros, a computed ``stat``
      is assigned before every update) and the fused node's ``stat_out`` is unused.

    Recognised (:func:`_guard`): a ``Where`` with a boolean condition (one element, or a mask of the state's
    shape) whose one branch is the port's new value and the other the state the variable replaces (each
    possibly through ``Identity``), of the state's shape and dtype, whose output or an ``Identity`` copy of
    it is a graph output: the step hands it out as the next state. Only graph-input and initializer states
    are considered (a fresh variable has no old value the graph could keep). Refused: two such outputs for
    one state (which one the variable holds next is ambiguous).

Values before the write
    A variable's writers run in order: its step ``Assign`` (if any), the ``SGD`` op, its write-back (if
    any). Every GE op that
    reads the variable's *old* value, directly or through a chain of ops that may alias memory (one rule,
    :mod:`sgdfuse.lowering.alias`: ``Identity``, ``Reshape``, ``Squeeze``, ``Unsqueeze``, ``ExpandDims``,
    ``Flatten``, and a ``Transpose`` that keeps the row-major order, such as one moving only size-1 axes),
    runs before the first writer: a control edge ``reader:-1`` is added to it unless the reader already is
    one of its ancestors. A reader that cannot run before the write (it depends on the writer, or it is
    ``NetOutput``, which runs last) reads a ``TensorMove`` snapshot of what it read instead, and the
    snapshot gets the control edge. The walk goes on through an aliasing reader only once it is ordered
    before the write, so a snapshot's source always runs before the write (an alias op that depends on the
    write, ``Reshape(w, Shape(w_out))``, gets a snapshot of ``w`` itself). The computed value of an
    ``Assign`` is a separate tensor (``SelectV2``, ``Expand``... are
    not aliases), so its other readers need no ordering.

    Cost: reachability questions are answered by :class:`sgdfuse.lowering.dag.OpOrder` (walks bounded by a
    topological rank from both ends, and hubs for the long paths through a loss), not by whole-graph walks.

Source of the op prototypes: the public GE op IR headers
(``Variable``: input x, output y; ``Assign``: ref, value → ref; ``TensorMove``: x → y, "copy data from x to
y"; ``NetOutput``: dynamic input x).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from sgdfuse.contract import INPUTS, TensorSpec
from sgdfuse.external_data import tensor_to_array
from sgdfuse.fused_op import DOMAIN, OP_TYPE, read_sgd_attributes
from sgdfuse.lowering import alias, ge_ir
from sgdfuse.lowering.context import GraphLowering, NodeLowering
from sgdfuse.lowering.dag import OpOrder
from sgdfuse.lowering.errors import InPlaceStateError
from sgdfuse.lowering.graph_builder import GraphBuilder, GraphWriter, OpKind, Tensor, add_const, tensor_def
from sgdfuse.lowering.registry import register
from sgdfuse.passes.index import GraphIndex, _outer_reads, _subgraphs
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = [
    "WRITABLE_PORTS",
    "ALIAS_OP_TYPES",
    "StateVariable",
    "StatePlan",
    "plan_state",
    "add_variables",
    "add_write_backs",
    "order_state_access",
    "prune",
    "build_init_graph",
]

WRITABLE_PORTS: tuple[int, ...] = tuple(port.index for port in INPUTS if port.writable)
"""Contract ports the kernel writes in place: parameters (0), accum (3), stat (5)."""

ALIAS_OP_TYPES = alias.ALIAS_OP_TYPES
"""GE ops whose output always may share its input's memory (see :mod:`sgdfuse.lowering.alias`, which also
counts a ``Transpose`` that keeps the row-major order)."""

_SOURCE_INPUT, _SOURCE_INITIALIZER, _SOURCE_ZEROS, _SOURCE_COMPUTED = "graph input", "initializer", "zeros", "computed"

_STANDARD = ("", "ai.onnx")
_SHAPE_ONLY = frozenset({"Shape", "Size"})
"""ONNX ops that read only the shape of their input, not its values."""


@dataclasses.dataclass(frozen=True)
class StateVariable:
    """One GE ``Variable`` standing for a writable input of an ``SGD`` node.

    Attributes:
        name: the ``Variable`` op name (the ONNX value's name).
        role: ``"parameters"``, ``"accum"`` or ``"stat"``.
        node: the ONNX ``SGD`` node's position in the graph.
        node_name: that node's name.
        onnx_value: the ONNX state value the variable replaces (for ``"zeros"`` and ``"computed"``: the
            value fed to the port).
        spec: shape and ONNX dtype.
        source: ``"graph input"``, ``"initializer"``, ``"zeros"`` or ``"computed"`` (what the init graph
            assigns: the input's value, the initializer, zeros, zeros).
        initial: the initializer's value (``source == "initializer"``), else None.
        shape_from: for ``"zeros"`` and ``"computed"``, the variable (this node's ``parameters``) whose shape
            it takes when its own shape is not static.
        assigned: the ONNX value ``Assign``-ed to the variable on every step before the ``SGD`` op writes
            it (a port fed a computed value), else None.
        next_value: the ONNX value ``Assign``-ed to the variable after the ``SGD`` op (the output of the
            runtime-momentum ``If`` that selects the buffer, or of the guard ``Where`` that keeps the old
            state on a skipped step, see the module docstring), else None.
        guarded_by: for a guarded update, the ONNX boolean value that selects between the old state and the
            op's result (``next_value`` is then the guard's output), else None.
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
    assigned: str | None = None
    next_value: str | None = None
    guarded_by: str | None = None


@dataclasses.dataclass
class StatePlan:
    """Every state variable of a graph.

    Attributes:
        variables: in graph order, per node in port order (parameters, accum, stat).
        by_port: ``(node position, port index)`` → its variable.
        readable: ONNX value name → variable, for graph-input and initializer states (their other readers
            read the variable).
        graph_outputs: the ONNX graph's output names.
    """

    variables: list[StateVariable]
    by_port: dict[tuple[int, int], StateVariable]
    readable: dict[str, StateVariable]
    graph_outputs: frozenset[str] = frozenset()


def _is_sgd(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def _followed(index: GraphIndex, value: str, op_types: Sequence[str]) -> str | None:
    """Input 0 of the standard ``op_types`` node producing ``value``, or None (read from the node facts)."""
    position = index.producer.get(value)
    if position is None:
        return None
    op_type, domain, inputs, *_ = index.nodes[position]
    if op_type not in op_types or domain not in _STANDARD or not inputs:
        return None
    return inputs[0]


def _through(index: GraphIndex, value: str, op_types: Sequence[str]) -> str:
    """Follow input 0 of standard ``op_types`` nodes back from ``value``."""
    source = _followed(index, value, op_types)
    if source is None:
        return value  # nothing to follow, as for nearly every value: no set allocated
    seen = {value}
    value = source
    while value not in seen:
        seen.add(value)
        source = _followed(index, value, op_types)
        if source is None:
            return value
        value = source
    return value


def _zero_fill(index: GraphIndex, value: str, memo: dict[bytes, bool]) -> bool:
    """True for zeros from ``ConstantOfShape``, also through ``Identity``/``Cast``/``CastLike`` (a cast of
    zero is zero in every float type). ``memo`` keeps the answer per serialised ``value`` attribute: the
    rewrite gives every update's ``stat`` its own ``ConstantOfShape`` with the same one-element value, and
    converting it to an array each time cost more than the rest of the plan."""
    position = index.producer.get(_through(index, value, ("Identity", "Cast", "CastLike")))
    if position is None:
        return False
    op_type, domain, *_ = index.nodes[position]
    if op_type != "ConstantOfShape" or domain not in _STANDARD:
        return False
    for attribute in index.graph.node[position].attribute:
        if attribute.name == "value":
            key = attribute.SerializeToString(deterministic=True)
            found = memo.get(key)
            if found is None:
                found = memo[key] = not np.any(tensor_to_array(helper.get_attribute_value(attribute)).astype(np.float64))
            return found
    return True  # the default value is a float 0


class _Sources:
    """The graph inputs and initializers a value is computed from (memoised over the whole graph, so shared
    sub-expressions such as a first-step condition are walked once)."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self._memo: dict[str, tuple[frozenset[str], str | None]] = {}

    def __call__(self, value: str) -> tuple[frozenset[str], str | None]:
        """``(sources, update)``: ``update`` names an ``SGD`` node the value depends on, else None."""
        stack = [(value, False)]
        while stack:
            name, expanded = stack.pop()
            if name in self._memo:
                continue
            reads = self._reads(name)
            if not expanded:
                stack.append((name, True))
                stack.extend((r, False) for r in reads if r not in self._memo)
                continue
            sources: set[str] = set()
            update: str | None = None
            node = self.index.node(name)
            if node is None:
                if name in self.index.state_names:
                    sources.add(name)
            elif _is_sgd(node):
                update = node.name or "SGD"
            for read in reads:
                found, via = self._memo[read]
                sources |= found
                update = update or via
            self._memo[name] = (frozenset(sources), update)
        return self._memo[value]

    def _reads(self, name: str) -> list[str]:
        node = self.index.node(name)
        if node is None or _is_sgd(node):
            return []
        if node.op_type in _SHAPE_ONLY and node.domain in _STANDARD:
            return []
        reads = [i for i in node.input if i]
        for attribute in node.attribute:
            for sub in _subgraphs(attribute):
                reads.extend(sorted(_outer_reads(sub)))
        return reads


def _same_tensor_type(a: TensorSpec, b: TensorSpec) -> bool:
    return a.dtype == b.dtype and a.shape is not None and a.shape == b.shape


def plan_state(index: GraphIndex) -> StatePlan:
    """Decide the ``Variable`` behind every writable input of every ``SGD`` node (see the module docstring).

    Raises:
        InPlaceStateError: a writable input is missing, computed from several candidate states or from an
            ``SGD`` node's result, or one state is written by two ports.
    """
    variables: list[StateVariable] = []
    by_port: dict[tuple[int, int], StateVariable] = {}
    readable: dict[str, StateVariable] = {}
    writers: dict[str, str] = {}
    taken: set[str] = set()
    sources_of = _Sources(index)
    shaped_sources = _ShapedSources(index)
    selections = _selections(index)
    zero_fills: dict[bytes, bool] = {}
    outputs = set(index.graph_outputs)
    graph_nodes = index.graph.node
    for position, (op_type, domain, node_inputs, node_outputs, *_) in enumerate(index.nodes):
        if op_type != OP_TYPE or domain != DOMAIN:
            continue
        node_name = graph_nodes[position].name or f"SGD_{position}"
        parameters_spec = index.spec(node_inputs[0]) if node_inputs else TensorSpec("parameters", None, 0)
        for port in WRITABLE_PORTS:
            role = INPUTS[port].name
            value = _through(index, node_inputs[port], ("Identity",)) if port < len(node_inputs) else ""
            subject = f"node {node_name}, input {role} ({value or 'absent'})"
            if not value:
                raise InPlaceStateError(subject, f"the {role} input is missing; the SGD op writes it in place")
            spec = index.spec(value)
            if spec.shape is None or not spec.dtype:
                spec = TensorSpec(value, spec.shape if spec.shape is not None else parameters_spec.shape, spec.dtype or parameters_spec.dtype)
            state, assigned = value, None
            if role == "stat":
                # stat is never fed state: the ONNX step feeds it a value of its own on every step (zeros, a
                # flag computed from the step, a graph input, an initializer), and the kernel's write of it is
                # dropped by the ONNX graph. Its variable is its own: zeros stay zeros (the kernel writes 0 or
                # leaves it), anything else is assigned its value before every update.
                if _zero_fill(index, value, zero_fills) or _zero_initializer(index, value):
                    source, initial = _SOURCE_ZEROS, None
                else:
                    source, initial = _computed_stat(index, sources_of, value, subject)
                assigned = value if source == _SOURCE_COMPUTED else None
            elif index.is_input_name(value):
                source, initial = _SOURCE_INPUT, None
            elif value in index.initializers:
                source, initial = _SOURCE_INITIALIZER, tensor_to_array(index.initializers[value])
            else:
                state, source, initial = _computed_state(index, shaped_sources, sources_of, value, spec, role, subject)
                assigned = value
            if source in (_SOURCE_INPUT, _SOURCE_INITIALIZER):
                if state in writers:
                    raise InPlaceStateError(
                        subject,
                        f"{state} is already written in place by {writers[state]}; one writer per state"
                        + (f" ({value} is computed from {state})" if state != value else ""),
                    )
                writers[state] = f"node {node_name} ({role})"
            # A stat fed a graph input or an initializer keeps that value as it is (a Data op or a Const);
            # its variable is named after the port instead.
            own = source in (_SOURCE_ZEROS, _SOURCE_COMPUTED) and (index.is_input_name(value) or value in index.initializers)
            name = _variable_name(f"{node_name}/{role}" if own else state, taken, f"{node_name}/{role}")
            fresh = source in (_SOURCE_ZEROS, _SOURCE_COMPUTED)
            shape_from = by_port[(position, 0)].name if fresh and (position, 0) in by_port else None
            if fresh and not spec.is_static and shape_from is None:
                raise InPlaceStateError(subject, "a computed parameters input of dynamic shape cannot be sized for its variable")
            next_value = _next_value(index, selections, node_inputs, node_outputs, port, spec)
            guard = None
            if not fresh and role != "stat":
                out_index = _NEW_VALUE_OF_PORT[port]
                new_value = next_value or (node_outputs[out_index] if out_index < len(node_outputs) else "")
                guard = _guard(index, outputs, new_value, state, spec, role, subject) if new_value else None
            variable = StateVariable(
                name=name,
                role=role,
                node=position,
                node_name=node_name,
                onnx_value=state,
                spec=TensorSpec(name, spec.shape, spec.dtype),
                source=source,
                initial=initial,
                shape_from=shape_from,
                assigned=assigned,
                next_value=guard[0] if guard else next_value,
                guarded_by=guard[1] if guard else None,
            )
            variables.append(variable)
            by_port[(position, port)] = variable
            if not fresh:
                readable[state] = variable
    return StatePlan(variables, by_port, readable, frozenset(outputs))


_OUTPUT_OF_PORT = {3: 1, 5: 2}
"""SGD output index carrying the new value of a writable port (``accum_out``, ``stat_out``)."""

_NEW_VALUE_OF_PORT = {0: 0, 3: 1, 5: 2}
"""SGD output index carrying the op's result for each writable port (``parameters_out``, ``accum_out``,
``stat_out``), before any guard selects it."""


def _copies(index: GraphIndex, value: str) -> list[str]:
    """``value`` and every value that is an ``Identity`` copy of it (transitively), in discovery order."""
    found = [value]
    for name in found:
        for position in index.consumers.get(name, ()):
            node = index.graph.node[position]
            if node.op_type == "Identity" and node.domain in _STANDARD and node.output and node.output[0] not in found:
                found.append(node.output[0])
    return found


def _guard(
    index: GraphIndex, outputs: set[str], new: str, state: str, spec: TensorSpec, role: str, subject: str
) -> tuple[str, str] | None:
    """``(guarded output, condition)`` when the op's result ``new`` for the state ``state`` reaches the step's
    outputs through a guard: ``Where(condition, state, new)`` or ``Where(condition, new, state)`` (each
    branch possibly through ``Identity``), a boolean condition, the state's shape and dtype, the ``Where``'s
    output (or a copy of it) one of the graph ``outputs``. That output, not ``new``, is then the state's next
    value: on a skipped step it is the old state. ``None`` when ``new`` is not guarded.

    Raises:
        InPlaceStateError: several such outputs (which one is the next value is ambiguous).
    """
    found: dict[str, str] = {}
    for read in _copies(index, new):
        for position in index.consumers.get(read, ()):
            where = index.graph.node[position]
            if where.op_type != "Where" or where.domain not in _STANDARD or len(where.input) != 3 or len(where.output) != 1:
                continue
            condition, if_true, if_false = where.input
            kept = if_false if if_true == read else if_true if if_false == read else None
            if kept is None or _through(index, kept, ("Identity",)) != state:
                continue
            if index.spec(condition).dtype != onnx.TensorProto.BOOL:
                continue
            output = where.output[0]
            out_spec = index.spec(output)
            if out_spec.dtype != spec.dtype or out_spec.shape is None or out_spec.shape != spec.shape:
                continue  # a Where that broadcasts to another shape is not the state's next value
            if any(name in outputs for name in _copies(index, output)):
                found[output] = condition
    if len(found) > 1:
        raise InPlaceStateError(
            subject,
            f"the update's new {role} {new} is selected against the old {state} by several guarded outputs "
            f"({', '.join(sorted(found))}); which one is the next {role} is ambiguous",
        )
    return next(iter(found.items())) if found else None


def _selections(index: GraphIndex) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """``accum_out`` of an ``SGD`` node → the runtime-momentum ``If`` nodes ``sgdfuse optimize`` emitted for
    it, as ``(node, 0)``. Only the rewrite's own ``If`` is recognised, by everything it writes
    (:meth:`sgdfuse.passes.rewrite.Planner._momentum_zero_buffer`): a node named ``sgdfuse/...``, branches
    named ``.../momentum_zero`` and ``.../momentum_nonzero``, one output, and an else branch that is exactly
    ``Identity(accum_out)``. A user's ``If`` that selects on the momentum (a monitor output) is an ordinary
    node: its result is never written into the buffer."""
    found: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for position in index.subgraph_nodes:  # an If with its branches holds subgraphs
        op_type, domain, *_ = index.nodes[position]
        if op_type != "If" or domain not in _STANDARD:
            continue
        node = index.graph.node[position]
        if not node.name.startswith("sgdfuse/") or len(node.output) != 1:
            continue
        branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        then_branch, else_branch = branches.get("then_branch"), branches.get("else_branch")
        if then_branch is None or else_branch is None:
            continue
        if not (then_branch.name.endswith("/momentum_zero") and else_branch.name.endswith("/momentum_nonzero")):
            continue
        if len(else_branch.node) != 1 or len(else_branch.output) != 1 or else_branch.initializer:
            continue
        (identity,) = else_branch.node
        if identity.op_type != "Identity" or identity.domain not in _STANDARD or list(identity.output) != [else_branch.output[0].name]:
            continue
        found.setdefault(identity.input[0], []).append((node, 0))
    return found


def _next_value(
    index: GraphIndex,
    selections: dict[str, list[tuple[onnx.NodeProto, int]]],
    inputs: Sequence[str],
    outputs: Sequence[str],
    port: int,
    spec: TensorSpec,
) -> str | None:
    """The output of the runtime-momentum ``If`` that replaces this port's new value (module docstring): the
    rewrite's ``If`` (:func:`_selections`) on ``Equal`` of the momentum of the ``SGD`` node reading
    ``inputs`` and writing ``outputs``."""
    out_index = _OUTPUT_OF_PORT.get(port)
    if out_index is None or out_index >= len(outputs) or not outputs[out_index] or len(inputs) < 5:
        return None
    selectors = selections.get(outputs[out_index])
    if not selectors:  # the common case: no runtime momentum
        return None
    momentum = _through(index, inputs[4], ("Identity",))
    for selector, k in selectors:
        condition = index.node(selector.input[0]) if selector.input else None
        if condition is None or condition.op_type != "Equal" or condition.domain not in _STANDARD:
            continue
        if momentum not in {_through(index, i, ("Identity",)) for i in condition.input}:
            continue
        result = selector.output[k] if k < len(selector.output) else ""
        if result and _same_tensor_type(index.spec(result), spec):
            return result
    return None


def _variable_name(base: str, taken: set[str], fallback: str) -> str:
    """A ``Variable`` name free among ``taken`` (then taken): ``base`` as GE writes op names (``:`` is an edge
    separator there), else ``fallback``, else ``fallback_<k>``."""
    for candidate in (base.replace(":", "_"), fallback.replace(":", "_")):
        if candidate not in taken:
            taken.add(candidate)
            return candidate
    counter = 1
    while f"{fallback}_{counter}".replace(":", "_") in taken:
        counter += 1
    name = f"{fallback}_{counter}".replace(":", "_")
    taken.add(name)
    return name


def _zero_initializer(index: GraphIndex, value: str) -> bool:
    """True for an initializer (not overridable as a graph input) holding only zeros."""
    tensor = index.initializers.get(value)
    if tensor is None or index.is_input_name(value):
        return False
    return not np.any(tensor_to_array(tensor).astype(np.float64))


def _computed_stat(index: GraphIndex, sources_of: _Sources, value: str, subject: str) -> tuple[str, None]:
    """``(source, initial)`` for a ``stat`` fed ``value``: its own variable, assigned ``value`` every step."""
    _, update = sources_of(value)
    if update is not None:
        producer = index.node(value)
        what = f"{producer.op_type} node {producer.name!r}" if producer is not None else value
        raise InPlaceStateError(
            subject,
            f"is produced by {what} from the result of the in-place update {update}; the SGD op's stat must be "
            "known before the update runs",
        )
    return _SOURCE_COMPUTED, None


class _ShapedSources:
    """The graph inputs and initializers whose *elements* a value is computed from: those reached through
    values of the value's own shape only. A reduction, a shape or a scalar condition breaks the path, so in
    ``Where(step + ReduceSum(g * 0) == 0, 0, buf)`` the source is ``buf``, not ``g``. Memoised by value
    name: a value has one shape, so what it reaches does not depend on which query reached it."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self._memo: dict[str, frozenset[str]] = {}

    def __call__(self, value: str) -> frozenset[str]:
        shape = self.index.spec(value).shape
        if shape is None:
            return frozenset()
        stack = [(value, False)]
        while stack:
            name, expanded = stack.pop()
            if name in self._memo:
                continue
            node = self.index.node(name)
            reads = [] if node is None or _is_sgd(node) or node.op_type in _SHAPE_ONLY else [
                r for r in dict.fromkeys(_node_reads(node)) if r and self.index.spec(r).shape == shape
            ]
            if not expanded:
                stack.append((name, True))
                stack.extend((r, False) for r in reads if r not in self._memo)
                continue
            found = {name} if node is None and name in self.index.state_names else set()
            for read in reads:
                found |= self._memo.get(read, frozenset())
            self._memo[name] = frozenset(found)
        return self._memo[value]


def _node_reads(node: onnx.NodeProto) -> list[str]:
    reads = [i for i in node.input if i]
    for attribute in node.attribute:
        for sub in _subgraphs(attribute):
            reads.extend(sorted(_outer_reads(sub)))
    return reads


def _computed_state(
    index: GraphIndex, shaped_sources: _ShapedSources, sources_of: _Sources, value: str, spec: TensorSpec, role: str, subject: str
) -> tuple[str, str, np.ndarray | None]:
    """``(state, source, initial)`` for a port fed the computed ``value`` (module docstring)."""
    _, update = sources_of(value)
    producer = index.node(value)
    what = f"{producer.op_type} node {producer.name!r}" if producer is not None else "nothing"
    if update is not None:
        raise InPlaceStateError(
            subject,
            f"is produced by {what} from the result of the in-place update {update}; the SGD op writes {role} "
            "in place, so it must be state or computed from the state it replaces",
        )
    candidates = sorted(s for s in shaped_sources(value) if _same_tensor_type(index.spec(s), spec))
    if len(candidates) > 1:
        raise InPlaceStateError(
            subject,
            f"is produced by {what} from {', '.join(candidates)}, each of the {role}'s shape and dtype; the SGD "
            f"op writes {role} in place, so it must be state or computed from at most one such graph input or "
            "initializer (the state it replaces)",
        )
    if not candidates:
        return value, _SOURCE_COMPUTED, None
    state = candidates[0]
    if index.is_input_name(state):
        return state, _SOURCE_INPUT, None
    return state, _SOURCE_INITIALIZER, tensor_to_array(index.initializers[state])


def add_variables(graph: GraphLowering, plan: StatePlan) -> dict[str, str]:
    """Emit one ``Variable`` op per state variable and bind graph-input/initializer states to them.

    Returns:
        state variable name → ``Variable`` op name.
    """
    ops: dict[str, str] = {}
    builder = graph.builder
    for variable in plan.variables:
        spec = variable.spec
        kind = builder.kind("state variable", (spec.dtype, spec.shape), "Variable")  # a few classes of variables: one tail each
        record = builder.add("Variable", variable.name, outputs=[("y", spec)], kind=kind, unconnected=[("x", spec)])
        ops[variable.name] = record.name
        if plan.readable.get(variable.onnx_value) is variable:
            graph.values[variable.onnx_value] = record.output(0)
    graph.variable_ops = ops
    graph.state = plan
    return ops


@register(OP_TYPE, domain=DOMAIN)
def lower_sgd(ctx: NodeLowering) -> None:
    """``ai.sgdfuse::SGD`` → GE ``SGD`` on the state variables (inputs in contract order, attributes
    ``dampening`` (f), ``weight_decay`` (f), ``nesterov`` (b)), after an ``Assign`` of each computed
    writable input; ``*_out`` as described in the module docstring."""
    graph = ctx.graph
    plan: StatePlan = graph.state
    builder = graph.builder
    index = graph.index
    position = ctx.position
    states = {port: plan.by_port[(position, port)] for port in WRITABLE_PORTS}
    # The node's inputs and outputs from the index's facts (ctx.node is the main graph's node at this position).
    node_inputs, outputs = index.nodes[position][2:4]

    # The variables' tensors, once per port (each output() call makes a new Tensor).
    sources = {port: builder.ops[graph.variable_ops[state.name]].output(0) for port, state in states.items()}

    assigns: list[str] = []
    for port, state in states.items():
        if state.assigned is None:
            continue
        value = graph.tensor(state.assigned, reader=ctx.name)
        assign = ctx.op(
            "Assign",
            [("ref", sources[port]), ("value", value)],
            [("ref", state.spec)],
            {"validate_shape": state.spec.is_static, "use_locking": False},
            suffix=f"assign_{state.role}",
        )
        graph.writers.setdefault(state.name, []).append(assign.name)
        assigns.append(assign.name)

    attributes = read_sgd_attributes(ctx.node)
    # ctx.input(i) of each port read as a value, in port order (an initializer's Const is made on its first
    # read), with the input's name from the facts
    inputs = [
        (port.name, sources[port.index] if port.writable else _read_input(graph, node_inputs, port.index, ctx.name))
        for port in INPUTS
    ]
    output = index.spec(outputs[0])
    attrs = {
        "dampening": float(attributes.dampening),
        "weight_decay": float(attributes.weight_decay),
        "nesterov": bool(attributes.nesterov),
        # GE marks an op whose input and output share a name as a ref op; recorded as GE records it.
        "reference": True,
    }
    # The updates of one hyper-parameter set and one dtype and shape are one kind of op (graph_builder.OpKind):
    # keyed by every port's dtype and shape and the attribute values (repr, so that -0.0 and 0.0 stay apart).
    key = (
        tuple(None if t is None else (t.spec.dtype, t.spec.shape) for _, t in inputs),
        output.dtype, output.shape, repr(attrs["dampening"]), repr(attrs["weight_decay"]), attrs["nesterov"],
    )
    op = builder.add("SGD", ctx.name, inputs, [("parameters", output)], kind=builder.kind("update", key, "SGD", attrs))
    for assign in assigns:
        builder.add_control(op.name, assign)
    writers = graph.writers
    for state in states.values():
        writers.setdefault(state.name, []).append(op.name)
    graph.sgd_ops.append(op.name)
    values = graph.values
    if outputs[0]:
        values[outputs[0]] = op.output(0)
    parameters = states[0]
    if parameters.next_value is not None and _read_besides(index, plan, outputs[0], parameters.next_value):
        # A guarded parameters variable is restored by its write-back on a skipped step, and output 0 is a ref
        # of that variable: readers of the op's result other than the guard read a copy taken before that.
        copy = ctx.op("TensorMove", [("x", op.output(0))], [("y", output)], suffix="parameters_after_write")
        graph.after_write.add(copy.name)
        graph.after_write_of.setdefault(parameters.name, []).append(copy.name)
        if outputs[0]:
            values[outputs[0]] = copy.output(0)
    for out_index, port in ((1, 3), (2, 5)):
        value = outputs[out_index] if out_index < len(outputs) else ""
        # index.is_used(value), with the graph outputs the plan holds as a set already
        if not value or not (value in plan.graph_outputs or index.consumers.get(value) or value in index.subgraph_reads):
            continue
        role = INPUTS[port].name
        source, copied = sources[port], index.spec(value)
        kind = builder.kind("after write", (source.spec.dtype, source.spec.shape, copied.dtype, copied.shape), "TensorMove")
        snapshot = builder.add("TensorMove", f"{ctx.name}/{role}_after_write", [("x", source)], [("y", copied)], kind=kind)
        builder.add_control(snapshot.name, op.name)
        graph.after_write.add(snapshot.name)
        graph.after_write_of.setdefault(states[port].name, []).append(snapshot.name)
        values[value] = snapshot.output(0)


def _read_input(graph: GraphLowering, inputs: tuple[str, ...], i: int, reader: str) -> Tensor | None:
    """The GE tensor of input ``i`` of a node reading ``inputs``, None when absent (NodeLowering.input)."""
    return graph.tensor(inputs[i], reader=reader) if i < len(inputs) and inputs[i] else None


def _read_besides(index: GraphIndex, plan: StatePlan, value: str, guarded: str) -> bool:
    """True when ``value`` is read by anything but the one node producing ``guarded`` (another node, a
    subgraph, a graph output)."""
    readers = index.consumers.get(value, [])
    return (
        value in index.subgraph_reads
        or value in plan.graph_outputs
        or len(readers) != 1
        or index.producer.get(guarded) != readers[0]
    )


def add_write_backs(graph: GraphLowering) -> None:
    """``Assign`` each variable with a ``next_value`` that value, after its ``SGD`` op and after the op's
    snapshots of it (module docstring). Run after every node has been lowered."""
    plan: StatePlan = graph.state
    builder = graph.builder
    for variable in plan.variables:
        if variable.next_value is None:
            continue
        writers = graph.writers[variable.name]
        ref = builder.ops[graph.variable_ops[variable.name]].output(0)
        value = graph.tensor(variable.next_value, reader=f"{variable.node_name} (write-back of {variable.role})")
        assign = builder.add(
            "Assign",
            f"{variable.node_name}/write_back_{variable.role}",
            [("ref", ref), ("value", value)],
            [("ref", variable.spec)],
            {"validate_shape": variable.spec.is_static, "use_locking": False},
        )
        builder.add_control(assign.name, writers[-1])
        for snapshot in graph.after_write_of.get(variable.name, ()):
            builder.add_control(assign.name, snapshot)
        writers.append(assign.name)


def _const_ints(builder: GraphBuilder, tensor: Tensor | None) -> list[int] | None:
    """The integers a ``Const`` op holds (a ``Transpose`` perm), or None when ``tensor`` is not a ``Const``."""
    record = builder.ops.get(tensor.op) if tensor is not None else None
    if record is None or record.type != "Const" or "value" not in record.attrs:
        return None
    value = record.attrs["value"].t
    dtype = {ge_ir.ge_dtype(onnx.TensorProto.INT64): "<i8", ge_ir.ge_dtype(onnx.TensorProto.INT32): "<i4"}.get(value.desc.dtype)
    return None if dtype is None else [int(v) for v in np.frombuffer(value.data, dtype=dtype)]


def _may_alias(builder: GraphBuilder, name: str) -> bool:
    """The aliasing rule of :mod:`sgdfuse.lowering.alias` for the op ``name`` being built."""
    record = builder.ops[name]
    source = record.inputs[0][1] if record.inputs else None
    if record.type not in ("Transpose", "Cast", "Expand", "BroadcastTo") or source is None:
        return alias.may_alias(record.type)
    output = record.outputs[0][1] if record.outputs else None
    perm = _const_ints(builder, record.inputs[1][1]) if record.type == "Transpose" and len(record.inputs) > 1 else None
    return alias.may_alias(
        record.type,
        perm=perm,
        shape=_dims(source.spec.shape),
        output_shape=_dims(output.shape) if output is not None else None,
        same_dtype=None if output is None or not output.dtype or not source.spec.dtype else output.dtype == source.spec.dtype,
    )


def _dims(shape) -> list[int | None] | None:
    return None if shape is None else [d if isinstance(d, int) and d >= 0 else None for d in shape]


def order_state_access(graph: GraphLowering) -> None:
    """Make every read of a state variable's old value happen before its first in-place write (module
    docstring). Run after the whole graph, ``NetOutput`` included, has been built.

    The reads are found from the variable down through ops that may alias it (:mod:`sgdfuse.lowering.alias`):
    a reader that can run before the write gets a control edge to it (and when it may alias, its own readers
    are reads of the variable too); a reader that cannot (it depends on the write, or it is ``NetOutput``)
    reads a ``TensorMove`` snapshot of what it read, taken before the write. Only readers ordered before the
    write are walked through, so a snapshot's source always runs before the write and no cycle is formed.
    """
    builder = graph.builder
    order = OpOrder(builder)
    readers = builder.readers()
    for variable_name, writers in graph.writers.items():
        first = writers[0]
        op_name = graph.variable_ops[variable_name]
        stack, seen = [(op_name, 0)], {(op_name, 0)}
        while stack:
            endpoint = stack.pop()
            for reader in dict.fromkeys(readers.get(endpoint, ())):
                if reader in writers or reader in graph.after_write:
                    continue
                record = builder.ops[reader]
                before = order.reaches(reader, first)
                if not before and record.type != "NetOutput" and not order.reaches(first, reader):
                    builder.add_control(first, reader)
                    order.add_edge(reader, first)
                    before = True
                if before:
                    if _may_alias(builder, reader) and (reader, 0) not in seen:
                        seen.add((reader, 0))
                        stack.append((reader, 0))
                    continue
                _snapshot_before(builder, order, readers, endpoint, reader, first, op_name)


def _snapshot_before(
    builder: GraphBuilder,
    order: OpOrder,
    readers: dict[tuple[str, int], list[str]],
    endpoint: tuple[str, int],
    reader: str,
    first: str,
    op_name: str,
) -> None:
    """Give ``reader`` a ``TensorMove`` copy of ``endpoint`` taken before the write ``first``."""
    record = builder.ops[reader]
    source = builder.ops[endpoint[0]].output(endpoint[1])
    snapshot = builder.add("TensorMove", f"{op_name}/before_{first}", [("x", source)], [("y", source.spec)])
    builder.add_control(first, snapshot.name)
    order.add_op(snapshot.name, [endpoint[0]])
    order.add_edge(snapshot.name, first)
    order.add_edge(snapshot.name, reader)
    record.inputs = [(port, snapshot.output(0) if t is not None and (t.op, t.index) == endpoint else t) for port, t in record.inputs]
    readers[endpoint] = [r for r in readers[endpoint] if r != reader] + [snapshot.name]
    readers[(snapshot.name, 0)] = [reader]


def prune(builder: GraphBuilder, roots: Sequence[str] = ("NetOutput", "SGD", "Assign", "Data")) -> None:
    """Remove ops nothing needs: keep ops of the ``roots`` types (outputs, in-place writers, graph inputs)
    and everything they transitively wait for."""
    live: set[str] = set()
    ops = builder.ops
    stack = [name for name, record in ops.items() if record.type in roots]
    while stack:
        name = stack.pop()
        if name in live:
            continue
        live.add(name)
        record = ops[name]  # GraphBuilder.predecessors, without its two lists per op
        stack.extend([t.op for _, t in record.inputs if t is not None])
        stack.extend(record.controls)
    for name in [n for n in builder.ops if n not in live]:
        del builder.ops[name]


def build_init_graph(
    plan: StatePlan, name: str, *, graph: GraphBuilder | GraphWriter | None = None
) -> tuple[GraphBuilder | GraphWriter, list[str], dict[str, str], list[Tensor]]:
    """The init graph: ``Assign`` each state variable its initial value.

    Args:
        graph: where the ops go; by default a :class:`GraphWriter` (nothing edits the init graph, so its ops
            are written as they are added). A :class:`GraphBuilder` gets the same ops as records.

    Returns:
        ``(graph, data op names in index order, data op name → ONNX graph input it takes, the graph's outputs:
        the Assign s' results, which the NetOutput reads)``.
    """
    # A graph of N updates assigns 3N variables with ops of a few classes (dtype, shape and source): each op
    # is added as its class's OpKind, so its tail is encoded once per class (graph_builder.OpKind).
    builder = graph if graph is not None else GraphWriter(name)
    data_ops: list[str] = []
    feeds: dict[str, str] = {}
    assigned: dict[str, Tensor] = {}
    outputs: list[Tensor] = []
    zero_values: dict[tuple, object] = {}
    assign_kinds: dict[tuple, OpKind] = {}
    refs: dict[str, Tensor] = {}
    for variable in plan.variables:  # first, so that no other op takes a variable's name
        spec = variable.spec
        kind = builder.kind("state variable", (spec.dtype, spec.shape), "Variable")
        refs[variable.name] = builder.add("Variable", variable.name, outputs=[("y", spec)], kind=kind, unconnected=[("x", spec)]).output(0)
    for variable in plan.variables:
        spec = variable.spec
        key = (spec.dtype, spec.shape)
        if variable.source == _SOURCE_INPUT:
            kind = builder.kind("initial value input", key, "Data", own=("index",))
            data = builder.add("Data", f"{variable.name}/initial_value", outputs=[("y", spec)], attrs={"index": len(data_ops)}, kind=kind, unconnected=[("x", spec)])
            data_ops.append(data.name)
            feeds[data.name] = variable.onnx_value
            value = data.output(0)
        elif variable.source == _SOURCE_INITIALIZER:
            value = add_const(builder, f"{variable.name}/initial_value", np.asarray(variable.initial), onnx_dtype=spec.dtype)
        elif spec.is_static:
            if key not in zero_values:  # one tensor per shape and dtype, shared by the Const ops
                zeros = np.zeros(tuple(spec.shape), dtype=onnx_to_numpy_dtype(spec.dtype))  # type: ignore[arg-type]
                zero_values[key] = ge_ir.AttrDef()
                zero_values[key].t.CopyFrom(tensor_def(zeros, onnx_dtype=spec.dtype))
            kind = builder.kind("zeros", key, "Const", {"value": zero_values[key]})
            zeros_spec = TensorSpec(f"{variable.name}/zeros", spec.shape, spec.dtype)
            value = builder.add("Const", f"{variable.name}/zeros", outputs=[("y", zeros_spec)], kind=kind).output(0)
        else:
            # Dynamic shape (950 series): zeros shaped like the parameters assigned in this graph.
            like = assigned[variable.shape_from]  # type: ignore[index]
            dims_spec = TensorSpec(f"{variable.name}/dims", (len(like.spec.shape),) if like.spec.shape is not None else (None,), onnx.TensorProto.INT64)
            dims = builder.add("Shape", f"{variable.name}/dims", [("x", like)], [("y", dims_spec)], {"dtype": ge_ir.ONNX_TO_GE_CPP_DTYPE[onnx.TensorProto.INT64]}).output(0)
            zero = add_const(builder, f"{variable.name}/zero", np.zeros((), dtype=onnx_to_numpy_dtype(spec.dtype)), onnx_dtype=spec.dtype)
            value = builder.add("Fill", f"{variable.name}/zeros", [("dims", dims), ("value", zero)], [("y", spec)]).output(0)
        assign_key = (key, value.spec.dtype, value.spec.shape)
        kind = assign_kinds.get(assign_key)
        if kind is None:
            kind = assign_kinds[assign_key] = builder.kind("initial assign", assign_key, "Assign", {"validate_shape": spec.is_static, "use_locking": False})
        assign = builder.add("Assign", f"{variable.name}/assign", [("ref", refs[variable.name]), ("value", value)], [("ref", spec)], kind=kind)
        assigned[variable.name] = value
        outputs.append(assign.output(0))
    builder.add("NetOutput", "NetOutput", [(f"x{k}", t) for k, t in enumerate(outputs)])
    return builder, data_ops, feeds, outputs
