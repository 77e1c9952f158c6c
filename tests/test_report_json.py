"""The JSON report is what ``json.dumps`` writes (sgdfuse.report.Report.to_json, to_dict).

``to_dict`` builds the fused and refused entries field by field, and ``to_json`` writes their lists itself,
every other part through ``json.dumps``: the independent tools here are ``dataclasses.asdict`` with the
report's rule for non-finite floats (``_reference_dict`` below, the definition ``to_dict`` had) and
``json.dumps`` with the report's settings. Both must give the same text, byte for byte, for entries holding
anything a dataclass field can: odd strings, non-finite and signed-zero floats, numpy scalars, tuples,
nested records, dicts with keys of any type, objects JSON cannot write.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sgdfuse
from sgdfuse import __version__
from sgdfuse.report import FusedUpdate, Refusal, Report

ROOT = Path(__file__).resolve().parent.parent


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _reference_dict(report: Report) -> dict:
    return _finite({
        "tool": {"name": "sgdfuse", "version": __version__, "report_format": 1},
        "fused": [dataclasses.asdict(f) for f in report.fused],
        "refused": [dataclasses.asdict(r) for r in report.refused],
        "verification": {**dataclasses.asdict(report.verification), "passed": report.verification.passed},
        "added_state": list(report.added_state),
        "model": {"source": report.source, "nodes_before": report.nodes_before, "nodes_after": report.nodes_after,
                  "already_fused": report.already_fused, "existing_sgd": list(report.existing_sgd),
                  "sorted_nodes": report.sorted_nodes},
        "memory_traffic": report.memory_traffic(),
    })


def _reference_json(report: Report, indent) -> str:
    return json.dumps(_reference_dict(report), indent=indent, sort_keys=False, default=str, allow_nan=False)


def _check(report: Report) -> None:
    assert report.to_dict() == _reference_dict(report)
    for indent in (2, 0, 4, "\t", None):
        assert report.to_json(indent) == _reference_json(report, indent)
    assert report.to_json() == _reference_json(report, 2)


@pytest.mark.parametrize("name", ["torch/mlp_train_step_dynamo.onnx", "torch/mlp_train_step_dynamo_noopt.onnx"])
def test_the_report_of_a_real_model_is_json_dumps_text(name):
    report = sgdfuse.optimize(ROOT / "testdata" / name, verify=True).report
    assert report.fused and report.verification.updates
    _check(report)


def test_an_empty_report_is_json_dumps_text():
    _check(Report("m.onnx"))


class _Opaque:
    def __str__(self) -> str:
        return "opaque \u00e9\n\"value\""

    def __repr__(self) -> str:
        return "_Opaque()"


@dataclasses.dataclass
class _Inner:
    x: float
    y: list


_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 1e300, 0.1, float("nan"), float("-inf")]),
)
_leaves = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["", "\"", "\\", "\n", "\x00", "\u2028", "😀", "名前", "\ud800"]),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    _floats,
)
_odd = st.one_of(
    _floats.map(np.float32),
    st.integers(-5, 5).map(np.int64),
    st.just(_Opaque()),
    st.builds(_Inner, _floats, st.lists(_leaves, max_size=2)),
    st.lists(st.lists(_leaves, max_size=2), max_size=2),
    st.dictionaries(st.one_of(st.integers(0, 3), st.booleans(), st.none(), _floats), _leaves, max_size=2),
)
_values = st.one_of(_leaves, _leaves, st.lists(_leaves, max_size=3), st.tuples(_leaves, _leaves),
                    st.dictionaries(st.text(max_size=4), _leaves, max_size=3), _odd)


def _fused(draw_values: dict) -> FusedUpdate:
    base = dict(
        node="n", parameters="p", gradient="g", accum="b", parameters_out="p_out", accum_out="b_out", learning_rate=0.1,
        momentum=0.9, learning_rate_input="lr", momentum_input="m", dampening=0.0, weight_decay=0.0, nesterov=False,
        maximize=False, stat="zeros", dtype="FLOAT", shape=[2, 3], parameter_equation="p_out = p - 0.1*b_out",
        accum_equation="b_out = 0.9*b + g",
    )
    base.update(draw_values)
    return FusedUpdate(**base)


_field_names = [f.name for f in dataclasses.fields(FusedUpdate)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.dictionaries(st.sampled_from(_field_names), _values, max_size=4), max_size=4),
    st.lists(st.tuples(_leaves, _leaves, _values), max_size=3),
)
def test_reports_holding_any_field_values_are_json_dumps_text(fused, refused):
    report = Report("m.onnx", fused=[_fused(values) for values in fused],
                    refused=[Refusal(str(a), str(b), "detail", c) for a, b, c in refused])
    try:
        expected = _reference_json(report, 2)
    except (TypeError, ValueError, UnicodeEncodeError) as error:
        with pytest.raises(type(error)):
            report.to_json()
        return
    # (Compared as text: asdict deep-copies an object, and NaN in a numpy scalar equals nothing.)
    assert json.dumps(report.to_dict(), default=repr) == json.dumps(_reference_dict(report), default=repr)
    assert report.to_json() == expected
    assert report.to_json("  ") == _reference_json(report, "  ")
