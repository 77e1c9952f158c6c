"""Refusals name the right reason and the term that did not fit, and each refused update is reported once
(its buffer output is not listed again as a candidate of its own)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

import sgdfuse
from forms import Builder


def _refusals(model):
    report = sgdfuse.inspect(model)
    assert not report.fused, report
    return report.refused


def test_nesterov_with_dampening_is_refused_by_the_contract_clause_not_as_a_momentum_mismatch():
    # buf' = 0.9*buf + 0.5*g; p' = p - 0.1*(g + 0.9*buf'): the contract's Nesterov form with dampening 0.5.
    b = Builder()
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), b.mul(g, b.scalar(0.5)), out="buf_out")
    b.sub(p, b.mul(b.add(g, b.mul("buf_out", b.scalar(0.9))), b.scalar(0.1)), out="p_out")
    (refusal,) = _refusals(b.model(["p_out", "buf_out"]))
    assert refusal.reason == "contract"
    assert "dampening 0.5" in refusal.detail and "Nesterov" in refusal.detail


def test_crossed_buffers_are_refused_as_not_their_own_previous_value():
    b = Builder()
    p, g, buf_a, buf_b = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf_a"), b.tensor_input("buf_b")
    b.add(b.mul(buf_b, b.scalar(0.9)), g, out="buf_a_out")
    b.sub(p, b.mul("buf_a_out", b.scalar(0.1)), out="p_out")
    (refusal,) = _refusals(b.model(["p_out", "buf_a_out"]))
    assert refusal.reason == "buffer-not-own-previous"
    assert "buf_b" in refusal.detail and "buf_a" in refusal.detail and "momentum is 0" not in refusal.detail


def test_a_refused_update_is_reported_once_without_a_row_for_its_buffer():
    b = Builder()
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_out")
    decoupled = b.sub(p, b.mul(p, b.scalar(1e-3)))  # decoupled weight decay: p - lr*wd*p - lr*buf'
    b.sub(decoupled, b.mul("buf_out", b.scalar(0.1)), out="p_out")
    refusals = _refusals(b.model(["p_out", "buf_out"]))
    assert [(r.candidate, r.reason) for r in refusals] == [("p_out", "extra-term")]
    assert refusals[0].differing == "-0.001*p"


def test_per_element_learning_rate_names_the_product_not_an_internal_value():
    b = Builder()
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    lr = b.tensor_input("lr_per_element")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_out")
    b.sub(p, b.mul("buf_out", lr), out="p_out")
    refusals = _refusals(b.model(["p_out", "buf_out"]))
    assert [(r.candidate, r.reason) for r in refusals] == [("p_out", "tensor-factor")]
    assert "lr_per_element" in refusals[0].detail and refusals[0].differing == "Mul(buf_out, lr_per_element)"


def test_bfloat16_constants_are_scalars_and_native_bfloat16_updates_fuse():
    b = Builder(dtype=TensorProto.BFLOAT16)
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_out")
    b.sub(p, b.mul("buf_out", b.scalar(0.1)), out="p_out")
    report = sgdfuse.inspect(b.model(["p_out", "buf_out"]))
    assert [(f.parameters, f.accum) for f in report.fused] == [("p", "buf")], report
    assert report.fused[0].momentum == float(np.float32(np.array(0.9, np.float32).astype("bfloat16")))


def test_rank_nine_parameters_are_refused_by_the_contract_before_lowering():
    b = Builder(shape=[2] + [1] * 8)
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_out")
    b.sub(p, b.mul("buf_out", b.scalar(0.1)), out="p_out")
    (refusal,) = _refusals(b.model(["p_out", "buf_out"]))
    assert refusal.reason == "contract" and "rank 1..8" in refusal.detail


def test_report_json_is_strict_and_names_the_tool():
    import json

    from onnx.backend.test.case.node import collect_testcases

    # A converted ONNX Momentum node has no bound ratio (its original runs in the reference evaluator).
    model = next(c.model for c in collect_testcases("Momentum") if c.name == "test_momentum")
    text = sgdfuse.optimize(model).report.to_json()
    data = json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert data["tool"]["name"] == "sgdfuse" and data["fused"]


def test_check_on_an_onnx_momentum_model_runs_the_original_in_the_reference_evaluator(tmp_path):
    import subprocess
    import sys

    import onnx
    from onnx.backend.test.case.node import collect_testcases

    model = next(c.model for c in collect_testcases("Momentum") if c.name == "test_momentum")
    onnx.save(model, tmp_path / "momentum.onnx")
    sgdfuse.optimize(model).save(tmp_path / "fused.onnx")
    done = subprocess.run(
        [sys.executable, "-m", "sgdfuse.cli", "check", tmp_path / "momentum.onnx", tmp_path / "fused.onnx"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_on_a_model_onnxruntime_cannot_run_is_one_error_line(tmp_path):
    import subprocess
    import sys

    import onnx
    from onnx import TensorProto, helper

    from graphs import momentum_sgd

    model = momentum_sgd()
    # A node of a domain no runtime knows, beside the update: the fused update verifies (its slice does not
    # include it), but the whole model cannot run in onnxruntime.
    model.graph.node.append(helper.make_node("Unknown", ["g"], ["side"], domain="com.example"))
    model.graph.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, [2, 3]))
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    onnx.save(model, tmp_path / "m.onnx")
    sgdfuse.optimize(model).save(tmp_path / "fused.onnx")
    done = subprocess.run(
        [sys.executable, "-m", "sgdfuse.cli", "check", tmp_path / "m.onnx", tmp_path / "fused.onnx"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error:") and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
