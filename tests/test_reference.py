"""The numpy reference against hand-derived vectors, one clause of docs/contract.md per test.

Every expected value here is derived by hand from the contract text, never by calling the code under
test. Most vectors use small dyadic numbers (1, 0.5, 0.25, ...) so that every intermediate of the formula
is exact in fp32: the expected numbers below are then exact, and the comparison is exact too. The worked
example of the contract page uses decimals; there the expected value is both the page's printed numbers
(to fp32 precision) and the formula written out inline with one ``np.float32`` rounding per operation.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from sgdfuse.reference import sgd

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES = (F32, F16, BF16)
DTYPE_IDS = ("FLOAT", "FLOAT16", "BFLOAT16")
INF = float("inf")
NAN = float("nan")


def _call(dtype, p, g, lr, accum, m, stat, **attributes):
    """Run the reference on Python lists, every tensor in ``dtype``; the values must be exact in it."""

    def arr(values):
        return np.array(values, dtype=dtype)

    return sgd(arr(p), arr(g), arr([lr]), arr(accum), arr([m]), arr(stat), **attributes)


def _assert_values(actual: np.ndarray, expected: list[float], dtype: np.dtype) -> None:
    """Exact comparison in float64 (every value of the three dtypes is exact there); NaN matches NaN."""
    assert actual.dtype == dtype
    np.testing.assert_array_equal(actual.astype(np.float64), np.array(expected, dtype=np.float64))


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint32)


# --- the worked example of docs/contract.md, FLOAT ------------------------------------------------------

WORKED = dict(p=[1.0, 2.0, 3.0], g=[0.1, 0.2, 0.3], accum=[0.5, 0.5, INF], stat=[1.0, 0.0, 0.0], lr=0.1)
WORKED_ATTRIBUTES = dict(dampening=0.1, weight_decay=0.01)


def _worked_example_inline(m_value: float) -> tuple[list, list]:
    """The contract formula written out for the worked example, one fp32 rounding per operation."""
    f = np.float32
    lr, m, d, wd = f(WORKED["lr"]), f(m_value), f(0.1), f(0.01)
    p_out, accum_out = [], []
    with np.errstate(all="ignore"):
        for p, g, a, s in zip(*(map(f, WORKED[k]) for k in ("p", "g", "accum", "stat"))):
            grad = g + p * wd
            accum_t = a * m + grad
            accum_t = accum_t - grad * (f(1) - s) * d
            p_out.append(p - accum_t * lr)
            accum_out.append(accum_t)
    return p_out, accum_out


def test_worked_example_momentum_09_gives_contract_values_not_mindspore_cpu():
    p_out, accum_out, stat_out = _call(F32, m=0.9, **WORKED, **WORKED_ATTRIBUTES)
    # The page: "the contract [.944, 1.9352, -inf]" (MindSpore CPU would give .989 for the first element).
    # By hand: grad = [.11, .22, .33]; accum_t = [.45+.11, .45+.22-.022, inf] = [.56, .648, inf].
    np.testing.assert_allclose(p_out, [0.944, 1.9352, -INF], rtol=1e-6)
    np.testing.assert_allclose(accum_out, [0.56, 0.648, INF], rtol=1e-6)
    _assert_values(stat_out, [0.0, 0.0, 0.0], F32)
    inline_p, inline_accum = _worked_example_inline(0.9)
    np.testing.assert_array_equal(_bits(p_out), _bits(np.array(inline_p, dtype=F32)))
    np.testing.assert_array_equal(_bits(accum_out), _bits(np.array(inline_accum, dtype=F32)))


def test_worked_example_momentum_zero_gives_nan_from_inf_accum_and_keeps_state():
    p_out, accum_out, stat_out = _call(F32, m=0.0, **WORKED, **WORKED_ATTRIBUTES)
    # The page: "the contract [.989, 1.9802, NaN]" (MindSpore CPU would give [.989, 1.978, 2.967]).
    # By hand: accum*0 = [0, 0, NaN]; accum_t = [.11, .22-.022, NaN]; p = [1-.011, 2-.0198, NaN].
    np.testing.assert_allclose(p_out, [0.989, 1.9802, NAN], rtol=1e-6)
    _assert_values(accum_out, [0.5, 0.5, INF], F32)
    _assert_values(stat_out, [1.0, 0.0, 0.0], F32)
    inline_p, _ = _worked_example_inline(0.0)
    np.testing.assert_array_equal(_bits(p_out[:2]), _bits(np.array(inline_p[:2], dtype=F32)))


# --- weight decay ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_weight_decay_adds_decayed_parameters_to_gradient(dtype):
    p_out, accum_out, stat_out = _call(
        dtype, p=[2, -4, 8], g=[1, 1, -1], lr=0.5, accum=[2, 0, 4], m=0.5, stat=[0, 0, 0], weight_decay=0.25
    )
    # grad = g + p*0.25 = [1.5, 0, 1]; accum_t = accum*0.5 + grad = [2.5, 0, 3]; p - accum_t*0.5
    _assert_values(p_out, [2 - 1.25, -4 - 0, 8 - 1.5], dtype)
    _assert_values(accum_out, [2.5, 0, 3], dtype)
    _assert_values(stat_out, [0, 0, 0], dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_weight_decay_zero_uses_gradient_even_where_parameters_is_inf(dtype):
    # wd == 0 means grad = gradient, not gradient + parameters * 0: Inf * 0 would be NaN.
    p_out, accum_out, _ = _call(dtype, p=[INF, -INF, 1], g=[1, 2, 4], lr=0.5, accum=[0, 0, 0], m=0.5, stat=[0, 0, 0])
    _assert_values(accum_out, [1, 2, 4], dtype)
    _assert_values(p_out, [INF, -INF, 1 - 2], dtype)
    assert not np.isnan(p_out.astype(np.float32)).any()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_weight_decay_nonzero_carries_inf_parameters_into_gradient(dtype):
    p_out, accum_out, _ = _call(
        dtype, p=[INF, -INF, 1], g=[1, 2, 4], lr=0.5, accum=[0, 0, 0], m=0.5, stat=[0, 0, 0], weight_decay=0.5
    )
    # grad = [Inf, -Inf, 4.5]; p - grad*0.5 = [Inf - Inf, -Inf + Inf, 1 - 2.25]
    _assert_values(accum_out, [INF, -INF, 4.5], dtype)
    _assert_values(p_out, [NAN, NAN, -1.25], dtype)


# --- dampening and stat ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_dampening_skipped_where_stat_is_one_applied_where_zero_scaled_elsewhere(dtype):
    p_out, accum_out, stat_out = _call(
        dtype, p=[4, 4, 4, 4], g=[2, 2, 2, 2], lr=0.5, accum=[1, 1, 1, 1], m=0.5, stat=[1, 0, 0.5, 2], dampening=0.25
    )
    # accum_t = 1*0.5 + 2 = 2.5, then minus grad*(1-stat)*d = 2*(1-stat)*0.25 = [0, 0.5, 0.25, -0.5]
    _assert_values(accum_out, [2.5, 2.0, 2.25, 3.0], dtype)
    _assert_values(p_out, [4 - 1.25, 4 - 1.0, 4 - 1.125, 4 - 1.5], dtype)
    _assert_values(stat_out, [0, 0, 0, 0], dtype)


@pytest.mark.parametrize("stat", [[1, 1, 1], [0, 0, 0]], ids=["stat-all-one", "stat-all-zero"])
def test_dampening_with_uniform_stat(stat):
    p_out, accum_out, _ = _call(
        F32, p=[4, 4, 4], g=[2, 2, 2], lr=0.5, accum=[1, 1, 1], m=0.5, stat=stat, dampening=0.25
    )
    # stat 1 -> no dampening: accum_t = 2.5; stat 0 -> accum_t = 2.5 - 2*0.25 = 2
    expected_accum = 2.5 if stat[0] == 1 else 2.0
    _assert_values(accum_out, [expected_accum] * 3, F32)
    _assert_values(p_out, [4 - expected_accum * 0.5] * 3, F32)


def test_dampening_zero_ignores_stat_even_when_stat_is_inf():
    # The dampening term is not evaluated at all when d == 0 (else grad*(1-Inf)*0 would be NaN).
    p_out, accum_out, stat_out = _call(F32, p=[4, 4, 4], g=[2, 2, 2], lr=0.5, accum=[1, 1, 1], m=0.5, stat=[1, 0, INF])
    _assert_values(accum_out, [2.5, 2.5, 2.5], F32)
    _assert_values(p_out, [2.75, 2.75, 2.75], F32)
    _assert_values(stat_out, [0, 0, 0], F32)


# --- nesterov -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_nesterov_steps_by_grad_plus_momentum_times_updated_accum(dtype):
    args = dict(p=[1, 1], g=[0.5, -1], lr=0.25, accum=[2, 4], m=0.5, stat=[0, 0])
    p_nesterov, accum_nesterov, _ = _call(dtype, nesterov=True, **args)
    p_plain, accum_plain, _ = _call(dtype, nesterov=False, **args)
    # accum_t = accum*0.5 + g = [1.5, 1]
    _assert_values(accum_nesterov, [1.5, 1.0], dtype)
    _assert_values(accum_plain, [1.5, 1.0], dtype)
    # nesterov: p - (g + accum_t*0.5)*0.25 = [1 - 1.25*0.25, 1 - (-0.5)*0.25]; plain: p - accum_t*0.25
    _assert_values(p_nesterov, [0.6875, 1.125], dtype)
    _assert_values(p_plain, [0.625, 0.75], dtype)


# --- momentum == 0 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [0.0, -0.0], ids=["m=+0", "m=-0"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_momentum_zero_keeps_accum_and_stat_but_updates_weights(dtype, m):
    p_out, accum_out, stat_out = _call(
        dtype, p=[1, 1], g=[1, 2], lr=0.5, accum=[3, -1], m=m, stat=[1, 0.5], dampening=0.5
    )
    # accum_t = accum*0 + g = [1, 2], minus g*(1-stat)*0.5 = [0, 0.5] -> [1, 1.5]; p - accum_t*0.5
    _assert_values(p_out, [0.5, 0.25], dtype)
    _assert_values(accum_out, [3, -1], dtype)
    _assert_values(stat_out, [1, 0.5], dtype)


@pytest.mark.parametrize("nesterov", [False, True], ids=["plain", "nesterov"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_momentum_zero_keeps_accum_but_propagates_nan(dtype, nesterov):
    p_out, accum_out, stat_out = _call(
        dtype, p=[1, 1, 1], g=[1, 1, 1], lr=0.5, accum=[INF, -INF, 1], m=0.0, stat=[0, 1, 0], nesterov=nesterov
    )
    # accum*m = [Inf*0, -Inf*0, 0] = [NaN, NaN, 0]: the NaN reaches the weights, the state stays as given.
    # Third element: accum_t = 1; plain p - 0.5 = 0.5; nesterov p - (1 + 1*0)*0.5 = 0.5.
    _assert_values(p_out, [NAN, NAN, 0.5], dtype)
    _assert_values(accum_out, [INF, -INF, 1], dtype)
    _assert_values(stat_out, [0, 1, 0], dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_momentum_nonzero_writes_accum_t_and_clears_stat(dtype):
    p_out, accum_out, stat_out = _call(dtype, p=[0, 0], g=[1, 1], lr=1, accum=[2, 2], m=-0.5, stat=[1, 3])
    # accum_t = 2*(-0.5) + 1 = 0; d == 0 so stat does not matter; stat <- 0
    _assert_values(accum_out, [0, 0], dtype)
    _assert_values(p_out, [0, 0], dtype)
    _assert_values(stat_out, [0, 0], dtype)


# --- learning rate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_negative_learning_rate_moves_weights_up_the_gradient(dtype):
    p_out, accum_out, _ = _call(dtype, p=[1, -1], g=[2, -4], lr=-0.25, accum=[0, 0], m=0.5, stat=[0, 0])
    # accum_t = g; p - g*(-0.25) = p + g/4
    _assert_values(accum_out, [2, -4], dtype)
    _assert_values(p_out, [1.5, -2.0], dtype)


# --- FLOAT intermediates, round-to-nearest-even back ------------------------------------------------------

# (dtype, precision in bits incl. the implicit one, smallest subnormal, smallest normal, bits of 1.0)
NARROW = [
    pytest.param(F16, 11, 2.0**-24, 2.0**-14, 0x3C00, id="FLOAT16"),
    pytest.param(BF16, 8, 2.0**-133, 2.0**-126, 0x3F80, id="BFLOAT16"),
]


@pytest.mark.parametrize(("dtype", "precision", "_sub", "_normal", "one_bits"), NARROW)
def test_weights_round_back_half_way_to_even(dtype, precision, _sub, _normal, one_bits):
    ulp = 2.0 ** (1 - precision)  # spacing just above 1.0
    half = ulp / 2
    # m = 0 and accum = 0, stat = 1, lr = 1: p_out = p - g, exact in fp32. Four fp32 results:
    #   1 + half      half-way between 1 (even) and 1+ulp (odd)        -> 1
    #   1 + 3*half    half-way between 1+ulp (odd) and 1+2ulp (even)   -> 1 + 2ulp
    #   1 + 1.25*half just above half-way                              -> 1 + ulp
    #   -1 - half     half-way between -1 (even) and -1-ulp (odd)      -> -1
    p = [1, 1 + ulp, 1, -1]
    g = [-half, -half, -1.25 * half, half]
    p_out, _, _ = _call(dtype, p=p, g=g, lr=1, accum=[0, 0, 0, 0], m=0, stat=[1, 1, 1, 1])
    expected = [one_bits, one_bits + 2, one_bits + 1, 0x8000 | one_bits]  # 0x8000: the sign bit
    np.testing.assert_array_equal(_bits(p_out), np.array(expected, np.uint16))


@pytest.mark.parametrize(("dtype", "precision", "_sub", "_normal", "one_bits"), NARROW)
def test_accum_rounds_back_half_way_to_even(dtype, precision, _sub, _normal, one_bits):
    ulp = 2.0 ** (1 - precision)
    half = ulp / 2
    # lr = 0 leaves p as is; accum_t = accum*1 + g = [1 + half, 1 + 3*half] -> [1, 1 + 2ulp]
    p_out, accum_out, _ = _call(dtype, p=[3, 3], g=[half, half], lr=0, accum=[1, 1 + ulp], m=1, stat=[0, 0])
    np.testing.assert_array_equal(_bits(accum_out), np.array([one_bits, one_bits + 2], np.uint16))
    _assert_values(p_out, [3, 3], dtype)


@pytest.mark.parametrize(("dtype", "_precision", "smallest_subnormal", "smallest_normal", "_one"), NARROW)
def test_subnormal_results_round_half_way_to_even(dtype, _precision, smallest_subnormal, smallest_normal, _one):
    # lr scales the smallest normal gradient to half a subnormal step: p_out = -g*lr =
    #   0.5 * smallest_subnormal -> tie between 0 (even) and 1 step (odd)  -> +0
    #   1.5 * smallest_subnormal -> tie between 1 step (odd) and 2 (even) -> 2 steps (bits 0x0002)
    lr = smallest_subnormal / smallest_normal / 2
    p_out, _, _ = _call(
        dtype, p=[0, 0], g=[-smallest_normal, -3 * smallest_normal], lr=lr, accum=[0, 0], m=0, stat=[1, 1]
    )
    np.testing.assert_array_equal(_bits(p_out), np.array([0x0000, 0x0002], np.uint16))


def test_float16_intermediates_are_float_so_no_overflow_midway():
    # accum_t = 60000*1 + 60000 = 120000: beyond FLOAT16 (max 65504) but fine in FLOAT.
    # p_out = 0 - 120000*0.25 = -30000 (exact in FLOAT16); accum_out = 120000 rounds back to Inf.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overflow to Inf is the contract's result, not a warning
        p_out, accum_out, _ = _call(F16, p=[0], g=[60000], lr=0.25, accum=[60000], m=1, stat=[0])
    _assert_values(p_out, [-30000], F16)
    _assert_values(accum_out, [INF], F16)


def test_bfloat16_intermediates_are_float_so_no_rounding_midway():
    # accum_t = 1*1 + 2^-8 = 1.00390625 in FLOAT (in BFLOAT16 it would already be 1.0);
    # p_out = 2 - 1.00390625 = 0.99609375 = 1 - 2^-8, exact in BFLOAT16; accum_out ties to even -> 1.0
    p_out, accum_out, _ = _call(BF16, p=[2], g=[2.0**-8], lr=1, accum=[1], m=1, stat=[0])
    _assert_values(p_out, [1 - 2.0**-8], BF16)
    _assert_values(accum_out, [1.0], BF16)


# --- inputs and outputs ---------------------------------------------------------------------------------


def _random_inputs(dtype, shape=(2, 3, 4)):
    rng = np.random.default_rng(7)

    def arr(s):
        return rng.uniform(-2, 2, size=s).astype(np.float32).astype(dtype)

    stat = rng.integers(0, 2, size=shape).astype(dtype)
    return arr(shape), arr(shape), arr((1,)), arr(shape), arr((1,)), stat


@pytest.mark.parametrize("m", [0.0, 0.5], ids=["m=0", "m=0.5"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_inputs_are_not_mutated(dtype, m):
    inputs = list(_random_inputs(dtype))
    inputs[4] = np.array([m], dtype=dtype)
    before = [_bits(x).copy() for x in inputs]
    sgd(*inputs, dampening=0.5, weight_decay=0.25)
    for name, x, old in zip(("parameters", "gradient", "learning_rate", "accum", "momentum", "stat"), inputs, before):
        np.testing.assert_array_equal(_bits(x), old, err_msg=f"{name} was mutated")


@pytest.mark.parametrize("m", [0.0, 0.5], ids=["m=0", "m=0.5"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=DTYPE_IDS)
def test_outputs_are_new_arrays_of_the_input_dtype_and_shape(dtype, m):
    inputs = list(_random_inputs(dtype))
    inputs[4] = np.array([m], dtype=dtype)
    outputs = sgd(*inputs, nesterov=True)
    assert len(outputs) == 3
    for out in outputs:
        assert isinstance(out, np.ndarray)
        assert out.dtype == dtype
        assert out.shape == (2, 3, 4)
        for x in inputs:
            assert not np.shares_memory(out, x)
    # Writing to an output must not reach the caller's tensors (m == 0 returns copies, not views).
    outputs[1][...] = 9
    outputs[2][...] = 9
    assert not (inputs[3] == 9).any() and not (inputs[5] == 9).any()


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (lambda t: t.__setitem__(0, t[0].astype(np.float64)), "parameters"),
        (lambda t: t.__setitem__(1, t[1][:1]), "gradient"),
        (lambda t: t.__setitem__(3, t[3].astype(np.float16)), "accum"),
        (lambda t: t.__setitem__(2, np.ones(2, np.float32)), "learning_rate"),
        (lambda t: t.__setitem__(4, np.ones(2, np.float32)), "momentum"),
        (lambda t: t.__setitem__(5, t[5].reshape(4, 3, 2)), "stat"),
    ],
    ids=["dtype-double", "gradient-shape", "accum-dtype", "lr-two-elements", "momentum-two-elements", "stat-shape"],
)
def test_reference_refuses_inputs_outside_the_contract_naming_the_tensor(change, name):
    inputs = list(_random_inputs(F32))
    change(inputs)
    with pytest.raises(ValueError, match=name):
        sgd(*inputs)
