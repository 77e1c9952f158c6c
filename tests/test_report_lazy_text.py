"""A fused entry's equations may be handed over unwritten (the matcher's lazy text): every reader of the
record (attribute, ``dataclasses.asdict``, JSON, equality, ``repr``) sees the text as a ``str``, written once."""

from __future__ import annotations

import dataclasses
import json

from sgdfuse.report import FusedUpdate, Report


class _Counted:
    """Text that counts how often it is written."""

    def __init__(self, text: str) -> None:
        self.text, self.written = text, 0

    def __str__(self) -> str:
        self.written += 1
        return self.text


def _entry(parameter_equation, accum_equation) -> FusedUpdate:
    return FusedUpdate(
        node="sgd_0", parameters="p", gradient="g", accum="buf", parameters_out="p_out", accum_out="buf_out",
        learning_rate=0.1, momentum=0.9, learning_rate_input="lr", momentum_input="m", dampening=0.0,
        weight_decay=0.0, nesterov=False, maximize=False, stat="0", dtype="FLOAT", shape=[4],
        parameter_equation=parameter_equation, accum_equation=accum_equation,
    )


def test_unwritten_equations_read_as_their_text_and_are_written_once():
    parameter, accum = _Counted("p_out = p - 0.1*buf_out"), _Counted("buf_out = 0.9*buf + g")
    entry = _entry(parameter, accum)
    assert parameter.written == accum.written == 0  # nothing is written before it is read
    assert entry.parameter_equation == "p_out = p - 0.1*buf_out"
    assert type(entry.parameter_equation) is str
    as_dict = dataclasses.asdict(entry)
    assert as_dict["parameter_equation"] == "p_out = p - 0.1*buf_out" and as_dict["accum_equation"] == "buf_out = 0.9*buf + g"
    assert "parameter_equation='p_out = p - 0.1*buf_out'" in repr(entry)
    assert parameter.written == accum.written == 1


def test_an_entry_with_unwritten_equations_equals_and_serialises_as_one_given_strings():
    lazy = _entry(_Counted("p_out = p - 0.1*buf_out"), _Counted("buf_out = 0.9*buf + g"))
    plain = _entry("p_out = p - 0.1*buf_out", "buf_out = 0.9*buf + g")
    assert lazy == plain
    assert Report("m.onnx", fused=[lazy]).to_json() == Report("m.onnx", fused=[plain]).to_json()
    fused = json.loads(Report("m.onnx", fused=[lazy]).to_json())["fused"][0]
    assert fused["parameter_equation"] == "p_out = p - 0.1*buf_out"
    assert list(fused).index("parameter_equation") == list(fused).index("shape") + 1  # field order kept


def test_equations_stay_required_arguments():
    import pytest

    with pytest.raises(TypeError):
        FusedUpdate("n", "p", "g", "a", "po", "ao", 0.1, 0.9, "lr", "m", 0.0, 0.0, False, False, "0", "FLOAT", [])  # type: ignore[call-arg]


def test_an_entry_with_unwritten_equations_pickles_and_copies_as_its_text():
    import copy
    import pickle

    from sgdfuse.passes.sgd_match import LazyText

    forms = {"p": 1.0}
    entry = _entry(LazyText(lambda: f"p_out = {len(forms)}*p"), LazyText(lambda: "buf_out = g"))  # closures do not pickle
    again = pickle.loads(pickle.dumps(entry))
    assert again == _entry("p_out = 1*p", "buf_out = g")
    assert type(again.parameter_equation) is str
    assert copy.copy(entry).parameter_equation == "p_out = 1*p"
