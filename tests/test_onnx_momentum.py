"""ai.onnx.preview.training::Momentum converted into SGD nodes: ONNX's own backend test cases (generated from
the onnx package's test-case definitions, which the wheel ships as Python), and both modes, one and several
tensors, T == 0 and T > 0 run with onnx.reference.ReferenceEvaluator against onnxruntime on the conversion."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import sgdfuse
import sgdfuse.verify
from sgdfuse.runtime import make_session, run

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # unrelated case modules warn while they are collected
    from onnx.backend.test.case.node import collect_testcases

    CASES = [c for c in collect_testcases("Momentum")]


def test_onnx_backend_cases_exist():
    assert sorted(c.name for c in CASES) == ["test_momentum", "test_momentum_multiple", "test_nesterov_momentum"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_onnx_backend_case_converts_and_reproduces_the_expected_outputs(case):
    result = sgdfuse.optimize(case.model)
    assert not result.report.refused, result.report
    assert [n.op_type for n in result.model.graph.node].count("SGD") == (len(case.model.graph.node[0].input) - 2) // 3
    assert not any(n.op_type == "Momentum" for n in result.model.graph.node)
    onnx.checker.check_model(result.model, full_check=True)
    session = make_session(result.model)
    for inputs, expected in case.data_sets:
        got = run(session, dict(zip([i.name for i in case.model.graph.input], inputs)))
        for output, want in zip([o.name for o in case.model.graph.output], expected):
            np.testing.assert_allclose(got[output], want, rtol=1e-6, atol=1e-7)


def _momentum_model(mode: str, tensors: int, alpha=0.9, beta=0.25, norm=0.01):
    names = [f"X{i}" for i in range(tensors)] + [f"G{i}" for i in range(tensors)] + [f"V{i}" for i in range(tensors)]
    outs = [f"X{i}_new" for i in range(tensors)] + [f"V{i}_new" for i in range(tensors)]
    node = helper.make_node(
        "Momentum", ["R", "T", *names], outs, domain="ai.onnx.preview.training", alpha=alpha, beta=beta, norm_coefficient=norm, mode=mode
    )
    inputs = [helper.make_tensor_value_info("R", TensorProto.FLOAT, []), helper.make_tensor_value_info("T", TensorProto.INT64, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 2]) for n in names]
    graph = helper.make_graph([node], "m", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, [3, 2]) for o in outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)])


@pytest.mark.parametrize("tensors", [1, 3])
@pytest.mark.parametrize("mode,beta", [("standard", 0.25), ("standard", 1.0), ("nesterov", 1.0)])
def test_both_modes_and_several_tensors_agree_with_the_reference_evaluator_over_steps(mode, beta, tensors):
    model = _momentum_model(mode, tensors, beta=beta)
    result = sgdfuse.optimize(model)
    assert len(result.report.fused) == tensors and not result.report.refused
    reference, session = ReferenceEvaluator(model), make_session(result.model)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal((3, 2)).astype(np.float32) for i in model.graph.input if i.name not in ("R", "T")}
    feeds["R"] = np.array(0.05, np.float32)
    outputs = [o.name for o in model.graph.output]
    for step in (0, 1, 2, 3):  # T == 0 first (beta_adjusted = 1, old buffer kept), then T > 0
        feeds["T"] = np.array(step, np.int64)
        want = dict(zip(outputs, reference.run(None, feeds)))
        have = run(session, feeds, outputs)
        for name in outputs:
            np.testing.assert_allclose(have[name], want[name], rtol=1e-5, atol=1e-6, err_msg=f"{name} T={step}")
        for i in range(tensors):
            feeds[f"X{i}"], feeds[f"V{i}"] = want[f"X{i}_new"], want[f"V{i}_new"]
            feeds[f"G{i}"] = rng.standard_normal((3, 2)).astype(np.float32)


def test_nesterov_with_beta_other_than_one_is_refused_by_the_contract():
    result = sgdfuse.optimize(_momentum_model("nesterov", 1, beta=0.5))
    assert not result.report.fused
    assert result.report.refused[0].reason == "momentum-op" and "dampening" in result.report.refused[0].detail


def test_alpha_zero_is_refused_since_the_contract_keeps_the_buffer():
    result = sgdfuse.optimize(_momentum_model("standard", 1, alpha=0.0))
    assert not result.report.fused and "alpha" in result.report.refused[0].detail


def test_check_runs_an_original_with_onnx_momentum_in_the_reference_evaluator(tmp_path):
    # onnxruntime does not run ai.onnx.preview.training; `check` runs that side in onnx's ReferenceEvaluator.
    import subprocess
    import sys

    from onnx import TensorProto, helper

    def value(name, dtype=TensorProto.FLOAT, shape=(3,)):
        return helper.make_tensor_value_info(name, dtype, list(shape))

    momentum = helper.make_node("Momentum", ["R", "T", "x", "g", "v"], ["x_out", "v_out"], domain="ai.onnx.preview.training",
                                alpha=0.9, beta=0.8, mode="standard", norm_coefficient=0.01)
    graph = helper.make_graph([momentum], "m", [value("R", shape=()), value("T", TensorProto.INT64, ()), value("x"), value("g"), value("v")],
                              [value("x_out"), value("v_out")])
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)], ir_version=8)
    onnx.save(original, tmp_path / "m.onnx")
    result = sgdfuse.optimize(original)
    assert len(result.report.fused) == 1
    result.save(tmp_path / "f.onnx")
    check = sgdfuse.verify.check_models(original, result.model)
    assert check.passed, check.outputs
    script = os.path.join(os.path.dirname(sys.executable), "sgdfuse")
    done = subprocess.run([script, "check", str(tmp_path / "m.onnx"), str(tmp_path / "f.onnx")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
