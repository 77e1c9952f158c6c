"""Shared helpers of the lowering tests (no tests here): testdata, one SoC per product line, synthetic fused
models, and the executor-vs-onnxruntime comparison over chained steps."""

from __future__ import annotations

import functools
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sgdfuse import runtime
from sgdfuse.contract import SgdAttributes
from sgdfuse.fused_op import ensure_sgd_function, is_sgd_node, make_sgd_node
from sgdfuse.lowering.lower import fused_model
from sgdfuse.runtime import onnx_to_numpy_dtype

TESTDATA = Path(__file__).resolve().parent.parent / "testdata" / "torch"
MODEL_PATHS = sorted(TESTDATA.glob("*.onnx"))

SOC_PER_LINE = {
    "Ascend 950PR/950DT": "Ascend950PR_9599",
    "Atlas A3 series": "Ascend910_9391",
    "Atlas A2 series": "Ascend910B2",
    "Atlas 200I/500 A2 inference": "Ascend310B1",
    "Atlas inference series": "Ascend310P3",
    "Atlas training series": "Ascend910B",  # bare Ascend910B: the old training series, not A2
}
NO_BF16_LINES = ("Atlas 200I/500 A2 inference", "Atlas inference series", "Atlas training series")

# Tolerances of the executor-vs-onnxruntime comparison, per element:
# FLOAT: the graphs differ from onnxruntime only in the summation order of MatMul/ReduceSum/ReduceMean
#   (numpy vs MLAS) and in Gemm's bias added by a separate op; rtol 1e-5 with atol 1e-5 (observed <= 2e-6).
# FLOAT16/BFLOAT16: at most one unit in the last place of the larger magnitude (observed: bit-identical, the
#   SGD op is the contract in both and the rest of those graphs is shape plumbing).
FLOAT_RTOL = FLOAT_ATOL = 1e-5


@functools.lru_cache(maxsize=None)
def fused(path: Path) -> onnx.ModelProto:
    """The committed model, fused (cached: fusion verifies in onnxruntime and is not what is tested here)."""
    return fused_model(path)


def _feed_shape(value: onnx.ValueInfoProto, symbols: dict[str, int]) -> tuple[int, ...]:
    dims = []
    for dim in value.type.tensor_type.shape.dim:
        dims.append(dim.dim_value if dim.HasField("dim_value") else symbols.setdefault(dim.dim_param or "?", 3))
    return tuple(dims)


def random_value(value: onnx.ValueInfoProto, rng: np.random.Generator, symbols: dict[str, int]) -> np.ndarray:
    dtype = onnx_to_numpy_dtype(value.type.tensor_type.elem_type)
    return rng.standard_normal(_feed_shape(value, symbols)).astype(np.float32).astype(dtype)


def chain(model: onnx.ModelProto) -> dict[str, str]:
    """ONNX output → the input it feeds on the next step: an SGD node's parameters_out/accum_out when both
    ends are graph values, and the ``X_out`` → ``X`` naming of the testdata."""
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    pairs = {name: name[: -len("_out")] for name in outputs if name.endswith("_out") and name[: -len("_out")] in inputs}
    for node in model.graph.node:
        if is_sgd_node(node):
            for out_index, in_index in ((0, 0), (1, 3)):
                if node.output[out_index] in outputs and node.input[in_index] in inputs:
                    pairs[node.output[out_index]] = node.input[in_index]
    return pairs


def assert_agree(name: str, expected: np.ndarray, actual: np.ndarray) -> float:
    """Assert one output agrees within the stated tolerance; return the largest |difference|."""
    assert expected.shape == actual.shape, f"{name}: shape {actual.shape}, onnxruntime {expected.shape}"
    assert expected.dtype == actual.dtype, f"{name}: dtype {actual.dtype}, onnxruntime {expected.dtype}"
    if expected.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected, err_msg=name)
        return 0.0
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    same_nan = np.isnan(e) & np.isnan(a)
    difference = np.where(same_nan, 0.0, np.abs(e - a))
    if expected.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        ulp = np.abs(np.spacing(np.maximum(np.abs(expected), np.abs(actual)).astype(expected.dtype)).astype(np.float64))
        assert np.all(difference <= ulp), f"{name}: more than 1 ulp apart, max |difference| {difference.max()}"
    else:
        bound = FLOAT_ATOL + FLOAT_RTOL * np.abs(e)
        assert np.all(difference <= bound), f"{name}: max |difference| {difference.max()} beyond rtol/atol {FLOAT_RTOL}"
    return float(difference.max(initial=0.0))


def run_both(
    model: onnx.ModelProto,
    ge_model,
    *,
    steps: int = 3,
    seed: int = 0,
    check: bool = True,
    schedule: dict[str, list] | None = None,
) -> list[dict[str, float]]:
    """Run the fused ONNX model in onnxruntime and the lowered graph in the executor for ``steps`` chained
    steps on the same random inputs; onnxruntime gets its own previous outputs as state inputs, the GE graph
    keeps its state in its variables. ``schedule`` fixes some inputs per step (a step counter fed 0, 1, 2; a
    runtime momentum), the value for step k at index k. Returns per-step max |difference| per output
    (asserted when ``check``)."""
    schedule = schedule or {}
    rng = np.random.default_rng(seed)
    symbols: dict[str, int] = {}
    feeds = {value.name: random_value(value, rng, symbols) for value in model.graph.input if value.name not in {t.name for t in model.graph.initializer}}
    for value in model.graph.input:  # accum buffers start non-zero, learning rates positive
        if value.name.startswith("lr"):
            feeds[value.name] = np.abs(feeds[value.name]) * 0.1
    pairs = chain(model)
    session = runtime.make_session(model)
    runner = ge_model.runner()
    runner.initialise({name: feeds[name] for name in ge_model.init_inputs.values()})
    report = []
    for step in range(steps):
        for name, values in schedule.items():
            feeds[name] = np.asarray(values[step], dtype=onnx_to_numpy_dtype(_input_type(model, name)))
        expected = runtime.run(session, feeds)
        actual = runner.step(feeds)
        differences = {}
        for name in ge_model.outputs:
            if check:
                differences[name] = assert_agree(name, expected[name], actual[name])
            else:
                differences[name] = float(np.max(np.abs(expected[name].astype(np.float64) - actual[name].astype(np.float64)), initial=0.0))
        report.append(differences)
        for output, input_name in pairs.items():
            feeds[input_name] = expected[output]
        for value in model.graph.input:  # fresh gradients and data, same state
            if value.name not in pairs.values() and not value.name.startswith("lr") and value.name in feeds:
                feeds[value.name] = random_value(value, rng, symbols)
    return report


def _input_type(model: onnx.ModelProto, name: str) -> int:
    return next(i.type.tensor_type.elem_type for i in model.graph.input if i.name == name)


def sgd_model(
    dtype: int = TensorProto.FLOAT,
    shape: tuple = (4, 3),
    *,
    attributes: SgdAttributes = SgdAttributes(0.25, 1e-4, False),
    lr_input: bool = False,
    extra_outputs: tuple[str, ...] = (),
) -> onnx.ModelProto:
    """A fused model of one update the way ``sgdfuse optimize`` writes it: inputs ``w``, ``grad_w``,
    ``buf_w`` (and ``lr``), stat from ``ConstantOfShape(Shape(w))`` zeros, outputs ``w_out``, ``buf_w_out``.

    ``extra_outputs`` may add ``"w_old"`` (``Identity(w)`` as an output: a read of the old value by the graph
    output) and ``"delta"`` (``Sub(w_out, w)``: a reader of the old value that depends on the update).
    """
    np_dtype = onnx_to_numpy_dtype(dtype)
    tensor = lambda name: helper.make_tensor_value_info(name, dtype, list(shape))  # noqa: E731
    initializers = [numpy_helper.from_array(np.array(0.9, dtype=np_dtype), "momentum")]
    inputs = [tensor("w"), tensor("grad_w"), tensor("buf_w")]
    if lr_input:
        inputs.append(helper.make_tensor_value_info("lr", dtype, []))
    else:
        initializers.append(numpy_helper.from_array(np.array(0.1, dtype=np_dtype), "lr"))
    zero = numpy_helper.from_array(np.zeros((1,), dtype=np_dtype), "value")
    nodes = [
        helper.make_node("Shape", ["w"], ["stat_shape"], name="stat/Shape"),
        helper.make_node("ConstantOfShape", ["stat_shape"], ["stat"], name="stat/ConstantOfShape", value=zero),
        make_sgd_node(("w", "grad_w", "lr", "buf_w", "momentum", "stat"), ("w_out", "buf_w_out", "stat_out"), attributes, name="update/SGD"),
    ]
    outputs = [tensor("w_out"), tensor("buf_w_out")]
    if "w_old" in extra_outputs:
        nodes.append(helper.make_node("Identity", ["w"], ["w_old"], name="old/Identity"))
        outputs.append(tensor("w_old"))
    if "delta" in extra_outputs:
        nodes.append(helper.make_node("Sub", ["w_out", "w"], ["delta"], name="delta/Sub"))
        outputs.append(tensor("delta"))
    graph = helper.make_graph(nodes, "sgd_graph", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    ensure_sgd_function(model)
    return model
