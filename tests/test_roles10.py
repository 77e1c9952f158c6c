"""roles10: a gradient computed from the tensor a reading takes as the momentum buffer, per structural class.

Whether an update's gradient is computed from its buffer can hang on a value behind an op the structural-class
key does not enter (a ``Relu`` output is keyed by its op type only, not by what it reads): two clusters with one
key may differ in it. The class's solved member must not lend its fusion to a member whose gradient reads the
tensor taken as its buffer (``sgd_match._find_by_class`` solves the graph directly then). Expected roles are
stated from the graph's construction, not from sgdfuse.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hunt_graphs import Exported  # noqa: E402

import sgdfuse  # noqa: E402
from sgdfuse.passes.index import build_index  # noqa: E402
from sgdfuse.passes.sgd_match import find_updates  # noqa: E402

F32 = TensorProto.FLOAT
S = (4, 3)


def _two_clusters(reads_own: list[bool]):
    """Per member k: ``v_k = 0.75*s_k + 0.9*h_k``, ``w_k = p_k - 0.1*v_k`` and a side output
    ``a_k = Abs(Relu(s_k))``. The 'gradient' ``h_k`` is ``Relu(Relu(s_k))`` when ``reads_own[k]`` (computed from
    the 'buffer' s_k: no SGD step) and ``Relu(Relu(z_k))`` of a separate input otherwise (buffer s_k, momentum 0.75,
    dampening 0.1, gradient h_k). Either way ``s_k`` is read by the update's ``Mul`` and by one ``Relu``, and
    ``h_k`` is a ``Relu`` of a ``Relu`` output: the members' regions, and so their class keys, are alike."""
    b = Exported()
    outputs = []
    for k, own in enumerate(reads_own):
        p, s = b.input(f"p{k}", F32, S), b.input(f"s{k}", F32, S)
        r = b.op("Relu", [s], f"m{k}_relu")
        h = b.op("Relu", [r if own else b.op("Relu", [b.input(f"z{k}", F32, S)], f"m{k}_relu")], f"m{k}_relu")
        v = b.op("Add", [b.op("Mul", [s, b.const(0.75)], f"m{k}_mul"), b.op("Mul", [h, b.const(0.9)], f"m{k}_mul")], f"m{k}_add")
        w = b.op("Sub", [p, b.op("Mul", [v, b.const(0.1)], f"m{k}_mul")], f"m{k}_sub")
        outputs += [(w, S), (v, S), (b.op("Abs", [r], f"m{k}_abs"), S)]
    return b.model(outputs)


def test_a_member_whose_gradient_reads_its_buffer_is_not_fused_by_class(monkeypatch):
    monkeypatch.setenv("SGDFUSE_CHECK_CLASSES", "1")  # the per-class result must equal the direct one
    model = _two_clusters([False, True, False])
    matches, _ = find_updates(build_index(model))
    # Members 0 and 2 read buffer s_k and gradient Relu(z_k); member 1's Relu reads s1, the would-be buffer.
    assert sorted(m.accum for m in matches) == ["s0", "s2"], [(m.parameters, m.accum, m.gradient) for m in matches]
    report = sgdfuse.optimize(model).report
    assert sorted(f.accum for f in report.fused) == ["s0", "s2"]
    assert [r.reason for r in report.refused if r.candidate == "m1_sub"] == ["gradient-reads-buffer"], report.refused


def test_the_fused_members_compute_their_own_numbers():
    rng = np.random.default_rng(10)
    model = _two_clusters([False, True, False])
    fused = sgdfuse.optimize(model).model
    feeds = {f"{n}{k}": rng.standard_normal(S).astype(np.float32) for k in range(3) for n in ("p", "s")}
    feeds.update({"z0": rng.standard_normal(S).astype(np.float32), "z2": rng.standard_normal(S).astype(np.float32)})
    session = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    names = [o.name for o in model.graph.output]
    for k, x in ((0, feeds["z0"]), (1, feeds["s1"]), (2, feeds["z2"])):  # Relu(Relu(x)) = Relu(x)
        p, s = np.float64(feeds[f"p{k}"]), np.float64(feeds[f"s{k}"])
        v = 0.75 * s + 0.9 * np.maximum(np.float64(x), 0)
        np.testing.assert_allclose(got[names[3 * k + 1]], v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[names[3 * k]], p - 0.1 * v, rtol=1e-5, atol=1e-6)
