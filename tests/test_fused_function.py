"""The fused op's ONNX form (sgdfuse.fused_op): the node, its model-local function, and what onnxruntime
computes with it.

- The model passes ``onnx.checker`` (full check) for every dtype and every default-domain opset from 15
  to the newest the installed onnx knows.
- onnxruntime runs the function on hand-derived vectors for every such opset.
- A hypothesis property: onnxruntime executing the function and the numpy reference agree bit for bit on
  thousands of random and edge-value cases per dtype.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from sgdfuse.contract import SgdAttributes
from sgdfuse.errors import AttributeContractError
from sgdfuse.fused_op import (
    DOMAIN,
    INPUT_NAMES,
    MIN_OPSET,
    OP_TYPE,
    OUTPUT_NAMES,
    OP_VERSION,
    Specialisation,
    ensure_sgd_function,
    is_sgd_node,
    make_sgd_function,
    make_sgd_node,
    read_sgd_attributes,
)
from sgdfuse.reference import sgd
from sgdfuse.runtime import make_session, run

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
ONNX_DTYPES = {F32: TensorProto.FLOAT, F16: TensorProto.FLOAT16, BF16: TensorProto.BFLOAT16}
DTYPES = [pytest.param(F32, id="FLOAT"), pytest.param(F16, id="FLOAT16"), pytest.param(BF16, id="BFLOAT16")]
NEWEST_OPSET = onnx.defs.onnx_opset_version()
OPSETS = list(range(MIN_OPSET, NEWEST_OPSET + 1))
INF = float("inf")
NAN = float("nan")
SCALARS = ("learning_rate", "momentum")


def _model(
    dtype: np.dtype,
    opset: int,
    shape: tuple[int | str, ...] | None,
    nodes: list[tuple[str, SgdAttributes | None]],
) -> onnx.ModelProto:
    """A model with one ``ai.sgdfuse::SGD`` node per ``(prefix, attributes)``, all reading the same six graph
    inputs and writing outputs ``{prefix}parameters_out`` etc. ``attributes=None`` builds the node with no
    attributes at all (the function's defaults apply). ``shape=None`` leaves the rank unknown."""
    elem = ONNX_DTYPES[dtype]
    inputs = [helper.make_tensor_value_info(n, elem, [1] if n in SCALARS else shape) for n in INPUT_NAMES]
    outputs, graph_nodes = [], []
    for prefix, attributes in nodes:
        names = tuple(prefix + n for n in OUTPUT_NAMES)
        if attributes is None:
            node = helper.make_node(OP_TYPE, list(INPUT_NAMES), list(names), name=prefix + "sgd", domain=DOMAIN)
        else:
            node = make_sgd_node(tuple(INPUT_NAMES), names, attributes, name=prefix + "sgd")
        graph_nodes.append(node)
        outputs += [helper.make_tensor_value_info(n, elem, shape) for n in names]
    graph = helper.make_graph(graph_nodes, "sgd_graph", inputs, outputs)
    ir_version = max(8, helper.find_min_ir_version_for([helper.make_opsetid("", opset)]))  # functions need IR 8
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    ensure_sgd_function(model)
    return model


def _session_or_skip(model: onnx.ModelProto):
    try:
        return make_session(model)
    except Exception as error:  # onnxruntime older than the installed onnx: not a fault of the function
        if "opset" in str(error).lower() or "ir_version" in str(error).lower():
            pytest.skip(f"onnxruntime does not load this opset/IR version: {error}")
        raise


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint32)


def _feeds(dtype, p, g, lr, accum, m, stat) -> dict[str, np.ndarray]:
    values = dict(parameters=p, gradient=g, learning_rate=[lr], accum=accum, momentum=[m], stat=stat)
    return {name: np.array(values[name], dtype=dtype) for name in INPUT_NAMES}


def _assert_values(actual: np.ndarray, expected: list[float], dtype: np.dtype) -> None:
    assert actual.dtype == dtype
    np.testing.assert_array_equal(actual.astype(np.float64), np.array(expected, dtype=np.float64))


# --- the node and the function as ONNX -------------------------------------------------------------------


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_with_one_sgd_node_passes_full_check(dtype, opset):
    model = _model(dtype, opset, (2, 3), [("", SgdAttributes(dampening=0.1, weight_decay=0.01))])
    onnx.checker.check_model(model, full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", opset), (DOMAIN, OP_VERSION)]
    [function] = model.functions
    assert (function.domain, function.name) == (DOMAIN, OP_TYPE)
    assert list(function.input) == list(INPUT_NAMES) and list(function.output) == list(OUTPUT_NAMES)
    assert [(o.domain, o.version) for o in function.opset_import] == [("", opset)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_with_symbolic_dimensions_passes_full_check(dtype):
    model = _model(dtype, MIN_OPSET, ("N", 3), [("", SgdAttributes(nesterov=True))])
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("opset", [1, 13, 14])
def test_make_sgd_function_refuses_opset_below_15(opset):
    with pytest.raises(ValueError, match="15"):
        make_sgd_function(opset)


def test_ensure_sgd_function_refuses_a_model_below_opset_15():
    graph = helper.make_graph([], "g", [], [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    with pytest.raises(ValueError, match="15"):
        ensure_sgd_function(model)


def test_ensure_sgd_function_adds_domain_and_function_once():
    model = _model(F32, 17, (3,), [("a_", SgdAttributes()), ("b_", SgdAttributes(weight_decay=0.5))])
    ensure_sgd_function(model)
    ensure_sgd_function(model)
    assert sum(o.domain == DOMAIN for o in model.opset_import) == 1
    assert len(model.functions) == 1


def test_make_sgd_node_refuses_nesterov_with_dampening_naming_the_node():
    with pytest.raises(AttributeContractError, match="update_w1.dampening"):
        attributes = SgdAttributes(dampening=0.1, nesterov=True)
        make_sgd_node(tuple(INPUT_NAMES), tuple(OUTPUT_NAMES), attributes, name="update_w1")


def test_node_attributes_round_trip_and_default_when_absent():
    attributes = SgdAttributes(dampening=0.25, weight_decay=0.5, nesterov=False)
    node = make_sgd_node(tuple(INPUT_NAMES), tuple(OUTPUT_NAMES), attributes, name="n")
    assert is_sgd_node(node)
    assert (node.domain, node.op_type) == (DOMAIN, OP_TYPE)
    assert read_sgd_attributes(node) == attributes
    bare = helper.make_node(OP_TYPE, list(INPUT_NAMES), list(OUTPUT_NAMES), domain=DOMAIN)
    assert read_sgd_attributes(bare) == SgdAttributes()
    assert not is_sgd_node(helper.make_node(OP_TYPE, ["x"], ["y"]))  # default-domain op named SGD


# --- onnxruntime on hand-derived vectors -----------------------------------------------------------------

# Dyadic values: every intermediate is exact in fp32, so the expected numbers below are exact in all dtypes.
# V1, dampening 0.25: stat 1 / 0 / 0.5 / 2 per element; wd == 0 with parameters Inf gives no NaN.
#   accum_t = accum*0.5 + g - g*(1-stat)*0.25 = [2.5, 2, 2.25, 3, 1]; p - accum_t*0.5
V1 = dict(p=[4, 4, 4, 4, INF], g=[2, 2, 2, 2, 1], lr=0.5, accum=[1, 1, 1, 1, 0], m=0.5, stat=[1, 0, 0.5, 2, 1])
V1_ATTRIBUTES = SgdAttributes(dampening=0.25)
V1_EXPECTED = ([2.75, 3.0, 2.875, 2.5, INF], [2.5, 2.0, 2.25, 3.0, 1.0], [0, 0, 0, 0, 0])
# V2, nesterov, weight_decay 0.25, momentum 0: grad = g + p/4 = [1.25, 1.25, 1];
#   accum_t = accum*0 + grad = [Inf*0 + 1.25, 1.25, 1] = [NaN, 1.25, 1]; p - (grad + accum_t*0)*0.5;
#   accum and stat keep their input values.
V2 = dict(p=[1, 1, 2], g=[1, 1, 0.5], lr=0.5, accum=[INF, 2, 1], m=0.0, stat=[0, 1, 0])
V2_ATTRIBUTES = SgdAttributes(weight_decay=0.25, nesterov=True)
V2_EXPECTED = ([NAN, 0.375, 1.5], [INF, 2, 1], [0, 1, 0])
VECTORS = [
    pytest.param(V1, V1_ATTRIBUTES, V1_EXPECTED, id="dampening-stat-mixed"),
    pytest.param(V2, V2_ATTRIBUTES, V2_EXPECTED, id="nesterov-wd-momentum0-inf"),
]


@pytest.mark.parametrize(("vector", "attributes", "expected"), VECTORS)
@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_onnxruntime_runs_the_function_to_hand_derived_values(dtype, opset, vector, attributes, expected):
    session = _session_or_skip(_model(dtype, opset, (len(vector["p"]),), [("", attributes)]))
    outputs = run(session, _feeds(dtype, **vector))
    for name, values in zip(OUTPUT_NAMES, expected):
        _assert_values(outputs[name], values, dtype)


@pytest.mark.parametrize(
    ("dtype", "precision", "one_bits"),
    [pytest.param(F16, 11, 0x3C00, id="FLOAT16"), pytest.param(BF16, 8, 0x3F80, id="BFLOAT16")],
)
def test_onnxruntime_rounds_back_half_way_to_even(dtype, precision, one_bits):
    half = 2.0**-precision  # half the spacing just above 1.0
    # p - g = [1 + half, 1 + 3*half, 1 + 1.25*half, -1 - half] -> [1, 1 + 2ulp, 1 + ulp, -1]
    p, g = [1, 1 + 2 * half, 1, -1], [-half, -half, -1.25 * half, half]
    vector = dict(p=p, g=g, lr=1, accum=[0] * 4, m=0, stat=[1] * 4)
    session = make_session(_model(dtype, 17, (4,), [("", SgdAttributes())]))
    outputs = run(session, _feeds(dtype, **vector))
    expected = np.array([one_bits, one_bits + 2, one_bits + 1, 0x8000 | one_bits], np.uint16)
    np.testing.assert_array_equal(_bits(outputs["parameters_out"]), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_onnxruntime_keeps_negative_zero_where_the_contract_selects_it(dtype):
    # m = 0 keeps accum and stat as given, -0 included. The weights: grad = g = +0;
    # accum_t = (-0)*0 + (+0) = +0; p_out = -0 - (+0)*1 = -0. onnxruntime's Where returns +0 for a selected
    # -0 (microsoft/onnxruntime#32191), so a body built on Where fails this.
    vector = dict(p=[-0.0], g=[0.0], lr=1, accum=[-0.0], m=0.0, stat=[-0.0])
    session = make_session(_model(dtype, 17, (1,), [("", SgdAttributes())]))
    outputs = run(session, _feeds(dtype, **vector))
    for name in OUTPUT_NAMES:
        assert np.signbit(outputs[name].astype(np.float32)).all(), f"{name} is {outputs[name]}, expected -0"


def test_one_function_serves_nodes_with_different_attributes_and_defaults():
    # Attribute references in the body resolve per call site; a node without attributes gets 0, 0, false.
    model = _model(F32, 18, (5,), [("v1_", V1_ATTRIBUTES), ("bare_", None), ("v2_", V2_ATTRIBUTES)])
    onnx.checker.check_model(model, full_check=True)
    session = make_session(model)
    outputs = run(session, _feeds(F32, **V1))
    for name, values in zip(OUTPUT_NAMES, V1_EXPECTED):
        _assert_values(outputs["v1_" + name], values, F32)
    # Defaults on V1's data: accum_t = accum*0.5 + g = [2.5]*4 + [1]; p - accum_t*0.5; stat <- 0
    _assert_values(outputs["bare_parameters_out"], [2.75, 2.75, 2.75, 2.75, INF], F32)
    _assert_values(outputs["bare_accum_out"], [2.5, 2.5, 2.5, 2.5, 1], F32)
    # V2's attributes on V1's data: grad = g + p/4 = [3, 3, 3, 3, Inf]; accum_t = accum*0.5 + grad;
    # nesterov: p - (grad + accum_t*0.5)*0.5 = 4 - (3 + 1.75)*0.5; Inf - Inf = NaN in the last element.
    _assert_values(outputs["v2_accum_out"], [3.5, 3.5, 3.5, 3.5, INF], F32)
    _assert_values(outputs["v2_parameters_out"], [1.625, 1.625, 1.625, 1.625, NAN], F32)


# --- property: onnxruntime == reference, bit for bit ------------------------------------------------------

PROPERTY_EXAMPLES = 2000
PROPERTY_OPSET = 18
MAX_ELEMENTS = 32

# Attributes come from small fixed sets so that one onnxruntime session per combination can be cached
# (models are built with unknown rank, so one session serves every shape). The sets hold the zero cases
# (+0 and -0 both mean "off"), ordinary values, a value not exact in fp32 (1/3), and fp32-edge values:
# 1e-45 becomes the smallest fp32 subnormal (non-zero), 1e-46 becomes 0 (attributes are FLOAT).
DAMPENINGS = (0.0, -0.0, 0.1, 0.5, 1.0, 1 / 3, 1e-45)
NESTEROV_DAMPENINGS = (0.0, -0.0)  # nesterov needs dampening == 0
WEIGHT_DECAYS = (0.0, -0.0, 0.01, 0.5, 2.0, 1 / 3, 1e-45, 1e-46)


@st.composite
def _attributes(draw) -> SgdAttributes:
    nesterov = draw(st.booleans())
    dampening = draw(st.sampled_from(NESTEROV_DAMPENINGS if nesterov else DAMPENINGS))
    return SgdAttributes(dampening, draw(st.sampled_from(WEIGHT_DECAYS)), nesterov)


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What the strategies need to know about one dtype."""

    dtype: np.dtype
    uint: type
    precision: int  # significand bits, the implicit one included
    nan_bits: tuple[int, ...]  # -qNaN, +sNaN, -sNaN (+qNaN comes from float("nan"))

    @property
    def width(self) -> int:
        return self.dtype.itemsize * 8

    def to_bits(self, value: float) -> int:
        with np.errstate(all="ignore"):
            return int(np.array([value], dtype=np.float32).astype(self.dtype).view(self.uint)[0])

    def finfo(self):
        return ml_dtypes.finfo(self.dtype) if self.dtype == BF16 else np.finfo(self.dtype)

    def edge_bits(self) -> tuple[int, ...]:
        info = self.finfo()
        sub, normal, big = float(info.smallest_subnormal), float(info.smallest_normal), float(info.max)
        values = [0.0, -0.0, INF, -INF, NAN, sub, -sub, normal - sub, -(normal - sub), normal, -normal, big, -big]
        values += [1.0, -1.0, 0.5, 2.0, 3.0, 1.5 * sub, 3 * sub]
        return tuple(self.to_bits(v) for v in values) + self.nan_bits


KINDS = {
    F32: _Kind(F32, np.uint32, 24, (0xFFC00000, 0x7F800001, 0xFFA00000)),
    F16: _Kind(F16, np.uint16, 11, (0xFE00, 0x7C01, 0xFD00)),
    BF16: _Kind(BF16, np.uint16, 8, (0xFFC0, 0x7F81, 0xFFA0)),
}


@st.composite
def _shapes(draw) -> tuple[int, ...]:
    rank = draw(st.integers(1, 8))
    shape: list[int] = []
    for _ in range(rank):
        room = MAX_ELEMENTS // math.prod(shape)
        shape.append(draw(st.integers(1, max(1, min(3, room)))))
    return tuple(shape)


def _element_bits(kind: _Kind) -> st.SearchStrategy[int]:
    """One element as its bit pattern: edge values, ordinary values, or any bit pattern at all."""
    ordinary_width = 16 if kind.dtype == F16 else 32  # BFLOAT16: draw fp32, round to nearest even
    return st.one_of(
        st.sampled_from(kind.edge_bits()),
        st.floats(-4, 4, width=ordinary_width).map(kind.to_bits),
        st.floats(-4, 4, width=ordinary_width).map(kind.to_bits),  # twice: mostly finite, ordinary data
        st.integers(0, (1 << kind.width) - 1),
    )


def _scalar_bits(kind: _Kind, nice: tuple[float, ...]) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([kind.to_bits(v) for v in nice]), _element_bits(kind))


def _array(kind: _Kind, bits: list[int], shape: tuple[int, ...]) -> np.ndarray:
    return np.array(bits, dtype=kind.uint).view(kind.dtype).reshape(shape)


def _half_ulps(kind: _Kind, values: np.ndarray) -> np.ndarray:
    """Half the spacing of ``kind`` at each (normal, non-zero) value: |v| in [2^(e-1), 2^e) -> 2^(e-P-1)."""
    _, exponent = np.frexp(np.abs(values.astype(np.float64)))
    return np.ldexp(1.0, exponent - kind.precision - 1)


@st.composite
def _sgd_cases(draw, kind: _Kind) -> tuple[SgdAttributes, dict[str, np.ndarray], str]:
    attributes = draw(_attributes())
    shape = draw(_shapes())
    n = math.prod(shape)
    elements = st.lists(_element_bits(kind), min_size=n, max_size=n)
    mode = draw(st.sampled_from(["random", "random", "tie_weights", "tie_accum"]))
    event(f"mode {mode}")

    stat_mode = draw(st.sampled_from(["zeros", "ones", "mixed01", "any"]))
    if stat_mode == "any":
        stat_bits = draw(elements)
    else:
        choices = {"zeros": [0.0], "ones": [1.0], "mixed01": [0.0, 1.0]}[stat_mode]
        stat_bits = draw(st.lists(st.sampled_from([kind.to_bits(v) for v in choices]), min_size=n, max_size=n))
    lr_bits = draw(_scalar_bits(kind, (1.0, 0.5, 0.1, 0.01, -0.1, 0.0, -0.0)))
    m_bits = draw(_scalar_bits(kind, (0.0, -0.0, 0.9, 0.5, 1.0, 0.99)))
    p = _array(kind, draw(elements), shape)
    g = _array(kind, draw(elements), shape)
    accum = _array(kind, draw(elements), shape)

    if mode != "random":
        # Values whose fp32 result lies exactly half-way between two values of the dtype (or, for FLOAT, an
        # fp32 operation whose exact result is half-way): base + k*half_ulp(base) with k odd.
        magnitudes = draw(st.lists(st.floats(0.125, 8.0, width=32), min_size=n, max_size=n))
        signs = draw(st.lists(st.sampled_from([1.0, -1.0]), min_size=n, max_size=n))
        base = (np.array(magnitudes, np.float32) * np.array(signs, np.float32)).astype(kind.dtype).reshape(shape)
        k = np.array(draw(st.lists(st.sampled_from([1.0, -1.0, 3.0, -3.0]), min_size=n, max_size=n))).reshape(shape)
        offset = (k * _half_ulps(kind, base)).astype(np.float32).astype(kind.dtype)
        if mode == "tie_weights":  # lr = 1, accum = 0, stat = 1: p_out = p - g = base + k*half
            p, g = base, -offset
            accum = np.zeros(shape, kind.dtype)
            lr_bits = kind.to_bits(1.0)
            stat_bits = [kind.to_bits(1.0)] * n
            m_bits = draw(st.sampled_from([kind.to_bits(v) for v in (0.0, -0.0, 0.5)]))
        else:  # m = 1: accum_t = accum + g = base + k*half
            accum, g = base, offset
            m_bits = kind.to_bits(1.0)

    stat = _array(kind, stat_bits, shape)
    lr = _array(kind, [lr_bits], (1,))
    m = _array(kind, [m_bits], (1,))
    feeds = dict(parameters=p, gradient=g, learning_rate=lr, accum=accum, momentum=m, stat=stat)
    return attributes, feeds, mode


def _nan_mask(array: np.ndarray) -> np.ndarray:
    return np.isnan(array.astype(np.float32))


def _assert_bitwise_equal(name: str, actual: np.ndarray, expected: np.ndarray, feeds: dict, attributes) -> None:
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    # NaN matches NaN whatever its sign and payload: the contract says nothing about NaN bits, and
    # onnxruntime's casts and numpy's produce different payloads. Every other value (+0 and -0 included)
    # must have the same bits.
    actual_nan, expected_nan = _nan_mask(actual), _nan_mask(expected)
    differ = (actual_nan != expected_nan) | (~actual_nan & ~expected_nan & (_bits(actual) != _bits(expected)))
    if differ.any():
        index = tuple(int(i) for i in np.argwhere(differ)[0])
        inputs = {k: v.reshape(-1)[0] if v.size == 1 else v[index] for k, v in feeds.items()}
        pytest.fail(
            f"{name}[{index}]: onnxruntime {actual[index]} (bits {_bits(actual)[index]:#x}) != reference "
            f"{expected[index]} (bits {_bits(expected)[index]:#x}); {differ.sum()} of {differ.size} differ; "
            f"inputs {inputs}; {attributes}"
        )


def _rounding_ties(x32: np.ndarray, dtype: np.dtype) -> int:
    """How many finite fp32 values lie exactly half-way between two finite values of ``dtype``."""
    x32 = x32[np.isfinite(x32)]
    with np.errstate(all="ignore"):
        rounded = x32.astype(dtype)
    keep = np.isfinite(rounded.astype(np.float32)) & (rounded.astype(np.float32) != x32)
    x, rounded = x32[keep].astype(np.float64), rounded[keep]
    toward = np.where(x > rounded.astype(np.float64), INF, -INF).astype(dtype)
    with np.errstate(all="ignore"):  # the neighbour of the largest finite value is Inf: never a tie
        neighbour = np.nextafter(rounded, toward)
    return int(np.sum(2 * x == rounded.astype(np.float64) + neighbour.astype(np.float64)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_onnxruntime_function_matches_reference_bit_for_bit(dtype, capsys, record_property):
    kind = KINDS[dtype]
    smallest_normal = float(kind.finfo().smallest_normal)
    sessions: dict[SgdAttributes, object] = {}
    counts = collections.Counter()
    seen: dict[str, set] = collections.defaultdict(set)

    # derandomize: CI runs the same 2,000+ examples every time; database=None: nothing is replayed from
    # earlier local runs, so the count and the time are the same everywhere.
    @settings(
        max_examples=PROPERTY_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=_sgd_cases(kind))
    def check(case):
        attributes, feeds, mode = case
        if attributes not in sessions:
            sessions[attributes] = make_session(_model(dtype, PROPERTY_OPSET, None, [("", attributes)]))
        actual = run(sessions[attributes], feeds)
        expected = dict(zip(OUTPUT_NAMES, sgd(*(feeds[n] for n in INPUT_NAMES), **dataclasses.asdict(attributes))))
        for name in OUTPUT_NAMES:
            _assert_bitwise_equal(name, actual[name], expected[name], feeds, attributes)

        # What the run covered, for the summary and the coverage asserts below.
        counts["examples"] += 1
        counts["half_way_constructions"] += mode != "random"
        counts["elements"] += feeds["parameters"].size
        counts["nan_weights"] += int(_nan_mask(expected["parameters_out"]).sum())
        for name in ("parameters", "gradient", "accum", "stat"):
            with np.errstate(all="ignore"):
                values = np.abs(feeds[name].astype(np.float32))
                counts["subnormal_inputs"] += int(np.sum((values > 0) & (values < smallest_normal)))
        m = feeds["momentum"].astype(np.float32)[0]
        counts["momentum_zero"] += int(m == 0)
        counts["momentum_negative_zero"] += int(m == 0 and np.signbit(m))
        seen["rank"].add(feeds["parameters"].ndim)
        seen["dampening"].add(abs(attributes.dampening))
        seen["weight_decay"].add(attributes.weight_decay)
        seen["nesterov"].add(attributes.nesterov)
        if dtype != F32:  # results rounded back from an exact half-way fp32 value
            wide = sgd(*(feeds[n].astype(np.float32) for n in INPUT_NAMES), **dataclasses.asdict(attributes))
            accum_written = float(m) != 0
            ties = _rounding_ties(wide[0], dtype) + (_rounding_ties(wide[1], dtype) if accum_written else 0)
            counts["half_way_round_backs"] += ties
            if ties:
                event("rounded back from a half-way value")

    start = time.perf_counter()
    check()
    seconds = time.perf_counter() - start

    summary = (
        f"ORT == reference, {dtype.name}: {counts['examples']} examples in {seconds:.1f} s "
        f"({len(sessions)} sessions); {counts['elements']} elements, {counts['subnormal_inputs']} subnormal inputs, "
        f"{counts['nan_weights']} NaN weights, {counts['half_way_constructions']} examples built half-way, "
        f"{counts['half_way_round_backs'] if dtype != F32 else 'n/a'} half-way round-backs to {dtype.name}, "
        f"momentum 0 in {counts['momentum_zero']} ({counts['momentum_negative_zero']} of them -0)"
    )
    for key, value in counts.items():
        record_property(key, value)
    record_property("seconds", round(seconds, 2))
    with capsys.disabled():  # the count and the time belong in the CI log, even with -q
        print(f"\n{summary}")

    assert counts["examples"] >= PROPERTY_EXAMPLES, summary
    assert seen["rank"] == set(range(1, 9)), summary
    assert seen["dampening"] >= {abs(d) for d in DAMPENINGS} and seen["nesterov"] == {False, True}, summary
    assert seen["weight_decay"] == set(WEIGHT_DECAYS), summary
    assert counts["momentum_negative_zero"] > 0 and counts["subnormal_inputs"] > 0, summary
    if dtype != F32:
        assert counts["half_way_round_backs"] >= 100, f"the strategy no longer produces half-way cases: {summary}"


# --- specialised bodies (function overloads) --------------------------------------------------------------
#
# Each Specialisation is a body with what the rewrite proved folded away. It must compute the contract bit for
# bit on every input that meets its preconditions: the same property as above, run for every specialisation,
# with the cases restricted to those preconditions (attributes zero or not as the overload says, a non-zero
# momentum for "mconst", stat = +0 for "stat0", learning rate and momentum of shape [1]).

SPECIALISATIONS = [
    Specialisation(ONNX_DTYPES[dtype], nesterov, dampening, weight_decay, momentum_nonzero, stat_zero)
    for dtype in (F32, F16, BF16)
    for nesterov in (False, True)
    for dampening in ((False,) if nesterov else (False, True))
    for weight_decay in (False, True)
    for momentum_nonzero in (False, True)
    for stat_zero in (False, True)
]
SPECIALISATION_EXAMPLES = 60  # per specialisation in every run; the per-dtype run below adds 2,000 (slow)
# Attribute sets kept small (one session per attribute combination): the "off" values include -0 and 1e-46
# (stored as fp32 0), the "on" values one not exact in fp32 and the smallest fp32 subnormal.
SPECIALISED_OFF = (0.0, -0.0, 1e-46)
SPECIALISED_DAMPENINGS = (0.1, 1 / 3, 1e-45)
SPECIALISED_WEIGHT_DECAYS = (0.5, 1 / 3, 1e-45)
NONZERO_MOMENTA = (0.9, 0.5, 1.0, -0.5, INF, NAN)  # and the dtype's smallest subnormal


def _specialised_model(spec: Specialisation, attributes: SgdAttributes) -> onnx.ModelProto:
    dtype = spec.dtype
    inputs = [helper.make_tensor_value_info(n, dtype, [1] if n in SCALARS else None) for n in INPUT_NAMES]
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in OUTPUT_NAMES]
    node = make_sgd_node(tuple(INPUT_NAMES), tuple(OUTPUT_NAMES), attributes, name="sgd", specialisation=spec)
    graph = helper.make_graph([node], "sgd_graph", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", PROPERTY_OPSET)], ir_version=10)
    ensure_sgd_function(model)
    return model


@st.composite
def _specialised_cases(draw, kind: _Kind, spec: Specialisation) -> tuple[SgdAttributes, dict[str, np.ndarray], str]:
    """A case of :func:`_sgd_cases` brought within ``spec``'s preconditions."""
    _, feeds, mode = draw(_sgd_cases(kind))
    off = NESTEROV_DAMPENINGS if spec.nesterov else SPECIALISED_OFF  # the contract refuses nesterov with 1e-46
    dampening = draw(st.sampled_from(SPECIALISED_DAMPENINGS if spec.dampening else off))
    weight_decay = draw(st.sampled_from(SPECIALISED_WEIGHT_DECAYS if spec.weight_decay else SPECIALISED_OFF))
    attributes = SgdAttributes(dampening, weight_decay, spec.nesterov)
    if spec.momentum_nonzero and feeds["momentum"].astype(np.float32)[0] == 0:
        value = draw(st.sampled_from(NONZERO_MOMENTA + (float(kind.finfo().smallest_subnormal),)))
        feeds["momentum"] = _array(kind, [kind.to_bits(value)], (1,))
    if spec.stat_zero:
        feeds["stat"] = np.zeros_like(feeds["stat"])
    return attributes, feeds, mode


def _check_case(sessions: dict, spec: Specialisation, attributes: SgdAttributes, feeds: dict[str, np.ndarray]) -> dict:
    key = (spec, attributes)
    if key not in sessions:
        sessions[key] = make_session(_specialised_model(spec, attributes))
    actual = run(sessions[key], feeds)
    expected = dict(zip(OUTPUT_NAMES, sgd(*(feeds[n] for n in INPUT_NAMES), **dataclasses.asdict(attributes))))
    for name in OUTPUT_NAMES:
        _assert_bitwise_equal(f"{spec.overload}: {name}", actual[name], expected[name], feeds, attributes)
    return expected


def test_specialisations_cover_every_assumption_once_with_distinct_names():
    names = [spec.overload for spec in SPECIALISATIONS]
    assert len(names) == len(set(names)) == 72
    assert all(Specialisation.from_overload(spec.overload) == spec for spec in SPECIALISATIONS)
    assert Specialisation(TensorProto.FLOAT, False, False, False, True, True).overload == "f32_plain_nodamp_nowd_mconst_stat0"
    with pytest.raises(ValueError, match="overload name"):
        Specialisation.from_overload("f32_plain")
    with pytest.raises(ValueError, match="nesterov"):
        Specialisation(TensorProto.FLOAT, True, True, False, True, True)


@pytest.mark.parametrize("spec", SPECIALISATIONS, ids=lambda s: s.overload)
def test_specialised_body_folds_what_it_assumes(spec):
    function = make_sgd_function(PROPERTY_OPSET, spec)
    assert (function.domain, function.name, function.overload) == (DOMAIN, OP_TYPE, spec.overload)
    op_types = [node.op_type for node in function.node]
    references = {a.ref_attr_name for node in function.node for a in node.attribute if a.ref_attr_name}
    assert ("Cast" in op_types) == (spec.dtype != TensorProto.FLOAT)
    assert ("If" in op_types) == (not spec.momentum_nonzero)
    assert "Reshape" not in op_types and "CastLike" not in op_types
    assert references == {name for name, on in (("dampening", spec.dampening), ("weight_decay", spec.weight_decay)) if on}
    if spec.stat_zero:  # stat is only passed through: no (1 - stat), no zeros built every run
        assert [n.op_type for n in function.node if "stat" in n.input] == ["Identity"]
    general = make_sgd_function(PROPERTY_OPSET)
    assert len(function.node) < len(general.node)


def test_make_sgd_node_refuses_a_specialisation_the_attributes_contradict():
    spec = Specialisation(TensorProto.FLOAT, False, False, False, True, True)
    with pytest.raises(ValueError, match="update_w1.*f32_plain_nodamp_nowd_mconst_stat0"):
        make_sgd_node(tuple(INPUT_NAMES), tuple(OUTPUT_NAMES), SgdAttributes(dampening=0.1), name="update_w1", specialisation=spec)
    # 1e-46 is stored as fp32 0: "off", so the nodamp body is the right one.
    node = make_sgd_node(tuple(INPUT_NAMES), tuple(OUTPUT_NAMES), SgdAttributes(dampening=1e-46), name="n", specialisation=spec)
    assert is_sgd_node(node) and node.overload == spec.overload


@pytest.mark.parametrize("opset", [MIN_OPSET, NEWEST_OPSET])
def test_model_calling_every_specialisation_passes_full_check(opset):
    nodes, outputs = [], []
    for k, spec in enumerate(SPECIALISATIONS):
        attributes = SgdAttributes(0.25 if spec.dampening else 0.0, 0.5 if spec.weight_decay else 0.0, spec.nesterov)
        names = tuple(f"{k}_{n}" for n in OUTPUT_NAMES)
        inputs = tuple(f"{TAGS[spec.dtype]}_{n}" for n in INPUT_NAMES)
        nodes.append(make_sgd_node(inputs, names, attributes, name=f"sgd_{k}", specialisation=spec))
        outputs += [helper.make_tensor_value_info(n, spec.dtype, (3,)) for n in names]
    inputs = [
        helper.make_tensor_value_info(f"{tag}_{n}", dtype, [1] if n in SCALARS else [3])
        for dtype, tag in TAGS.items()
        for n in INPUT_NAMES
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    ensure_sgd_function(model)
    ensure_sgd_function(model)
    assert model.ir_version == 10  # node overloads are IR 10
    assert sorted(f.overload for f in model.functions) == sorted(s.overload for s in SPECIALISATIONS)
    onnx.checker.check_model(model, full_check=True)


TAGS = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}


@pytest.mark.parametrize("spec", [s for s in SPECIALISATIONS if not s.momentum_nonzero], ids=lambda s: s.overload)
def test_specialised_body_keeps_negative_zero_where_the_contract_selects_it(spec):
    # momentum 0 keeps accum (and stat) as given, -0 included: the If-instead-of-Where reason, per overload.
    dtype = onnx.helper.tensor_dtype_to_np_dtype(spec.dtype) if spec.dtype != TensorProto.BFLOAT16 else BF16
    stat = [0.0] if spec.stat_zero else [-0.0]
    feeds = _feeds(dtype, p=[-0.0], g=[0.0], lr=1, accum=[-0.0], m=-0.0, stat=stat)
    attributes = SgdAttributes(0.25 if spec.dampening else 0.0, 0.5 if spec.weight_decay else 0.0, spec.nesterov)
    expected = _check_case({}, spec, attributes, feeds)
    assert np.signbit(expected["accum_out"].astype(np.float32)).all()


@pytest.mark.parametrize("spec", SPECIALISATIONS, ids=lambda s: s.overload)
def test_specialised_body_matches_reference_bit_for_bit(spec):
    kind = KINDS[{TensorProto.FLOAT: F32, TensorProto.FLOAT16: F16, TensorProto.BFLOAT16: BF16}[spec.dtype]]
    sessions: dict = {}
    counts = collections.Counter()

    @settings(
        max_examples=SPECIALISATION_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=_specialised_cases(kind, spec))
    def check(case):
        attributes, feeds, _ = case
        _check_case(sessions, spec, attributes, feeds)
        counts["examples"] += 1

    check()
    assert counts["examples"] >= SPECIALISATION_EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_specialised_bodies_match_reference_bit_for_bit_2000_per_dtype(dtype, capsys):
    # The per-dtype run of the property over that dtype's specialisations: 2,000 examples, each drawing
    # which specialisation it runs.
    kind = KINDS[dtype]
    specs = [s for s in SPECIALISATIONS if s.dtype == ONNX_DTYPES[dtype]]
    sessions: dict = {}
    counts = collections.Counter()

    @st.composite
    def cases(draw):
        spec = draw(st.sampled_from(specs))
        return (spec, *draw(_specialised_cases(kind, spec)))

    @settings(
        max_examples=PROPERTY_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=cases())
    def check(case):
        spec, attributes, feeds, _ = case
        _check_case(sessions, spec, attributes, feeds)
        counts["examples"] += 1
        counts[spec.overload] += 1

    start = time.perf_counter()
    check()
    with capsys.disabled():
        print(f"\nspecialised ORT == reference, {dtype.name}: {counts['examples']} examples over {len(specs)} overloads "
              f"in {time.perf_counter() - start:.1f} s ({len(sessions)} sessions)")
    assert counts["examples"] >= PROPERTY_EXAMPLES
    assert all(counts[s.overload] > 0 for s in specs)
