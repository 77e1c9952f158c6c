"""The matcher's name evidence (ROLE_EVIDENCE "names" and "conventions") is read through cheap pre-tests
before any regex or suffix loop; the pre-tests must never change an answer, for any name, ASCII or not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgdfuse.passes.sgd_match import (
    _BUFFER_NAME, _DIGITS_AS_ZERO, _GRADIENT_NAME, _STATE_PREFIXES, _STATE_SUFFIXES, _convention_flags, _conventions_of, previous_by_name,
)

# Pieces of real names, and the characters an ignore-case match reads as ASCII letters (long s, dotless i,
# Kelvin sign, dotted capital I).
_PIECES = [
    "momentum", "moments", "Moment", "velocity", "veloc", "buf", "BUFFER", "bufs", "accum", "accumulator", "slot",
    "ſlot", "trace", "mom", "grad", "grads", "gradient", "gradıent", "g", "G", "dw", "dp", "weight", "fc0", "p", "out",
    "new", "next", ".", "_", "-", "/", "0", "7", "ı", "ſ", "K", "İ", "x", "lots", "gg",
]
_NAMES = st.lists(st.sampled_from(_PIECES), max_size=5).map("".join) | st.text(max_size=12)


def _regex_flags(name: str) -> tuple[bool, bool]:
    return _BUFFER_NAME.search(name) is not None, _GRADIENT_NAME.search(name) is not None


def _previous_reference(output: str, inputs: set[str]) -> str | None:
    """The rule of ``previous_by_name`` as its docstring states it: suffixes first, then prefixes."""
    for suffix in _STATE_SUFFIXES:
        if output.endswith(suffix) and output[: -len(suffix)] in inputs:
            return output[: -len(suffix)]
    for prefix in _STATE_PREFIXES:
        if output.startswith(prefix) and output[len(prefix):] in inputs:
            return output[len(prefix):]
    return None


@settings(max_examples=300, deadline=None)
@given(_NAMES)
def test_convention_flags_agree_with_the_patterns(name):
    assert _convention_flags(name) == _regex_flags(name)


@settings(max_examples=300, deadline=None)
@given(st.lists(_NAMES, max_size=6))
def test_conventions_asked_once_per_digit_form_agree_with_the_patterns(names):
    # The patterns read a digit only as a character that is no letter, so a name and its digits made 0
    # match them alike; the class keys ask each such form once.
    assert [_regex_flags(name.translate(_DIGITS_AS_ZERO)) for name in names] == [_regex_flags(name) for name in names]
    known: dict = {}
    assert _conventions_of(names, known) == [_regex_flags(name) for name in names]
    assert _conventions_of(names[::-1], known) == [_regex_flags(name) for name in names[::-1]]


def test_conventions_of_numbered_names_fall_on_few_forms():
    known: dict = {}
    names = [f"{stem}{k}" for k in range(100) for stem in ("grad_p", "buf_p", "nmul_", "state.mom")]
    assert _conventions_of(names, known) == [_regex_flags(name) for name in names]
    assert len(known) == 8  # one form per stem and number of digits


def test_convention_flags_on_names_an_ignore_case_match_reads_through_unicode():
    for name in ("ſlot", "fc.ſlot", "gradıent_0", "KELVIN_buf", "momentum_buffer", "w.grad", "dw1", "weight", "lots"):
        assert _convention_flags(name) == _regex_flags(name)
    assert _convention_flags("ſlot") == (True, False)  # the long s is an s to the pattern
    assert _convention_flags("weight") == (False, False)


@settings(max_examples=200, deadline=None)
@given(_NAMES, st.sets(_NAMES, max_size=4))
def test_previous_by_name_follows_its_rule(output, inputs):
    inputs = inputs | {output[:-4], output[4:], output[:-5], output[5:]}
    assert previous_by_name(output, inputs) == _previous_reference(output, inputs)
