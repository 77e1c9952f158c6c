"""What ``sgdfuse.optimize`` refuses to fuse, and why; and that what it does fuse stays sound.

Each refusal test builds the smallest graph (``tests/graphs.py``, opset 18, FLOAT [2, 3] unless noted) that
breaks one clause, then asserts the reason code (``sgdfuse.passes.sgd_match.REASONS``), that the detail
names the offending value, and that the model comes back unchanged (no SGD node, the same bytes).

The soundness tests at the end fuse graphs where the update's values are also read elsewhere and run the
original and the fused model in onnxruntime: every output must come out the same. The expected values come
from onnxruntime on the original graph, never from sgdfuse.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import sgdfuse.api as api
from graphs import F16, F32, make_model, momentum_sgd, random_feeds, scalar, value
from sgdfuse.report import Refusal

node = helper.make_node


def _refusal(model: onnx.ModelProto, candidate: str = "p_out") -> Refusal:
    """Optimise ``model``, check it came back unchanged, and return the refusal of ``candidate``."""
    before = model.SerializeToString()
    result = api.optimize(model)
    assert result.report.fused == [], result.report
    assert not [n for n in result.model.graph.node if n.domain == "ai.sgdfuse"]
    assert result.model.SerializeToString() == before, "a refused model must come back unchanged"
    assert model.SerializeToString() == before
    refusals = {r.candidate: r for r in result.report.refused}
    assert candidate in refusals, f"{candidate} not refused; refusals: {result.report.refused}"
    return refusals[candidate]


def _names(text: str, name: str) -> bool:
    """True when ``text`` mentions the value ``name`` as a whole word (``p`` is not in ``p_out``)."""
    return re.search(rf"(?<![\w/]){re.escape(name)}(?![\w/])", text) is not None


def _momentum_step(*, buffer: list[onnx.NodeProto], weights: list[onnx.NodeProto], inputs, initializers, dtype=F32):
    """A step with graph outputs ``p_out`` and ``buf_out`` computed by ``buffer`` and ``weights`` nodes."""
    return make_model(
        [*buffer, *weights],
        inputs,
        [value("p_out", dtype), value("buf_out", dtype)],
        initializers,
    )


PLAIN_BUFFER = [
    node("Mul", ["buf", "m"], ["buf_scaled"]),
    node("Add", ["buf_scaled", "g"], ["buf_out"]),
]
PLAIN_WEIGHTS = [
    node("Mul", ["buf_out", "lr"], ["step"]),
    node("Sub", ["p", "step"], ["p_out"]),
]
STATE = [value("p"), value("g"), value("buf")]


def test_the_plain_graph_the_refusals_start_from_does_fuse():
    # Guard: the refusals below differ from this graph in one clause only.
    result = api.optimize(momentum_sgd())
    [fused] = result.report.fused
    assert (fused.parameters, fused.gradient, fused.accum) == ("p", "g", "buf")
    assert fused.momentum == pytest.approx(0.9) and fused.learning_rate == pytest.approx(0.1)
    assert (fused.dampening, fused.weight_decay, fused.nesterov) == (0.0, 0.0, False)


# -- constant-state -------------------------------------------------------------------------------------


def test_parameters_as_an_initializer_are_refused_as_constant_state():
    refusal = _refusal(momentum_sgd(parameters_as_initializer=True))
    assert refusal.reason == "constant-state", refusal
    assert _names(refusal.detail, "p"), refusal.detail


def test_momentum_buffer_as_an_initializer_is_refused_as_constant_state():
    refusal = _refusal(momentum_sgd(buffer_as_initializer=True))
    assert refusal.reason == "constant-state", refusal
    assert _names(refusal.detail, "buf"), refusal.detail


# -- no-momentum-buffer ---------------------------------------------------------------------------------


def test_plain_sgd_without_a_buffer_is_refused_as_no_momentum_buffer():
    # p_out = p - lr*g: nothing to fuse into a momentum operator.
    model = make_model(
        [node("Mul", ["g", "lr"], ["step"]), node("Sub", ["p", "step"], ["p_out"])],
        [value("p"), value("g")],
        [value("p_out")],
        [scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "no-momentum-buffer", refusal
    assert _names(refusal.detail, "p_out"), refusal.detail


def test_momentum_zero_is_refused_as_no_momentum_buffer():
    # buf_out = 0*buf + g; p_out = p - lr*buf_out. With momentum 0 the contract keeps the old buffer where
    # this graph overwrites it (docs/contract.md), and docs/design.md, "Momentum 0 is not momentum": such an
    # update is left as it is and the report says why.
    refusal = _refusal(momentum_sgd(momentum=0.0))
    assert refusal.reason == "no-momentum-buffer", refusal
    assert _names(refusal.detail, "p_out"), refusal.detail


def test_a_learning_rate_of_zero_is_refused_saying_so():
    # p_out = p - 0*buf_out folds to p_out = p: the refusal was on buf_out as "reads no momentum buffer
    # (momentum 0 or absent)", about the buffer itself (a wrong-numbers trial's finding).
    refusal = _refusal(momentum_sgd(lr=0.0), candidate="buf_out")
    assert refusal.reason == "no-momentum-buffer", refusal
    assert "learning rate of 0" in refusal.detail and _names(refusal.detail, "p_out") and _names(refusal.detail, "p"), refusal.detail
    assert "momentum 0 or absent" not in refusal.detail


def test_parameter_update_that_reads_the_old_buffer_is_refused():
    # buf_out = m*buf + g is computed, but p_out = p - lr*buf reads the *old* buffer: not momentum SGD.
    model = _momentum_step(
        buffer=PLAIN_BUFFER,
        weights=[node("Mul", ["buf", "lr"], ["step"]), node("Sub", ["p", "step"], ["p_out"])],
        inputs=STATE,
        initializers=[scalar("m", 0.9), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "no-momentum-buffer", refusal
    assert _names(refusal.detail, "p_out") and _names(refusal.detail, "buf"), refusal.detail


# -- extra-term -----------------------------------------------------------------------------------------


def test_decoupled_weight_decay_is_refused_as_an_extra_term_naming_the_parameters():
    # AdamW-style decay: p_out = p - lr*wd*p - lr*buf_out. The contract folds wd into the gradient (and so
    # into the buffer); a decay applied to p directly is a term momentum SGD does not have.
    model = _momentum_step(
        buffer=PLAIN_BUFFER,
        weights=[
            node("Mul", ["buf_out", "lr"], ["step"]),
            node("Mul", ["p", "lr_wd"], ["decay"]),
            node("Sub", ["p", "decay"], ["p_decayed"]),
            node("Sub", ["p_decayed", "step"], ["p_out"]),
        ],
        inputs=STATE,
        initializers=[scalar("m", 0.9), scalar("lr", 0.1), scalar("lr_wd", 0.1 * 0.01)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "extra-term", refusal
    assert re.search(r"\*p(?!\w)", refusal.detail), f"the detail should show the p term: {refusal.detail}"
    assert _names(refusal.differing, "p") or "*p" in refusal.differing, refusal.differing


# -- nesterov-momentum-mismatch -------------------------------------------------------------------------


def test_nesterov_look_ahead_with_another_momentum_is_refused():
    # buf_out = 0.9*buf + g; p_out = p - lr*(g + 0.5*buf_out): the look-ahead momentum is not the buffer's.
    model = _momentum_step(
        buffer=PLAIN_BUFFER,
        weights=[
            node("Mul", ["buf_out", "m_look"], ["look"]),
            node("Add", ["g", "look"], ["direction"]),
            node("Mul", ["direction", "lr"], ["step"]),
            node("Sub", ["p", "step"], ["p_out"]),
        ],
        inputs=STATE,
        initializers=[scalar("m", 0.9), scalar("m_look", 0.5), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "nesterov-momentum-mismatch", refusal
    assert _names(refusal.detail, "buf_out"), refusal.detail
    assert "0.9" in refusal.detail, refusal.detail


def test_nesterov_with_the_buffer_momentum_fuses():
    # Guard for the test above: the same graph with the look-ahead reading m itself is Nesterov SGD.
    model = _momentum_step(
        buffer=PLAIN_BUFFER,
        weights=[
            node("Mul", ["buf_out", "m"], ["look"]),
            node("Add", ["g", "look"], ["direction"]),
            node("Mul", ["direction", "lr"], ["step"]),
            node("Sub", ["p", "step"], ["p_out"]),
        ],
        inputs=STATE,
        initializers=[scalar("m", 0.9), scalar("lr", 0.1)],
    )
    [fused] = api.optimize(model).report.fused
    assert fused.nesterov and fused.momentum == pytest.approx(0.9) and fused.accum == "buf"


# -- runtime-hyperparameter / runtime momentum ----------------------------------------------------------


def test_dampening_fed_as_a_graph_input_fuses_with_the_damped_gradient_as_the_gradient():
    # buf_out = m*buf + (1 - d)*g with d a graph input: the contract needs dampening as an attribute, but the
    # graph computes (1 - d)*g itself, and SGD(gradient = g_damped, dampening = 0) is exact.
    model = _momentum_step(
        buffer=[
            node("Mul", ["buf", "m"], ["buf_scaled"]),
            node("Sub", ["one", "d"], ["one_minus_d"]),
            node("Mul", ["g", "one_minus_d"], ["g_damped"]),
            node("Add", ["buf_scaled", "g_damped"], ["buf_out"]),
        ],
        weights=PLAIN_WEIGHTS,
        inputs=[*STATE, value("d", shape=[])],
        initializers=[scalar("m", 0.9), scalar("lr", 0.1), scalar("one", 1.0)],
    )
    result = api.optimize(model)
    [fused] = result.report.fused
    assert (fused.gradient, fused.dampening) == ("g_damped", 0.0)
    feeds = random_feeds(model, seed=4)
    names = ["p_out", "buf_out"]
    for want, have in zip(_session(model).run(names, feeds), _session(result.model).run(names, feeds)):
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7)


def test_dampening_computed_at_run_time_without_a_value_for_the_term_is_refused_as_runtime_hyperparameter():
    # buf_out = m*buf + g - d*g: no value of the graph holds the whole gradient term.
    model = _momentum_step(
        buffer=[
            node("Mul", ["buf", "m"], ["buf_scaled"]),
            node("Mul", ["g", "d"], ["g_d"]),
            node("Add", ["buf_scaled", "g"], ["t"]),
            node("Sub", ["t", "g_d"], ["buf_out"]),
        ],
        weights=PLAIN_WEIGHTS,
        inputs=[*STATE, value("d", shape=[])],
        initializers=[scalar("m", 0.9), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "runtime-hyperparameter", refusal
    assert _names(refusal.detail, "d"), refusal.detail


def test_weight_decay_fed_as_a_graph_input_fuses_with_the_decayed_gradient_as_the_gradient():
    # g' = g + wd*p with wd a graph input: the op's weight_decay attribute must be a constant, but the graph
    # computes g' itself, and SGD(gradient = g', weight_decay = 0) is exact.
    model = _momentum_step(
        buffer=[
            node("Mul", ["p", "wd"], ["decay"]),
            node("Add", ["g", "decay"], ["g_decayed"]),
            node("Mul", ["buf", "m"], ["buf_scaled"]),
            node("Add", ["buf_scaled", "g_decayed"], ["buf_out"]),
        ],
        weights=PLAIN_WEIGHTS,
        inputs=[*STATE, value("wd", shape=[])],
        initializers=[scalar("m", 0.9), scalar("lr", 0.1)],
    )
    result = api.optimize(model)
    [fused] = result.report.fused
    assert (fused.gradient, fused.weight_decay) == ("g_decayed", 0.0)
    feeds = random_feeds(model, seed=3)
    names = ["p_out", "buf_out"]
    for want, have in zip(_session(model).run(names, feeds), _session(result.model).run(names, feeds)):
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=1e-7)


def test_momentum_fed_as_a_graph_input_fuses_with_the_momentum_zero_case_kept():
    # A runtime momentum may be 0 at run time, where the contract keeps the old buffer: the rewrite keeps the
    # graph's buffer output for that case (an If on momentum == 0) instead of refusing.
    model = _momentum_step(
        buffer=PLAIN_BUFFER,
        weights=PLAIN_WEIGHTS,
        inputs=[*STATE, value("m", shape=[])],
        initializers=[scalar("lr", 0.1)],
    )
    result = api.optimize(model)
    assert [f.momentum for f in result.report.fused] == ["m"], result.report
    assert "If" in [n.op_type for n in result.model.graph.node]


# -- mixed-precision ------------------------------------------------------------------------------------
# FLOAT16 state whose update is computed in FLOAT between Casts. The contract computes in FLOAT and rounds
# once at the end (docs/contract.md); sgd_match documents the rule: an update wholly in FLOAT between Casts
# is that computation and fuses, an update that rounds to FLOAT16 midway is mixed precision and is refused.


def _float16_state_float_math(weights: str) -> onnx.ModelProto:
    """FLOAT16 p, g, buf; buf_out = Cast16(m*Cast32(buf) + Cast32(g)). The weights' step:

    - ``"float"``: p_out = Cast16(Cast32(p) - lr*buf32_out), all FLOAT (one rounding at the end);
    - ``"rounded-buffer"``: as "float" but reading Cast32(buf_out), the buffer already rounded to FLOAT16;
    - ``"float16"``: p_out = p - lr16*buf_out computed in FLOAT16.
    """
    buffer = [
        node("Cast", ["g"], ["g32"], to=F32),
        node("Cast", ["buf"], ["buf32"], to=F32),
        node("Mul", ["buf32", "m"], ["buf_scaled"]),
        node("Add", ["buf_scaled", "g32"], ["buf32_out"]),
        node("Cast", ["buf32_out"], ["buf_out"], to=F16),
    ]
    initializers = [scalar("m", 0.9), scalar("lr", 0.1)]
    if weights == "float16":
        initializers.append(scalar("lr16", 0.1, F16))
        steps = [node("Mul", ["buf_out", "lr16"], ["step"]), node("Sub", ["p", "step"], ["p_out"])]
    else:
        read = "buf32_out"
        if weights == "rounded-buffer":
            buffer.append(node("Cast", ["buf_out"], ["buf_out32"], to=F32))
            read = "buf_out32"
        steps = [
            node("Cast", ["p"], ["p32"], to=F32),
            node("Mul", [read, "lr"], ["step"]),
            node("Sub", ["p32", "step"], ["p32_out"]),
            node("Cast", ["p32_out"], ["p_out"], to=F16),
        ]
    return _momentum_step(
        buffer=buffer,
        weights=steps,
        inputs=[value("p", F16), value("g", F16), value("buf", F16)],
        initializers=initializers,
        dtype=F16,
    )


def test_float16_update_that_rounds_to_float16_midway_is_refused_as_mixed_precision():
    # The buffer is computed in FLOAT and rounded to FLOAT16; the weights' step then runs in FLOAT16.
    refusal = _refusal(_float16_state_float_math("float16"))
    assert refusal.reason == "mixed-precision", refusal
    assert "FLOAT" in refusal.detail, refusal.detail
    assert any(_names(refusal.detail, v) for v in ("step", "buf_scaled", "buf32_out", "buf_out")), refusal.detail


def test_float16_update_reading_the_rounded_buffer_back_in_float_is_refused_as_mixed_precision():
    # p_out = Cast16(Cast32(p) - lr*Cast32(Cast16(buf32_out))): the buffer is rounded to FLOAT16 midway
    # (at buf_out) between FLOAT computations, which the contract (one rounding at the end) does not do.
    refusal = _refusal(_float16_state_float_math("rounded-buffer"))
    assert refusal.reason == "mixed-precision", refusal
    assert "FLOAT" in refusal.detail and _names(refusal.detail, "buf_out"), refusal.detail


def test_float16_update_with_float_constants_is_refused_unless_rounding_is_allowed():
    # FLOAT math with FLOAT lr 0.1 and momentum 0.9: the op takes both in FLOAT16 (0.099975586, 0.89990234).
    refusal = _refusal(_float16_state_float_math("float"))
    assert refusal.reason == "hyperparameter-precision", refusal
    assert "0.0999755859" in refusal.detail and "0.1" in refusal.detail, refusal.detail


def test_float16_update_computed_wholly_in_float_between_casts_fuses_and_agrees():
    # The contract's own computation: FLOAT intermediates, one round-to-nearest-even at the end.
    model = _float16_state_float_math("float")
    result = api.optimize(model, allow_rounding=True)
    [fused] = result.report.fused
    assert (fused.parameters, fused.gradient, fused.accum, fused.dtype) == ("p", "g", "buf", "FLOAT16")
    feeds = random_feeds(model, seed=5)
    names = ["p_out", "buf_out"]
    want = _session(model).run(names, feeds)
    have = _session(result.model).run(names, feeds)
    for name, w, h in zip(names, want, have):
        # lr and momentum are fed to the operator in the parameters' dtype (the contract's rule), so 0.1 and
        # 0.9 become FLOAT16 constants (relative change < 2.5e-4): agreement within two FLOAT16 ulps.
        np.testing.assert_allclose(h.astype(np.float64), w.astype(np.float64), rtol=2e-3, atol=2e-3, err_msg=name)


# -- shape-mismatch -------------------------------------------------------------------------------------


def test_gradient_of_another_shape_than_the_parameters_is_refused_as_shape_mismatch():
    # g is [3], broadcast against p and buf of [2, 3]: the operator needs one shape.
    model = _momentum_step(
        buffer=PLAIN_BUFFER,
        weights=PLAIN_WEIGHTS,
        inputs=[value("p"), value("g", shape=[3]), value("buf")],
        initializers=[scalar("m", 0.9), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "shape-mismatch", refusal
    assert _names(refusal.detail, "g"), refusal.detail


# -- soundness: roles and values read outside the update ------------------------------------------------


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _assert_same_outputs(original: onnx.ModelProto, fused: onnx.ModelProto) -> None:
    # FLOAT: the fused function computes the same formula in FLOAT, rounding in another order: a few ulps.
    feeds = random_feeds(original, seed=3)
    names = [o.name for o in original.graph.output]
    assert names == [o.name for o in fused.graph.output]
    want = _session(original).run(names, feeds)
    have = _session(fused).run(names, feeds)
    for name, w, h in zip(names, want, have):
        np.testing.assert_allclose(h, w, rtol=1e-6, atol=1e-7, err_msg=name)


def _fused_once(model: onnx.ModelProto):
    result = api.optimize(model)
    assert len(result.report.fused) == 1, result.report
    onnx.checker.check_model(result.model, full_check=True)
    return result


def test_new_buffer_read_by_a_reduction_that_is_a_graph_output_is_still_computed():
    model = momentum_sgd(
        extra_nodes=[node("ReduceSum", ["buf_out"], ["buf_sum"], keepdims=0)],
        extra_outputs=[value("buf_sum", shape=[])],
    )
    result = _fused_once(model)
    _assert_same_outputs(model, result.model)


def test_intermediate_step_that_is_a_graph_output_is_still_computed():
    # step = lr*buf_out is matched inside the update and is also a graph output.
    model = momentum_sgd(extra_outputs=[value("step")])
    result = _fused_once(model)
    assert "step" in {o for n in result.model.graph.node for o in n.output}
    _assert_same_outputs(model, result.model)


def test_intermediate_read_by_another_node_is_still_computed():
    # buf_scaled = m*buf is matched inside the update and read by a node outside it.
    model = momentum_sgd(
        extra_nodes=[node("Abs", ["buf_scaled"], ["buf_scaled_abs"])],
        extra_outputs=[value("buf_scaled_abs")],
    )
    result = _fused_once(model)
    _assert_same_outputs(model, result.model)


def test_new_parameters_read_downstream_are_still_computed():
    model = momentum_sgd(
        extra_nodes=[node("Mul", ["p_out", "p_out"], ["p_out_squared"])],
        extra_outputs=[value("p_out_squared")],
    )
    result = _fused_once(model)
    _assert_same_outputs(model, result.model)


def _rename(model: onnx.ModelProto, names: dict[str, str]) -> onnx.ModelProto:
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    for n in renamed.graph.node:
        n.input[:] = [names.get(x, x) for x in n.input]
        n.output[:] = [names.get(x, x) for x in n.output]
    for o in renamed.graph.output:
        o.name = names.get(o.name, o.name)
    onnx.checker.check_model(renamed, full_check=True)
    return renamed


@pytest.mark.parametrize(
    "output_names",
    [{}, {"p_out": "output_0", "buf_out": "output_1"}],
    ids=["outputs_named_after_inputs", "outputs_named_output_N"],
)
@pytest.mark.parametrize("gradient_first", [False, True], ids=["buf_first", "gradient_first"])
@pytest.mark.parametrize("one_minus_dampening", [1.0, 0.75], ids=["no_dampening", "dampening_0.25"])
def test_commuted_buffer_add_never_fuses_the_gradient_as_the_buffer(gradient_first, one_minus_dampening, output_names):
    # buf_out = Add(m*buf, (1-d)*g) or Add((1-d)*g, m*buf), m = 0.9. docs/design.md promises commuted operands
    # fuse alike. The accum port is written in place (docs/contract.md), so it must be the buffer buf, never
    # the gradient g: otherwise the lowered op overwrites the gradient, leaves buf stale, and the report's
    # momentum/dampening are not the graph's.
    # One step's algebra alone cannot tell them apart: (accum=buf, m=0.9, d) and (accum=g, m=1-d,
    # dampening 1-0.9) both solve it. When the output names pair buf_out with buf, the update must fuse with
    # accum=buf; when they do not (outputs named output_N), it must fuse that way or be refused.
    gradient_term = "g"
    nodes = [node("Mul", ["buf", "m"], ["buf_scaled"])]
    initializers = [scalar("m", 0.9), scalar("lr", 0.1)]
    if one_minus_dampening != 1.0:
        nodes.append(node("Mul", ["g", "one_minus_d"], ["g_damped"]))
        initializers.append(scalar("one_minus_d", one_minus_dampening))
        gradient_term = "g_damped"
    operands = [gradient_term, "buf_scaled"] if gradient_first else ["buf_scaled", gradient_term]
    nodes.append(node("Add", operands, ["buf_out"]))
    model = _momentum_step(buffer=nodes, weights=PLAIN_WEIGHTS, inputs=STATE, initializers=initializers)
    model = _rename(model, output_names)

    result = api.optimize(model)
    if not output_names:
        assert len(result.report.fused) == 1, result.report
    for fused in result.report.fused:
        assert (fused.parameters, fused.gradient, fused.accum) == ("p", "g", "buf"), fused
        assert fused.momentum == pytest.approx(0.9, rel=1e-6), fused
        assert fused.dampening == pytest.approx(1.0 - one_minus_dampening, abs=1e-6), fused
    for sgd in (n for n in result.model.graph.node if n.domain == "ai.sgdfuse"):
        assert sgd.input[3] == "buf", sgd


# -- refusals that say what the buffer goes through (not "momentum is 0") ------------------------------------


def test_a_first_step_zeroing_of_the_old_buffer_is_refused_as_first_step_unsupported():
    # buf_eff = Where(t == 0, zeros, buf); buf_out = 0.9*buf_eff + g (onnx/onnx#3929's ConstantOfShape(Shape(p))
    # zero buffer). The momentum is 0.9, not 0: the refusal must say where the buffer went.
    model = make_model(
        [
            node("Shape", ["p"], ["ps"]),
            node("ConstantOfShape", ["ps"], ["zeros"]),
            node("Equal", ["t", "zero_i"], ["first"]),
            node("Where", ["first", "zeros", "buf"], ["buf_eff"]),
            node("Mul", ["buf_eff", "m"], ["mb"]),
            node("Add", ["mb", "g"], ["buf_out"]),
            *PLAIN_WEIGHTS,
        ],
        [*STATE, value("t", onnx.TensorProto.INT64, [])],
        [value("p_out"), value("buf_out")],
        [scalar("m", 0.9), scalar("lr", 0.1), scalar("zero_i", 0, onnx.TensorProto.INT64)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "first-step-unsupported", refusal
    assert "momentum is 0" not in refusal.detail
    assert _names(refusal.detail, "buf_eff") and _names(refusal.detail, "first"), refusal.detail


def test_a_per_element_momentum_is_refused_as_a_tensor_factor():
    # buf_out = [0.9, 0.9, 0.8]*buf + g: a momentum per element, which the operator cannot take.
    model = _momentum_step(
        buffer=[node("Mul", ["buf", "m"], ["buf_scaled"]), node("Add", ["buf_scaled", "g"], ["buf_out"])],
        weights=PLAIN_WEIGHTS,
        inputs=STATE,
        initializers=[onnx.numpy_helper.from_array(np.array([0.9, 0.9, 0.8], np.float32), "m"), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "tensor-factor", refusal
    assert "momentum is 0" not in refusal.detail and _names(refusal.detail, "m"), refusal.detail


def test_a_buffer_read_through_a_non_linear_op_is_not_called_momentum_0():
    # buf_out = 0.9*Relu(buf) + g: the buffer is read, by an op that is no scaling.
    model = _momentum_step(
        buffer=[node("Relu", ["buf"], ["buf_r"]), node("Mul", ["buf_r", "m"], ["buf_scaled"]), node("Add", ["buf_scaled", "g"], ["buf_out"])],
        weights=PLAIN_WEIGHTS,
        inputs=STATE,
        initializers=[scalar("m", 0.9), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert refusal.reason == "no-momentum-buffer", refusal
    assert "momentum is 0" not in refusal.detail and "Relu" in refusal.detail, refusal.detail


# -- two outputs named after one state ----------------------------------------------------------------------


def _two_claimants(junk: str = "buf_out", true: str = "new_buf") -> onnx.ModelProto:
    # true = 0.9*buf + g is what p_out reads; junk = 2*true is another output whose name also says "next buf".
    # Read with junk as the buffer, the algebra is momentum SGD too (momentum 1.8, dampening -1, lr 0.05), and
    # an in-place run would then write 2*true into buf: a user trial found it fused from the names, with check
    # passing.
    return make_model(
        [
            node("Mul", ["buf", "m"], ["buf_scaled"]),
            node("Add", ["buf_scaled", "g"], [true]),
            node("Mul", [true, "lr"], ["step"]),
            node("Sub", ["p", "step"], ["p_out"]),
            node("Mul", [true, "two"], [junk]),
        ],
        STATE,
        [value("p_out"), value("buf_out" if junk == "buf_out" else true), value(junk if junk != "buf_out" else true)],
        [scalar("m", 0.9), scalar("lr", 0.1), scalar("two", 2.0)],
    )


@pytest.mark.parametrize("junk, true", [("buf_out", "new_buf"), ("new_buf", "buf_out"), ("buf_out", "buf_next")])
def test_two_outputs_named_after_one_buffer_with_different_values_are_ambiguous(junk, true):
    refusal = _refusal(_two_claimants(junk, true))
    assert refusal.reason == "ambiguous-roles", refusal
    assert _names(refusal.detail, junk) and _names(refusal.detail, true) and "--state" in refusal.detail, refusal.detail


def test_a_pin_says_which_of_two_claimants_is_the_buffer():
    result = api.optimize(_two_claimants("buf_out", "new_buf"), pins=api.RolePins(state={"new_buf": "buf"}))
    [fused] = result.report.fused
    assert (fused.accum, fused.accum_out, fused.momentum, fused.dampening) == ("buf", "new_buf", pytest.approx(0.9), 0.0)


def test_a_copy_of_the_buffer_named_after_it_too_is_no_conflict():
    # buf_out = Identity(new_buf): both names hold one value; nothing to choose.
    model = make_model(
        [*PLAIN_BUFFER[:1], node("Add", ["buf_scaled", "g"], ["new_buf"]), node("Identity", ["new_buf"], ["buf_out"]),
         node("Mul", ["new_buf", "lr"], ["step"]), node("Sub", ["p", "step"], ["p_out"])],
        STATE,
        [value("p_out"), value("buf_out"), value("new_buf")],
        [scalar("m", 0.9), scalar("lr", 0.1)],
    )
    result = api.optimize(model)
    assert [f.parameters_out for f in result.report.fused] == ["p_out"], result.report.refused


def test_check_takes_the_pin_optimize_took(tmp_path):
    # Fused with --state new_buf=buf, the model writes new_buf into buf; check must carry the same output into
    # buf on the original's side, or it compares the fused buffer with buf_out (= 2*new_buf) and fails a
    # correct model. Without the pin, check says which output it took and how to say another.
    from sgdfuse.verify import check_models

    original = _two_claimants("buf_out", "new_buf")
    fused = api.optimize(original, pins=api.RolePins(state={"new_buf": "buf"})).model
    assert check_models(original, fused, steps=3, pinned={"new_buf": "buf"}).passed
    unpinned = check_models(original, fused, steps=3)
    assert not unpinned.passed
    assert "buf_out, new_buf are each named as the next value of buf" in unpinned.note, unpinned.note


# -- a graph at fault is named as such ---------------------------------------------------------------------


def _damped_step() -> onnx.ModelProto:
    # grad = Sqrt(Relu(g)): a gradient the update computes in the graph, by two nodes.
    return make_model(
        [
            node("Relu", ["g"], ["t1"], name="n_t1"),
            node("Sqrt", ["t1"], ["t2"], name="n_t2"),
            node("Mul", ["buf", "m"], ["buf_scaled"], name="n_bs"),
            node("Add", ["buf_scaled", "t2"], ["buf_out"], name="n_bo"),
            node("Mul", ["buf_out", "lr"], ["step"], name="n_st"),
            node("Sub", ["p", "step"], ["p_out"], name="n_po"),
        ],
        STATE,
        [value("p_out"), value("buf_out")],
        [scalar("m", 0.9), scalar("lr", 0.1)],
    )


def test_the_step_the_faults_start_from_fuses():
    assert [f.parameters_out for f in api.optimize(_damped_step()).report.fused] == ["p_out"]


def test_a_read_of_a_value_nothing_defines_is_named():
    model = _damped_step()
    model.graph.node[0].input[0] = "does_not_exist"
    refusal = _refusal(model)
    assert "n_t1 reads does_not_exist, which nothing defines" in refusal.detail, refusal.detail


def test_a_graph_out_of_topological_order_is_named():
    model = _damped_step()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    refusal = _refusal(model)
    assert "not in topological order" in refusal.detail, refusal.detail


def test_outputs_declared_without_a_shape_take_the_inferred_one():
    # A user trial: graph outputs declared with a dtype only were refused as "w_out has shape None" although
    # ONNX shape inference infers them (it writes an output's shape into the output, not a value info).
    model = momentum_sgd()
    for output in model.graph.output:
        output.type.tensor_type.ClearField("shape")
    result = api.optimize(model)
    assert [f.parameters_out for f in result.report.fused] == ["p_out"], result.report.refused
    assert all(u["passed"] for u in result.report.verification.updates)


def test_a_first_step_condition_of_several_elements_is_named_not_called_momentum_0():
    # Where(first[3], grad, 0.9*buf + grad) with a per-row condition (a public hunt, after apache/tvm#10106):
    # refused, but the reason said "buf_out = buf_out ... momentum is 0".
    model = make_model(
        [
            node("Mul", ["buf", "m"], ["buf_scaled"]),
            node("Add", ["buf_scaled", "g"], ["later"]),
            node("Where", ["first", "g", "later"], ["buf_out"]),
            *PLAIN_WEIGHTS,
        ],
        [*STATE, value("first", onnx.TensorProto.BOOL, [2, 1])],
        [value("p_out"), value("buf_out")],
        [scalar("m", 0.9), scalar("lr", 0.1)],
    )
    refusal = _refusal(model)
    assert "momentum is 0" not in refusal.detail, refusal.detail
    assert "condition first has 2 elements" in refusal.detail, refusal.detail
