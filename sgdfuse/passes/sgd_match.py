"""Solve for the SGD roles in normalised update equations.

A candidate is a graph output ``W`` (new parameters) whose elementwise cone contains another graph output
``V`` (the new momentum buffer). With both normalised by :mod:`sgdfuse.passes.linear`, the contract
(docs/contract.md, with ``stat = 0``, which is what a step after the first computes) says

    V = m·A + (1-d)·s·G + (1-d)·wd·P                      (s = -1 for maximize, +1 otherwise)
    W = P - lr·V                                           (plain)
    W = P - lr·(s·G + wd·P) - lr·m·V  =  P - lr·(1+m)·V + lr·m·A      (Nesterov, d = 0)

so for a choice of the leaves ``A`` (old buffer) and ``P`` (old parameters), ``W - P = α·V + β·A`` must
hold exactly for two scalars α, β: β = 0 is plain momentum with lr = -α; otherwise Nesterov with
lr = β/m and α = -lr·(1+m). The gradient is whatever is left of ``V`` once ``m·A`` and the ``P`` term are
removed; it must be the value of one tensor in the graph (times a constant ±(1-d)). Any formulation with
these equations fuses; anything else is refused with the term that did not fit.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import itertools
import logging
import math
import operator
import os
import re
from collections.abc import Callable, Container, Iterable, Mapping, Sequence

import numpy as np
import onnx

from sgdfuse.contract import TensorSpec, check_attributes, dtype_name, format_shape
from sgdfuse.errors import ContractError, RolePinError
from sgdfuse.passes.classes import find_by_class
from sgdfuse.passes.index import GraphIndex
from sgdfuse.passes.linear import LINEAR_OPS, ONE, Form, Normaliser, Poly, add_forms, boolean_root, format_form, format_poly, scale_form
from sgdfuse.passes.precision import FLOAT_DTYPES, SPACINGS, Precision, round_to_dtype, working_precision

__all__ = ["Match", "Miss", "FirstStep", "Guard", "RolePins", "REASONS", "ROLE_EVIDENCE", "find_updates", "guarded_outputs", "previous_by_name"]

logger = logging.getLogger(__name__)

_EPS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
"""The dtypes the SGD operator keeps state in (the only candidates for an update)."""

_NO_SPEC = TensorSpec("", None, 0)
"""``GraphIndex.spec`` of a value without one (dtype 0)."""

_dtype_of = operator.attrgetter("dtype")

_COPY_OPS = frozenset({"Identity", "Cast", "CastLike"})
"""The ops :func:`_skip_copies` may follow (any other producer makes a value its own copy-free value)."""

_state_of = operator.attrgetter("parameters", "accum", "parameters_out", "accum_out")
_outputs_of = operator.attrgetter("parameters_out", "accum_out")


class LazyText:
    """Text computed when first read (``str()``): equations of every candidate tried are formatted only for
    the few that reach a report."""

    __slots__ = ("_make", "_text")

    def __init__(self, make) -> None:
        self._make = make
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._make()
        return self._text

    def __repr__(self) -> str:
        return repr(str(self))

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


@dataclasses.dataclass
class Match:
    """One momentum-SGD update found in the graph, with its roles solved.

    Attributes:
        parameters, gradient, accum: value names of the old weights, the gradient and the old buffer.
        parameters_out, accum_out: graph outputs holding the new weights and the new buffer.
        learning_rate, momentum: coefficients (constants or expressions of runtime scalars).
        dampening, weight_decay: compile-time constants (contract attributes).
        nesterov, maximize: the update's form; maximize means the gradient enters negated.
        dtype, shape: of the parameters (ONNX dtype code; dims, symbolic ones as strings).
        nodes: indices of the nodes of the matched cone (the update's nodes in the original graph).
        parameter_equation, accum_equation: the normalised equations, for the report.
    """

    parameters: str
    gradient: str
    accum: str
    parameters_out: str
    accum_out: str
    learning_rate: Poly
    momentum: Poly
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    dtype: int
    shape: tuple | None
    nodes: set[int]
    parameter_equation: "str | LazyText"
    accum_equation: "str | LazyText"
    first_step: "FirstStep | None" = None
    rounded: dict[str, float] = dataclasses.field(default_factory=dict)
    """Learning rate or momentum constants the op's dtype rounds (only with rounding allowed): name → the
    value the op uses."""
    roles_from: str = "structure"
    """Which evidence decided the roles (:data:`ROLE_EVIDENCE`)."""
    guard: "Guard | None" = None
    """The condition under which the graph skips this update (a loss-scaling overflow, a frozen parameter):
    the graph outputs are ``Where(condition, old, new)``; ``parameters_out``/``accum_out`` are the new values
    and the ``Where`` nodes stay, reading the fused node's outputs."""
    coefficient_error: float = 0.0
    """The largest difference between a coefficient of the buffer update as the op applies it and the
    graph's, in spacings of the working precision (:mod:`sgdfuse.passes.precision`). The graph writes the
    buffer's coefficients as single constants, so an exact reading has 0 here; one that needs a dampening
    near 1 does not. Readings are ranked by it."""
    structural_class: object = dataclasses.field(default=None, compare=False, repr=False)
    """``(class, position)`` when the matcher solved this update's structural class once and renamed the
    result (:mod:`sgdfuse.passes.classes`): matches with equal values are one another's renaming, and so are
    their rewrites; None when it was solved on its own."""
    rejected_readings: tuple = dataclasses.field(default=(), compare=False, repr=False)
    """``(buffer, gradient)`` of the readings the role evidence ranked above this one and that were dropped
    because the gradient is computed from that buffer (:func:`_reads_from`): a fact of the graph beyond the
    structural class key, so :func:`_find_by_class` solves the graph directly when a solved member has one."""
    equation_forms: tuple = dataclasses.field(default=(), compare=False, repr=False)
    """``(parameter form, buffer form)`` the two equations are written from (over the graph's values): kept
    so that a match renamed for another member of its structural class writes its own equations."""


    def with_equations(self) -> "Match":
        """This match with :attr:`parameter_equation` and :attr:`accum_equation` written (lazily) from
        :attr:`equation_forms`, in terms of its own values."""
        parameter_form, buffer_form = self.equation_forms
        self.parameter_equation, self.accum_equation = _equations(
            self.parameters, self.gradient, self.accum, self.parameters_out, self.accum_out, parameter_form, buffer_form
        )
        return self

    def renamed(self, names: Mapping[str, str], nodes: Mapping[int, int]) -> "Match":
        """This match for another member of its structural class (:mod:`sgdfuse.passes.classes`): every value
        name through ``names`` and node index through ``nodes`` (names and nodes not in them, shared by the
        members, stay), its equations rewritten from the renamed forms."""
        name = names.get
        parameter_form, buffer_form = self.equation_forms
        # A copy of every field, then the renamed ones (what dataclasses.replace does, without its per-field
        # introspection: this runs once per renamed update, ten thousand times on a large step).
        renamed = object.__new__(type(self))
        renamed.__dict__.update(
            self.__dict__,
            parameters=name(self.parameters, self.parameters),
            gradient=name(self.gradient, self.gradient),
            accum=name(self.accum, self.accum),
            parameters_out=name(self.parameters_out, self.parameters_out),
            accum_out=name(self.accum_out, self.accum_out),
            learning_rate=_renamed_poly(self.learning_rate, names),
            momentum=_renamed_poly(self.momentum, names),
            nodes=set(map(nodes.get, self.nodes, self.nodes)),
            first_step=None if self.first_step is None else dataclasses.replace(self.first_step, condition=name(self.first_step.condition, self.first_step.condition)),
            guard=None if self.guard is None else dataclasses.replace(
                self.guard,
                output=name(self.guard.output, self.guard.output),
                new=name(self.guard.new, self.guard.new),
                old=name(self.guard.old, self.guard.old),
                condition=name(self.guard.condition, self.guard.condition),
            ),
            rounded=dict(self.rounded),
            equation_forms=(_renamed_form(parameter_form, names), _renamed_form(buffer_form, names)),
        )
        return renamed.with_equations()


def _equations(p: str, g: str, a: str, w: str, v: str, parameter_form: Form, buffer_form: Form) -> tuple[LazyText, LazyText]:
    """:attr:`Match.parameter_equation` and :attr:`Match.accum_equation`, written when first read."""
    return (
        LazyText(functools.partial(_equation, w, parameter_form, [p, v, a])),
        LazyText(functools.partial(_equation, v, buffer_form, [a, g, p])),
    )


def _equation(left: str, form: Form, order: list[str]) -> str:
    return f"{left} = {format_form(form, order)}"


def _renamer(match: Match, values: list[str], nodes: list[int]) -> Callable[[list[str], list[int]], Match]:
    """:meth:`Match.renamed` of ``match`` for the other members of its structural class, as a function of a
    member's values and nodes, which correspond by position to ``values`` and ``nodes`` (the solved member's).

    Each name the match holds is read once here as a position among ``values`` (or as itself, when shared by
    the members), so that a member's names are one ``itemgetter`` away; a match with runtime coefficients, a
    first-step rule or a guard is renamed by :meth:`Match.renamed`."""
    parameter_form, buffer_form = match.equation_forms
    if (
        match.first_step is not None
        or match.guard is not None
        or not all(map(_is_constant, (match.learning_rate, match.momentum, *parameter_form.values(), *buffer_form.values())))
    ):
        return lambda member_values, member_nodes: match.renamed(dict(zip(values, member_values)), dict(zip(nodes, member_nodes)))
    fields = (match.parameters, match.gradient, match.accum, match.parameters_out, match.accum_out)
    names, names_staying = _positions([*fields, *parameter_form, *buffer_form], values)
    node_positions, nodes_staying = _positions(list(match.nodes), nodes)
    split = len(fields) + len(parameter_form)
    parameter_coefficients, buffer_coefficients = list(parameter_form.values()), list(buffer_form.values())

    def rename(member_values: list[str], member_nodes: list[int]) -> Match:
        renamed_names = names(member_values + names_staying if names_staying else member_values)
        p, g, a, w, v = renamed_names[:5]
        member_parameter_form = dict(zip(renamed_names[len(fields):split], parameter_coefficients))
        member_buffer_form = dict(zip(renamed_names[split:], buffer_coefficients))
        parameter_equation, accum_equation = _equations(p, g, a, w, v, member_parameter_form, member_buffer_form)
        renamed = object.__new__(Match)
        # As Match.renamed: a copy of every field, then the renamed ones (its equations written from its forms).
        renamed.__dict__.update(
            match.__dict__,
            parameters=p,
            gradient=g,
            accum=a,
            parameters_out=w,
            accum_out=v,
            nodes=set(node_positions(member_nodes + nodes_staying if nodes_staying else member_nodes)),
            rounded=dict(match.rounded),
            equation_forms=(member_parameter_form, member_buffer_form),
            parameter_equation=parameter_equation,
            accum_equation=accum_equation,
        )
        return renamed

    return rename


def _positions(items: list, among: list) -> tuple[Callable[[list], tuple], list]:
    """``(getter, staying)``: ``getter(member + staying)`` is ``items`` with each item of ``among`` replaced by the
    entry of ``member`` at its position, and every other item kept (``staying`` holds those)."""
    where = dict(zip(among, range(len(among))))
    staying: list = []
    positions = []
    for item in items:
        position = where.get(item)
        if position is None:
            position = len(among) + len(staying)
            staying.append(item)
        positions.append(position)
    getter = operator.itemgetter(*positions) if positions else (lambda _: ())
    if len(positions) == 1:
        return (lambda member: (getter(member),)), staying
    return getter, staying


def _is_constant(poly: Poly) -> bool:
    """:attr:`Poly.is_constant`, as a function."""
    return poly.is_constant


def _renamed_poly(poly: Poly, names: Mapping[str, str]) -> Poly:
    terms = poly.terms
    if not terms or (len(terms) == 1 and () in terms):
        return poly  # a constant (Poly.is_constant, inline: most coefficients are)
    return Poly({tuple(sorted((names.get(s, s), power) for s, power in monomial)): c for monomial, c in terms.items()})


def _renamed_form(form: Form, names: Mapping[str, str]) -> Form:
    return dict(zip(map(names.get, form, form), map(_renamed_poly, form.values(), itertools.repeat(names))))


@dataclasses.dataclass
class Miss:
    """A candidate that did not fuse.

    Attributes:
        candidate: the graph output that looked like an update.
        reason: a stable reason code (see :data:`REASONS`).
        detail: one sentence saying what did not fit and what the user can do.
        equation: the update equation recovered from the graph, if any.
        nearest: the closest SGD form the solver reached, if any.
        differing: the term that differed between the two.
        score: how far the candidate got (higher is nearer); used to pick the nearest miss.
    """

    candidate: str
    reason: str
    detail: str
    equation: "str | LazyText" = ""
    nearest: str = ""
    differing: str = ""
    score: int = 0
    buffer: str = ""
    buffer_in_cone: bool = False


REASONS = {
    "no-momentum-buffer": "the parameter update reads no momentum buffer that the graph outputs (momentum 0 or absent)",
    "constant-state": "parameters or momentum buffer are constants (initializers), not state the graph is fed",
    "computed-state": "parameters or momentum buffer are computed inside the graph, not fed as state",
    "extra-term": "the parameter update has a term momentum SGD does not have",
    "no-gradient": "the buffer update has no gradient term",
    "gradient-not-a-value": "the gradient term is a sum that no single tensor in the graph computes",
    "nesterov-momentum-mismatch": "the Nesterov look-ahead uses a different momentum than the buffer",
    "runtime-hyperparameter": "dampening or weight decay is computed at run time; the contract needs constants",
    "contract": "the solved hyper-parameters break the operator contract",
    "shape-mismatch": "parameters, gradient and buffers do not share one shape",
    "dtype-mismatch": "parameters, gradient and buffers do not share one dtype",
    "mixed-precision": "the update is computed in a different precision than the parameters",
    "shared-state": "another update already uses this parameter or buffer",
    "verification-failed": "onnxruntime found the fused update computes different numbers",
    "tensor-factor": "the buffer is multiplied by a tensor of several elements (a per-element learning rate)",
    "gradient-mixes-tensors": "the gradient weighs several tensors differently (weight decay on another tensor)",
    "first-step-unsupported": "the first-step rule is not expressible with the contract's stat flag",
    "buffer-not-own-previous": "the buffer update reads a different tensor than the buffer it replaces",
    "parameters-not-own-previous": "the parameter update reads a different tensor than the parameters it replaces",
    "opset": "the model's opset is too old for the fused op's function body",
    "ambiguous-roles": "the algebra admits more than one choice of buffer and gradient, and nothing names the buffer",
    "inexact-coefficients": "the coefficients the op would apply (float32 attributes, 1 - dampening) differ from the graph's",
    "hyperparameter-precision": "the op takes learning rate and momentum in the parameters' dtype, which rounds the graph's values",
    "cancelling-terms": "the update adds and removes the same runtime term, which floating point does not cancel",
    "wrong-in-place-output": "another graph output is named as the next value of the state this reading would overwrite",
    "momentum-op": "an ai.onnx.preview.training Momentum node whose settings the SGD operator cannot express",
    "nonlinear-update": "the new buffer reaches the parameter update through an op that is not a scaling (Pow, say)",
    "guarded-update": "the update is skipped under a condition in a form sgdfuse cannot keep exact",
    "hidden-update": "the parameters' output is a Slice, Reshape or other non-elementwise op of an update",
    "gradient-reads-buffer": "the only readings take as the buffer a tensor the gradient is computed from",
    "state-stepped-twice": "the new weights are stepped again in the same graph (two steps unrolled, a tied weight)",
}


@dataclasses.dataclass(frozen=True)
class RolePins:
    """What the user says about roles, the first evidence consulted (:data:`ROLE_EVIDENCE`).

    Attributes:
        state: new value → the input it replaces (``{"add": "b0", "add_1": "p0"}``): that output is written
            into that input in place.
        buffers: glob patterns (``fnmatch``) of the momentum-buffer inputs (``"b*"``, ``"*.momentum_buffer"``).
    """

    state: Mapping[str, str] = dataclasses.field(default_factory=dict)
    buffers: tuple[str, ...] = ()
    guarded: frozenset[str] = frozenset()
    """(Filled in by the matcher, not the user.) New values whose input the graph's own guard names:
    ``Where(found_inf, buf, buf_new)`` says ``buf_new`` replaces ``buf``; their pairs are in :attr:`state`."""

    def is_buffer(self, name: str) -> bool | None:
        """True/False when the globs say whether ``name`` is a buffer; None when there are none."""
        if not self.buffers:
            return None
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.buffers)


ROLE_EVIDENCE = ("pin", "names", "structure", "conventions", "plausibility")
"""Which evidence decides a fused update's roles (which input is the buffer, which the gradient, which
output is written in place), in the order consulted (``Match.roles_from``):

- ``pin``: the user's ``RolePins`` (``--state NEW=OLD``, ``--buffers GLOB``);
- ``names``: an output named after its input (``buf_out``/``new_buf``/``buf_next`` for ``buf``);
- ``structure``: only one reading is momentum SGD with its state fed from outside (the algebra, and a
  gradient computed in the graph while the buffer is fed in);
- ``conventions``: the ecosystem's names for buffers (``momentum_buffer``, ``velocity``, ``accum``, ``buf``,
  ``moments``, ``slot``) and gradients (``grad``, ``gradient``, ``g``, ``g0``);
- ``plausibility``: the reading with a constant momentum in (0, 1) and dampening 0, when the others do not
  have both. The weakest evidence: ``lower`` warns when it decided.
"""

_BUFFER_NAME = re.compile(r"(^|[^a-z])(momentum|moments?|velocity|veloc|buf|buffer|bufs|accum|accumulator|slot|trace|mom)([^a-z]|$)", re.I)
_GRADIENT_NAME = re.compile(r"(^|[^a-z])(grad|grads|gradient|gradients|g|dw|dp)([^a-z]|\d|$)", re.I)


def _convention_flags(name: str) -> tuple[bool, bool]:
    """Whether ``_BUFFER_NAME`` and ``_GRADIENT_NAME`` match ``name``. An ASCII name holding none of a pattern's
    words' cores cannot match it (each alternative contains one: ``mom``, ``buf``, ``veloc``, ``accum``,
    ``lot`` rather than ``slot``, whose ``s`` the ignore-case match also reads as ``ſ``, ``trace``; ``g``,
    ``dw``, ``dp``), which rules out most names without the regex; other names are searched."""
    if name.isascii():
        low = name.lower()
        buffer = ("mom" in low or "buf" in low or "veloc" in low or "accum" in low or "lot" in low or "trace" in low) and _BUFFER_NAME.search(name) is not None
        gradient = ("g" in low or "dw" in low or "dp" in low) and _GRADIENT_NAME.search(name) is not None
        return buffer, gradient
    return _BUFFER_NAME.search(name) is not None, _GRADIENT_NAME.search(name) is not None


_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
"""Every ASCII digit as ``0`` (in UTF-8: no other character's bytes are ASCII): the convention patterns read a
digit only as a character that is no letter (``[^a-z]``, ``\\d``), any digit alike, so a name and its digits
made ``0`` match them alike."""


def _conventions_of(names: Sequence[str], known: dict[bytes, tuple[bool, bool]]) -> list[tuple[bool, bool]]:
    """:func:`_convention_flags` of each name, asked once per name with its digits made ``0``
    (:data:`_DIGITS_AS_ZERO`) and remembered in ``known``: the updates of a step differ in their numbers, so
    their values' names fall on a few such forms. The forms are made for all the names at once, joined
    (``str.translate`` would look every character up in a dict)."""
    if not names:
        return []
    text = "\x00".join(names)
    if text.count("\x00") == len(names) - 1:
        forms = text.encode("utf-8", "surrogatepass").translate(_DIGITS_AS_ZERO).split(b"\x00")
    else:  # a name holding NUL: each on its own
        forms = [name.encode("utf-8", "surrogatepass").translate(_DIGITS_AS_ZERO) for name in names]
    found = list(map(known.get, forms))
    for position in list(itertools.compress(range(len(found)), map(operator.is_, found, itertools.repeat(None)))):
        form = forms[position]
        flags = known.get(form)
        if flags is None:
            flags = known[form] = _convention_flags(form.decode("utf-8", "surrogatepass"))
        found[position] = flags
    return found


@dataclasses.dataclass(frozen=True)
class Guard:
    """A guarded state output ``output = Where(condition, old, new)`` (or with the branches swapped).

    Attributes:
        output: the graph output; new: the updated value it selects; old: the state input it keeps.
        condition: a boolean of one element; skip_when: the condition's value that keeps ``old``.
        only: on a match, ``"parameters"`` or ``"buffer"`` when the guard keeps that state alone and the
            graph writes the other one's update on every step; ``""`` when it keeps both.
    """

    output: str
    new: str
    old: str
    condition: str
    skip_when: bool
    only: str = ""

    def describe(self) -> str:
        """``"skipped where found_inf is true"``; for a guard on one state, ``"parameters skipped where
        found_inf is true (the buffer is updated on every step)"``."""
        text = f"skipped where {self.condition} is {'true' if self.skip_when else 'false'}"
        if self.only:
            other = "buffer" if self.only == "parameters" else "parameters"
            text = f"{self.only} {text} (the {other} {'is' if other == 'buffer' else 'are'} updated on every step)"
        return text


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """A first-step rule selected by ``Where`` on one boolean.

    Attributes:
        condition: the boolean value that selects the branches.
        when_true: True when ``condition`` true means "first step".
        zero_accum: True when the first step ignores the old buffer (PyTorch's ``buf = grad``): the fused
            node is then fed a zeroed buffer on that step, so it stays exact whatever the buffer holds.
            False when the first step is ``m·buf + grad`` (ONNX ``Momentum`` with ``T == 0``), which is the
            contract with ``stat = 1`` as it is.
    """

    condition: str
    when_true: bool
    zero_accum: bool


def find_updates(
    index: GraphIndex, normaliser: Normaliser | None = None, *, allow_rounding: bool = False, pins: RolePins | None = None
) -> tuple[list[Match], list[Miss]]:
    """All momentum-SGD updates among the graph outputs of ``index``, and the candidates refused.

    Deterministic: candidates are taken in graph-output order. ``allow_rounding`` accepts a learning rate or
    momentum that the op's dtype (the parameters') rounds (reason ``hyperparameter-precision`` otherwise).
    ``pins`` is the user's word on roles, consulted first (:data:`ROLE_EVIDENCE`).
    """
    pins = pins or RolePins()
    _check_pins(index, pins)
    normaliser = normaliser or Normaliser(index)
    outputs = list(dict.fromkeys(index.graph_outputs))
    # Every output's copy-free value, asked here for each output and again for the fused ones (most outputs
    # come out of no copy: they are their own).
    canonical = dict(zip(outputs, outputs))
    producer, facts = index.producer, index.nodes
    for output in [o for o in outputs if (k := producer.get(o)) is not None and facts[k][0] in _COPY_OPS]:
        canonical[output] = _skip_copies(index, output)
    matches, misses = _find_by_class(index, normaliser, outputs, pins, allow_rounding, canonical)
    # A guarded output Where(c, old, new) that no update explains as it is (a first-step Where is one) is
    # matched through its new value; the guard pairs new with old.
    fused = list(itertools.chain.from_iterable(map(_outputs_of, matches)))
    claimed = set(map(canonical.get, fused))
    if None in claimed:  # an output not among the graph's (never, as the matcher finds them)
        claimed = {canonical[name] if name in canonical else _skip_copies(index, name) for name in fused}
    guards = {g.new: g for g in (_guard(index, o) for o in outputs if canonical[o] not in claimed) if g is not None}
    if not guards:
        return _solve_readers_of_fused(index, normaliser, outputs, canonical, matches, misses, pins, allow_rounding)
    guarded_pins = dataclasses.replace(pins, state={**{g.new: g.old for g in guards.values()}, **pins.state}, guarded=frozenset(guards))
    # The unguarded outputs take part too: a guard on the parameters alone must meet its bare buffer (and
    # be refused as guarded-update, not as an update without a buffer).
    unguarded = [o for o in outputs if canonical[o] not in claimed and o not in {g.output for g in guards.values()}]
    guarded_matches, guarded_misses = _find(index, normaliser, list(guards) + unguarded, guarded_pins, allow_rounding, guards)
    guarded_matches = [m for m in guarded_matches if m.guard is not None]
    guarded_misses = [miss for miss in guarded_misses if miss.candidate in guards or miss.reason == "guarded-update" or miss.candidate in {g.output for g in guards.values()}]
    guard_outputs = {g.output for g in guards.values()} | set(guards)
    # An unguarded output met by a one-sided guard is reported there, not again as an update without a buffer.
    involved = {name for miss in guarded_misses if miss.reason == "guarded-update" for name in (miss.candidate, miss.buffer) if name}
    # The unguarded state output of an update fused with a guard on its other state is that update's.
    involved |= {canonical.get(name, name) for match in guarded_matches for name in _outputs_of(match)}
    misses = [miss for miss in misses if miss.candidate not in guard_outputs and miss.candidate not in involved and canonical.get(miss.candidate) not in involved] + guarded_misses
    combined, shared = _one_writer(matches + guarded_matches)
    return _solve_readers_of_fused(index, normaliser, outputs, canonical, combined, misses + shared, pins, allow_rounding)


_KEPT_FOR_READERS = frozenset({"shared-state", "parameters-not-own-previous", "guarded-update", "state-stepped-twice"})
"""Refusals :func:`_find` keeps for an output that reads a fused update's new values (they are about that
output as a writer of state, not about how it reads the fused update), and :func:`_solve_readers_of_fused`
does not solve again."""


def _solve_readers_of_fused(
    index: GraphIndex,
    normaliser: Normaliser,
    outputs: list[str],
    canonical: Mapping[str, str],
    matches: list[Match],
    misses: list[Miss],
    pins: RolePins,
    allow_rounding: bool,
) -> tuple[list[Match], list[Miss]]:
    """``matches`` and ``misses`` with the updates that read a fused update's new values solved again.

    Read through the fused update's nodes, such an update (``g2 = 2*w1_new`` as the gradient of ``w2``) mixes
    the other update's state into its own gradient: :func:`_find` dropped it as a reader of the fused update
    (its rule for ``delta = lr*buf_out`` beside ``p_out = p - delta``), so it was neither fused nor refused, or
    refused it for the other update's terms (``computed-state`` for the other's first-step ``Where``). After
    the rewrite those new values are outputs of an ``ai.sgdfuse`` node, so each output that reads them, looks
    like an update and is not fused is solved again with every fused update's outputs as opaque leaves
    (:class:`~sgdfuse.passes.linear.Normaliser`'s ``opaque``): it fuses (its SGD node reads the other's output;
    the rewrite orders nodes topologically, and verification runs it against the original), is refused with
    that reading's reason, keeps its first refusal when that reading still sees an update but says nothing of
    it, or is dropped as a reader when it is no update then (``lr*buf_out`` is one leaf). A reader guarded by
    a loss scaler (``Where(found_inf, old, new)`` on its state) is solved through its guards, its new values
    the candidates, as :func:`find_updates` solves the others. Repeated while updates fuse: a chain of them. Solved directly, not per structural class: these are few, and the class key
    knows nothing of ``opaque``."""
    named_next: dict[str, str] | None = None
    while matches:
        fused = frozenset(name for match in matches for name in (*_outputs_of(match), match.guard.output if match.guard else "") if name)

        def reads_fused(output: str) -> bool:
            return not fused.isdisjoint(normaliser.cone(output)[1] - {output})

        again: list[Miss] = []
        kept: list[Miss] = []
        for miss in misses:  # one pass: a list's `in` compares dataclasses, quadratic over many refusals
            (again if miss.reason not in _KEPT_FOR_READERS and reads_fused(miss.candidate) else kept).append(miss)
        accounted = set(fused) | {name for miss in kept for name in (miss.candidate, miss.buffer) if name}
        accounted |= {canonical.get(name, name) for name in accounted}
        open_outputs = [o for o in outputs if o not in accounted and canonical[o] not in accounted and index.spec(o).dtype in _EPS]
        # A guarded reader (Where(found_inf, old, new) on its state) is solved through its guards, as
        # find_updates solves the others: its new values are the candidates, the guards pair them with the old.
        guards = {g.new: g for g in (_guard(index, o) for o in open_outputs) if g is not None and g.new not in accounted}
        guard_outputs = {g.output for g in guards.values()}
        candidates = list(guards) + [o for o in open_outputs if o not in guard_outputs]
        readers = {o for o in candidates if _looks_like_update(index, o, normaliser.form(o)) and reads_fused(o)}
        opaque = Normaliser(index, opaque=fused)
        if not readers:
            return matches, kept + [miss for miss in again if _looks_like_update(index, miss.candidate, opaque.form(miss.candidate))]
        if named_next is None:
            named_next = _named_next(index, [o for o in outputs if index.spec(o).dtype in _EPS], pins, canonical)
        reader_pins = pins
        if guards:
            reader_pins = dataclasses.replace(pins, state={**{g.new: g.old for g in guards.values()}, **pins.state}, guarded=frozenset(guards))
        # The open outputs are the readers and the buffers they may read (a reader's new buffer reads the
        # fused update too); outputs fused or refused for another reason are not solved twice.
        found, refused = _find(index, opaque, candidates, reader_pins, allow_rounding, guards, named_next)
        found = [m for m in found if not readers.isdisjoint(_outputs_of(m))]
        # Only a reader that is no update of its own state steps the weights again: B's new buffer
        # 0.9*b1 + (1-d)*2*w1_new holds w1_new with coefficient 1 at d = 0.5, and fuses as B's buffer.
        stepped = _stepped_twice(index, opaque, matches, readers - {name for m in found for name in _outputs_of(m)})
        if stepped:
            # The fused update's new weights are stepped again in this graph: they are not the state's next
            # values, and no single step says which output replaces the weights (nor the buffer): both are refused.
            dropped = {id(match) for match, _ in stepped.values()}
            involved = set(stepped) | {name for match, _ in stepped.values() for name in _outputs_of(match)}
            matches = [match for match in matches if id(match) not in dropped]
            misses = [miss for miss in misses if miss.candidate not in involved and canonical.get(miss.candidate) not in involved]
            first_refusals = {}
            for reader, (match, _) in stepped.items():
                first_refusals.setdefault(id(match), (match, reader))
                misses.append(_stepped_twice_miss(reader, match, reader, score=10))
            misses.extend(_stepped_twice_miss(match.parameters_out, match, reader, score=10) for match, reader in first_refusals.values())
            continue
        accepted, shared = _one_writer(matches + found)
        new = accepted[len(matches):]
        guarded_readers = {g.output for g in guards.values() if g.new in readers}
        refused = [miss for miss in refused if miss.candidate in readers or miss.candidate in guarded_readers] + shared
        explained = {name for match in new for name in _outputs_of(match)} | {miss.candidate for miss in refused}
        explained |= {g.output for g in guards.values() if g.new in explained}
        # A first refusal stands when the opaque reading still sees an update but says nothing of it; an
        # output that is no update once the fused values are leaves is a reader of them (lr*buf_out).
        unexplained = [miss for miss in again if miss.candidate not in explained and _looks_like_update(index, miss.candidate, opaque.form(miss.candidate))]
        misses = kept + unexplained + refused
        matches = accepted
        if not new:
            break
    return matches, misses


def _stepped_twice(index: GraphIndex, opaque: Normaliser, matches: list[Match], readers: set[str]) -> dict[str, tuple[Match, str]]:
    """The readers (update-shaped outputs that read fused updates' new values, not fused) that step a fused
    update's new weights again: their form, with the fused outputs as leaves (``opaque``), holds that update's
    ``parameters_out`` with coefficient exactly 1 (``add_3 = add_1 - 0.1*add_2`` beside ``add_1 = p0 -
    0.1*add``: two optimizer steps unrolled in one graph, or a tied weight updated twice). Such a reader is
    the weights' later value, so the fused update's outputs are not the state's next values. Maps each reader
    to ``(the fused match, the new weights it reads)``. A gradient computed from the new weights (``2*w1_new``)
    enters scaled by a learning rate, never with coefficient 1."""
    by_output = {match.parameters_out: match for match in matches if match.guard is None}
    stepped: dict[str, tuple[Match, str]] = {}
    for reader in sorted(readers):
        form = opaque.form(reader)
        for leaf, coefficient in form.items():
            match = by_output.get(leaf)
            if match is not None and coefficient.is_constant and coefficient.constant_value == 1.0 and len(set(form) - {ONE, leaf}) >= 1:
                stepped[reader] = (match, leaf)
                break
    return stepped


def _stepped_twice_miss(candidate: str, match: Match, reader: str, score: int) -> Miss:
    """The refusal of ``candidate`` (the first update's new weights, or the later update ``reader``) when
    ``reader`` steps ``match``'s new weights again (:func:`_stepped_twice`)."""
    return Miss(
        candidate,
        "state-stepped-twice",
        f"{match.parameters_out} = {match.parameters} - lr*{match.accum_out} is stepped again in this graph: "
        f"{reader} is computed from {match.parameters_out} plus another update term, so {match.parameters_out} is not "
        f"the next value of {match.parameters} (nor is {match.accum_out} surely that of {match.accum}); one fused node "
        "cannot say which output replaces the weights. Export one optimizer step per graph, or fuse with the state "
        "pinned (--state) after making the graph a single step.",
        buffer=match.accum_out if candidate == match.parameters_out else "",
        score=score,
    )


def _check_pins(index: GraphIndex, pins: RolePins) -> None:
    """A pin must name the model's own values: silently ignoring a typo would fuse as if it were not given.

    Raises:
        RolePinError: a ``state`` pair names an output or input the graph does not have, or a ``buffers``
            glob matches no graph input.
    """
    if not pins.state and not pins.buffers:
        return  # nothing to check (and no sets of every output and input to build)
    outputs, inputs = set(index.graph_outputs), set(index.state_names) | set(index.graph_inputs)
    for new, old in pins.state.items():
        if new not in outputs and new not in index.producer:
            raise RolePinError(f"--state {new}={old}", f"{new} is not a value of the model (graph outputs: {', '.join(sorted(outputs)[:8])}{', ...' if len(outputs) > 8 else ''})")
        if old not in inputs:
            raise RolePinError(f"--state {new}={old}", f"{old} is not an input of the model; OLD names the input that NEW replaces")
    for pattern in pins.buffers:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in inputs):
            raise RolePinError(f"--buffers {pattern}", "matches no input of the model; give a glob of the momentum-buffer inputs")


def _one_writer(matches: list[Match]) -> tuple[list[Match], list[Miss]]:
    """One parameter, one buffer, one update: a second claim on the same state is refused.

    A claim that *ascends* (a constant learning rate below 0 on a gradient that is not negated: the weights climb
    the buffer) is a real formulation on its own (gradient ascent written ``p + lr*buf``, optax's negative
    learning rate), but beside another claim on the same state it is the tell of a misreading: an unrolled second
    step ``add_2 = 0.9*add + g1`` read as the update of "parameters" ``g1`` with learning rate -0.9, claiming the
    buffer ``b0`` that ``add_1 = p0 - 0.1*add`` updates. No claim then says which output replaces the state,
    so every claim on it is refused (``shared-state``), not only the later ones."""
    names = list(itertools.chain.from_iterable(map(_state_of, matches)))
    if len(set(names)) == len(names):
        return list(matches), []  # every state value named once: no claim meets another (most steps)
    claims: dict[str, list[Match]] = {}
    for match in matches:
        for name in {match.parameters, match.accum, match.parameters_out, match.accum_out}:
            claims.setdefault(name, []).append(match)
    contested = {
        name for name, claimants in claims.items()
        if len(claimants) > 1 and any(_ascends(claimant) for claimant in claimants)
    }
    claimed: set[str] = set()
    accepted: list[Match] = []
    misses: list[Miss] = []
    for match in matches:
        state = {match.parameters, match.accum, match.parameters_out, match.accum_out}
        if state & contested:
            misses.append(
                Miss(
                    match.parameters_out,
                    "shared-state",
                    f"{match.parameters_out}: {', '.join(sorted(state & contested))} is claimed by more than one update, "
                    "one of them read with a negative learning rate on a gradient that is not negated (the weights "
                    "climbing their buffer: an unrolled second step read as an update of its gradient, say); no claim "
                    "says which output replaces that state, so none is fused. Export one optimizer step per graph, or "
                    "pin the state (--state).",
                    score=5,
                )
            )
            continue
        if state & claimed:
            misses.append(
                Miss(
                    match.parameters_out,
                    "shared-state",
                    f"{match.parameters_out}: {', '.join(sorted(state & claimed))} is already updated by "
                    "another fused update; fusing both would write it twice.",
                    score=5,
                )
            )
            continue
        claimed |= state
        accepted.append(match)
    return accepted, misses


def _ascends(match: Match) -> bool:
    """A constant learning rate below 0 on a gradient that is not negated (:func:`_one_writer`)."""
    lr = match.learning_rate
    return lr.is_constant and lr.constant_value < 0 and not match.maximize


def _named_next(index: GraphIndex, float_outputs: list[str], pins: RolePins, canonical: Mapping[str, str] | None = None) -> dict[str, str]:
    """Name evidence of which output is the next value of which state input (buf -> buf_out), by the
    input: the copy-free value of the first output so named (``canonical``: the outputs' copy-free values, when
    known)."""
    return _next_by_previous(index, _previous_of(index, float_outputs, pins), canonical, pins.state)


def _previous_of(index: GraphIndex, float_outputs: list[str], pins: RolePins) -> dict[str, str | None]:
    """:func:`_previous_by_name` of each output."""
    previous_of = dict.fromkeys(float_outputs)
    # Only a pinned output or one with a state suffix or prefix can name its input (previous_by_name).
    named = map(operator.or_, map(operator.methodcaller("endswith", _STATE_SUFFIXES), float_outputs), map(operator.methodcaller("startswith", _STATE_PREFIXES), float_outputs))
    for output in itertools.chain(itertools.compress(float_outputs, named), pins.state.keys() & previous_of.keys()):
        previous_of[output] = _previous_by_name(index, output, pins)
    return previous_of


class _Claimed(str):
    """A state's next value as the first output naming it gives it, when other outputs named after the same
    state hold other values (``buf_out`` and ``new_buf``, one ``2*new_buf``): equal to that first value as a
    string, so every other reader of the name evidence goes on as before; :func:`_in_place_problem` refuses
    a reading that writes such a state in place (``ambiguous-roles``), since the names do not say which."""

    claimants: tuple[str, ...]


def _next_by_previous(
    index: GraphIndex, previous_of: Mapping[str, str | None], canonical: Mapping[str, str] | None, pinned: Container[str] = ()
) -> dict[str, str]:
    """:func:`_named_next` from the outputs' :func:`_previous_of`, in output order. A pinned output (``pinned``:
    the user's ``--state`` outputs) is the next value of its state whatever names say; two outputs named after
    one state with different copy-free values make it a :class:`_Claimed`."""
    named_next: dict[str, str] = {}
    by: dict[str, str] = {}  # state -> the output that named it first
    for o, previous in previous_of.items():
        if previous is None:
            continue
        value = canonical[o] if canonical is not None and o in canonical else _skip_copies(index, o)
        first = by.get(previous)
        if first is None:
            named_next[previous], by[previous] = value, o
        elif o in pinned and first not in pinned:
            named_next[previous], by[previous] = value, o
        elif value != named_next[previous] and first not in pinned:
            claimed = _Claimed(named_next[previous])
            claimed.claimants = (*getattr(named_next[previous], "claimants", (first,)), o)
            named_next[previous] = claimed
    return named_next


MEMO_CHECK_ENV = "SGDFUSE_CHECK_CLASSES"
"""Environment variable: when set to 1, :func:`find_updates` also solves every output directly and raises
AssertionError if the per-class result differs (used by the test suite)."""


def _find_by_class(
    index: GraphIndex, normaliser: Normaliser, outputs: list[str], pins: RolePins, allow_rounding: bool, canonical: Mapping[str, str] | None = None
) -> tuple[list[Match], list[Miss]]:
    """:func:`_find` over ``outputs``, solving one member of each structural class of update clusters
    (:mod:`sgdfuse.passes.classes`) and renaming its matches for the others (``canonical``: the outputs'
    copy-free values, when known)."""
    float_outputs = list(itertools.compress(outputs, map(_EPS.__contains__, map(_dtype_of, map(index.specs.get, outputs, itertools.repeat(_NO_SPEC))))))
    previous_of = _previous_of(index, float_outputs, pins)
    named_next = _next_by_previous(index, previous_of, canonical, pins.state)
    name_facts = name_facts_of(index, pins, named_next, previous_of)

    def solve(some: list[str]) -> tuple[list[Match], list[Miss]]:
        return _find(index, normaliser, some, pins, allow_rounding, {}, named_next)

    def form_leaves(output: str) -> set[str]:
        return set(normaliser.form(output)) - {ONE}

    # One renamer per solved match (by identity: find_by_class keeps its templates until it returns).
    renamers: dict[int, Callable[[list[str], list[int]], Match]] = {}

    def rename(match: Match, values: list[str], nodes: list[int], member_values: list[str], member_nodes: list[int]) -> Match:
        renamer = renamers.get(id(match))
        if renamer is None:
            renamer = renamers[id(match)] = _renamer(match, values, nodes)
        return renamer(member_values, member_nodes)

    found, refused = find_by_class(index, float_outputs, solve, rename, name_facts, form_leaves)
    # Whether a gradient is computed from its buffer (_reads_from, in _solve_pair) may hang on values behind
    # an op the class key does not enter: a renamed match stands only if its solved member dropped no reading
    # for it and its own gradient is not computed from its own buffer; otherwise the graph is solved directly
    # (never on real steps: their buffers feed their updates alone).
    if any(m.structural_class is not None and (m.rejected_readings or _reads_from(index, m.gradient, m.accum)) for m in found):
        found, refused = solve(list(outputs))
    # Clusters are solved apart: one writer per state holds within each; a state value shared by clusters (a
    # one-element input read by many updates) is claimed once over the whole graph as well.
    found, shared = _one_writer(found)
    result = (found, refused + shared)
    if os.environ.get(MEMO_CHECK_ENV) == "1":
        direct = _find(index, normaliser, outputs, pins, allow_rounding, {})
        _assert_same(result, direct)
    return result


def name_facts_of(
    index: GraphIndex, pins: RolePins, named_next: Mapping[str, str], previous_of: Mapping[str, str | None] | None = None
) -> Callable[[Sequence[str], Sequence[bool]], list[tuple]]:
    """Everything the matcher reads from a value's name, for the structural class key
    (:func:`sgdfuse.passes.classes.clusters_of`): ``name_facts(values, is_output)`` gives per value ``(flags,
    previous, next)``.

    ``flags`` are the buffer and gradient conventions (:data:`ROLE_EVIDENCE`), the user's buffer globs and
    whether a state pin names it; ``previous`` is the input its name (or a pin) says it replaces, asked of
    graph outputs only (the matcher asks it of the candidate and its buffers; ``previous_of`` holds it for the
    outputs it was asked of already); ``next`` is the output named as its next value (``named_next``,
    :func:`_named_next`). One call for many values: the classes ask it of every value of every update."""

    state = pins.state
    next_of = named_next.get
    known = previous_of or {}
    is_buffer = pins.is_buffer if pins.buffers else None
    conventions: dict[bytes, tuple[bool, bool]] = {}

    def name_facts(values: Sequence[str], is_output: Sequence[bool]) -> list[tuple]:
        globs = map(is_buffer, values) if is_buffer is not None else itertools.repeat(None)
        flags = map(operator.add, _conventions_of(values, conventions), zip(globs, map(state.__contains__, values)))
        previous: list[str | None] = [None] * len(values)
        for position in itertools.compress(range(len(values)), is_output):
            value = values[position]
            previous[position] = known[value] if value in known else _previous_by_name(index, value, pins)
        return list(zip(flags, previous, map(next_of, values)))

    return name_facts


def _assert_same(by_class: tuple[list[Match], list[Miss]], direct: tuple[list[Match], list[Miss]]) -> None:
    """Raise AssertionError when the per-class matcher's result differs from the direct one."""
    def matches(found: list[Match]) -> list:
        return [(dataclasses.replace(m, parameter_equation=str(m.parameter_equation), accum_equation=str(m.accum_equation)), sorted(m.nodes)) for m in found]

    def misses(refused: list[Miss]) -> list:
        return sorted((m.candidate, m.reason, m.detail, str(m.equation), m.nearest, m.differing, m.buffer) for m in refused)

    if matches(by_class[0]) != matches(direct[0]):
        raise AssertionError(f"per-class matches differ from the direct ones: {matches(by_class[0])} != {matches(direct[0])}")
    if misses(by_class[1]) != misses(direct[1]):
        raise AssertionError(f"per-class refusals differ from the direct ones: {misses(by_class[1])} != {misses(direct[1])}")


def _find(
    index: GraphIndex,
    normaliser: Normaliser,
    outputs: list[str],
    pins: RolePins,
    allow_rounding: bool,
    guards: dict[str, "Guard"],
    named_next: dict[str, str] | None = None,
) -> tuple[list[Match], list[Miss]]:
    """The updates among ``outputs`` (graph outputs, or the new values of guarded ones) and the refusals.
    ``named_next`` is the name evidence of the whole graph (:func:`_named_next`) when ``outputs`` are a part
    of it; by default it is read from ``outputs``."""
    float_outputs = [o for o in outputs if index.spec(o).dtype in _EPS]
    canonical = {o: _skip_copies(index, o) for o in float_outputs}
    position = {o: k for k, o in enumerate(float_outputs)}
    outputs_by_canonical: dict[str, list[str]] = {}
    for o in float_outputs:
        outputs_by_canonical.setdefault(canonical[o], []).append(o)
    # Name evidence of which output is the next value of which state input (buf -> buf_out): an in-place
    # write must hit the input its output replaces, whatever order the outputs come in.
    if named_next is None:
        named_next = _named_next(index, float_outputs, pins)

    matches: list[Match] = []
    misses: list[Miss] = []
    tried_buffers: set[str] = set()
    # Outputs by leaf, so that a parameter update written without reading the new buffer (p - lr*m*buf -
    # lr*g beside buf_new = m*buf + g) still finds it: the algebra, not the wiring, decides.
    by_leaf: dict[str, list[str]] = {}
    for o in float_outputs:
        for leaf in normaliser.form(o):
            if leaf != ONE:
                by_leaf.setdefault(leaf, []).append(o)
    for w in float_outputs:
        form_w = normaliser.form(w)
        if not _looks_like_update(index, w, form_w):
            hidden = _hidden_update(index, normaliser, w)
            if hidden is not None:
                misses.append(hidden)
            continue
        _, values_w = normaliser.cone(w)
        buffers = sorted(
            (v for c in values_w for v in outputs_by_canonical.get(c, ()) if v != w and c != canonical[w]),
            key=position.__getitem__,
        )
        leaves_w = set(form_w)
        for leaf in sorted(leaves_w - {ONE}):
            for v in by_leaf.get(leaf, ()):
                if v != w and v not in buffers and canonical[v] != canonical[w] and set(normaliser.form(v)) - {ONE} <= leaves_w:
                    buffers.append(v)
        if not buffers:
            miss = _no_buffer_miss(index, w, form_w, outputs_by_canonical)
            if miss.reason == "no-momentum-buffer":
                miss = _frozen_parameters_miss(index, normaliser, w, canonical) or miss
            misses.append(miss)
            continue
        best: Miss | None = None
        found: Match | None = None
        tried_buffers.update(v for v in buffers if canonical[v] in values_w)
        for v in buffers:
            result = _solve(index, normaliser, w, v, canonical[v], allow_rounding, pins)
            if isinstance(result, Match):
                result = _in_place_problem(result, named_next, canonical) or result
            if isinstance(result, Match):
                found = result
                break
            if result.reason == "parameters-not-own-previous" and result.score == 10:
                best = result  # another output is this parameter's update: w is only a reader of it
                break
            if best is None or result.score > best.score:
                best = dataclasses.replace(result, buffer=v, buffer_in_cone=canonical[v] in values_w)
        if found is not None:
            matches.append(found)
        elif best is not None:
            misses.append(best if best.buffer else dataclasses.replace(best, buffer=v if len(buffers) == 1 else best.buffer))

    if guards:
        matches, guard_misses = _check_guards(matches, guards)
        misses.extend(guard_misses)
    accepted, shared = _one_writer(matches)
    misses.extend(shared)
    # A buffer output is reported through the parameter update that reads it, not as a candidate itself.
    tried_buffers |= {m.accum_out for m in accepted}
    # An output computed from a fused update's new values (delta = lr*buf_out beside p_out = p - delta) is
    # refused here as read through the update's nodes; find_updates solves it again with those values opaque
    # (_solve_readers_of_fused), over the whole graph, so that the fused updates of other clusters count too.
    # A buffer output is dropped only when it is reported there (as a match's buffer, a refused shared-state
    # match's included, or a refusal's): an output tried as the buffer of an update that was solved with
    # another buffer (p1_new in the cone of p2_new, when p2's gradient reads p1_new) is a candidate of its own.
    reported_buffers = {m.accum_out for m in matches} | {miss.buffer for miss in misses if miss.buffer and miss.candidate != miss.buffer}
    misses = [miss for miss in misses if miss.candidate not in tried_buffers or miss.candidate not in reported_buffers or miss.reason == "shared-state"]
    # (W, V) and (V, W) are one pair read two ways: report the reading that got further.
    best_of_pair: dict[frozenset, Miss] = {}
    for miss in misses:
        key = frozenset((miss.candidate, miss.buffer)) if miss.buffer else frozenset((miss.candidate,))
        if key not in best_of_pair or miss.score > best_of_pair[key].score:
            best_of_pair[key] = miss
    misses = [miss for miss in misses if best_of_pair[frozenset((miss.candidate, miss.buffer)) if miss.buffer else frozenset((miss.candidate,))] is miss]
    # An output that another candidate read as its buffer is reported there, not again on its own.
    read_as_buffer = {miss.buffer for miss in misses if miss.buffer and miss.buffer_in_cone}
    misses = [miss for miss in misses if miss.buffer or miss.candidate not in read_as_buffer]
    return accepted, misses


def guarded_outputs(index: GraphIndex) -> dict[str, Guard]:
    """The graph's guarded state outputs ``Where(condition, old, new)`` (or with the branches swapped), by
    their new value: a matched update's ``parameters_out``/``accum_out`` is then the ``new`` of a guard whose
    ``output`` is the graph output carrying the next state."""
    return {g.new: g for g in (_guard(index, o) for o in dict.fromkeys(index.graph_outputs)) if g is not None}


def _guard(index: GraphIndex, output: str) -> Guard | None:
    """``output = Where(condition, old, new)`` with ``condition`` one boolean and ``old`` a state input of
    ``output``'s shape and dtype (either branch): a guarded update, else None.

    ``condition`` may be that boolean negated or broadcast (``Not(found_inf)``, ``Expand(finite, shape)``:
    :func:`sgdfuse.passes.linear.boolean_root`); the guard names the boolean itself, with ``skip_when``
    turned for a negation, so that the parameters' ``Where(Not(found_inf), p_new, p)`` and the buffer's
    ``Where(found_inf, buf, buf_new)`` are one guard. ``old`` may be an ``Identity`` copy of the state input
    (``p.detach()``, ``p.clone()``)."""
    node = index.node(_skip_copies(index, output))
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
        return None
    if not _read_only_by_copies(index, node.output[0]):
        # The selected value feeds more of the step: not a guard on the final state but a step rule, such as
        # the first step's buf = Where(first, g, m*buf + (1-d)*g) that the parameter update reads.
        return None
    condition, if_true, if_false = node.input
    root = boolean_root(index, condition)
    if root is None:
        return None
    condition, negated = root
    out_spec = index.spec(output)
    for old_value, new, skip_when in ((if_true, if_false, True), (if_false, if_true, False)):
        old = _exact_copy_source(index, old_value)
        old_spec = index.spec(old)
        if (
            index.is_input_name(old)
            and not index.is_input_name(new)
            and old_spec.dtype == out_spec.dtype
            and _same_shape(old_spec, out_spec)
            and index.spec(new).dtype == out_spec.dtype
        ):
            return Guard(output, new, old, condition, skip_when != negated)
    return None


def _exact_copy_source(index: GraphIndex, value: str) -> str:
    """The value that ``value`` copies through ``Identity`` nodes (``p.detach()``), else ``value`` itself.
    Only ``Identity``: the lowering's write-back of a guard (sgdfuse.lowering.state) and the verification's
    in-place pairing (``sgdfuse.verify``) recognise a kept state through those."""
    seen = {value}
    while True:
        node = index.node(value)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type != "Identity" or not node.input or node.input[0] in seen:
            return value
        value = node.input[0]
        seen.add(value)


def _hidden_update(index: GraphIndex, normaliser: Normaliser, output: str) -> Miss | None:
    """A graph output that is not itself an update but passes one through a non-elementwise op (a ``Slice``,
    a ``Reshape``, a ``Where`` on a per-element mask): named here, so that the refusal is on the parameters'
    output and not only on the buffer it reads."""
    node = index.node(_skip_copies(index, output))
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "If" and len(node.output) > 1 and node.input and index.spec(node.input[0]).dtype == onnx.TensorProto.BOOL:
        # Parameters and buffer selected together by one If (a skipped step written as control flow).
        condition = node.input[0]
        return Miss(
            output,
            "guarded-update",
            f"{output} comes out of If node {node.name or '(unnamed)'} on {condition} together with other outputs: a "
            "guarded update written as control flow is not fused. Written as Where(condition, old, new) on the "
            "parameters and the buffer (one boolean condition), it is.",
            score=2,
        )
    for operand in node.input:
        if not operand or operand == output or index.spec(operand).dtype not in _EPS or index.producer.get(operand) is None:
            continue
        if index.is_output_name(operand) and node.op_type != "Where":
            # The update is a graph output itself (fused, or refused on its own name): this output only reads
            # it, as a logged norm ``ReduceSumSquare(w_out)`` does, and hides nothing.
            continue
        form = normaliser.form(operand)
        if not _looks_like_update(index, operand, form):
            continue
        state = sorted(leaf for leaf in form if leaf != ONE and index.is_input_name(leaf))
        if node.op_type == "Where":
            condition = node.input[0]
            equation = f"{operand} = {format_form(form, state)}"
            readers = _non_copy_readers(index, node.output[0])
            if readers and boolean_root(index, condition) is not None:
                # A guard in form (one boolean, the old state on one side) whose selected value more of the step
                # reads: _guard takes only a Where on the final state, since a Where read on (a first step's
                # buf = Where(first, g, m*buf + (1-d)*g)) is a step rule, not a guard.
                return Miss(
                    output,
                    "guarded-update",
                    f"{output} selects the update {operand} (of {', '.join(state)}) with Where on {condition}, and "
                    f"{', '.join(readers[:3])}{' ...' if len(readers) > 3 else ''} read{'s' if len(readers) == 1 else ''} "
                    "the selected value: sgdfuse fuses a guarded update only when the guarded outputs are the final "
                    "state, read by nothing but copies (a Where that more of the step reads may be a step rule, as a "
                    "first step's Where(first, g, m*buf + (1-d)*g) is).",
                    equation=equation,
                    score=2,
                )
            return Miss(
                output,
                "guarded-update",
                f"{output} selects the update {operand} (of {', '.join(state)}) with Where on {condition}, which is not "
                "one boolean keeping the old state on one side: sgdfuse fuses a guarded update written as "
                "Where(condition, old, new) with a condition of one element, the parameters and buffer guarded alike.",
                equation=equation,
                score=2,
            )
        return Miss(
            output,
            "hidden-update",
            f"{output} is {node.op_type}({operand}, ...) of an update of {', '.join(state)}; the fused op writes its "
            f"state whole, so the update must be the graph output itself (an {node.op_type} after it changes what is "
            "written). Output the update before the " + node.op_type + " to fuse it.",
            equation=f"{operand} = {format_form(form, state)}",
            score=2,
        )
    return None


def _non_copy_readers(index: GraphIndex, value: str) -> list[str]:
    """The names of the nodes (``op_type`` when unnamed) that read ``value`` or a copy of it and are not copies
    themselves (:func:`_read_only_by_copies`'s test, naming what fails it); a subgraph reading it counts as its
    node's reader."""
    readers: list[str] = []
    stack, seen = [value], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in index.subgraph_reads:
            readers.append(f"a subgraph reading {name}")
        for position in index.consumers.get(name, ()):
            reader = index.graph.node[position]
            if not reader.output or _skip_copies(index, reader.output[0]) != _skip_copies(index, name):
                readers.append(reader.name or reader.op_type)
            else:
                stack.extend(reader.output)
    return readers


def _read_only_by_copies(index: GraphIndex, value: str) -> bool:
    """True when nothing but copies (``Identity``, float-to-float ``Cast``/``CastLike``, as
    :func:`_skip_copies` follows) read ``value``, and nothing but copies read those, nor any subgraph."""
    return not _non_copy_readers(index, value)



def _check_guards(matches: list[Match], guards: dict[str, Guard]) -> tuple[list[Match], list[Miss]]:
    """Keep a guarded match when its parameters and its buffer are guarded alike, each keeping its own old
    value: then the graph's Where nodes, left reading the fused node's outputs, skip the whole update (the
    op's stat output is not used, so stat is unchanged too). Keep it too when one guard keeps one state and
    the graph writes the other's update on every step (the weights frozen while the buffer moves): the fused
    node computes both updates, as the graph does, and the one Where, left reading its output, keeps that
    state as the graph does. Anything else is ``guarded-update``."""
    kept: list[Match] = []
    misses: list[Miss] = []
    for match in matches:
        gw, gv = guards.get(match.parameters_out), guards.get(match.accum_out)
        if gw is None and gv is None:
            kept.append(match)
            continue
        problem, bare = "", ""
        if gw is None or gv is None:
            one, state = (gw, match.parameters) if gw is not None else (gv, match.accum)
            if one.old == state:
                kept.append(dataclasses.replace(match, guard=dataclasses.replace(one, only="parameters" if gw is not None else "buffer")))
                continue
            problem = f"the guard {one.output} keeps {one.old}, not the update's own state {state}"
        elif (gw.condition, gw.skip_when) != (gv.condition, gv.skip_when):
            problem = f"the parameters are {gw.describe()}, the buffer {gv.describe()}: one guard must skip both"
        elif (gw.old, gv.old) != (match.parameters, match.accum):
            problem = f"the guard keeps {gw.old} and {gv.old}, not the update's own state {match.parameters} and {match.accum}"
        if problem:
            condition = (gw or gv).condition
            misses.append(
                Miss((gw or gv).output if gw is None else gw.output, "guarded-update",
                     f"the update of {match.parameters} is guarded by {condition}, but {problem}.", score=9, buffer=bare)
            )
            continue
        kept.append(dataclasses.replace(match, guard=gw))
    return kept, misses


def _in_place_problem(match: Match, named_next: dict[str, str], canonical: dict[str, str]) -> Miss | None:
    """A reading that would write the wrong output in place: the names say another output is the next value
    of its parameters or of its buffer (outputs ``p_out, delta, buf_out`` with ``delta = 0.1*buf_out``: the
    buffer is ``buf_out``, whatever the algebra of ``delta`` allows)."""
    for role, old, new in (("parameters", match.parameters, match.parameters_out), ("momentum buffer", match.accum, match.accum_out)):
        named = named_next.get(old)
        if isinstance(named, _Claimed):
            claimants = " and ".join(named.claimants)
            return Miss(
                match.parameters_out,
                "ambiguous-roles",
                f"{claimants} are each named as the next value of the {role} {old} and hold different values, so the "
                f"names do not say which one to write into {old} in place (this reading takes {new}). Say which: "
                f"--state {named.claimants[0]}={old} (RolePins(state=...) in the API), or rename the others.",
                score=10,
            )
        if named is not None and named != canonical.get(new, new):
            if role == "parameters":
                return Miss(
                    match.parameters_out,
                    "parameters-not-own-previous",
                    f"{match.parameters_out} reads like an update of {old}, but {named} is named as {old}'s next value; "
                    f"{match.parameters_out} is left as it is (it reads the state, it does not replace it).",
                    score=10,
                )
            return Miss(
                match.parameters_out,
                "wrong-in-place-output",
                f"reading {new} as the new value of the {role} {old} would write {new} into {old} in place, but {named} "
                f"is named as {old}'s next value.",
                score=4,
            )
    return None


def _skip_copies(index: GraphIndex, value: str) -> str:
    """Follow ``Identity`` and float-to-float ``Cast``/``CastLike`` back to the value they copy or round:
    a buffer output ``Cast(v32, FLOAT16)`` is the buffer ``v32`` the parameter update reads."""
    # The index's node facts, not the protobuf node: this runs for every graph output, several times.
    producer, facts = index.producer, index.nodes
    seen: set[str] | None = None
    while True:
        k = producer.get(value)
        if k is None:
            return value
        op, domain, inputs = facts[k][:3]
        if domain not in ("", "ai.onnx") or not inputs:
            return value
        if not (op == "Identity" or (op in ("Cast", "CastLike") and index.spec(inputs[0]).dtype in _EPS and index.spec(value).dtype in _EPS)):
            return value
        if seen is None:
            seen = {value}
        value = inputs[0]
        if value in seen:
            return value
        seen.add(value)


def _no_buffer_miss(index: GraphIndex, w: str, form_w: Form, outputs_by_canonical: dict[str, list[str]]) -> Miss:
    # A buffer hidden behind a non-linear op (a per-element learning rate, say) is named as such.
    for leaf in form_w:
        node = index.node(leaf)
        if node is None:
            continue
        for operand in node.input:
            others = [o for o in outputs_by_canonical.get(_skip_copies(index, operand), ()) if o != w] if operand else []
            if others and index.spec(operand).num_elements() != 1:
                other = [i for i in node.input if i and i != operand]
                shapes = ", ".join(f"{name} (shape {format_shape(index.spec(name).shape)})" for name in other) or "another operand"
                if node.op_type not in ("Mul", "Div") or not any(index.spec(name).num_elements() != 1 for name in other):
                    reason = "nonlinear-update"
                    detail = (
                        f"{w} passes the buffer {others[0]} through {node.op_type} node {node.name or leaf} (with {shapes}); "
                        "momentum SGD only scales the new buffer by the learning rate, so this is not an update sgdfuse "
                        "can fuse."
                    )
                else:
                    reason = "tensor-factor"
                    detail = (
                        f"{w} multiplies the buffer {others[0]} ({node.op_type} node {node.name or leaf}) by {shapes}, a "
                        "tensor of more than one element rather than one scalar: the SGD operator's learning rate is a "
                        "single number, so a per-element learning rate (or any per-element factor on the buffer) cannot "
                        "be fused. A learning rate of one element, of any shape, would be; a uniform constant is taken as "
                        "one only when its shape cannot broadcast the buffer's up (symbolic dimensions may be 1)."
                    )
                return Miss(
                    w,
                    reason,
                    detail,
                    equation=f"{w} = {format_form(form_w, [n for n in (_previous_by_name(index, w),) if n])}",
                    differing=f"{node.op_type}({', '.join(i for i in node.input if i)})",
                    score=1,
                    buffer=others[0],
                    buffer_in_cone=True,
                )
    order = [name for name in (_previous_by_name(index, w),) if name]
    return Miss(
        w,
        "no-momentum-buffer",
        f"{w} = {format_form(form_w, order)} reads no momentum buffer that the graph outputs "
        "(momentum 0 or absent): plain SGD is left as it is.",
        equation=f"{w} = {format_form(form_w, order)}",
        score=0,
    )


def _frozen_parameters_miss(index: GraphIndex, normaliser: Normaliser, v: str, canonical: dict[str, str]) -> Miss | None:
    """The refusal of a buffer-like update ``v`` that another graph output reads only to leave a state input
    unchanged (``w_out = w - 0*v``: a learning rate of 0 folded away), None when no output does: the update
    then has no parameters to write, which the SGD operator always does, and the message says why rather
    than that ``v`` reads no buffer."""
    # The graph outputs computed from v, a few nodes on at most (a step of lr*v and a subtraction).
    reached: list[str] = []
    stack, seen = [v], {v}
    while stack and len(seen) <= 16:
        for k in index.consumers.get(stack.pop(), ()):
            for name in index.nodes[k][3]:
                if name and name not in seen:
                    seen.add(name)
                    stack.append(name)
                    if index.is_output_name(name) and name in canonical:
                        reached.append(name)
    for o in reached:
        form = normaliser.form(o)
        if len(form) != 1:
            continue
        (state, coefficient), = form.items()
        if state == ONE or not index.is_input_name(state) or not coefficient.is_constant or coefficient.terms.get((), 0.0) != 1.0:
            continue
        if canonical[v] not in normaliser.cone(o)[1]:
            continue
        return Miss(
            v,
            "no-momentum-buffer",
            f"{o} = {state}: the graph reads {v} to update {state} but multiplies it by 0 (a learning rate of 0), so "
            f"the parameters never change and {v} = {format_form(normaliser.form(v), [])} is a buffer update with no "
            "parameter update to fuse it with: left as it is. With a learning rate other than 0 it fuses.",
            equation=f"{o} = {state}",
            score=1,
        )
    return None


def _looks_like_update(index: GraphIndex, w: str, form_w: Form) -> bool:
    """A candidate reads itself plus something: at least two leaves, one of them a tensor with the
    output's shape and dtype fed from outside the elementwise cone (an input or an initializer)."""
    if len(form_w) < 2:
        return False
    spec_w = index.spec(w)
    for leaf in form_w:
        if leaf == ONE or index.producer.get(leaf) is not None:
            continue
        spec = index.spec(leaf)
        if spec.dtype == spec_w.dtype and _same_shape(spec, spec_w):
            return True
    return False


def _same_shape(a: TensorSpec, b: TensorSpec) -> bool:
    if a.shape is None or b.shape is None:
        return True
    return len(a.shape) == len(b.shape) and all(x == y or x is None or y is None for x, y in zip(a.shape, b.shape))


def _substitute(form: Form, leaf: str, replacement: Form) -> Form:
    if leaf not in form:
        return form
    coefficient = form[leaf]
    rest = {k: c for k, c in form.items() if k != leaf}
    return add_forms(rest, replacement, coefficient)


def _solve(
    index: GraphIndex, normaliser: Normaliser, w: str, v: str, v_source: str, allow_rounding: bool = False, pins: RolePins | None = None
) -> Match | Miss:
    result = _solve_selection(index, normaliser, w, v, v_source, allow_rounding, pins or RolePins())
    cancelled = {**normaliser.cancellations(w), **normaliser.cancellations(v)}
    if cancelled and isinstance(result, Match):
        # A refusal for another reason says more (momentum 0 is a buffer times 0); a match is blocked.
        where, what = sorted(cancelled.items())[0]
        return Miss(
            w,
            "cancelling-terms",
            f"in {where}, {what}: the terms cancel in exact arithmetic but not in floating point (a large, infinite "
            "or zero value changes the result), so the update is not exactly momentum SGD. Remove the cancelling "
            "terms from the graph to fuse it.",
            score=8,
        )
    return result


def _solve_selection(
    index: GraphIndex, normaliser: Normaliser, w: str, v: str, v_source: str, allow_rounding: bool, pins: RolePins
) -> Match | Miss:
    rel = _Reading(working_precision(_coefficient_dtypes(index, normaliser, w, v), index.spec(w).dtype), allow_rounding, pins)
    form_w = normaliser.form(w)
    source_node = index.node(v_source)
    branches = normaliser.where_branches(v_source)
    if branches is not None:
        condition, if_true, if_false = branches
        form_true, form_false = normaliser.form(if_true), normaliser.form(if_false)
    else:
        selected = normaliser.if_branches(v_source)
        if selected is None:
            if source_node is not None and source_node.op_type in ("If", "Loop", "Scan"):
                return Miss(
                    w,
                    "first-step-unsupported",
                    f"the buffer {v} comes out of {source_node.op_type} node {source_node.name or v_source}; a "
                    "first-step rule is fused when written as Where(condition, first, later) or as an If on one "
                    "boolean whose branches compute the buffer elementwise.",
                    score=2,
                )
            per_element = _per_element_selection(index, w, v, source_node, pins)
            if per_element is not None:
                return per_element
            return _solve_pair(index, normaliser, w, v, form_w, normaliser.form(v), rel, None)
        condition, form_true, form_false, _ = selected
    best: Miss | None = None
    # Either branch may be the later steps; the other must be the contract's first step.
    for form_v, form_first, when_true in ((form_false, form_true, True), (form_true, form_false, False)):
        result = _solve_pair(index, normaliser, w, v, _substitute(form_w, v_source, form_v), form_v, rel, (condition, form_first, when_true, v_source))
        if isinstance(result, Match):
            return result
        if best is None or result.score > best.score:
            best = result
    assert best is not None
    return best


def _per_element_selection(index: GraphIndex, w: str, v: str, node: onnx.NodeProto | None, pins: RolePins) -> Miss | None:
    """Why the buffer ``v`` is not read when it is ``Where(mask, a, b)`` on a boolean of several elements that
    is no broadcast of one (:func:`sgdfuse.passes.linear.boolean_root`): a first step, or a skip, chosen per
    element (``guarded-update`` when a branch is the buffer ``v``'s name says it replaces). Else None."""
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
        return None
    condition = node.input[0]
    spec = index.spec(condition)
    if spec.dtype != onnx.TensorProto.BOOL or boolean_root(index, condition) is not None:
        return None
    count = spec.num_elements()
    elements = f"{count} elements" if count is not None else "an unknown number of elements"
    branches = node.input[1:]
    previous = _previous_by_name(index, v, pins)
    skip = previous is not None and previous in {_exact_copy_source(index, b) for b in branches}
    return Miss(
        w,
        "guarded-update" if skip else "first-step-unsupported",
        f"the buffer {v} = Where({condition}, {', '.join(branches)}) selects per element: its condition {condition} has "
        f"{elements} and is no broadcast of one boolean, so {'some elements skip the step' if skip else 'some elements take the first-step rule'} "
        "and others do not. sgdfuse fuses a first step or a skipped step selected by one boolean for the whole "
        "tensor (the step counter's test, found_inf; also negated, or broadcast with Expand, Reshape or "
        "Unsqueeze), whose verification runs both branches; compute the condition once for the tensor "
        "(step == 0, not per element) to fuse it.",
        score=2,
    )


@dataclasses.dataclass(frozen=True)
class _Reading:
    """How coefficients of one candidate are compared: the graph's working precision, and whether the op's
    rounding of learning rate and momentum to the parameters' dtype is accepted."""

    precision: Precision
    allow_rounding: bool
    pins: RolePins = dataclasses.field(default_factory=RolePins)


def _coefficient_dtypes(index: GraphIndex, normaliser: Normaliser, w: str, v: str) -> set[int]:
    """Float dtypes the graph computes the update's coefficients in: every value a node of the two cones
    reads or writes (constants and intermediates), except the state and gradient leaves and the two outputs,
    whose storage dtype the op rounds to once at the end."""
    dtypes: set[int] = set()
    for root in (w, v):
        nodes, values = normaliser.cone(root)
        leaves = {value for value in values if normaliser.is_leaf(value)}
        for k in nodes:
            node = index.graph.node[k]
            for name in list(node.input) + list(node.output):
                if not name or name in (w, v) or name in leaves and index.constant(name) is None:
                    continue
                dtype = index.spec(name).dtype
                if dtype in FLOAT_DTYPES:
                    dtypes.add(dtype)
    return dtypes


def _solve_pair(
    index: GraphIndex,
    normaliser: Normaliser,
    w: str,
    v: str,
    form_w: Form,
    form_v: Form,
    rel: "_Reading",
    selection: tuple[str, Form, bool, str] | None,
) -> Match | Miss:
    first = [n for n in (_previous_by_name(index, w, rel.pins), _previous_by_name(index, v, rel.pins)) if n]
    equation = LazyText(lambda: f"{w} = {format_form(form_w, first)};  {v} = {format_form(form_v, first[1:])}")
    best = Miss(w, "extra-term", f"{w} is not a momentum-SGD update of buffer {v}.", equation=equation, score=1)
    named_buffer = _previous_by_name(index, v, rel.pins)
    named_parameters = _previous_by_name(index, w, rel.pins)
    named_by = "structure" if v in rel.pins.guarded else ("pin" if v in rel.pins.state or w in rel.pins.state else "names")
    if named_buffer is not None and named_buffer not in form_v:
        # Tensors fed from outside with the buffer's shape and dtype: one is the gradient; a second is a buffer.
        fed = [
            leaf
            for leaf in form_v
            if leaf not in (ONE, named_parameters)
            and index.producer.get(leaf) is None
            and _same_shape(index.spec(leaf), index.spec(v))
            and index.spec(leaf).dtype == index.spec(v).dtype
        ]
        if len(fed) >= 2:
            # buf_a_out = 0.9*buf_b + g: computed from another buffer than the one it replaces.
            read = fed
            return Miss(
                w,
                "buffer-not-own-previous",
                f"{w}: its buffer update {v} = {format_form(form_v)} is computed from {' and '.join(read)}, not from "
                f"{named_buffer}, whose next value its name says it is; an in-place update would overwrite "
                f"{named_buffer} with a value computed from another buffer. Rename or rewire the buffers.",
                equation=equation,
                score=3,
            )
        unread = _why_unread(index, normaliser, v, named_buffer)
        if unread is not None:
            return dataclasses.replace(unread, candidate=w, equation=equation)
        # buf_out = g: the buffer's own previous value has coefficient 0.
        return Miss(
            w,
            "no-momentum-buffer",
            f"{w}: its buffer update {v} = {format_form(form_v)} does not read {named_buffer}, the buffer it replaces: momentum is 0, "
            "which is plain SGD (and the contract's momentum == 0 rule would keep the old buffer).",
            equation=equation,
            score=3,
        )
    if named_parameters is not None and named_parameters not in form_w:
        reader = sorted(leaf for leaf in form_w if leaf != ONE and index.is_input_name(leaf) and leaf != named_buffer)
        return Miss(
            w,
            "parameters-not-own-previous",
            f"{w} is named as the next value of {named_parameters}, but it does not read {named_parameters}"
            + (f" (it reads {', '.join(reader)})" if reader else "")
            + f"; an in-place update would overwrite {named_parameters} with another tensor's update. Rename or rewire the outputs.",
            equation=equation,
            score=3,
        )
    solutions: list[Match] = []
    unsolved = best
    for a in [leaf for leaf in form_v if leaf != ONE]:
        m = form_v[a]
        if named_buffer is not None and a != named_buffer:
            continue  # the names say which input this buffer replaces
        if rel.pins.is_buffer(a) is False:
            continue  # the user's globs say which inputs are buffers
        for p in [leaf for leaf in form_w if leaf not in (ONE, a)]:
            if named_parameters is not None and p != named_parameters:
                continue
            result = _solve_roles(index, normaliser, w, v, form_w, form_v, p, a, m, rel, equation, selection)
            if isinstance(result, Match):
                solutions.append(result)
                continue
            if a in normaliser.opaque or p in normaliser.opaque:
                # Another update's new values (opaque: that update is fused) read as this one's state: a
                # reading of the other update's terms (its "computed-state"), not of this one. Any reading of
                # this update's own state says more; this one is reported only when there is none.
                result = dataclasses.replace(result, score=1)
            if result.score > best.score or best is unsolved:
                best = result
    # A gradient never depends on its own momentum buffer: a reading whose gradient is computed from the tensor
    # it takes as the buffer (mlx#473's Where(first, (d/m)*g, buf) read as buffer g) is no momentum-SGD update.
    # The reading the evidence ranks first is checked (one short walk per update), and dropped if it fails,
    # so that the evidence can rank the others.
    rejected: list[Match] = []
    while solutions:
        chosen = _choose_reading(index, w, v, solutions, rel, named_by, named_buffer, equation, form_v)
        if not isinstance(chosen, Match) or not _reads_from(index, chosen.gradient, chosen.accum):
            if isinstance(chosen, Match) and rejected:
                chosen.rejected_readings = tuple((r.accum, r.gradient) for r in rejected)
            return chosen
        rejected.append(chosen)
        solutions = [s for s in solutions if (s.accum, s.gradient, s.parameters) != (chosen.accum, chosen.gradient, chosen.parameters)]
    if rejected:
        first_rejected = rejected[0]
        return Miss(
            w,
            "gradient-reads-buffer",
            f"the momentum-SGD reading of {v} takes {first_rejected.accum} as the momentum buffer and "
            f"{first_rejected.gradient} as the gradient, but {first_rejected.gradient} is computed from "
            f"{first_rejected.accum}: a gradient never depends on its own momentum buffer, so this is no SGD step "
            f"and fusing it would write {first_rejected.accum} in place; the update is left as it is. A buffer "
            "started from the gradient on the first step is fused when written as a first-step Where on the buffer's "
            "own update (buf_out = Where(first, g, m*buf + (1-d)*g)).",
            equation=equation,
            score=9,
        )
    return best


def _choose_reading(
    index: GraphIndex, w: str, v: str, solutions: list[Match], rel: "_Reading", named_by: str, named_buffer: str | None, equation: "LazyText", form_v: Form
) -> Match | Miss:
    """The reading of ``w``/``v`` the role evidence (:data:`ROLE_EVIDENCE`) picks among ``solutions`` (one or
    more algebraic readings, :func:`_solve_pair`), with ``roles_from`` set, or the ``ambiguous-roles`` refusal
    when no evidence decides."""
    if len(solutions) == 1:
        decided = "pin" if rel.pins.buffers and named_by != "structure" else (named_by if named_buffer is not None else "structure")
        only = solutions[0]
        if decided == "structure" and only.momentum.is_constant and not 0 < only.momentum.constant_value < 1:
            # The one reading left takes a fed tensor as the buffer with a momentum no optimizer uses (1, from a
            # buffer hidden behind a per-element factor, m*buf with m a vector): without a name or a pin
            # that is no evidence of which tensor is written in place.
            return Miss(
                w,
                "ambiguous-roles",
                f"the only momentum-SGD reading of {v} takes {only.accum} as the buffer with momentum "
                f"{format_poly(only.momentum)} and {only.gradient} as the gradient; nothing but the algebra says "
                f"{only.accum} is the buffer. If it is, pin it: --state {v}={only.accum} (or name the output "
                f"{only.accum}_out).",
                equation=equation,
                score=9,
            )
        return dataclasses.replace(only, roles_from=decided)
    # One step's algebra cannot tell the buffer from the gradient when both are inputs: buf' = 0.9*buf + g
    # is also "accum = g, momentum 1, dampening 0.1". The in-place write must hit the real buffer: the
    # ecosystem's names, then plausibility decide; failing both, the update is left alone.
    plausible = [_plausibility_score(solution) for solution in solutions]
    for evidence, score in (("conventions", _convention_score), ("plausibility", _plausibility_score)):
        scores = [score(solution) for solution in solutions]
        best_score = max(scores)
        if scores.count(best_score) == 1 and best_score > 0:
            chosen = scores.index(best_score)
            if plausible[chosen] < max(plausible):
                # Names say one thing, the hyper-parameters another (buffer b0 would need momentum 1 and
                # dampening 0.1): neither decides.
                break
            return dataclasses.replace(solutions[chosen], roles_from=evidence)
    readings = "; ".join(
        f"buffer {s.accum}, gradient {s.gradient}, momentum {format_poly(s.momentum)}, dampening {s.dampening:g}" for s in solutions
    )
    return Miss(
        w,
        "ambiguous-roles",
        f"{v} = {format_form(form_v)} reads as more than one momentum-SGD update ({readings}), and no name or "
        f"hyper-parameter tells them apart. Say which input {v} replaces: --state {v}=<buffer input> (repeatable; "
        f"RolePins(state=...) in the API), or --buffers GLOB for the buffer inputs, or name the output after its "
        "input (<buffer>_out).",
        equation=equation,
        score=9,
    )


def _convention_score(match: Match) -> int:
    """How well the names fit the ecosystem's conventions: the buffer named like one, the gradient too."""
    return int(bool(_BUFFER_NAME.search(match.accum))) + int(bool(_GRADIENT_NAME.search(match.gradient))) - int(
        bool(_GRADIENT_NAME.search(match.accum))
    ) - int(bool(_BUFFER_NAME.search(match.gradient)))


def _plausibility_score(match: Match) -> int:
    """A momentum that is a constant in (0, 1) and a dampening of 0: what momentum SGD is configured with."""
    momentum = match.momentum.constant_value if match.momentum.is_constant else None
    return int(momentum is not None and 0 < momentum < 1) + int(match.dampening == 0)


def _solve_roles(
    index: GraphIndex,
    normaliser: Normaliser,
    w: str,
    v: str,
    form_w: Form,
    form_v: Form,
    p: str,
    a: str,
    m: Poly,
    rel: "_Reading",
    equation: str,
    selection: tuple[str, Form, bool, str] | None,
) -> Match | Miss:
    equation = LazyText(lambda: f"{w} = {format_form(form_w, [p, a])};  {v} = {format_form(form_v, [a])}")
    vp = form_v.get(p, Poly.const(0))
    # What V holds besides the buffer and parameter terms: (1-d)·s·G.
    rest_v = add_forms(add_forms(form_v, {a: m}, Poly.const(-1)), {p: vp}, Poly.const(-1))
    if not rest_v:
        return Miss(
            w,
            "no-momentum-buffer",
            f"{v} = {format_form(form_v)} reads a single tensor: either momentum is 0 or no gradient enters; "
            "neither is a momentum update.",
            equation=equation,
            score=2,
        )
    if ONE in rest_v:
        return Miss(
            w,
            "extra-term",
            f"buffer update {v} adds a constant {format_poly(rest_v[ONE])}, which momentum SGD does not.",
            equation=equation,
            differing=f"{format_poly(rest_v[ONE])}*1",
            score=2,
        )

    # W - P = α·V + β·A: read α off a gradient leaf, β off the buffer leaf, then demand the rest vanishes.
    delta = add_forms(form_w, {p: Poly.const(1)}, Poly.const(-1))
    pivot = sorted(rest_v)[0]
    inverse = form_v[pivot].inverse()
    alpha = None
    if inverse is None:
        # A sum of terms ((1 - m) with m fed at run time): W's coefficient must be a multiple of it.
        alpha = _poly_ratio(delta.get(pivot, Poly.const(0)), form_v[pivot])
    if inverse is None and alpha is None:
        # Only runtime values make a coefficient a sum of terms (constants fold to one number).
        return Miss(
            w,
            "runtime-hyperparameter",
            f"the coefficient {format_poly(form_v[pivot])} of {pivot} in {v} depends on runtime values; dampening and "
            "weight decay must be compile-time constants (the contract's attributes).",
            equation=equation,
            score=6,
        )
    if alpha is None:
        alpha = delta.get(pivot, Poly.const(0)) * inverse
    if alpha.is_zero:
        return Miss(
            w,
            "extra-term",
            f"{w} does not use the new buffer {v}: {w} = {format_form(form_w, [p])}.",
            equation=equation,
            nearest=f"{w} = {p} - lr*{v}",
            score=2,
        )
    beta = delta.get(a, Poly.const(0)) - alpha * m
    predicted = add_forms(scale_form(form_v, alpha), {a: beta})
    # Compared relative to W's own coefficient too: a folded constant (1 - lr*wd) rounds relative to 1.
    residual = {
        leaf: c
        for leaf, c in add_forms(delta, predicted, Poly.const(-1)).items()
        if not _close(delta.get(leaf, Poly.const(0)), predicted.get(leaf, Poly.const(0)), rel, scale=form_w.get(leaf))
    }
    lr_plain = -alpha
    if residual:
        # Say it in terms of the new buffer: W = P + α·V (+ β·A) + the terms that do not fit.
        shown = add_forms({p: Poly.const(1), v: alpha}, residual)
        if not _close(beta, Poly.const(0), rel, scale=alpha * m):
            shown = add_forms(shown, {a: beta})
        differing = [f"{format_poly(c)}*{'1' if leaf == ONE else leaf}" for leaf, c in sorted(residual.items())]
        return Miss(
            w,
            "extra-term",
            f"{w} is {p} - lr*{v} plus {', '.join(differing)}, which momentum SGD (plain or Nesterov) does not have.",
            equation=f"{w} = {format_form(shown, [p, v, a])};  {v} = {format_form(form_v, [a])}",
            nearest=f"{w} = {p} - {format_poly(lr_plain)}*{v}",
            differing=", ".join(differing),
            score=4,
        )

    readings = _gradient_readings(index, normaliser, v, rest_v, vp, p, a, rel.precision)
    if not readings:
        return Miss(
            w,
            "gradient-not-a-value",
            f"the gradient term {format_form(rest_v)} of {v} is not computed by any one tensor of the graph.",
            equation=equation,
            score=5,
        )
    g, k, _ = readings[0]
    nesterov = not _close(beta, Poly.const(0), rel, scale=alpha * m)
    if nesterov:
        m_inverse = m.inverse()
        k_inverse = k.inverse()
        if m_inverse is None or k_inverse is None:
            return Miss(w, "extra-term", f"momentum {format_poly(m)} is not a single term.", equation=equation, score=3)
        lr = beta * m_inverse
        expected_alpha = -(lr + lr * m)
        if not _close(alpha, expected_alpha, rel):
            return _nesterov_miss(w, v, p, a, g, k, m, m_inverse, alpha, beta, lr, form_v, rel)
    else:
        lr = lr_plain

    state_problem = _state_problem(index, w, v, p, a, rel.pins)
    if state_problem is not None:
        # A constant or computed state is the graph's own fact; a name mismatch may just be a wrong reading.
        score = 8 if state_problem.reason in ("constant-state", "computed-state") else 7
        return dataclasses.replace(state_problem, equation=equation, score=score)

    # Each way of naming the gradient (the leaf itself, or a value of the graph that computes the scaled
    # gradient: Keras's lr*g, a clipped g*s, an upcast g) is tried in turn; the first exact one fuses.
    best: Miss | None = None
    chosen: Match | None = None
    solved = _Solved(w, v, p, a, m, lr, nesterov, alpha, beta, form_w, form_v, equation, selection)
    order, unit = _reading_order(normaliser, v, rest_v, vp, p, a, rel.precision, readings)
    refusals: list[Miss | None] = [None] * len(readings)
    for position, (g, k, absorbs_decay) in order:
        result = _try_reading(index, normaliser, solved, g, k, Poly.const(0) if absorbs_decay else vp, rel, absorbs_decay)
        if isinstance(result, Match):
            # Readings that need a dampening near 1 (the graph's lr*g read as g with 1 - d = lr) lose to
            # the exact ones: the op forms 1 - d in float32, which cancels.
            # One spacing is the rounding of a folded constant (1 - d, (1 - d)*wd): such readings tie, and
            # the first (the leaf gradient, with the graph's own hyper-parameters) wins. The op's own
            # arithmetic counts too: it forms grad - grad*d, whose rounding is |d|/|1 - d| times the term's
            # (d = 1 - 2^-20 is exact in float32, but grad - grad*d keeps one ulp of grad on a 2^-20 term).
            if chosen is None or _reading_cost(result) < _reading_cost(chosen):
                chosen = result
            if _reading_cost(chosen) <= 1.0:
                break
            continue
        if position is not None:
            refusals[position] = result
    for result in refusals:
        # The first reading's refusal is the one to report; a later value reading's own typing (a FLOAT
        # Cast of a FLOAT16 gradient) is no news about the update.
        if result is not None and (best is None or (result.score > best.score and result.reason not in ("mixed-precision", "dtype-mismatch"))):
            best = result
    if chosen is None:
        # No reading with the graph's own hyper-parameters or with a value holding the whole term fits. A
        # value holding a constant part of the term (the clipped g*clip_coef inside (1 - d)*g*clip_coef) is
        # the gradient with that part as dampening: the one a first step without dampening needs.
        for g, k, absorbs_decay in _scaled_readings(normaliser, v, rest_v, vp, p, a, rel.precision, readings + unit):
            result = _try_reading(index, normaliser, solved, g, k, Poly.const(0) if absorbs_decay else vp, rel, absorbs_decay)
            if isinstance(result, Match) and (chosen is None or _reading_cost(result) < _reading_cost(chosen)):
                chosen = result
    if chosen is not None and _cancellation_gain(chosen) > MAX_CANCELLATION_GAIN:
        return Miss(
            w,
            "inexact-coefficients",
            f"read with dampening {chosen.dampening:.9g}, the op would compute grad - grad*d, whose rounding is "
            f"{_cancellation_gain(chosen):.3g} times the size of the term it leaves (1 - d = {1 - chosen.dampening:.3g}); "
            "no value of the graph holds the scaled gradient, which the op could take with dampening 0.",
            equation=equation,
            score=6,
        )
    if chosen is not None:
        return chosen
    assert best is not None
    return best


MAX_CANCELLATION_GAIN = 1024.0
"""A reading whose ``grad - grad*d`` rounds more than this many times the term ``(1 - d)*grad`` it leaves is
refused when nothing better exists (dampening within 2^-10 of 1)."""


def _cancellation_gain(match: Match) -> float:
    """|d| / |1 - d|: how much the op's ``grad - grad*d`` amplifies rounding relative to the term it leaves."""
    d = match.dampening
    return math.inf if d == 1 else max(1.0, abs(d) / abs(1.0 - d))


def _reading_cost(match: Match) -> float:
    """How far a reading is from exact: its coefficient distance (spacings, at least 1) times the op's own
    cancellation gain."""
    return max(match.coefficient_error, 1.0) * _cancellation_gain(match)


@dataclasses.dataclass(frozen=True)
class _Solved:
    """What one (parameters, buffer) reading of a candidate fixed before its gradient is chosen."""

    w: str
    v: str
    p: str
    a: str
    m: Poly
    lr: Poly
    nesterov: bool
    alpha: Poly
    beta: Poly
    form_w: Form
    form_v: Form
    equation: object
    selection: tuple | None


def _try_reading(
    index: GraphIndex, normaliser: Normaliser, solved: _Solved, g: str, k: Poly, vp: Poly, rel: "_Reading", absorbs_decay: bool = False
) -> Match | Miss:
    """The update read with gradient ``g`` entering the buffer as ``k·g`` (and ``vp·p``): its attributes,
    its exactness in the op's own arithmetic, its first step and its typing; a :class:`Match` or why not."""
    w, v, p, a, m, lr, equation = solved.w, solved.v, solved.p, solved.a, solved.m, solved.lr, solved.equation
    mixed = _mixed_gradient(normaliser, g, rel, solved.p if absorbs_decay else None)
    if mixed is not None:
        form_g = normaliser.form(g)
        main = max(form_g, key=lambda leaf: abs(next(iter(form_g[leaf].terms.values()), 0.0)))
        buffer_text = format_form({a: m, g: k}, [a, g])
        return Miss(
            w,
            "gradient-mixes-tensors",
            mixed,
            equation=LazyText(
                lambda: f"{w} = {p} - {format_poly(lr)}*{v};  {v} = {buffer_text};  {g} = {format_form(form_g, [main])}"
            ),
            nearest=f"{v} = {format_form({a: m, main: k * form_g[main]}, [a, main])}",
            differing=", ".join(f"{format_poly(c * k)}*{leaf} in {v}" for leaf, c in form_g.items() if leaf != main),
            score=5,
        )
    if not k.is_constant or not vp.is_constant:
        return Miss(
            w,
            "runtime-hyperparameter",
            f"dampening or weight decay of {v} depend on runtime values ({format_poly(k)}, {format_poly(vp)}); "
            "the contract needs them as compile-time attributes.",
            equation=equation,
            score=6,
        )
    k_value = k.constant_value
    if k_value == 0:
        return Miss(w, "no-gradient", f"{v} has dampening 1: the gradient never enters the buffer.", equation=equation, score=6)
    # k = s·(1 - d): s = -1 is maximize. Both signs are one update on later steps; a first-step rule
    # (no dampening when stat = 1) tells them apart, so with one the other sign is tried as well.
    signs = [1.0 if k_value > 0 else -1.0]
    if solved.selection is not None:
        signs.append(-signs[0])
    best: Miss | None = None
    for sign in signs:
        one_minus_d = k_value / sign
        dampening = 1.0 - one_minus_d  # not rounded to 0: a dampening of 2^-6 in BFLOAT16 is one
        weight_decay = vp.constant_value / one_minus_d if vp.constant_value else 0.0
        result = _attributes_reading(index, normaliser, solved, g, sign < 0, dampening, weight_decay, rel)
        if isinstance(result, Match):
            return result
        if best is None or result.score > best.score:
            best = result
    assert best is not None
    return best


def _attributes_reading(
    index: GraphIndex, normaliser: Normaliser, solved: _Solved, g: str, maximize: bool, dampening: float, weight_decay: float, rel: "_Reading"
) -> Match | Miss:
    w, v, p, a, m, lr, nesterov, equation = solved.w, solved.v, solved.p, solved.a, solved.m, solved.lr, solved.nesterov, solved.equation
    form_v = solved.form_v
    typing_problem = _typing_problem(index, normaliser, w, v, p, a, g)
    if typing_problem is not None:
        return dataclasses.replace(typing_problem, equation=equation, score=8)
    try:
        check_attributes(dampening, weight_decay, nesterov, subject=w)
    except ContractError as error:
        return Miss(w, "contract", str(error), equation=equation, score=7)
    inexact, error = _inexact_coefficients(index, normaliser, solved, g, maximize, dampening, weight_decay, rel)
    if inexact is not None:
        return dataclasses.replace(inexact, equation=equation)
    first_step = None
    if solved.selection is not None:
        condition, form_first, when_true, _ = solved.selection
        one_minus_d = 1.0 - dampening
        grad_eff = scale_form(add_forms(form_v, {a: m}, Poly.const(-1)), Poly.const(1.0 / one_minus_d))
        if not _differing_terms(form_first, grad_eff, rel):
            first_step = FirstStep(condition, when_true, zero_accum=True)
        elif not _differing_terms(form_first, add_forms(grad_eff, {a: m}), rel):
            first_step = FirstStep(condition, when_true, zero_accum=False)
        else:
            # A "first step" reading a tensor this reading has no role for (the real buffer b1, when the
            # branches are read the other way round: buffer x with momentum 2 in the first step's 2*x + h) is
            # no first step of this reading: its refusal ranks below any reading of the branches as they are.
            foreign = set(form_first) - set(form_v) - {a, p, ONE}
            return Miss(
                w,
                "first-step-unsupported",
                f"on the first step ({condition} is {when_true}) {v} = {format_form(form_first, [a])}; the contract "
                f"with stat = 1 gives {format_form(grad_eff)} (old buffer ignored) or "
                f"{format_form(add_forms(grad_eff, {a: m}), [a])}.",
                equation=equation,
                nearest=f"{v} = {format_form(grad_eff)}",
                differing=", ".join(_differing_terms(form_first, grad_eff, rel)),
                score=1 if foreign else 7,
            )
    nodes_w, _ = normaliser.cone(w)
    nodes_v, _ = normaliser.cone(v)
    alpha, beta = solved.alpha, solved.beta
    return Match(
        parameters=p,
        gradient=g,
        accum=a,
        parameters_out=w,
        accum_out=v,
        learning_rate=lr,
        momentum=m,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        dtype=index.spec(p).dtype,
        shape=index.spec(p).shape,
        nodes=nodes_w | nodes_v,
        parameter_equation="",
        accum_equation="",
        first_step=first_step,
        rounded=_rounded_hyperparameters(lr, m, index.spec(p).dtype, rel),
        coefficient_error=error,
        equation_forms=({p: Poly.const(1), v: alpha, a: beta} if nesterov else {p: Poly.const(1), v: alpha}, form_v),
    ).with_equations()


def _op_forms(normaliser: Normaliser, solved: _Solved, g: str, sign: float, lr: Poly, m: Poly, dampening: float, weight_decay: float) -> tuple[Form, Form]:
    """The forms the SGD op computes (contract, stat = 0) over the graph's leaves: ``V = m·A + (1-d)·grad``,
    ``grad = s·g + wd·P``; ``W = P - lr·V``, or ``P - lr·(grad + m·V)`` for Nesterov. ``dampening`` and
    ``weight_decay`` are taken as the float32 attributes store them, ``1 - d`` exactly from that."""
    d32 = round_to_dtype(dampening, onnx.TensorProto.FLOAT)
    wd32 = round_to_dtype(weight_decay, onnx.TensorProto.FLOAT)
    grad = scale_form(normaliser.form(g), Poly.const(sign))
    if wd32:
        grad = add_forms(grad, {solved.p: Poly.const(wd32)})
    buffer = add_forms({solved.a: m}, grad, Poly.const(1.0 - d32))
    weights: Form = {solved.p: Poly.const(1.0)}
    if solved.nesterov:
        weights = add_forms(add_forms(weights, grad, -lr), buffer, -(lr * m))
    else:
        weights = add_forms(weights, buffer, -lr)
    return weights, buffer


def _worst_difference(
    have: tuple[Form, Form], want: tuple[Form, Form], solved: _Solved, rel: "_Reading", exact_parameters: bool
) -> tuple[tuple[float, str, str, Poly, Poly], float]:
    """The coefficient where the op's forms ``have`` and the graph's ``want`` differ most, in spacings of the
    working precision: ``(spacings, output, leaf, op's, graph's)``. With ``exact_parameters`` (no weight
    decay) the parameters' own coefficient is 1 in the op with no arithmetic, so any difference from the
    graph's is a real term (``p*(1 - 2^-10)`` in FLOAT16 is decoupled weight decay, not a rounding of 1).
    Also returns the largest difference in the buffer update alone."""
    worst: tuple[float, str, str, Poly, Poly] = (0.0, "", "", Poly.const(0), Poly.const(0))
    buffer_worst = 0.0
    for op_form, graph_form, output in ((have[0], want[0], solved.w), (have[1], want[1], solved.v)):
        for leaf in sorted(set(op_form) | set(graph_form)):
            x, y = op_form.get(leaf, Poly.const(0)), graph_form.get(leaf, Poly.const(0))
            if exact_parameters and leaf == solved.p:
                spacings = 0.0 if dict(x.terms) == dict(y.terms) else math.inf
            else:
                spacings = rel.precision.spacings_poly(x, y)
            if spacings > worst[0]:
                worst = (spacings, output, leaf, x, y)
            if output == solved.v:
                buffer_worst = max(buffer_worst, spacings)
    return worst, buffer_worst


def _inexact_coefficients(
    index: GraphIndex, normaliser: Normaliser, solved: _Solved, g: str, maximize: bool, dampening: float, weight_decay: float, rel: "_Reading"
) -> tuple[Miss | None, float]:
    """Compare the coefficients the op applies with the graph's: first with the graph's own learning rate and
    momentum (``inexact-coefficients``: float32 attributes, ``1 - d``), then with both rounded to the
    parameters' dtype as the op takes them (``hyperparameter-precision`` when that dtype is coarser than the
    graph's working precision, unless rounding is allowed). Returns the refusal, or None and the largest
    difference in spacings."""
    sign = -1.0 if maximize else 1.0
    graph = (solved.form_w, solved.form_v)
    exact_parameters = round_to_dtype(weight_decay, onnx.TensorProto.FLOAT) == 0
    have = _op_forms(normaliser, solved, g, sign, solved.lr, solved.m, dampening, weight_decay)
    (spacings, output, leaf, op_value, graph_value), buffer_spacings = _worst_difference(have, graph, solved, rel, exact_parameters)
    if spacings > SPACINGS:
        return Miss(
            solved.w,
            "inexact-coefficients",
            f"read with gradient {g}, dampening {dampening:.9g} and weight decay {weight_decay:.9g} (float32 attributes), "
            f"the op would give {leaf or '1'} the coefficient {format_poly(op_value, 9)} in {output}, the graph "
            f"{format_poly(graph_value, 9)} ({_relative(op_value, graph_value)} relative, more than "
            f"{dtype_name(rel.precision.dtype)} rounding).",
            differing=f"{format_poly(op_value - graph_value, 9)}*{leaf or '1'} in {output}",
            score=6,
        ), buffer_spacings
    dtype = index.spec(solved.p).dtype
    lr_op, m_op = _in_dtype(solved.lr, dtype, index), _in_dtype(solved.m, dtype, index)
    coarser = dtype in FLOAT_DTYPES and Precision(dtype).unit_roundoff > rel.precision.unit_roundoff
    if lr_op is None or m_op is None:
        runtime = [name for name, op in (("learning rate", lr_op), ("momentum", m_op)) if op is None]
        if rel.allow_rounding or not coarser:
            return None, buffer_spacings
        return Miss(
            solved.w,
            "hyperparameter-precision",
            f"the {' and '.join(runtime)} is a runtime value that the op takes in {dtype_name(dtype)}, the parameters' "
            "dtype, which rounds it; give it in that dtype, or allow rounding (--allow-rounding).",
            score=6,
        ), spacings
    degenerate = _degenerate_rounding(solved.lr, lr_op, solved.m, m_op)
    if degenerate is not None:
        # Not a rounding of the update but another update: --allow-rounding does not cover it.
        return Miss(
            solved.w,
            "hyperparameter-precision",
            f"the op takes learning rate and momentum in {dtype_name(dtype)} (the parameters' dtype), where {degenerate}; "
            "that is another update, not a rounding of this one, so it is refused even with --allow-rounding. Keep "
            "the parameters in a wider dtype or change the hyper-parameter.",
            score=6,
        ), spacings
    have = _op_forms(normaliser, solved, g, sign, lr_op, m_op, dampening, weight_decay)
    rounded_spacings = _worst_difference(have, graph, solved, rel, exact_parameters)[0][0]
    if rounded_spacings <= SPACINGS or rel.allow_rounding:
        return None, buffer_spacings
    changes = [
        f"{name} {format_poly(graph_value, 9)} becomes {format_poly(op_value, 9)} ({_relative(op_value, graph_value)} relative)"
        for name, graph_value, op_value in (("learning rate", solved.lr, lr_op), ("momentum", solved.m, m_op))
        if graph_value != op_value
    ]
    return Miss(
        solved.w,
        "hyperparameter-precision",
        f"the op takes learning rate and momentum in {dtype_name(dtype)} (the parameters' dtype): {'; '.join(changes)}, "
        f"while the graph computes in {dtype_name(rel.precision.dtype)}. Allow the rounding with --allow-rounding "
        "(allow_rounding=True) if that is acceptable.",
        score=6,
    ), rounded_spacings


def _degenerate_rounding(lr: Poly, lr_op: Poly, m: Poly, m_op: Poly) -> str | None:
    """What rounding the constant learning rate or momentum to the op's dtype makes of the update when it is
    no longer the same kind of update, else None: a non-zero learning rate that becomes 0 (the weights never
    move), a non-zero momentum that becomes 0 (no momentum), or a momentum below 1 in magnitude that becomes
    1 or more (the buffer no longer decays: FLOAT16's 0.9995 is 1)."""
    if lr.is_constant and lr_op.is_constant and lr.constant_value != 0 and lr_op.constant_value == 0:
        return f"the learning rate {lr.constant_value:.9g} becomes 0 and the weights would never move"
    if m.is_constant and m_op.is_constant:
        before, after = m.constant_value, m_op.constant_value
        if before != 0 and after == 0:
            return f"the momentum {before:.9g} becomes 0"
        if abs(before) < 1 <= abs(after):
            return f"the momentum {before:.9g} becomes {after:.9g} and the buffer would no longer decay"
    return None


def _relative(have: Poly, want: Poly) -> str:
    errors = []
    for monomial in set(have.terms) | set(want.terms):
        x, y = have.terms.get(monomial, 0.0), want.terms.get(monomial, 0.0)
        errors.append(abs(x - y) / abs(y) if y else float("inf"))
    worst = max(errors, default=0.0)
    return "infinitely" if worst == float("inf") else f"{worst:.2g}"


def _in_dtype(poly: Poly, dtype: int, index: GraphIndex) -> Poly | None:
    """``poly`` as the op receives it in ``dtype``: a constant rounded; a runtime value unchanged when it is
    one symbol already of a dtype that ``dtype`` holds exactly, else None (rounded at run time)."""
    if poly.is_constant:
        return Poly.const(round_to_dtype(poly.constant_value, dtype)) if dtype in FLOAT_DTYPES else poly
    if dtype == onnx.TensorProto.FLOAT and all(value == round_to_dtype(value, dtype) for value in poly.terms.values()):
        return poly
    if poly.is_monomial:
        ((monomial, coefficient),) = poly.terms.items()
        if coefficient == 1 and len(monomial) == 1 and monomial[0][1] == 1 and index.spec(monomial[0][0]).dtype == dtype:
            return poly
    return None


def _rounded_hyperparameters(lr: Poly, m: Poly, dtype: int, rel: "_Reading") -> dict[str, float]:
    """With rounding allowed, the learning rate and momentum constants that the op's dtype changes beyond
    the working precision: name → the value the op uses."""
    rounded: dict[str, float] = {}
    if not rel.allow_rounding or dtype not in FLOAT_DTYPES:
        return rounded
    for name, poly in (("learning_rate", lr), ("momentum", m)):
        if poly.is_constant:
            value = round_to_dtype(poly.constant_value, dtype)
            if not rel.precision.close(value, poly.constant_value):
                rounded[name] = value
    return rounded


def _nesterov_miss(w, v, p, a, g, k, m, m_inverse, alpha, beta, lr, form_v, rel) -> Miss:
    """Say a Nesterov candidate's misfit with the new buffer and the gradient: ``W = P + c_v·V + c_g·g``."""
    c_v = alpha + beta * m_inverse
    c_g = -(beta * m_inverse) * k
    # The contract's Nesterov step is P - lr*(grad + m*V) whatever V's dampening: -c_g/s and -c_v/m are
    # then one learning rate, and only the dampening stands in the way (the contract needs 0).
    sign = -1.0 if (k.is_constant and k.constant_value < 0) else 1.0
    lr_g, lr_v = c_g.scale(-sign), -(c_v * m_inverse)
    if k.is_constant and _close(lr_g, lr_v, rel) and not rel.precision.close(abs(k.constant_value), 1.0):
        return Miss(
            w,
            "contract",
            f"{w} = {p} - {format_poly(lr_g)}*({g} + {format_poly(m)}*{v}) is a Nesterov step, but its buffer "
            f"{v} has dampening {1.0 - abs(k.constant_value):g}; the SGD operator requires dampening 0 with "
            "Nesterov (contract: nesterov requires dampening == 0).",
            equation=f"{w} = {format_form({p: Poly.const(1), v: c_v, g: c_g}, [p, v, g])};  {v} = {format_form(form_v, [a])}",
            score=7,
        )
    plain_differs = f"{format_poly(c_g)}*{g}"
    nesterov_differs = f"{format_poly(c_v - (-(lr * m)))}*{v}"
    return Miss(
        w,
        "nesterov-momentum-mismatch",
        f"{w} = {p} {_signed(c_v)}*{v} {_signed(c_g)}*{g} is neither plain momentum ({p} - "
        f"{format_poly(-c_v)}*{v}; differs by {plain_differs}) nor Nesterov with the buffer's momentum "
        f"{format_poly(m)} ({p} - {format_poly(lr)}*({g} + {format_poly(m)}*{v}); differs by {nesterov_differs}).",
        equation=f"{w} = {format_form({p: Poly.const(1), v: c_v, g: c_g}, [p, v, g])};  {v} = {format_form(form_v, [a])}",
        nearest=f"{w} = {p} - {format_poly(-c_v)}*{v}  or  {w} = {p} - {format_poly(lr)}*({g} + {format_poly(m)}*{v})",
        differing=f"{plain_differs} (plain) / {nesterov_differs} (Nesterov)",
        score=5,
    )


def _signed(poly: Poly) -> str:
    text = format_poly(poly)
    return f"- {text[1:]}" if text.startswith("-") and " " not in text else f"+ {text}"


def _mixed_gradient(normaliser: Normaliser, g: str, rel: "_Reading", decay_on: str | None = None) -> str | None:
    """A gradient computed as a weighted mix of tensors (``g + 0.01*q``: weight decay on a tensor other than
    the parameter) is not taken as the gradient; a sum of contributions with one common weight
    (accumulated micro-batch gradients, averaged or not) is, and so is weight decay on the parameters
    ``decay_on`` inside a scaled gradient (LARS's ``(g + wd*p)*trust``)."""
    form = {leaf: c for leaf, c in normaliser.form(g).items() if leaf != decay_on}
    if len(form) < 2:
        return None
    weights = list(form.values())
    first = weights[0]
    if all(_close(w, first, rel) for w in weights[1:]):
        return None
    leaves = sorted(form, key=lambda leaf: -abs(next(iter(form[leaf].terms.values()), 0.0)))
    main, extra = leaves[0], leaves[1:]
    return (
        f"the buffer's gradient term {g} = {format_form(form, [main])} adds {', '.join(extra)} with a different "
        f"weight than {main}. sgdfuse takes as the gradient one tensor, or a sum of contributions with one common "
        "weight (accumulated micro-batches); a differently weighted extra tensor is read as weight decay applied "
        f"to a tensor other than the parameters, which momentum SGD does not do. If {', '.join(extra)} genuinely "
        f"belongs to the gradient, give the step {g} as one tensor, e.g. as a graph input: sgdfuse looks through "
        "elementwise sums, so a sum written in front of the update is read as part of the update."
    )


def _close(a: Poly, b: Poly, rel: "_Reading", scale: Poly | None = None) -> bool:
    """``a`` and ``b`` are one coefficient at the candidate's working precision (per monomial, relative to
    the larger magnitude among a, b and ``scale``; see :mod:`sgdfuse.passes.precision`)."""
    return rel.precision.close_poly(a, b, scale)


def _differing_terms(actual: Form, predicted: Form, rel: float) -> list[str]:
    differing = []
    for leaf in sorted(set(actual) | set(predicted)):
        x, y = actual.get(leaf, Poly.const(0)), predicted.get(leaf, Poly.const(0))
        if not _close(x, y, rel):
            name = "1" if leaf == ONE else leaf
            differing.append(f"{format_poly(x - y)}*{name}")
    return differing


def _gradient_readings(
    index: GraphIndex, normaliser: Normaliser, v: str, rest: Form, vp: Poly, p: str, a: str, precision: Precision
) -> list[tuple[str, Poly, bool]]:
    """Ways to name the gradient of ``v``: ``(g, k, absorbs_decay)`` with ``rest = k·form(g)`` (or, when
    ``absorbs_decay``, ``rest + vp·p = k·form(g)``: a weight-decay term inside a scaled gradient belongs to it).

    First the reading of :func:`_find_gradient` (the leaf itself, or the one value computing the sum); then
    every other value of ``v``'s cone that computes the whole term (up to its sign): the graph's own ``lr*g``
    (Keras), ``g*clip_scale``, ``Cast(g16, FLOAT)``. A value computed by the graph is exact as the op's
    gradient with dampening 0, where a factor folded into dampening may not be.
    """
    readings: list[tuple[str, Poly, bool]] = []
    first = _find_gradient(index, normaliser, v, rest, {a, p}, precision)
    if first is not None:
        readings.append((first[0], first[1], False))
    targets = [(rest, False)]
    if not vp.is_zero:
        targets.append((add_forms(rest, {p: vp}), True))
    _, values = normaliser.cone(v)
    more: list[tuple[str, Poly, bool]] = []
    for value in sorted(values):
        if value in (v, a, p, ONE) or (first is not None and value == first[0]) or index.spec(value).dtype not in FLOAT_DTYPES:
            continue
        form = normaliser.form(value)
        for target, absorbs in targets:
            k = _proportional(target, form, precision)
            # Only the value that is the whole term (k = ±1, dampening 0): a value that is a part of it
            # (0.05*g of a 0.1*g term) would need a dampening of its own, which says nothing clearer.
            if k is not None and k.is_constant and abs(k.constant_value) == 1.0:
                more.append((value, k, absorbs))
    more.sort(key=lambda r: r[2])
    return readings + more


def _reading_order(
    normaliser: Normaliser, v: str, rest: Form, vp: Poly, p: str, a: str, precision: Precision, readings: list[tuple[str, Poly, bool]]
) -> tuple[list[tuple[int | None, tuple[str, Poly, bool]]], list[tuple[str, Poly, bool]]]:
    """The order in which :func:`_solve_roles` tries the gradient ``readings`` (each with its position in
    them, None for one added here), and the readings added.

    As given, unless the first folds into ``1 - d`` a factor that is the gradient's own scaling, not the
    optimiser's:

    - a factor larger than 1 (``|k| > 1``: a negative dampening): ``g2 = 2*w1_new`` read as gradient ``w1_new``
      with dampening -1, or ``0.75*(2*w1_new)`` as dampening -0.5, where the user wrote dampening 0 and 0.25
      (also an unchained ``0.9*buf + 2*g``);
    - any factor when its gradient is an opaque leaf of ``normaliser`` (another update's new values, in
      :func:`_solve_readers_of_fused`): no optimiser feeds those as they are, the gradient is computed from
      them (``g2 = 0.5*w1_new`` is gradient ``g2`` with dampening 0, not ``w1_new`` with dampening 0.5).

    Then the values of the graph that hold the term up to a factor in (0, 1) are tried first (the gradient the
    term's last scaling reads, with that factor as the user's ``1 - d``; the largest factor, the least
    dampening, first), then the values holding the whole term (dampening 0), and that first reading last.
    Readings are compared as before (:func:`_reading_cost`), so it still fuses when nothing else does; only
    the choice among exact readings changes. Everything read is in the class key (forms of the cone's values,
    from their ops and constants; dtypes; the names' order); opaque leaves exist only in the direct solve of
    :func:`_solve_readers_of_fused`, which no class shares."""
    placed = list(enumerate(readings))
    if not readings:
        return placed, []
    g, k, _ = readings[0]
    if not (g in normaliser.opaque or (k.is_constant and abs(k.constant_value) > 1.0)):
        return placed, []
    unit = [r for r in _scaled_readings(normaliser, v, rest, vp, p, a, precision, readings) if abs(r[1].constant_value) < 1.0]
    unit.sort(key=lambda r: -abs(r[1].constant_value))  # stable: equal factors keep the names' order
    return [(None, r) for r in unit] + placed[1:] + placed[:1], unit


def _scaled_readings(
    normaliser: Normaliser, v: str, rest: Form, vp: Poly, p: str, a: str, precision: Precision, tried: list[tuple[str, Poly, bool]]
) -> list[tuple[str, Poly, bool]]:
    """The readings :func:`_gradient_readings` leaves out: values of ``v``'s cone that compute a constant
    multiple ``rest = k·form(g)`` of the gradient term with ``k`` neither 1 nor -1, so that ``1 - d = |k|``
    (``g*clip_coef`` in ``0.9*buf + 0.75*g*clip_coef``). Tried only when no other reading fits: such a
    reading says no more than the value that holds the whole term, unless a first step tells them apart."""
    seen = {g for g, _, _ in tried} | {v, a, p, ONE}
    targets = [(rest, False)] + ([(add_forms(rest, {p: vp}), True)] if not vp.is_zero else [])
    _, values = normaliser.cone(v)
    found: list[tuple[str, Poly, bool]] = []
    for value in sorted(values - seen):
        if normaliser.index.spec(value).dtype not in FLOAT_DTYPES:
            continue
        form = normaliser.form(value)
        for target, absorbs in targets:
            k = _proportional(target, form, precision)
            if k is not None and k.is_constant and abs(k.constant_value) not in (0.0, 1.0):
                found.append((value, k, absorbs))
    found.sort(key=lambda r: r[2])
    return found


def _poly_ratio(a: Poly, b: Poly) -> Poly | None:
    """``q`` with ``a = q·b`` exactly for a monomial ``q`` (``-0.1 + 0.1·m`` over ``1 - m`` is ``-0.1``), or
    None: the ratio of two sums of terms, where :meth:`Poly.inverse` has none."""
    if b.is_zero:
        return None
    if a.is_zero:
        return Poly.const(0)
    (mb, vb) = sorted(b.terms.items())[0]
    for ma, va in sorted(a.terms.items()):
        q = Poly({tuple(sorted((s, p) for s, p in (dict(ma) | {s2: dict(ma).get(s2, 0) - p2 for s2, p2 in mb}).items() if p != 0)): va / vb})
        product = q * b
        if set(product.terms) == set(a.terms) and all(math.isclose(product.terms[k], a.terms[k], rel_tol=1e-12) for k in a.terms):
            return q
    return None


def _proportional(target: Form, form: Form, precision: Precision) -> Poly | None:
    """``k`` with ``target = k·form`` for one scalar ``k`` (per-leaf ratios equal at ``precision``), or None."""
    if set(form) != set(target) or not form:
        return None
    if all(target[leaf] == form[leaf] for leaf in form):
        return Poly.const(1.0)  # the same term, whatever its coefficients (1 - m with m fed at run time)
    if all(target[leaf] == -form[leaf] for leaf in form):
        return Poly.const(-1.0)
    pivot = sorted(form)[0]
    inverse = form[pivot].inverse()
    if inverse is None:
        return None
    k = target[pivot] * inverse
    if k.is_constant and abs(abs(k.constant_value) - 1.0) < 1e-12:
        k = Poly.const(math.copysign(1.0, k.constant_value))  # x/x is 1, not 1 + 2^-52
    if all(precision.close_poly(target[leaf], form[leaf] * k) for leaf in target):
        return k
    return None


def _find_gradient(
    index: GraphIndex, normaliser: Normaliser, v: str, rest: Form, exclude: set[str], precision: Precision
) -> tuple[str, Poly] | None:
    """A tensor ``g`` of the graph with ``rest = k·form(g)`` for a scalar ``k``: a single leaf itself, or
    an intermediate of ``v``'s cone (a gradient summed from several contributions, say)."""
    if len(rest) == 1:
        ((leaf, coefficient),) = rest.items()
        return (leaf, coefficient) if leaf not in exclude else None
    _, values = normaliser.cone(v)
    for value in sorted(values):
        if value == v or value in exclude:
            continue
        form = normaliser.form(value)
        if set(form) != set(rest):
            continue
        pivot = sorted(form)[0]
        inverse = form[pivot].inverse()
        if inverse is None:
            continue
        k = rest[pivot] * inverse
        if all(precision.close_poly(rest[leaf], form[leaf] * k) for leaf in rest):
            return value, k
    return None


def _why_unread(index: GraphIndex, normaliser: Normaliser, v: str, buffer: str) -> Miss | None:
    """Why ``v``'s linear form lacks ``buffer`` when something else than momentum 0 explains it: the buffer
    has another shape than ``v`` (one element broadcast, say), or it is scaled by a constant that is not a
    finite number (a NaN momentum is not 0)."""
    buffer_spec, v_spec = index.spec(buffer), index.spec(v)
    if buffer_spec.shape is not None and v_spec.shape is not None and not _same_shape(buffer_spec, v_spec):
        return Miss(
            v,
            "shape-mismatch",
            f"the momentum buffer {buffer} has shape {format_shape(buffer_spec.shape)} but its new value {v} has "
            f"{format_shape(v_spec.shape)}; the SGD operator needs one shape for parameters, gradient and buffer.",
            score=4,
        )
    form = normaliser.form(v)
    if set(form) == {v}:
        # v itself is a leaf: the op computing it is one the algebra does not enter.
        node = index.node(v)
        if node is not None:
            detail = ""
            if node.op_type == "Where" and node.input:
                condition = index.spec(node.input[0])
                elements = _elements(condition.shape)
                if elements is None or elements > 1:
                    detail = (
                        f" Its condition {node.input[0]} has {'an unknown number of' if elements is None else elements} "
                        "elements: sgdfuse reads a first-step or skip selection by one boolean only."
                    )
            return Miss(
                v,
                "no-momentum-buffer",
                f"{v} is computed by {node.op_type} node {node.name or '(unnamed)'}, which the algebra does not read "
                f"through, so no momentum of the buffer {buffer} is seen in it.{detail}",
                score=4,
            )
    for leaf in form:
        node = index.node(leaf) if leaf != ONE else None
        if node is None or buffer not in node.input:
            continue
        if node.op_type == "Where" and len(node.input) == 3 and buffer in node.input[1:]:
            other = node.input[2] if node.input[1] == buffer else node.input[1]
            if _is_zeros(index, other):
                when = "true" if node.input[2] == buffer else "false"
                return Miss(
                    v,
                    "first-step-unsupported",
                    f"{v} reads the buffer {buffer} through {leaf} = Where({node.input[0]}, ...), which zeroes the old "
                    f"buffer when {node.input[0]} is {when} (a first-step rule on the old buffer); sgdfuse fuses a "
                    f"first-step rule written on the new buffer, {v} = Where(first, grad, m*{buffer} + (1-d)*grad), "
                    "not on the old one.",
                    score=4,
                )
        if node.op_type == "Mul" and len(node.input) == 2:
            factor = node.input[1] if node.input[0] == buffer else node.input[0]
            constant = index.constant(factor)
            elements = constant.size if constant is not None else _elements(index.spec(factor).shape)
            uniform = constant is not None and constant.size > 0 and bool(np.all(constant == constant.reshape(-1)[0]))
            if factor != buffer and not uniform and (elements is None or elements > 1):
                return Miss(
                    v,
                    "tensor-factor",
                    f"{v} multiplies the buffer {buffer} by {factor}, a tensor of "
                    f"{'unknown size' if elements is None else f'{elements} elements'} (a per-element momentum); the "
                    "SGD operator takes one momentum for the whole tensor.",
                    score=4,
                )
        if node.op_type not in LINEAR_OPS:  # a linear op left a leaf: a factor it could not resolve, below
            return Miss(
                v,
                "no-momentum-buffer",
                f"{v} reads the buffer {buffer} only through {node.op_type} node {node.name or '(unnamed)'} ({leaf}), "
                "which is not linear in it, so no momentum multiplies the buffer itself; no momentum-SGD reading.",
                score=4,
            )
        for operand in node.input:
            constant = index.constant(operand) if operand and operand != buffer else None
            if constant is not None and constant.dtype.kind == "f" and not np.all(np.isfinite(constant.astype(np.float64))):
                return Miss(
                    v,
                    "extra-term",
                    f"{v} multiplies the buffer {buffer} by {operand}, a constant that is not a finite number "
                    f"({constant.reshape(-1)[0]}); that is no momentum (and not momentum 0).",
                    score=4,
                )
    return None


def _elements(shape) -> int | None:
    """The number of elements of a static shape, None when a dimension (or the shape) is unknown."""
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))


def _is_zeros(index: GraphIndex, value: str) -> bool:
    """``value`` is all zeros by construction: a small constant of zeros, or ``ConstantOfShape`` whose value
    attribute is zero or absent (ONNX: a FLOAT 0 by default)."""
    constant = index.constant(value)
    if constant is not None:
        return bool(constant.size) and not np.any(constant.astype(np.float64))
    node = index.node(value)
    if node is None or node.op_type != "ConstantOfShape":
        return False
    for attribute in node.attribute:
        if attribute.name == "value":
            return not np.any(onnx.numpy_helper.to_array(attribute.t).astype(np.float64))
    return True


def _state_problem(index: GraphIndex, w: str, v: str, p: str, a: str, pins: RolePins | None = None) -> Miss | None:
    for role, name in (("parameters", p), ("momentum buffer", a)):
        if name in index.initializers and not index.is_input_name(name):
            return Miss(
                w,
                "constant-state",
                f"the {role} {name} is an initializer, a constant of the model, not state fed to the step "
                "(exporters fold module buffers this way); make it a graph input to fuse.",
            )
        if not index.is_input_name(name):
            origin = index.node(name)
            what = f"computed by {origin.op_type} node {origin.name or '(unnamed)'}" if origin is not None else "not a graph input"
            return Miss(
                w,
                "computed-state",
                f"the {role} {name} is {what}; fused state must be a graph input the caller feeds and updates.",
            )
    # ONNX does not say which input a new state output replaces. Where the names say it (buf -> buf_out),
    # the buffer an update reads must be the one its output replaces, or the in-place write hits another.
    for role, old, new in (("momentum buffer", a, v), ("parameters", p, w)):
        named = _previous_by_name(index, new, pins)
        if named is not None and named != old:
            return Miss(
                w,
                "buffer-not-own-previous" if role == "momentum buffer" else "parameters-not-own-previous",
                f"{new} is computed from {old}, but its name says it is the next value of {named}; an in-place "
                f"update would overwrite {old} instead.",
            )
    return None


_STATE_SUFFIXES = ("_out", "_new", "_next", "_updated", ".out", ".new")
_STATE_PREFIXES = ("new_", "next_", "updated_", "out_")


def previous_by_name(output: str, inputs: Iterable[str]) -> str | None:
    """The input whose name marks ``output`` as its next value (``buf`` for ``buf_out``, ``new_buf``,
    ``buf_new``, ``buf_next``, ``buf_updated``, ``next_buf``, ...), or None when the names say nothing."""
    # One call each rules out the names with none of the suffixes or prefixes (most of them).
    suffixed, prefixed = output.endswith(_STATE_SUFFIXES), output.startswith(_STATE_PREFIXES)
    if not (suffixed or prefixed):
        return None
    names = inputs if isinstance(inputs, (set, frozenset, dict)) else set(inputs)
    for suffix in _STATE_SUFFIXES if suffixed else ():
        if output.endswith(suffix) and output[: -len(suffix)] in names:
            return output[: -len(suffix)]
    for prefix in _STATE_PREFIXES if prefixed else ():
        if output.startswith(prefix) and output[len(prefix):] in names:
            return output[len(prefix):]
    return None


def _previous_by_name(index: GraphIndex, output: str, pins: RolePins | None = None) -> str | None:
    """The graph input that ``output`` is the next value of: as pinned by the user, else as its name says
    (:func:`previous_by_name`); None when neither says."""
    if pins is not None and output in pins.state:
        return pins.state[output]
    return previous_by_name(output, index.state_names)


def _origin_problem(index: GraphIndex, value: str, limit: int = 10_000) -> str | None:
    """Why shape inference could not type ``value``, when the graph itself is at fault: a node of its cone
    reads a value that nothing defines (no node output, graph input or initializer), or reads a value a later
    node computes (ONNX requires nodes in topological order). None when neither is found within ``limit``
    nodes. Asked only of a refusal: the walk costs nothing on the way to a fusion."""
    producer, nodes = index.producer, index.graph.node
    if value not in producer and not index.is_input_name(value) and value not in index.initializers:
        return f"{value} is read but nothing defines it (no node output, graph input or initializer of that name)."
    stack, seen = [value], {value}
    while stack and len(seen) < limit:
        k = producer.get(stack.pop())
        if k is None:
            continue
        node = nodes[k]
        label = node.name or f"#{k} ({node.op_type})"
        for name in node.input:
            if not name or name in seen:
                continue
            seen.add(name)
            j = producer.get(name)
            if j is None and not index.is_input_name(name) and name not in index.initializers:
                return f"node {label} reads {name}, which nothing defines (no node output, graph input or initializer of that name)."
            if j is not None and j > k:
                return (
                    f"node {label} reads {name} before node {nodes[j].name or f'#{j} ({nodes[j].op_type})'} computes it: "
                    "the graph is not in topological order, which ONNX requires (onnx.checker says so); sort its nodes."
                )
            stack.append(name)
    return None


def _reads_from(index: GraphIndex, value: str, source: str) -> bool:
    """Whether ``value`` is computed from ``source`` (or is it): a walk forward from ``source`` through the
    nodes that read it, over nodes placed before ``value``'s producer only when the graph is in topological
    order (any path to ``value`` runs through such nodes), so a buffer read by its update alone costs a few
    steps. A node holding a subgraph that reads outer-scope values counts as reading every one of them
    (``GraphIndex.subgraph_reads`` does not say which node reads which), which can only say yes more often."""
    if value == source:
        return True
    target = index.producer.get(value)
    if target is None:
        return False  # a graph input or initializer is computed from nothing
    limit = target + 1 if index.in_order else len(index.nodes)
    facts, consumers, outer, holders = index.nodes, index.consumers, index.subgraph_reads, index.subgraph_nodes
    seen_nodes: set[int] = set()
    seen, stack = {source}, [source]
    while stack:
        name = stack.pop()
        readers = consumers.get(name, ())
        if name in outer:
            readers = [*readers, *holders]
        for k in readers:
            if k >= limit or k in seen_nodes:
                continue
            seen_nodes.add(k)
            if k == target:
                return True
            for out in (facts[k][3] if facts else index.graph.node[k].output):
                if out and out not in seen:
                    seen.add(out)
                    stack.append(out)
    return False


def _reached_without(index: GraphIndex, root: str, values: set[str], stop: str) -> set[str]:
    """The values among ``values`` (a cone of ``root``) that ``root`` reads without passing through ``stop``:
    what the fused update computes itself when ``stop`` (its gradient) is one of its inputs."""
    if stop not in values or stop == root:
        return values
    reached: set[str] = set()
    stack = [root]
    while stack:
        value = stack.pop()
        if value in reached or value not in values:
            continue
        reached.add(value)
        if value == stop:
            continue
        k = index.producer.get(value)
        if k is not None:
            stack.extend(name for name in index.graph.node[k].input if name)
    return reached


def _typing_problem(
    index: GraphIndex, normaliser: Normaliser, w: str, v: str, p: str, a: str, g: str
) -> Miss | None:
    specs = {name: index.spec(name) for name in (p, g, a, w, v)}
    for name, spec in specs.items():
        if spec.dtype == 0 or spec.shape is None:
            origin = _origin_problem(index, name)
            if origin is not None:
                return Miss(w, "dtype-mismatch" if spec.dtype == 0 else "shape-mismatch", f"{name}'s type is unknown: {origin}")
    dtype = specs[p].dtype
    for name, spec in specs.items():
        if spec.dtype != dtype:
            both_float = spec.dtype in _EPS and dtype in _EPS
            return Miss(
                w,
                "mixed-precision" if both_float else "dtype-mismatch",
                f"{name} is {dtype_name(spec.dtype)} but parameters {p} are {dtype_name(dtype)}; the SGD operator "
                "keeps parameters, gradient and buffer in one dtype"
                + (" (a buffer or gradient kept in higher precision cannot be fused without changing it)." if both_float else "."),
            )
    shape = specs[p].shape
    if shape is not None and (not 1 <= len(shape) <= 8 or any(d == 0 for d in shape)):
        return Miss(
            w,
            "contract",
            f"parameters {p} have shape {list(shape)}; the SGD operator takes rank 1..8 and no empty tensor "
            "(contract: parameters rank is 1..8, not empty).",
        )
    for name, spec in specs.items():
        if not _same_shape(spec, specs[p]) or spec.shape is None and specs[p].shape is not None:
            return Miss(
                w,
                "shape-mismatch",
                f"{name} has shape {spec.shape} but parameters {p} have {specs[p].shape}; the SGD operator needs "
                "one shape.",
            )
    # The contract computes in FLOAT and rounds once at the end. An update computed wholly in the parameters'
    # dtype, or wholly in FLOAT between Casts of FLOAT16/BFLOAT16 state, is that computation (up to the
    # rounding the verification bound covers); a mix rounds to the low precision midway, and is refused.
    intermediate_dtypes: dict[int, str] = {}
    # The parameter update's cone includes the buffer output when it reads the rounded buffer back: that is
    # a rounding midway, so only each cone's own root is exempt.
    for root in (w, v):
        _, values = normaliser.cone(root)
        # The gradient is the op's input: how the graph computes it (a FLOAT gradient round-tripped through
        # FLOAT16, a compressed gradient) is kept as it is, not fused; only what the update reads besides it
        # must be in one precision. Unless the update also reads what the gradient is computed from another
        # way: forms read a rounding Cast as a copy, so 0.5*round(g0) + 0.5*g0 would read as round(g0).
        outside = _reached_without(index, root, values, g)
        if not outside & (set(normaliser.form(g)) - {ONE}):
            values = outside
        for value in sorted(values):
            spec = index.spec(value)
            if value in (p, g, a, root) or value == ONE or spec.num_elements() == 1 or index.producer.get(value) is None:
                continue
            if spec.dtype:
                intermediate_dtypes.setdefault(spec.dtype, value)
    allowed = {dtype} | ({onnx.TensorProto.FLOAT} if dtype in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) else set())
    for other, value in intermediate_dtypes.items():
        if other not in allowed:
            return Miss(
                w,
                "mixed-precision",
                f"{value} in the update is computed in {dtype_name(other)} while parameters {p} are {dtype_name(dtype)}.",
            )
    if len(intermediate_dtypes) > 1:
        low = intermediate_dtypes[dtype]
        return Miss(
            w,
            "mixed-precision",
            f"the update rounds to {dtype_name(dtype)} midway ({low}) between FLOAT computations; the contract "
            "rounds once, at the end.",
        )
    return None
