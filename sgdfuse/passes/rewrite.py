"""Turn matched updates into ``ai.sgdfuse::SGD`` nodes: plan each rewrite, then apply accepted plans to a
copy of the model.

A plan is everything one fused update adds (the SGD node, helper nodes, scalar initializers). Plans are
verified before they are applied (:mod:`sgdfuse.verify`), so a failing one can be dropped while the rest of
the model is still optimised. Applying never touches a node that is not part of a fused update: the old
update's nodes are removed only when nothing else reads their outputs (a value someone reads is never
dropped), and the node order is otherwise kept.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import os
import re
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from google.protobuf import unknown_fields
from onnx import helper, numpy_helper

from sgdfuse.contract import SgdAttributes
from sgdfuse.fused_op import DOMAIN, OP_TYPE, Specialisation, ensure_sgd_function, make_sgd_node
from sgdfuse.passes.index import OWN_PREFIX, GraphIndex, _outer_reads, _subgraphs
from sgdfuse.passes.linear import Poly, format_poly
from sgdfuse.passes.sgd_match import MEMO_CHECK_ENV, Match
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = ["Plan", "Planner", "apply_plans", "ROLES_BY_PLAUSIBILITY"]

ROLES_BY_PLAUSIBILITY = "sgdfuse: roles from plausibility"
"""Written into an SGD node's ``doc_string`` when only plausibility decided its roles, so that ``lower``
can warn about a fused model it did not fuse itself."""

logger = logging.getLogger(__name__)

STAT_DESCRIPTION = (
    "zeros of the parameters' shape (ConstantOfShape of a constant shape when it is static, else of "
    "Shape(parameters); in FLOAT then Cast for BFLOAT16): the original "
    "graph applies dampening on every step it computes, which is the contract with stat = 0; stat_out is unused"
)


class _Made:
    """``Plan.nodes`` and ``Plan.sgd_node``: the plan's own nodes. A plan the planner replayed from its class's
    template (:class:`_Replay`) makes them when one of the two is first read; until then nothing can have
    changed them, so :func:`apply_plans` writes them into its output straight from the template (one copy of
    each node instead of two, and their names known without reading them back). A dataclass field with this
    descriptor as its "default" has no default (``__get__`` on the class raises ``AttributeError``)."""

    __slots__ = ("_slot", "_other")

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name
        self._other = "_sgd_node" if name == "nodes" else "_nodes"

    def __get__(self, plan: object, owner: type | None = None):
        if plan is None:
            raise AttributeError(self._slot)  # no default: the field stays a required argument
        value = plan.__dict__[self._slot]
        if type(value) is _Replay:
            _make(plan)
            value = plan.__dict__[self._slot]
        return value

    def __set__(self, plan: object, value: object) -> None:
        other = plan.__dict__.get(self._other)
        if type(other) is _Replay and other is not value:
            _make(plan)  # the other field keeps the nodes it would have had
        plan.__dict__[self._slot] = value


def _make(plan: object) -> None:
    """Make the nodes of a replayed ``plan`` (both fields at once: ``sgd_node`` is one of ``nodes``)."""
    replay = plan.__dict__["_nodes"]
    nodes, sgd = replay.make()
    plan.__dict__["_nodes"] = nodes
    plan.__dict__["_sgd_node"] = sgd


@dataclasses.dataclass
class Plan:
    """The rewrite of one :class:`Match`.

    Attributes:
        match: the update being fused.
        nodes: new nodes in order (helpers first, the SGD node last).
        initializers: new scalar initializers (learning rate, momentum) this plan introduced first.
        sgd_node: the fused node (also the last of ``nodes``).
        gradient_input: the value fed as ``gradient`` (the matched gradient, or its negation for maximize).
        learning_rate_input, momentum_input: values fed as ``learning_rate`` and ``momentum``.
        stat: how ``stat`` is provided (for the report).

    A replayed plan's nodes are made when first read (:class:`_Made`); :meth:`node_io`, :meth:`op_types` and
    :meth:`sgd_position` answer from its template until then, and from the nodes after.
    """

    match: Match
    nodes: list[onnx.NodeProto] = _Made()  # type: ignore[assignment]
    initializers: list[onnx.TensorProto]
    sgd_node: onnx.NodeProto = _Made()  # type: ignore[assignment]
    gradient_input: str
    learning_rate_input: str
    momentum_input: str
    stat: str

    def _replay(self) -> "_Replay | None":
        """The replay whose nodes are not made yet, or None."""
        value = self.__dict__.get("_nodes")
        return value if type(value) is _Replay else None

    def first_outputs(self) -> list[str | None]:
        """Per node, in order, its first output name (None for a node with no output)."""
        replay = self._replay()
        if replay is not None:
            rename = replay.names.get
            return [None if name is None else rename(name, name) for name in replay.template.first_outputs]
        first = []
        for node in self.nodes:
            names = node.output  # read once: each read of a protobuf field makes a new object
            first.append(names[0] if names else None)
        return first

    def node_io(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """Per node, in order, its input and output names as ``NodeProto.input`` and ``output`` hold them."""
        replay = self._replay()
        if replay is not None:
            return replay.io()
        return [(tuple(node.input), tuple(node.output)) for node in self.nodes]

    def op_types(self) -> list[str]:
        """Per node, in order, its ``op_type``."""
        replay = self._replay()
        if replay is not None:
            return list(replay.template.op_types)
        return [node.op_type for node in self.nodes]

    def sgd_position(self) -> int:
        """The place of :attr:`sgd_node` among :attr:`nodes`."""
        replay = self._replay()
        if replay is not None:
            return replay.template.sgd_position
        sgd = self.sgd_node
        return next(k for k, node in enumerate(self.nodes) if node is sgd)

    def sgd_node_name(self) -> str:
        """``sgd_node.name``."""
        replay = self._replay()
        if replay is not None:
            return replay.name(replay.template.sgd_position)
        return self.sgd_node.name

    def __getstate__(self) -> dict:
        # Pickling and copying take the nodes made: a replay holds the planner's container.
        if self._replay() is not None:
            _make(self)
        return self.__dict__


_new_plan = object.__new__  # Plan defines no __new__ (Planner._replayed fills a plan's __dict__ itself)


class _Replay:
    """The nodes of a plan replayed from ``template``, named by ``names`` (the first member's values and fresh
    names -> the member's), made into ``container`` (the planner's) when the plan's nodes are first read."""

    __slots__ = ("template", "names", "container")

    def __init__(self, template: "_Template", names: dict[str, str], container) -> None:
        self.template = template
        self.names = names
        self.container = container

    def make(self, container=None) -> tuple[list[onnx.NodeProto], onnx.NodeProto]:
        """The nodes, made in ``container`` (default: the planner's), and the SGD node among them."""
        add = (self.container if container is None else container).add
        nodes = [self.write(j, add()) for j in range(len(self.template.nodes))]
        return nodes, nodes[self.template.sgd_position]

    def write(self, j: int, node: onnx.NodeProto) -> onnx.NodeProto:
        """Node ``j`` written into the empty ``node``: the template's copy without names, then the names (about
        40% cheaper than copying the whole node and assigning its inputs and outputs again; the fields serialise
        in field order either way)."""
        stripped, name, inputs, outputs = self.template.nodes[j]
        rename = self.names.get
        node.CopyFrom(stripped)
        node.name = rename(name, name)  # set even when empty, as the direct plan's copy has it
        node.input.extend(map(rename, inputs, inputs))
        node.output.extend(map(rename, outputs, outputs))
        return node

    def name(self, j: int) -> str:
        name = self.template.nodes[j][1]
        return self.names.get(name, name)

    def io(self) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
        """Per node, its input and output names."""
        rename = self.names.get
        return [(tuple(map(rename, inputs, inputs)), tuple(map(rename, outputs, outputs))) for _, _, inputs, outputs in self.template.nodes]

    def reads_and_outputs(self) -> list[tuple[list[str], list[str]]]:
        """Per node, :func:`_reads_and_outputs` of the node made: its non-empty inputs renamed and what its
        subgraphs read from outside (the template's: a replay renames no name inside an attribute), and its
        non-empty outputs renamed."""
        rename = self.names.get
        result = []
        for (inputs, outputs), outer in zip(self.template.named, self.template.outer_reads):
            reads = list(map(rename, inputs, inputs))
            if outer:
                reads.extend(outer)
            result.append((reads, list(map(rename, outputs, outputs))))
        return result

    def renamed(self, name: str) -> str:
        """``name`` of the template's nodes, as this replay's nodes hold it."""
        return self.names.get(name, name)


@dataclasses.dataclass
class _Template:
    """The first plan of a structural class, the fresh names it made in order (``(requested, made)``), and its
    base name (:func:`_base_of`).

    The rest is derived from those once, so that replaying (:meth:`Planner._replayed`, once per member) only
    looks names up: ``slots``, the first match's values in the order :meth:`Planner._replayed` renames them,
    each with its number in :func:`_renamed_values` (values the match does not have left out); ``suffixes``,
    per fresh name made from the base, what followed the base and the name made; ``nodes``, per plan node, a
    copy without name, inputs and outputs, and those names; each node's op type, and which one is the SGD node."""

    plan: Plan
    fresh: list[tuple[str, str]]
    base: str
    slots: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    suffixes: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    nodes: list[tuple[onnx.NodeProto, str, tuple[str, ...], tuple[str, ...]]] = dataclasses.field(default_factory=list)
    op_types: tuple[str, ...] = ()
    sgd_position: int = 0
    outer_reads: tuple[list[str], ...] = ()
    """Per node, what its subgraphs read from outside (:func:`_reads`): the same in every replay (the names a
    replay renames are the nodes' own, not those inside their attributes)."""
    named: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    """Per node, its non-empty input and output names (a replay renames a name to a name, never to ``""``)."""
    sgd_overloads: tuple[str, ...] = ()
    """The overloads the SGD nodes among the nodes call (a replay copies them)."""
    first_outputs: tuple[str | None, ...] = ()
    """Per node, its first output name (None for a node with no output), as the template holds it."""
    wire_nodes: tuple[tuple[bytes, str, tuple[str, ...], tuple[str, ...]], ...] = ()
    """Per node, its stripped copy serialised (every field but the inputs, outputs and name, which come first in
    field order), its name, inputs and outputs: what the native writer reads (:func:`_write_nodes`)."""


# Characters a plan's names keep from the parameters' output name (compiled once: _base_of runs per plan).
_UNSAFE_NAME_CHARACTERS = re.compile(r"[^A-Za-z0-9_.:/-]")


def _base_of(match: Match) -> str:
    """The prefix of every name a plan makes for ``match``."""
    return "sgdfuse/" + _UNSAFE_NAME_CHARACTERS.sub("_", match.parameters_out)


def _renamed_values(match: Match) -> tuple[str | None, ...]:
    """The values of ``match`` a replayed plan renames, in order (:meth:`Planner._replayed`): parameters,
    gradient, buffer, their outputs, and the runtime learning rate and momentum (None when constant)."""
    return (
        match.parameters, match.gradient, match.accum, match.parameters_out, match.accum_out,
        _symbol(match.learning_rate), _symbol(match.momentum),
    )


def _single_symbol(poly: Poly) -> bool:
    """``poly`` is one runtime value, with coefficient 1 (the plan feeds it as it is, or casts it)."""
    if not poly.is_monomial:
        return False
    ((monomial, coefficient),) = poly.terms.items()
    return coefficient == 1 and len(monomial) == 1 and monomial[0][1] == 1


def _symbol(poly: Poly) -> str | None:
    """The runtime value of a :func:`_single_symbol` ``poly``, else None."""
    if poly.is_constant or not _single_symbol(poly):
        return None
    ((monomial, _),) = poly.terms.items()
    return monomial[0][0]


def _assert_same_plan(replayed: Plan, direct: Plan) -> None:
    """The class check: a replayed plan equals the one made directly, node for node and field for field."""
    def text(plan: Plan) -> list:
        return [n.SerializeToString(deterministic=True) for n in plan.nodes] + [
            [t.SerializeToString(deterministic=True) for t in plan.initializers],
            plan.gradient_input, plan.learning_rate_input, plan.momentum_input, plan.stat,
            plan.sgd_node.SerializeToString(deterministic=True),
        ]

    assert text(replayed) == text(direct), f"{direct.match.parameters_out}: the replayed plan differs from the direct one"


class Planner:
    """Makes :class:`Plan` s for the matches of one graph, with names that collide with nothing in it.

    Scalar constants are shared between plans: every update with learning rate 0.01 in FLOAT reads the same
    initializer.
    """

    def __init__(self, index: GraphIndex, opset: int = 18) -> None:
        self.index = index
        self.opset = opset
        # Every name a plan makes starts with OWN_PREFIX (_fresh), so only the graph's names that do can
        # collide with one: the value names among the index's tables, the node names as the index read them
        # (reading every node's name through protobuf cost as much as planning every update of a 50,000-update
        # graph). A name requested outside the prefix takes in every name first (_fresh).
        prefix = OWN_PREFIX
        self._taken: set[str] = set()
        for names in (index.producer, index.consumers, index.initializers, index.graph_inputs):
            self._taken.update(n for n in names if n.startswith(prefix))
        if index.own_node_names is None:
            # (A name that is not UTF-8 comes back as bytes, which no name made here equals.)
            self._taken.update(name for name in (n.name for n in index.graph.node) if type(name) is str and name.startswith(prefix))
        else:
            self._taken.update(index.own_node_names)
        self._every_name_taken = False
        self._constants: dict[tuple[str, int, bytes], str] = {}
        self._arena = onnx.GraphProto()  # holds every planned node (see _held)
        self._zeros: dict[int, onnx.TensorProto] = {}
        # How many shared constants of each role exist: their names are numbered in order of creation.
        self._role_counts: dict[str, int] = {}
        # Per structural class of the matcher: the first member's plan, replayed for the others (_Template).
        self._templates: dict[object, _Template] = {}
        self._templates_arena = onnx.GraphProto()
        self._fresh_log: list[tuple[str, str]] | None = None
        # Read once per planner, not once per plan (an environment look-up per plan cost about 5% of planning).
        self._check_classes = os.environ.get(MEMO_CHECK_ENV) == "1"

    def _fresh(self, base: str) -> str:
        if not base.startswith(OWN_PREFIX) and not self._every_name_taken:
            self._take_every_name()
        name, counter = base, 1
        while name in self._taken:
            name = f"{base}_{counter}"
            counter += 1
        self._taken.add(name)
        if self._fresh_log is not None:
            self._fresh_log.append((base, name))
        return name

    def _take_every_name(self) -> None:
        """Count every value and node name of the graph as taken (``__init__`` takes only those that start with
        :data:`OWN_PREFIX`, the only ones a name made from that prefix can meet)."""
        index = self.index
        for names in (index.producer, index.consumers, index.initializers, index.graph_inputs):
            self._taken.update(names)
        self._taken.update(n.name for n in index.graph.node)
        self._every_name_taken = True

    def _zero_value(self, dtype: int) -> onnx.TensorProto:
        """The ``value`` attribute of a ``ConstantOfShape`` of zeros in ``dtype`` (made once per dtype; the
        node copies it)."""
        if dtype not in self._zeros:
            self._zeros[dtype] = numpy_helper.from_array(np.zeros((1,), dtype=onnx_to_numpy_dtype(dtype)), name="value")
        return self._zeros[dtype]

    def _count_role(self, role: str) -> int:
        """How many shared constants of ``role`` were made before this one (then counts this one)."""
        count = self._role_counts.get(role, 0)
        self._role_counts[role] = count + 1
        return count

    def plan(self, match: Match) -> Plan:
        """The rewrite of ``match``. Raises :class:`~sgdfuse.errors.AttributeContractError` if the
        solved attributes break the contract (the matcher checks first, so this is a safeguard).

        Matches of one structural class of the matcher (``Match.structural_class``: one another's renaming,
        with equal constants, dtypes and shapes) take the same path through this method and differ only in
        names: the first member's plan is made here, and each other member's is that plan with its names
        replaced (:meth:`_replayed`), the fresh ones made in the same order from the member's own names, so
        the result is the plan this method would make. ``SGDFUSE_CHECK_CLASSES=1`` (the test suite) checks
        each replayed plan against one made directly."""
        key = self._template_key(match)
        if key is None:
            return self._plan(match)
        template = self._templates.get(key)
        if template is None:
            self._fresh_log = []
            try:
                plan = self._plan(match)
            finally:
                fresh, self._fresh_log = self._fresh_log, None
            # The template keeps copies: the caller owns the plan it is given (and may change it).
            self._templates[key] = self._template(self._pristine(plan), fresh, _base_of(match))
            return plan
        if self._check_classes:
            direct = self._shadow()._plan(match)
            plan = self._replayed(template, match)
            # Compared with nodes made apart: the plan handed out keeps its nodes unmade, as without the check.
            nodes, sgd = plan._replay().make(onnx.GraphProto().node)  # type: ignore[union-attr]
            _assert_same_plan(dataclasses.replace(plan, nodes=nodes, sgd_node=sgd), direct)
            return plan
        return self._replayed(template, match)

    def _template_key(self, match: Match) -> object | None:
        """The key under which ``match``'s plan can be replayed for its structural class, or None (plan it
        directly): plans whose texts, fresh names or helper subgraphs hold the names of other values (a
        first-step condition, a guard, a runtime momentum's If, a learning rate computed by helper nodes) are
        made one by one."""
        if match.structural_class is None or match.first_step is not None or match.guard is not None:
            return None
        if not match.momentum.is_constant:
            return None
        if not match.learning_rate.is_constant:
            # Fed as it is only when it is one value of the parameters' dtype (_scalar); else helper nodes
            # named after it compute it.
            symbol = _symbol(match.learning_rate)
            if symbol is None or self.index.spec(symbol).dtype != match.dtype:
                return None
        return match.structural_class

    def _replayed(self, template: _Template, match: Match) -> Plan:
        """``template``'s plan for ``match``: the first member's values renamed to ``match``'s, and each fresh
        name made again from ``match``'s base, in the order the first plan made them."""
        names: dict[str, str] = {}
        own = (match.parameters, match.gradient, match.accum, match.parameters_out, match.accum_out)
        for slot, old in template.slots:
            # Slots 5 and 6, the runtime learning rate and momentum, are read only where the first plan has one.
            names[old] = own[slot] if slot < 5 else _symbol(match.learning_rate if slot == 5 else match.momentum)
        base = _base_of(match)
        taken = self._taken
        fresh = self._fresh
        logged = self._fresh_log is not None
        for suffix, made in template.suffixes:
            name = base + suffix
            # _fresh inlined for the usual case: the name is free (base always starts with OWN_PREFIX).
            if logged or name in taken:
                name = fresh(name)
            else:
                taken.add(name)
            names[made] = name
        rename = names.get
        # The nodes are made when first read (_Made): apply_plans writes them into its output from the template.
        replay = _Replay(template, names, self._arena.node)
        plan = template.plan
        # What Plan(match, replay, [], replay, ...) makes, without its __init__ and the descriptor's two __set__
        # calls (each asks for the other field, which is not there yet or is this very replay): the fields in
        # __init__'s order, the two node fields in _Made's slots, one item at a time (as __init__ sets them: the
        # dict then shares its keys with every other plan's; dict.update made one of its own, twice the memory).
        made = _new_plan(Plan)
        fields = made.__dict__
        fields["match"] = match
        fields["_nodes"] = replay
        fields["initializers"] = []
        fields["_sgd_node"] = replay
        fields["gradient_input"] = rename(plan.gradient_input, plan.gradient_input)
        fields["learning_rate_input"] = rename(plan.learning_rate_input, plan.learning_rate_input)
        fields["momentum_input"] = rename(plan.momentum_input, plan.momentum_input)
        fields["stat"] = plan.stat
        return made

    def _template(self, plan: Plan, fresh: list[tuple[str, str]], base: str) -> _Template:
        """The :class:`_Template` of ``plan`` (already :meth:`_pristine`, whose nodes it strips of their names in
        place: the template's plan is its own)."""
        prefix = base + "/"
        # A fresh name requested outside the base is a shared constant's, made once for all plans.
        suffixes = [(requested[len(base):], made) for requested, made in fresh if requested.startswith(prefix)]
        nodes = []
        sgd_position = 0
        for k, node in enumerate(plan.nodes):
            entry = (node, node.name, tuple(node.input), tuple(node.output))
            node.ClearField("name")
            del node.input[:]
            del node.output[:]
            nodes.append(entry)
            if node is plan.sgd_node:
                sgd_position = k
        slots = [(slot, old) for slot, old in enumerate(_renamed_values(plan.match)) if old is not None]
        op_types = tuple(node.op_type for node, _, _, _ in nodes)
        outer_reads = tuple(_reads(node) for node, _, _, _ in nodes)  # stripped: no inputs, its subgraphs' reads only
        named = tuple((tuple(n for n in inputs if n), tuple(n for n in outputs if n)) for _, _, inputs, outputs in nodes)
        sgd_overloads = tuple(node.overload for node, _, _, _ in nodes if node.op_type == OP_TYPE and node.domain == DOMAIN)
        first_outputs = tuple(outputs[0] if outputs else None for _, _, _, outputs in nodes)
        wire_nodes = tuple((node.SerializeToString(), name, inputs, outputs) for node, name, inputs, outputs in nodes)
        return _Template(
            plan, fresh, base, slots, suffixes, nodes, op_types, sgd_position, outer_reads, named, sgd_overloads, first_outputs, wire_nodes,
        )

    def _pristine(self, plan: Plan) -> Plan:
        """``plan`` with copies of its nodes, kept apart from the plans handed out."""
        nodes = []
        for node in plan.nodes:
            copy = self._templates_arena.node.add()
            copy.CopyFrom(node)
            nodes.append(copy)
        sgd = nodes[next(k for k, node in enumerate(plan.nodes) if node is plan.sgd_node)]
        return dataclasses.replace(plan, nodes=nodes, initializers=[], sgd_node=sgd)

    def _shadow(self) -> "Planner":
        """A copy of this planner whose fresh names and constants are its own (for the class check)."""
        shadow = Planner.__new__(Planner)
        shadow.__dict__.update(self.__dict__)
        shadow._taken = set(self._taken)
        shadow._constants = dict(self._constants)
        shadow._role_counts = dict(self._role_counts)
        shadow._arena = onnx.GraphProto()
        shadow._templates = {}
        shadow._templates_arena = onnx.GraphProto()
        shadow._fresh_log = None
        return shadow

    def _plan(self, match: Match) -> Plan:
        """:meth:`plan`, made directly."""
        base = _base_of(match)
        nodes: list[onnx.NodeProto] = []
        initializers: list[onnx.TensorProto] = []

        gradient = match.gradient
        if match.maximize:
            gradient = self._fresh(f"{base}/negated_gradient")
            nodes.append(helper.make_node("Neg", [match.gradient], [gradient], name=self._fresh(f"{base}/Neg")))
        learning_rate = self._scalar(match.learning_rate, match.dtype, f"{base}/learning_rate", "learning_rate", nodes, initializers)
        momentum = self._scalar(match.momentum, match.dtype, f"{base}/momentum", "momentum", nodes, initializers)

        shape = self._fresh(f"{base}/stat_shape")
        stat = self._fresh(f"{base}/stat")
        if match.first_step is not None or self._static_dims(match) is None:
            nodes.append(helper.make_node("Shape", [match.parameters], [shape], name=self._fresh(f"{base}/Shape")))
        accum = match.accum
        # onnxruntime's CPU kernels lack BFLOAT16 Expand and Where: for BFLOAT16 the flag is built in FLOAT
        # and cast (exact: 0 and 1 are BFLOAT16 values).
        low = match.dtype == onnx.TensorProto.BFLOAT16
        work_dtype = onnx.TensorProto.FLOAT if low else match.dtype
        if match.first_step is None:
            zero = self._zero_value(work_dtype)
            stat_work = self._fresh(f"{base}/stat_float") if low else stat
            shape = self._static_shape(match, shape, nodes, initializers)
            nodes.append(helper.make_node("ConstantOfShape", [shape], [stat_work], name=self._fresh(f"{base}/ConstantOfShape"), value=zero))
            stat_text = STAT_DESCRIPTION
        else:
            # stat = 1 on the first step (no dampening), 0 after: the condition the graph selects with.
            first = match.first_step.condition
            if not match.first_step.when_true:
                first = self._fresh(f"{base}/first_step")
                nodes.append(helper.make_node("Not", [match.first_step.condition], [first], name=self._fresh(f"{base}/Not")))
            flag = self._fresh(f"{base}/first_step_flag")
            nodes.append(helper.make_node("Cast", [first], [flag], to=work_dtype, name=self._fresh(f"{base}/Cast")))
            stat_work = self._fresh(f"{base}/stat_float") if low else stat
            nodes.append(helper.make_node("Expand", [flag, shape], [stat_work], name=self._fresh(f"{base}/Expand")))
            stat_text = (
                f"1 where {match.first_step.condition} is {match.first_step.when_true} (the first step: no dampening), "
                "else 0; Expand(Cast(condition), Shape(parameters)); stat_out is unused"
            )
            if match.first_step.zero_accum:
                # The graph's first step ignores the old buffer (buf = grad); the contract computes
                # accum*m + grad, so the buffer is fed as zero on that step.
                zero_value = self._scalar(Poly.const(0.0), work_dtype, f"{base}/zero", "zero", nodes, initializers)
                source = match.accum
                if low:
                    source = self._fresh(f"{base}/accum_float")
                    nodes.append(helper.make_node("Cast", [match.accum], [source], to=work_dtype, name=self._fresh(f"{base}/Cast")))
                accum = self._fresh(f"{base}/accum_first_step_zeroed")
                zeroed = self._fresh(f"{base}/accum_zeroed_float") if low else accum
                nodes.append(helper.make_node("Where", [first, zero_value, source], [zeroed], name=self._fresh(f"{base}/Where")))
                if low:
                    nodes.append(helper.make_node("Cast", [zeroed], [accum], to=match.dtype, name=self._fresh(f"{base}/Cast")))
                stat_text += "; on the first step the buffer is fed as 0 (the graph ignores the old buffer then)"
        if low:
            nodes.append(helper.make_node("Cast", [stat_work], [stat], to=match.dtype, name=self._fresh(f"{base}/Cast")))
        stat_out = self._fresh(f"{base}/stat_out")

        accum_out = match.accum_out
        if not match.momentum.is_constant:
            # A runtime momentum may be 0, where the contract keeps the old buffer but this graph writes
            # m*buf + (1-d)*grad: the buffer output then comes from an If that recomputes it for m == 0 only.
            accum_out = self._fresh(f"{base}/accum_out")
        sgd = make_sgd_node(
            (match.parameters, gradient, learning_rate, accum, momentum, stat),
            (match.parameters_out, accum_out, stat_out),
            SgdAttributes(match.dampening, match.weight_decay, match.nesterov),
            name=self._fresh(f"{base}/SGD"),
            specialisation=self.specialisation(match, learning_rate, momentum),
        )
        sgd.doc_string = ROLES_BY_PLAUSIBILITY if match.roles_from == "plausibility" else f"sgdfuse: roles from {match.roles_from}"
        if match.guard is not None:
            # The graph's Where(condition, old, new) outputs stay and read this node's outputs.
            sgd.doc_string += f"; guarded: {match.guard.describe()}"
        nodes.append(sgd)
        if accum_out != match.accum_out:
            nodes.extend(self._momentum_zero_buffer(match, base, (match.parameters, gradient, accum, momentum, stat), accum_out))
            stat_text += (
                f"; momentum is the runtime value {momentum}: where it is 0 the buffer output is recomputed "
                "(If node) as the graph does, since the contract would keep the old buffer"
            )
        nodes, sgd = self._held(nodes, sgd)
        return Plan(match, nodes, initializers, sgd, gradient, learning_rate, momentum, stat_text)

    def _held(self, nodes: list[onnx.NodeProto], sgd: onnx.NodeProto) -> tuple[list[onnx.NodeProto], onnx.NodeProto]:
        """``nodes`` copied into the planner's one container, and the copy of ``sgd`` among them. A message of
        its own costs about twice the memory (protobuf gives each its own arena): 10,000 plans hold 20,000
        nodes."""
        held = []
        for node in nodes:
            copy = self._arena.node.add()
            copy.CopyFrom(node)
            held.append(copy)
        return held, held[next(k for k, node in enumerate(nodes) if node is sgd)]

    def specialisation(self, match: Match, learning_rate: str, momentum: str) -> Specialisation | None:
        """The specialised body the fused node of ``match`` can call (sgdfuse.fused_op.Specialisation), with
        ``learning_rate`` and ``momentum`` the values the plan feeds; None (the general body) when a scalar's
        rank is unknown or may exceed the parameters'.

        What is proved here: the dtype and attributes are the match's; the momentum is a non-zero constant
        when the match's momentum is a constant that stays non-zero in the dtype (as :meth:`_scalar` rounds
        it); stat is +0 when the graph has no first-step rule (the plan feeds ``ConstantOfShape`` zeros).
        """
        if match.dtype not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            return None
        parameters_rank = len(match.shape) if match.shape is not None else None
        for name in (learning_rate, momentum):
            known = name in self.index.producer or name in self.index.initializers or self.index.is_input_name(name)
            # A name the plan made is a rank-0 initializer or a Reshape to rank 0 (_scalar).
            shape = self.index.spec(name).shape if known else ()
            if shape is None or (len(shape) > 0 and (parameters_rank is None or len(shape) > parameters_rank)):
                return None
        momentum_nonzero = False
        if match.momentum.is_constant:
            value = np.array(match.momentum.constant_value if not match.momentum.is_zero else 0.0, dtype=np.float64)
            momentum_nonzero = bool(value.astype(np.float32).astype(onnx_to_numpy_dtype(match.dtype)) != 0)
        attributes = SgdAttributes(match.dampening, match.weight_decay, match.nesterov)
        return Specialisation.of(match.dtype, attributes, momentum_nonzero=momentum_nonzero, stat_zero=match.first_step is None)

    @staticmethod
    def _static_dims(match: Match) -> list[int] | None:
        if match.shape is None or not all(isinstance(d, int) and d >= 0 for d in match.shape):
            return None
        return [int(d) for d in match.shape]

    def _static_shape(self, match: Match, shape: str, nodes: list[onnx.NodeProto], initializers: list[onnx.TensorProto]) -> str:
        """The shape ``stat`` zeros are made with: a shared INT64 initializer when the parameters' shape is
        static (onnxruntime then folds the zeros into a constant once, instead of a Shape + ConstantOfShape
        every run), else ``shape`` (the Shape node's output)."""
        dims = self._static_dims(match)
        if dims is None:
            return shape
        array = np.array(dims, dtype=np.int64)
        key = ("stat_shape", onnx.TensorProto.INT64, array.tobytes())
        if key not in self._constants:
            name = self._fresh(f"sgdfuse/stat_shape_{self._count_role('stat_shape')}")
            self._constants[key] = name
            initializers.append(numpy_helper.from_array(array, name=name))
        return self._constants[key]

    def _momentum_zero_buffer(self, match: Match, base: str, inputs: tuple[str, str, str, str, str], fused_accum: str) -> list[onnx.NodeProto]:
        """``If(momentum == 0)``: then the contract's accum_t (accum*m + grad - grad*(1-stat)*d in FLOAT,
        cast back), which the graph writes; else the fused node's buffer output."""
        parameters, gradient, accum, momentum, stat = inputs
        f = onnx.TensorProto.FLOAT
        zero = self._fresh(f"{base}/momentum_zero_value")
        is_zero = self._fresh(f"{base}/momentum_is_zero")
        nodes: list[onnx.NodeProto] = []
        zero_float = self._const_node_value(0.0, f"{base}/zero_float", nodes)
        nodes.append(helper.make_node("CastLike", [zero_float, momentum], [zero], name=self._fresh(f"{base}/CastLike")))
        nodes.append(helper.make_node("Equal", [momentum, zero], [is_zero], name=self._fresh(f"{base}/Equal")))

        body: list[onnx.NodeProto] = []
        t = lambda tag: self._fresh(f"{base}/m0/{tag}")  # noqa: E731
        a, m, g = t("a"), t("m"), t("g")
        body += [
            helper.make_node("Cast", [accum], [a], to=f),
            helper.make_node("Cast", [momentum], [m], to=f),
            helper.make_node("Cast", [gradient], [g], to=f),
        ]
        grad = g
        if match.weight_decay != 0:
            pf, pwd, grad = t("p"), t("p_wd"), t("grad")
            body += [
                helper.make_node("Cast", [parameters], [pf], to=f),
                helper.make_node("Mul", [pf, self._const_node_value(match.weight_decay, f"{base}/m0/wd", body)], [pwd]),
                helper.make_node("Add", [g, pwd], [grad]),
            ]
        am, accum_t = t("a_m"), t("accum_t")
        body += [helper.make_node("Mul", [a, m], [am]), helper.make_node("Add", [am, grad], [accum_t])]
        if match.dampening != 0:
            sf, oms, gs, damp, damped = t("s"), t("one_minus_s"), t("grad_1ms"), t("damp"), t("accum_t_damped")
            body += [
                helper.make_node("Cast", [stat], [sf], to=f),
                helper.make_node("Sub", [self._const_node_value(1.0, f"{base}/m0/one", body), sf], [oms]),
                helper.make_node("Mul", [grad, oms], [gs]),
                helper.make_node("Mul", [gs, self._const_node_value(match.dampening, f"{base}/m0/d", body)], [damp]),
                helper.make_node("Sub", [accum_t, damp], [damped]),
            ]
            accum_t = damped
        then_out, else_out = t("then"), t("else")
        body.append(helper.make_node("CastLike", [accum_t, accum], [then_out]))
        shape = None if match.shape is None else list(match.shape)
        then_branch = helper.make_graph(body, f"{base}/momentum_zero", [], [helper.make_tensor_value_info(then_out, match.dtype, shape)])
        else_branch = helper.make_graph(
            [helper.make_node("Identity", [fused_accum], [else_out])], f"{base}/momentum_nonzero", [],
            [helper.make_tensor_value_info(else_out, match.dtype, shape)],
        )
        nodes.append(
            helper.make_node("If", [is_zero], [match.accum_out], name=self._fresh(f"{base}/If"), then_branch=then_branch, else_branch=else_branch)
        )
        return nodes

    def _const_node_value(self, value: float, base: str, nodes: list[onnx.NodeProto]) -> str:
        """Append a FLOAT scalar ``Constant`` node to ``nodes``; returns its output name."""
        name = self._fresh(base)
        nodes.append(
            helper.make_node(
                "Constant", [], [name], name=self._fresh(f"{base}/Constant"),
                value=numpy_helper.from_array(np.array(value, dtype=np.float32), name="value"),
            )
        )
        return name

    def _scalar(
        self,
        poly: Poly,
        dtype: int,
        base: str,
        role: str,
        nodes: list[onnx.NodeProto],
        initializers: list[onnx.TensorProto],
    ) -> str:
        """A value holding ``poly`` as one element of ``dtype``: a shared initializer for a constant, the
        runtime value itself when it already is exactly that, else a few nodes computing it in FLOAT."""
        np_dtype = onnx_to_numpy_dtype(dtype)
        if poly.is_constant:
            array = np.array(poly.constant_value if not poly.is_zero else 0.0, dtype=np.float64).astype(np.float32).astype(np_dtype)
            key = (role, dtype, array.tobytes())
            if key not in self._constants:
                name = self._fresh(f"sgdfuse/{role}_{self._count_role(role)}")
                self._constants[key] = name
                initializers.append(numpy_helper.from_array(array, name=name))
            return self._constants[key]
        if poly.is_monomial:
            ((monomial, coefficient),) = poly.terms.items()
            if coefficient == 1 and len(monomial) == 1 and monomial[0][1] == 1:
                symbol = monomial[0][0]
                if self.index.spec(symbol).dtype == dtype:
                    return symbol
        # General case: Σ c·Π symbol^k evaluated in FLOAT, then cast to the parameters' dtype.
        total: str | None = None
        for monomial, coefficient in sorted(poly.terms.items()):
            term = self._const_node_value(coefficient, f"{base}/coefficient", nodes)
            for symbol, power in monomial:
                as_float = self._fresh(f"{base}/{symbol}_float")
                nodes.append(helper.make_node("Cast", [symbol], [as_float], to=onnx.TensorProto.FLOAT, name=self._fresh(f"{base}/Cast")))
                for _ in range(abs(power)):
                    product = self._fresh(f"{base}/term")
                    op = "Mul" if power > 0 else "Div"
                    nodes.append(helper.make_node(op, [term, as_float], [product], name=self._fresh(f"{base}/{op}")))
                    term = product
            if total is None:
                total = term
            else:
                summed = self._fresh(f"{base}/sum")
                nodes.append(helper.make_node("Add", [total, term], [summed], name=self._fresh(f"{base}/Add")))
                total = summed
        shaped = self._fresh(f"{base}/scalar")
        shape = self._fresh(f"{base}/scalar_shape")
        nodes.append(
            helper.make_node(
                "Constant", [], [shape], name=self._fresh(f"{base}/Constant"),
                value=numpy_helper.from_array(np.zeros((0,), dtype=np.int64), name="value"),
            )
        )
        nodes.append(helper.make_node("Reshape", [total, shape], [shaped], name=self._fresh(f"{base}/Reshape")))
        result = self._fresh(base)
        nodes.append(helper.make_node("Cast", [shaped], [result], to=dtype, name=self._fresh(f"{base}/Cast")))
        return result


def shortest_float32(value: float) -> float:
    """``value`` as stored in a FLOAT attribute or tensor, written as the shortest decimal that round-trips
    there: 0.01, not 0.009999999776482582."""
    return float(str(np.float32(value)))


def describe_scalar(poly: Poly) -> str | float:
    """A report value for a coefficient: a float for a constant, else its expression over graph values."""
    return shortest_float32(poly.constant_value) if poly.is_constant else format_poly(poly)


def apply_plans(model: onnx.ModelProto, index: GraphIndex, plans: Sequence[Plan]) -> onnx.ModelProto:
    """A new model with ``plans`` applied; ``model`` is not modified. ``index`` is ``build_index(model)``.

    The work is proportional to the graph's size only where the output must be written anyway (each kept
    node is copied once); which old nodes go is decided from the index's reader lists, looking at the
    updates' nodes and their readers only.

    Raises:
        ValueError: the model's default-domain opset is below 15 (the SGD function body needs it); callers
            check :data:`sgdfuse.fused_op.MIN_OPSET` first.
    """
    if not plans:
        result = onnx.ModelProto()
        result.CopyFrom(model)
        return result
    old = _OldNodes(model.graph.node, index)
    # Plans replayed from their class's template whose nodes nobody has read (so nobody changed): their names
    # come from the template, and their nodes are written into the output from it (_write_nodes).
    replays = [plan._replay() for plan in plans]
    # What each new node reads and outputs, read from it once (each read of a protobuf field makes new objects).
    new_reads: list[list[str]] = []
    new_outputs: list[list[str]] = []
    for plan, replay in zip(plans, replays):
        if replay is None:
            for node in plan.nodes:
                reads_, outputs_ = _reads_and_outputs(node)
                new_reads.append(reads_)
                new_outputs.append(outputs_)
            continue
        for reads_, outputs_ in replay.reads_and_outputs():
            new_reads.append(reads_)
            new_outputs.append(outputs_)
    replaced_outputs = {name for plan in plans for name in (plan.match.parameters_out, plan.match.accum_out)}
    removed, is_read = _removed_nodes(old, index, plans, new_reads, replaced_outputs)

    # Scalars only the removed nodes read go with them; every other initializer stays. Whether a removed node
    # reads one is asked of its readers in the index (input slots), and of the removed nodes holding subgraphs
    # (outer reads): most of the graph is removed, and a set of everything it reads cost more than this.
    consumers = index.consumers
    read_by_removed_subgraphs = {name for i in removed if i in old.with_subgraphs for name in old.reads(i)}

    def read_by_removed(name: str) -> bool:
        return bool(name) and (name in read_by_removed_subgraphs or any(i in removed for i in consumers.get(name, ())))

    inputs = set(index.graph_inputs)
    outputs = set(index.graph_outputs)
    kept_initializers = [
        t for t in model.graph.initializer
        if not (read_by_removed(t.name) and not is_read(t.name) and t.name not in inputs and t.name not in outputs)
    ]
    gone_values: set[str] = set()
    facts = index.nodes
    for i in removed:  # set updates from the facts' tuples (the empty name dropped after): most of the graph
        gone_values.update(facts[i][3])
    gone_values.discard("")
    gone_values -= replaced_outputs

    # Order: every kept node at its old position, each plan's nodes at the position of its update's last
    # node, then a stable topological sort (a reader of a fused output placed earlier moves after it).
    kept = [i for i in range(len(old)) if i not in removed]
    entries: list[tuple[tuple[int, int], onnx.NodeProto | tuple[_Replay, int]]] = [((i, 0), old.node(i)) for i in kept]
    entry_reads = [old.reads(i) for i in kept] + new_reads
    for plan, replay in zip(plans, replays):
        anchor = max(plan.match.nodes) if plan.match.nodes else len(old)
        if replay is None:
            for j, node in enumerate(plan.nodes):
                entries.append(((anchor, 1 + j), node))
        else:
            for j in range(len(replay.template.nodes)):
                entries.append(((anchor, 1 + j), (replay, j)))  # written by _write_nodes
    available = inputs | {t.name for t in kept_initializers} | {t.name for plan in plans for t in plan.initializers}
    entry_outputs = [old.outputs(i) for i in kept] + new_outputs
    ordered = _stable_topological_sort(entries, available=available, reads=entry_reads, outputs=entry_outputs)

    # The new model is built field by field: the old node list is never copied whole (only the kept nodes).
    result = onnx.ModelProto()
    _copy_into(result, model, skip={"graph"})
    graph = result.graph
    _copy_into(graph, model.graph, skip={"node", "initializer", "value_info"})
    _write_nodes(graph, ordered)
    graph.initializer.extend(kept_initializers)
    graph.initializer.extend(t for plan in plans for t in plan.initializers)
    graph.value_info.extend(vi for vi in model.graph.value_info if vi.name not in gone_values)
    declared = _DeclaredTypes()
    for plan, replay in zip(plans, replays):
        declared.add(plan, replay)
    declared.write_to(graph)
    # The overloads the output's SGD nodes call, from what is known of them (every node read again cost about
    # as much as the rest of this tail): the kept ones by the index's facts, the new ones by their plans.
    overloads = {old.node(i).overload for i in kept if facts[i][0] == OP_TYPE and facts[i][1] == DOMAIN}
    for plan, replay in zip(plans, replays):
        if replay is None:
            overloads.update(node.overload for node in plan.nodes if node.op_type == OP_TYPE and node.domain == DOMAIN)
        else:
            overloads.update(replay.template.sgd_overloads)
    ensure_sgd_function(result, overloads)
    return result


class _DeclaredTypes:
    """Value infos for the values a plan adds whose type is certain: exactly what ONNX shape inference gives
    them in the output (tests/test_rewrite_value_info.py compares the two on every testdata model).

    Declared only when the parameters' shape is static (all known dimensions) and ``stat`` comes from
    ``ConstantOfShape`` (no first-step rule): ``stat`` (and the FLOAT ``stat_float`` it is cast from for
    BFLOAT16) and ``stat_out`` then have the parameters' shape, in the parameters' dtype (FLOAT for
    ``stat_float``): ``stat`` is ``ConstantOfShape`` of a constant of those dimensions, and the SGD function
    computes ``stat_out`` from ``stat`` alone.
    Without them every fused model lacked two types per update, and lowering's index had to run shape
    inference over the whole model (growing faster than linearly: 12.9 s at 50,000 updates); other values
    (first-step flags, computed learning rates, a runtime momentum's ``If``) stay undeclared, and inference
    then runs as before.
    Each tensor type is built and serialised once per (dtype, dims) (``helper.make_tensor_value_info`` builds
    a type anew, a message per dimension: about a sixth of ``apply_plans`` with one stat per update), and the
    value infos are written as their serialised bytes and parsed into the graph in one call: the same messages
    (a ``ValueInfoProto`` with the name and that type), without a field assignment and a copy per value."""

    def __init__(self) -> None:
        self._types: dict[tuple[int, tuple[int, ...]], bytes] = {}
        # Per (dtype, shape) of a match: the serialised type of its stat, or None (not declared).
        self._stat_types: dict[tuple[int, tuple | None], bytes | None] = {}
        self._chunks: list[bytes] = []

    def _type(self, dtype: int, dims: Sequence[int]) -> bytes:
        """``ValueInfoProto.type`` (field 2) of a tensor of ``dtype`` and ``dims``, serialised."""
        key = (dtype, tuple(dims))
        found = self._types.get(key)
        if found is None:
            typed = helper.make_tensor_type_proto(dtype, list(dims)).SerializeToString()
            found = self._types[key] = b"\x12" + _varint(len(typed)) + typed
        return found

    def add(self, plan: Plan, replay: _Replay | None = None) -> None:
        """Collect the value infos of what ``plan`` adds (:meth:`write_to` appends them); ``replay``: its
        :class:`_Replay` while its nodes are not made (their names are then the template's, renamed)."""
        match = plan.match
        if match.first_step is not None:
            return
        shape = match.shape
        key = (match.dtype, shape)
        typed = self._stat_types.get(key, _UNSET) if shape is None or type(shape) is tuple else _UNSET
        if typed is _UNSET:
            dims = Planner._static_dims(match)
            typed = None if dims is None else self._type(match.dtype, dims)
            if shape is None or type(shape) is tuple:
                self._stat_types[key] = typed
        if typed is None:
            return
        if replay is not None:
            template = replay.template
            if match.dtype == onnx.TensorProto.BFLOAT16:
                dims = Planner._static_dims(match)
                for (_, _, _, outputs), op_type in zip(template.nodes, template.op_types):
                    if op_type == "ConstantOfShape":
                        self._declare(replay.renamed(outputs[0]), self._type(onnx.TensorProto.FLOAT, dims))  # stat_float
            _, _, sgd_inputs, sgd_outputs = template.nodes[template.sgd_position]
            self._declare(replay.renamed(sgd_inputs[5]), typed)
            self._declare(replay.renamed(sgd_outputs[2]), typed)
            return
        sgd = plan.sgd_node
        if match.dtype == onnx.TensorProto.BFLOAT16:
            dims = Planner._static_dims(match)
            for node in plan.nodes:
                if node.op_type == "ConstantOfShape":
                    self._declare(node.output[0], self._type(onnx.TensorProto.FLOAT, dims))  # stat_float
        self._declare(sgd.input[5], typed)
        self._declare(sgd.output[2], typed)
        # A maximize update's negated gradient is left undeclared: its type is the gradient's as inference reads
        # it, which need not be the index's (a gradient input that is also a graph output declared otherwise is
        # read with the output's declaration), whereas stat's shape is that of the constant ConstantOfShape reads.

    def _declare(self, name: str, typed: bytes) -> None:
        encoded = name.encode("utf-8")
        size = len(encoded)
        # ValueInfoProto: name (field 1), type (field 2); in GraphProto.value_info (field 13)
        body = b"\n" + (_ONE_BYTE[size] if size < 0x80 else _varint(size)) + encoded + typed
        size = len(body)
        self._chunks.append(b"j" + (_ONE_BYTE[size] if size < 0x80 else _varint(size)) + body)

    def write_to(self, graph: onnx.GraphProto) -> None:
        """Append the value infos collected to ``graph.value_info``, in the order of the plans."""
        if self._chunks:
            graph.MergeFromString(b"".join(self._chunks))


_UNSET = object()
_ONE_BYTE = [bytes((n,)) for n in range(0x80)]  # the varints of one byte


def _varint(value: int) -> bytes:
    """``value`` (>= 0) in protobuf's varint encoding."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class _OldNodes:
    """The nodes of the graph being rewritten, by position: their reads and outputs from the index's node facts,
    the protobuf read only for what subgraphs read."""

    def __init__(self, nodes, index: GraphIndex) -> None:
        self._nodes = nodes
        self._facts = index.nodes
        self._with_subgraphs = set(index.subgraph_nodes)
        self._reads: dict[int, list[str]] = {}

    @property
    def with_subgraphs(self) -> set[int]:
        """The positions of the nodes that hold a subgraph (whose reads are more than their inputs)."""
        return self._with_subgraphs

    def __len__(self) -> int:
        return len(self._facts)

    def node(self, i: int) -> onnx.NodeProto:
        return self._nodes[i]

    def outputs(self, i: int) -> Sequence[str]:
        """The names node ``i`` outputs (empty slots left out)."""
        names = self._facts[i][3]
        return [n for n in names if n] if "" in names else names

    def inputs(self, i: int) -> Sequence[str]:
        """The names node ``i`` lists as inputs (empty slots left out)."""
        names = self._facts[i][2]
        return [n for n in names if n] if "" in names else names

    def reads(self, i: int) -> Sequence[str]:
        """What node ``i`` reads (:func:`_reads`): its inputs, and what its subgraphs read from outside."""
        if i not in self._with_subgraphs:
            return self.inputs(i)
        names = self._reads.get(i)
        if names is None:
            names = self._reads[i] = _reads(self._nodes[i])
        return names


def _removed_nodes(
    old: _OldNodes, index: GraphIndex, plans: Sequence[Plan], new_reads: list[list[str]], replaced_outputs: set[str]
) -> tuple[set[int], Callable[[str], bool]]:
    """The old nodes the plans remove, and whether a value is read after the rewrite (``replaced_outputs``: the
    updates' outputs, which the fused nodes now produce).

    The fused node now produces each update's outputs: their old producers go. Another node of an update's
    cone goes only if nothing reads its outputs after the rewrite (neither a kept node, a subgraph, a new
    node nor the graph's outputs); cone nodes are visited last to first, so a chain of helpers goes whole.
    A value is read after the rewrite when one of its readers in the index (one per input slot of every
    node, and the nodes whose subgraphs read it from the outer scope) is not removed, or a new node reads it
    (``new_reads``: what each new node reads). This is the count of reads the index gives, less the removed
    readers' reads, plus the new ones, being non-zero: each of the three parts is a count of its own, so
    their sum is zero exactly when every reader is removed and no new node reads the value; asking the
    readers spares a count update per input of every removed node (most of the graph in a pure optimizer
    step).
    """
    cone = set().union(*(plan.match.nodes for plan in plans))
    # A value has one producer (ONNX graphs are in SSA form; build_index's table): the replaced outputs'
    # producers in the cone are found by name, not by reading every cone node's outputs.
    producer = index.producer
    removed: set[int] = {k for k in (producer.get(name) for name in replaced_outputs) if k is not None and k in cone}

    outer: dict[str, list[int]] = {}  # value -> the nodes whose subgraphs read it from the outer scope
    for i in index.subgraph_nodes:
        for name in old.reads(i)[len(old.inputs(i)):]:
            outer.setdefault(name, []).append(i)
    new_read: set[str] = set()
    for names in new_reads:
        new_read.update(names)
    consumers = index.consumers
    facts = index.nodes
    # Whether a node is removed, by position, next to the set: a byte per node stays in the CPU's caches where
    # a set of most of a large graph's positions does not (a look-up per reader of every cone node's outputs).
    gone = bytearray(len(facts))
    for k in removed:
        gone[k] = 1

    def is_read(name: str) -> bool:
        if name in new_read:
            return True
        return any(not gone[r] for r in consumers.get(name, ())) or any(not gone[r] for r in outer.get(name, ()))

    # Read after the rewrite whatever else: a graph output, or a value a new node reads (one set, one look-up).
    kept_anyway = set(index.graph_outputs) | new_read
    # The loop below runs over every cone node (most of the graph in a pure optimizer step): the look-ups
    # are inlined, and the names read from the index's facts (an empty name, an omitted slot, is skipped).
    consumers_get = consumers.get
    # Last to first removes a chain of helpers whole in a graph in topological order; in a graph out of it a
    # helper can come before its reader, so the sweep is repeated until it removes nothing more.
    while True:
        removed_before = len(removed)
        _sweep_cone(cone, removed, gone, facts, kept_anyway, outer, is_read, consumers_get)
        if index.in_order or len(removed) == removed_before:
            break
    return removed, is_read


def _sweep_cone(cone: set[int], removed: set[int], gone: bytearray, facts, kept_anyway: set[str], outer: dict,
                is_read: Callable[[str], bool], consumers_get) -> None:
    """One pass of :func:`_removed_nodes` over the cone's nodes not yet removed, last to first: a node none of whose
    outputs is read after the rewrite is removed (added to ``removed``, marked in ``gone``)."""
    for i in sorted(cone - removed, reverse=True):
        read = False
        for o in facts[i][3]:
            if not o:
                continue
            if o in kept_anyway or o in outer and is_read(o):
                read = True
                break
            readers = consumers_get(o)
            if readers is not None:
                for r in readers:
                    if not gone[r]:
                        read = True
                        break
                if read:
                    break
        if not read:
            removed.add(i)
            gone[i] = 1


def _write_nodes(graph: onnx.GraphProto, ordered: list) -> None:
    """Append ``ordered`` to ``graph.node``: a node is copied (runs of them in one call), a ``(replay, j)`` entry
    is node ``j`` of the replay, written once: natively, a run of them serialised by ``_splice.node_wires`` (the
    node :meth:`_Replay.write` makes, its fields in number order: inputs, outputs, name, then the template's
    bytes of the rest, :attr:`_Template.wire_nodes`) and parsed into ``graph`` in one ``MergeFromString``
    (merging appends to a repeated field), which makes the same message; else (no native writer, or it
    refuses) :meth:`_Replay.write` in place. tests/test_plan_replay.py holds the two to equal bytes."""
    target = graph.node
    wires = _native_writer()
    run: list[onnx.NodeProto] = []
    replayed: list[tuple[_Replay, int]] = []
    for item in ordered:
        if type(item) is tuple:
            if run:
                target.extend(run)
                run = []
            if wires is None:
                replay, j = item
                replay.write(j, target.add())
            else:
                replayed.append(item)
        else:
            if replayed:
                _write_replayed(graph, replayed, wires)
                replayed = []
            run.append(item)
    if run:
        target.extend(run)
    if replayed:
        _write_replayed(graph, replayed, wires)


def _write_replayed(graph: onnx.GraphProto, items: list, wires) -> None:
    """Append the replayed nodes ``items`` (``(replay, j)``) to ``graph.node`` through the native ``wires``, or
    one by one (:meth:`_Replay.write`) when it refuses them (nothing is appended then)."""
    try:
        data = wires(items)
    except (TypeError, ValueError, IndexError, AttributeError) as error:  # a name protobuf would refuse too
        logger.debug("native node writer refused a run of replayed nodes, writing them one by one: %s", error)
        add = graph.node.add
        for replay, j in items:
            replay.write(j, add())
        return
    graph.MergeFromString(data)


_SPLICE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_splice.cc")


def _native_writer():
    """``_splice.node_wires``, or None when the native scanners are off (``$SGDFUSE_NATIVE_SCAN=0``) or it does
    not build (why is logged at debug level; :func:`sgdfuse.passes.scan.build_extension`)."""
    from pathlib import Path

    from sgdfuse.errors import NativeBuildError
    from sgdfuse.native import cache_root
    from sgdfuse.passes.scan import NATIVE_ENV, build_extension

    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return None
    try:
        module = build_extension(Path(_SPLICE_SOURCE), "sgdfuse.passes._splice", "splice", "the native node writer", root=str(cache_root())).module
    except NativeBuildError as error:
        logger.debug("native node writer unavailable, writing replayed nodes through protobuf: %s", error)
        return None
    return module.node_wires


def _copy_into(target, source, *, skip: set[str]) -> None:
    """Copy every field of ``source`` but ``skip`` into the empty message ``target`` of the same type. A
    message with fields this ``onnx`` does not know (unknown fields) is copied whole and the skipped fields
    cleared, so nothing of it is lost."""
    if len(unknown_fields.UnknownFieldSet(source)):
        target.CopyFrom(source)
        for name in skip:
            target.ClearField(name)
        return
    for field, value in source.ListFields():
        if field.name not in skip:
            _set_field(target, field, value)


def _set_field(target, field, value) -> None:
    # ``is_repeated`` is the newer protobuf's name for ``label == LABEL_REPEATED`` (removed there).
    repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
    if repeated:
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _reads_and_outputs(node: onnx.NodeProto) -> tuple[list[str], list[str]]:
    """:func:`_reads` of ``node`` and the names it outputs (empty slots left out), each field read once."""
    names = list(node.input)
    if "" in names:
        names = [name for name in names if name]
    for attribute in node.attribute:
        kind = attribute.type
        if kind == onnx.AttributeProto.GRAPH or kind == onnx.AttributeProto.GRAPHS:
            for sub in _subgraphs(attribute):
                names.extend(_outer_reads(sub))
    outputs = list(node.output)
    if "" in outputs:
        outputs = [name for name in outputs if name]
    return names, outputs


def _reads(node: onnx.NodeProto) -> list[str]:
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for sub in _subgraphs(attribute):
            names.extend(_outer_reads(sub))
    return names


def _stable_topological_sort(
    entries: list[tuple[tuple[int, int], onnx.NodeProto]],
    available: set[str],
    reads: list[list[str]] | None = None,
    outputs: list[list[str]] | None = None,
) -> list[onnx.NodeProto]:
    """Kahn's algorithm, always taking the ready node with the smallest original position. ``reads``: what
    each entry's node reads (:func:`_reads`), ``outputs`` the names it outputs, when already known."""
    if reads is None:
        reads = [_reads(node) for _, node in entries]
    if outputs is None:
        outputs = [list(node.output) for _, node in entries]
    producer: dict[str, int] = {}
    for k, names in enumerate(outputs):
        for name in names:
            if name:
                producer[name] = k
    # When the entries in position order already respect every dependency (no reader placed before what it
    # reads), that order is the result: the smallest entry left is then always ready, so Kahn's algorithm
    # would take them in that very order. Checked per read first; the dependencies are collected and the
    # heap runs only otherwise.
    keys = [(entry[0], k) for k, entry in enumerate(entries)]
    keyed = sorted(range(len(entries)), key=keys.__getitem__)
    rank = [0] * len(entries)
    for r, k in enumerate(keyed):
        rank[k] = r
    producer_get = producer.get
    # (A name read twice is asked twice, which changes no answer; no set per entry.)
    in_order = True
    for k, names in enumerate(reads):
        own = rank[k]
        for name in names:
            source = producer_get(name)
            if source is not None and rank[source] > own and name not in available:
                in_order = False
                break
        if not in_order:
            break
    if in_order:
        return [entries[k][1] for k in keyed]
    edges: list[tuple[int, int]] = []
    for k, names in enumerate(reads):
        for name in set(names) if len(names) > 1 else names:
            source = producer_get(name)
            if source is not None and source != k and name not in available:
                edges.append((source, k))
    waiting: list[int] = [0] * len(entries)
    dependants: dict[int, list[int]] = {}
    for source, k in edges:
        waiting[k] += 1
        dependants.setdefault(source, []).append(k)
    ready = [(entries[k][0], k) for k in range(len(entries)) if waiting[k] == 0]
    heapq.heapify(ready)
    order: list[onnx.NodeProto] = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(entries[k][1])
        for d in dependants.get(k, ()):
            waiting[d] -= 1
            if waiting[d] == 0:
                heapq.heappush(ready, (entries[d][0], d))
    if len(order) != len(entries):
        raise ValueError("the rewritten graph has a cycle; this is a bug in sgdfuse, please report it")
    return order
