"""The contract as data and its validation (sgdfuse.contract), clause by clause of docs/contract.md.

Each refusal is checked for its ContractError subclass and for the name of the offending tensor or
attribute in the message, since that name is what tells the user where to look.
"""

from __future__ import annotations

import math

import pytest
from onnx import TensorProto

from sgdfuse.contract import (
    ATTRIBUTES,
    INPUTS,
    OUTPUT,
    PRODUCT_LINES,
    SUPPORTED_DTYPES,
    SgdAttributes,
    TensorSpec,
    check_attributes,
    check_signature,
    product_line_for_soc,
    canonical_soc,
)
from sgdfuse.errors import (
    AttributeContractError,
    ContractError,
    DtypeContractError,
    ProductLineError,
    ShapeContractError,
)

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16

LINE_950 = "Ascend 950PR/950DT"
LINE_A3 = "Atlas A3 series"
LINE_A2 = "Atlas A2 series"
LINE_310B = "Atlas 200I/500 A2 inference"
LINE_310P = "Atlas inference series"
LINE_TRAINING = "Atlas training series"


# --- ports and attributes as data -----------------------------------------------------------------------


def test_inputs_are_the_six_ports_in_contract_order_with_three_writable():
    assert [p.name for p in INPUTS] == ["parameters", "gradient", "learning_rate", "accum", "momentum", "stat"]
    assert [p.index for p in INPUTS] == list(range(6))
    assert {p.name for p in INPUTS if p.writable} == {"parameters", "accum", "stat"}
    assert {p.name for p in INPUTS if p.scalar} == {"learning_rate", "momentum"}
    assert OUTPUT == "parameters"


def test_attributes_default_to_zero_zero_false():
    assert [(a.name, a.kind, a.default) for a in ATTRIBUTES] == [
        ("dampening", "float", 0.0),
        ("weight_decay", "float", 0.0),
        ("nesterov", "bool", False),
    ]
    assert SgdAttributes() == SgdAttributes(dampening=0.0, weight_decay=0.0, nesterov=False)


def test_supported_dtypes_are_float_float16_bfloat16():
    assert set(SUPPORTED_DTYPES) == {FLOAT, FLOAT16, BFLOAT16}


# --- attribute clauses ----------------------------------------------------------------------------------


def test_nesterov_with_nonzero_dampening_is_refused_naming_dampening():
    with pytest.raises(AttributeContractError, match="dampening") as info:
        check_attributes(0.1, 0.0, True, subject="node7")
    assert info.value.subject == "node7.dampening"
    assert "node7.dampening" in str(info.value)
    assert "nesterov" in str(info.value)


@pytest.mark.parametrize("dampening", [0.0, -0.0], ids=["+0", "-0"])
def test_nesterov_with_zero_dampening_is_accepted(dampening):
    check_attributes(dampening, 0.5, True)
    SgdAttributes(dampening=dampening, nesterov=True).check()


@pytest.mark.parametrize("dampening", [0.0, 0.1, 1.0, 2.5])
def test_any_finite_dampening_is_accepted_without_nesterov(dampening):
    check_attributes(dampening, 0.0, False)


@pytest.mark.parametrize("weight_decay", [-0.01, -1e-30, -math.inf, math.nan], ids=["-0.01", "-tiny", "-inf", "nan"])
def test_weight_decay_below_zero_is_refused_naming_weight_decay(weight_decay):
    with pytest.raises(AttributeContractError, match="weight_decay") as info:
        SgdAttributes(weight_decay=weight_decay).check(subject="sgd_w1")
    assert info.value.subject == "sgd_w1.weight_decay"


@pytest.mark.parametrize("weight_decay", [0.0, -0.0, 1e-4, 3.0], ids=["0", "-0", "1e-4", "3"])
def test_weight_decay_zero_or_positive_is_accepted(weight_decay):
    check_attributes(0.0, weight_decay, False)


def test_non_finite_dampening_is_refused_naming_dampening():
    with pytest.raises(AttributeContractError, match="dampening"):
        check_attributes(math.inf, 0.0, False, subject="n")


def test_attribute_errors_are_contract_errors():
    assert issubclass(AttributeContractError, ContractError)
    with pytest.raises(ContractError) as info:
        check_attributes(0.5, 0.0, True)
    assert info.value.clause  # the clause is carried, not only formatted into the message


# --- tensor clauses -------------------------------------------------------------------------------------

NAMES = {
    "parameters": "w",
    "gradient": "w_grad",
    "learning_rate": "lr_value",
    "accum": "w_accum",
    "momentum": "mom_value",
    "stat": "w_stat",
}


def _specs(shape=(2, 3), dtype=FLOAT, **overrides):
    """The six TensorSpecs of a valid call, with ``port=(shape, dtype)`` overrides."""
    specs = {}
    for port in INPUTS:
        port_shape, port_dtype = ((1,), dtype) if port.scalar else (shape, dtype)
        if port.name in overrides:
            port_shape, port_dtype = overrides[port.name]
        specs[port.name] = TensorSpec(NAMES[port.name], port_shape, port_dtype)
    return specs


def _check(specs, **kwargs):
    check_signature(*(specs[p.name] for p in INPUTS), **kwargs)


@pytest.mark.parametrize("dtype", [FLOAT, FLOAT16, BFLOAT16], ids=["FLOAT", "FLOAT16", "BFLOAT16"])
@pytest.mark.parametrize("shape", [(5,), (2, 3), (1, 1, 1, 1, 1, 1, 1, 2)], ids=["rank1", "rank2", "rank8"])
def test_valid_signatures_are_accepted(shape, dtype):
    _check(_specs(shape, dtype))


@pytest.mark.parametrize("scalar_shape", [(1,), (), (1, 1)], ids=["[1]", "[]", "[1,1]"])
def test_learning_rate_and_momentum_of_one_element_any_rank_are_accepted(scalar_shape):
    _check(_specs(learning_rate=(scalar_shape, FLOAT), momentum=(scalar_shape, FLOAT)))


@pytest.mark.parametrize("shape", [(), (1,) * 9], ids=["rank0", "rank9"])
def test_parameters_rank_outside_1_to_8_is_refused_naming_parameters(shape):
    with pytest.raises(ShapeContractError, match="rank") as info:
        _check(_specs(shape))
    assert info.value.subject == "w"
    assert str(info.value).startswith("w: ")
    assert f"rank is {len(shape)}" in str(info.value)


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)], ids=["[0]", "[2,0,3]"])
def test_empty_parameters_are_refused_naming_parameters(shape):
    with pytest.raises(ShapeContractError, match="empty") as info:
        _check(_specs(shape))
    assert info.value.subject == "w"


@pytest.mark.parametrize("port", ["gradient", "accum", "stat"])
@pytest.mark.parametrize("bad_shape", [(3, 2), (2, 3, 1), (6,)], ids=["transposed", "extra-dim", "flattened"])
def test_state_tensor_shaped_unlike_parameters_is_refused_naming_it(port, bad_shape):
    with pytest.raises(ShapeContractError) as info:
        _check(_specs(**{port: (bad_shape, FLOAT)}))
    assert info.value.subject == NAMES[port]
    assert str(info.value).startswith(f"{NAMES[port]}: ")
    assert port in info.value.clause


@pytest.mark.parametrize("port", ["learning_rate", "momentum"])
@pytest.mark.parametrize("bad_shape", [(2,), (1, 2)], ids=["[2]", "[1,2]"])
def test_scalar_input_with_two_elements_is_refused_naming_it(port, bad_shape):
    with pytest.raises(ShapeContractError, match="1 element") as info:
        _check(_specs(**{port: (bad_shape, FLOAT)}))
    assert info.value.subject == NAMES[port]
    assert "holds 2" in str(info.value)


@pytest.mark.parametrize(
    "dtype", [TensorProto.DOUBLE, TensorProto.INT32, TensorProto.FLOAT8E4M3FN], ids=["DOUBLE", "INT32", "FLOAT8E4M3FN"]
)
def test_dtype_outside_float_float16_bfloat16_is_refused_naming_parameters(dtype):
    with pytest.raises(DtypeContractError) as info:
        _check(_specs(dtype=dtype))
    assert info.value.subject == "w"
    assert TensorProto.DataType.Name(dtype) in str(info.value)


@pytest.mark.parametrize("port", ["gradient", "learning_rate", "accum", "momentum", "stat"])
def test_dtype_differing_from_parameters_is_refused_naming_the_tensor(port):
    shape = (1,) if port in ("learning_rate", "momentum") else (2, 3)
    with pytest.raises(DtypeContractError) as info:
        _check(_specs(**{port: (shape, FLOAT16)}))
    assert info.value.subject == NAMES[port]
    assert "FLOAT16" in str(info.value) and "FLOAT" in str(info.value)


def test_allowed_dtypes_narrow_the_accepted_set():
    with pytest.raises(DtypeContractError, match="BFLOAT16"):
        _check(_specs(dtype=BFLOAT16), allowed_dtypes=(FLOAT, FLOAT16))


@pytest.mark.parametrize(
    ("parameters_shape", "state_shape"),
    [(("N", 3), ("N", 3)), ((None, 3), (2, 3)), (None, (2, 3)), ((2, 3), None)],
    ids=["symbolic", "unknown-dim", "unknown-rank-parameters", "unknown-rank-state"],
)
def test_unknown_dimensions_are_not_contract_violations(parameters_shape, state_shape):
    # Dynamic shape is a product-line question (ProductLine.check), not a violation of the operator contract.
    _check(
        _specs(
            parameters=(parameters_shape, FLOAT),
            gradient=(state_shape, FLOAT),
            accum=(state_shape, FLOAT),
            stat=(state_shape, FLOAT),
        )
    )


# --- product lines --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("soc", "line"),
    [
        ("Ascend950PR_9599", LINE_950),
        ("Ascend950DT_9591", LINE_950),
        ("Ascend910_9391", LINE_A3),
        ("Ascend910_9362", LINE_A3),
        ("Ascend910B2", LINE_A2),
        ("Ascend910B4-1", LINE_A2),
        ("Ascend310B1", LINE_310B),
        ("Ascend310P3", LINE_310P),
        ("Ascend910A", LINE_TRAINING),
        ("Ascend910", LINE_TRAINING),
        ("Ascend910ProB", LINE_TRAINING),
    ],
)
def test_soc_version_maps_to_its_product_line(soc, line):
    assert product_line_for_soc(soc).name == line


def test_bare_ascend910b_is_the_old_training_series_not_a2():
    # docs/contract.md, "Product lines": "Ascend910B" without a digit is the Atlas training series.
    line = product_line_for_soc("Ascend910B")
    assert line.name == LINE_TRAINING
    assert BFLOAT16 not in line.dtypes
    assert product_line_for_soc("Ascend910B2").name == LINE_A2


@pytest.mark.parametrize("soc", ["Ascend999", "Ascend910B9", "Ascend950PR_95", "Ascend950PR_9A99", ""])
def test_unknown_soc_is_refused_listing_the_families(soc):
    with pytest.raises(ProductLineError) as info:
        product_line_for_soc(soc)
    message = str(info.value)
    for line in PRODUCT_LINES:
        assert line.name in message
    for example in ("Ascend910B2", "Ascend910_9391", "Ascend310P3", "Ascend950PR_95##", "Ascend910ProA"):
        assert example in message


def test_unknown_soc_lists_one_product_line_per_line_after_one_message_line():
    with pytest.raises(ProductLineError) as info:
        product_line_for_soc("Ascend910X")
    first, *rest = str(info.value).splitlines()
    assert "unknown SoC version" in first
    assert [line.strip().split(":")[0] for line in rest] == [line.name for line in PRODUCT_LINES]


@pytest.mark.parametrize(
    "typo, suggestion",
    [("Ascend910Bx", "Ascend910B"), ("Ascend910B22", "Ascend910B2"), ("Ascend31OP3", "Ascend310P3"), ("Ascend950PR_95", "Ascend950PR_95##")],
)
def test_unknown_soc_suggests_the_nearest_spelling(typo, suggestion):
    with pytest.raises(ProductLineError) as info:
        product_line_for_soc(typo)
    assert suggestion in str(info.value).splitlines()[0].split("did you mean", 1)[1]


@pytest.mark.parametrize(
    "typed, atc",
    [("ascend910b2", "Ascend910B2"), ("ASCEND310P3", "Ascend310P3"), ("ascend950pr_9599", "Ascend950PR_9599"),
     ("Ascend910b", "Ascend910B"), ("ascend910_9391", "Ascend910_9391")],
)
def test_soc_version_is_read_in_any_case_and_written_in_atc_spelling(typed, atc):
    assert canonical_soc(typed) == atc
    assert product_line_for_soc(typed) == product_line_for_soc(atc)


def test_every_line_keeps_rank_and_not_empty_and_scalar_formats_from_the_contract():
    assert {line.name for line in PRODUCT_LINES} == {LINE_950, LINE_A3, LINE_A2, LINE_310B, LINE_310P, LINE_TRAINING}
    for line in PRODUCT_LINES:
        if line.name == LINE_950:
            assert line.formats == ("ND",) and line.dynamic_shape
        else:
            assert set(line.formats) == {"NC1HWC0", "NDC1HWC0", "ND", "FRACTAL_Z", "FRACTAL_Z_3D"}
            assert not line.dynamic_shape


@pytest.mark.parametrize("soc", ["Ascend310B1", "Ascend310P3", "Ascend910A", "Ascend910B"])
def test_bfloat16_is_refused_on_lines_without_it(soc):
    line = product_line_for_soc(soc)
    with pytest.raises(ProductLineError, match="BFLOAT16") as info:
        line.check(TensorSpec("w", (2, 3), BFLOAT16), node="sgd_0")
    assert "sgd_0" in str(info.value) and "w" in info.value.subject
    assert line.name in str(info.value)
    for dtype in (FLOAT, FLOAT16):
        line.check(TensorSpec("w", (2, 3), dtype), node="sgd_0")


@pytest.mark.parametrize("soc", ["Ascend950PR_9599", "Ascend910_9391", "Ascend910B2"])
@pytest.mark.parametrize("dtype", [FLOAT, FLOAT16, BFLOAT16], ids=["FLOAT", "FLOAT16", "BFLOAT16"])
def test_all_three_dtypes_are_accepted_on_950_a3_a2(soc, dtype):
    product_line_for_soc(soc).check(TensorSpec("w", (2, 3), dtype), node="sgd_0")


@pytest.mark.parametrize("shape", [("N", 3), (None, 3), None], ids=["symbolic", "unknown-dim", "unknown-rank"])
@pytest.mark.parametrize(
    "soc", ["Ascend910_9391", "Ascend910B2", "Ascend310B1", "Ascend310P3", "Ascend910A", "Ascend910B"]
)
def test_dynamic_shape_is_refused_everywhere_but_950(soc, shape):
    line = product_line_for_soc(soc)
    with pytest.raises(ProductLineError, match="dynamic") as info:
        line.check(TensorSpec("w", shape, FLOAT), node="sgd_0")
    assert "sgd_0" in str(info.value)
    line.check(TensorSpec("w", (4, 3), FLOAT), node="sgd_0")


@pytest.mark.parametrize("shape", [("N", 3), (None, 3), None], ids=["symbolic", "unknown-dim", "unknown-rank"])
def test_dynamic_shape_and_rank_are_accepted_on_950(shape):
    product_line_for_soc("Ascend950DT_9591").check(TensorSpec("w", shape, BFLOAT16), node="sgd_0")
