"""The native onnxruntime kernel for ``ai.sgdfuse::SGD`` (sgdfuse.ortkernel).

Pinned:
- onnxruntime runs the registered kernel, not the model-local function body, for the general body and for a
  specialised overload, in every dtype, with graph optimisations off and on (read from onnxruntime's profile);
- the kernel computes the contract bit for bit: the same hypothesis property as the function bodies
  (tests/test_fused_function.py), against the numpy reference, with the same strategies (edge values, ±0,
  Inf, NaN, subnormals, half-way roundings), for the general body's cases and for every specialisation's;
- ``check`` still passes on every testdata model with momentum updates with the kernel registered
  (``SGDFUSE_ORT_KERNEL=1``), and still rejects a tampered fused model; it really runs the kernel then (its
  native-dtype run keeps the SGD nodes instead of inlining their bodies): a kernel built wrong fails it;
- build errors are clear, and a failed build leaves no library behind.

The kernel is built once per machine (cached under the sgdfuse cache root): the first run of this module
fetches onnxruntime's headers with npm (about 10 s) and compiles (about 1 s).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from sgdfuse import api, ortkernel
from sgdfuse.contract import SgdAttributes
from sgdfuse.fused_op import INPUT_NAMES, OUTPUT_NAMES, Specialisation
from sgdfuse.lift import lift_to_double
from sgdfuse.reference import sgd
from sgdfuse.runtime import ORT_KERNEL_ENV, make_session, run
from sgdfuse.verify import check_models
from tests.test_fused_function import (
    BF16,
    DTYPES,
    F16,
    F32,
    KINDS,
    ONNX_DTYPES,
    PROPERTY_OPSET,
    SPECIALISATIONS,
    _assert_bitwise_equal,
    _model,
    _sgd_cases,
    _specialised_cases,
    _specialised_model,
)

TESTDATA = Path(__file__).resolve().parent.parent / "testdata" / "torch"
PROPERTY_EXAMPLES = 2000  # per dtype, as the function bodies' property
# The kernel does not read a node's overload: the specialised cases only narrow the inputs, so a shorter run
# per overload adds the corners of its preconditions (the bodies run 60 per overload).
SPECIALISED_EXAMPLES = 20


@pytest.fixture(scope="module")
def kernel() -> ortkernel.KernelBuild:
    if not os.environ.get(ortkernel.INCLUDE_ENV) and shutil.which("npm") is None:
        pytest.fail("neither npm nor SGDFUSE_ORT_INCLUDE: onnxruntime's headers cannot be had to build the kernel; "
                    "install npm (the test command fetches them from the npm registry) or point SGDFUSE_ORT_INCLUDE at them")
    return ortkernel.build_kernel()


@pytest.fixture
def with_kernel(kernel, monkeypatch) -> ortkernel.KernelBuild:
    """Every session sgdfuse.runtime.make_session creates has the kernel registered."""
    monkeypatch.setenv(ORT_KERNEL_ENV, "1")
    return kernel


def _executed_op_types(model: onnx.ModelProto, feeds: dict, *, optimise: bool, directory: Path) -> set[str]:
    """The op types onnxruntime executed for ``model`` with the kernel registered, from its profile."""
    options = ort.SessionOptions()
    ortkernel.register(options)
    options.enable_profiling = True
    options.profile_file_prefix = str(directory / "ort_profile")
    options.log_severity_level = 3
    if not optimise:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    run(session, feeds)
    profile = Path(session.end_profiling())
    try:
        events = json.loads(profile.read_text())
    finally:
        profile.unlink()
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


def _feeds(dtype: np.dtype, n: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(n).astype(np.float32).astype(dtype) for name in INPUT_NAMES}
    feeds["learning_rate"] = np.array([0.1], np.float32).astype(dtype)
    feeds["momentum"] = np.array([0.9], np.float32).astype(dtype)
    feeds["stat"] = np.array([0, 1, 0, 1, 0][:n], np.float32).astype(dtype)
    return feeds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optimise", [False, True], ids=["optimisations-off", "optimisations-on"])
@pytest.mark.parametrize("overload", ["general", "specialised"])
def test_onnxruntime_runs_the_kernel_instead_of_the_function_body(kernel, dtype, optimise, overload, tmp_path):
    attributes = SgdAttributes(dampening=0.1, weight_decay=0.01)
    if overload == "general":
        model = _model(dtype, PROPERTY_OPSET, None, [("", attributes)])
    else:
        spec = Specialisation(ONNX_DTYPES[dtype], False, True, True, True, False)
        model = _specialised_model(spec, attributes)
    feeds = _feeds(dtype)
    # Without the kernel the profile shows the body's elementwise nodes (Mul, Add, Sub...), never SGD.
    assert _executed_op_types(model, feeds, optimise=optimise, directory=tmp_path) == {"SGD"}


def _check_with_kernel(sessions: dict, model_for, key, attributes: SgdAttributes, feeds: dict, label: str) -> None:
    if key not in sessions:
        sessions[key] = make_session(model_for())
    actual = run(sessions[key], feeds)
    expected = dict(zip(OUTPUT_NAMES, sgd(*(feeds[n] for n in INPUT_NAMES), **dataclasses.asdict(attributes))))
    for name in OUTPUT_NAMES:
        _assert_bitwise_equal(f"kernel {label}: {name}", actual[name], expected[name], feeds, attributes)


PROPERTY_SETTINGS = settings(
    max_examples=PROPERTY_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference_bit_for_bit(with_kernel, dtype):
    kind = KINDS[dtype]
    sessions: dict = {}
    counts = collections.Counter()

    @PROPERTY_SETTINGS
    @given(case=_sgd_cases(kind))
    def check(case):
        attributes, feeds, _ = case
        model_for = lambda: _model(dtype, PROPERTY_OPSET, None, [("", attributes)])  # noqa: E731
        _check_with_kernel(sessions, model_for, attributes, attributes, feeds, "general")
        counts["examples"] += 1
        counts["momentum_zero"] += int(feeds["momentum"].astype(np.float32)[0] == 0)
        counts["nan_weights"] += int(np.isnan(sgd(*(feeds[n] for n in INPUT_NAMES), **dataclasses.asdict(attributes))[0].astype(np.float32)).sum())

    check()
    assert counts["examples"] >= PROPERTY_EXAMPLES
    assert counts["momentum_zero"] > 0 and counts["nan_weights"] > 0, counts


@pytest.mark.parametrize("spec", SPECIALISATIONS, ids=lambda s: s.overload)
def test_kernel_matches_reference_bit_for_bit_on_every_specialisation(with_kernel, spec):
    # Nodes that name a specialised overload run the same kernel; the cases are those of the overload's
    # preconditions (constant non-zero momentum, stat = +0, attributes on or off), as for the bodies.
    kind = KINDS[{TensorProto.FLOAT: F32, TensorProto.FLOAT16: F16, TensorProto.BFLOAT16: BF16}[spec.dtype]]
    sessions: dict = {}
    counts = collections.Counter()

    @settings(PROPERTY_SETTINGS, max_examples=SPECIALISED_EXAMPLES)
    @given(case=_specialised_cases(kind, spec))
    def check(case):
        attributes, feeds, _ = case
        _check_with_kernel(sessions, lambda: _specialised_model(spec, attributes), attributes, attributes, feeds, spec.overload)
        counts["examples"] += 1

    check()
    assert counts["examples"] >= SPECIALISED_EXAMPLES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "attributes",
    [SgdAttributes(), SgdAttributes(0.1, 0.01, False), SgdAttributes(0.0, 1 / 3, True), SgdAttributes(1 / 3, 0.0, False)],
    ids=["plain", "damp-wd", "nesterov-wd", "damp"],
)
@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["m0.9", "m0"])
def test_kernel_matches_reference_bit_for_bit_on_long_tensors(with_kernel, dtype, attributes, momentum):
    # The property's tensors hold at most 32 elements; the kernel's vector loops (8 FLOAT16 elements a step
    # on x86 with F16C, FLOAT with streaming stores from 2^18 elements, whatever GCC vectorised otherwise)
    # and their scalar tails run here on 2^18 + 5 elements: every edge value of the dtype, then ordinary
    # values and random bit patterns (NaN, Inf, subnormals among them).
    kind = KINDS[dtype]
    rng = np.random.default_rng(18)
    n = (1 << 18) + 5
    edges = np.array(kind.edge_bits(), dtype=kind.uint)

    def tensor() -> np.ndarray:
        bits = rng.integers(0, 1 << kind.width, n, dtype=np.uint64).astype(kind.uint)
        ordinary = (rng.standard_normal(n) * 2).astype(np.float32).astype(dtype).view(kind.uint)
        bits = np.where(rng.random(n) < 0.7, ordinary, bits)
        bits[: len(edges)] = rng.permutation(edges)
        return bits.view(dtype)

    feeds = {name: tensor() for name in ("parameters", "gradient", "accum")}
    flags = rng.choice(np.array([0.0, 1.0, -0.0], np.float32), n).astype(dtype)
    feeds["stat"] = np.where(rng.random(n) < 0.5, flags, tensor())  # 0/1 flags, and any value at all
    feeds["learning_rate"] = np.array([0.1], np.float32).astype(dtype)
    feeds["momentum"] = np.array([momentum], np.float32).astype(dtype)
    session = make_session(_model(dtype, PROPERTY_OPSET, None, [("", attributes)]))
    _check_with_kernel({"k": session}, None, "k", attributes, feeds, "long tensors")


@pytest.mark.parametrize(
    "attributes",
    [SgdAttributes(), SgdAttributes(0.1, 0.01, False), SgdAttributes(0.0, 1 / 3, True), SgdAttributes(1 / 3, 1e-45, False)],
    ids=["plain", "damp-wd", "nesterov-wd", "damp-tiny-wd"],
)
@pytest.mark.parametrize("momentum", [0.9, 0.0, -0.0, float("nan")], ids=["m0.9", "m0", "m-0", "mnan"])
def test_kernel_runs_lifted_double_models_as_their_lifted_bodies(kernel, attributes, momentum, tmp_path):
    # DOUBLE is not a contract dtype but what sgdfuse.lift makes of a model (check's DOUBLE run): with the
    # kernel registered such a model must still load, and give what its lifted function body gives.
    lifted = lift_to_double(_model(F32, PROPERTY_OPSET, None, [("", attributes)]))
    rng = np.random.default_rng(7)
    n = 1031
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, -5e-324, 1e308, -1e308, 1.0, 0.5], np.float64)

    def tensor() -> np.ndarray:
        values = rng.standard_normal(n) * 2
        values[: len(edges)] = edges
        return rng.permutation(values)

    feeds = {name: tensor() for name in ("parameters", "gradient", "accum", "stat")}
    feeds["learning_rate"] = np.array([0.1])
    feeds["momentum"] = np.array([momentum])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    bodies = ort.InferenceSession(lifted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = dict(zip(OUTPUT_NAMES, bodies.run(list(OUTPUT_NAMES), feeds)))
    assert _executed_op_types(lifted, feeds, optimise=False, directory=tmp_path) == {"SGD"}
    with_kernel = ort.InferenceSession(lifted.SerializeToString(), ortkernel.session_options(), providers=["CPUExecutionProvider"])
    actual = dict(zip(OUTPUT_NAMES, with_kernel.run(list(OUTPUT_NAMES), feeds)))
    for name in OUTPUT_NAMES:
        nan = np.isnan(expected[name])
        assert np.array_equal(np.isnan(actual[name]), nan), name  # NaN matches NaN, whatever its payload
        assert np.array_equal(actual[name][~nan].view(np.uint64), expected[name][~nan].view(np.uint64)), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_keeps_negative_zero_where_the_contract_selects_it(with_kernel, dtype):
    # momentum -0 keeps accum and stat as given, -0 included (what If rather than Where is for in the bodies).
    feeds = {name: np.array([-0.0], np.float32).astype(dtype) for name in INPUT_NAMES}
    feeds["learning_rate"] = np.array([1.0], np.float32).astype(dtype)
    feeds["gradient"] = np.array([0.0], np.float32).astype(dtype)
    attributes = SgdAttributes(0.25, 0.5, False)
    session = make_session(_model(dtype, PROPERTY_OPSET, None, [("", attributes)]))
    actual = run(session, feeds)
    for name in ("accum_out", "stat_out"):
        assert np.signbit(actual[name].astype(np.float32)).all(), name
    _check_with_kernel({"k": session}, None, "k", attributes, feeds, "negative zero")


def test_kernel_refuses_tensors_of_different_shapes_naming_the_input(with_kernel):
    session = make_session(_model(F32, PROPERTY_OPSET, None, [("", SgdAttributes())]))
    feeds = _feeds(F32)
    feeds["accum"] = np.zeros(4, np.float32)
    with pytest.raises(Exception, match="ai.sgdfuse::SGD: accum must have the shape of parameters"):
        run(session, feeds)


# --- check with the kernel registered ---------------------------------------------------------------------

# Every committed export with momentum updates (the ones without fuse nothing: no SGD node to run).
CHECK_MODELS = [
    e["file"] for e in json.loads((TESTDATA / "manifest.json").read_text())["models"] if e["expected_momentum_updates"] > 0
]


@pytest.mark.parametrize("file", CHECK_MODELS)
def test_check_passes_with_the_kernel_registered(with_kernel, file):
    original = onnx.load(TESTDATA / file)
    fused = api.optimize(original).model
    assert any(n.domain == "ai.sgdfuse" for n in fused.graph.node)
    result = check_models(original, fused, steps=3)
    assert result.passed, [o for o in result.outputs if not o["passed"]]


def test_check_rejects_a_tampered_fused_model_with_the_kernel_registered(with_kernel):
    original = onnx.load(TESTDATA / "sgd_dampening_legacy.onnx")
    fused = api.optimize(original).model
    for node in fused.graph.node:
        for attribute in node.attribute:
            if node.domain == "ai.sgdfuse" and attribute.name == "dampening":
                attribute.CopyFrom(helper.make_attribute("dampening", 0.5))
    assert not check_models(original, fused, steps=3).passed


def test_check_runs_the_kernel_so_a_wrong_kernel_fails_it(kernel, tmp_path, monkeypatch):
    # A kernel built from a source with one sign flipped (p + accum_t*lr): if check ran the function bodies
    # instead of the registered kernel, it would pass.
    source = ortkernel._SOURCE.read_text()
    wrong = source.replace("result = pf - accum_t * lr;", "result = pf + accum_t * lr;")
    assert wrong != source
    (tmp_path / "wrong.cc").write_text(wrong)
    monkeypatch.setattr(ortkernel, "_SOURCE", tmp_path / "wrong.cc")
    monkeypatch.setenv(ortkernel.INCLUDE_ENV, str(kernel.include))
    monkeypatch.setenv("SGDFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(ORT_KERNEL_ENV, "1")
    original = onnx.load(TESTDATA / "sgd_dampening_legacy.onnx")
    fused = api.optimize(original, verify=False).model
    assert not check_models(original, fused, steps=3).passed
    monkeypatch.delenv(ORT_KERNEL_ENV)
    assert check_models(original, fused, steps=3).passed


# --- build errors -----------------------------------------------------------------------------------------


def test_include_directory_without_the_header_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(ortkernel.INCLUDE_ENV, str(tmp_path))
    with pytest.raises(ortkernel.KernelBuildError, match="SGDFUSE_ORT_INCLUDE=.*no onnxruntime_c_api.h") as info:
        ortkernel.build_kernel(cache_dir=tmp_path / "cache")
    assert info.value.reason == "no-headers"


def test_header_older_than_the_api_the_kernel_needs_is_refused(tmp_path, monkeypatch):
    (tmp_path / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 15\n")
    monkeypatch.setenv(ortkernel.INCLUDE_ENV, str(tmp_path))
    with pytest.raises(ortkernel.KernelBuildError, match="C API version 15; the kernel needs 16") as info:
        ortkernel.build_kernel(cache_dir=tmp_path / "cache")
    assert info.value.reason == "no-headers"


def test_compile_failure_reports_the_compiler_output_and_leaves_no_library(kernel, tmp_path, monkeypatch):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv(ortkernel.INCLUDE_ENV, str(kernel.include))
    monkeypatch.setattr(ortkernel, "_SOURCE", broken)
    with pytest.raises(ortkernel.KernelBuildError, match="native SGD kernel .* failed; last lines") as info:
        ortkernel.build_kernel(cache_dir=tmp_path / "cache")
    assert info.value.reason == "compile-failed" and "error" in info.value.log
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_build_is_cached_and_compiled_without_contraction(kernel):
    again = ortkernel.build_kernel()
    assert again.cached and again.path == kernel.path
    record = json.loads((kernel.path.parent / "build.json").read_text())
    assert "-ffp-contract=off" in record["command"] and not any("fast-math" in f and "-fno" not in f for f in record["command"])
    assert kernel.api_version >= ortkernel.MIN_API_VERSION


# --- buffers bound over one another (IOBinding) -------------------------------------------------------------

def _bound_run(session, feeds: dict, outputs: list[np.ndarray]) -> None:
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    for name, array in zip(OUTPUT_NAMES, outputs):
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    session.run_with_iobinding(binding)


STATE_INPUTS = ("parameters", "gradient", "accum", "stat")
OWN_INPUT = {"parameters_out": "parameters", "accum_out": "accum", "stat_out": "stat"}


@pytest.mark.parametrize("dtype", [F32, F16], ids=["FLOAT", "FLOAT16"])
@pytest.mark.parametrize("n", [9, (1 << 18) + 3], ids=["short", "streamed"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_an_output_bound_over_another_input_gives_the_contract_result(with_kernel, dtype, n, momentum):
    """Each output written into the buffer of an input that is not its own (parameters_out over accum, say):
    the kernel reads every input before any write reaches it, as if the buffers were apart. Writing an output
    over its own input (in place) is the fast path and is checked too."""
    attributes = SgdAttributes(0.25, 0.5, False)
    session = make_session(_model(dtype, PROPERTY_OPSET, None, [("", attributes)]))
    cases = [{o: i} for o in OUTPUT_NAMES for i in STATE_INPUTS if OWN_INPUT[o] != i] + [dict(OWN_INPUT)]
    for case in cases:
        rng = np.random.default_rng(len(case))
        feeds = {name: rng.standard_normal(n).astype(np.float32).astype(dtype) for name in INPUT_NAMES}
        feeds["learning_rate"] = np.array([0.5], dtype)
        feeds["momentum"] = np.array([momentum], dtype)
        feeds["stat"] = (rng.random(n) < 0.5).astype(dtype)
        originals = {name: array.copy() for name, array in feeds.items()}
        expected = sgd(*(originals[name] for name in INPUT_NAMES), dampening=attributes.dampening,
                       weight_decay=attributes.weight_decay, nesterov=attributes.nesterov)
        outputs = [feeds[case[o]] if o in case else np.empty(n, dtype) for o in OUTPUT_NAMES]
        _bound_run(session, feeds, outputs)
        for name, have, want in zip(OUTPUT_NAMES, outputs, expected):
            _assert_bitwise_equal(f"{case}: {name}", have, np.asarray(want).astype(dtype), originals, attributes)


def test_outputs_bound_to_one_buffer_are_refused(with_kernel):
    session = make_session(_model(F32, PROPERTY_OPSET, None, [("", SgdAttributes())]))
    feeds = _feeds(F32)
    shared = np.empty(5, np.float32)
    with pytest.raises(Exception, match="outputs bound to overlapping memory"):
        _bound_run(session, feeds, [shared, shared, np.empty(5, np.float32)])


# --- setup mistakes --------------------------------------------------------------------------------------

def test_registering_twice_on_the_same_options_is_harmless(kernel):
    options = ort.SessionOptions()
    ortkernel.register(options)
    ortkernel.register(options)  # onnxruntime alone would refuse the session: "Domain already set in registry"
    session = ort.InferenceSession(
        _model(F32, PROPERTY_OPSET, None, [("", SgdAttributes())]).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = _feeds(F32)
    expected = sgd(*(feeds[name] for name in INPUT_NAMES))
    for name, want in zip(OUTPUT_NAMES, expected):
        _assert_bitwise_equal(name, run(session, feeds)[name], np.asarray(want).astype(F32), feeds, SgdAttributes())


def test_optimize_asked_to_use_a_kernel_it_cannot_build_fails_once_up_front(tmp_path, monkeypatch):
    """Not a verification failure per update (which would write an unfused model and exit 0): one error."""
    monkeypatch.setenv(ORT_KERNEL_ENV, "1")
    monkeypatch.setenv(ortkernel.INCLUDE_ENV, str(tmp_path))  # no header there
    model = TESTDATA / "sgd_momentum_dynamo.onnx"
    with pytest.raises(ortkernel.KernelBuildError, match="no onnxruntime_c_api.h there"):
        api.optimize(model)
    from sgdfuse.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["optimize", str(model), "-o", str(tmp_path / "out.onnx")])
    assert stop.value.code == 1 and not (tmp_path / "out.onnx").exists()


def test_a_cache_directory_that_is_a_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv(ortkernel.INCLUDE_ENV, raising=False)
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    with pytest.raises(ortkernel.KernelBuildError, match="cannot use the cache directory .*SGDFUSE_CACHE_DIR"):
        ortkernel.build_kernel(cache_dir=blocker)
