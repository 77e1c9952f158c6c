"""A wrong hyper-parameter fails in BFLOAT16 too: ``check`` and ``optimize``'s verification hold the learning
rate and momentum of a fused update on BFLOAT16 state to one rounding of BFLOAT16, not four.

PyTorch's BFLOAT16 exports (testdata/torch_bf16) store their momentum and learning rate as BFLOAT16
constants, so a correct fused op applies exactly those values; any other BFLOAT16 value is at least one
ulp off, and one ulp is more than one rounding (``ulp(c) > 2^-8 * |c|`` for every BFLOAT16 ``c``). A fused
momentum three ulps off (0.91015625 for PyTorch's 0.8984375) passed both before: the coefficient tolerance
was four roundings of the parameters' dtype, 1.6 % in BFLOAT16. The expected outcome comes from the models:
a different constant is a different update.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import sgdfuse
import sgdfuse.api as api
from sgdfuse.passes.rewrite import Planner
from sgdfuse.verify import check_models

DATA = Path(__file__).resolve().parent.parent / "testdata" / "torch_bf16"
FUSING = ["sgd_momentum_dynamo.onnx", "sgd_nesterov_legacy.onnx", "sgd_wd_dynamo.onnx", "sgd_dampening_dynamo.onnx"]
PREFIX = {"momentum": "sgdfuse/momentum", "learning_rate": "sgdfuse/learning_rate"}


@functools.lru_cache(maxsize=None)
def _fused(file: str) -> onnx.ModelProto:
    return sgdfuse.optimize(DATA / file).model


def _ulps_off(tensor: onnx.TensorProto, ulps: int) -> onnx.TensorProto:
    """``tensor`` (BFLOAT16, positive) moved ``ulps`` representable values up: its bits plus ``ulps``."""
    array = numpy_helper.to_array(tensor)
    assert array.dtype.name == "bfloat16" and (array.astype(np.float64) > 0).all()
    moved = (array.view(np.uint16) + np.uint16(ulps)).view(array.dtype)
    return numpy_helper.from_array(moved, tensor.name)


def _with(model: onnx.ModelProto, what: str, ulps: int) -> onnx.ModelProto:
    wrong = onnx.ModelProto()
    wrong.CopyFrom(model)
    changed = 0
    for tensor in wrong.graph.initializer:
        if tensor.name.startswith(PREFIX[what]):
            tensor.CopyFrom(_ulps_off(tensor, ulps))
            changed += 1
    assert changed, f"the fused model has no {what} initializer"
    return wrong


@pytest.mark.parametrize("file", FUSING)
def test_check_passes_the_fused_bfloat16_export(file):
    # The control: the same models, unchanged, agree.
    assert check_models(onnx.load(DATA / file), _fused(file), steps=3).passed


# Nesterov's new weights read lr·(g + m·buf_new), so a learning-rate error shares that output's bound with the
# momentum's own allowance there (ε_m·|lr·m·T_v|); its learning rate is told apart from 2 ulps on (at the first
# step, lr·ε·(|g| + 2m·|g|) against Δlr·(1 + m)·|g|: 1.44 roundings at m = 0.8, and one ulp of 0.1 is 1.25).
CASES = [(f, what, ulps) for f in FUSING for what in ("momentum", "learning_rate") for ulps in (1, 3)
         if not ("nesterov" in f and what == "learning_rate" and ulps == 1)] + [("sgd_nesterov_legacy.onnx", "learning_rate", 2)]


@pytest.mark.parametrize(("file", "what", "ulps"), CASES)
def test_check_fails_a_bfloat16_coefficient_a_few_ulps_off(file, what, ulps):
    result = check_models(onnx.load(DATA / file), _with(_fused(file), what, ulps), steps=3)
    assert not result.passed


@pytest.mark.parametrize("ulps", [1, 3])
@pytest.mark.parametrize("what", ["momentum", "learning_rate"])
def test_optimize_refuses_a_plan_whose_bfloat16_coefficient_is_a_few_ulps_off(monkeypatch, what, ulps):
    class WrongPlanner(Planner):
        def plan(self, match):
            plan = super().plan(match)
            name = plan.learning_rate_input if what == "learning_rate" else plan.momentum_input
            # Shared constants are carried by the first plan that reads them (the later ones read it too).
            initializers = [_ulps_off(t, ulps) if t.name == name else t for t in plan.initializers]
            changed.append(initializers != plan.initializers)
            return dataclasses.replace(plan, initializers=initializers)

    changed: list[bool] = []
    monkeypatch.setattr(api, "Planner", WrongPlanner)
    result = api.optimize(DATA / "sgd_momentum_dynamo.onnx")
    assert any(changed), f"no plan has a {what} initializer"
    assert result.report.fused == []
    assert {r.reason for r in result.report.refused} == {"verification-failed"}
