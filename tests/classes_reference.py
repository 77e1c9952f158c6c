"""The structural classes' clustering and keys as they were before issue 12, kept as the reference that
``sgdfuse.passes.classes`` is held to (tests/test_classes_reference.py).

The walk, the union of regions and the keys below are ``sgdfuse/passes/classes.py`` of commit 06e5390,
verbatim but for this docstring, the parts of the module the tests do not need (``find_by_class``) and
``name_facts_of`` at the end, the matcher's name facts of that commit (``sgd_match.name_facts_of``), which
answered one name at a time. This implementation makes each key a value at a time, with Python calls for
each value's facts; the present one reads the same facts in passes of builtins over a batch of clusters, and
must find the same clusters, values and nodes, and keys equal exactly when these are.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet

import onnx

from sgdfuse.passes.index import GraphIndex

__all__ = ["Cluster", "clusters_of", "name_facts_of"]

logger = logging.getLogger(__name__)

ENTERED_OPS = frozenset(
    {
        "Identity", "Cast", "CastLike", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Flatten", "Gather", "Neg",
        "Reciprocal", "ConstantOfShape", "Add", "Sub", "Mul", "Div", "Sum", "Constant", "Shape",
    }
)
"""Default-domain ops whose inputs the region walk enters: every op the normaliser (:mod:`sgdfuse.passes.linear`)
reads through for forms or scalars, plus ``Shape`` and ``Constant``. The output of any other op is a leaf of
the region, keyed by its op type (the matcher does not look behind it when it fuses)."""

DIRECT_OPS = frozenset({"Where", "If", "Loop", "Scan"})
"""Ops the matcher reads into (a first-step ``Where``, an ``If`` on one boolean) in ways the key does not
capture: a cluster holding one is solved directly."""

MAX_REGION = 512
"""A cluster with more values than this is solved directly (no class would share its cost)."""

_NAMED_DTYPES = frozenset({0, onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})
"""Dtypes of values whose names the matcher may read (state, gradients; 0: unknown)."""

MAX_WALK = 20_000
"""A region with more values than this stops per-class matching altogether (the whole graph is solved
directly): clustering needs every region whole, and walking many such regions would cost more than solving."""


class _TooLarge(Exception):
    """A region exceeded :data:`MAX_WALK`."""


SHARED_SCALAR_REGIONS = 4
"""A one-element value read by more regions than this (a learning rate fed to every update) links no
clusters: it is keyed by name instead."""


@dataclasses.dataclass
class Cluster:
    """Graph outputs solved together, and the walk that keys them.

    Attributes:
        outputs: the float graph outputs of the cluster, in graph order.
        extras: outputs of other clusters (computed only from shared values) that the matcher may pair with
            these, passed along and keyed by name.
        values: the region's value names in canonical order (local values only).
        nodes: the region's node indices in canonical order.
        key: the class key (None: solve directly).
    """

    outputs: list[str]
    extras: list[str] = dataclasses.field(default_factory=list)
    values: list[str] = dataclasses.field(default_factory=list)
    nodes: list[int] = dataclasses.field(default_factory=list)
    key: tuple | None = None


_LEAF_STEP: tuple = (None, (), False, ())
"""The step of a value no node produces (a graph input, an initializer, an undefined name)."""

_DEFAULT_DOMAINS = ("", "ai.onnx")

_NOTHING: frozenset[str] = frozenset()
"""The fringe of a region without one (one object for all of them)."""

_LISTED, _WALKED = "listed", "walked"
"""What the region walk (:func:`_walk_regions`) has seen of a value."""


_COPY_OPS = frozenset({"Identity", "Cast", "CastLike"})


def _steps(nodes: Sequence[tuple]) -> dict[str, tuple]:
    """The walk's step (:meth:`_Walker.step`) of every value a node outputs, one tuple per node shared by its
    outputs; a later producer of a name wins, as in the index's ``producer``."""
    steps: dict[str, tuple] = {}
    entered, direct_ops, default = ENTERED_OPS, DIRECT_OPS, _DEFAULT_DOMAINS
    for k, (op, domain, inputs, outputs, subgraph, _) in enumerate(nodes):
        direct = subgraph or op in direct_ops
        step = (k, inputs, direct, ()) if op in entered and domain in default else (None, (), direct, inputs)
        for name in outputs:
            if name:
                steps[name] = step
    return steps


class _Walker:
    """Regions of graph outputs, with per-node facts read from the protobuf once.

    Every table here is filled lazily and looked up inline by the hot loops (:func:`_walk_regions`, :func:`_key`):
    at ten thousand updates the walk asks for a value's step some four hundred thousand times, and a method
    call per ask cost more than the look-up it wraps."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self._nodes = index.graph.node
        self._node_facts = index.nodes
        self._distinct: dict[tuple, tuple] = {}
        self._value_facts: dict[str, tuple] = {}
        self._steps = _steps(index.nodes)
        self._constants: dict[str, bool] = {}
        self._below: dict[frozenset[str], list[str]] = {}
        self.outputs = set(index.graph_outputs)

    def node_facts(self, k: int) -> tuple:
        """``(op_type, domain, inputs, outputs, has subgraph, has attributes)`` of node ``k`` (the index's
        :data:`~sgdfuse.passes.index.NodeFacts`)."""
        return self._node_facts[k]

    def attributes(self, k: int) -> bytes:
        """Node ``k``'s attributes, serialised deterministically (a ``Constant``'s value, a ``Cast``'s type)."""
        if not self._node_facts[k][5]:
            return b""
        return b"".join(a.SerializeToString(deterministic=True) for a in self._nodes[k].attribute)

    def step(self, value: str) -> tuple[int | None, tuple[str, ...], bool, tuple[str, ...]]:
        """``(producer entered or None, its inputs, whether the producer makes the region direct, the inputs of
        a producer not entered)``: the matcher reads the operands of a leaf's producer (to name a buffer
        hidden behind it), so those are listed in the region, but not entered."""
        return self._steps.get(value, _LEAF_STEP)

    def copy_chain(self, value: str) -> list[str]:
        """``value`` and the values it copies through ``Identity``, ``Cast`` and ``CastLike``, nearest first (a
        superset of the matcher's own copy rule, which follows only float-to-float casts)."""
        producer = self.index.producer
        k = producer.get(value)
        if k is None or self._node_facts[k][0] not in _COPY_OPS:
            return [value]  # most values: no copy behind them
        chain = [value]
        seen = {value}
        while k is not None:
            op, domain, inputs = self._node_facts[k][:3]
            if domain not in _DEFAULT_DOMAINS or op not in _COPY_OPS or not inputs or not inputs[0] or inputs[0] in seen:
                break
            value = inputs[0]
            seen.add(value)
            chain.append(value)
            k = producer.get(value)
        return chain

    def shared_below(self, roots: frozenset[str]) -> list[str]:
        """``roots`` and every value the walk enters below them, sorted (cached per set of roots)."""
        cached = self._below.get(roots)
        if cached is None:
            seen = set(roots)
            stack = list(roots)
            while stack:
                for name in self.step(stack.pop())[1]:
                    if name and name not in seen:
                        seen.add(name)
                        stack.append(name)
            cached = self._below[roots] = sorted(seen)
        return cached

    def behind_copies_not_entered(self, output: str, chain: list[str] | None = None) -> bool:
        """True when ``output``, past its copies (``chain``, its :meth:`copy_chain` if known), comes out of an op
        the walk does not enter (the matcher then looks behind that op for an update it passes through)."""
        k = self.index.producer.get((chain or self.copy_chain(output))[-1])
        if k is None:
            return False
        op, domain = self._node_facts[k][:2]
        return domain not in _DEFAULT_DOMAINS or op not in ENTERED_OPS

    def value_facts(self, value: str) -> tuple:
        """What the key holds of ``value`` besides its name facts: its spec and how it is defined (the
        defining node's inputs are added by the caller, as positions)."""
        facts = self._value_facts.get(value)
        if facts is None:
            facts = self._value_facts[value] = self._facts_of(value)
        return facts

    def _facts_of(self, value: str) -> tuple:
        """:meth:`value_facts`, uncached."""
        index = self.index
        k = index.producer.get(value)
        if k is not None:
            op, domain, _, outputs, _, has_attributes = self._node_facts[k]
            if domain in _DEFAULT_DOMAINS and op in ENTERED_OPS:
                attributes = self.attributes(k) if has_attributes else b""
                kind: tuple = ("node", op, domain, outputs.index(value) if len(outputs) > 1 else 0, len(outputs), attributes)
            else:
                kind = ("computed", op, domain, outputs.index(value) if len(outputs) > 1 else 0, len(outputs), b"")
        elif value in index.initializers:
            if index.is_input_name(value):
                kind = ("initializer-input",)
            else:
                constant = index.constant(value)
                kind = ("initializer", None if constant is None else (str(constant.dtype), constant.shape, constant.tobytes()))
        elif index.is_input_name(value):
            kind = ("input",)
        else:
            kind = ("undefined",)
        spec = index.specs.get(value)
        facts = (0, None, kind, value in self.outputs) if spec is None else (spec.dtype, spec.shape, kind, value in self.outputs)
        # One tuple per distinct fact: most values of a step share theirs, and equal keys then compare by
        # identity.
        return self._distinct.setdefault(facts, facts)

    def is_constant(self, value: str) -> bool:
        """A small compile-time constant (``GraphIndex.constant``: its bytes are keyed)."""
        known = self._constants.get(value)
        if known is None:
            k = self.index.producer.get(value)
            if k is not None and self._node_facts[k][0] != "Constant":
                known = False  # only a Constant node's output is a constant among computed values
            elif k is None and value not in self.index.initializers:
                known = False
            else:
                known = self.index.constant(value) is not None
            self._constants[value] = known
        return known


def clusters_of(
    index: GraphIndex,
    outputs: Sequence[str],
    name_facts: Callable[[str, bool], tuple],
    form_leaves: Callable[[str], set[str]],
    *,
    lazy: bool = False,
) -> Iterable[Cluster]:
    """The clusters of ``outputs`` (float graph outputs, in graph order), each keyed (or marked direct); with
    ``lazy``, a generator that keys each cluster as it is taken (so that a caller dropping them never holds
    every key at once).

    ``name_facts(name, is_output)`` returns the matcher's facts drawn from a name: ``(flags, previous, next)`` with
    ``flags`` a tuple (conventions, pins), ``previous`` the input the name says it replaces and ``next`` the
    output named as its next value (or None);
    ``form_leaves(output)`` the leaves of an output's linear form (asked only of outputs computed from shared
    values alone).
    """
    walker = _Walker(index)
    regions, fringes, direct, appearances = _walk_regions(walker, outputs)
    cluster_of, members = _union(walker, outputs, appearances)
    shared = set()
    for value, readers in appearances.items():
        if len(readers) > 1:
            root = cluster_of[readers[0]]
            for o in readers:
                if cluster_of[o] != root:
                    shared.add(value)
                    break
    del appearances

    # Outputs computed from shared values alone (a learning-rate schedule lr*0.99): the matcher may pair them
    # with any cluster whose region holds their form's leaves, so they go along as keyed extras.
    loose = [o for o, values in regions.items() if values is not None and _loose(walker, values, fringes[o], shared)]
    loose_leaves = {o: form_leaves(o) for o in loose}

    clusters: list[Cluster] = []
    pending: set[int] = set()
    # The loose outputs' own results come from solving them together, directly.
    loose_cluster = Cluster([o for o in outputs if o in loose_leaves])
    for outs in members.values():
        if loose_leaves:
            outs = [o for o in outs if o not in loose_leaves]
            if not outs:
                continue
        cluster = Cluster(outs)
        if loose_leaves:
            region_values = {value for o in outs for value in regions[o] or (o,)}
            cluster.extras = [v for v, leaves in loose_leaves.items() if leaves and leaves <= region_values]
        if not any(o in direct or o in shared for o in outs):
            pending.add(id(cluster))
        clusters.append(cluster)
    if loose_cluster.outputs:
        clusters.append(loose_cluster)

    def keyed(cluster: Cluster) -> Cluster:
        if id(cluster) in pending:
            _key(walker, cluster, regions, fringes, shared, name_facts)
        return cluster

    return (keyed(c) for c in clusters) if lazy else [keyed(c) for c in clusters]


def _walk_regions(
    walker: _Walker, outputs: Sequence[str]
) -> tuple[dict[str, list[str] | None], dict[str, AbstractSet[str]], set[str], dict[str, list[str]]]:
    """Walk the outputs' regions: ``(regions, fringes, direct, appearances)``.

    - ``regions``: each output's region, its values in walk order (depth first, inputs in order); None for a
      tensor inside a region walked already, whose region is itself alone;
    - ``fringes``: the values of each region only listed as operands of a leaf's producer, not entered (the
      matcher reads them to name a buffer hidden behind the leaf);
    - ``direct``: the outputs to solve directly: behind their copies they come out of an op the walk does
      not enter, or their region holds a node of :data:`DIRECT_OPS` or one with a subgraph, or it has more
      than :data:`MAX_REGION` values;
    - ``appearances``: per value, the outputs whose regions hold it (an operand of a leaf's producer only
      when it is (a copy of) a graph output's value: an activation a gradient's ``MatMul`` reads links
      nothing).

    Raises:
        _TooLarge: a region has more than :data:`MAX_WALK` values.
    """
    regions: dict[str, list[str] | None] = {}
    fringes: dict[str, AbstractSet[str]] = {}
    direct: set[str] = set()
    appearances: dict[str, list[str]] = {}
    appearances_get = appearances.get
    chains = {o: walker.copy_chain(o) for o in outputs}
    output_copies = set()
    for chain in chains.values():
        output_copies.update(chain)
    linking: dict[str, bool] = {}
    spec = walker.index.spec
    steps_get = walker._steps.get
    # Later outputs first: a parameter update's region holds its buffer output's, whose own region then adds
    # nothing (every value reachable from a value of a region is in it) and is not walked again.
    walked: set[str] = set()
    for o in reversed(outputs):
        if walker.behind_copies_not_entered(o, chains[o]):
            direct.add(o)
        if o in walked and spec(o).num_elements() != 1:
            # A tensor links its reader's region with its own, so both land in one cluster anyway.
            regions[o], fringes[o] = None, _NOTHING
            appearances[o].append(o)
            continue
        # One table for what the walk has seen of a value: _LISTED (only as an operand of a leaf's producer)
        # or _WALKED (its producer's inputs are taken). A value's appearance is recorded when it is walked,
        # or at the end when it stayed listed only.
        seen = {o: _WALKED}
        seen_get = seen.get
        order = [o]
        listed: list[str] = []
        stack = [o]
        must = False
        walked.add(o)
        readers = appearances_get(o)
        if readers is None:
            appearances[o] = [o]
        else:
            readers.append(o)
        while stack:
            value = stack.pop()
            _, inputs, makes_direct, operands = steps_get(value, _LEAF_STEP)
            if makes_direct:
                must = True
            for name in inputs:
                if name:
                    was = seen_get(name)
                    if was is not _WALKED:
                        seen[name] = _WALKED
                        stack.append(name)
                        if was is None:
                            order.append(name)
                        walked.add(name)
                        readers = appearances_get(name)
                        if readers is None:
                            appearances[name] = [o]
                        else:
                            readers.append(o)
            if operands:
                for name in operands:
                    if name and name not in seen:
                        seen[name] = _LISTED
                        order.append(name)
                        listed.append(name)
            if len(order) > MAX_WALK:
                raise _TooLarge(o)
        fringe = {name for name in listed if seen[name] is _LISTED} if listed else _NOTHING
        regions[o] = order
        fringes[o] = fringe
        if must or len(order) > MAX_REGION:
            direct.add(o)
        for name in fringe:
            links = linking.get(name)
            if links is None:
                links = linking[name] = not output_copies.isdisjoint(walker.copy_chain(name))
            if links:
                readers = appearances_get(name)
                if readers is None:
                    appearances[name] = [o]
                else:
                    readers.append(o)
    return regions, fringes, direct, appearances


def _union(walker: _Walker, outputs: Sequence[str], appearances: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Link the outputs whose regions share a value (:func:`_links`): each output's cluster root, and each
    root's outputs in graph order."""
    parent = {o: o for o in outputs}

    def find(o: str) -> str:
        while parent[o] != o:
            parent[o] = parent[parent[o]]
            o = parent[o]
        return o

    for value, readers in appearances.items():
        if len(readers) < 2:
            continue
        root = find(readers[0])
        for other in readers:
            if find(other) != root:
                break
        else:
            continue  # linked already (a buffer's values, read by its parameter's region too)
        links = _links(walker, value, len(readers))
        if links is None:
            # A one-element value read by many regions: a learning rate links nothing, but the regions of
            # one-element outputs (updates of one-element state, which it may be) are linked through it.
            readers = [o for o in readers if walker.index.spec(o).num_elements() in (1, None)]
            if len(readers) < 2:
                continue
        elif not links:
            continue
        root = find(readers[0])
        for other in readers[1:]:
            other_root = find(other)
            if other_root != root:
                parent[other_root] = root
    members: dict[str, list[str]] = {}
    cluster_of: dict[str, str] = {}
    for o in outputs:
        root = cluster_of[o] = find(o)
        found = members.get(root)
        if found is None:
            members[root] = [o]
        else:
            found.append(o)
    return cluster_of, members


def _links(walker: _Walker, value: str, readers: int) -> bool | None:
    """Whether a value read by several regions puts them in one cluster: a tensor does, a constant never (its
    bytes are in the key), a one-element value when few regions read it; None for a one-element value read by
    more than :data:`SHARED_SCALAR_REGIONS` regions (the caller links only the regions of one-element
    outputs through it)."""
    if walker.is_constant(value):
        return False
    if readers <= SHARED_SCALAR_REGIONS or walker.index.spec(value).num_elements() != 1:
        return True
    return None


def _loose(walker: _Walker, values: list[str], fringe: AbstractSet[str], shared: set[str]) -> bool:
    """True when every leaf of the region that is not a constant is shared with other clusters."""
    steps_get = walker._steps.get
    for value in values:
        step = steps_get(value, _LEAF_STEP)
        if step[0] is None and value not in shared and value not in fringe and not walker.is_constant(value):
            return False
    return True


def _key(
    walker: _Walker, cluster: Cluster, regions: dict[str, list[str] | None], fringes: dict[str, AbstractSet[str]], shared: set[str], name_facts: Callable[[str, bool], tuple]
) -> None:
    """Fill ``cluster.values``, ``cluster.nodes`` and ``cluster.key``: the values are the outputs' regions in
    turn (each in its walk order) without repeats or shared values, which is canonical: two members of a
    class list corresponding values at the same positions."""
    walks = [regions[o] or (o,) for o in cluster.outputs]
    values = [value for value in dict.fromkeys(itertools.chain.from_iterable(walks)) if value not in shared]
    if len(values) > MAX_REGION:
        return
    ids = dict(zip(values, range(len(values))))
    # A value is walked (its producer entered) when some output's region walks it, not only lists it.
    walked: set[str] = set()
    for o, walk in zip(cluster.outputs, walks):
        fringe = fringes[o]
        walked.update(set(walk).difference(fringe) if fringe else walk)
    structure, nodes, computed, shared_read = _structure(walker, values, ids, walked)
    read_outside = _read_outside(walker, values, computed, set(nodes))
    # The matcher sorts names it reaches through a shared value too (a gradient read behind a shared copy):
    # each local name's place among every shared name below the ones the cluster reads is in the key.
    shared_names = walker.shared_below(frozenset(shared_read))
    names = _name_facts(walker, values, structure, ids, shared, shared_names, name_facts)
    cluster.values = values
    cluster.nodes = nodes
    cluster.key = (tuple(ids[o] for o in cluster.outputs), tuple(cluster.extras), tuple(structure), tuple(names), read_outside)


def _structure(walker: _Walker, values: list[str], ids: dict[str, int], walked: set[str]) -> tuple[list[tuple], list[int], list[int], set[str]]:
    """Per value of a cluster, how it is defined: ``(facts, "operand of a leaf's producer")`` for a value
    only listed, ``(facts, None, operands)`` for a leaf and ``(facts, node position, inputs)`` for a value
    the walk enters, each input as a position (local) or a name (shared; "" for an input left out). Also
    the cluster's nodes in canonical order, the positions of the values they compute and the shared values
    read."""
    steps_get = walker._steps.get
    facts_get = walker._value_facts.get
    value_facts = walker.value_facts
    ids_get = ids.get
    node_ids: dict[int, int] = {}
    nodes: list[int] = []
    read: set[str] = set()
    structure: list[tuple] = []
    computed: list[int] = []
    for position, value in enumerate(values):
        facts = facts_get(value)
        if facts is None:
            facts = value_facts(value)
        if value not in walked:
            structure.append((facts, "operand of a leaf's producer"))
            continue
        step = steps_get(value, _LEAF_STEP)
        k = step[0]
        names = step[1] if k is not None else step[3]
        # An input is its position when local, else its own name ("" stays "": no value is named so).
        refs = tuple(map(ids_get, names, names))
        read.update(names)
        if k is None:
            structure.append((facts, None, refs))
            continue
        computed.append(position)
        node_id = node_ids.get(k)
        if node_id is None:
            node_id = node_ids[k] = len(nodes)
            nodes.append(k)
        structure.append((facts, node_id, refs))
    shared_read = {name for name in read if name and name not in ids}
    return structure, nodes, computed, shared_read


def _read_outside(walker: _Walker, values: list[str], computed: list[int], inside: set[int]) -> tuple[int, ...]:
    """Positions of the computed values something outside the region reads: the rewrite keeps their nodes,
    and the verification probes them, so members of a class must agree on it too."""
    consumers_get, subgraph_reads = walker.index.consumers.get, walker.index.subgraph_reads
    read: list[int] = []
    for position in computed:
        value = values[position]
        if value in subgraph_reads:
            read.append(position)
            continue
        for c in consumers_get(value, ()):
            if c not in inside:
                read.append(position)
                break
    return tuple(read)


def _name_facts(
    walker: _Walker,
    values: list[str],
    structure: list[tuple],
    ids: dict[str, int],
    shared: set[str],
    shared_names: list[str],
    name_facts: Callable[[str, bool], tuple],
) -> list[tuple]:
    """Per value, its rank among the cluster's names and among the shared names below it, and (for a float
    value that is not a small constant) every fact the matcher draws from its name."""
    outputs = walker.outputs
    is_constant = walker.is_constant
    names: list = [None] * len(values)
    bisect_left = bisect.bisect_left
    for rank, value in enumerate(sorted(values)):
        position = ids[value]
        before = bisect_left(shared_names, value) if shared_names else 0
        is_output = value in outputs
        facts = structure[position][0]
        if not is_output and (facts[0] not in _NAMED_DTYPES or (facts[2][0] == "initializer" or facts[2][:2] == ("node", "Constant")) and is_constant(value)):
            # A value that is not a float tensor (a shape, a condition) is never state or a gradient, and a
            # small constant folds into a coefficient: the matcher reads no fact from their names.
            names[position] = (rank, before)
            continue
        flags, previous, named_next = name_facts(value, is_output)
        names[position] = (
            rank,
            before,
            flags,
            None if previous is None else _named(previous, ids, shared),
            None if named_next is None else _named(named_next, ids, shared),
        )
    return names


def _named(name: str | None, ids: dict[str, int], shared: set[str]) -> tuple | None:
    """A value a name fact points to: local (by position), shared (by name), or elsewhere in the graph."""
    if name is None:
        return None
    if name in ids:
        return ("local", ids[name])
    if name in shared:
        return ("shared", name)
    return ("outside",)


def name_facts_of(index: GraphIndex, pins, named_next) -> Callable[[str, bool], tuple]:
    """``sgd_match.name_facts_of`` of commit 06e5390: ``(flags, previous, next)`` of one name."""
    from sgdfuse.passes.sgd_match import _convention_flags, _previous_by_name

    is_buffer = pins.is_buffer if pins.buffers else lambda name: None
    state = pins.state
    next_of = named_next.get

    def name_facts(value: str, is_output: bool) -> tuple:
        buffer, gradient = _convention_flags(value)
        flags = (buffer, gradient, is_buffer(value), value in state)
        return flags, _previous_by_name(index, value, pins) if is_output else None, next_of(value)

    return name_facts
