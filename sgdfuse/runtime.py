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
import logging
import math
import os
import weakref
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

__all__ = ["ORT_KERNEL_ENV", "kernel_requested", "make_session", "run", "onnx_to_numpy_dtype", "numpy_to_onnx_dtype", "ONNXRUNTIME_ERRORS", "ReferenceSession", "REFERENCE_DOMAINS"]

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
        from onnx.reference import ReferenceEvaluator

        self.evaluator = ReferenceEvaluator(model)
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
