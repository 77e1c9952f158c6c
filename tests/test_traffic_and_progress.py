"""The memory-traffic estimate (bytes moved per step before and after fusion) and the progress stages."""

from __future__ import annotations

from onnx import TensorProto

import sgdfuse
from forms import Builder


def test_traffic_counts_every_elementwise_pass_before_and_seven_passes_after():
    # buf' = m*buf + g (Mul: read 1 tensor, write 1; Add: read 2, write 1), p' = p - lr*buf' (Mul 1+1, Sub 2+1):
    # 10 passes over a [3, 2] FLOAT tensor of 24 bytes before; the SGD kernel reads p, g, accum, stat and writes
    # p, accum, stat: 7 passes after.
    b = Builder()
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), g, out="buf_new")
    b.sub(p, b.mul(b.scalar(0.01), "buf_new"), out="p_new")
    report = sgdfuse.inspect(b.model(["p_new", "buf_new"]))
    assert (report.fused[0].traffic_before_bytes, report.fused[0].traffic_after_bytes) == (10 * 24, 7 * 24)
    assert report.memory_traffic() == {
        "before_bytes": 240,
        "after_bytes": 168,
        "by_dtype": {"FLOAT": {"before_bytes": 240, "after_bytes": 168, "updates": 1}},
        "unknown": 0,
    }
    assert "memory_traffic" in report.to_dict()


def test_traffic_of_float16_counts_two_bytes_and_maximize_adds_the_negation():
    b = Builder(dtype=TensorProto.FLOAT16)
    p, g, buf = b.tensor_input("p"), b.tensor_input("g"), b.tensor_input("buf")
    b.add(b.mul(buf, b.scalar(0.9)), b.neg(g), out="buf_new")  # Neg 1+1, Mul 1+1, Add 2+1: 7 passes
    b.sub(p, b.mul(b.scalar(0.01), "buf_new"), out="p_new")  # Mul 1+1, Sub 2+1: 5 more, 12 of 12 bytes
    report = sgdfuse.inspect(b.model(["p_new", "buf_new"]))
    f = report.fused[0]
    assert f.maximize
    assert (f.traffic_before_bytes, f.traffic_after_bytes) == (12 * 12, (7 + 2) * 12)


def test_optimize_reports_its_stages_in_order():
    stages = []
    sgdfuse.optimize("testdata/torch/sgd_wd_dynamo.onnx", progress=stages.append)
    assert stages == ["load", "index", "match", "verify", "rewrite"]
