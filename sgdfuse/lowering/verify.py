"""Check a lowered GE graph against the ONNX model it came from: what ``sgdfuse lower`` runs before writing.

The comparison is ``sgdfuse check``'s (:func:`sgdfuse.verify.check_lowered`, docs/design.md, "Verification"):
onnxruntime on the fused ONNX model is check's *original* side, the GE graph in the numpy executor
(:mod:`sgdfuse.lowering.executor`) its *fused* side, run by :class:`_GESession`, which makes the executor
look like a session: fed every input by ONNX name, it writes each carried state (an ``SGD`` node's parameters
and buffer) into the state's ``Variable``, runs the step graph in place, and returns the graph's outputs, each
``SGD`` op's gradient, learning rate and momentum as the op read them, and what each state ``Variable``
holds after the step. So lower's check has check's

- schedule: a first step with a zero buffer, a zero-gradient step (a runtime momentum is 0 there: the op
  keeps the buffer and the rewrite's ``If`` recomputes it; a loss-scaling ``found_inf`` computed from
  ``g / scale`` is NaN there, so the guard skips; a guard computed from fed gradients alone has them fed +Inf
  on the "inf" extreme step, :func:`_input_roles`), random steps, then from the state reached the
  extreme-value steps, a restart, a step with random buffers, in the lifted run the isolating steps
  (:data:`sgdfuse.verify.ISOLATING_KINDS`: a weight decay of 1e-6 x 1.01 fails) and, for an update whose
  gradient was never live, the wide-range step; in lockstep (both sides fed onnxruntime's state) and in place (each side carrying
  its own: the executor's variables after the step are what it carries);
- precisions: natively and lifted to DOUBLE (the executor runs lifted: every float value as DOUBLE, the
  ``SGD`` op's formula in DOUBLE with its FLOAT attributes as stored; the fused model's nodes onnxruntime has
  no DOUBLE kernel for run in onnx's reference implementation,
  :func:`sgdfuse.runtime.make_session_with_reference_ops`), so that a coefficient a few roundings off (a
  learning rate x(1 + 1e-5), a dampening 1e-6, a weight decay dropped) and a layer's constant a relative 1e-6
  off (a LayerNorm or BatchNorm epsilon, a Conv weight) stand out;
- bound for each update's outputs and state writes, derived from the update's own terms, plus the measured
  difference of the gradients the two sides read, propagated (|Δg|, :class:`sgdfuse.verify._Terms`);
- "never compared" failures: an update whose gradient was never live, an output NaN everywhere; and an
  update's value finite on one side only fails whatever its bound (the bound is infinite where the update's
  terms are).

What differs from check is what is not an update's: the executor computes matrix products, reductions and
layers in another order than onnxruntime, so those outputs, and every ``SGD`` node's gradient, are compared
within ``atol + rtol*|onnxruntime's value|`` (:data:`TOLERANCES`, DOUBLE's in a lifted run, where both sides
compute in DOUBLE and a relative 1e-6 stands out), or within :data:`CONDITIONING_FACTOR` times onnxruntime's own
change when every float input of more than one element is nudged by :data:`PERTURBATION`
(:data:`PERTURBATION_DOUBLE` lifted), all alike and each on its own (:class:`_Conditioned`; the ResNet step's
BatchNorms at 1x1 spatial size turn a relative 1e-7 into ~1e-5, and at a zero image normalise their own rounding). A gradient wrong by more fails as a gradient; the update's bound allows only the
gradient difference measured. The init graph is checked on its own (:func:`_check_init`): run alone, it must
leave in each state variable exactly the value fed (a graph-input state), the initializer, or zeros.

Both sides run part by part (:mod:`sgdfuse.lowering.parts`: independent parts of the GE graph with the
ONNX nodes that compute the same outputs), packed into runs of about :data:`_CHUNK_OPS` GE ops, each run
fed from its own seed; from :data:`sgdfuse.verify.CLASS_MIN_PLANS` parts on, one member per class of parts
equal up to names, plus a seeded sample of :data:`sgdfuse.verify.CLASS_SAMPLE` (docs/lowering.md,
"Verification per class"). How each input is fed (its role) is decided on the whole fused model, as check
decides it, and is part of the class key. A state held in an initializer is made a graph input of the
onnxruntime copy, since an initializer cannot change between runs while the GE variable does.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import onnx
from onnx import helper

from sgdfuse.verify import non_negative_inputs
from sgdfuse import collector, runtime
from sgdfuse.fused_op import is_sgd_node
from sgdfuse.lowering.errors import LoweringError
from sgdfuse.lowering.ge_model import GEModel
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = ["LoweringCheck", "LoweringVerificationError", "verify_lowering", "TOLERANCES"]

logger = logging.getLogger(__name__)

TOLERANCES: dict[int, tuple[float, float]] = {
    onnx.TensorProto.FLOAT: (1e-4, 1e-5),
    onnx.TensorProto.DOUBLE: (2.0**-30, 2.0**-40),
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
        note: what could not be run and why (the lifted DOUBLE comparison of a part with an op that neither
            onnxruntime nor onnx's reference implementation runs in DOUBLE, a size the fused model cannot run),
            or "".
    """

    steps: int
    passed: bool
    outputs: dict[str, float]
    message: str = ""
    parts: int = 0
    classes: int = 0
    parts_run: int = 0
    note: str = ""


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


CONDITIONING_FACTOR = 16.0
"""An output element beyond the fixed tolerance still agrees when within this many times onnxruntime's own change
of it (or the output's largest relative change times its magnitude, :func:`_per_element`) for a
:data:`PERTURBATION` of the data inputs (the ResNet step's BatchNorms at 1x1 spatial size turn a
relative 1e-7 into ~1e-5 on some outputs; the executor's difference there was at most 3.4 times that)."""

PERTURBATION = 2.0**-22
"""Relative change of the data inputs for the conditioning chain (two float32 ulps); in a lifted run, where
every float input is DOUBLE, :data:`PERTURBATION_DOUBLE`."""

PERTURBATION_DOUBLE = 2.0**-40
"""Relative change of the DOUBLE inputs of a lifted run for the conditioning chain: 2^12 DOUBLE ulps, well above
the rounding of either side, and small enough that the bound it gives stays far below a FLOAT rounding, so a
lowered op off by a relative 1e-7 stands out (2^-22 here allowed 16 x 2^-22 ~ 4e-6 of any output)."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _cannot_verify(cause: str) -> LoweringVerificationError:
    return LoweringVerificationError("model", f"cannot verify the lowered graph: {cause}; pass --no-verify to write it unchecked")


_CHUNK_OPS = 1200
"""About this many GE step ops go into one run (parts are packed, so onnxruntime builds a few small sessions
instead of one per part: session building grows faster than linearly with a model's nodes)."""


@dataclasses.dataclass
class _Setup:
    """What the verification of one lowered model feeds and compares, shared by the runs of its parts."""

    probe: onnx.ModelProto
    fused: onnx.ModelProto
    pairs: dict[str, str]  # next value (probe output) -> state input
    initial: dict[str, np.ndarray]
    dtypes: dict[str, int]
    inputs: dict[str, onnx.ValueInfoProto]
    momenta: set[str]
    non_negative: frozenset[str]
    input_roles: dict[str, str] = dataclasses.field(default_factory=dict)
    """Fed input → how :func:`sgdfuse.verify.check_lowered` feeds it, decided on the whole model (as ``check``
    decides it): "non-negative", "coefficient" (what an SGD node's learning rate or momentum is computed
    from), "momentum" (a runtime momentum itself), "gradient" (what a gradient is computed from), "other";
    state inputs are fed as state whatever their entry."""

    def roles(self) -> dict[str, tuple]:
        """Input name → how it is fed: dtype, dims, and whether it is state, an initializer's state, a
        momentum, non-negative (what a class key must hold for the feeds to be of one kind)."""
        state = set(self.pairs.values())
        # The dims as the shape's canonical bytes (one call per input; equal exactly when every dim, value,
        # parameter and denotation, is).
        return {
            name: (value.type.tensor_type.elem_type, value.type.tensor_type.shape.SerializeToString(deterministic=True), name in state,
                   name in self.initial, name in self.momenta, name in self.non_negative, self.input_roles.get(name, ""))
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
    non_negative = frozenset(non_negative_inputs(probe.graph.node))
    return _Setup(
        probe, fused, pairs, initial, {o.name: o.type.tensor_type.elem_type for o in probe.graph.output}, {i.name: i for i in inputs},
        momenta, non_negative, _input_roles(probe, [i.name for i in inputs], momenta, non_negative,
                                            [v.guarded_by for v in lowered.state if v.guarded_by], set(pairs.values())),
    )


def _input_roles(probe: onnx.ModelProto, inputs: list[str], momenta: set[str], non_negative: frozenset[str],
                 guards: list[str] = (), state: set[str] = frozenset()) -> dict[str, str]:
    """:attr:`_Setup.input_roles`: the roles ``sgdfuse.verify._check_inputs`` gives on the whole model, so that
    an input read by several parts is fed alike in every run that reads it (a part's class stands for its
    members only when they would be fed as it is). A guard computed in the graph (``guards``: a loss-scaling
    ``found_inf``) must be seen to skip: computed from a one-element float input (a loss scale), it is NaN on
    check's zero-gradient step (``g / 0``); computed from gradients alone, those are given the role
    "overflow" (+Inf on the "inf" step, sgdfuse.verify._feed)."""
    from sgdfuse.verify import _sources

    producers = {output: node for node in probe.graph.node for output in node.output if output}

    def sources(values) -> set[str]:
        return _sources(values, (), producers)

    sgd = [node for node in probe.graph.node if is_sgd_node(node)]
    gradients = sources(node.input[1] for node in sgd if len(node.input) > 1)
    coefficients = sources(node.input[k] for node in sgd for k in (2, 4) if len(node.input) > k)
    roles = {}
    for name in inputs:
        role = ("non-negative" if name in non_negative else "coefficient" if name in coefficients else
                "gradient" if name in gradients else "other")
        roles[name] = "momentum" if role == "coefficient" and name in momenta else role
    if guards:
        read = sources(guards)
        floats = {i.name: i for i in probe.graph.input if i.name in roles and i.name not in state and i.name in read
                  and i.type.tensor_type.elem_type in TOLERANCES}
        scalars = [name for name, value in floats.items()
                   if all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim)
                   and int(np.prod([d.dim_value for d in value.type.tensor_type.shape.dim])) == 1]
        if not scalars:
            for name in floats:
                if roles[name] == "gradient":
                    roles[name] = "overflow"
    return roles


_WRITTEN = "sgdfuse_ge_variable/"
"""Prefix of the names under which :class:`_GESession` returns what a state variable holds after a step."""


class _GESession(runtime.ReferenceSession):
    """The GE model of a run of parts in the executor, as a session :func:`sgdfuse.verify.check_lowered` runs as
    its "fused" side: fed every input by ONNX name, state included, it writes each carried state into its
    ``Variable`` before the step (so the check's lockstep and in-place chains, and its steps from one state,
    drive the GE graph as they drive onnxruntime), runs the step graph in place, and returns the graph's
    outputs, each ``SGD`` op's gradient, learning-rate and momentum operands (as the op read them) under the
    probe names of the ONNX model, and what each state variable holds after the step (``written`` names, and
    the next values that are not graph outputs). The init graph runs before the first step."""

    def __init__(self, sub: GEModel, *, lifted: bool, inputs: list[str], state_variables: dict[str, str],
                 returned: dict[str, str], probes: dict[str, tuple[str, int]]) -> None:
        self.runner = sub.runner(lifted=lifted)
        self.init_inputs = list(sub.init_inputs.values())
        self._inputs = [runtime._Named(name) for name in inputs]
        self.output_names = list(sub.outputs)
        self.state_variables = state_variables  # ONNX state input -> GE Variable
        self.returned = returned  # name -> GE Variable whose value after the step it is
        self.probes = probes  # probe name -> (SGD op, input index)
        self.watch = frozenset(op for op, _ in probes.values())
        self.started = False
        self.error: Exception | None = None

    def run(self, names, feeds):
        from sgdfuse.lowering.executor import ExecutorError

        runner = self.runner
        if not self.started:
            runner.initialise({name: feeds[name] for name in self.init_inputs})
            self.started = True
        variables = runner.variables
        for state, variable in self.state_variables.items():
            variables[variable] = np.array(feeds[state], copy=True)
        try:
            outputs = runner.step(feeds, watch=self.watch)
        except ExecutorError as error:  # the executor cannot run the graph: the check cannot run, nothing disagrees
            self.error = error
            raise
        watched = runner.executor.watched
        result = {}
        for name in names:
            if name in outputs:
                result[name] = outputs[name]
            elif name in self.probes:
                op, port = self.probes[name]
                result[name] = watched[op][port]
            else:
                result[name] = np.array(variables[self.returned[name]], copy=True)
        return result


def _sgd_ops_by_variable(sub: GEModel) -> dict[str, str]:
    """GE ``Variable`` name → the ``SGD`` op whose parameters it is (input 0, through aliasing ops)."""
    ops = {op.name: op for op in sub.graph.op}
    found: dict[str, str] = {}
    for name in sub.sgd_ops:
        source = ops[name].input[0].rpartition(":")[0]
        seen = 0
        while source in ops and ops[source].type != "Variable" and ops[source].input and seen < 16:
            source, seen = ops[source].input[0].rpartition(":")[0], seen + 1
        found[source] = name
    return found


def _sgd_attributes_differ(fused: onnx.ModelProto, sub: GEModel) -> str:
    """The first GE ``SGD`` op of ``sub`` whose ``dampening``, ``weight_decay`` or ``nesterov`` is not its fused
    node's (FLOAT values compared as stored, absent ones as the contract's defaults), or whose ``reference`` is
    not true (GE then gives the op a new output buffer and the variable is not updated), described; else "".

    Lowering copies these attributes, so they must be equal, not merely close: the comparison of numbers gives a
    coefficient up to COEFFICIENT_ROUNDINGS FLOAT roundings (an exporter's folding), and a weight decay or
    dampening a relative 1e-4 off hid there (or wholly, where the lifted run cannot run)."""
    from sgdfuse.fused_op import read_sgd_attributes

    ops = {op.name: op for op in sub.graph.op}
    by_variable = _sgd_ops_by_variable(sub)
    for variable in sub.state:
        name = by_variable.get(variable.name) if variable.role == "parameters" else None
        if name is None:
            continue
        op, node = ops[name], fused.graph.node[variable.node]
        want = read_sgd_attributes(node)
        for key, wanted, default in (("dampening", want.dampening, 0.0), ("weight_decay", want.weight_decay, 0.0),
                                     ("nesterov", want.nesterov, False)):
            attr = op.attr.get(key)
            have = default if attr is None else (attr.b if key == "nesterov" else attr.f)
            if (bool(have) != bool(wanted)) if key == "nesterov" else not np.float32(have) == np.float32(wanted):
                return (f"the GE SGD op {name} has {key} {have!r}, the fused node {node.name or variable.node_name} "
                        f"{wanted!r} (a bug of the lowering; please report it with the model)")
        reference = op.attr.get("reference")
        if reference is None or not reference.b:
            return (f"the GE SGD op {name} is not marked reference (attribute reference true): GE would not write its "
                    "parameters in place (a bug of the lowering; please report it with the model)")
    return ""


def _data_indices_differ(graph: bytes, what: str, ops=None) -> str:
    """The first ``Data`` op of the serialised ``GraphDef`` ``graph`` whose ``index`` is not its place in the
    graph's input list (``GraphDef.input``), described; else "". GE binds the k-th input fed to the ``Data`` op of
    index k, while the executor feeds ``Data`` ops by name: two ``Data`` ops with their indices swapped passed the
    numbers and would take each other's inputs on the device. Read from the bytes without parsing any op but
    the ``Data`` ops (a step graph of 10,000 updates has 150,000 ops).

    ``ops``: the ops of ``graph`` as :func:`sgdfuse.lowering.parts._read_ops` read them (``graph`` is their
    ``data``), or None. With them only the bytes between the ops are walked for the input list (:func:`_fields_between`)
    and only the ``Data`` ops are parsed; where those bytes are not the ops' headers alone, laid out as read, the
    whole graph is walked field by field as without them, so the answer is the same either way
    (tests/test_lowering_data_index.py)."""
    from sgdfuse.lowering import ge_ir
    from sgdfuse.lowering.ge_model import read_varint

    input_field = ge_ir.GraphDef.DESCRIPTOR.fields_by_name["input"].number
    op_field = ge_ir.GraphDef.DESCRIPTOR.fields_by_name["op"].number
    type_field = ge_ir.OpDef.DESCRIPTOR.fields_by_name["type"].number
    inputs: list[str] = []
    indices: dict[str, int | None] = {}
    between = None if ops is None or ops.data is not graph else _fields_between(ops, op_field)
    if between is not None:
        inputs = [graph[start:end].decode() for tag, start, end in between if tag >> 3 == input_field]
        spans = ops.spans
        for k in [k for k, op_type in enumerate(ops.types) if op_type == "Data"]:
            start, end = spans[k]
            op = ge_ir.OpDef.FromString(graph[start:end])
            indices[op.name] = op.attr["index"].i if "index" in op.attr else None
    pos = len(graph) if between is not None else 0
    while pos < len(graph):
        tag, pos = read_varint(graph, pos)
        length, pos = read_varint(graph, pos)  # every GraphDef field is length-delimited
        start, pos = pos, pos + length
        if tag >> 3 == input_field:
            inputs.append(graph[start:pos].decode())
        elif tag >> 3 == op_field and _op_type(graph, start, pos, type_field, read_varint) == "Data":
            op = ge_ir.OpDef.FromString(graph[start:pos])
            indices[op.name] = op.attr["index"].i if "index" in op.attr else None
    for k, entry in enumerate(inputs):
        name = entry.rpartition(":")[0]
        if indices.get(name, k) != k:
            return (f"the {what} graph's Data op {name} has index {indices[name]}, but it is graph input {k}: GE would feed "
                    "it another input (a bug of the lowering; please report it with the model)")
    missing = sorted(set(indices) - {entry.rpartition(":")[0] for entry in inputs})
    if missing:
        return f"the {what} graph's Data op {missing[0]} is not in its input list (a bug of the lowering; please report it with the model)"
    return ""


def _fields_between(ops, op_field: int) -> list[tuple[int, int, int]] | None:
    """The ``GraphDef`` fields of ``ops.data`` that are not ops, as ``(tag, start, end)`` of their payloads, found
    by walking only the bytes before, between and after the ops' spans; None when those bytes are not exactly
    other fields and each op's own header (a one-byte tag ``op_field`` and the shortest varint of its length,
    what canonical bytes write) or an op field lies between the ops: the caller then walks every field.

    Cost: a few numpy operations over the spans, and a walk of the other fields (the input and output lists,
    the graph's name and attributes)."""
    import numpy as np

    from sgdfuse.lowering.ge_model import read_varint

    data, spans = ops.data, ops.spans
    op_tag = op_field << 3 | 2
    if op_tag >= 0x80:
        return None
    if not spans:
        bounds = np.zeros((0, 2), dtype=np.int64)
    else:
        bounds = np.array(spans, dtype=np.int64).reshape(-1, 2)
    lengths = bounds[:, 1] - bounds[:, 0]
    header = 2 + (lengths >= 1 << 7) + (lengths >= 1 << 14) + (lengths >= 1 << 21) + (lengths >= 1 << 28) + (lengths >= 1 << 35)
    begins = bounds[:, 0] - header  # where each op's field starts if its header is the canonical one
    previous = np.concatenate(([0], bounds[:-1, 1]))
    if np.any(begins < previous):
        return None
    regions = [(int(previous[k]), int(begins[k])) for k in np.flatnonzero(begins != previous)]
    regions.append((int(bounds[-1, 1]) if len(bounds) else 0, len(data)))
    fields: list[tuple[int, int, int]] = []
    for pos, stop in regions:
        while pos < stop:
            tag = data[pos]
            length = data[pos + 1] if pos + 1 < stop else 0x80
            if tag < 0x80 and length < 0x80:  # one-byte tag and length: the input list's entries
                pos += 2
            else:
                tag, pos = read_varint(data, pos)
                length, pos = read_varint(data, pos)
            if tag & 7 != 2 or tag >> 3 == op_field:
                return None
            fields.append((tag, pos, pos + length))
            pos += length
        if pos != stop:
            return None
    # Each op's header as read: its tag, then its length as the shortest varint, nothing else.
    if len(bounds):
        wire = np.frombuffer(data, dtype=np.uint8)
        if np.any(wire[begins] != op_tag):
            return None
        digits = header - 1
        for j in range(int(digits.max())):
            has = digits > j
            want = ((lengths[has] >> 7 * j) & 0x7F) | np.where(digits[has] > j + 1, 0x80, 0)
            if np.any(wire[begins[has] + 1 + j] != want):
                return None
    return fields


def _op_type(data: bytes, pos: int, end: int, type_field: int, read_varint) -> str:
    """The ``type`` of the ``OpDef`` at ``data[pos:end]``: canonical bytes write ``name`` and ``type`` first."""
    while pos < end:
        tag, pos = read_varint(data, pos)
        if tag & 7 != 2:
            return ""
        length, pos = read_varint(data, pos)
        if tag >> 3 == type_field:
            return data[pos: pos + length].decode()
        pos += length
    return ""


def _fixed_tolerance(want: np.ndarray) -> np.ndarray:
    """``atol + rtol*|value|`` of ``want``'s dtype (:data:`TOLERANCES`; DOUBLE in a lifted run)."""
    dtype = {np.dtype(np.float64): onnx.TensorProto.DOUBLE, np.dtype(np.float32): onnx.TensorProto.FLOAT,
             np.dtype(np.float16): onnx.TensorProto.FLOAT16}.get(want.dtype, onnx.TensorProto.BFLOAT16)
    rtol, atol = TOLERANCES[dtype]
    with np.errstate(invalid="ignore"):
        return atol + rtol * np.abs(np.nan_to_num(want.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0))


def _nudged(array: np.ndarray, nudge: float, rng: np.random.Generator | None) -> np.ndarray:
    """``array`` (a float input) moved by a relative ``nudge``, in its dtype: with ``rng`` None every element times
    ``1 + nudge``; else every element times ``1 ± nudge`` (a random sign each), and an array of zeros only
    replaced by ``± nudge`` (a relative change leaves a zero where it is)."""
    if rng is None:
        return (array * (1 + nudge)).astype(array.dtype)
    signs = np.where(rng.random(array.shape) < 0.5, -1.0, 1.0)
    wide = array.astype(np.float64)
    if not np.any(wide):
        return (signs * nudge).astype(array.dtype)
    return (wide * (1 + nudge * signs)).astype(array.dtype)


ROUNDING_DOMINATED = 2.0**-10
"""An output element whose nudged change exceeds this fraction of its magnitude (or that moves off an exact zero)
is its computation's rounding amplified, not a number (a zero image through BatchNormalization): another
implementation's value there is as good, and the output's bound is its largest change (:func:`_per_element`)."""


def _per_element(sensitivity: np.ndarray, want: np.ndarray) -> np.ndarray:
    """The conditioning allowance of each element of an output: its own change under the nudges, or the output's
    largest relative change times the element's magnitude, whichever is larger. Not the largest change of any
    element for every element: an output whose elements differ by a factor R in magnitude then allowed its small
    elements R times their own conditioning, and a gradient element a relative 1e-6 off passed beside elements
    1e6 times larger. The relative term keeps an element whose own change happened to be small under two random
    nudges from a bound below its rounding. Where some element is :data:`ROUNDING_DOMINATED` (a degenerate
    feed: a ResNet step's gradient at a zero image is 176 in the executor, 1.8e-8 in onnxruntime), the output's
    values are noise, and every element gets its largest change, as before."""
    magnitude = np.abs(want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(magnitude > 0, sensitivity / magnitude, np.where(sensitivity > 0, np.inf, 0.0))
    relative = float(np.max(ratios, initial=0.0))
    if relative > ROUNDING_DOMINATED:
        return np.full_like(sensitivity, float(np.max(sensitivity, initial=0.0)))
    return np.maximum(sensitivity, relative * magnitude)


class _Conditioned(runtime.ReferenceSession):
    """onnxruntime's session of the fused model (the check's original side), which remembers each run's
    feeds so that :meth:`loose` can run them again nudged (every float input of more than one element by a
    relative :data:`PERTURBATION`, :data:`PERTURBATION_DOUBLE` in a lifted run, twice: all elements alike, and each
    on its own, :func:`_nudged`) and allow a value that is not an update's :data:`CONDITIONING_FACTOR` times its
    largest change (module docstring)."""

    def __init__(self, session, momenta: set[str]) -> None:
        self.session = session
        self.momenta = momenta
        self._inputs = list(session.get_inputs())
        self._runs: dict[int, tuple] = {}  # id of an output array -> (the array, the run's record)

    def run(self, names, feeds):
        result = runtime.run(self.session, feeds, names)
        record = [feeds, None]
        for value in result.values():
            self._runs[id(value)] = (value, record)
        return result

    def loose(self, name: str, want: np.ndarray) -> np.ndarray:
        """The bound of ``want`` (this session's value of ``name`` on one run) for a value that is not an update's."""
        fixed = _fixed_tolerance(np.asarray(want))
        entry = self._runs.get(id(want))
        if entry is None or entry[0] is not want or np.asarray(want).dtype.kind not in "fV" and np.asarray(want).dtype.name != "bfloat16":
            return fixed
        record = entry[1]
        if record[1] is None:
            # Two nudges of the same size: every element scaled alike, and every element moved on its own (a
            # random sign each; an input that is all zeros moved by the nudge itself). The first keeps a ratio
            # of inputs, the second breaks the equalities a degenerate feed holds: a zero image in a network
            # with BatchNormalization makes every normalised value the amplified rounding of the layers below
            # (a ResNet step's loss at x = 0 moves from 9.40 to 12.6 for an x of 1e-7 noise, and onnxruntime's
            # own two optimisation levels differ there), which only the second nudge shows.
            rng = np.random.default_rng(0)
            runs = []
            for independent in (False, True):
                nudged = {}
                for key, value in record[0].items():
                    array = np.asarray(value)
                    if key not in self.momenta and (array.dtype.kind == "f" or array.dtype.name == "bfloat16") and array.size > 1:
                        array = _nudged(array, PERTURBATION_DOUBLE if array.dtype == np.float64 else PERTURBATION, rng if independent else None)
                    nudged[key] = array
                runs.append(runtime.run(self.session, nudged, list(self._runs_names(record))))
            record[1] = runs
        wide = np.asarray(want).astype(np.float64)
        sensitivity = np.zeros_like(wide)
        for run in record[1]:
            perturbed = run.get(name)
            if perturbed is None or np.shape(perturbed) != wide.shape:
                return fixed
            with np.errstate(invalid="ignore"):
                change = np.abs(wide - np.asarray(perturbed).astype(np.float64))
            if not np.all(np.isfinite(change)):
                return fixed
            sensitivity = np.maximum(sensitivity, change)
        return np.maximum(fixed, CONDITIONING_FACTOR * _per_element(sensitivity, wide))

    def _runs_names(self, record) -> list[str]:
        return [o.name for o in self.session.get_outputs()] if hasattr(self.session, "get_outputs") else list(self.session.output_names)


def _check_init(setup: _Setup, sub: GEModel, seed: int) -> str:
    """Run ``sub``'s init graph alone and check what it leaves in each state variable, exactly: the value fed
    for a graph-input state, the initializer for an initializer's, zeros for the rest. The step comparison
    writes every carried state itself (:class:`_GESession`), so this is where the init graph is checked.
    Returns the first disagreement, or ""."""
    rng = np.random.default_rng(seed)
    # Every graph-input state gets a value of its own (an init graph reading another state's Data op, or none,
    # then gives its variable something else).
    wanted = list(sub.init_inputs.values()) + [v.onnx_value for v in sub.state if v.source == "graph input"]
    feeds = {name: _feed(setup.inputs[name], rng, 0) if name in setup.inputs else setup.initial[name]
             for name in dict.fromkeys(wanted) if name in setup.inputs or name in setup.initial}
    runner = sub.runner()
    runner.initialise(feeds)
    for variable in sub.state:
        have = runner.variables.get(variable.name)
        if variable.source == "graph input":
            want = feeds.get(variable.onnx_value)
        elif variable.source == "initializer":
            want = setup.initial.get(variable.onnx_value, variable.initial)
        else:
            want = None if have is None else np.zeros_like(have)
        if want is None or have is None:
            if have is None:
                return f"the init graph leaves variable {variable.name} unassigned"
            continue
        want = np.asarray(want).astype(have.dtype) if np.asarray(want).dtype != have.dtype else np.asarray(want)
        what = f"the init graph gives variable {variable.name} ({variable.source} {variable.onnx_value})"
        if have.shape != want.shape:
            return f"{what} the shape {list(have.shape)}, the fused model {list(want.shape)}"
        if have.tobytes() != want.tobytes():
            k = int(np.flatnonzero(have.reshape(-1).view(np.uint8 if have.dtype.itemsize == 1 else f"u{have.dtype.itemsize}")
                                   != want.reshape(-1).view(np.uint8 if want.dtype.itemsize == 1 else f"u{want.dtype.itemsize}"))[0])
            return (f"{what} another initial value than the fused model's: element {k} is {have.reshape(-1)[k]!r} in GE, "
                    f"{want.reshape(-1)[k]!r} in the fused model")
    return ""


def _run_parts(setup: _Setup, parts, chunk: list, lowered_outputs: set[str], steps: int, seed: int, worst: dict[str, float]) -> LoweringCheck:
    """Run ``chunk`` (parts of :class:`sgdfuse.lowering.parts.LoweredParts`) together: their GE ops in the
    executor against their ONNX nodes in onnxruntime, by :func:`sgdfuse.verify.check_lowered` (module
    docstring); the largest differences go into ``worst``."""
    from sgdfuse.lowering.executor import ExecutorError, GraphContradictionError
    from sgdfuse.verify import check_lowered

    sub = parts.sub_model(chunk)
    outputs = [name for part in chunk for name in part.outputs]
    model = parts.onnx.model(outputs)
    fed = {i.name for i in model.graph.input}
    ge_inputs = list(dict.fromkeys(list(sub.input_names.values()) + list(sub.init_inputs.values())))
    for name in ge_inputs:  # read by the GE part alone: fed to both sides
        if name not in fed and name in setup.inputs:
            model.graph.input.append(setup.inputs[name])
            fed.add(name)
    states = {state for part in chunk for state in part.states}
    original_pairs = {state: output for output, state in setup.pairs.items() if state in states}
    state_variables = {v.onnx_value: v.name for v in sub.state
                       if v.source in ("graph input", "initializer") and v.role in _OUTPUT_OF_ROLE and v.onnx_value in original_pairs}
    written = {state: _WRITTEN + state for state in state_variables}
    returned = {_WRITTEN + state: variable for state, variable in state_variables.items()}
    returned.update((original_pairs[state], variable) for state, variable in state_variables.items())
    sgd_of = _sgd_ops_by_variable(sub)
    inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]

    sessions: list[_GESession] = []

    def session(lifted: bool, views) -> _GESession:
        # Each view's probes of its SGD node's operands are the GE SGD op's inputs; the op is found through
        # the Variable of the state the node writes its parameters into.
        probes: dict[str, tuple[str, int]] = {}
        for view in views:
            op = sgd_of.get(state_variables.get(view.parameters, ""))
            if op is not None:
                probes.update({view.gradient: (op, 1), view.learning_rate: (op, 2), view.momentum: (op, 4)})
        sessions.append(_GESession(sub, lifted=lifted, inputs=inputs, state_variables=state_variables, returned=returned, probes=probes))
        return sessions[-1]

    problem = _sgd_attributes_differ(setup.fused, sub)
    if problem:
        return LoweringCheck(steps, False, worst, problem)
    try:
        problem = _check_init(setup, sub, seed)
        if problem:
            return LoweringCheck(steps, False, worst, problem)
        momenta = setup.momenta & fed
        originals: list[_Conditioned] = []

        def conditioned(session, lifted: bool) -> _Conditioned:
            originals.append(_Conditioned(session, momenta))
            return originals[-1]

        def loose(name: str, want: np.ndarray) -> np.ndarray:
            for original in originals:
                if id(want) in original._runs:
                    return original.loose(name, want)
            return _fixed_tolerance(np.asarray(want))

        result = check_lowered(model, session, original_pairs=original_pairs, written=written, input_roles=setup.input_roles,
                               loose=loose, original_wrapper=conditioned, exact_attributes=True, steps=steps, seed=seed)
        for ge in sessions:
            if ge.error is not None:
                raise ge.error
    except GraphContradictionError as error:  # a wrong graph, not one the executor cannot run
        return LoweringCheck(steps, False, worst, f"the GE graph contradicts itself: {error} (a bug of the lowering: the graph "
                             "would fail or compute something else on the device; please report it with the model)")
    except ExecutorError as error:
        raise _cannot_verify(str(error)) from error
    except LoweringError:
        raise
    except ValueError as error:
        raise _cannot_verify(_first_line(error)) from error
    except Exception as error:  # onnxruntime failing
        if type(error).__module__.startswith("onnxruntime"):
            raise _cannot_verify(f"onnxruntime failed ({_first_line(error)})") from error
        raise
    message = ""
    # A coefficient the GE graph gets wrong fails every update that reads it, too: its own failure names the cause.
    for entry in sorted(result.outputs + result.in_place, key=lambda entry: entry["kind"] != "coefficient"):
        if entry["name"] in lowered_outputs and entry["kind"] != "in place":
            worst[entry["name"]] = max(worst.get(entry["name"], 0.0), float(entry["max_abs_error"]))
        if not entry["passed"] and not message:
            what = {"in place": "the GE graph's write into state ", "gradient": "SGD gradient ",
                    "coefficient": "SGD learning rate or momentum "}.get(entry["kind"], "output ")
            message = (f"{what}{entry['name']}: {entry['message']} (the GE graph in the executor is the 'fused' side, "
                       "onnxruntime on the fused ONNX model the 'original')")
    if message:
        return LoweringCheck(steps, False, worst, message, note=result.note)
    return LoweringCheck(steps, True, worst, note=result.note)


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
    from sgdfuse.lowering.parts import LoweredParts, _read_ops
    from sgdfuse.verify import CLASS_MIN_PLANS, CLASS_SAMPLE

    setup = _setup(fused, lowered)
    bodies: dict = {}
    try:  # the parts' reading of the ops, which the check of the Data ops' indices reuses
        read: tuple | None = (_read_ops(lowered.graph_bytes(), bodies), _read_ops(lowered.graph_bytes(init=True), bodies), bodies)
    except Exception:  # bytes the reader refuses (a Data op without an index): checked first by the whole walk, as
        read = None    # before; LoweredParts then reads them again, and raises as it did
    for what, init in (("step", False), ("init", True)):
        ops = None if read is None else read[init]
        problem = _data_indices_differ(lowered.graph_bytes(init=init) if ops is None else ops.data, what, ops)
        if problem:
            return LoweringCheck(steps, False, {name: 0.0 for name in lowered.outputs}, problem)
    parts = LoweredParts(setup.probe, {state: output for output, state in setup.pairs.items()}, lowered, read=read)
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
    notes: dict[str, None] = {}
    for number, chunk in enumerate(_chunks([parts.parts[k] for k in chosen])):
        check = _run_parts(setup, parts, chunk, lowered_outputs, steps, seed + number, worst)
        notes.update((text, None) for text in check.note.split("; ") if text)
        if not check.passed:
            return dataclasses.replace(check, parts=len(every), classes=len(classes), parts_run=len(chosen), note="; ".join(notes))
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
    return LoweringCheck(steps, True, worst, parts=len(every), classes=len(classes), parts_run=len(chosen), note="; ".join(notes))
