"""Rules for the layers, indexing ops, activations and losses of real training steps: each op lowered on a
small graph and run in the GE executor against onnxruntime; the GE op, port and attribute conventions the
rules promise (pads layouts, axes, keep_dims); and refusals that name the node."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse.lowering.errors import LoweringError
from sgdfuse.lowering.registry import registered
from test_lowering_support import run_both

F, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(7)


def _graph(nodes, inputs, initializers=(), opset: int = 20) -> onnx.ModelProto:
    """A model of ``nodes`` whose outputs are every node output, with shapes from strict shape inference."""
    outputs = [o for node in nodes for o in node.output if o]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(o, 0, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    del model.graph.output[:]
    model.graph.output.extend(known[o] for o in outputs)
    return model


def _ints(*values):
    return np.array(values, dtype=np.int64)


n = helper.make_node

CASES = {
    "conv_2d_groups_dilation_bias": _graph(
        [n("Conv", ["x", "w", "b"], ["y"], pads=[1, 0, 2, 1], strides=[2, 1], dilations=[1, 2], group=2)],
        [("x", F, [2, 4, 7, 6])],
        [("w", RNG.standard_normal((6, 2, 3, 2)).astype(np.float32)), ("b", RNG.standard_normal(6).astype(np.float32))],
    ),
    "conv_same_upper": _graph([n("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])], [("x", F, [1, 3, 5, 6]), ("w", F, [4, 3, 3, 3])]),
    "conv_3d": _graph([n("Conv", ["x", "w"], ["y"], pads=[1, 0, 1, 0, 1, 1])], [("x", F, [1, 2, 4, 4, 3]), ("w", F, [3, 2, 2, 3, 2])]),
    "conv_transpose": _graph(
        [n("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2], pads=[1, 0, 1, 1], output_padding=[1, 0])],
        [("x", F, [2, 4, 3, 4]), ("w", F, [4, 3, 3, 3]), ("b", F, [3])],
    ),
    "conv_transpose_groups_output_shape": _graph(
        [n("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], output_shape=[8, 9], group=2)], [("x", F, [1, 4, 4, 4]), ("w", F, [4, 1, 3, 3])]
    ),
    "col2im": _graph(
        [n("Col2Im", ["x", "image", "block"], ["y"], pads=[1, 1, 1, 1], strides=[2, 1], dilations=[1, 2])],
        [("x", F, [2, 3 * 6, 3 * 4])],
        [("image", _ints(5, 6)), ("block", _ints(2, 3))],
    ),
    "batch_norm_inference": _graph(
        [n("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-3), n("BatchNormalization", ["x2", "s", "b", "m", "v"], ["y2"])],
        [("x", F, [2, 3, 4, 5]), ("x2", F, [4, 3]), ("s", F, [3]), ("b", F, [3]), ("m", F, [3])],
        [("v", np.array([0.5, 1.0, 2.0], np.float32))],
    ),
    "batch_norm_training": _graph(
        [n("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "running_mean", "running_var"], training_mode=1, momentum=0.8)],
        [("x", F, [4, 3, 2, 2]), ("s", F, [3]), ("b", F, [3]), ("m", F, [3]), ("v", F, [3])],
    ),
    "layer_norm_with_stats": _graph(
        [n("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv_std"], axis=-1, epsilon=1e-5), n("LayerNormalization", ["x", "s2"], ["y2"], axis=1)],
        [("x", F, [2, 3, 4]), ("s", F, [4]), ("b", F, [4]), ("s2", F, [3, 4])],
    ),
    "max_pool_with_indices": _graph(
        [
            n("MaxPool", ["x"], ["y", "idx"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
            n("MaxPool", ["x"], ["y1", "idx1"], kernel_shape=[1, 1], strides=[1, 1]),
            n("MaxPool", ["x"], ["y_ceil"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        ],
        [("x", F, [2, 3, 7, 6])],
    ),
    "average_and_global_pools": _graph(
        [
            n("AveragePool", ["x"], ["avg_excl"], kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1]),
            n("AveragePool", ["x"], ["avg_incl"], kernel_shape=[3, 3], strides=[1, 2], pads=[1, 1, 1, 1], count_include_pad=1),
            n("GlobalAveragePool", ["x"], ["gap"]),
            n("GlobalMaxPool", ["x"], ["gmp"]),
        ],
        [("x", F, [2, 3, 6, 5])],
    ),
    "pad_slice_split": _graph(
        [
            n("Pad", ["x", "pads"], ["p_const"], mode="constant"),
            n("Pad", ["x", "pads", "value"], ["p_value"]),
            n("Pad", ["x", "pads"], ["p_reflect"], mode="reflect"),
            n("Pad", ["x", "pads2", "", "axes"], ["p_axes"], mode="edge"),
            n("Slice", ["x", "starts", "ends", "slice_axes", "steps"], ["sl"]),
            n("Slice", ["x", "starts_neg", "ends_neg", "axis2", "minus1"], ["sl_rev"]),
            n("Split", ["x"], ["s0", "s1", "s2"], axis=2, num_outputs=3),
            n("Split", ["x", "sizes"], ["t0", "t1"], axis=-1),
        ],
        [("x", F, [2, 3, 5, 4])],
        [
            ("pads", _ints(0, 0, 1, 2, 0, 1, 2, 1)),
            ("value", np.array(1.5, np.float32)),
            ("pads2", _ints(1, 2, 2, 1)),
            ("axes", _ints(2, -1)),
            ("starts", _ints(1, -3)),
            ("ends", _ints(2**62, 4)),
            ("slice_axes", _ints(1, 2)),
            ("steps", _ints(1, 2)),
            ("starts_neg", _ints(-1)),
            ("ends_neg", _ints(-(2**62))),
            ("axis2", _ints(2)),
            ("minus1", _ints(-1)),
            ("sizes", _ints(1, 3)),
        ],
    ),
    "gathers_and_scatters": _graph(
        [
            n("GatherElements", ["x", "idx"], ["ge"], axis=1),
            n("GatherND", ["x", "nd_idx"], ["gnd"]),
            n("ScatterElements", ["x", "idx", "upd"], ["se"], axis=1),
            n("ScatterElements", ["x", "idx", "upd"], ["se_add"], axis=1, reduction="add"),
            n("ScatterElements", ["x", "idx", "upd"], ["se_mul"], axis=-2, reduction="mul"),
            n("ScatterND", ["x", "nd_idx", "nd_upd"], ["snd"]),
            n("ScatterND", ["x", "nd_dup", "nd_upd"], ["snd_add"], reduction="add"),
        ],
        [("x", F, [3, 4, 5]), ("upd", F, [3, 2, 5]), ("nd_upd", F, [2, 5])],
        [
            ("idx", RNG.integers(-4, 4, size=(3, 2, 5))),
            ("nd_idx", _ints(2, 1, 0, -1).reshape(2, 2)),
            ("nd_dup", _ints(1, 1, 1, 1).reshape(2, 2)),
        ],
    ),
    "tile_range_cumsum_trilu_expand_concat": _graph(
        [
            n("Tile", ["x", "reps"], ["tile"]),
            n("Range", ["start", "limit", "delta"], ["range"]),
            n("CumSum", ["x", "axis1"], ["cs"]),
            n("CumSum", ["x", "axis0"], ["cs_rev_excl"], exclusive=1, reverse=1),
            n("Trilu", ["x", "k"], ["triu"]),
            n("Trilu", ["x"], ["tril"], upper=0),
            n("Expand", ["x", "shape"], ["expanded"]),
            n("Concat", ["x", "x"], ["cat"], axis=0),
            n("Gather", ["x", "gidx"], ["gathered"], axis=1),
        ],
        [("x", F, [3, 4])],
        [
            ("reps", _ints(2, 1)),
            ("start", np.array(1.0, np.float32)),
            ("limit", np.array(6.5, np.float32)),
            ("delta", np.array(1.5, np.float32)),
            ("axis1", np.array(1, np.int64)),
            ("axis0", np.array(0, np.int64)),
            ("k", np.array(1, np.int64)),
            ("shape", _ints(2, 3, 4)),
            ("gidx", _ints(3, -1)),
        ],
    ),
    "activations": _graph(
        [
            n("Clip", ["x", "lo", "hi"], ["clip"]),
            n("Clip", ["x", "", "hi"], ["clip_max"]),
            n("Clip", ["x"], ["clip_none"]),
            n("Erf", ["x"], ["erf"]),
            n("Gelu", ["x"], ["gelu"]),
            n("Gelu", ["x"], ["gelu_tanh"], approximate="tanh"),
            n("Softmax", ["x"], ["sm"], axis=1),
            n("LogSoftmax", ["x"], ["lsm"], axis=-1),
            n("Tanh", ["x"], ["tanh"]),
            n("Sigmoid", ["x"], ["sig"]),
        ],
        [("x", F, [3, 5])],
        [("lo", np.array(-0.5, np.float32)), ("hi", np.array(0.7, np.float32))],
    ),
    "reductions": _graph(
        [
            n("ReduceSum", ["x", "axes"], ["rsum"], keepdims=0),
            n("ReduceMean", ["x", "axes"], ["rmean"]),
            n("ReduceMax", ["x", "axes"], ["rmax"], keepdims=1),
            n("ReduceMax", ["x"], ["rmax_all"], keepdims=0),
            n("ReduceL2", ["x", "axes"], ["rl2"], keepdims=0),
            n("ReduceL2", ["x"], ["rl2_all"], keepdims=0),
            n("ReduceSumSquare", ["x", "axes"], ["rss"], keepdims=1),
            n("ReduceSumSquare", ["x"], ["rss_all"], keepdims=0),
        ],
        [("x", F, [2, 3, 4])],
        [("axes", _ints(0, -1))],
    ),
    "losses": _graph(
        [
            n("NegativeLogLikelihoodLoss", ["logp", "t"], ["nll_mean"]),
            n("NegativeLogLikelihoodLoss", ["logp", "t", "w"], ["nll_w_sum"], reduction="sum"),
            n("NegativeLogLikelihoodLoss", ["logp", "t_ign"], ["nll_ignore"], ignore_index=1),
            n("NegativeLogLikelihoodLoss", ["logp3", "t3", "w"], ["nll_none_3d"], reduction="none"),
            n("SoftmaxCrossEntropyLoss", ["logp", "t"], ["sce", "sce_log_prob"]),
            n("SoftmaxCrossEntropyLoss", ["logp3", "t3", "w"], ["sce_3d"], reduction="mean"),
        ],
        [("logp", F, [4, 3]), ("logp3", F, [2, 3, 4]), ("w", F, [3])],
        [("t", _ints(0, 2, 1, 2)), ("t_ign", _ints(1, 0, 1, 2)), ("t3", np.array([[0, 1, 2, 0], [2, 2, 1, 0]], np.int64))],
    ),
    "schedule": _graph(
        [
            n("Div", ["step", "ten"], ["ratio"]),
            n("Floor", ["ratio"], ["floor"]),
            n("Pow", ["half", "floor"], ["decay"]),
            n("Mul", ["lr0", "decay"], ["lr"]),
            n("Mod", ["step", "three"], ["fmod"], fmod=1),
            n("Mod", ["istep", "ithree"], ["imod"]),
        ],
        [("step", F, [1]), ("istep", I64, [4])],
        [("ten", np.array(10.0, np.float32)), ("half", np.array(0.5, np.float32)), ("lr0", np.array(0.1, np.float32)), ("three", np.array(3.0, np.float32)), ("ithree", _ints(3, -3, 3, -3))],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_rules_compute_what_onnxruntime_computes(case):
    model = CASES[case]
    lowered = sgdfuse.lower(model, soc="Ascend910B2")
    report = run_both(model, lowered, steps=1, seed=3)
    assert set(report[0]) == {o.name for o in model.graph.output}


def _op(lowered, ge_type):
    return next(op for op in lowered.graph.op if op.type == ge_type)


def _ints_attr(op, name):
    return list(op.attr[name].list.i)


def test_convolution_and_pooling_attributes_follow_the_ge_layouts():
    conv = _op(sgdfuse.lower(CASES["conv_2d_groups_dilation_bias"], soc="Ascend910B2"), "Conv2D")
    assert _ints_attr(conv, "pads") == [1, 2, 0, 1]  # ONNX [h_begin, w_begin, h_end, w_end] = [1, 0, 2, 1]
    assert _ints_attr(conv, "strides") == [1, 1, 2, 1] and _ints_attr(conv, "dilations") == [1, 1, 1, 2]
    assert conv.attr["groups"].i == 2 and conv.attr["data_format"].s == b"NCHW"
    assert list(conv.attr["_input_name_key"].list.s) == [b"x", b"filter", b"bias"]
    pool = _op(sgdfuse.lower(CASES["average_and_global_pools"], soc="Ascend910B2"), "AvgPoolV2")
    assert _ints_attr(pool, "ksize") == [1, 1, 3, 2] and _ints_attr(pool, "pads") == [1, 1, 0, 1]
    assert pool.attr["exclusive"].b is True and pool.attr["padding_mode"].s == b"CALCULATED"


def test_pad_keeps_the_onnx_pads_order_with_non_contiguous_paddings():
    lowered = sgdfuse.lower(CASES["pad_slice_split"], soc="Ascend910B2")
    pad = next(op for op in lowered.graph.op if op.type == "PadV3" and op.attr["mode"].s == b"edge")
    assert pad.attr["paddings_contiguous"].b is False
    const = next(op for op in lowered.graph.op if op.name == pad.input[1].rsplit(":", 1)[0])
    values = np.frombuffer(const.attr["value"].t.data, dtype=np.int64)
    assert list(values) == [0, 0, 1, 2, 0, 0, 2, 1]  # axes (2, -1) written out over all four axes


def test_reductions_write_axes_out_and_keep_dims():
    lowered = sgdfuse.lower(CASES["reductions"], soc="Ascend910B2")
    maxima = [op for op in lowered.graph.op if op.type == "ReduceMax"]
    assert sorted(op.attr["keep_dims"].b for op in maxima) == [False, True]
    assert {op.type for op in lowered.graph.op} >= {"ReduceSum", "ReduceMean", "ReduceMax", "Sqrt"}


def test_asymmetric_col2im_pads_are_refused_naming_the_node():
    model = _graph(
        [n("Col2Im", ["x", "image", "block"], ["y"], pads=[1, 0, 0, 1], name="fold")],
        [("x", F, [1, 4, 16])],
        [("image", _ints(4, 4)), ("block", _ints(2, 2))],
    )
    with pytest.raises(LoweringError, match=r"node fold \(Col2Im\).*pads"):
        sgdfuse.lower(model, soc="Ascend910B2")


def test_the_issue_op_list_has_rules():
    wanted = (
        "Conv ConvTranspose Col2Im BatchNormalization LayerNormalization MaxPool AveragePool GlobalAveragePool "
        "Pad Slice Split Concat Gather GatherElements GatherND ScatterElements ScatterND Expand Tile Range CumSum "
        "Trilu Clip Erf Gelu Softmax LogSoftmax Tanh Sigmoid ReduceSum ReduceMean ReduceMax ReduceL2 "
        "NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss Floor Pow Mod"
    ).split()
    table = {op for domain, op in registered() if domain == "ai.onnx"}
    assert not sorted(set(wanted) - table)


def test_the_readme_lists_exactly_the_ops_with_rules():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## Lowering: covered ONNX ops", 1)[1].split("\n## ", 1)[0]
    listed = section.strip().split("\n\n")[-1].replace("\n", " ").rstrip(".")
    table = sorted(op for domain, op in registered() if domain == "ai.onnx")
    assert sorted(op.strip() for op in listed.split(",")) == table
    assert f"these {len(table)} standard ops" in section.replace("\n", " ")
