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


def test_replayed_plans_count_their_own_helper_passes():
    # Three maximize updates alike (one structural class: their plans are replayed, each with a Neg of the
    # gradient, 2 passes more) beside three plain ones of another class, over [3, 2] FLOAT tensors (24 bytes):
    # 7 + 2 passes after for the first three, 7 for the others, whatever order the classes come in.
    b = Builder()
    outputs = []
    for k in range(6):
        p, g, buf = b.tensor_input(f"p{k}"), b.tensor_input(f"g{k}"), b.tensor_input(f"buf{k}")
        gradient = b.neg(g) if k % 2 == 0 else g
        b.add(b.mul(buf, b.scalar(0.9)), gradient, out=f"buf{k}_new")
        b.sub(p, b.mul(b.scalar(0.01), f"buf{k}_new"), out=f"p{k}_new")
        outputs += [f"p{k}_new", f"buf{k}_new"]
    report = sgdfuse.inspect(b.model(outputs))
    after = {f.parameters: f.traffic_after_bytes for f in report.fused}
    assert after == {f"p{k}": (9 if k % 2 == 0 else 7) * 24 for k in range(6)}
