"""The fast paths of the verifier's elementwise arithmetic and session runs give what the calls they stand
for give (issue 12: ``difference``, ``_bounds`` and ``_run_side`` run thousands of times per verification).
Expected values come from numpy and onnxruntime themselves."""

import numpy as np
import onnx
import pytest
from onnx import helper

from sgdfuse import verify
from sgdfuse.runtime import make_session

SPECIAL = [0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, np.finfo(np.float64).max, 5e-324]


@pytest.mark.parametrize("nan,posinf", [(np.inf, None), (0.0, np.inf)])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (2, 3)])
def test_nan_to_num_matches_numpy(nan, posinf, shape):
    rng = np.random.default_rng(0)
    for trial in range(50):
        x = rng.choice(SPECIAL, size=shape) if trial % 2 else rng.standard_normal(shape)
        want = np.nan_to_num(np.array(x, dtype=np.float64), nan=nan, posinf=posinf)
        have = verify._nan_to_num(np.array(x, dtype=np.float64), nan=nan, posinf=posinf)
        assert type(have) is type(want)
        assert np.asarray(have).dtype == np.asarray(want).dtype
        assert np.asarray(have).tobytes() == np.asarray(want).tobytes()


def test_difference_keeps_numpy_conventions():
    # NaN against a number counts Inf; Inf against a number counts the largest double (np.nan_to_num's
    # default for +Inf), as before the fast path; equal values, NaN against NaN, count 0.
    want = np.array([1.0, np.nan, np.inf, np.nan, 2.0, np.inf], dtype=np.float32)
    have = np.array([1.0, 3.0, 1.0, np.nan, 2.5, np.inf], dtype=np.float32)
    assert verify.difference(want, have).tolist() == [0.0, np.inf, np.finfo(np.float64).max, 0.0, 0.5, 0.0]
    assert verify.difference(np.float32(1), np.float32(1.25)).tolist() == 0.25


def test_run_side_feeds_only_the_session_inputs_each_time():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "g",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in "ab"],
        [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [2])],
    )
    session = make_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    for k in range(3):  # the second and third runs read the cached input names
        feeds = {"a": np.full(2, k, np.float32), "b": np.ones(2, np.float32), "unused": np.zeros(1, np.float32)}
        out = verify._run_side(session, feeds, ["c"], "original slice")
        assert out["c"].tolist() == [k + 1.0, k + 1.0]
    assert verify._input_names(session) == {"a", "b"}
