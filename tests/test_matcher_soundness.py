"""The matcher never fuses a wrong reading: graphs built to break it, each fused exactly or refused.

"Exactly" is checked the way the device runs the op: in place, over several chained steps, from zero buffers
(as a fresh optimizer starts) and from random ones. The original graph runs in onnxruntime with its state
carried by the pairing the test states (output → the input it replaces); the fused graph runs with each SGD
node's outputs written back into its own ``parameters`` and ``accum`` inputs. The expected numbers are
onnxruntime's on the original graph, never sgdfuse's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import sgdfuse
from sgdfuse.passes.sgd_match import RolePins
from sgdfuse.runtime import make_session, onnx_to_numpy_dtype, run

F32, F16, BF16 = T.FLOAT, T.FLOAT16, T.BFLOAT16
node = helper.make_node


def value(name, dtype=F32, shape=(2, 3)):
    return helper.make_tensor_value_info(name, dtype, None if shape is None else list(shape))


def const(name, number, dtype=F32):
    return numpy_helper.from_array(np.array(number, dtype=np.float32).astype(onnx_to_numpy_dtype(dtype)), name=name)


def model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "step", inputs, outputs, initializer=list(initializers))
    result = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(result, full_check=True)
    return result


def keras_step(lr, *, nesterov=False, lr_input=False):
    """Keras 3's SGD: ``m' = 0.9*m - lr*g``; ``w' = w + m'`` (Nesterov ``w' = w + 0.9*m' - lr*g``), with
    ``lr*g`` computed once, as the exported graph does."""
    nodes = [node("Mul", ["m", "mu"], ["m_mu"]), node("Mul", ["g", "lr"], ["lr_g"]), node("Sub", ["m_mu", "lr_g"], ["m_out"])]
    if nesterov:
        nodes += [node("Mul", ["m_out", "mu"], ["look"]), node("Add", ["w", "look"], ["w1"]), node("Sub", ["w1", "lr_g"], ["w_out"])]
    else:
        nodes.append(node("Add", ["w", "m_out"], ["w_out"]))
    inputs = [value("w"), value("m"), value("g")] + ([value("lr", F32, ())] if lr_input else [])
    initializers = [const("mu", 0.9)] + ([] if lr_input else [const("lr", lr)])
    return model(nodes, inputs, [value("w_out"), value("m_out")], initializers)


def plain_step(*, dtype=F32, lr=0.1, momentum=0.9, outputs=("p_out", "buf_out"), extra=(), extra_inputs=(), extra_initializers=()):
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["step"]),
             node("Sub", ["p", "step"], ["p_out"]), *extra]
    return model(
        nodes, [value("p", dtype), value("g", dtype), value("buf", dtype), *extra_inputs], [value(o, dtype) for o in outputs],
        [const("mom", momentum, dtype), const("lr", lr, dtype), *extra_initializers],
    )


def float_math_step(dtype, *, lr, momentum, decay=None, one_minus_d=None):
    """FLOAT16/BFLOAT16 state, the update computed in FLOAT between Casts, FLOAT constants."""
    nodes = [node("Cast", [x], [x + "32"], to=F32) for x in ("p", "g", "buf")]
    nodes.append(node("Mul", ["buf32", "mom"], ["bm"]))
    if one_minus_d is None:
        nodes.append(node("Add", ["bm", "g32"], ["bnew"]))
    else:
        nodes += [node("Mul", ["g32", "omd"], ["gd"]), node("Add", ["bm", "gd"], ["bnew"])]
    nodes += [node("Cast", ["bnew"], ["buf_out"], to=dtype), node("Mul", ["bnew", "lr"], ["st"])]
    if decay is None:
        nodes.append(node("Sub", ["p32", "st"], ["pnew"]))
    else:
        nodes += [node("Mul", ["p32", "decay"], ["pd"]), node("Sub", ["pd", "st"], ["pnew"])]
    nodes.append(node("Cast", ["pnew"], ["p_out"], to=dtype))
    initializers = [const("mom", momentum), const("lr", lr)]
    initializers += [const("decay", decay)] if decay is not None else []
    initializers += [const("omd", one_minus_d)] if one_minus_d is not None else []
    return model(nodes, [value("p", dtype), value("g", dtype), value("buf", dtype)], [value("p_out", dtype), value("buf_out", dtype)], initializers)


# -- running in place ------------------------------------------------------------------------------------


def _with_outputs(m: onnx.ModelProto, names) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(m)
    present = {o.name for o in copy.graph.output}
    copy.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in present)
    return copy


def _sgd_in_place(fused: onnx.ModelProto) -> dict[str, str]:
    """input → the value the device writes into it: each SGD node's outputs 0 and 1 into its inputs 0 and 3;
    where the graph selects that output with a guard ``Where(c, old, new)``, the selection."""
    consumers = {}
    for n in fused.graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    pairs = {}
    for n in fused.graph.node:
        if n.domain == "ai.sgdfuse":
            for source, target in ((n.input[0], n.output[0]), (n.input[3], n.output[1])):
                guard = [c for c in consumers.get(target, []) if c.op_type == "Where" and source in c.input]
                pairs[source] = guard[0].output[0] if guard else target
    return pairs


def run_in_place(original, fused, state: dict[str, str], feeds_per_step, *, steps=4):
    """(original outputs, fused outputs) per step: the original carried by ``state`` (output → input), the
    fused graph by its SGD nodes' in-place writes (other state by ``state`` too)."""
    pairs_fused = {**{i: o for o, i in state.items()}, **_sgd_in_place(fused)}
    so = make_session(original)
    sf = make_session(_with_outputs(fused, pairs_fused.values()))
    inputs_o = [i.name for i in original.graph.input]
    inputs_f = [i.name for i in fused.graph.input]
    carried_o, carried_f = {}, {}
    results = []
    for step in range(steps):
        feeds = feeds_per_step(step)
        fo = {k: carried_o.get(k, feeds.get(k)) for k in inputs_o if k in feeds or k in carried_o}
        ff = {k: carried_f.get(k, feeds.get(k)) for k in inputs_f if k in feeds or k in carried_f}
        got_o = run(so, fo)
        got_f = run(sf, ff)
        results.append((got_o, got_f))
        carried_o = {i: got_o[o] for o, i in state.items()}
        carried_f = {i: got_f[o] for i, o in pairs_fused.items()}
    return results


def feeds_for(m: onnx.ModelProto, *, zero=("buf", "m"), seed=0, extra=None):
    rng = np.random.default_rng(seed)
    initialised = {t.name for t in m.graph.initializer}
    specs = {i.name: i for i in m.graph.input if i.name not in initialised}

    def make(step):
        feeds = {}
        for name, info in specs.items():
            t = info.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
            dtype = onnx_to_numpy_dtype(t.elem_type)
            if t.elem_type == T.BOOL:
                feeds[name] = np.array(step % 2 == 0)
            elif int(np.prod(shape)) == 1 and not shape == [1]:
                feeds[name] = np.array(rng.uniform(0.01, 0.1), dtype=np.float32).astype(dtype).reshape(shape)
            elif step == 0 and name in zero:
                feeds[name] = np.zeros(shape, dtype=dtype)
            else:
                feeds[name] = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        if extra:
            feeds.update(extra(step))
        return feeds

    return make


def assert_in_place_equal(original, fused, state, *, rtol=2e-6, seed=0, zero=("buf", "m"), extra=None, steps=4):
    for zeroed in (zero, ()):
        results = run_in_place(original, fused, state, feeds_for(original, zero=zeroed, seed=seed, extra=extra), steps=steps)
        for step, (want, have) in enumerate(results):
            for name in state:
                w, h = np.asarray(want[name], np.float64), np.asarray(have[name], np.float64)
                # Relative to each element's own size: an lr*g term of 1e-8 must not hide in a bound made of |g|.
                np.testing.assert_allclose(h, w, rtol=rtol, atol=1e-30, err_msg=f"{name} at step {step}, zero state {zeroed}")


def fused_one(m, **kwargs):
    result = sgdfuse.optimize(m, **kwargs)
    assert len(result.report.fused) == 1 and not result.report.refused, result.report
    return result


def refusal(m, candidate="p_out", **kwargs):
    result = sgdfuse.optimize(m, **kwargs)
    assert not result.report.fused, result.report
    assert result.model.SerializeToString() == m.SerializeToString()
    reasons = {r.candidate: r for r in result.report.refused}
    assert candidate in reasons, result.report.refused
    return reasons[candidate]


# -- the Keras kind: exact readings win over a dampening near 1 ------------------------------------------


@pytest.mark.parametrize("lr", [0.1, 1e-3, 1e-6, 1e-8])
@pytest.mark.parametrize("nesterov", [False, True])
def test_keras_velocity_form_fuses_with_its_own_lr_times_g_and_no_dampening(lr, nesterov):
    original = keras_step(lr, nesterov=nesterov)
    result = fused_one(original)
    f = result.report.fused[0]
    # The op forms 1 - d in float32: with d = 1 - lr that cancels (lr 1e-8 gives d = 1.0 and no gradient).
    assert (f.gradient, f.dampening, f.learning_rate, f.nesterov) == ("lr_g", 0.0, -1.0, nesterov)
    assert_in_place_equal(original, result.model, {"w_out": "w", "m_out": "m"})


def test_keras_velocity_form_with_a_learning_rate_fed_at_run_time_fuses():
    original = keras_step(0, lr_input=True)
    result = fused_one(original)
    assert result.report.fused[0].gradient == "lr_g"
    assert_in_place_equal(original, result.model, {"w_out": "w", "m_out": "m"})


def test_dampening_read_off_a_gradient_scale_near_one_is_not_exact():
    # buf' = buf*0.9 + 0.1*g with no graph value 0.1*g: dampening 0.9 is 3 float32 spacings off in 1 - d.
    # Then the reading is still within the op's roundoff and fuses; with 1 - d = 1e-6 it is refused.
    for scale, fuses in ((0.1, True), (1e-6, False)):
        nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Mul", ["g", "k"], ["gk"]), node("Add", ["bm", "gk"], ["buf_out"]),
                 node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])]
        original = model(nodes, [value("p"), value("g"), value("buf")], [value("p_out"), value("buf_out")],
                         [const("mom", 0.9), const("lr", 0.1), const("k", scale)])
        result = sgdfuse.optimize(original)
        assert len(result.report.fused) == 1, result.report
        f = result.report.fused[0]
        # gk is the graph's own k*g: the exact gradient with dampening 0, whatever k is.
        assert (f.gradient, f.dampening) == ("gk", 0.0)
        assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


# -- tolerances from the graph's own arithmetic ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_decoupled_weight_decay_in_float_math_is_not_rounded_away(dtype):
    # p' = p*(1 - 2^-6) - 0.125*buf': a whole term, far above FLOAT rounding, whatever the state's dtype.
    r = refusal(float_math_step(dtype, lr=0.125, momentum=0.875, decay=1 - 2**-6))
    assert r.reason in ("extra-term", "inexact-coefficients"), r


def test_decoupled_weight_decay_in_float16_math_is_not_rounded_away():
    # FLOAT16 math, SGDW lr 0.1 wd 0.01: p*(1 - 0.001) is p*0.99902 in FLOAT16, two spacings below 1; the op's
    # coefficient of p is 1 with no arithmetic at all, so no rounding explains the difference.
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["p", "decay"], ["pd"]),
             node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["pd", "st"], ["p_out"])]
    original = model(nodes, [value("p", F16), value("g", F16), value("buf", F16)], [value("p_out", F16), value("buf_out", F16)],
                     [const("mom", 0.9, F16), const("decay", 1 - 0.1 * 0.01, F16), const("lr", 0.1, F16)])
    assert refusal(original).reason in ("extra-term", "inexact-coefficients")


def test_bfloat16_dampening_of_two_to_the_minus_six_is_kept():
    original = float_math_step(BF16, lr=0.125, momentum=0.875, one_minus_d=1 - 2**-6)
    result = fused_one(original)
    assert result.report.fused[0].dampening == 2**-6
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"}, rtol=2**-7)


def test_float_constants_that_the_parameters_dtype_rounds_are_refused_unless_allowed():
    original = float_math_step(BF16, lr=0.1, momentum=0.9)
    r = refusal(original)
    assert r.reason == "hyperparameter-precision" and "0.100097656" in r.detail, r
    allowed = fused_one(original, allow_rounding=True).report.fused[0]
    assert allowed.learning_rate == 0.10009765625 and allowed.rounded == {"learning_rate": 0.1, "momentum": 0.9}


def test_nesterov_look_ahead_with_another_momentum_is_refused():
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "look"], ["lb"]),
             node("Add", ["g", "lb"], ["st"]), node("Mul", ["st", "lr"], ["stl"]), node("Sub", ["p", "stl"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf")], [value("p_out"), value("buf_out")],
                     [const("mom", 0.875), const("look", 0.90625), const("lr", 0.1)])
    assert refusal(original).reason == "nesterov-momentum-mismatch"


def test_an_extra_small_gradient_term_is_not_folded_into_the_learning_rate():
    extra = [node("Mul", ["g", "small"], ["gs"]), node("Sub", ["p_out", "gs"], ["p_final"])]
    original = plain_step(outputs=("p_final", "buf_out"), extra=extra, extra_initializers=[const("small", 0.1 / 64)])
    assert refusal(original, "p_final").reason in ("nesterov-momentum-mismatch", "extra-term")


# -- the right output written in place ---------------------------------------------------------------------


def test_the_named_buffer_output_is_written_in_place_not_a_scaled_copy():
    extra = [node("Mul", ["buf_out", "lr"], ["delta"])]
    original = plain_step(outputs=("p_out", "delta", "buf_out"), extra=extra)
    result = fused_one(original)
    f = result.report.fused[0]
    assert (f.accum, f.accum_out, f.roles_from) == ("buf", "buf_out", "names")
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_a_nesterov_evaluation_output_is_not_taken_for_the_parameters_update():
    extra = [node("Mul", ["buf_out", "mom"], ["lb"]), node("Add", ["g", "lb"], ["nst"]), node("Mul", ["nst", "lr"], ["nstl"]),
             node("Sub", ["p", "nstl"], ["p_eval"])]
    original = plain_step(outputs=("p_eval", "p_out", "buf_out"), extra=extra)
    result = sgdfuse.optimize(original)
    [f] = result.report.fused
    assert (f.parameters_out, f.nesterov) == ("p_out", False)
    assert {r.candidate: r.reason for r in result.report.refused} == {"p_eval": "parameters-not-own-previous"}
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_default_names_fuse_by_plausibility_and_pins_override():
    nodes = [node("Mul", ["b0", "mom"], ["mul"]), node("Add", ["mul", "g0"], ["add"]), node("Mul", ["add", "lr"], ["mul_1"]),
             node("Sub", ["p0", "mul_1"], ["sub"])]
    original = model(nodes, [value("p0"), value("x0"), value("b0")] if False else [value("p0"), value("g0"), value("b0")],
                     [value("sub"), value("add")], [const("mom", 0.9), const("lr", 0.1)])
    f = fused_one(original).report.fused[0]
    assert (f.accum, f.gradient, f.roles_from) == ("b0", "g0", "conventions")
    pinned = fused_one(original, pins=RolePins(state={"add": "b0"})).report.fused[0]
    assert (pinned.accum, pinned.roles_from) == ("b0", "pin")
    # Pinning the other reading (g0 is the buffer) is obeyed: momentum 1, dampening 0.1.
    other = fused_one(original, pins=RolePins(buffers=("g*",))).report.fused[0]
    assert (other.accum, other.momentum, other.roles_from) == ("g0", 1.0, "pin")


def test_names_without_conventions_fall_back_to_plausibility():
    nodes = [node("Mul", ["onnx::Mul_4", "mom"], ["t"]), node("Add", ["t", "onnx::Add_2"], ["onnx::Mul_8"]),
             node("Mul", ["onnx::Mul_8", "lr"], ["u"]), node("Sub", ["onnx::Add_0", "u"], ["11"])]
    original = model(nodes, [value("onnx::Add_0"), value("onnx::Add_2"), value("onnx::Mul_4")], [value("11"), value("onnx::Mul_8")],
                     [const("mom", 0.9), const("lr", 0.1)])
    result = fused_one(original)
    f = result.report.fused[0]
    assert (f.accum, f.roles_from) == ("onnx::Mul_4", "plausibility")
    assert "roles from plausibility" in [n for n in result.model.graph.node if n.domain == "ai.sgdfuse"][0].doc_string


# -- dynamic dimensions, cancellation, value-changing casts -------------------------------------------------


def test_a_uniform_constant_that_broadcasts_a_symbolic_dimension_up_is_no_learning_rate():
    shape = ("N", 4)
    lr = numpy_helper.from_array(np.full((2, 1), 0.1, np.float32), "lr")
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p", F32, shape), value("g", F32, shape), value("buf", F32, shape)],
                     [value("p_out", F32, shape), value("buf_out", F32, shape)], [const("mom", 0.9), lr])
    assert refusal(original).reason == "tensor-factor"


@pytest.mark.parametrize("kind", ["add_sub", "times_zero", "scale_unscale"])
def test_terms_that_cancel_only_in_exact_arithmetic_are_refused(kind):
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["b1"])]
    inputs = [value("p"), value("g"), value("buf")]
    initializers = [const("mom", 0.9), const("lr", 0.1)]
    if kind == "add_sub":
        nodes += [node("Add", ["b1", "z"], ["b2"]), node("Sub", ["b2", "z"], ["buf_out"])]
        inputs.append(value("z"))
    elif kind == "times_zero":
        nodes += [node("Mul", ["z", "zero"], ["z0"]), node("Add", ["b1", "z0"], ["buf_out"])]
        inputs.append(value("z"))
        initializers.append(const("zero", 0.0))
    else:
        nodes.append(node("Identity", ["b1"], ["buf_out"]))
    if kind == "scale_unscale":
        nodes += [node("Mul", ["buf_out", "s"], ["bs"]), node("Mul", ["bs", "lr"], ["bsl"]), node("Div", ["bsl", "s"], ["st"])]
        inputs.append(value("s", F32, ()))
    else:
        nodes.append(node("Mul", ["buf_out", "lr"], ["st"]))
    nodes.append(node("Sub", ["p", "st"], ["p_out"]))
    original = model(nodes, inputs, [value("p_out"), value("buf_out")], initializers)
    assert refusal(original).reason == "cancelling-terms"


def test_a_cast_through_an_integer_changes_the_learning_rate():
    nodes = [node("Cast", ["lr0"], ["lri"], to=T.INT64), node("Cast", ["lri"], ["lr"], to=F32), node("Mul", ["buf", "mom"], ["bm"]),
             node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf")], [value("p_out"), value("buf_out")], [const("mom", 0.9), const("lr0", 1.27)])
    result = fused_one(original)
    assert result.report.fused[0].learning_rate == 1.0  # Cast(1.27, INT64) is 1
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


# -- reasons that say what is wrong ----------------------------------------------------------------------


def test_swapped_parameter_output_names_are_named_as_such():
    nodes = [node("Mul", ["b1", "mom"], ["b1m"]), node("Add", ["b1m", "g1"], ["b1_out"]), node("Mul", ["b1_out", "lr"], ["s1"]),
             node("Sub", ["p1", "s1"], ["p2_out"]), node("Mul", ["b2", "mom"], ["b2m"]), node("Add", ["b2m", "g2"], ["b2_out"]),
             node("Mul", ["b2_out", "lr"], ["s2"]), node("Sub", ["p2", "s2"], ["p1_out"])]
    original = model(nodes, [value(x) for x in ("p1", "g1", "b1", "p2", "g2", "b2")],
                     [value("p1_out"), value("b1_out"), value("p2_out"), value("b2_out")], [const("mom", 0.9), const("lr", 0.1)])
    result = sgdfuse.optimize(original)
    assert not result.report.fused
    assert {r.candidate: r.reason for r in result.report.refused} == {"p1_out": "parameters-not-own-previous", "p2_out": "parameters-not-own-previous"}


def test_a_one_element_parameter_fuses():
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["p_out"])]
    one = (1,)
    original = model(nodes, [value("p", F32, one), value("g", F32, one), value("buf", F32, one)],
                     [value("p_out", F32, one), value("buf_out", F32, one)], [const("mom", 0.9), const("lr", 0.1)])
    result = fused_one(original)
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_a_nan_momentum_is_not_called_momentum_zero():
    r = refusal(plain_step(momentum=float("nan")))
    assert "momentum is 0" not in r.detail and "nan" in r.detail.lower(), r


def test_a_buffer_of_one_element_is_a_shape_mismatch():
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf", F32, (1,))], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    assert refusal(original).reason == "shape-mismatch"


def test_a_buffer_through_pow_is_not_called_a_per_element_factor():
    extra_nodes = [node("Pow", ["buf_out", "one"], ["bp"]), node("Mul", ["bp", "lr"], ["st2"]), node("Sub", ["p", "st2"], ["p_final"])]
    original = plain_step(outputs=("p_final", "buf_out"), extra=extra_nodes, extra_initializers=[const("one", 1.0)])
    r = refusal(original, "p_final")
    assert r.reason == "nonlinear-update" and "Pow" in r.detail, r


def test_a_first_step_with_dampening_above_one_fuses_exactly():
    # later: buf = 0.9*buf + (1 - 1.5)*g; first step: buf = g. The contract expresses it (stat = 1: no dampening).
    nodes = [node("Equal", ["step", "zero"], ["first"]), node("Mul", ["buf", "mom"], ["bm"]), node("Mul", ["g", "omd"], ["gd"]),
             node("Add", ["bm", "gd"], ["later"]), node("Where", ["first", "g", "later"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("step", T.INT64, ())], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1), const("omd", -0.5), numpy_helper.from_array(np.array(0, np.int64), "zero")])
    result = fused_one(original)
    f = result.report.fused[0]
    assert (f.dampening, f.weight_decay, f.maximize) == (1.5, 0.0, False)
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"}, extra=lambda step: {"step": np.array(step, np.int64)})


# -- guarded updates -----------------------------------------------------------------------------------


def _guarded(condition_keeps_old: bool = True, buffer_guard: str = "found_inf"):
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["bnew"]), node("Mul", ["bnew", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["pnew"])]
    pick = (lambda old, new: [old, new]) if condition_keeps_old else (lambda old, new: [new, old])
    nodes += [node("Where", ["found_inf", *pick("p", "pnew")], ["p_out"]), node("Where", [buffer_guard, *pick("buf", "bnew")], ["buf_out"])]
    inputs = [value("p"), value("g"), value("buf"), value("found_inf", T.BOOL, ())]
    if buffer_guard != "found_inf":
        inputs.append(value(buffer_guard, T.BOOL, ()))
    return model(nodes, inputs, [value("p_out"), value("buf_out")], [const("mom", 0.9), const("lr", 0.1)])


@pytest.mark.parametrize("keeps_old_when_true", [True, False])
def test_a_guarded_update_fuses_with_its_guard_and_skips_exactly(keeps_old_when_true):
    original = _guarded(keeps_old_when_true)
    result = fused_one(original)
    assert result.report.fused[0].guard == f"skipped where found_inf is {'true' if keeps_old_when_true else 'false'}"
    # The guard alternates true/false over the steps (feeds_for): skipped and applied steps both checked.
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_parameters_and_buffer_under_different_guards_are_refused():
    r = refusal(_guarded(buffer_guard="other_flag"), candidate="p_out")
    assert r.reason == "guarded-update" and "found_inf" in r.detail, r


def test_a_per_element_mask_is_named_as_a_guard_that_cannot_fuse():
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["bnew"]), node("Mul", ["bnew", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["pnew"]), node("Where", ["mask", "pnew", "p"], ["p_out"]), node("Where", ["mask", "bnew", "buf"], ["buf_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("mask", T.BOOL)], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    r = refusal(original)
    assert r.reason == "guarded-update" and "mask" in r.detail


def test_a_sliced_parameter_output_is_named():
    extra = [node("Slice", ["p_out", "s0", "e0"], ["p_slice"])]
    original = plain_step(outputs=("buf_out",), extra=extra,
                          extra_initializers=[numpy_helper.from_array(np.array([0], np.int64), "s0"), numpy_helper.from_array(np.array([1], np.int64), "e0")])
    graph = original.graph
    graph.output.insert(0, value("p_slice", F32, (1, 3)))
    r = refusal(original, "p_slice")
    assert r.reason == "hidden-update" and "Slice" in r.detail


def test_a_norm_logged_of_fused_new_weights_is_no_refusal():
    # ReduceSumSquare(p_out) beside the update's own output p_out: the update is the graph output and fuses, the
    # norm only reads it. It was refused as a "hidden-update" that told the user to output the update, which
    # the graph already does.
    extra = [node("ReduceSumSquare", ["p_out"], ["p_norm2"], keepdims=0)]
    original = plain_step(extra=extra)
    original.graph.output.append(value("p_norm2", F32, ()))
    result = sgdfuse.optimize(original)
    assert [u.parameters for u in result.report.fused] == ["p"]
    assert result.report.refused == []
    assert "p_norm2" in {o.name for o in result.model.graph.output}


# -- ONNX Momentum: one writer per state -------------------------------------------------------------------


def _momentum_node(name, xs, gs, vs, outs):
    return node("Momentum", ["R", "T", *xs, *gs, *vs], outs, domain="ai.onnx.preview.training", name=name, alpha=0.9, beta=1.0,
                mode="standard", norm_coefficient=0.0)


def _momentum_model(nodes, inputs, outputs, extra_nodes=()):
    graph = helper.make_graph([*nodes, *extra_nodes], "m", [value("R", F32, ()), value("T", T.INT64, ()), *inputs], outputs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)], ir_version=8)
    return m


def test_a_momentum_node_listing_a_weight_twice_is_refused_as_shared_state():
    m = _momentum_model([_momentum_node("mo", ["x", "x"], ["g1", "g2"], ["v1", "v2"], ["x1", "x2", "v1n", "v2n"])],
                        [value(n) for n in ("x", "g1", "g2", "v1", "v2")], [value(n) for n in ("x1", "x2", "v1n", "v2n")])
    result = sgdfuse.optimize(m)
    assert not result.report.fused and {r.reason for r in result.report.refused} == {"shared-state"}


def test_two_momentum_nodes_sharing_a_buffer_are_refused_as_shared_state():
    m = _momentum_model([_momentum_node("a", ["x"], ["g1"], ["v"], ["x1", "v1"]), _momentum_node("b", ["y"], ["g2"], ["v"], ["y1", "v2"])],
                        [value(n) for n in ("x", "y", "g1", "g2", "v")], [value(n) for n in ("x1", "v1", "y1", "v2")])
    result = sgdfuse.optimize(m)
    assert not result.report.fused and {r.reason for r in result.report.refused} == {"shared-state"}


def test_a_momentum_node_and_a_hand_written_update_of_the_same_weight_keep_one_writer():
    hand = [node("Mul", ["w_buf", "mom"], ["bm"]), node("Add", ["bm", "g2"], ["w_buf_out"]), node("Mul", ["w_buf_out", "lr"], ["st"]),
            node("Sub", ["x", "st"], ["x_out"])]
    graph = helper.make_graph(
        [_momentum_node("mo", ["x"], ["g1"], ["v"], ["x1", "v1"]), *hand], "m",
        [value("R", F32, ()), value("T", T.INT64, ()), *[value(n) for n in ("x", "g1", "v", "g2", "w_buf")]],
        [value(n) for n in ("x1", "v1", "x_out", "w_buf_out")], initializer=[const("mom", 0.9), const("lr", 0.1)],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)], ir_version=8)
    result = sgdfuse.optimize(m)
    writers = [f for f in result.report.fused if f.parameters == "x"]
    assert len(writers) == 1, result.report
    assert any(r.reason == "shared-state" and r.candidate == "x_out" for r in result.report.refused), result.report.refused


def test_a_guarded_update_written_as_an_if_is_refused_naming_the_condition():
    update = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["bnew"]), node("Mul", ["bnew", "lr"], ["st"]),
              node("Sub", ["p", "st"], ["pnew"])]
    skip = helper.make_graph([node("Identity", ["p"], ["p_keep"]), node("Identity", ["buf"], ["buf_keep"])], "skip", [],
                             [value("p_keep"), value("buf_keep")])
    step = helper.make_graph([*update, node("Identity", ["pnew"], ["p_step"]), node("Identity", ["bnew"], ["buf_step"])], "step", [],
                             [value("p_step"), value("buf_step")])
    nodes = [node("If", ["found_inf"], ["p_out", "buf_out"], then_branch=skip, else_branch=step)]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("found_inf", T.BOOL, ())], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    r = refusal(original)
    assert r.reason == "guarded-update" and "found_inf" in r.detail, r


# -- gradients that are values of the graph ----------------------------------------------------------


def test_a_gradient_scaled_at_run_time_fuses_with_the_scaled_value():
    # clip-by-global-norm style: g_c = g * s with s a runtime scalar; the op takes g_c as its gradient.
    nodes = [node("Mul", ["g", "s"], ["g_c"]), node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g_c"], ["buf_out"]),
             node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("s", F32, ())], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    result = fused_one(original)
    assert (result.report.fused[0].gradient, result.report.fused[0].dampening) == ("g_c", 0.0)
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_lars_style_trust_ratio_keeps_weight_decay_in_the_gradient():
    # g2 = (g + wd*p) * trust: weight decay inside the scaled term belongs to the gradient (weight_decay 0).
    nodes = [node("Mul", ["p", "wd"], ["pwd"]), node("Add", ["g", "pwd"], ["gw"]), node("Mul", ["gw", "trust"], ["g2"]),
             node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g2"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("trust", F32, ())], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1), const("wd", 1e-4)])
    result = fused_one(original)
    f = result.report.fused[0]
    assert (f.gradient, f.weight_decay, f.dampening) == ("g2", 0.0, 0.0)
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_a_float16_gradient_cast_up_to_float_parameters_is_the_gradient():
    nodes = [node("Cast", ["g16"], ["g"], to=F32), node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["buf_out"]),
             node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g16", F16), value("buf")], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    result = fused_one(original)
    assert result.report.fused[0].gradient == "g"
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


@pytest.mark.parametrize("guarded", ["parameters", "buffer"])
def test_a_guard_on_one_side_only_fuses_and_keeps_that_side_alone(guarded):
    # The loss scaler skips the weights but the buffer still moves (or the other way round): the fused node
    # computes both updates, as the graph does, and the graph's one Where keeps that state (it was refused
    # as guarded-update; the public hunt's case 2).
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["bnew"]), node("Mul", ["bnew", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["pnew"])]
    if guarded == "parameters":
        nodes += [node("Where", ["skip", "p", "pnew"], ["p_out"]), node("Identity", ["bnew"], ["buf_out"])]
    else:
        nodes += [node("Identity", ["pnew"], ["p_out"]), node("Where", ["skip", "buf", "bnew"], ["buf_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("skip", T.BOOL, ())], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    result = fused_one(original)
    assert result.report.fused[0].guard.startswith(f"{guarded} skipped where skip is true"), result.report.fused[0].guard
    # feeds_for alternates the guard true/false over the steps: skipped and applied steps both checked.
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_a_guard_keeping_another_tensor_than_its_state_is_refused():
    # p_out = Where(skip, q, p_new): the skipped step writes q, not p's old value, into p.
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Add", ["bm", "g"], ["bnew"]), node("Mul", ["bnew", "lr"], ["st"]),
             node("Sub", ["p", "st"], ["pnew"]), node("Where", ["skip", "q", "pnew"], ["p_out"]), node("Identity", ["bnew"], ["buf_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("q"), value("skip", T.BOOL, ())], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1)])
    result = sgdfuse.optimize(original)
    assert not result.report.fused
    assert any(r.reason == "parameters-not-own-previous" and "q" in r.detail for r in result.report.refused), result.report.refused


def test_an_ema_buffer_with_a_runtime_momentum_fuses_with_its_own_scaled_gradient():
    # buf' = m*buf + (1 - m)*g with m fed at run time: (1 - m) is no constant dampening, but the graph's own
    # (1 - m)*g is the exact gradient with dampening 0.
    nodes = [node("Sub", ["one", "m"], ["omm"]), node("Mul", ["g", "omm"], ["dg"]), node("Mul", ["buf", "m"], ["bm"]),
             node("Add", ["bm", "dg"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf"), value("m", F32, ())], [value("p_out"), value("buf_out")],
                     [const("one", 1.0), const("lr", 0.1)])
    result = fused_one(original)
    assert (result.report.fused[0].gradient, result.report.fused[0].momentum) == ("dg", "m")
    assert_in_place_equal(original, result.model, {"p_out": "p", "buf_out": "buf"})


def test_a_term_scaled_far_up_and_back_down_is_refused():
    # (buf*1e30)*0.9/1e30: the graph's intermediate overflows for |buf| > 3.4e8, the folded 0.9*buf does not.
    nodes = [node("Mul", ["buf", "s"], ["bs"]), node("Mul", ["bs", "mu"], ["bsm"]), node("Div", ["bsm", "s"], ["bm"]),
             node("Add", ["bm", "g"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["u"]), node("Sub", ["p", "u"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf")], [value("p_out"), value("buf_out")],
                     [const("lr", 0.1), const("mu", 0.9), const("s", 1e30)])
    assert refusal(original).reason == "cancelling-terms"


def test_a_buffer_behind_a_per_element_momentum_is_not_replaced_by_the_gradient():
    # buf' = m_vec*buf + g with m a per-element vector: the only linear reading takes g as the buffer with
    # momentum 1, which would write buf' into g in place. Without names it is refused, not guessed.
    shape = (3, 4)
    nodes = [node("Mul", ["m", "buf"], ["a"]), node("Add", ["a", "g"], ["bo"]), node("Mul", ["lr", "bo"], ["d"]),
             node("Sub", ["p", "d"], ["po"])]
    original = model(nodes, [value("p", F32, shape), value("g", F32, shape), value("buf", F32, shape)],
                     [value("po", F32, shape), value("bo", F32, shape)],
                     [numpy_helper.from_array(np.array([0.875, 0.5, 0.25, 0.125], np.float32), "m"), const("lr", 0.125)])
    r = refusal(original, "po")
    assert r.reason == "ambiguous-roles" and "--state" in r.detail, r


@pytest.mark.parametrize("lr", [2.0**-7, 2.0**-10, 2.0**-20])
def test_keras_with_a_power_of_two_learning_rate_takes_its_own_scaled_gradient(lr):
    # 1 - lr is exact in float32 here, but the op's grad - grad*d with d = 1 - lr keeps one ulp of grad on a
    # term of lr*grad: the graph's own lr*g with dampening 0 is the exact reading.
    original = keras_step(lr)
    result = fused_one(original)
    f = result.report.fused[0]
    assert (f.gradient, f.dampening) == ("lr_g", 0.0)
    assert_in_place_equal(original, result.model, {"w_out": "w", "m_out": "m"}, steps=6)


def test_a_dampening_within_two_to_the_minus_ten_of_one_with_no_scaled_value_is_refused():
    # buf' = 0.9*buf + g - d*g with d = 1 - 2^-12 written as g - d*g: no value holds (1 - d)*g.
    nodes = [node("Mul", ["buf", "mom"], ["bm"]), node("Mul", ["g", "d"], ["gd"]), node("Add", ["bm", "g"], ["t"]),
             node("Sub", ["t", "gd"], ["buf_out"]), node("Mul", ["buf_out", "lr"], ["st"]), node("Sub", ["p", "st"], ["p_out"])]
    original = model(nodes, [value("p"), value("g"), value("buf")], [value("p_out"), value("buf_out")],
                     [const("mom", 0.9), const("lr", 0.1), const("d", 1 - 2.0**-12)])
    assert refusal(original).reason == "inexact-coefficients"
