"""Check a lowered GE graph against the ONNX model it came from: what ``sgdfuse lower`` runs before writing.

The step graph runs in the numpy GE executor (:mod:`sgdfuse.lowering.executor`, in place: state lives in its
``Variable`` s, written by the ``SGD`` op and ``Assign`` s, after the init graph set it), and the fused ONNX
model runs in onnxruntime, for ``steps`` chained steps on the same seeded inputs. onnxruntime is fed its own
new state between steps (the next value of each state variable, :attr:`StateVariable.next_value
<sgdfuse.lowering.state.StateVariable.next_value>` when it has one, else the op's result: for a guarded update
the guard's output ``Where(condition, old, new)``, for a runtime momentum the rewrite's ``If``); the GE graph
keeps its own. Every ONNX graph output must agree at every step, so a state the GE graph left wrong after a
step shows in the next step's outputs.

Both sides run part by part (:mod:`sgdfuse.lowering.parts`: independent parts of the GE graph with the
ONNX nodes that compute the same outputs), packed into runs of about :data:`_CHUNK_OPS` GE ops, each run
fed from its own seed; from :data:`sgdfuse.verify.CLASS_MIN_PLANS` parts on, one member per class of parts
equal up to names, plus a seeded sample of :data:`sgdfuse.verify.CLASS_SAMPLE` (docs/lowering.md,
"Verification per class").

Inputs, as :mod:`sgdfuse.verify` makes them: floats from a standard normal (a one-element float, a learning
rate or runtime momentum, from U(0.01, 0.1); a momentum fed at run time is 0 on the second step);
integer scalars count steps (0, 1, 2, ...); other integer tensors are zeros; booleans are true on the first
step only, so a guard fed as a graph input takes both values within two steps. A guard computed in the graph
(a loss-scaling ``found_inf = any(!isfinite(grads))``) is made to skip on the second step: the float graph
inputs it is computed from (through node inputs, not subgraphs) are fed +inf there: the one-element ones, a
loss scale, when there are any, else every such input (gradients fed to the step). Random inputs never
overflow, and even float32's largest finite loss scale leaves a small model's gradients finite. A state held
in an initializer is made a graph input of the onnxruntime copy (fed its initial value, then chained), since
an initializer cannot change between runs while the GE variable does.

A gradient that is never live proves nothing (docs/design.md, "Verification"): a gradient computed in the
graph as ``Relu(x - 10)`` is zero on every standard-normal ``x``, and a lowered ``SGD`` with another dampening
passed. So each SGD node's gradient and outputs are probed in onnxruntime; when some SGD node's gradient was zero
or not finite at every element (where its outputs are finite) on every step, one more chained step feeds every
float input of more than one element that is neither state nor a runtime momentum wide-range values
(:func:`sgdfuse.verify.wide_values`, as ``check`` does), comparing only elements finite on both sides; an SGD
node whose gradient is still never live fails the check as never compared, naming its gradient.

Agreement, per element (NaN equals NaN; integers and booleans exactly): ``|ge - onnx| <= atol + rtol*|onnx|``,
with (rtol, atol) = (1e-4, 1e-5) for FLOAT and DOUBLE, (2^-8, 2^-10) for FLOAT16 and (2^-5, 2^-7) for
BFLOAT16: both sides compute the same formulas, so only summation order and the rounding of 16-bit values
(done once per op by both) differ, far inside these bounds; an old value read after the in-place write, a
missed write-back or a state fed from the wrong value differ by the size of an update.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import onnx
from onnx import helper

from sgdfuse.verify import WIDE, dead_gradient_message, finite_elements, gradient_live, non_negative_inputs, wide_values
from sgdfuse import collector, runtime
from sgdfuse.fused_op import is_sgd_node
from sgdfuse.lowering.errors import LoweringError
from sgdfuse.lowering.ge_model import GEModel
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = ["LoweringCheck", "LoweringVerificationError", "verify_lowering", "TOLERANCES"]

logger = logging.getLogger(__name__)

TOLERANCES: dict[int, tuple[float, float]] = {
    onnx.TensorProto.FLOAT: (1e-4, 1e-5),
    onnx.TensorProto.DOUBLE: (1e-4, 1e-5),
    onnx.TensorProto.FLOAT16: (2.0**-8, 2.0**-10),
    onnx.TensorProto.BFLOAT16: (2.0**-5, 2.0**-7),
}
"""ONNX float dtype → (rtol, atol) of the comparison (module docstring)."""

_OUTPUT_OF_ROLE = {"parameters": 0, "accum": 1}
"""State role → the ``SGD`` output holding its new value (the next state unless the variable names another
``next_value``: a guard's output, the runtime-momentum ``If``'s output)."""


class LoweringVerificationError(LoweringError):
    """The lowered graph disagrees with onnxruntime on the fused model, or the check could not run."""


@dataclasses.dataclass
class LoweringCheck:
    """The result of :func:`verify_lowering`.

    Attributes:
        steps: chained steps run.
        passed: every output agreed at every step.
        outputs: ONNX output name → largest |difference| seen.
        message: the first disagreement (output, step, element, both values, the tolerance), else "".
        parts, classes, parts_run: independent parts of the model, their classes (parts equal up to names),
            and how many parts were run (:mod:`sgdfuse.lowering.parts`).
    """

    steps: int
    passed: bool
    outputs: dict[str, float]
    message: str = ""
    parts: int = 0
    classes: int = 0
    parts_run: int = 0


def _feed(value: onnx.ValueInfoProto, rng: np.random.Generator, step: int, non_negative: frozenset[str] = frozenset()) -> np.ndarray:
    tensor_type = value.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else 2 for d in tensor_type.shape.dim)
    dtype = onnx_to_numpy_dtype(tensor_type.elem_type)
    if tensor_type.elem_type in TOLERANCES:
        if value.name in non_negative:
            # Read where only non-negative values are defined (a BatchNormalization variance, a Sqrt).
            return np.abs(rng.standard_normal(shape)).astype(np.float32).astype(dtype)
        if int(np.prod(shape)) == 1:
            return rng.uniform(0.01, 0.1, size=shape).astype(np.float32).astype(dtype)
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return np.full(shape, step if int(np.prod(shape)) == 1 else 0, dtype=dtype)
    if dtype == np.bool_:
        return np.full(shape, step == 0, dtype=bool)
    raise LoweringVerificationError(f"input {value.name}", f"no test data for dtype {dtype}; pass --no-verify to write the graph unchecked")


def _overflow_inputs(fused: onnx.ModelProto, lowered: GEModel, inputs: list[onnx.ValueInfoProto]) -> list[str]:
    """The runtime inputs fed +inf on the overflow step (module docstring): float graph inputs that a guard
    condition computed in the graph is computed from, the one-element ones if there are any. State inputs
    are never among them (their values are chained)."""
    guards = [v.guarded_by for v in lowered.state if v.guarded_by]
    if not guards:  # no guarded update (the common case): no table of every node's outputs
        return []
    runtime_floats = {i.name: i for i in inputs if i.type.tensor_type.elem_type in TOLERANCES}
    state = {v.onnx_value for v in lowered.state}
    producers = {output: node for node in fused.graph.node for output in node.output}
    stack = [guard for guard in guards if guard in producers]
    seen: set[str] = set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        node = producers.get(value)
        if node is not None:
            stack.extend(i for i in node.input if i)
    found = [name for name in runtime_floats if name in seen and name not in state]
    scalars = [name for name in found if _elements(runtime_floats[name]) == 1]
    return scalars or found


def _elements(value: onnx.ValueInfoProto) -> int:
    dims = value.type.tensor_type.shape.dim
    return int(np.prod([d.dim_value if d.HasField("dim_value") else 2 for d in dims]))


def _probe(fused: onnx.ModelProto, lowered: GEModel) -> tuple[onnx.ModelProto, dict[str, str], dict[str, np.ndarray]]:
    """The onnxruntime copy: state initializers as graph inputs, each state's next value as an output.

    Returns ``(model, next value → state input, initial values of the former initializers)``."""
    probe = onnx.ModelProto()
    probe.CopyFrom(fused)
    graph = probe.graph
    outputs = {o.name for o in graph.output}
    pairs: dict[str, str] = {}
    initial: dict[str, np.ndarray] = {}
    initializers = {t.name: t for t in graph.initializer}
    for variable in lowered.state:
        if variable.source not in ("graph input", "initializer"):
            continue
        out_index = _OUTPUT_OF_ROLE.get(variable.role)
        if out_index is None:  # stat: never fed state
            continue
        node = fused.graph.node[variable.node]
        next_value = variable.next_value or (node.output[out_index] if out_index < len(node.output) else "")
        if not next_value:
            continue
        pairs[next_value] = variable.onnx_value
        if next_value not in outputs:
            shape = None if variable.spec.shape is None else list(variable.spec.shape)
            graph.output.append(helper.make_tensor_value_info(next_value, variable.spec.dtype, shape))
            outputs.add(next_value)
        tensor = initializers.get(variable.onnx_value)
        if variable.source == "initializer" and tensor is not None:
            initial[tensor.name] = onnx.numpy_helper.to_array(tensor)
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    if initial:
        kept = [t for t in graph.initializer if t.name not in initial]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return probe, pairs, initial


def _disagreement(name: str, want: np.ndarray, have: np.ndarray, dtype: int, step: int, finite_only: bool = False) -> tuple[float, str]:
    """The largest |GE - onnxruntime| of output ``name`` and the first disagreement beyond the tolerance ("" when
    none). With ``finite_only`` (the :data:`sgdfuse.verify.WIDE` step) an element not finite on either side is
    left out: an overflow of wide values proves nothing either way."""
    if want.shape != have.shape:
        return float("inf"), f"output {name}, step {step}: shape {list(have.shape)} in GE, {list(want.shape)} in onnxruntime"
    if finite_only and want.size:
        want, have, kept = finite_elements(want, have)
        if not kept:
            return 0.0, ""
    if want.dtype == have.dtype and want.tobytes() == have.tobytes():
        return 0.0, ""  # bit for bit equal (most outputs): nothing to measure
    if dtype not in TOLERANCES:
        wrong = np.flatnonzero(want.reshape(-1) != have.reshape(-1))
        if wrong.size:
            k = int(wrong[0])
            got, wanted = have.reshape(-1)[k], want.reshape(-1)[k]
            return float("inf"), f"output {name}, step {step}, element {k}: {got!r} in GE, {wanted!r} in onnxruntime"
        return 0.0, ""
    rtol, atol = TOLERANCES[dtype]
    w, h = want.astype(np.float64), have.astype(np.float64)
    with np.errstate(invalid="ignore"):
        same = (w == h) | (np.isnan(w) & np.isnan(h))
        error = np.nan_to_num(np.where(same, 0.0, np.abs(h - w)), nan=np.inf)
    worst = float(error.max(initial=0.0))
    over = error > atol + rtol * np.abs(np.nan_to_num(w))
    if np.any(over):
        k = int(np.argmax(over.reshape(-1)))
        return worst, (
            f"output {name}, step {step}, element {k}: {float(h.reshape(-1)[k])!r} in GE, {float(w.reshape(-1)[k])!r} in "
            f"onnxruntime (allowed |difference| {atol:g} + {rtol:g}*|value|)"
        )
    return worst, ""


CONDITIONING_FACTOR = 16.0
"""An output beyond the fixed tolerance still agrees when within this many times onnxruntime's own change
for a :data:`PERTURBATION` of the data inputs (the ResNet step's BatchNorms at 1x1 spatial size turn a
relative 1e-7 into ~1e-5 on some outputs; the executor's difference there was at most 3.4 times that)."""

PERTURBATION = 2.0**-22
"""Relative change of the data inputs for the conditioning chain (two float32 ulps)."""


def _within_conditioning(expected: np.ndarray, actual: np.ndarray, perturbed: np.ndarray, finite_only: bool = False) -> bool:
    if expected.dtype.kind not in "f" and expected.dtype.name != "bfloat16":
        return False
    if finite_only:  # the wide step: only the elements finite on both sides were compared
        with np.errstate(invalid="ignore"):
            keep = np.isfinite(expected.astype(np.float64)) & np.isfinite(actual.astype(np.float64))
        expected, actual, perturbed = (np.where(keep, a.astype(np.float64), 0.0) for a in (expected, actual, perturbed))
    with np.errstate(invalid="ignore"):
        difference = np.abs(expected.astype(np.float64) - actual.astype(np.float64))
        sensitivity = np.abs(expected.astype(np.float64) - perturbed.astype(np.float64))
    if not (np.all(np.isfinite(difference)) and np.all(np.isfinite(sensitivity))):
        return False
    return float(np.max(difference)) <= CONDITIONING_FACTOR * float(np.max(sensitivity))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _cannot_verify(cause: str) -> LoweringVerificationError:
    return LoweringVerificationError("model", f"cannot verify the lowered graph: {cause}; pass --no-verify to write it unchecked")


def _specialised(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its SGD functions inlined per node and their ``If`` s on attributes resolved
    (:func:`sgdfuse.lift.specialise`: the same arithmetic, bit for bit); onnxruntime builds a session of it
    many times faster than of a model calling its functions (49 s against seconds for 2000 SGD nodes), since
    every ``If`` branch of every call is a graph of its own to initialise. A model the inliner refuses runs
    as it is."""
    from sgdfuse.lift import specialise

    try:
        return specialise(model)
    except Exception as error:  # onnx's inliner refusing a model
        logger.info("could not inline the fused model's functions (%s); running it as it is", error)
        return model


_CHUNK_OPS = 1200
"""About this many GE step ops go into one run (parts are packed, so onnxruntime builds a few small sessions
instead of one per part: session building grows faster than linearly with a model's nodes)."""


@dataclasses.dataclass
class _Setup:
    """What the verification of one lowered model feeds and compares, shared by the runs of its parts."""

    probe: onnx.ModelProto
    pairs: dict[str, str]  # next value (probe output) -> state input
    initial: dict[str, np.ndarray]
    dtypes: dict[str, int]
    inputs: dict[str, onnx.ValueInfoProto]
    momenta: set[str]
    overflow: set[str]
    non_negative: frozenset[str]

    def roles(self) -> dict[str, tuple]:
        """Input name → how it is fed: dtype, dims, and whether it is state, an initializer's state, a
        momentum, overflowed, non-negative (what a class key must hold for the feeds to be of one kind)."""
        state = set(self.pairs.values())
        # The dims as the shape's canonical bytes (one call per input; equal exactly when every dim, value,
        # parameter and denotation, is).
        return {
            name: (value.type.tensor_type.elem_type, value.type.tensor_type.shape.SerializeToString(deterministic=True), name in state,
                   name in self.initial, name in self.momenta, name in self.overflow, name in self.non_negative)
            for name, value in self.inputs.items()
        }


class _Spec:
    __slots__ = ("dtype", "shape")

    def __init__(self, value: onnx.ValueInfoProto) -> None:
        tensor_type = value.type.tensor_type
        self.dtype = tensor_type.elem_type
        self.shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim)


def _setup(fused: onnx.ModelProto, lowered: GEModel) -> _Setup:
    probe, pairs, initial = _probe(fused, lowered)
    initializer_names = {t.name for t in probe.graph.initializer}
    inputs = [i for i in probe.graph.input if i.name not in initializer_names]
    for value in inputs:  # the same refusal as before any part runs: an input no test data is made for
        elem_type = value.type.tensor_type.elem_type
        dtype = onnx_to_numpy_dtype(elem_type)
        if elem_type not in TOLERANCES and not np.issubdtype(dtype, np.integer) and dtype != np.bool_:
            raise LoweringVerificationError(f"input {value.name}", f"no test data for dtype {dtype}; pass --no-verify to write the graph unchecked")
    # A momentum fed at run time is 0 on the second step: the kernel then keeps the buffer, and the
    # rewrite's If recomputes it (the write-back), the path most easily lowered wrong.
    momenta = {n.input[4] for n in fused.graph.node if is_sgd_node(n) and len(n.input) > 4} & {i.name for i in inputs}
    # A guard computed in the graph (found_inf) skips on the second step: its float inputs overflow there.
    overflow = set(_overflow_inputs(fused, lowered, inputs))
    return _Setup(
        probe, pairs, initial, {o.name: o.type.tensor_type.elem_type for o in probe.graph.output}, {i.name: i for i in inputs},
        momenta, overflow, frozenset(non_negative_inputs(probe.graph.node)),
    )


@dataclasses.dataclass
class _Update:
    """An SGD node of a run: its gradient operand and its two outputs (new weights, new buffer), whose
    onnxruntime values the run probes to tell whether the gradient took part in a comparison."""

    gradient: str
    outputs: list[str]


def _updates(setup: _Setup, parts, outputs: list[str]) -> list[_Update]:
    """The SGD nodes among the ONNX nodes that compute ``outputs``, in graph order."""
    nodes = setup.probe.graph.node
    return [_Update(nodes[k].input[1], [o for o in nodes[k].output[:2] if o]) for k in parts.onnx.cone(outputs)
            if is_sgd_node(nodes[k]) and len(nodes[k].input) > 1 and nodes[k].input[1]]


def _update_live(update: _Update, values: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> bool:
    """Did ``update``'s gradient take part in this step's comparison (:func:`sgdfuse.verify.gradient_live` over
    the SGD node's outputs in onnxruntime and in GE where GE computes them)? ``values``: onnxruntime's outputs,
    the probes and the feeds of the step."""
    compared = [side[name] for side in (values, actual) for name in update.outputs if name in side]
    return gradient_live(values.get(update.gradient), compared)


def _dead_gradient(setup: _Setup, parts, update: _Update) -> str:
    """Why a run whose ``update`` never had a live gradient does not pass (:func:`sgdfuse.verify.dead_gradient_message`)."""
    state = set(setup.pairs.values())
    sources = [name for name in parts.onnx.inputs([update.gradient]) if name != update.gradient]
    sources.sort(key=lambda name: name in state)
    return dead_gradient_message(
        update.gradient, sources, update.outputs,
        "the lowering check feeds every input random values and wide ones, and none reaches this gradient; lower a "
        "form of the step that takes the gradient as a graph input, or pass --no-verify to write the graph unchecked",
    )


def _run_parts(setup: _Setup, parts, chunk: list, lowered_outputs: set[str], steps: int, seed: int, worst: dict[str, float]) -> LoweringCheck:
    """Run ``chunk`` (parts of :class:`sgdfuse.lowering.parts.LoweredParts`) together: their GE ops in the
    executor against their ONNX nodes in onnxruntime, ``steps`` chained steps, and the wide-range step when
    some SGD node's gradient was never live (module docstring); the largest differences go into ``worst``."""
    from sgdfuse.lowering.executor import ExecutorError

    sub = parts.sub_model(chunk)
    outputs = [name for part in chunk for name in part.outputs]
    updates = _updates(setup, parts, outputs)
    initializers = {t.name: t for t in setup.probe.graph.initializer}
    # The SGD nodes' gradients and outputs are probed (extra outputs of the onnxruntime model): a gradient that
    # is zero on every step proves nothing about the update's gradient term (sgdfuse.verify.WIDE).
    probes = [name for name in dict.fromkeys(n for u in updates for n in [u.gradient, *u.outputs])
              if name not in outputs and name not in setup.inputs and name not in initializers]
    constants = {u.gradient: onnx.numpy_helper.to_array(initializers[u.gradient]) for u in updates if u.gradient in initializers}
    try:
        session = runtime.make_session(_specialised(parts.onnx.model(outputs + probes)))
    except Exception as error:  # onnxruntime's own exception types
        raise _cannot_verify(f"onnxruntime cannot run the fused model ({_first_line(error)})") from error
    session_inputs = [i.name for i in session.get_inputs()]
    wanted = dict.fromkeys(session_inputs + list(sub.input_names.values()) + list(sub.init_inputs.values()))
    inputs = [setup.inputs[name] for name in wanted if name in setup.inputs]
    states = {state for part in chunk for state in part.states}
    pairs = {output: state for output, state in setup.pairs.items() if state in states}
    initial = {name: value for name, value in setup.initial.items() if name in wanted}
    momenta, overflow, non_negative = setup.momenta, setup.overflow, setup.non_negative
    rng = np.random.default_rng(seed)
    feeds = {i.name: _feed(i, rng, 0, non_negative) for i in inputs}
    feeds.update(initial)
    state_inputs = set(pairs.values())
    runner = sub.runner()

    def run_onnx(values) -> dict[str, np.ndarray]:
        return runtime.run(session, {name: values[name] for name in session_inputs})

    # A second onnxruntime chain with the data nudged by two float32 ulps measures how much the model itself
    # amplifies rounding (BatchNorm over a few values is ill-conditioned): an output beyond the fixed
    # tolerance still agrees within CONDITIONING_FACTOR times that change.
    data = [i.name for i in inputs if i.name not in state_inputs and i.name not in initial and i.name not in momenta
            and i.name not in overflow and np.asarray(feeds[i.name]).dtype.kind == "f" and np.asarray(feeds[i.name]).size > 1]
    nudged = dict(feeds)
    compared = [name for name in sub.outputs if name in lowered_outputs]
    live = [False] * len(updates)

    def run_step(step: int, finite_only: bool) -> str:
        """One chained step: compare, then feed the next step's state; the first disagreement, or ""."""
        for name in data:
            nudged[name] = (np.asarray(feeds[name]) * (1 + PERTURBATION)).astype(np.asarray(feeds[name]).dtype)
        expected = run_onnx(feeds)
        actual = runner.step(feeds)
        perturbed = None
        for name in compared:
            want, have = np.asarray(expected[name]), np.asarray(actual[name])
            error, message = _disagreement(name, want, have, setup.dtypes.get(name, 0), step + 1, finite_only)
            if message and data:
                perturbed = perturbed if perturbed is not None else run_onnx(nudged)
                if _within_conditioning(want, have, np.asarray(perturbed[name]), finite_only):
                    message = ""
            worst[name] = max(worst.get(name, 0.0), error)
            if message:
                return message
        values = {**feeds, **constants, **expected}
        live[:] = [seen or _update_live(update, values, actual) for update, seen in zip(updates, live)]
        if data:
            perturbed = perturbed if perturbed is not None else run_onnx(nudged)
            for output, state in pairs.items():
                nudged[state] = perturbed[output]
        for output, state in pairs.items():
            feeds[state] = expected[output]
        return ""

    def feed_next(step: int) -> None:
        """The inputs of step ``step + 1`` (0-based ``step`` just run) that are not state."""
        for value in inputs:
            if value.name not in state_inputs and value.name not in initial:
                feeds[value.name] = _feed(value, rng, step + 1, non_negative)
                if value.name in momenta and step == 0:
                    feeds[value.name] = np.zeros_like(feeds[value.name])
                if value.name in overflow and step == 0:
                    feeds[value.name] = np.full_like(feeds[value.name], np.inf)
                nudged[value.name] = feeds[value.name]

    def feed_wide() -> None:
        """The :data:`sgdfuse.verify.WIDE` step's inputs: every float input of more than one element that is not
        state nor a runtime momentum gets wide-range values (non-negative where only those are defined); a
        one-element one (a learning rate, a loss scale) keeps a learning-rate-like value, the state its chain."""
        for name in data + [name for name in overflow if name in feeds and np.asarray(feeds[name]).size > 1]:
            value = np.asarray(feeds[name])
            wide = wide_values(value.shape, value.dtype, rng)
            feeds[name] = nudged[name] = np.abs(wide) if name in non_negative else wide

    try:
        runner.initialise({name: feeds[name] for name in sub.init_inputs.values()})
        for step in range(steps):
            message = run_step(step, finite_only=False)
            if message:
                return LoweringCheck(step + 1, False, worst, message)
            feed_next(step)
        if not all(live):
            feed_wide()
            message = run_step(steps, finite_only=True)
            if message:
                return LoweringCheck(steps + 1, False, worst, f"{message} (the {WIDE}-range step)")
            dead = [update for update, seen in zip(updates, live) if not seen]
            if dead:
                return LoweringCheck(steps + 1, False, worst, _dead_gradient(setup, parts, dead[0]))
    except ExecutorError as error:
        raise _cannot_verify(str(error)) from error
    except LoweringError:
        raise
    except Exception as error:  # onnxruntime failing at run time
        if type(error).__module__.startswith("onnxruntime"):
            raise _cannot_verify(f"onnxruntime failed ({_first_line(error)})") from error
        raise
    return LoweringCheck(steps, True, worst)


def _chunks(parts: list) -> list[list]:
    """``parts`` packed in order into runs of about :data:`_CHUNK_OPS` GE step ops."""
    chunks: list[list] = []
    size = 0
    for part in parts:
        if not chunks or size + len(part.step_ops) > _CHUNK_OPS:
            chunks.append([])
            size = 0
        chunks[-1].append(part)
        size += len(part.step_ops)
    return chunks


def _classes(parts, setup: _Setup) -> dict[object, list[int]]:
    """Part indices by class key (:meth:`sgdfuse.lowering.parts.LoweredParts.key`); a part without a key is
    a class of its own."""
    roles = setup.roles()
    specs = {name: _Spec(value) for name, value in setup.inputs.items()}
    cache: dict = {}
    classes: dict[object, list[int]] = {}
    for k, part in enumerate(parts.parts):
        key = parts.key(part, specs.__getitem__, roles, setup.dtypes, cache)
        classes.setdefault(("own", k) if key is None else key, []).append(k)
    return classes


def verify_lowering(fused: onnx.ModelProto, lowered: GEModel, *, steps: int = 3, seed: int = 0) -> LoweringCheck:
    """Run ``lowered`` in the GE executor and ``fused`` in onnxruntime for ``steps`` chained steps and compare
    every output (module docstring).

    Args:
        fused: the ONNX model ``lowered`` was lowered from (with its ``SGD`` nodes).
        lowered: the result of :func:`sgdfuse.lowering.lower` on ``fused`` (``optimise=False``).

    Returns:
        The :class:`LoweringCheck` (``passed`` False on a disagreement; nothing is raised for that).

    Raises:
        LoweringVerificationError: the check cannot run (onnxruntime or the executor refuses the model, an
            input has a dtype no test data is made for); the message names the cause.
    """
    with collector.paused():  # parts and keys are many small objects alive to the end
        return _verify(fused, lowered, steps, seed)


def _verify(fused: onnx.ModelProto, lowered: GEModel, steps: int, seed: int) -> LoweringCheck:
    from sgdfuse.lowering.parts import LoweredParts
    from sgdfuse.verify import CLASS_MIN_PLANS, CLASS_SAMPLE

    setup = _setup(fused, lowered)
    parts = LoweredParts(setup.probe, {state: output for output, state in setup.pairs.items()}, lowered)
    lowered_outputs = set(lowered.outputs)
    worst = {name: 0.0 for name in lowered.outputs}
    every = list(range(len(parts.parts)))
    classes: dict[object, list[int]] = {k: [k] for k in every}
    chosen = every
    if len(every) >= CLASS_MIN_PLANS:
        classes = _classes(parts, setup)
        sampler = random.Random(seed)
        picked: set[int] = set()
        for members in classes.values():
            picked.add(members[0])
            picked.update(sampler.sample(members[1:], min(CLASS_SAMPLE, len(members) - 1)))
        chosen = sorted(picked)
    logger.info("lowering check: %d parts in %d classes, %d run", len(every), len(classes), len(chosen))
    for number, chunk in enumerate(_chunks([parts.parts[k] for k in chosen])):
        check = _run_parts(setup, parts, chunk, lowered_outputs, steps, seed + number, worst)
        if not check.passed:
            return dataclasses.replace(check, parts=len(every), classes=len(classes), parts_run=len(chosen))
    ran = set(chosen)
    for members in classes.values():
        first = parts.parts[members[0]]
        by_number = {number: name for name, number in first.names.items()}
        for k in members:
            if k in ran:
                continue
            for name in parts.parts[k].outputs:
                if name in lowered_outputs:
                    worst[name] = worst[by_number[parts.parts[k].names[name]]]
    return LoweringCheck(steps, True, worst, parts=len(every), classes=len(classes), parts_run=len(chosen))
