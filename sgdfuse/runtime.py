"""Running ONNX models in onnxruntime with numpy arrays of every dtype sgdfuse handles, BFLOAT16 included.

onnxruntime's Python API cannot feed or fetch BFLOAT16 as numpy arrays (seen with onnxruntime 1.32): BFLOAT16 inputs are bound as ``OrtValue``s made from ``uint16`` views through IO
binding, and BFLOAT16 outputs are copied out of the ``OrtValue``'s CPU buffer and viewed as
``ml_dtypes.bfloat16``. A model computing FLOAT16 runs with each FLOAT16 op's result rounded by an explicit
``Cast`` (:func:`make_session`): onnxruntime's CPU provider would round a chain of them once at its end.

With ``SGDFUSE_ORT_KERNEL=1`` in the environment, every session :func:`make_session` creates has sgdfuse's
native ``ai.sgdfuse::SGD`` kernel registered (:mod:`sgdfuse.ortkernel`, built on first use), so ``check`` and
``optimize``'s verification run fused nodes through the kernel instead of their function bodies.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import weakref
from collections.abc import Collection, Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from sgdfuse.passes.index import _outer_reads as _graph_outer_reads, _subgraphs

__all__ = ["ORT_KERNEL_ENV", "kernel_requested", "make_session", "make_session_with_reference_ops", "run", "onnx_to_numpy_dtype",
           "numpy_to_onnx_dtype", "ONNXRUNTIME_ERRORS", "MixedSession", "ReferenceSession", "REFERENCE_DOMAINS"]

logger = logging.getLogger(__name__)

REFERENCE_DOMAINS = frozenset({"ai.onnx.preview.training"})
"""Op domains onnxruntime does not run (ONNX's preview training ``Momentum``): a model using them runs in
``onnx.reference.ReferenceEvaluator`` instead (slow, exact to the ONNX reference)."""

ORT_KERNEL_ENV = "SGDFUSE_ORT_KERNEL"
"""Set to ``1`` to run fused nodes through the native kernel in every session :func:`make_session` creates."""

_BF16 = np.dtype(ml_dtypes.bfloat16)


def kernel_requested() -> bool:
    """True when :data:`ORT_KERNEL_ENV` asks for the native kernel; then it is built (or found in the cache)
    now, so that a command fails once, up front, when it cannot be had, rather than in every session.

    Raises:
        sgdfuse.ortkernel.KernelBuildError: the kernel was asked for and cannot be built (no headers, no
            compiler, a failed compile).
    """
    if os.environ.get(ORT_KERNEL_ENV) != "1":
        return False
    from sgdfuse import ortkernel  # imported only when asked for: it may build the kernel

    ortkernel.build_kernel()
    return True

from onnxruntime.capi import onnxruntime_pybind11_state as _state  # noqa: E402

ONNXRUNTIME_ERRORS: tuple[type[Exception], ...] = tuple(
    getattr(_state, name)
    for name in ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
                 "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail")
    if isinstance(getattr(_state, name, None), type)
)
"""The exception types onnxruntime raises when it refuses or fails to run a model (they derive from
``Exception`` directly, not ``RuntimeError``)."""
_ONNX_BF16 = onnx.TensorProto.BFLOAT16


def onnx_to_numpy_dtype(dtype: int) -> np.dtype:
    """numpy dtype of an ONNX ``TensorProto.DataType`` code (BFLOAT16 → ``ml_dtypes.bfloat16``)."""
    if dtype == _ONNX_BF16:
        return _BF16
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype))


def numpy_to_onnx_dtype(dtype: np.dtype) -> int:
    """ONNX ``TensorProto.DataType`` code of a numpy dtype (``ml_dtypes.bfloat16`` → BFLOAT16)."""
    if np.dtype(dtype) == _BF16:
        return _ONNX_BF16
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


class ReferenceSession:
    """``onnx.reference.ReferenceEvaluator`` behind :func:`run`, for models onnxruntime cannot run (ops of
    :data:`REFERENCE_DOMAINS`). Arrays go in and come out as numpy, BFLOAT16 included."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.evaluator = _reference_evaluator()(model)
        self.output_names = [o.name for o in model.graph.output]
        initialised = {t.name for t in model.graph.initializer}
        self._inputs = [_Named(i.name) for i in model.graph.input if i.name not in initialised]

    def get_inputs(self) -> list["_Named"]:
        """The fed graph inputs, as onnxruntime's ``get_inputs`` lists them (objects with a ``name``)."""
        return list(self._inputs)

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``{name: array}`` for ``names`` (graph outputs) given ``feeds``."""
        values = self.evaluator.run(list(names), {k: np.asarray(v) for k, v in feeds.items()})
        return dict(zip(names, values))


@functools.cache
def _reference_evaluator() -> type:
    """``onnx.reference.ReferenceEvaluator`` with two of its operators made to compute in DOUBLE as the
    specification defines them (onnx 1.23): its ``Erf`` rounds every result to FLOAT (``np.vectorize(erf,
    otypes=["f"])``; a relative 3e-8 in a lifted run, where both sides are compared within 2^-40), and its
    ``LayerNormalization`` refuses a ``stash_type`` other than FLOAT, which :func:`sgdfuse.lift.lift_to_double`
    makes DOUBLE (onnx's kernel computes in its input's type whatever the stash type). And its ``Col2Im``, a
    Python loop per element (1.2 s of every run of the ResNet step), is vectorised for 2-D images
    (:func:`_col2im_2d`: the same sums; tests/test_lowering_lifted_reference.py holds it to onnx's). The class
    also evaluates the function bodies it expands (``Gelu``'s ``Erf``) with these operators."""
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops._op import OpRunUnaryNum
    from onnx.reference.ops.op_col2im import Col2Im as OnnxCol2Im
    from onnx.reference.ops.op_layer_normalization import LayerNormalization as OnnxLayerNormalization

    class Erf(OpRunUnaryNum):
        def _run(self, x):
            return (np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy(),)

    class LayerNormalization(OnnxLayerNormalization):
        def _run(self, X, Scale, B=None, axis=None, epsilon=None, stash_type=None):
            if stash_type == onnx.TensorProto.DOUBLE and X.dtype == np.float64:
                stash_type = onnx.TensorProto.FLOAT  # the same computation: onnx's kernel is X's type throughout
            return super()._run(X, Scale, B, axis=axis, epsilon=epsilon, stash_type=stash_type)

    class Col2Im(OnnxCol2Im):
        def _run(self, data, image_shape, block_shape, dilations=None, pads=None, strides=None):
            shaped = _col2im_2d(data, image_shape, block_shape, dilations, pads, strides)
            if shaped is None:  # another rank, or shapes onnx's own kernel explains the error of
                return super()._run(data, image_shape, block_shape, dilations=dilations, pads=pads, strides=strides)
            return (shaped,)

    class Evaluator(ReferenceEvaluator):
        def __init__(self, proto, *args, **kwargs) -> None:
            kwargs["new_ops"] = [Col2Im, Erf, LayerNormalization, *(kwargs.get("new_ops") or ())]
            super().__init__(proto, *args, **kwargs)

    return Evaluator


def _col2im_2d(data: np.ndarray, image_shape, block_shape, dilations, pads, strides) -> "np.ndarray | None":
    """ONNX's ``Col2Im`` of ``data`` [N, C·kh·kw, L] for a 2-D ``image_shape`` [H, W] and ``block_shape``
    [kh, kw]: ``image[n, c, i·sh - ph + a·dh, j·sw - pw + b·dw] += data[n, (c·kh + a)·kw + b, i·BW + j]`` over
    every block position (i, j) of the BH x BW grid and kernel tap (a, b) that lands inside the image (the
    specification's sum, as onnx's ``col2im_naive_implementation`` loops it), by ``np.add.at``; None for another
    rank or shapes that do not fit (onnx's own kernel then raises its error)."""
    image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
    block = [int(v) for v in np.asarray(block_shape).reshape(-1)]
    if len(image) != 2 or len(block) != 2 or data.ndim != 3:
        return None
    dilations = [1, 1] if dilations is None else [int(v) for v in dilations]
    pads = [0, 0, 0, 0] if pads is None else [int(v) for v in pads]
    strides = [1, 1] if strides is None else [int(v) for v in strides]
    grid = [(image[k] + pads[k] + pads[k + 2] - dilations[k] * (block[k] - 1) - 1) // strides[k] + 1 for k in range(2)]
    batch, rows, length = data.shape
    channels = rows // (block[0] * block[1]) if block[0] * block[1] else 0
    if min(grid) < 1 or channels * block[0] * block[1] != rows or grid[0] * grid[1] != length:
        return None
    # Coordinates in the image padded by `pads` on each side, where every tap lands (the grid's formula).
    along = [(np.arange(grid[k]) * strides[k])[None, :] + (np.arange(block[k]) * dilations[k])[:, None] for k in range(2)]
    top, left = np.broadcast_arrays(along[0][:, None, :, None], along[1][None, :, None, :])  # [kh, kw, BH, BW]
    padded = np.zeros((batch, channels, image[0] + pads[0] + pads[2], image[1] + pads[1] + pads[3]), data.dtype)
    np.add.at(padded, (slice(None), slice(None), top, left), data.reshape(batch, channels, block[0], block[1], grid[0], grid[1]))
    return padded[:, :, pads[0] : pads[0] + image[0], pads[1] : pads[1] + image[1]].copy()


def make_session(model: onnx.ModelProto | bytes) -> "ort.InferenceSession | ReferenceSession":
    """A single-threaded CPU ``InferenceSession`` for ``model``, with graph optimisations off so that what runs
    is the graph as written (no constant folding or fusion that could change rounding); a :class:`ReferenceSession`
    for a model with ops onnxruntime does not run (:data:`REFERENCE_DOMAINS`). With ``SGDFUSE_ORT_KERNEL=1`` the
    native SGD kernel is registered (:mod:`sgdfuse.ortkernel`).

    Raises:
        KernelBuildError: ``SGDFUSE_ORT_KERNEL=1`` and the kernel cannot be built.
    """
    if isinstance(model, onnx.ModelProto) and any(node.domain in REFERENCE_DOMAINS for node in model.graph.node):
        return ReferenceSession(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    # One thread, no spinning: the checks build many small sessions (each would start its own thread pool)
    # and run tiny tensors; a pool costs more than it gives (sessions of 1,000 nodes built 2-2.5x faster).
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if os.environ.get(ORT_KERNEL_ENV) == "1":
        from sgdfuse import ortkernel  # imported only when asked for: it may build the kernel

        ortkernel.register(options)
    if isinstance(model, onnx.ModelProto) and _mentions(model, onnx.TensorProto.FLOAT16):
        model = _float16_rounded_per_op(model)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    try:
        return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    except ONNXRUNTIME_ERRORS as error:
        session = _bfloat16_in_float(model, error, options)
        if session is None:
            raise
        return session


def make_session_with_reference_ops(model: onnx.ModelProto, known: Collection[str] = ()) -> "tuple[ort.InferenceSession | ReferenceSession, list[str]]":
    """:func:`make_session` of ``model``, or, when onnxruntime has no kernel for some of its ops in the types
    they are used with (a lifted model's DOUBLE ``Conv``, ``AveragePool``, ``Col2Im``, ``LayerNormalization``,
    and the ``Erf`` of ``Gelu``'s function body, seen with onnxruntime 1.32), a :class:`MixedSession` that runs
    the nodes of those op types in onnx's reference implementation and every other node in onnxruntime; and
    the op types so run (empty for a plain session).

    onnxruntime names one missing kernel per refusal, so the op types are found by asking again (at most
    :data:`_MAX_EMULATION_ROUNDS` times), each time with the ops found so far taken out. A kernel named again
    once the nodes of its op are out is missing in the function body onnxruntime expands another node into
    (``Gelu``'s ``Erf``): the nodes whose body (``onnx.defs``) holds that op are taken out too.

    ``known``: op types found missing before, for a model of the same kind (a caller making the sessions of
    several parts of one lifted model, or the original and fused sides of one slice): those of them that
    ``model`` uses go to the reference implementation from the start, which saves the refused attempts (each
    builds a session of the whole model before onnxruntime names the kernel). An op type named there that has a
    kernel after all is computed by the reference implementation as the specification defines it: slower, the
    same values.

    Raises:
        onnxruntime's error: a refusal that names no missing kernel, or one that no node of ``model`` explains.
        ValueError: the split needs the type of a value that ONNX shape inference cannot give.
    """
    missing: set[str] = {op for op in known if any(_uses(node, (op,)) for node in model.graph.node)}
    try:
        if missing:
            return MixedSession(model, missing), sorted(missing)
        return make_session(model), []
    except ONNXRUNTIME_ERRORS as error:
        last: Exception = error
    for _ in range(_MAX_EMULATION_ROUNDS):
        named = set(_missing_kernels(last))
        more = {node.op_type for node in model.graph.node if _uses(node, named)} - missing
        if not more:  # the nodes of that op are out already: the op is in a body onnxruntime expands
            more = _op_types_expanding_to(model, named) - missing
        if not more:
            raise last
        missing |= more
        try:
            return MixedSession(model, missing), sorted(missing)
        except ONNXRUNTIME_ERRORS as again:
            last = again
    raise last


def _missing_kernels(error: Exception) -> list[str]:
    from sgdfuse.lift import missing_kernels  # lift imports nothing of runtime

    return missing_kernels(error)


def _op_types_expanding_to(model: onnx.ModelProto, op_types: set[str]) -> set[str]:
    """The op types of ``model``'s (top-level, default-domain) nodes whose function body, as ONNX defines it for
    the model's opset and the node's input types, holds one of ``op_types``: onnxruntime expands a node it has
    no kernel for into that body, and then names the body's op it has no kernel for either."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or not op_types:
        return set()
    types = _value_types(model)
    found: set[str] = set()
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type not in found and op_types & _body_op_types(node, opset, types):
            found.add(node.op_type)
    return found


def _body_op_types(node: onnx.NodeProto, opset: int, types: Mapping[str, onnx.TypeProto]) -> set[str]:
    """The op types of the function body ONNX's schema gives ``node`` at ``opset`` (context-dependent bodies
    built for its input types), nested bodies included; empty when it has none."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return set()
    body: list[onnx.NodeProto] = []
    versions = [v for v in schema.function_opset_versions if v <= opset]
    dependent = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    if versions and (not dependent or max(versions) >= max(dependent)):
        body = list(onnx.FunctionProto.FromString(schema.get_function_with_opset_version(max(versions))).node)
    elif dependent and all(name in types for name in node.input if name):
        built = schema.get_context_dependent_function_with_opset_version(
            max(dependent), node.SerializeToString(), [types[name].SerializeToString() for name in node.input if name])
        body = list(onnx.FunctionProto.FromString(built).node)
    found = {inner.op_type for inner in body}
    for inner in body:  # the body's own values are not typed here: a nested context-dependent body is not built
        found |= _body_op_types(inner, opset, {})
    return found


class MixedSession(ReferenceSession):
    """``model`` run in stages (:func:`make_session_with_reference_ops`): the nodes of ``reference_ops`` (or with
    a subgraph using one) by ``onnx.reference.ReferenceEvaluator``, the others by onnxruntime (:func:`make_session`
    sessions of sub-models), each stage fed what the stages before it computed.

    A node runs in the earliest stage its operands allow: onnxruntime's stage ``s`` holds the nodes that depend
    (through data edges) on ``s`` reference stages at most, so the number of onnxruntime sessions is one more
    than the longest chain of reference nodes, not one per node (the ResNet step's 19 ``Col2Im`` s, 16 in a
    chain, make 17 onnxruntime and 16 reference stages). The reference implementation computes each op as the
    ONNX specification defines it, in the operands' own type (:func:`_reference_evaluator`), so that a DOUBLE
    model's values stay DOUBLE end to end.

    Raises:
        onnxruntime's error: a stage it refuses (another op it has no kernel for: see the caller).
        ValueError: the type of a value passed between stages is not known from the model's value infos or
            ONNX shape inference.
    """

    def __init__(self, model: onnx.ModelProto, reference_ops: "set[str] | frozenset[str]") -> None:
        graph = model.graph
        initializers = {t.name: t for t in graph.initializer}
        fed = [i for i in graph.input if i.name not in initializers]
        self._inputs = [_Named(i.name) for i in fed]
        self.output_names = [o.name for o in graph.output]
        stages = _stages(graph.node, reference_ops)
        types = _value_types(model)
        # What each stage reads from outside itself, and which of its results a later stage or the caller reads.
        reads = [sorted(set().union(*(_outer_reads(node) for node in nodes)) - _produced(nodes)) for _, nodes in stages]
        wanted_later: set[str] = set(self.output_names)
        outputs: list[list[str]] = [[] for _ in stages]
        for k in reversed(range(len(stages))):
            outputs[k] = [name for name in _produced_in_order(stages[k][1]) if name in wanted_later]
            wanted_later.update(reads[k])
        # A graph output no node computes (an initializer) is returned as stored.
        self._constants = {name: numpy_helper.to_array(initializers[name]) for name in self.output_names if name in initializers}
        self._stages: list[tuple[object, list[str], list[str]]] = []
        for (reference, nodes), needed, produced in zip(stages, reads, outputs):
            if not produced:
                continue
            stage_inputs = [name for name in needed if name not in initializers]
            sub = _stage_model(model, nodes, [_typed(name, types) for name in stage_inputs],
                               [_typed(name, types) for name in produced], [initializers[n] for n in needed if n in initializers])
            runner = ReferenceSession(sub) if reference else make_session(sub)
            self._stages.append((runner, stage_inputs, produced))

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``{name: array}`` for ``names`` (graph outputs) given ``feeds``, every stage run in order."""
        values = {**self._constants, **feeds}
        for runner, stage_inputs, produced in self._stages:
            values.update(run(runner, {name: values[name] for name in stage_inputs}, produced))
        return {name: values[name] for name in names}


def _stage_model(model: onnx.ModelProto, nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    """A model of ``nodes`` with ``model``'s opsets, IR version and functions."""
    graph = onnx.helper.make_graph(list(nodes), model.graph.name or "stage", inputs, outputs, list(initializers))
    sub = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    sub.functions.extend(model.functions)
    return sub


def _stages(nodes, reference_ops) -> list[tuple[bool, list[onnx.NodeProto]]]:
    """``nodes`` (in topological order) split into alternating onnxruntime and reference stages
    (:class:`MixedSession`): ``[(reference?, nodes)]``, onnxruntime's first."""
    ready_at: dict[str, int] = {}  # value -> the first onnxruntime stage (0, 1, ...) that can read it
    ort_stages: list[list[onnx.NodeProto]] = [[]]
    reference_stages: list[list[onnx.NodeProto]] = []
    for node in nodes:
        level = max((ready_at.get(name, 0) for name in _outer_reads(node)), default=0)
        if _uses(node, reference_ops):
            # Reference stage `level` runs after onnxruntime's stage `level`: its results are ready at level + 1.
            while len(reference_stages) <= level:
                reference_stages.append([])
            reference_stages[level].append(node)
            level += 1
        else:
            while len(ort_stages) <= level:
                ort_stages.append([])
            ort_stages[level].append(node)
        for name in node.output:
            if name:
                ready_at[name] = level
    stages: list[tuple[bool, list[onnx.NodeProto]]] = []
    for k in range(max(len(ort_stages), len(reference_stages) + 1)):
        if k < len(ort_stages):
            stages.append((False, ort_stages[k]))
        if k < len(reference_stages):
            stages.append((True, reference_stages[k]))
    return stages


def _uses(node: onnx.NodeProto, op_types) -> bool:
    """Is ``node`` of one of ``op_types``, or does a subgraph of it hold one?"""
    if node.op_type in op_types:
        return True
    return any(_uses(inner, op_types) for attribute in node.attribute for sub in _subgraphs(attribute) for inner in sub.node)


def _outer_reads(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads from its graph: its inputs and what its subgraphs read from outside themselves
    (:func:`sgdfuse.passes.index._outer_reads`)."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        for sub in _subgraphs(attribute):
            names |= _graph_outer_reads(sub)
    return names


def _produced(nodes) -> set[str]:
    return {name for node in nodes for name in node.output if name}


def _produced_in_order(nodes) -> list[str]:
    return [name for node in nodes for name in node.output if name]


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's declared or inferred type (ONNX shape inference; the model's own declarations win)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception as error:  # inference refusing the model: only the declared types are known
        logger.info("shape inference failed (%s); the declared types only", error)
        inferred = model.graph
    types: dict[str, onnx.TypeProto] = {}
    for graph in (inferred, model.graph):
        for info in (*graph.value_info, *graph.input, *graph.output):
            if info.type.WhichOneof("value") is not None:
                types[info.name] = info.type
    return types


def _typed(name: str, types: Mapping[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    if name not in types:
        raise ValueError(f"the type of value {name!r} is not known (declare it in the model's value_info), so the "
                         "model cannot be split between onnxruntime and onnx's reference implementation")
    info = onnx.ValueInfoProto(name=name)
    info.type.CopyFrom(types[name])
    if info.type.WhichOneof("value") == "tensor_type":
        info.type.tensor_type.ClearField("shape")  # the element type is what a stage needs; shapes come with the values
    return info


def _float16_rounded_per_op(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every FLOAT16 op computed in FLOAT and rounded to FLOAT16 by an explicit ``Cast``
    (:func:`sgdfuse.lift.float16_through_float`): onnxruntime's CPU provider otherwise computes a chain of
    FLOAT16 ops in FLOAT and rounds once at its end, which is not what the graph computes (ONNX rounds after
    each op; an intermediate that overflows to inf stays finite). ``model`` itself when the transform fails
    (its shape inference, say): then onnxruntime runs it as it is, as before."""
    from sgdfuse.lift import float16_through_float  # lift imports nothing of runtime

    try:
        widened, changed = float16_through_float(model)
    except Exception as error:  # advisory: the plain model still runs
        logger.info("FLOAT16 ops left to onnxruntime's own casts: %s", error)
        return model
    return widened if changed else model


_MAX_EMULATION_ROUNDS = 32
"""How many times :func:`_bfloat16_in_float` asks onnxruntime again (each answer names one op it lacks)."""


def _bfloat16_in_float(model: onnx.ModelProto | bytes, error: Exception, options: ort.SessionOptions) -> "ort.InferenceSession | None":
    """A session (with ``options``) of ``model`` with every op onnxruntime has no BFLOAT16 kernel for computed
    in FLOAT (:func:`sgdfuse.lift.bfloat16_through_float`: the same BFLOAT16 results), or None when ``error``
    is not about a missing kernel or ``model`` has no BFLOAT16 node to widen. onnxruntime names one missing
    kernel per attempt, so this asks again until it accepts; a kernel it names that is no node of the model
    (an op of a function body onnxruntime expands: ``Softmax``'s ``ReduceMax``) widens every BFLOAT16 op.

    Raises:
        onnxruntime's error for the last attempt, when it still refuses a model this could widen.
    """
    from sgdfuse.lift import bfloat16_through_float, missing_kernels  # lift imports nothing of runtime

    missing: set[str] | None = set(missing_kernels(error))
    if not missing:
        return None
    proto = onnx.ModelProto.FromString(model) if isinstance(model, bytes) else model
    if not _mentions_bfloat16(proto):
        return None  # a kernel missing for another type (DOUBLE in a lifted model): nothing to widen
    last: Exception = error
    for _ in range(_MAX_EMULATION_ROUNDS):
        widened, changed = bfloat16_through_float(proto, missing)
        if not changed:
            if missing is None:
                return None if last is error else _reraise(last)
            missing = None  # the op named is not a node here: widen every BFLOAT16 op
            continue
        try:
            return ort.InferenceSession(widened.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except ONNXRUNTIME_ERRORS as again:
            last = again
            more = set(missing_kernels(again))
            if missing is None or not more:
                raise
            if more <= missing:
                missing = None
            else:
                missing |= more
    raise last


def _reraise(error: Exception):
    raise error




def _mentions_bfloat16(model: onnx.ModelProto) -> bool:
    """:func:`_mentions` of BFLOAT16."""
    return _mentions(model, _ONNX_BF16)


def _mentions(model: onnx.ModelProto, dtype: int) -> bool:
    """Whether any graph of ``model`` (subgraphs and function bodies included) declares, stores or makes a
    value of ``dtype`` (BFLOAT16 below): a value info or initializer of that type, or a node attribute holding a BFLOAT16 tensor or
    naming the type (``Cast``'s ``to``, a ``dtype``). Every BFLOAT16 value starts at one of these (``CastLike``
    copies its target's type), so a model without one has nothing :func:`sgdfuse.lift.bfloat16_through_float`
    could widen; this walk is much cheaper than the transform's inference on a large model."""
    graphs: list[onnx.GraphProto] = [model.graph]
    bodies = [function.node for function in model.functions]
    while graphs or bodies:
        if graphs:
            graph = graphs.pop()
            infos = (*graph.input, *graph.output, *graph.value_info)
            if any(i.type.tensor_type.elem_type == dtype for i in infos) or any(t.data_type == dtype for t in graph.initializer):
                return True
            nodes = graph.node
        else:
            nodes = bodies.pop()
        for node in nodes:
            for attribute in node.attribute:
                kind = attribute.type
                if kind == onnx.AttributeProto.INT and attribute.name in ("to", "dtype") and attribute.i == dtype:
                    return True
                if kind == onnx.AttributeProto.TENSOR and attribute.t.data_type == dtype:
                    return True
                if kind == onnx.AttributeProto.GRAPH:
                    graphs.append(attribute.g)
                elif kind == onnx.AttributeProto.GRAPHS:
                    graphs.extend(attribute.graphs)
    return False


def run(
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """Run ``session`` on ``feeds`` and return ``{output name: array}``.

    Arrays of any dtype onnxruntime supports are accepted, plus ``ml_dtypes.bfloat16``; BFLOAT16 outputs
    come back as ``ml_dtypes.bfloat16`` arrays.
    """
    if isinstance(session, ReferenceSession):
        return session.run(list(output_names) if output_names is not None else session.output_names, feeds)
    names = list(output_names) if output_names is not None else [o.name for o in session.get_outputs()]
    if not any(np.asarray(value).dtype == _BF16 for value in feeds.values()) and not _bfloat16_outputs(session).intersection(names):
        # The plain path converts the arrays in C++: several times faster per tensor than binding each one.
        values = session.run(names, {name: np.asarray(value, order="C") for name, value in feeds.items()})
        return dict(zip(names, values))
    binding = session.io_binding()
    for name, value in feeds.items():
        array = np.asarray(value, order="C")
        if array.dtype == _BF16:
            ort_value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), _ONNX_BF16)
        else:
            ort_value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, ort_value)
    for name in names:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    return {name: _to_numpy(value) for name, value in zip(names, binding.get_outputs())}


_BF16_OUTPUTS: "weakref.WeakKeyDictionary[ort.InferenceSession, frozenset[str]]" = weakref.WeakKeyDictionary()


def _bfloat16_outputs(session: ort.InferenceSession) -> frozenset[str]:
    """The outputs of ``session`` declared BFLOAT16 (fetched through IO binding), once per session."""
    try:
        return _BF16_OUTPUTS[session]
    except (KeyError, TypeError):
        pass
    found = frozenset(o.name for o in session.get_outputs() if o.type == "tensor(bfloat16)")
    try:
        _BF16_OUTPUTS[session] = found
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return found


def _to_numpy(value: ort.OrtValue) -> np.ndarray:
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    # No numpy type for BFLOAT16 in onnxruntime: copy the two-byte elements out of the CPU buffer.
    shape = tuple(value.shape())
    count = math.prod(shape)
    if count == 0:
        return np.zeros(shape, dtype=_BF16)
    raw = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.frombuffer(raw, dtype=np.uint16, count=count).copy().view(_BF16).reshape(shape)
