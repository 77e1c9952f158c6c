"""Structural classes of update clusters: the matcher solves one member of each class, the rest are renamed.

A training step of N parameters holds N update sub-graphs that differ only in their names (and often not even
in their constants): solving each one costs milliseconds of algebra, while recognising that two of them are
the same up to names costs a walk over a dozen nodes. :func:`find_by_class` groups the graph outputs into
*clusters* (outputs whose elementwise regions share a tensor), computes a key per cluster that captures
everything the matcher (:mod:`sgdfuse.passes.sgd_match`) reads, solves the first member of each key and
instantiates its matches for every other member by renaming. The argument, and what the key holds, is in
docs/design.md ("Matching per structural class").

What the key holds, per value of the cluster's region (numbered in a canonical walk from the cluster's
outputs, so two members' values correspond by position):

- how it is defined: the producing node's op type, domain, serialised attributes and input positions, or the
  kind of leaf (graph input, initializer that is an input, constant initializer with its bytes, output of an op
  the walk does not enter, with that op's type);
- its dtype and shape (symbolic dimensions by name);
- every fact the matcher draws from its name: the buffer and gradient conventions, the user's pins, the input
  its name says it replaces (``previous_by_name``), the output named as its own next value, and its place in
  the sort order of the cluster's names (the matcher breaks ties by name order);
- which graph outputs the cluster has, in graph order.

The keys of a batch of clusters are made together, in passes of builtins over all their values
(:func:`_key_batch`), with the facts numbered and the names' order held as a permutation.

Values shared with other clusters (a learning-rate input read by every update, a shared scalar initializer)
are keyed by their literal name and not entered. A cluster whose region holds a ``Where``, an ``If`` or any
node with a subgraph, whose outputs come out of an op the walk does not enter, or whose region is large is
solved directly; so is every member of a class whose solved member was refused (the refusal's wording names
the member's own values). Without a class to share, the result is exactly :func:`_find`'s.

The walker's steps, the region walk, the union, the clusters' values, the facts' numbering and the per-cluster
loop of the keys run natively (``_classes.cc``, :func:`_native`) where the extension builds, each a port of a
Python function here that stays as the fallback and gives the same tables in the same order
(tests/test_classes_native.py; docs/design.md, "The walk and the keys' loops, run natively").
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
import logging
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

import onnx

from sgdfuse.contract import TensorSpec
from sgdfuse.native import cache_root
from sgdfuse.passes.index import GraphIndex
from sgdfuse.passes.scan import NATIVE_ENV, ScannerBuildError, build_extension

__all__ = ["ENTERED_OPS", "MAX_REGION", "Cluster", "find_by_class", "clusters_of"]

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


_BATCH = 256
"""Clusters keyed together (:func:`_key_batch`): enough values for passes of builtins over them to cost little
more than the look-ups they make, few enough that a lazy caller never holds many keys at once."""


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


_LEAF_STEP: tuple = (None, (), False, (), None)
"""The step of a value no node produces (a graph input, an initializer, an undefined name); its kind is the
leaf's (:meth:`_Walker.facts`)."""

_DEFAULT_DOMAINS = ("", "ai.onnx")

_NOTHING: frozenset[str] = frozenset()
"""The fringe of a region without one (one object for all of them)."""

_LISTED, _WALKED = "listed", "walked"
"""What the region walk (:func:`_walk_regions`) has seen of a value."""


_COPY_OPS = frozenset({"Identity", "Cast", "CastLike"})

_OUTSIDE = ("outside",)
"""A value a name fact points to that is neither the cluster's nor shared (:func:`_named`)."""

_NO_SPEC = TensorSpec("", None, 0)
"""The spec of a value the index has none for (dtype 0, shape unknown), as ``GraphIndex.spec`` makes it."""

_dtype_of, _shape_of = operator.attrgetter("dtype"), operator.attrgetter("shape")

_UNLESS_CONSTANT = "unless constant"
"""The matcher reads facts from a float value's name unless it is a small constant (:func:`_reads_names`)."""

_INPUT, _INITIALIZER_INPUT, _UNDEFINED = ("input",), ("initializer-input",), ("undefined",)
"""Kinds of leaves (:meth:`_Walker.facts`)."""

_producer_of_step, _inputs_of_step, _operands_of_step, _kind_of_step = (operator.itemgetter(k) for k in (0, 1, 3, 4))
_previous_of, _next_of = operator.itemgetter(1), operator.itemgetter(2)
_is_output_of = operator.itemgetter(3)
_is_not_none = functools.partial(operator.is_not, None)


_NATIVE_SOURCE = Path(__file__).with_name("_classes.cc")


def _native() -> object | None:
    """The native region walk (``_classes.cc``, compiled on first use and cached like the node scanner,
    :func:`sgdfuse.passes.scan.build_extension`), or None where it does not build or ``$SGDFUSE_NATIVE_SCAN``
    is ``0``: then :func:`_steps_python` and :func:`_walk_regions_python` run instead, with the same results
    (tests/test_classes_native.py)."""
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return None
    try:
        return build_extension(_NATIVE_SOURCE, "sgdfuse.passes._classes", "classes-walk", "the native region walk", root=str(cache_root())).module
    except ScannerBuildError as error:
        logger.debug("native region walk unavailable, walking in Python: %s", error)
        return None


def _steps(nodes: Sequence[tuple]) -> tuple[dict[str, tuple], set[str]]:
    """:func:`_steps_python`, natively where the extension builds (:func:`_native`)."""
    native = _native()
    if native is None or type(nodes) is not list:
        return _steps_python(nodes)
    return native.steps(nodes, ENTERED_OPS, DIRECT_OPS, _COPY_OPS, _DEFAULT_DOMAINS)


def _steps_python(nodes: Sequence[tuple]) -> tuple[dict[str, tuple], set[str]]:
    """The walk's step (:meth:`_Walker.step`) of every value a node outputs; a later producer of a name wins, as
    in the index's ``producer``.

    A step ends with the value's kind for the key (:meth:`_Walker.facts`): ``("node", op, domain, output
    position, output count, attributes)`` for an op the walk enters, ``("computed", ...)`` with no attributes
    for any other op. It is None for an entered op with attributes, whose bytes the key reads from the
    protobuf only for the values it holds. One kind per distinct op, domain and position (most nodes have one
    output and share their op's), and one step per single-output node.

    Also the values an ``Identity``, ``Cast`` or ``CastLike`` outputs (in any domain, and whoever produces them
    last: the candidates for :meth:`_Walker.copy_chain`)."""
    steps: dict[str, tuple] = {}
    copies: set[str] = set()
    ops: dict[tuple[str, str], tuple[bool, bool, tuple, bool]] = {}
    kinds: dict[tuple, tuple] = {}
    entered_ops, direct_ops, default = ENTERED_OPS, DIRECT_OPS, _DEFAULT_DOMAINS
    for k, (op, domain, inputs, outputs, subgraph, has_attributes) in enumerate(nodes):
        known = ops.get((op, domain))
        if known is None:
            entered = op in entered_ops and domain in default
            single = ("node" if entered else "computed", op, domain, 0, 1, b"")
            known = ops[op, domain] = (entered, op in direct_ops, kinds.setdefault(single, single), op in _COPY_OPS)
        entered, direct, kind, copy = known
        direct = direct or subgraph
        if copy:
            copies.update(outputs)
        if len(outputs) == 1:
            name = outputs[0]
            if name:
                if entered:
                    steps[name] = (k, inputs, direct, (), None if has_attributes else kind)
                else:
                    steps[name] = (None, (), direct, inputs, kind)
            continue
        count = len(outputs)
        for name in outputs:
            if name:
                if entered and has_attributes:
                    kind = None
                else:
                    kind = ("node" if entered else "computed", op, domain, outputs.index(name), count, b"")
                    kind = kinds.setdefault(kind, kind)
                steps[name] = (k, inputs, direct, (), kind) if entered else (None, (), direct, inputs, kind)
    return steps, copies


class _Walker:
    """Regions of graph outputs, with per-node facts read from the protobuf once.

    Its tables are looked up inline by the hot loops (:func:`_walk_regions`, :func:`_key_batch`): at ten
    thousand updates the walk asks for a value's step some two hundred thousand times, and a method call per
    ask cost more than the look-up it wraps."""

    def __init__(self, index: GraphIndex) -> None:
        self.index = index
        self._nodes = index.graph.node
        self._node_facts = index.nodes
        # The distinct facts seen (:meth:`facts`), numbered, and whether the matcher reads names of values with them.
        self._numbers: dict[tuple, int] = {}
        self._facts: list[tuple] = []
        self._reads_names: list[bool | str] = []
        # The kinds of the graph inputs that are no initializer, the most common leaves.
        self._leaf_kinds = dict.fromkeys(index.graph_inputs, _INPUT)
        self.plain_inputs = self._leaf_kinds.keys() - index.initializers.keys()
        for name in self._leaf_kinds.keys() & index.initializers.keys():
            self._leaf_kinds[name] = _INITIALIZER_INPUT
        self._steps, self.copies = _steps(index.nodes)
        self._constants: dict[str, bool] = {}
        self._constant_attributes: dict[bytes, bool] = {}
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
        attributes = self._nodes[k].attribute
        if len(attributes) == 1:
            return attributes[0].SerializeToString(deterministic=True)  # most nodes: one attribute, no join
        return b"".join([a.SerializeToString(deterministic=True) for a in attributes])

    def step(self, value: str) -> tuple[int | None, tuple[str, ...], bool, tuple[str, ...], tuple | None]:
        """``(producer entered or None, its inputs, whether the producer makes the region direct, the inputs of
        a producer not entered, the value's kind or None)`` (:func:`_steps`): the matcher reads the operands of
        a leaf's producer (to name a buffer hidden behind it), so those are listed in the region, but not
        entered."""
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

    def facts(self, values: list[str], steps: list[tuple]) -> list[int]:
        """What the key holds of each of ``values`` (whose walk steps are ``steps``) besides its name facts, as
        the number of its distinct facts ``(dtype, shape, kind, is a graph output)`` (:meth:`facts_of`), with
        ``kind`` how it is defined (the defining node's inputs are added by the caller, as positions): the
        producing node's op type, domain, output position, output count and (entered ops only) serialised
        attributes, or the kind of leaf (an initializer that is a graph input, a constant initializer with its
        dtype, shape and bytes, a graph input, an undefined name).

        Numbers stand for the facts in the key: one walker numbers distinct facts apart, so equal numbers are
        equal facts, and an int hashes and compares at once where the tuple would be walked again at every
        class look-up."""
        native = _native()
        if native is not None and type(values) is list and type(steps) is list and type(self.outputs) is set:
            # In one native pass (the same numbers, numbered in the same order: tests/test_classes_native.py).
            return native.facts(
                values, steps, _LEAF_STEP, self._leaf_kinds, self._leaf_kind, self._kind_with_attributes, self.index.specs, _NO_SPEC,
                self.outputs, self._numbers, self._number,
            )
        return self.facts_python(values, steps)

    def facts_python(self, values: list[str], steps: list[tuple]) -> list[int]:
        """:meth:`facts` in Python (the fallback, and the reference the native pass is tested against)."""
        count = len(values)
        kinds = list(map(_kind_of_step, steps))
        holes = list(itertools.compress(range(count), map(operator.is_, kinds, itertools.repeat(None, count))))
        if holes:
            # Leaves (most of them graph inputs, whose kinds are known) and entered ops with attributes.
            leaves = list(itertools.compress(holes, map(operator.is_, map(steps.__getitem__, holes), itertools.repeat(_LEAF_STEP))))
            for position, kind in zip(leaves, map(self._leaf_kinds.get, map(values.__getitem__, leaves))):
                kinds[position] = self._leaf_kind(values[position]) if kind is None else kind
            if len(leaves) < len(holes):
                for position in set(holes).difference(leaves):
                    kinds[position] = self._kind_with_attributes(values[position], steps[position][0])
        specs = list(map(self.index.specs.get, values, itertools.repeat(_NO_SPEC, count)))
        facts = list(zip(map(_dtype_of, specs), map(_shape_of, specs), kinds, map(self.outputs.__contains__, values)))
        numbers = list(map(self._numbers.get, facts))
        for position in list(itertools.compress(range(count), map(operator.is_, numbers, itertools.repeat(None, count)))):
            numbers[position] = self._number(facts[position])
        return numbers

    def facts_of(self, number: int) -> tuple:
        """The facts numbered ``number`` by :meth:`facts`."""
        return self._facts[number]

    def _number(self, facts: tuple) -> int:
        """The number of ``facts`` (a new one when first seen)."""
        number = self._numbers.get(facts)
        if number is None:
            number = self._numbers[facts] = len(self._facts)
            self._facts.append(facts)
            self._reads_names.append(_reads_names(facts))
        return number

    def _kind_with_attributes(self, value: str, k: int) -> tuple:
        """The kind of a value that node ``k``, an entered op with attributes, outputs (:meth:`facts`)."""
        op, domain, _, outputs, _, _ = self._node_facts[k]
        return ("node", op, domain, outputs.index(value) if len(outputs) > 1 else 0, len(outputs), self.attributes(k))

    def _leaf_kind(self, value: str) -> tuple:
        """The kind of a value no node outputs that is not a plain graph input (:meth:`facts`)."""
        index = self.index
        if value in index.initializers:
            if index.is_input_name(value):
                return _INITIALIZER_INPUT
            constant = index.constant(value)
            return ("initializer", None if constant is None else (str(constant.dtype), constant.shape, constant.tobytes()))
        return _INPUT if index.is_input_name(value) else _UNDEFINED

    def name_tails(self, values: list[str], facts: list[int], name_facts: Callable[[Sequence[str], Sequence[bool]], list[tuple]]) -> tuple[list[tuple], list[int]]:
        """What the key holds of each of ``values`` (with these :meth:`facts`) after its ranks (:func:`_names`),
        and the positions whose entry still names other values: ``()`` for a value whose name the matcher reads
        nothing from (a value that is not a float tensor, a small constant), else ``name_facts(value,
        is_output)``, ``(flags, previous, next)``, whose ``previous`` and ``next`` the cluster turns into
        positions (:func:`_named`)."""
        count = len(values)
        reads = list(map(self._reads_names.__getitem__, facts))
        for position in list(itertools.compress(range(count), map(operator.is_, reads, itertools.repeat(_UNLESS_CONSTANT, count)))):
            reads[position] = not self._is_constant_of(values[position], self._facts[facts[position]][2])
        named = list(itertools.compress(range(count), map(operator.is_, reads, itertools.repeat(True, count))))
        is_output = list(map(_is_output_of, map(self._facts.__getitem__, map(facts.__getitem__, named))))
        found = name_facts(list(map(values.__getitem__, named)), is_output)
        tails = list(map(dict(zip(named, found)).get, range(count), itertools.repeat((), count)))
        pointing = list(itertools.compress(named, map(operator.or_, map(_is_not_none, map(_previous_of, found)), map(_is_not_none, map(_next_of, found)))))
        return tails, pointing

    def _is_constant_of(self, value: str, kind: tuple) -> bool:
        """:meth:`is_constant` of a value defined as ``kind`` says (a float initializer or ``Constant`` output,
        :func:`_reads_names`), read from the kind where it tells: an initializer's kind holds its constant or
        None (:meth:`facts`), and a ``Constant``'s value is a function of its attributes, whose bytes the kind
        holds, so nodes with the same bytes get one answer (most ``Constant`` nodes of a step repeat a few
        values)."""
        if kind[0] == "initializer":
            return kind[1] is not None
        if value in self.index.initializers:
            return self.is_constant(value)  # an initializer shadows the node (GraphIndex.constant)
        known = self._constant_attributes.get(kind[5])
        if known is None:
            known = self._constant_attributes[kind[5]] = self.is_constant(value)
        return known

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


def _reads_names(facts: tuple) -> bool | str:
    """Whether the matcher reads facts from the name of a value with these facts (:meth:`_Walker.facts`): True
    for a graph output or a float tensor, False for any other value (a shape, a condition; the matcher takes no
    state or gradient from it), :data:`_UNLESS_CONSTANT` for a float initializer or ``Constant`` output (a
    small constant folds into a coefficient)."""
    dtype, _, kind, is_output = facts
    if is_output:
        return True
    if dtype not in _NAMED_DTYPES:
        return False
    if kind[0] == "initializer" or kind[:2] == ("node", "Constant"):
        return _UNLESS_CONSTANT
    return True


def clusters_of(
    index: GraphIndex,
    outputs: Sequence[str],
    name_facts: Callable[[Sequence[str], Sequence[bool]], list[tuple]],
    form_leaves: Callable[[str], set[str]],
    *,
    lazy: bool = False,
) -> Iterable[Cluster]:
    """The clusters of ``outputs`` (float graph outputs, in graph order), each keyed (or marked direct); with
    ``lazy``, a generator that keys the clusters as they are taken, :data:`_BATCH` at a time (so that a caller
    dropping them never holds every key at once).

    ``name_facts(names, is_output)`` returns the matcher's facts drawn from each name (``is_output``: whether
    it is a graph output): ``(flags, previous, next)`` with ``flags`` a tuple (conventions, pins),
    ``previous`` the input the name says it replaces and ``next`` the output named as its next value (or
    None);
    ``form_leaves(output)`` the leaves of an output's linear form (asked only of outputs computed from shared
    values alone).
    """
    walker = _Walker(index)
    walk = _walk_regions(walker, outputs)
    regions, direct, appearances = walk.regions, walk.direct, walk.appearances
    cluster_of, members, unlinked = _union(walker, outputs, appearances)
    # A value is shared when its regions are in several clusters: only a value whose readers were not all
    # linked can be.
    shared = set()
    for value in unlinked:
        readers = appearances[value]
        root = cluster_of[readers[0]]
        for o in readers:
            if cluster_of[o] != root:
                shared.add(value)
                break
    del appearances

    # Outputs computed from shared values alone (a learning-rate schedule lr*0.99): the matcher may pair them
    # with any cluster whose region holds their form's leaves, so they go along as keyed extras.
    loose = [o for o, found in walk.leaves.items() if _loose(walker, found, shared)]
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

    to_key = [c for c in clusters if id(c) in pending]

    def keyed() -> Iterator[Cluster]:
        # In batches (_key_batch), each keyed when its first cluster is taken.
        done = 0
        for cluster in clusters:
            if done < len(to_key) and cluster is to_key[done]:
                if done % _BATCH == 0:
                    _key_batch(walker, to_key[done:done + _BATCH], walk, shared, name_facts)
                done += 1
            yield cluster

    return keyed() if lazy else list(keyed())


@dataclasses.dataclass
class _Walk:
    """The outputs' regions (:func:`_walk_regions`).

    Attributes:
        regions: each output's region, its values in walk order (depth first, inputs in order); None for a
            tensor inside a region walked already, whose region is itself alone.
        steps: per region walked, each of its values' :meth:`_Walker.step` in the same order, ``_LISTED`` for
            a value it only lists.
        fringes: the values of each region only listed as operands of a leaf's producer, not entered (the
            matcher reads them to name a buffer hidden behind the leaf).
        direct: the outputs to solve directly: behind their copies they come out of an op the walk does not
            enter, or their region holds a node of :data:`DIRECT_OPS` or one with a subgraph, or it has more
            than :data:`MAX_REGION` values.
        appearances: per value, the outputs whose regions hold it (an operand of a leaf's producer only when it
            is (a copy of) a graph output's value: an activation a gradient's ``MatMul`` reads links nothing).
        leaves: per region walked, the values it walks that no entered op produces (:func:`_loose`).
    """

    regions: dict[str, list[str] | None]
    steps: dict[str, list[tuple | str]]
    fringes: dict[str, AbstractSet[str]]
    direct: set[str]
    appearances: dict[str, list[str]]
    leaves: dict[str, list[str]]


def _walk_regions(walker: _Walker, outputs: Sequence[str]) -> _Walk:
    """Walk the outputs' regions (:class:`_Walk`), later outputs first: :func:`_walk_regions_python`, its loop
    run natively where the extension builds (:func:`_native`; the same dicts, lists and sets in the same
    order).

    Raises:
        _TooLarge: a region has more than :data:`MAX_WALK` values.
    """
    native = _native()
    if native is None:
        return _walk_regions_python(walker, outputs)
    outputs = list(outputs)
    behind_copies, output_copies = _behind_copies(walker, outputs)
    linking: dict[str, bool] = {}
    copy_chain = walker.copy_chain
    spec = walker.index.spec

    def links(name: str) -> bool:
        # Whether a value only listed links its region: it is (a copy of) a graph output's value.
        found = linking.get(name)
        if found is None:
            found = linking[name] = not output_copies.isdisjoint(copy_chain(name))
        return found

    regions, steps, fringes, direct, appearances, leaves = native.walk(
        outputs, behind_copies, walker._steps, _LEAF_STEP, _LISTED, _WALKED, _NOTHING, MAX_WALK, MAX_REGION, _TooLarge,
        lambda o: spec(o).num_elements() != 1, links,
    )
    return _Walk(regions, steps, fringes, direct, appearances, leaves)


def _behind_copies(walker: _Walker, outputs: Sequence[str]) -> tuple[dict[str, str], set[str]]:
    """Each output past its copies, and every value an output copies (most outputs copy nothing)."""
    behind_copies = dict(zip(outputs, outputs))
    output_copies = set(outputs)
    for o in output_copies.intersection(walker.copies):
        chain = walker.copy_chain(o)
        behind_copies[o] = chain[-1]
        output_copies.update(chain)
    return behind_copies, output_copies


def _walk_regions_python(walker: _Walker, outputs: Sequence[str]) -> _Walk:
    """:func:`_walk_regions` in Python (the fallback, and the reference the native walk is tested against)."""
    regions: dict[str, list[str] | None] = {}
    steps: dict[str, list[tuple | str]] = {}
    fringes: dict[str, AbstractSet[str]] = {}
    leaves: dict[str, list[str]] = {}
    direct: set[str] = set()
    appearances: dict[str, list[str]] = collections.defaultdict(list)
    behind_copies, output_copies = _behind_copies(walker, outputs)
    linking: dict[str, bool] = {}
    spec = walker.index.spec
    steps_get = walker._steps.get
    appearances_get = appearances.get  # (a look-up that adds no entry)
    # Later outputs first: a parameter update's region holds its buffer output's, whose own region then adds
    # nothing (every value reachable from a value of a region is in it) and is not walked again.
    for o in reversed(outputs):
        behind = steps_get(behind_copies[o])
        if behind is not None and behind[0] is None:
            direct.add(o)  # past its copies, it comes out of an op the walk does not enter
        if _walked_in(o, appearances_get(o), fringes) and spec(o).num_elements() != 1:
            # A tensor links its reader's region with its own, so both land in one cluster anyway.
            regions[o], fringes[o] = None, _NOTHING
            appearances[o].append(o)
            continue
        # One table for what the walk has seen of a value, in the order first seen (the region's order):
        # _LISTED (only as an operand of a leaf's producer), _WALKED (its producer's inputs are to be taken)
        # and, once they are, its step. A value's appearance is recorded when it is walked, or at the end
        # when it stayed listed only.
        seen = {o: _WALKED}
        seen_get = seen.get
        listed: list[str] = []
        found_leaves: list[str] = []
        stack = [o]
        must = False
        appearances[o].append(o)
        while stack:
            value = stack.pop()
            step = seen[value] = steps_get(value, _LEAF_STEP)  # kept for the key (_Walk.steps)
            k, inputs, makes_direct, operands, _ = step
            if k is None:
                found_leaves.append(value)
            if makes_direct:
                must = True
            for name in inputs:
                if name:
                    was = seen_get(name)
                    if was is None or was is _LISTED:
                        seen[name] = _WALKED
                        stack.append(name)
                        appearances[name].append(o)
            if operands:
                for name in operands:
                    if name and name not in seen:
                        seen[name] = _LISTED
                        listed.append(name)
            if len(seen) > MAX_WALK:
                raise _TooLarge(o)
        order = list(seen)
        fringe = {name for name in listed if seen[name] is _LISTED} if listed else _NOTHING
        regions[o] = order
        steps[o] = list(seen.values())
        fringes[o] = fringe
        leaves[o] = found_leaves
        if must or len(order) > MAX_REGION:
            direct.add(o)
        for name in fringe:
            links = linking.get(name)
            if links is None:
                links = linking[name] = not output_copies.isdisjoint(walker.copy_chain(name))
            if links:
                appearances[name].append(o)
    return _Walk(regions, steps, fringes, direct, appearances, leaves)


def _walked_in(value: str, readers: list[str] | None, fringes: dict[str, AbstractSet[str]]) -> bool:
    """Whether a region walked so far walks ``value`` (whose appearances are ``readers``), rather than only
    lists it."""
    if readers:
        for reader in readers:
            if value not in fringes[reader]:
                return True
    return False


def _union(walker: _Walker, outputs: Sequence[str], appearances: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, list[str]], list[str]]:
    """Link the outputs whose regions share a value (:func:`_links`): each output's cluster root, each root's
    outputs in graph order, and the values whose readers this did not link all (the only ones that can be
    shared by clusters: linking only merges). :func:`_union_python`, natively where the extension builds
    (:func:`_native`; the same dicts and lists in the same order)."""
    native = _native()
    if native is None:
        return _union_python(walker, outputs, appearances)
    outputs = list(outputs)
    parent_keys = dict.fromkeys(outputs)
    one_element: dict[str, bool] = {}

    def one_element_readers(readers: list[str]) -> list[str]:
        # The readers that are one-element outputs (updates of one-element state), the table filled once.
        if len(one_element) < len(parent_keys):
            for o in parent_keys.keys() - one_element.keys():
                one_element[o] = walker.index.spec(o).num_elements() in (1, None)
        return list(filter(one_element.__getitem__, readers))

    return native.union(outputs, appearances, functools.partial(_links, walker), one_element_readers)


def _union_python(walker: _Walker, outputs: Sequence[str], appearances: dict[str, list[str]]) -> tuple[dict[str, str], dict[str, list[str]], list[str]]:
    """:func:`_union` in Python (the fallback, and the reference the native one is tested against)."""
    parent = {o: o for o in outputs}

    def find(o: str) -> str:
        while parent[o] != o:
            parent[o] = parent[parent[o]]
            o = parent[o]
        return o

    one_element: dict[str, bool] = {}
    unlinked: list[str] = []
    for value, readers in appearances.items():
        if len(readers) < 2:
            continue
        if len(readers) == 2 and parent[readers[0]] == parent[readers[1]]:
            continue  # one parent, one root: linked already (a buffer's values, read by its parameter's region too)
        root = find(readers[0])
        for other in readers:
            if find(other) != root:
                break
        else:
            continue  # linked already
        links = _links(walker, value, len(readers))
        if links is None:
            # A one-element value read by many regions: a learning rate links nothing, but the regions of
            # one-element outputs (updates of one-element state, which it may be) are linked through it.
            if len(one_element) < len(parent):
                for o in parent.keys() - one_element.keys():
                    one_element[o] = walker.index.spec(o).num_elements() in (1, None)
            unlinked.append(value)
            readers = list(filter(one_element.__getitem__, readers))
            if len(readers) < 2:
                continue
        elif not links:
            unlinked.append(value)
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
    return cluster_of, members, unlinked


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


def _loose(walker: _Walker, leaves: list[str], shared: set[str]) -> bool:
    """True when every leaf the region walks that is not a constant is shared with other clusters."""
    plain_inputs = walker.plain_inputs
    for leaf in leaves:
        # A graph input that is no initializer is never a constant (most regions read one of their own).
        if leaf in plain_inputs and leaf not in shared:
            return False
    return all(map(walker.is_constant, itertools.filterfalse(shared.__contains__, leaves)))


def _key_batch(walker: _Walker, batch: list[Cluster], walk: _Walk, shared: set[str], name_facts: Callable[[Sequence[str], Sequence[bool]], list[tuple]]) -> None:
    """Fill ``values``, ``nodes`` and ``key`` of every cluster of ``batch``; a cluster of more than
    :data:`MAX_REGION` values is left without a key (solved directly).

    The key is ``(output positions, extras, structure, names, read outside)``, over the cluster's values in
    canonical order (:func:`_values`):

    - ``structure``, how each value is defined, as ``(facts, nodes, arities, inputs)``: per value the number
      :meth:`_Walker.facts` gives its dtype, shape, kind and output-ness, its node's position among the
      cluster's nodes (None for a leaf or a value only listed), how many names its entry refers to (the
      entered producer's inputs, a leaf's producer's operands; -1 for a value only listed as an operand of a
      leaf's producer), and all those names in turn, each as a position (local) or its own name (shared; ""
      for an input left out: no value is named so);
    - ``names`` (:func:`_names`): the values' positions in name order, each value's place among the shared
      names below the ones the cluster reads, and its name facts (:meth:`_Walker.name_tails`);
    - ``read outside``: the positions of the computed values something outside the region reads (the rewrite
      keeps their nodes, and the verification probes them, so members of a class must agree on it too).

    The key before issue 12 held per value ``(facts, "operand of a leaf's producer")``, ``(facts, None,
    operands)`` or ``(facts, node position, inputs)``, with the facts themselves, and ``(rank, place) + name
    facts``. This one is a one-to-one image of it, so two clusters have equal keys exactly when they had: facts
    and numbers are one-to-one (one walker numbers them, and only keys of one walker are compared); the
    entries' columns, with the arities to cut the inputs apart and -1 standing for the operand mark, give the
    entries back; and the positions in name order are the permutation the ranks invert, from which the ranks
    are computed back. The columns cost a few slices per cluster where the entries cost three tuples per
    value. Every key of the committed models and of benchmark steps decodes into the old one
    (tests/test_classes_reference.py).

    The batch is keyed as a whole (:func:`_key_together`, passes of builtins over all its values: a cluster
    has about ten values, and a pass over ten values costs mostly its own set-up) unless a value is in two
    of its clusters or a node computes two of its values; then cluster by cluster (:func:`_key_alone`)."""
    tables = _tables(walker, batch, walk, shared, name_facts)
    local = dict(zip(tables.flat, itertools.chain.from_iterable(map(range, tables.sizes))))
    computed = list(itertools.compress(range(len(tables.flat)), map(_is_not_none, tables.producers)))
    nodes = list(map(tables.producers.__getitem__, computed))
    if len(local) == len(tables.flat) and len(set(nodes)) == len(nodes):
        _key_together(walker, tables, local, computed, nodes, shared)
    else:
        for j in range(len(tables.clusters)):
            _key_alone(walker, tables, j, shared)


@dataclasses.dataclass
class _Tables:
    """What the key holds of each value of a batch of clusters, read for all of them at once
    (:func:`_key_batch`): one entry per value of each cluster in turn, cluster ``j``'s from ``starts[j]``."""

    clusters: list[Cluster]
    values: list[list[str]]
    """Each cluster's values (:func:`_values`)."""
    sizes: list[int]
    starts: list[int]
    """Where each cluster's entries begin, and, last, where the entries end."""
    flat: list[str]
    """The values of the clusters in turn."""
    facts: list[int]
    """:meth:`_Walker.facts` (numbers)."""
    producers: list[int | None]
    """The value's entered producer (None for a leaf and for a value only listed)."""
    referred: list[tuple[str, ...]]
    """The names the value's entry refers to: an entered producer's inputs or a leaf's producer's operands
    (() for a value only listed)."""
    listed: list[int]
    """The entries of values only listed (their clusters' :func:`_listed_only`)."""
    tails: list[tuple]
    pointing: list[int]
    """:meth:`_Walker.name_tails`."""


def _tables(walker: _Walker, batch: list[Cluster], walk: _Walk, shared: set[str], name_facts: Callable[[Sequence[str], Sequence[bool]], list[tuple]]) -> _Tables:
    """The per-value tables of the clusters of ``batch`` that have at most :data:`MAX_REGION` values."""
    kept: list[Cluster] = []
    values_of: list[list[str]] = []
    steps_of: list[list] = []
    native = _native()
    if native is not None and type(shared) is set:
        found = native.cluster_values(batch, walk.regions, walk.steps, walk.fringes, shared, _LISTED)  # (the same lists)
    else:
        found = [_values(cluster, walk, shared) for cluster in batch]
    for cluster, (values, steps) in zip(batch, found):
        if len(values) <= MAX_REGION:
            kept.append(cluster)
            values_of.append(values)
            steps_of.append(steps)
    sizes = list(map(len, values_of))
    starts = list(itertools.accumulate(sizes, initial=0))
    flat = list(itertools.chain.from_iterable(values_of))
    steps = list(itertools.chain.from_iterable(steps_of))
    # A value only listed in its region has no step there: its kind still counts (its producer does not).
    for position in list(itertools.compress(range(len(steps)), map(operator.is_, steps, itertools.repeat(_LISTED)))):
        steps[position] = walker.step(flat[position])
    facts = walker.facts(flat, steps)
    producers = list(map(_producer_of_step, steps))
    # A step has an entered producer's inputs or a leaf's producer's operands, the other of the two empty.
    referred = list(map(operator.add, map(_inputs_of_step, steps), map(_operands_of_step, steps)))
    listed: list[int] = []
    for j, cluster in enumerate(kept):
        only = _listed_only(cluster, walk)
        if only:
            # A value only listed has no node and refers to nothing.
            for position in range(starts[j], starts[j + 1]):
                if flat[position] in only:
                    producers[position] = None
                    referred[position] = ()
                    listed.append(position)
    tails, pointing = walker.name_tails(flat, facts, name_facts)
    return _Tables(kept, values_of, sizes, starts, flat, facts, producers, referred, listed, tails, pointing)


def _values(cluster: Cluster, walk: _Walk, shared: set[str]) -> tuple[list[str], list]:
    """The cluster's values in canonical order: the outputs' regions in turn (each in its walk order) without
    repeats or shared values. Two members of a class list corresponding values at the same positions. Also
    their steps as the walk kept them (:attr:`_Walk.steps`; ``_LISTED`` for a value only listed where it came
    from, to be looked up)."""
    outputs = cluster.outputs
    first = walk.regions[outputs[0]]
    if first is not None and (
        len(outputs) == 1
        # A parameter update and the new buffer it reads: a region walking an output holds that output's
        # region (the walk from it takes the same steps), so the second region adds nothing.
        or len(outputs) == 2 and outputs[1] in first and outputs[1] not in walk.fringes[outputs[0]]
    ):
        values, steps = first, walk.steps[outputs[0]]
    else:
        # The first place of each value, with the step of its last (any step of a value is its step).
        regions = [walk.regions[o] or (o,) for o in outputs]
        merged = dict(zip(itertools.chain.from_iterable(regions), itertools.chain.from_iterable(
            walk.steps[o] if walk.regions[o] is not None else (_LISTED,) for o in outputs
        )))
        values, steps = list(merged), list(merged.values())
    if not shared:
        return list(values), list(steps)
    kept = list(map(operator.not_, map(shared.__contains__, values)))
    return list(itertools.compress(values, kept)), list(itertools.compress(steps, kept))


def _listed_only(cluster: Cluster, walk: _Walk) -> AbstractSet[str]:
    """The values of the cluster that no output's region walks, only lists as operands of a leaf's producer
    (a value is walked, its producer entered, when some output's region walks it)."""
    outputs, fringes = cluster.outputs, walk.fringes
    listed = [fringes[o] for o in outputs if fringes[o]]
    if not listed:
        return _NOTHING  # most clusters: every value is walked
    if len(outputs) == 1:
        return listed[0]  # a region's fringe is what it never walked
    walked: set[str] = set()
    for o in outputs:
        walk_o, fringe = walk.regions[o] or (o,), fringes[o]
        walked.update(set(walk_o).difference(fringe) if fringe else walk_o)
    return set().union(*listed).difference(walked)


def _key_together(walker: _Walker, tables: _Tables, local: dict[str, int], computed: list[int], nodes: list[int], shared: set[str]) -> None:
    """Key every cluster of ``tables`` (:func:`_key_batch`) with passes over all their entries, given that no
    value is in two of the clusters and no node computes two of their values. Then:

    - ``local`` (each value's position in its cluster) gives an input's position, for an input in the
      reader's region is in its cluster or shared;
    - a value's node is numbered by the values computed before it in its cluster;
    - something outside a cluster's region reads a computed value exactly when a reader of the value is none
      of the nodes of the batch: a node of another cluster of the batch reading it would put the value in a
      region of that cluster too, and it is in one cluster only."""
    flat, referred, starts = tables.flat, tables.referred, tables.starts
    count = len(flat)
    facts = tuple(tables.facts)
    native = _native()
    if native is not None:
        # The columns below, natively (the same tuples: tests/test_classes_native.py).
        ends, node_ids, arities, inputs, at = native.key_columns(computed, starts, referred, tables.listed, local)
    else:
        # Each cluster's computed values are computed[ends[j]:ends[j + 1]] (computed is in entry order).
        ends = list(map(functools.partial(bisect.bisect_left, computed), starts))
        node_of = dict(zip(computed, itertools.chain.from_iterable(map(range, map(operator.sub, ends[1:], ends)))))
        node_ids = tuple(map(node_of.get, range(count)))
        arities = _arities(referred, tables.listed)
        names = list(itertools.chain.from_iterable(referred))
        inputs = tuple(map(local.get, names, names))
        # Each cluster's inputs are inputs[at[start]:at[end]].
        at = list(itertools.accumulate(map(len, referred), initial=0))
    tails = tables.tails
    if tables.pointing:
        # Name facts naming other values: each such value by its position in the entry's own cluster.
        values_of = tables.values
        for position, after in zip(tables.pointing, map(functools.partial(bisect.bisect_right, starts), tables.pointing)):
            values = values_of[after - 1]
            flags, previous, named_next = tails[position]
            tails[position] = (
                flags,
                None if previous is None else _named_in(previous, values, local, shared),
                None if named_next is None else _named_in(named_next, values, local, shared),
            )
    tails = tuple(tails)
    # The computed values read outside their regions, in entry order (a sentinel ends them).
    read = _read_outside(walker, list(map(flat.__getitem__, computed)), set(nodes), computed)
    shared_below = walker.shared_below
    if native is not None:
        # The loop below, natively (the same keys: tests/test_classes_native.py).
        native.key_clusters(tables.clusters, tables.values, starts, ends, nodes, facts, node_ids, arities, inputs, at, tails, referred, local, read, shared_below)
        return
    outside = iter(read + [count])
    next_outside = next(outside)
    for j, cluster in enumerate(tables.clusters):
        start, end = starts[j], starts[j + 1]
        values = tables.values[j]
        shared_read = set(itertools.chain.from_iterable(referred[start:end])).difference(local)
        shared_read.discard("")
        read_outside: tuple[int, ...] = ()
        if next_outside < end:
            found = []
            while next_outside < end:
                found.append(next_outside - start)
                next_outside = next(outside)
            read_outside = tuple(found)
        cluster.values = values
        cluster.nodes = nodes[ends[j]:ends[j + 1]]
        cluster.key = (
            tuple(map(local.__getitem__, cluster.outputs)),
            tuple(cluster.extras),
            (facts[start:end], node_ids[start:end], arities[start:end], inputs[at[start]:at[end]]),
            _names(values, tails[start:end], shared_below(frozenset(shared_read)) if shared_read else []),
            read_outside,
        )


def _between(positions: list[int], start: int, end: int) -> list[int]:
    """The entries of the sorted ``positions`` in ``[start, end)``."""
    return positions[bisect.bisect_left(positions, start):bisect.bisect_left(positions, end)]


def _named_in(name: str, values: list[str], local: dict[str, int], shared: set[str]) -> tuple:
    """:func:`_named` for a cluster of :func:`_key_together`, whose values' positions are in ``local``."""
    position = local.get(name)
    if position is not None and position < len(values) and values[position] == name:
        return ("local", position)
    return ("shared", name) if name in shared else _OUTSIDE


def _key_alone(walker: _Walker, tables: _Tables, j: int, shared: set[str]) -> None:
    """Key cluster ``j`` of ``tables`` (:func:`_key_batch`) on its own: its values' positions, nodes and readers
    outside taken within the cluster."""
    cluster, values = tables.clusters[j], tables.values[j]
    start, end = tables.starts[j], tables.starts[j + 1]
    count = end - start
    ids = dict(zip(values, range(count)))
    producers, referred = tables.producers[start:end], tables.referred[start:end]
    # Nodes in the order their first value comes; a leaf's None maps to None.
    nodes = list(dict.fromkeys(filter(_is_not_none, producers)))
    node_ids = dict(zip(nodes, range(len(nodes))))
    names = list(itertools.chain.from_iterable(referred))
    structure = (
        tuple(tables.facts[start:end]),
        tuple(map(node_ids.get, producers)),
        _arities(referred, [position - start for position in _between(tables.listed, start, end)]),
        tuple(map(ids.get, names, names)),
    )
    computed = list(itertools.compress(range(count), map(_is_not_none, producers)))
    shared_read = set(itertools.chain.from_iterable(referred)).difference(ids)
    shared_read.discard("")
    tails = tables.tails[start:end]
    for position in _between(tables.pointing, start, end):
        flags, previous, named_next = tails[position - start]
        tails[position - start] = (flags, _named(previous, ids, shared), _named(named_next, ids, shared))
    cluster.values = values
    cluster.nodes = nodes
    cluster.key = (
        tuple(map(ids.__getitem__, cluster.outputs)),
        tuple(cluster.extras),
        structure,
        _names(values, tails, walker.shared_below(frozenset(shared_read)) if shared_read else []),
        tuple(_read_outside(walker, list(map(values.__getitem__, computed)), set(nodes), computed)),
    )


def _arities(referred: list[tuple[str, ...]], listed: list[int]) -> tuple[int, ...]:
    """How many names each entry refers to, -1 for an entry of a value only listed (``listed``)."""
    arities = list(map(len, referred))
    for position in listed:
        arities[position] = -1
    return tuple(arities)


def _names(values: list[str], tails: Sequence[tuple], shared_names: list[str]) -> tuple[tuple, tuple, tuple]:
    """The cluster's names in the key: ``(by name, before, tails)``, the positions of its values in name order,
    each value's place among ``shared_names`` (the number of them sorting before it) and its ``tails`` entry.

    The order of the names is kept as the permutation that sorts them, which is what each value's rank holds
    too (the ranks are its inverse), at the cost of one sort instead of two."""
    count = len(values)
    by_name = tuple(sorted(range(count), key=values.__getitem__))
    before = tuple(map(functools.partial(bisect.bisect_left, shared_names), values)) if shared_names else (0,) * count
    return by_name, before, tails if isinstance(tails, tuple) else tuple(tails)


def _read_outside(walker: _Walker, computed_values: list[str], inside: set[int], positions: list[int]) -> list[int]:
    """The ``positions`` of the ``computed_values`` that a subgraph or a node not ``inside`` reads."""
    index = walker.index
    outside = map(operator.not_, map(inside.issuperset, map(index.consumers.get, computed_values, itertools.repeat((), len(computed_values)))))
    if index.subgraph_reads:
        outside = map(operator.or_, outside, map(index.subgraph_reads.__contains__, computed_values))
    return list(itertools.compress(positions, outside))


def _named(name: str | None, ids: dict[str, int], shared: set[str]) -> tuple | None:
    """A value a name fact points to: local (by position), shared (by name), or elsewhere in the graph."""
    if name is None:
        return None
    if name in ids:
        return ("local", ids[name])
    if name in shared:
        return ("shared", name)
    return _OUTSIDE


@dataclasses.dataclass
class _Template:
    """A solved class: its first member's values and nodes, and the matches found (None: solve each member
    directly)."""

    values: list[str]
    nodes: list[int]
    matches: list | None


def find_by_class(
    index: GraphIndex,
    outputs: Sequence[str],
    solve: Callable[[list[str]], tuple[list, list]],
    rename: Callable[[object, list[str], list[int], list[str], list[int]], object],
    name_facts: Callable[[Sequence[str], Sequence[bool]], list[tuple]],
    form_leaves: Callable[[str], set[str]],
) -> tuple[list, list]:
    """The matcher's result over ``outputs``, solving one member per structural class.

    Args:
        index: the graph.
        outputs: the candidate outputs (graph outputs, in graph order; the non-float ones are skipped).
        solve: the matcher over a list of outputs: ``(matches, misses)`` (``sgd_match._find``).
        rename: a match of a class's solved member renamed for another member: ``rename(match, values, nodes,
            member values, member nodes)``, the solved member's values and nodes corresponding by position to
            the other member's.
        name_facts: the facts the matcher draws from a name (see :func:`clusters_of`).
        form_leaves: the leaves of an output's linear form.

    Returns:
        ``(matches, misses)`` in the order the matcher gives them for the whole list.
    """
    position = {o: k for k, o in enumerate(outputs)}
    try:
        clusters = clusters_of(index, outputs, name_facts, form_leaves, lazy=True)
    except _TooLarge as error:
        logger.debug("region of %s exceeds %d values: solving the graph directly", error, MAX_WALK)
        return solve(list(outputs))
    templates: dict[tuple, _Template] = {}
    matches: list = []
    misses: list = []
    solved = instantiated = 0
    for cluster in clusters:
        if cluster.key is None:
            found, refused = _solve_cluster(cluster, solve, position)
            solved += 1
        else:
            template = templates.get(cluster.key)
            if template is None:
                found, refused = _solve_cluster(cluster, solve, position)
                solved += 1
                template = _Template(cluster.values, cluster.nodes, None if refused else found)
                templates[cluster.key] = template
                if not refused:
                    for j, match in enumerate(found):
                        match.structural_class = (len(templates), j)
            elif template.matches is None:
                found, refused = _solve_cluster(cluster, solve, position)
                solved += 1
            else:
                found, refused = [rename(m, template.values, template.nodes, cluster.values, cluster.nodes) for m in template.matches], []
                for match, solved_match in zip(found, template.matches):
                    match.structural_class = solved_match.structural_class
                instantiated += 1
        # The key and the walk are done with (a template keeps its own): drop them as we go.
        cluster.key, cluster.values, cluster.nodes = None, [], []
        matches.extend(found)
        misses.extend(refused)
    logger.debug("matched %d clusters directly, %d by class", solved, instantiated)
    matches.sort(key=lambda m: position.get(m.parameters_out, len(position)))
    misses.sort(key=lambda m: position.get(m.candidate, len(position)))
    return matches, misses


def _solve_cluster(cluster: Cluster, solve: Callable[[list[str]], tuple[list, list]], position: dict[str, int]) -> tuple[list, list]:
    """The matcher on the cluster's outputs (and its extras, whose own results belong to their cluster)."""
    if not cluster.extras:
        return solve(cluster.outputs)
    own = set(cluster.outputs)
    together = sorted(set(cluster.outputs) | set(cluster.extras), key=position.__getitem__)
    found, refused = solve(together)
    return [m for m in found if m.parameters_out in own], [m for m in refused if m.candidate in own]
