"""The report's equation text (sgdfuse.passes.linear.format_form, format_poly) is the one it has always been.

``format_poly`` writes a constant coefficient without going through the general case, and ``format_form``
reads a coefficient's constant value once: the reference here is the general formulation, the definition
both functions had (``_reference_poly``, ``_reference_form``), on random polynomials and forms.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgdfuse.passes.linear import ONE, Poly, format_form, format_poly


def _reference_poly(poly: Poly, precision: int = 6) -> str:
    if poly.is_zero:
        return "0"
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


def _reference_form(form: dict, order=()) -> str:
    order = [leaf for leaf in order if leaf in form]
    leaves = order + sorted(leaf for leaf in form if leaf not in order)
    parts = []
    for leaf in leaves:
        coefficient = form[leaf]
        name = leaf if leaf != ONE else "1"
        if coefficient.is_constant and coefficient.constant_value == 1:
            parts.append(f"+ {name}")
        elif coefficient.is_constant and coefficient.constant_value == -1:
            parts.append(f"- {name}")
        else:
            text = _reference_poly(coefficient)
            if text.startswith("-") and not text.startswith("(-") and " " not in text:
                parts.append(f"- {text[1:]}*{name}")
            else:
                parts.append(f"+ {text}*{name}")
    if not parts:
        return "0"
    text = " ".join(parts)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([1.0, -1.0, 0.5, -0.9, 1e-7, 1e21, -1e6, 0.1, 1.0000001]),
)
_symbols = st.sampled_from(["lr", "m", "d", "a b", "x"])
_monomials = st.lists(st.tuples(_symbols, st.sampled_from([1, -1, 2, -2, 3])), max_size=3, unique_by=lambda t: t[0]).map(
    lambda m: tuple(sorted(m))
)
_polys = st.dictionaries(_monomials, _values.filter(lambda v: v != 0), max_size=3).map(Poly)
_forms = st.dictionaries(st.sampled_from(["p", "buf", "g", ONE, "v_out", "z"]), _polys, max_size=5)


@settings(max_examples=500, deadline=None)
@given(_polys, st.sampled_from([6, 3, 12]))
def test_a_polynomial_reads_as_the_general_formulation_writes_it(poly, precision):
    assert format_poly(poly, precision) == _reference_poly(poly, precision)


@settings(max_examples=500, deadline=None)
@given(_forms, st.lists(st.sampled_from(["p", "buf", "g", "v_out", "w"]), max_size=3))
def test_a_form_reads_as_the_general_formulation_writes_it(form, order):
    assert format_form(form, order) == _reference_form(form, order)


def test_constants_and_their_signs():
    assert format_poly(Poly.const(0.1)) == "0.1"
    assert format_poly(Poly.const(0.0)) == "0"
    assert format_form({"p": Poly.const(1.0), "buf": Poly.const(-0.01), ONE: Poly.const(-1.0)}, ["p", "buf"]) == "p - 0.01*buf - 1"
    assert format_form({"p": Poly({(): 0.0})}) == _reference_form({"p": Poly({(): 0.0})})
