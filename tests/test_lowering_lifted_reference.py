"""``sgdfuse lower``'s lifted (DOUBLE) comparison where onnxruntime has no DOUBLE kernel.

onnxruntime 1.32 has no DOUBLE ``Conv``, ``AveragePool``, ``Col2Im``, ``LayerNormalization`` or ``Erf`` (``Gelu``'s
function body), so lower's check skipped the lifted run of every CNN, ResNet and GPT step, and FLOAT's tolerance
(rtol 1e-4, atol 1e-5) let through an edit of the GE graph that moves those steps' values by a relative 1e-6.
Those nodes now run in onnx's reference implementation (``sgdfuse.runtime.make_session_with_reference_ops``) and
the rest in onnxruntime. Each edit here passed the old check; the expected values of the reference kernels
come from onnx's own kernels, tables of erf, or numpy's formula, never from the code under test.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sgdfuse import api, runtime
from sgdfuse.lift import lift_to_double
from sgdfuse.lowering.lower import lower
from sgdfuse.lowering.verify import verify_lowering

SOC = "Ascend910B2"
STEPS = Path(__file__).resolve().parent.parent / "testdata" / "steps"
F, D = TensorProto.FLOAT, TensorProto.DOUBLE


def _lowered(model: onnx.ModelProto):
    fused = api.optimize(model).model
    lowered = lower(fused, soc=SOC, optimise=False)
    check = verify_lowering(fused, lowered)
    assert check.passed, check.message  # the unedited lowering passes
    assert check.note == "", check.note  # and both runs ran: nothing skipped
    return fused, lowered


def _op(lowered, op_type: str):
    return next(op for op in lowered.graph.op if op.type == op_type)


def _set_ints(op, key: str, values: list[int]) -> None:
    del op.attr[key].list.i[:]
    op.attr[key].list.i.extend(values)


# --- every committed step gets its lifted run --------------------------------------------------------------


@pytest.mark.parametrize("name", ["cnn_bn", "cnn_clip", "cnn_frozen", "gpt_tiny", "mlp_amp",
                                  pytest.param("resnet_small", marks=pytest.mark.slow)])
def test_every_real_step_passes_lowers_check_with_its_lifted_run(name):
    # The old check's note: "the lifted (DOUBLE) comparison could not run (onnxruntime has no DOUBLE kernel for
    # Conv | Col2Im | LayerNormalization)" for all but mlp_amp.
    fused, lowered = _lowered(onnx.load(STEPS / f"{name}.onnx"))
    assert lowered.sgd_ops


# --- edits FLOAT's tolerance hid (gpt_tiny's LayerNorm epsilon: tests/test_lowering_hunt10_soundness.py) ----------


def _batch_norm_op_epsilon(lowered) -> None:
    _op(lowered, "BatchNorm").attr["epsilon"].f *= 1.01


def _batch_norm_const_epsilon(lowered) -> None:
    # Training-mode BatchNorm is exported as arithmetic: var + eps with eps a FLOAT Const of 1e-5 (one, shared).
    (const,) = [op for op in lowered.graph.op if op.type == "Const" and op.attr["value"].t.desc.dtype == 1
                and len(op.attr["value"].t.data) == 4 and np.frombuffer(op.attr["value"].t.data, np.float32)[0] == np.float32(1e-5)]
    const.attr["value"].t.data = (np.float32(1e-5) * np.float32(1.01)).tobytes()


@pytest.mark.parametrize("name, edit", [("cnn_frozen", _batch_norm_op_epsilon), ("cnn_bn", _batch_norm_const_epsilon)],
                         ids=["cnn_frozen-BatchNorm-op", "cnn_bn-training-mode"])
def test_a_batch_norm_epsilon_one_percent_off_fails_in_the_lifted_run(name, edit):
    # eps 1e-5 -> 1.01e-5 moves (x - mean) / sqrt(var + eps) by ~5e-8 relative at unit variance. cnn_frozen's is
    # GE's BatchNorm (after a Conv), cnn_bn's the exported arithmetic (its backward has a Col2Im).
    fused, lowered = _lowered(onnx.load(STEPS / f"{name}.onnx"))
    edit(lowered)
    check = verify_lowering(fused, lowered)
    assert not check.passed and ": double," in check.message, check.message


def _residual_conv_step(pads=(1, 1, 1, 1), strides=(1, 1), dilations=(1, 1)) -> onnx.ModelProto:
    """A residual step: gradient ``g = r + Conv(x, W)`` with a FLOAT initializer ``W`` of scale 1e-7 (a branch
    small beside the skip, as a freshly initialised residual branch is), x [2, 3, 5, 5], updating ``w`` (m 0.9,
    lr 0.1). Any change of the branch's numbers is ~1e-7 of ``g``'s: inside FLOAT's tolerance, far outside DOUBLE's."""
    weights = (np.random.default_rng(7).standard_normal((4, 3, 3, 3)) * 1e-7).astype(np.float32)
    side = (5 + pads[0] + pads[2] - dilations[0] * 2 - 1) // strides[0] + 1
    nodes = [helper.make_node("Conv", ["x", "conv_w"], ["branch"], pads=list(pads), strides=list(strides), dilations=list(dilations),
                              kernel_shape=[3, 3]),
             helper.make_node("Add", ["r", "branch"], ["g"]),
             helper.make_node("Mul", ["buf", "m"], ["kept"]), helper.make_node("Add", ["kept", "g"], ["buf_out"]),
             helper.make_node("Mul", ["buf_out", "lr"], ["step"]), helper.make_node("Sub", ["w", "step"], ["w_out"])]
    values = [helper.make_tensor_value_info(n, F, [2, 4, side, side]) for n in ("r", "w", "buf", "w_out", "buf_out")]
    constants = [numpy_helper.from_array(weights, "conv_w"), numpy_helper.from_array(np.array(0.9, np.float32), "m"),
                 numpy_helper.from_array(np.array(0.1, np.float32), "lr")]
    graph = helper.make_graph(nodes, "step", [helper.make_tensor_value_info("x", F, [2, 3, 5, 5])] + values[:3], values[3:], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _scale_one_weight(lowered) -> None:
    conv = _op(lowered, "Conv2D")
    const = lowered.op(conv.input[1].rpartition(":")[0])
    assert const.type == "Const"
    weights = np.frombuffer(const.attr["value"].t.data, np.float32).copy()
    weights[13] *= 1.1  # one tap of 108: the branch's numbers move by ~1e-8
    const.attr["value"].t.data = weights.tobytes()


CONV_EDITS = [
    # (the step's Conv, the edit of the GE Conv2D; GE's pads are [top, bottom, left, right], its lists NCHW)
    ("weight", {}, _scale_one_weight),
    ("pads", {}, lambda lowered: _set_ints(_op(lowered, "Conv2D"), "pads", [0, 2, 1, 1])),  # the same size, shifted a row
    ("strides", {"pads": (0, 0, 0, 0)}, lambda lowered: (_set_ints(_op(lowered, "Conv2D"), "strides", [1, 1, 2, 2]),
                                                         _set_ints(_op(lowered, "Conv2D"), "pads", [1, 1, 1, 1]))),
    ("dilations", {}, lambda lowered: (_set_ints(_op(lowered, "Conv2D"), "dilations", [1, 1, 2, 2]),
                                       _set_ints(_op(lowered, "Conv2D"), "pads", [2, 2, 2, 2]))),
]


@pytest.mark.parametrize("what, conv, edit", CONV_EDITS, ids=[case[0] for case in CONV_EDITS])
def test_a_conv_weight_or_window_subtly_off_in_the_ge_graph_fails_in_the_lifted_run(what, conv, edit):
    # Each edit keeps every shape (so no descriptor contradicts it) and changes which inputs, or how much of them,
    # the convolution sums; the old check passed each on FLOAT's tolerance alone.
    fused, lowered = _lowered(_residual_conv_step(**conv))
    edit(lowered)
    check = verify_lowering(fused, lowered)
    assert not check.passed and ": double," in check.message, check.message


# --- the reference side itself ---------------------------------------------------------------------------------


def _single_node_model(node: onnx.NodeProto, inputs, outputs, initializers=(), opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_a_double_erf_is_computed_in_double():
    # onnx's own Erf rounds to FLOAT (np.vectorize(erf, otypes=["f"])); expected values from tables of erf.
    table = {0.5: 0.5204998778130465377, 1.0: 0.8427007929497148693, 2.0: 0.9953222650189527342, -0.25: -0.2763263901682369}
    model = _single_node_model(helper.make_node("Erf", ["x"], ["y"]), [helper.make_tensor_value_info("x", D, [4])],
                               [helper.make_tensor_value_info("y", D, [4])])
    session, referenced = runtime.make_session_with_reference_ops(model)
    assert referenced == ["Erf"]
    got = runtime.run(session, {"x": np.array(list(table), np.float64)})["y"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, list(table.values()), rtol=4e-16, atol=0)


def test_a_lifted_layer_norm_is_computed_in_double_with_its_stash_type_lifted():
    # Mean and InvStdDev read, as in gpt_tiny's backward. The stash type (FLOAT by default) is lifted to DOUBLE:
    # left as it was, onnxruntime refused the model ("Type parameter (T) of Optype (Mul) bound to different
    # types"), and onnx's kernel refused a DOUBLE one. Expected: numpy's formula in float64.
    nodes = [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1, epsilon=1e-5),
             helper.make_node("Mul", ["mean", "inv"], ["stats"]), helper.make_node("Add", ["y", "stats"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, shape) for n, shape in (("x", [3, 8]), ("s", [8]), ("b", [8]))],
                              [helper.make_tensor_value_info("z", F, [3, 8])])
    session, referenced = runtime.make_session_with_reference_ops(lift_to_double(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])))
    assert referenced == ["LayerNormalization"]
    rng = np.random.default_rng(0)
    x, s, b = rng.standard_normal((3, 8)), rng.standard_normal(8), rng.standard_normal(8)
    mean = x.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(x.var(-1, keepdims=True) + float(np.float32(1e-5)))
    got = runtime.run(session, {"x": x, "s": s, "b": b})["z"]
    np.testing.assert_allclose(got, (x - mean) * inv * s + b + mean * inv, rtol=1e-13, atol=1e-14)


def test_col2im_sums_what_onnxs_own_kernel_sums():
    # onnx's Col2Im is a Python loop per element (1.2 s of each run of the ResNet step); the vectorised one must
    # give its sums for every stride, padding, dilation and kernel shape (the ResNet's among them).
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(0)
    cases = 0
    for (h, w), (kh, kw), strides, dilations, pads in itertools.product(
            [(1, 1), (2, 2), (4, 4), (3, 5)], [(1, 1), (3, 3), (2, 3)], [(1, 1), (2, 2), (1, 3)], [(1, 1), (2, 1)],
            [(0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 2, 0)]):
        grid = [(size + pads[k] + pads[k + 2] - dilations[k] * (kernel - 1) - 1) // strides[k] + 1
                for k, (size, kernel) in enumerate(((h, kh), (w, kw)))]
        if min(grid) < 1:
            continue
        node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], strides=list(strides), dilations=list(dilations), pads=list(pads))
        constants = [numpy_helper.from_array(np.array([h, w], np.int64), "image"), numpy_helper.from_array(np.array([kh, kw], np.int64), "block")]
        model = _single_node_model(node, [helper.make_tensor_value_info("x", D, None)], [helper.make_tensor_value_info("y", D, None)], constants)
        data = rng.standard_normal((2, 3 * kh * kw, grid[0] * grid[1]))
        want = ReferenceEvaluator(model).run(None, {"x": data})[0]
        got = runtime.ReferenceSession(model).run(["y"], {"x": data})["y"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14, err_msg=str((h, w, kh, kw, strides, dilations, pads)))
        cases += 1
    assert cases > 150


def test_only_the_nodes_without_a_double_kernel_leave_onnxruntime():
    # Relu -> Conv -> Mul -> Conv -> Add in DOUBLE: the two Conv nodes run in the reference implementation, in two
    # stages (the second reads the first through a Mul), and everything else in three onnxruntime stages; the
    # result is the FLOAT model's within FLOAT rounding, and DOUBLE's own (not FLOAT values widened).
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Conv", ["a", "k"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["b", "half"], ["c"]), helper.make_node("Conv", ["c", "k2"], ["d"]),
             helper.make_node("Add", ["d", "x"], ["y"])]
    rng = np.random.default_rng(1)
    constants = [numpy_helper.from_array(rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "k"),
                 numpy_helper.from_array(rng.standard_normal((2, 2, 1, 1)).astype(np.float32), "k2"),
                 numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [1, 2, 4, 4])], [helper.make_tensor_value_info("y", F, [1, 2, 4, 4])],
                              constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session, referenced = runtime.make_session_with_reference_ops(lift_to_double(model))
    assert referenced == ["Conv"] and isinstance(session, runtime.MixedSession)
    kinds = [type(runner).__name__ for runner, _, _ in session._stages]
    assert kinds == ["InferenceSession", "ReferenceSession", "InferenceSession", "ReferenceSession", "InferenceSession"]
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    got = runtime.run(session, {"x": x.astype(np.float64)})["y"]
    want = runtime.run(runtime.make_session(model), {"x": x})["y"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.any(got != got.astype(np.float32).astype(np.float64))


def test_a_kernel_missing_inside_a_function_body_takes_out_the_node_that_expands_to_it():
    # onnxruntime has no DOUBLE Gelu and runs its ONNX function body, whose Erf it has no DOUBLE kernel for either:
    # it names Erf, which is no node here. Expected: 0.5 x (1 + erf(x / sqrt 2)), erf from math.
    model = _single_node_model(helper.make_node("Gelu", ["x"], ["y"]), [helper.make_tensor_value_info("x", D, [5])],
                               [helper.make_tensor_value_info("y", D, [5])], opset=20)
    session, referenced = runtime.make_session_with_reference_ops(model)
    assert referenced == ["Gelu"]
    x = np.array([-2.0, -0.5, 0.0, 0.75, 3.0])
    want = [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x]
    np.testing.assert_allclose(runtime.run(session, {"x": x})["y"], want, rtol=1e-15, atol=1e-300)


def test_a_plain_model_keeps_its_onnxruntime_session():
    # The bench's steps (no op lacking a DOUBLE kernel) must run as before: one onnxruntime session, no inference.
    model = _single_node_model(helper.make_node("Mul", ["x", "x"], ["y"]), [helper.make_tensor_value_info("x", D, [3])],
                               [helper.make_tensor_value_info("y", D, [3])])
    session, referenced = runtime.make_session_with_reference_ops(model)
    assert referenced == [] and not isinstance(session, runtime.ReferenceSession)
