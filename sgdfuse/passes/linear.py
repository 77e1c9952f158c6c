"""Normalise the elementwise cone of a value into a linear combination of tensor leaves.

This is the heart of "matching is algebraic, not a list of shapes" (docs/design.md): whatever mix of
``Add``/``Sub``/``Mul``/``Div``/``Neg``/``Sum``/``Identity``/``Cast``/``CastLike`` an exporter wrote, a value
becomes ``Σ coefficient_i · leaf_i``. A leaf is a tensor the normaliser does not look through (a graph input,
an initializer, the output of a non-elementwise op or of a product of two tensors). A coefficient is a
:class:`Poly`: a polynomial with real coefficients over *symbols*, the runtime scalars of the graph (a
learning rate fed as a graph input, say). Scalars are recognised through ``Constant``, initializers,
``Reshape``/``Unsqueeze``/``Squeeze``/``Expand``/``Gather``/``Identity``/``Cast``/``CastLike`` and scalar
arithmetic, so ``Mul(v, Reshape(lr))`` and ``Mul(Neg(lr), v)`` normalise alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np
import onnx

from sgdfuse.errors import GraphCycleError
from sgdfuse.external_data import tensor_to_array
from sgdfuse.passes.index import GraphIndex

__all__ = ["Monomial", "Poly", "Form", "ONE", "Normaliser", "boolean_root", "format_form", "format_poly"]

ONE = ""
"""The leaf of the constant term: ``Add(v, 1.0)`` normalises to ``1·v + 1.0·ONE``."""

SCALE_UP_LIMIT = 1000.0
"""A term the graph scales up by more than this factor beyond its final coefficient and back down is a
cancellation (refused): the graph's intermediate overflows for values 1000 times below FLOAT's maximum where
the fused op's does not. Smaller re-associations (``(g*4)*0.25``) fuse: they change the overflow threshold
by less than that, and only their rounding, which verification bounds."""

MAX_LEAVES = 64
"""A form with more leaves is not an update; it is treated as one opaque leaf to bound the work."""

Monomial = tuple[tuple[str, int], ...]
"""A product of symbols with integer powers, sorted by symbol: ``(("lr", 1), ("m", -1))`` is lr/m."""


@dataclasses.dataclass(frozen=True)
class Poly:
    """A polynomial over runtime scalar symbols: ``{monomial: coefficient}``; ``{(): c}`` is the constant c.

    Coefficients are float64. Values that come from FLOAT16 or FLOAT constants keep their exact value.
    """

    terms: Mapping[Monomial, float]

    @staticmethod
    def const(value: float) -> "Poly":
        """The constant polynomial ``value`` (zero has no terms)."""
        return Poly({(): float(value)} if value != 0 else {})

    @staticmethod
    def symbol(name: str) -> "Poly":
        """The polynomial ``1·name``."""
        return Poly({((name, 1),): 1.0})

    def __add__(self, other: "Poly") -> "Poly":
        terms = dict(self.terms)
        for monomial, value in other.terms.items():
            terms[monomial] = terms.get(monomial, 0.0) + value
        return Poly({k: v for k, v in terms.items() if v != 0})

    def __neg__(self) -> "Poly":
        return Poly({k: -v for k, v in self.terms.items()})

    def __sub__(self, other: "Poly") -> "Poly":
        return self + (-other)

    def __mul__(self, other: "Poly") -> "Poly":
        if len(self.terms) == 1 and len(other.terms) == 1:
            ((m1, v1),), ((m2, v2),) = self.terms.items(), other.terms.items()
            value = v1 * v2
            return Poly({_multiply_monomials(m1, m2): value} if value != 0 else {})
        terms: dict[Monomial, float] = {}
        for m1, v1 in self.terms.items():
            for m2, v2 in other.terms.items():
                monomial = _multiply_monomials(m1, m2)
                terms[monomial] = terms.get(monomial, 0.0) + v1 * v2
        return Poly({k: v for k, v in terms.items() if v != 0})

    def scale(self, factor: float) -> "Poly":
        """``factor · self``."""
        return Poly({k: v * factor for k, v in self.terms.items() if v * factor != 0})

    @property
    def is_zero(self) -> bool:
        return not self.terms

    @property
    def is_constant(self) -> bool:
        """True when no symbol appears (zero included). Terms are keyed by monomial, so a constant has at
        most the one term ``()``."""
        terms = self.terms
        return not terms or (len(terms) == 1 and () in terms)

    @property
    def constant_value(self) -> float:
        """The value of a constant polynomial (0.0 for zero). Raises ValueError if symbols appear."""
        if not self.is_constant:
            raise ValueError(f"{format_poly(self)} is not a constant")
        return self.terms.get((), 0.0)

    @property
    def is_monomial(self) -> bool:
        """True for exactly one non-zero term."""
        return len(self.terms) == 1

    def inverse(self) -> "Poly | None":
        """``1/self`` for a monomial; None otherwise (division by a sum is not linear)."""
        if not self.is_monomial:
            return None
        ((monomial, value),) = self.terms.items()
        return Poly({tuple((s, -p) for s, p in monomial): 1.0 / value})


def _multiply_monomials(a: Monomial, b: Monomial) -> Monomial:
    if not a:
        return b
    if not b:
        return a
    powers: dict[str, int] = dict(a)
    for symbol, power in b:
        powers[symbol] = powers.get(symbol, 0) + power
    return tuple(sorted((s, p) for s, p in powers.items() if p != 0))


Form = dict[str, Poly]
"""A linear form: leaf value name (or :data:`ONE`) → coefficient."""


def add_forms(a: Form, b: Form, factor: Poly | None = None) -> Form:
    """``a + factor·b`` (factor 1 when None), dropping zero coefficients."""
    result = dict(a)
    for leaf, coefficient in b.items():
        term = coefficient if factor is None else coefficient * factor
        total = result.get(leaf, Poly.const(0)) + term
        if total.is_zero:
            result.pop(leaf, None)
        else:
            result[leaf] = total
    return result


def scale_form(form: Form, factor: Poly) -> Form:
    """``factor·form``."""
    result = {}
    for leaf, coefficient in form.items():
        product = coefficient * factor
        if not product.is_zero:
            result[leaf] = product
    return result


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_PASS_THROUGH = {"Identity", "Cast", "CastLike"}

LINEAR_OPS = frozenset(_PASS_THROUGH | {"Neg", "Add", "Sub", "Sum", "Mul", "Div"})
"""Default-domain ops :meth:`Normaliser.form` reads as linear in an operand (``Mul``/``Div`` by a one-element
factor); a node of any other op is a leaf of the forms that read it."""
_SCALAR_SHAPE_OPS = {"Reshape", "Unsqueeze", "Squeeze", "Expand", "Flatten"}
_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
}


class Normaliser:
    """Computes and memoises :data:`Form` s of tensors and :class:`Poly` s of scalars of one graph.

    Only nodes of the default domain are looked through. Every value met while expanding is recorded in
    :attr:`visited_nodes` per root, so callers know the cone a form was read from.
    """

    def __init__(self, index: GraphIndex, *, opaque: frozenset[str] = frozenset()) -> None:
        """``opaque``: values read as leaves although their nodes are elementwise (the outputs of updates
        already fused, which the rewrite gives to an ``ai.sgdfuse`` node: :func:`sgdfuse.passes.sgd_match.find_updates`
        solves the updates reading them this way)."""
        self.index = index
        self.opaque = opaque
        self._forms: dict[str, Form] = {}
        self._scalars: dict[str, Poly | None] = {}
        self._plans: dict[str, tuple[str, list[tuple[str, Poly]]] | None] = {}
        self._cones: dict[str, tuple[set[int], set[str]]] = {}
        self.cancelled: dict[str, str] = {}
        self._gains: dict[str, tuple[float, float]] = {}
        """value → (gain, peak): the largest constant factor any term of it was scaled by on the way from its leaves (the
        product of the |constant factors| along the path, its maximum over the path): a term scaled up by S
        and back down overflows in the graph where the folded coefficient does not."""
        """Values whose form or scalar lost a leaf or a symbol that its operands had (``(x + z) - z``,
        ``0*z``, ``(x*s)/s``): value → what cancelled. Exact in real arithmetic, not in floating point (a
        large, infinite or zero ``z`` or ``s`` changes the number), so an update read through one is refused."""

    def _node(self, value: str) -> onnx.NodeProto | None:
        """The node computing ``value``, None for a graph input, an initializer or an :attr:`opaque` value (read
        as the output of a node of another domain: a leaf, and a scalar symbol when it has one element)."""
        return None if value in self.opaque else self.index.node(value)

    # -- scalars -------------------------------------------------------------------------------------
    def scalar(self, value: str) -> Poly | None:
        """The polynomial of ``value`` if every element of it provably equals one scalar; else None.

        Constants give numbers; runtime values proven to hold one element give symbols (their own name);
        arithmetic and shape ops over scalars are folded.
        """
        if value in self._scalars:
            return self._scalars[value]
        # Iterative post-order over the operands _scalar reads, so that _scalar finds them memoised: a chain
        # of thousands of elementwise ops does not hit Python's recursion limit.
        stack = [value]
        expanded: set[str] = set()
        while stack:
            current = stack[-1]
            if current in self._scalars:
                stack.pop()
                continue
            if current not in expanded:
                expanded.add(current)
                missing = [i for i in self._scalar_operands(current) if not self._scalar_ready(i) and i not in expanded]
                if missing:
                    stack.extend(missing)
                    continue
            stack.pop()
            self._scalars[current] = None  # cycle guard (graphs are acyclic, but be safe)
            self._scalars[current] = self._scalar(current)
        return self._scalars[value]

    def _scalar_ready(self, value: str) -> bool:
        """True when :meth:`scalar` answers ``value`` without walking (memoised here)."""
        return value in self._scalars

    def _scalar_operands(self, value: str) -> list[str]:
        """The values :meth:`_scalar` asks :meth:`scalar` about for ``value`` (the same cases, in order)."""
        node = self._node(value)
        if node is None or node.domain not in ("", "ai.onnx") or self.index.constant(value) is not None:
            return []
        inputs = [i for i in node.input]
        if node.op_type in _PASS_THROUGH or node.op_type in _SCALAR_SHAPE_OPS or node.op_type in ("Gather", "Neg", "Reciprocal"):
            return [inputs[0]] if inputs and inputs[0] else []
        if node.op_type in ("Add", "Sub", "Mul", "Div") and len(inputs) == 2:
            return [i for i in inputs if i]
        return []

    def _scalar(self, value: str) -> Poly | None:
        constant = self.index.constant(value)
        if constant is not None:
            if constant.size == 0 or (constant.dtype.kind not in "fiu" and constant.dtype != _BFLOAT16):
                return None
            flat = constant.astype(np.float64).reshape(-1)
            if not np.all(flat == flat[0]):
                return None
            if not math.isfinite(flat[0]):
                return None
            return Poly.const(float(flat[0]))
        node = self._node(value)
        if node is None or node.domain not in ("", "ai.onnx"):
            return self._symbol(value)
        op, inputs = node.op_type, [i for i in node.input]
        if op in ("Cast", "CastLike"):
            return self._cast_scalar(value, node)
        if op in _PASS_THROUGH or op in _SCALAR_SHAPE_OPS:
            inner = self.scalar(inputs[0]) if inputs and inputs[0] else None
            return inner if inner is not None else self._symbol(value)
        if op == "Gather":
            # Every element of a uniform tensor is the same scalar, whichever indices are gathered.
            inner = self.scalar(inputs[0])
            return inner if inner is not None else self._symbol(value)
        if op == "ConstantOfShape":
            for attribute in node.attribute:
                if attribute.name == "value":
                    if attribute.t.data_location == onnx.TensorProto.EXTERNAL:
                        return None  # not read here: external data only through sgdfuse.external_data
                    array = tensor_to_array(attribute.t).astype(np.float64).reshape(-1)
                    return Poly.const(float(array[0])) if array.size else None
            return Poly.const(0.0)
        if op in ("Add", "Sub", "Mul", "Div") and len(inputs) == 2:
            a, b = self.scalar(inputs[0]), self.scalar(inputs[1])
            if a is not None and b is not None:
                result = None
                if op == "Add":
                    result = a + b
                elif op == "Sub":
                    result = a - b
                elif op == "Mul":
                    result = a * b
                elif b.inverse() is not None:
                    result = a * b.inverse()
                if result is not None:
                    self._note_lost_symbols(value, (a, b), result)
                    return result
            return self._symbol(value)
        if op == "Neg":
            inner = self.scalar(inputs[0])
            return -inner if inner is not None else self._symbol(value)
        if op == "Reciprocal":
            inner = self.scalar(inputs[0])
            inverse = inner.inverse() if inner is not None else None
            return inverse if inverse is not None else self._symbol(value)
        return self._symbol(value)

    def _cast_scalar(self, value: str, node: onnx.NodeProto) -> Poly | None:
        """A ``Cast``/``CastLike`` of a scalar. A cast is a copy only when it cannot change the value: a
        constant is rounded to the target type (``Cast(Cast(0.27, INT64), FLOAT)`` is 0, and a FLOAT 0.1 cast
        to FLOAT16 is 0.0999755859375); a runtime scalar keeps its symbol only through a widening float cast,
        otherwise the cast's output is a symbol of its own."""
        source = node.input[0] if node.input else ""
        if not source:
            return None
        target = self.index.spec(value).dtype or _cast_target(node, self.index)
        inner = self.scalar(source)
        if inner is None:
            return self._symbol(value)
        if inner.is_constant:
            rounded = _round_to(inner.constant_value, target)
            return None if rounded is None else Poly.const(rounded)
        if _widens(self.index.spec(source).dtype, target):
            return inner
        return self._symbol(value)

    def _note_lost_symbols(self, value: str, operands: Iterable[Poly], result: Poly) -> None:
        before = {s for poly in operands for monomial in poly.terms for s, _ in monomial}
        after = {s for monomial in result.terms for s, _ in monomial}
        lost = before - after
        if lost:
            self.cancelled[value] = f"the runtime value{'s' if len(lost) > 1 else ''} {', '.join(sorted(lost))} cancel{'' if len(lost) > 1 else 's'} out"

    def _symbol(self, value: str) -> Poly | None:
        spec = self.index.spec(value)
        if spec.num_elements() == 1 and spec.dtype in _FLOAT_TYPES:
            return Poly.symbol(value)
        return None

    # -- tensors -------------------------------------------------------------------------------------
    def form(self, value: str) -> Form:
        """The linear form of ``value`` over its leaves (``{value: 1}`` when it is a leaf itself).

        Raises:
            GraphCycleError: ``value`` depends on a cycle of nodes (no valid ONNX graph has one).
        """
        cached = self._forms.get(value)
        if cached is not None:
            return cached
        # Iterative post-order so that long chains do not hit Python's recursion limit. A value met again with
        # operands still unformed after they were all pushed is on a cycle (each push would repeat forever).
        stack = [value]
        entered: set[str] = set()
        while stack:
            current = stack[-1]
            if current in self._forms:
                stack.pop()
                continue
            missing = [i for i in self._operands(current) if i not in self._forms]
            if missing:
                if current in entered:
                    raise GraphCycleError(current)
                entered.add(current)
                stack.extend(missing)
                continue
            stack.pop()
            self._forms[current] = self._form_from_operands(current)
        return self._forms[value]

    def is_leaf(self, value: str) -> bool:
        """True when the form of ``value`` is ``value`` itself (an input, a constant, a non-linear result)."""
        return self._plan(value) is None

    def _operands(self, value: str) -> list[str]:
        """Tensor operands the form of ``value`` is built from (empty for a leaf)."""
        plan = self._plan(value)
        return [] if plan is None else [name for name, _ in plan[1]]

    def _plan(self, value: str) -> tuple[str, list[tuple[str, Poly]]] | None:
        """How ``value`` combines its operands: ``("sum", [(operand, factor), ...])``; None for a leaf.
        Memoised: forms, cones and operand lists all ask."""
        try:
            return self._plans[value]
        except KeyError:
            plan = self._plans[value] = self._make_plan(value)
            return plan

    def _make_plan(self, value: str) -> tuple[str, list[tuple[str, Poly]]] | None:
        node = self._node(value)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        spec = self.index.spec(value)
        if spec.dtype not in _FLOAT_TYPES:
            return None
        op, inputs = node.op_type, list(node.input)
        one = Poly.const(1.0)
        if op in _PASS_THROUGH:
            if not inputs or self.index.spec(inputs[0]).dtype not in _FLOAT_TYPES:
                return None
            return ("sum", [(inputs[0], one)])
        if op == "Neg":
            return ("sum", [(inputs[0], Poly.const(-1.0))])
        if op in ("Add", "Sub") and len(inputs) == 2:
            sign = Poly.const(1.0 if op == "Add" else -1.0)
            return ("sum", [(inputs[0], one), (inputs[1], sign)])
        if op == "Sum":
            return ("sum", [(i, one) for i in inputs if i])
        if op == "Mul" and len(inputs) == 2:
            a, b = self.scalar(inputs[0]), self.scalar(inputs[1])
            if a is not None and b is not None and spec.num_elements() == 1:
                # Two one-element values: a tensor of one element (a bias of shape [1]) times a constant
                # coefficient is still a tensor term; two runtime scalars are a product, not linear.
                if a.is_constant != b.is_constant:
                    a, b = (a, None) if a.is_constant else (None, b)
            if a is not None and b is None:
                return ("sum", [(inputs[1], a)]) if self._stays_within(inputs[0], inputs[1]) else None
            if b is not None and a is None:
                return ("sum", [(inputs[0], b)]) if self._stays_within(inputs[1], inputs[0]) else None
            return None  # a product of two tensors (or of two scalars, which a caller reads as a scalar)
        if op == "Div" and len(inputs) == 2:
            numerator = self.scalar(inputs[0])
            if numerator is not None and (spec.num_elements() != 1 or numerator.is_constant):
                return None  # a number divided by a tensor is not linear in it
            b = self.scalar(inputs[1])
            inverse = b.inverse() if b is not None else None
            if inverse is None or not self._stays_within(inputs[1], inputs[0]):
                return None
            return ("sum", [(inputs[0], inverse)])
        return None

    def _stays_within(self, scalar: str, value: str) -> bool:
        """True when ``scalar`` (one number repeated) provably broadcasts into the shape of the tensor ``value``
        it combines with, without enlarging it. A uniform constant of shape [2, 1] against [N, 4] gives [2, 4] when N is 1: it is no
        scalar factor there. Each of the scalar's dimensions must be 1 or equal ``value``'s; with ``value``'s
        rank unknown, only a scalar of rank 0 or shape [1] is safe."""
        shape = self.index.spec(scalar).shape
        if shape is None:
            constant = self.index.constant(scalar)
            if constant is None:
                return False
            shape = constant.shape
        if all(d == 1 for d in shape) and len(shape) <= 1:
            return True
        target = self.index.spec(value).shape
        if target is None or len(shape) > len(target):
            return False
        return all(d == 1 or d == t for d, t in zip(reversed(shape), reversed(target)))

    def _form_from_operands(self, value: str) -> Form:
        plan = self._plan(value)
        if plan is None:
            return {value: Poly.const(1.0)}
        result: Form = {}
        leaves: set[str] = set()
        symbols: set[str] = set()
        gain = 0.0
        peak = 0.0
        for operand, factor in plan[1]:
            scale = abs(factor.constant_value) if factor.is_constant else 1.0
            operand_gain, operand_peak = self._gains.get(operand, (1.0, 1.0))
            gain = max(gain, operand_gain * scale)
            peak = max(peak, operand_peak, operand_gain * scale)
            operand_scalar = self.scalar(operand) if self.index.spec(operand).num_elements() == 1 else None
            if operand_scalar is not None and self.index.spec(value).num_elements() != 1:
                # A scalar added to a tensor: a constant (or runtime-scalar) term on the ONE leaf.
                others = [name for name, _ in plan[1] if name != operand]
                if not all(self._stays_within(operand, other) for other in others):
                    return {value: Poly.const(1.0)}
                term: Form = {ONE: operand_scalar}
            else:
                term = self._forms[operand]
            leaves.update(term)
            symbols.update(_symbols_of(term.values()))
            symbols.update(_symbols_of([factor]))
            result = add_forms(result, term, factor)
        self._gains[value] = (gain, peak)
        lost_leaves = sorted(leaf for leaf in leaves - set(result))
        lost_symbols = sorted(symbols - _symbols_of(result.values()))
        if lost_leaves or lost_symbols:
            what = [("the constant term" if leaf == ONE else leaf) for leaf in lost_leaves] + lost_symbols
            self.cancelled[value] = f"{', '.join(what)} cancel{'s' if len(what) == 1 else ''} out"
        if len(result) > MAX_LEAVES:
            return {value: Poly.const(1.0)}
        return result

    def cancellations(self, value: str) -> dict[str, str]:
        """The values in ``value``'s cone (tensor and scalar nodes) whose terms cancel (:attr:`cancelled`), and
        ``value`` itself when a term was scaled up by more than :data:`SCALE_UP_LIMIT` times its final
        coefficient on the way (``(buf*1e30)*0.9/1e30``: the graph overflows at ``|buf| > max/1e30``, the
        folded ``0.9*buf`` does not)."""
        nodes, values = self.cone(value)
        found = {name: self.cancelled[name] for name in values if name in self.cancelled}
        _, peak = self._gains.get(value, (1.0, 1.0))
        final = max((abs(c.constant_value) for c in self.form(value).values() if c.is_constant), default=1.0)
        if peak > SCALE_UP_LIMIT * max(1.0, final):
            found[value] = f"a term is scaled up by {peak:g} and back down to at most {max(1.0, final):g}"
        for k in nodes:
            for name in self.index.graph.node[k].output:
                if name in self.cancelled:
                    found[name] = self.cancelled[name]
        return found

    # -- selections ----------------------------------------------------------------------------------
    def where_branches(self, value: str) -> tuple[str, str, str] | None:
        """``(condition, if_true, if_false)``, the inputs of ``value``'s node, when ``value`` is a ``Where``
        whose condition is one boolean (a step-counter test, say) or a broadcast of one (``Expand``,
        ``Reshape``, ``Unsqueeze``, ``Not``: :func:`boolean_root`), and whose branches are float tensors of the
        value's dtype; else None. The condition is the ``Where``'s own input (what a rewrite or a verification
        slice reads), not its root.

        Such a selection is linear within each branch, which is how a first-step rule is matched.
        """
        node = self._node(value)
        if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
            return None
        condition, if_true, if_false = node.input
        if boolean_root(self.index, condition) is None:
            return None
        dtype = self.index.spec(value).dtype
        if self.index.spec(if_true).dtype != dtype or self.index.spec(if_false).dtype != dtype:
            return None
        return condition, if_true, if_false

    def if_branches(self, value: str) -> tuple[str, Form, Form, list[str]] | None:
        """``(condition, then_form, else_form, outer_reads)`` when ``value`` is the one output of an ``If`` on
        one boolean whose branches compute it elementwise from outer values; else None. The branch forms are
        over the outer graph's leaves (through :class:`_BranchNormaliser`)."""
        node = self._node(value)
        if node is None or node.op_type != "If" or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            return None
        spec = self.index.spec(node.input[0])
        if spec.dtype != onnx.TensorProto.BOOL or spec.num_elements() != 1:
            return None
        branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        if set(branches) != {"then_branch", "else_branch"}:
            return None
        forms = []
        for key in ("then_branch", "else_branch"):
            graph = branches[key]
            if len(graph.output) != 1 or graph.input:
                return None
            forms.append(_BranchNormaliser(self, graph).form(graph.output[0].name))
        from sgdfuse.passes.index import _outer_reads

        reads = sorted(_outer_reads(branches["then_branch"]) | _outer_reads(branches["else_branch"]))
        return node.input[0], forms[0], forms[1], reads

    # -- cones ---------------------------------------------------------------------------------------
    def cone(self, value: str) -> tuple[set[int], set[str]]:
        """Node indices and value names the form of ``value`` was read through (leaves excluded from the
        nodes, included in the values), plus the nodes that compute scalar coefficients. A ``Where`` on
        one boolean (see :meth:`where_branches`) is entered: both branches belong to the cone, the
        condition does not."""
        cached = self._cones.get(value)
        if cached is not None:
            return cached
        nodes: set[int] = set()
        values: set[str] = set()
        stack = [value]
        while stack:
            current = stack.pop()
            if current in values:
                continue
            values.add(current)
            plan = self._plan(current)
            if plan is None:
                branches = self.where_branches(current)
                if branches is not None:
                    nodes.add(self.index.producer[current])
                    stack.extend(branches[1:])
                else:
                    selected = self.if_branches(current)
                    if selected is not None:
                        nodes.add(self.index.producer[current])
                        stack.extend(name for name in selected[3] if name != selected[0])
                continue
            node_index = self.index.producer[current]
            nodes.add(node_index)
            node = self.index.graph.node[node_index]
            for name in node.input:
                if not name:
                    continue
                if name in {operand for operand, _ in plan[1]}:
                    stack.append(name)
                else:
                    nodes.update(self.scalar_cone(name))
        self._cones[value] = (nodes, values)
        return nodes, values

    def scalar_cone(self, value: str) -> set[int]:
        """Node indices that compute the scalar ``value`` (foldable ops only; symbols are not entered)."""
        nodes: set[int] = set()
        stack = [value]
        seen: set[str] = set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            node_index = self.index.producer.get(current)
            if node_index is None:
                continue
            poly = self.scalar(current)
            if poly is None or poly == Poly.symbol(current):
                continue
            nodes.add(node_index)
            stack.extend(i for i in self.index.graph.node[node_index].input if i)
        return nodes


class _BranchNormaliser(Normaliser):
    """Forms inside one ``If`` branch: the branch's own nodes are looked through; every outer value (read from
    the enclosing graph) takes its form and scalar value from the outer normaliser."""

    def __init__(self, outer: Normaliser, graph: onnx.GraphProto) -> None:
        from sgdfuse.passes.index import GraphIndex

        producer = {name: k for k, node in enumerate(graph.node) for name in node.output if name}
        index = GraphIndex(
            graph=graph,
            producer=producer,
            consumers={},
            initializers={**outer.index.initializers, **{t.name: t for t in graph.initializer}},
            graph_inputs=[],
            graph_outputs=[o.name for o in graph.output],
            specs=outer.index.specs,
            subgraph_reads=set(),
        )
        super().__init__(index)
        self.outer = outer

    def _is_outer(self, value: str) -> bool:
        return value not in self.index.producer and value not in {t.name for t in self.index.graph.initializer}

    def scalar(self, value: str) -> Poly | None:
        return self.outer.scalar(value) if self._is_outer(value) else super().scalar(value)

    def _scalar_ready(self, value: str) -> bool:
        return self._is_outer(value) or super()._scalar_ready(value)

    def _form_from_operands(self, value: str) -> Form:
        return self.outer.form(value) if self._is_outer(value) else super()._form_from_operands(value)


_BOOLEAN_COPIES = frozenset({"Identity", "Not", "Expand", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast", "CastLike"})
"""Ops through which :func:`boolean_root` follows a boolean: copies, broadcasts and reshapes keep every
element's value the one of the value they read; ``Not`` negates it."""


def boolean_root(index: GraphIndex, condition: str) -> tuple[str, bool] | None:
    """``(root, negated)`` when the BOOL value ``condition`` holds one boolean ``root`` of one element in every
    element, negated when ``negated``: ``condition`` is ``root`` itself, or ``root`` through ``Identity``,
    ``Not``, ``Expand``/``Reshape``/``Unsqueeze``/``Squeeze``/``Flatten`` and BOOL-to-BOOL ``Cast``/``CastLike``
    (a loss scaler's ``Not(found_inf)``, JAX's ``jnp.where`` broadcasting its scalar predicate). None when
    ``condition`` is not BOOL or its root has several elements (a per-element mask) or an unknown shape.

    The root is the value nearest ``condition`` that has one element, so that two conditions written apart
    (``Not(found_inf)`` once per parameter) compare equal by their roots."""
    if index.spec(condition).dtype != onnx.TensorProto.BOOL:
        return None
    negated, value, seen = False, condition, {condition}
    while index.spec(value).num_elements() != 1:
        node = index.node(value)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _BOOLEAN_COPIES or not node.input:
            return None
        source = node.input[0]
        if index.spec(source).dtype != onnx.TensorProto.BOOL or source in seen:
            return None
        negated ^= node.op_type == "Not"
        value = source
        seen.add(value)
    # One element: follow the negations and copies of one element too, so that Not(c) and c are one guard.
    while True:
        node = index.node(value)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _BOOLEAN_COPIES or not node.input:
            break
        source = node.input[0]
        spec = index.spec(source)
        if spec.dtype != onnx.TensorProto.BOOL or spec.num_elements() != 1 or source in seen:
            break
        negated ^= node.op_type == "Not"
        value = source
        seen.add(value)
    return value, negated


def _symbols_of(polys: Iterable[Poly]) -> set[str]:
    return {s for poly in polys for monomial in poly.terms for s, _ in monomial}


_FLOAT_BITS = {onnx.TensorProto.FLOAT16: 11, onnx.TensorProto.BFLOAT16: 8, onnx.TensorProto.FLOAT: 24, onnx.TensorProto.DOUBLE: 53}


def _widens(source: int, target: int) -> bool:
    """True when every value of float dtype ``source`` is exact in ``target`` (FLOAT16 → FLOAT, say)."""
    if source == target:
        return True
    if source not in _FLOAT_BITS or target not in _FLOAT_BITS:
        return False
    if {source, target} == {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}:
        return False
    return _FLOAT_BITS[target] > _FLOAT_BITS[source]


def _cast_target(node: onnx.NodeProto, index: GraphIndex) -> int:
    if node.op_type == "CastLike":
        return index.spec(node.input[1]).dtype if len(node.input) > 1 else 0
    for attribute in node.attribute:
        if attribute.name == "to":
            return attribute.i
    return 0


def _round_to(value: float, dtype: int) -> float | None:
    """``value`` as ONNX ``Cast`` stores it in ``dtype`` (round to nearest even for floats, truncation for
    integers, != 0 for BOOL); None for an unknown or non-numeric dtype."""
    if not dtype:
        return None
    if dtype == onnx.TensorProto.BOOL:
        return float(value != 0)
    try:
        np_dtype = _BFLOAT16 if dtype == onnx.TensorProto.BFLOAT16 else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return None
    if np_dtype.kind not in "fiu" and np_dtype != _BFLOAT16:
        return None
    with np.errstate(all="ignore"):
        rounded = float(np.array(value, dtype=np.float64).astype(np_dtype).astype(np.float64))
    return rounded if math.isfinite(rounded) else None


def format_poly(poly: Poly, precision: int = 6) -> str:
    """Human form of a polynomial: ``0.01``, ``lr``, ``-0.9*lr``, ``lr/m``."""
    terms = poly.terms
    if not terms:
        return "0"
    if len(terms) == 1 and () in terms:
        # A constant, the usual coefficient: its number alone (what the general case below writes for it, as
        # a number has no "+ -" to replace).
        return f"{terms[()]:.{precision}g}"
    parts = []
    for monomial, value in sorted(poly.terms.items()):
        symbols = "*".join(s if p == 1 else f"{s}^{p}" for s, p in monomial if p > 0)
        divisors = "*".join(s if p == -1 else f"{s}^{-p}" for s, p in monomial if p < 0)
        number = f"{value:.{precision}g}"
        if symbols:
            text = symbols if value == 1 else ("-" + symbols if value == -1 else f"{number}*{symbols}")
        else:
            text = number
        if divisors:
            text += "/" + (divisors if "*" not in divisors else f"({divisors})")
        parts.append(text)
    text = " + ".join(parts).replace("+ -", "- ")
    return text if len(parts) == 1 else f"({text})"


def format_form(form: Form, order: Iterable[str] = ()) -> str:
    """Human form of a linear form, e.g. ``p - 0.01*buf_new - 0.0001*p``; leaves listed in ``order``
    first, then the rest by name."""
    order = [leaf for leaf in order if leaf in form]
    leaves = order + sorted(leaf for leaf in form if leaf not in order)
    parts = []
    for leaf in leaves:
        coefficient = form[leaf]
        name = leaf if leaf != ONE else "1"
        terms = coefficient.terms  # a constant has no term (zero) or the one term ()
        value = (terms[()] if () in terms else None) if len(terms) == 1 else (None if terms else 0.0)
        if value == 1:
            parts.append(f"+ {name}")
        elif value == -1:
            parts.append(f"- {name}")
        else:
            text = format_poly(coefficient)
            if text.startswith("-") and not text.startswith("(-") and " " not in text:
                parts.append(f"- {text[1:]}*{name}")
            else:
                parts.append(f"+ {text}*{name}")
    if not parts:
        return "0"
    text = " ".join(parts)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]
