"""A reference executor for sgdfuse's GE graphs, in numpy, with GE's ref (in-place) semantics.

It exists to check lowering numerically: the step graph run here must compute what onnxruntime computes on
the fused ONNX model. It is a reference, not an emulator of Ascend kernels: each op transcribes its GE
prototype's documented meaning; FLOAT16/BFLOAT16 arithmetic is done in FLOAT and rounded back once per op
(what onnxruntime's CPU kernels and the SGD contract do), matrix products accumulate in FLOAT.

GE semantics it keeps, because lowering depends on them:

- ``Variable`` values persist across runs and across graphs (the init graph and the step graph share them
  by name), and a ``Variable`` op outputs *the* stored array, not a copy.
- ``SGD`` (via :func:`sgdfuse.reference.sgd`) writes ``parameters``, ``accum`` and ``stat`` into its input
  arrays in place; its output is its ``parameters`` input array (a ref). ``Assign`` writes its ``ref`` input
  in place.
- The ops that may alias their input (:mod:`sgdfuse.lowering.alias`: ``Identity``, ``Reshape``,
  ``Squeeze``, ``Unsqueeze``, a ``Transpose`` that keeps the row-major order, a ``Cast`` to the same dtype,
  an ``Expand`` to the same shape) return views or the input itself; every other op returns a new array
  (``TensorMove`` copies), and a kernel returning a view the rule does not allow is an error; ``NetOutput`` copies its inputs out when the run ends, ``Data`` copies its feed in.
- Order: an op runs when its data and control predecessors have run; among ready ops the in-place writers
  (``SGD``, ``Assign``) go first and the readers of variable memory (a ``Variable``, the ref output of an
  ``SGD`` or ``Assign``, or an alias of one) last. So a read of an old value that
  lowering forgot to order before the write sees the new value and the comparison with onnxruntime fails,
  as it could on the device. And before any op runs, every access of a variable's memory must be ordered
  against each in-place write of it by a path of edges (:func:`_check_state_order`): a read that must follow
  the write (the copy of the buffer an ``SGD`` op wrote) but lost its edge ran after it here all the same.

Every output is checked against its descriptor (dtype, and every static dimension).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np
from onnx import TensorProto

from sgdfuse import reference
from sgdfuse.errors import SgdfuseError
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.alias import keeps_layout, may_alias
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = ["ASSUMED_ATTRIBUTES", "ExecutorError", "GEExecutor", "GEModelRunner", "GraphContradictionError", "IGNORED_ATTRIBUTES", "KERNELS", "RunPlan", "kernel",
           "numpy_dtype"]

WRITERS = frozenset({"SGD", "Assign"})


class ExecutorError(SgdfuseError):
    """The executor cannot run a graph: unknown op types, missing feeds, an uninitialised variable, or an
    op result that contradicts its descriptor (:class:`GraphContradictionError`)."""


class GraphContradictionError(ExecutorError):
    """The GE graph contradicts itself: an op's result has another dtype or shape than its output descriptor
    says, its operands do not fit its own attributes, an ``Assign`` changes a variable's shape, or an op returns
    a view its aliasing rules say it does not. On the device such a graph fails or computes something else, so
    it is a wrong graph (a bug of the lowering that made it), not a graph the executor cannot run."""


_GE_TO_ONNX = {ge: onnx for onnx, ge in ge_ir.ONNX_TO_GE_DTYPE.items()}
_CPP_TO_ONNX = {cpp: onnx for onnx, cpp in ge_ir.ONNX_TO_GE_CPP_DTYPE.items()}
_SMALL_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def numpy_dtype(ge_dtype: int) -> np.dtype:
    """numpy dtype of a proto ``DataType`` number."""
    if ge_dtype not in _GE_TO_ONNX:
        raise ExecutorError(f"no numpy dtype for GE {ge_ir.GE_DTYPE_NAMES.get(ge_dtype, ge_dtype)}")
    return onnx_to_numpy_dtype(_GE_TO_ONNX[ge_dtype])


@dataclasses.dataclass
class Op:
    """One ``OpDef`` decoded for running: data inputs (``(op, index)`` or None), control predecessors,
    attributes as Python values, output dtypes and shapes from the descriptors."""

    name: str
    type: str
    inputs: list[tuple[str, int] | None]
    controls: list[str]
    attrs: Mapping[str, object]
    output_dtypes: list[np.dtype | None]
    output_shapes: list[list[int]]
    position: int
    lifted: bool = False
    """Run lifted (:class:`GEExecutor` ``lifted``): every FLOAT, FLOAT16 and BFLOAT16 value is DOUBLE."""
    may_alias: bool | None = None
    """:func:`_may_alias` of the op in its graph, once it was asked (it depends on the graph alone)."""


def _attr(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "list":
        items = value.list
        for field in ("s", "i", "f", "b", "dt"):
            if len(getattr(items, field)):
                values = list(getattr(items, field))
                return [v.decode() for v in values] if field == "s" else values
        return []
    if kind == "s":
        return value.s.decode()
    if kind == "t":
        return _tensor(value.t)
    return getattr(value, kind) if kind else None


def _tensor(tensor) -> np.ndarray:
    dtype = numpy_dtype(tensor.desc.dtype)
    shape = tuple(tensor.desc.shape.dim)
    return np.frombuffer(tensor.data, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)  # astype copies


class _Attributes(Mapping):
    """An op's attributes as Python values, each decoded when first read (most are never read by a kernel:
    decoding them all was most of the cost of running a large graph)."""

    __slots__ = ("_proto", "_decoded")

    def __init__(self, proto) -> None:
        self._proto = proto
        self._decoded: dict[str, object] = {}

    def __getitem__(self, key: str) -> object:
        try:
            return self._decoded[key]
        except KeyError:
            pass
        if key not in self._proto:
            raise KeyError(key)
        value = self._decoded[key] = _attr(self._proto[key])
        return value

    def __iter__(self):
        return iter(self._proto)

    def __len__(self) -> int:
        return len(self._proto)


_LIFTED = frozenset({np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


def _lift_dtype(dtype: np.dtype | None, lifted: bool) -> np.dtype | None:
    """``dtype``, or float64 for a float dtype of a lifted run."""
    return np.dtype(np.float64) if lifted and dtype in _LIFTED else dtype


def _decode(op, position: int, lifted: bool = False) -> Op:
    inputs: list[tuple[str, int] | None] = []
    controls: list[str] = []
    for entry in op.input:
        if not entry:
            inputs.append(None)
            continue
        source, _, index = entry.rpartition(":")
        if index == "-1":
            controls.append(source)
        else:
            inputs.append((source, int(index)))
    return Op(
        name=op.name,
        type=op.type,
        inputs=inputs,
        controls=controls,
        attrs=_Attributes(op.attr),
        output_dtypes=[_lift_dtype(numpy_dtype(d.dtype), lifted) if d.dtype else None for d in op.output_desc],
        output_shapes=[list(d.shape.dim) for d in op.output_desc],
        position=position,
        lifted=lifted,
    )


Kernel = Callable[[Op, list], list]
KERNELS: dict[str, Kernel] = {}


def kernel(*op_types: str) -> Callable[[Kernel], Kernel]:
    """Decorator: register a numpy kernel ``(op, inputs) -> outputs`` for GE op types."""

    def decorate(function: Kernel) -> Kernel:
        for op_type in op_types:
            KERNELS[op_type] = function
        return function

    return decorate


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A graph decoded (op name → :class:`Op`) and its run order (:meth:`GEExecutor.plan`)."""

    ops: dict[str, Op]
    order: list[Op]


class _Uninitialised:
    def __init__(self, name: str) -> None:
        self.name = name


class GEExecutor:
    """Runs GE ``GraphDef`` s; :attr:`variables` (name → array) persist across :meth:`run` calls.

    With ``lifted`` every FLOAT, FLOAT16 and BFLOAT16 value is computed as DOUBLE (descriptors, ``Const``
    values, ``Cast`` targets and feeds; the ``SGD`` op computes the contract's formula in DOUBLE with its
    FLOAT attributes as stored), as :func:`sgdfuse.lift.lift_to_double` lifts an ONNX model: roundoff is
    gone, and what is left between two lifted runs is the difference of the coefficients they apply.

    :attr:`watched`: after :meth:`run`, per op named in its ``watch`` argument, copies of the inputs the op
    read (``None`` for an absent optional input).
    """

    def __init__(self, *, lifted: bool = False) -> None:
        self.variables: dict[str, np.ndarray] = {}
        self.lifted = lifted
        self.watched: dict[str, list] = {}

    def plan(self, graph) -> "RunPlan":
        """``graph`` decoded and scheduled once, for :meth:`run` to take again and again (the decoding is
        most of a run's cost); the plan is of the graph as it is now.

        Raises:
            ExecutorError: unknown op types (all listed), a read of an op that is not in the graph, a cycle.
        """
        ops = {op.name: _decode(op, k, self.lifted) for k, op in enumerate(graph.op)}
        unknown = sorted({op.type for op in ops.values()} - set(KERNELS) - {"Data", "Variable", "NetOutput", "Assign"})
        if unknown:
            raise ExecutorError(f"graph {graph.name}: no executor kernel for op type(s) {', '.join(unknown)}")
        for op in ops.values():
            _check_assumed_attributes(op)
        order = _schedule(ops)
        _check_state_order(ops, order)
        return RunPlan(ops, order)

    def run(self, graph, feeds: Mapping[str, np.ndarray], *, plan: "RunPlan | None" = None, watch=frozenset()) -> list[np.ndarray]:
        """Run ``graph`` once with ``feeds`` (``Data`` op name → array); return ``NetOutput``'s inputs, copied.
        ``plan``: :meth:`plan` of ``graph``, made here when not given. ``watch``: op names whose inputs are
        copied into :attr:`watched` as the op reads them.

        Raises:
            ExecutorError: unknown op types (all listed), a missing or mistyped feed, a variable read before
                it was assigned, an output contradicting its descriptor.
        """
        plan = plan or self.plan(graph)
        ops = plan.ops
        values: dict[tuple[str, int], object] = {}
        results: list[np.ndarray] = []
        self.watched = {}
        for op in plan.order:
            inputs = [values[source] if source is not None else None for source in op.inputs]
            if op.name in watch:
                self.watched[op.name] = [None if x is None else np.array(_checked(x, op.name), copy=True) for x in inputs]
            if op.type == "NetOutput":
                results = [np.array(_checked(x, op.name), copy=True) for x in inputs]
                continue
            if op.type == "Data":
                outputs = [self._feed(op, feeds)]
            elif op.type == "Variable":
                outputs = [self.variables.get(op.name, _Uninitialised(op.name))]
            elif op.type == "Assign":
                outputs = [self._assign(op, ops, inputs)]
            else:
                outputs = KERNELS[op.type](op, [_checked(x, op.name) if x is not None else None for x in inputs])
                if op.type not in WRITERS:
                    _check_alias(op, ops, inputs, outputs)
            for index, value in enumerate(outputs):
                if not isinstance(value, _Uninitialised):
                    _check_output(op, index, value)
                values[(op.name, index)] = value
        return results

    def _feed(self, op: Op, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        if op.name not in feeds:
            raise ExecutorError(f"no feed for Data op {op.name}")
        value = np.asarray(feeds[op.name])
        expected = op.output_dtypes[0]
        if expected is not None and value.dtype != expected:
            raise ExecutorError(f"feed {op.name}: dtype {value.dtype}, the graph declares {expected}")
        return np.array(value, copy=True)

    def _assign(self, op: Op, ops: Mapping[str, Op], inputs: list) -> np.ndarray:
        ref, value = inputs
        source = op.inputs[0]
        if source is None or ops[source[0]].type != "Variable":
            raise ExecutorError(f"Assign {op.name}: its ref input is not a Variable")
        name = source[0]
        value = np.asarray(value)
        if isinstance(ref, _Uninitialised) or ref.shape != value.shape:
            if op.attrs.get("validate_shape") and not isinstance(ref, _Uninitialised):
                raise GraphContradictionError(f"Assign {op.name}: shape {value.shape} differs from variable {name} {ref.shape}")
            self.variables[name] = np.array(value, copy=True)
        else:
            ref[...] = value
        return self.variables[name]


def _check_alias(op: Op, ops: Mapping[str, Op], inputs: list, outputs: list) -> None:
    """A kernel may return a view of an input only when the one aliasing rule allows it
    (:mod:`sgdfuse.lowering.alias`): lowering orders reads by that rule, so a kernel that aliases beyond it
    would hide ordering bugs, or invent them."""
    arrays = [x for x in inputs if isinstance(x, np.ndarray)]
    if not arrays:
        return
    if op.may_alias is None:
        op.may_alias = _may_alias(op, ops)
    if op.may_alias:
        return
    for value in outputs:
        if isinstance(value, np.ndarray) and any(np.may_share_memory(value, x) for x in arrays):
            raise GraphContradictionError(f"op {op.name} ({op.type}) returned a view of its input, which sgdfuse.lowering.alias says it copies")


def _checked(value, reader: str):
    if isinstance(value, _Uninitialised):
        raise ExecutorError(f"op {reader} reads variable {value.name} before it was assigned; run the init graph first")
    return value


def _check_output(op: Op, index: int, value: np.ndarray) -> None:
    if index >= len(op.output_dtypes):
        return
    expected = op.output_dtypes[index]
    if expected is not None and value.dtype != expected:
        raise GraphContradictionError(f"op {op.name} ({op.type}) output {index}: dtype {value.dtype}, descriptor says {expected}")
    dims = op.output_shapes[index]
    if dims == [-2]:
        return
    if len(dims) != value.ndim or any(d >= 0 and d != s for d, s in zip(dims, value.shape)):
        raise GraphContradictionError(f"op {op.name} ({op.type}) output {index}: shape {list(value.shape)}, descriptor says {dims}")


def _may_alias(op: Op, ops: Mapping[str, Op]) -> bool:
    """The one aliasing rule (:func:`sgdfuse.lowering.alias.may_alias`), read from the decoded graph: a
    ``Transpose``'s perm from its ``Const`` input, its input's shape from the producer's descriptor."""
    source, perm_source = (op.inputs + [None, None])[:2]
    if op.type not in ("Transpose", "Cast", "Expand", "BroadcastTo") or source is None:
        return may_alias(op.type)
    perm = None
    if op.type == "Transpose" and perm_source is not None and ops[perm_source[0]].type == "Const":
        perm = [int(p) for p in np.ravel(ops[perm_source[0]].attrs["value"])]
    producer = ops[source[0]]
    dims = producer.output_shapes[source[1]] if source[1] < len(producer.output_shapes) else [-2]
    shape = None if dims == [-2] else [d if d >= 0 else None for d in dims]
    output_dims = op.output_shapes[0] if op.output_shapes else [-2]
    output_shape = None if output_dims == [-2] else [d if d >= 0 else None for d in output_dims]
    in_dtype = producer.output_dtypes[source[1]] if source[1] < len(producer.output_dtypes) else None
    out_dtype = op.output_dtypes[0] if op.output_dtypes else None
    same_dtype = None if in_dtype is None or out_dtype is None else in_dtype == out_dtype
    return may_alias(op.type, perm=perm, shape=shape, output_shape=output_shape, same_dtype=same_dtype)


def _schedule(ops: Mapping[str, Op]) -> list[Op]:
    waiting = {name: 0 for name in ops}
    dependants: dict[str, list[str]] = {}
    for op in ops.values():
        for source in {s[0] for s in op.inputs if s is not None} | set(op.controls):
            if source not in ops:
                raise ExecutorError(f"op {op.name} reads {source}, which is not in the graph")
            waiting[op.name] += 1
            dependants.setdefault(source, []).append(op.name)

    # Adversarial among ready ops: in-place writers first, readers of variable memory (directly, through the
    # refs SGD and Assign output, or through ops that may alias it) last. A read that lowering did not order
    # before a write (a later write: the restore of a guarded update) then sees the write.
    state: set[tuple[str, int]] = {(name, 0) for name, op in ops.items() if op.type == "Variable" or op.type in WRITERS}
    for op in sorted(ops.values(), key=lambda o: o.position):
        if op.inputs and op.inputs[0] in state and _may_alias(op, ops):
            state.add((op.name, 0))
    reads_state = {op.name for op in ops.values() if any(s in state for s in op.inputs if s is not None)}

    def key(name: str) -> tuple[int, int, str]:
        rank = 0 if ops[name].type in WRITERS else 2 if name in reads_state else 1
        return (rank, ops[name].position, name)

    ready = [key(n) for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[Op] = []
    while ready:
        name = heapq.heappop(ready)[2]
        order.append(ops[name])
        for dependant in dependants.get(name, ()):
            waiting[dependant] -= 1
            if waiting[dependant] == 0:
                heapq.heappush(ready, key(dependant))
    if len(order) != len(ops):
        raise ExecutorError("the graph has a cycle")
    return order


_NO_MASKS = {mask: 0 for mask in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}

ASSUMED_ATTRIBUTES: dict[str, dict[str, object]] = {
    "AvgPoolV2": {"data_format": "NCHW", "divisor_override": 0, "global_pooling": False, "padding_mode": "CALCULATED"},
    "MaxPoolV3": {"data_format": "NCHW", "global_pooling": False, "padding_mode": "CALCULATED"},
    "BatchNorm": {"data_format": "NCHW"},
    "Conv2D": {"data_format": "NCHW", "offset_x": 0},
    "Conv2DTranspose": {"data_format": "NCHW", "offset_x": 0},
    "Conv3D": {"data_format": "NCDHW", "offset_x": 0},
    "MatMulV2": {"offset_x": 0},
    "BatchMatMulV2": {"offset_x": 0},
    "Cast": {"truncate": False},
    "GatherV2": {"batch_dims": 0},
    "Reshape": {"axis": 0, "num_axes": -1},
    "StridedSliceV2": _NO_MASKS,
}
"""Op type → the attributes its kernel does not read, with the one value it computes for (what lowering writes):
an op with another value is refused (:func:`_check_assumed_attributes`), so that no kernel computes something
else than the op means. A ``data_format`` of NHWC, a ``global_pooling``, a ``begin_mask`` or a Reshape ``axis``
each changed the op's meaning and passed lower's check, the kernel never looking at it."""

IGNORED_ATTRIBUTES: dict[tuple[str, str], str] = {
    ("Assign", "use_locking"): "a lock changes no value",
    ("Data", "index"): "the executor feeds Data ops by name; lower's check compares each index with the graph's input list",
    ("SGD", "reference"): "lower's check requires it true (sgdfuse.lowering.verify)",
}
"""(op type, attribute) that no kernel reads and whose value changes nothing here, with where it is checked."""


def _check_assumed_attributes(op: Op) -> None:
    """Refuse an op whose attribute of :data:`ASSUMED_ATTRIBUTES` has another value than the kernel computes for.

    Raises:
        GraphContradictionError: naming the op, the attribute, its value and the value computed for.
    """
    for key, assumed in ASSUMED_ATTRIBUTES.get(op.type, {}).items():
        if key in op.attrs and op.attrs[key] != assumed:
            raise GraphContradictionError(
                f"op {op.name} ({op.type}) has {key} {op.attrs[key]!r}; lowering writes {assumed!r}, the value the "
                "executor computes the op for")


_IN_PLACE_PORTS = {"SGD": (0, 3, 5), "Assign": (0,)}
"""The inputs each in-place writer writes into (SGD: ``parameters``, ``accum``, ``stat``; Assign: ``ref``)."""

_METADATA_READERS = frozenset({"Shape", "Size", "Rank"})
"""Ops that read a tensor's description only, not its elements: no access to order against a write."""


def _check_state_order(ops: Mapping[str, Op], order: Sequence[Op]) -> None:
    """Every access to a variable's memory must be ordered against every in-place write of it, by a path of
    data or control edges: otherwise the device may run the two in either order, and the read sees the old
    value or the new one as it happens (GE orders ops by their edges only).

    The executor's schedule is adversarial one way (writers first, readers of variables last), which exposes a
    read that must come before a write but was left unordered; a read that must come *after* the write (the
    ``TensorMove`` copy of the buffer an ``SGD`` op wrote, another update's gradient computed from its new
    weights) was then always run after it, and a graph that lost that control edge passed. So the orders are
    checked here, whatever the schedule: an access is any op reading the memory through a ``Variable``, the ref
    output of a writer, or ops that may alias it (an aliasing op itself counts, as it may copy), but ``Shape``
    and the like; a write is an ``SGD`` op's ``parameters``, ``accum`` and ``stat`` and an ``Assign``'s ref.

    Raises:
        GraphContradictionError: a write and another access of one variable with no path between them.
    """
    memory: dict[tuple[str, int], str] = {}
    accesses: dict[str, list[str]] = {}
    writes: dict[str, list[str]] = {}
    for op in order:
        held = [(port, memory.get(source)) for port, source in enumerate(op.inputs) if source is not None]
        for port, variable in held:
            if variable is None or op.type in _METADATA_READERS:
                continue
            accesses.setdefault(variable, []).append(op.name)
            if port in _IN_PLACE_PORTS.get(op.type, ()):
                writes.setdefault(variable, []).append(op.name)
        if op.type == "Variable":
            memory[(op.name, 0)] = op.name
        elif op.inputs and op.inputs[0] is not None and op.inputs[0] in memory and (op.type in WRITERS or _may_alias(op, ops)):
            memory[(op.name, 0)] = memory[op.inputs[0]]
    if not writes:
        return
    position = {op.name: k for k, op in enumerate(order)}
    predecessors = {op.name: [s[0] for s in op.inputs if s is not None] + list(op.controls) for op in order}
    successors: dict[str, list[str]] = {}
    for name, sources in predecessors.items():
        for source in sources:
            successors.setdefault(source, []).append(name)

    def reached(start: str, edges: Mapping[str, list[str]], inside) -> set[str]:
        # The ops reached from ``start`` along ``edges`` through ops whose position ``inside`` accepts: an op
        # on a path between two ops lies between them in any topological order.
        seen, stack = {start}, [start]
        while stack:
            for other in edges.get(stack.pop(), ()):
                if other not in seen and inside(position[other]):
                    seen.add(other)
                    stack.append(other)
        return seen

    for variable, writers in writes.items():
        others = list(dict.fromkeys(accesses[variable]))
        for writer in dict.fromkeys(writers):
            here = position[writer]
            before = [name for name in others if position[name] < here]
            after = [name for name in others if position[name] > here]
            unordered = []
            if before:
                low = min(position[name] for name in before)
                ancestors = reached(writer, predecessors, lambda k: k >= low)
                unordered += [name for name in before if name not in ancestors]
            if after:
                high = max(position[name] for name in after)
                descendants = reached(writer, successors, lambda k: k <= high)
                unordered += [name for name in after if name not in descendants]
            if unordered:
                raise GraphContradictionError(
                    f"op {unordered[0]} ({ops[unordered[0]].type}) accesses variable {variable}, which op {writer} "
                    f"({ops[writer].type}) writes in place, and no data or control edge orders the two: the device may "
                    "run them in either order (a control edge missing)")


# ---- kernels ------------------------------------------------------------------------------------------


def _in_float(function: Callable[..., np.ndarray], out_dtype: np.dtype | None, *arrays: np.ndarray) -> np.ndarray:
    """Apply ``function``; FLOAT16/BFLOAT16 operands are computed in FLOAT and the result rounded once."""
    small = any(np.asarray(a).dtype in _SMALL_FLOATS for a in arrays)
    with np.errstate(all="ignore"):
        if small:
            result = function(*(np.asarray(a).astype(np.float32) if np.asarray(a).dtype in _SMALL_FLOATS else a for a in arrays))
        else:
            result = function(*arrays)
    result = np.asarray(result)
    if out_dtype is not None and result.dtype != out_dtype:
        result = result.astype(out_dtype)
    return result


def _elementwise(function: Callable[..., np.ndarray]) -> Kernel:
    def run(op: Op, inputs: list) -> list:
        return [_in_float(function, op.output_dtypes[0], *inputs)]

    return run


def _truncate_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    quotient = np.floor_divide(a, b)
    inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return quotient + inexact


def _exp(op: Op, inputs: list) -> list:
    base, scale, shift = (float(op.attrs.get(k, d)) for k, d in (("base", -1.0), ("scale", 1.0), ("shift", 0.0)))
    log_base = 1.0 if base == -1.0 else math.log(base)
    return [_in_float(lambda x: np.exp((x * scale + shift) * log_base), op.output_dtypes[0], inputs[0])]


def _log(op: Op, inputs: list) -> list:
    base, scale, shift = (float(op.attrs.get(k, d)) for k, d in (("base", -1.0), ("scale", 1.0), ("shift", 0.0)))
    log_base = 1.0 if base == -1.0 else math.log(base)
    return [_in_float(lambda x: np.log(x * scale + shift) / log_base, op.output_dtypes[0], inputs[0])]


for _types, _function in (
    (("Add",), np.add),
    (("Sub",), np.subtract),
    (("Mul",), np.multiply),
    (("RealDiv",), np.divide),
    (("TruncateDiv",), _truncate_div),
    (("Pow",), np.power),
    (("Maximum",), np.maximum),
    (("Minimum",), np.minimum),
    (("Neg",), np.negative),
    (("Abs",), np.abs),
    (("Sqrt",), np.sqrt),
    (("Reciprocal",), np.reciprocal),
    (("Relu",), lambda x: np.maximum(x, np.zeros((), dtype=np.asarray(x).dtype))),
    (("Sigmoid",), lambda x: 1 / (1 + np.exp(-x))),
    (("Tanh",), np.tanh),
    (("Equal",), np.equal),
    (("Less",), np.less),
    (("LessEqual",), np.less_equal),
    (("Greater",), np.greater),
    (("GreaterEqual",), np.greater_equal),
    (("LogicalNot",), np.logical_not),
    (("IsNan",), np.isnan),
    (("IsInf",), np.isinf),
    (("LogicalAnd",), np.logical_and),
    (("LogicalOr",), np.logical_or),
    (("SelectV2",), np.where),
):
    kernel(*_types)(_elementwise(_function))
kernel("Exp")(_exp)
kernel("Log")(_log)


@kernel("Const")
def _const(op: Op, inputs: list) -> list:
    value = np.array(op.attrs["value"], copy=True)
    return [value.astype(np.float64) if op.lifted and value.dtype in _LIFTED else value]


@kernel("Identity")
def _identity(op: Op, inputs: list) -> list:
    return [inputs[0]]  # may alias: GE may hand out the same memory


@kernel("TensorMove")
def _tensor_move(op: Op, inputs: list) -> list:
    return [np.array(inputs[0], copy=True)]


@kernel("Reshape")
def _reshape(op: Op, inputs: list) -> list:
    x, shape = inputs
    return [np.reshape(x, tuple(int(d) for d in np.ravel(shape)))]


@kernel("Squeeze")
def _squeeze(op: Op, inputs: list) -> list:
    axes = op.attrs.get("axis") or None
    return [np.squeeze(inputs[0], axis=tuple(axes) if axes else None)]


@kernel("Unsqueeze")
def _unsqueeze(op: Op, inputs: list) -> list:
    value = inputs[0]
    for axis in sorted(op.attrs.get("axes", [])):
        value = np.expand_dims(value, axis)
    return [value]


@kernel("Transpose")
def _transpose(op: Op, inputs: list) -> list:
    x = inputs[0]
    perm = tuple(int(p) for p in np.ravel(inputs[1]))
    if keeps_layout(perm, x.shape):
        # Same elements in the same order: a view, as GE may compile it to a reshape (sgdfuse.lowering.alias).
        return [np.reshape(x, tuple(x.shape[p] for p in perm))]
    return [np.array(np.transpose(x, perm), copy=True)]


def _matmul(a: np.ndarray, b: np.ndarray, out_dtype: np.dtype | None) -> np.ndarray:
    if a.dtype in _SMALL_FLOATS or b.dtype in _SMALL_FLOATS:
        a, b = a.astype(np.float32), b.astype(np.float32)
    result = np.matmul(a, b)
    return result.astype(out_dtype) if out_dtype is not None and result.dtype != out_dtype else result


@kernel("MatMulV2", "MatMul")
def _mat_mul(op: Op, inputs: list) -> list:
    a, b = inputs[0], inputs[1]
    if op.attrs.get("transpose_x1"):
        a = a.T
    if op.attrs.get("transpose_x2"):
        b = b.T
    return [_matmul(a, b, op.output_dtypes[0])]


@kernel("BatchMatMulV2")
def _batch_mat_mul(op: Op, inputs: list) -> list:
    a, b = inputs[0], inputs[1]
    if op.attrs.get("adj_x1"):
        a = np.swapaxes(a, -1, -2)
    if op.attrs.get("adj_x2"):
        b = np.swapaxes(b, -1, -2)
    return [_matmul(a, b, op.output_dtypes[0])]


def _reduce(function: Callable[..., np.ndarray]) -> Kernel:
    def run(op: Op, inputs: list) -> list:
        x, axes = inputs
        axes = tuple(int(a) for a in np.ravel(axes))
        if not axes and op.attrs.get("noop_with_empty_axes", True):
            return [np.array(x, copy=True)]
        keep = bool(op.attrs.get("keep_dims", False))
        return [_in_float(lambda v: function(v, axis=axes or None, keepdims=keep), op.output_dtypes[0], x)]

    return run


kernel("ReduceSum")(_reduce(np.sum))
kernel("ReduceMean")(_reduce(np.mean))


@kernel("Cast")
def _cast(op: Op, inputs: list) -> list:
    target = _lift_dtype(np.dtype(onnx_to_numpy_dtype(_CPP_TO_ONNX[int(op.attrs["dst_type"])])), op.lifted)
    if np.asarray(inputs[0]).dtype == target:
        return [inputs[0]]  # a no-op GE may remove: the input itself (sgdfuse.lowering.alias)
    with np.errstate(all="ignore"):
        return [np.asarray(inputs[0]).astype(target)]


@kernel("Shape")
def _shape(op: Op, inputs: list) -> list:
    dtype = onnx_to_numpy_dtype(_CPP_TO_ONNX[int(op.attrs.get("dtype", ge_ir.ONNX_TO_GE_CPP_DTYPE[TensorProto.INT32]))])
    return [np.array(np.shape(inputs[0]), dtype=dtype)]


@kernel("Fill")
def _fill(op: Op, inputs: list) -> list:
    dims, value = inputs
    return [np.full(tuple(int(d) for d in np.ravel(dims)), np.asarray(value).reshape(()), dtype=np.asarray(value).dtype)]


@kernel("Expand")
def _expand(op: Op, inputs: list) -> list:
    x, shape = inputs
    target = np.broadcast_shapes(np.shape(x), tuple(int(d) for d in np.ravel(shape)))
    if target == np.shape(x):
        return [x]  # a no-op GE may remove: the input itself (sgdfuse.lowering.alias)
    return [np.array(np.broadcast_to(x, target), copy=True)]


@kernel("ConcatV2")
def _concat(op: Op, inputs: list) -> list:
    count = int(op.attrs.get("N", len(inputs) - 1))
    return [np.concatenate(inputs[:count], axis=int(np.asarray(inputs[count])))]


@kernel("GatherV2")
def _gather(op: Op, inputs: list) -> list:
    x, indices, axis = inputs
    indices = np.asarray(indices)
    if not op.attrs.get("negative_index_support", False) and indices.size and int(indices.min()) < 0:
        # GE counts a negative index from the end only when told to; numpy's take always does.
        raise GraphContradictionError(f"op {op.name} (GatherV2) reads index {int(indices.min())} with "
                                      "negative_index_support false: out of range on the device")
    return [np.take(x, indices, axis=int(np.asarray(axis)))]


def _softmax(log: bool) -> Kernel:
    def run(op: Op, inputs: list) -> list:
        axes = tuple(op.attrs.get("axes", [-1]))

        def compute(x: np.ndarray) -> np.ndarray:
            shifted = x - np.max(x, axis=axes, keepdims=True)
            total = np.sum(np.exp(shifted), axis=axes, keepdims=True)
            return shifted - np.log(total) if log else np.exp(shifted) / total

        return [_in_float(compute, op.output_dtypes[0], inputs[0])]

    return run


kernel("SoftmaxV2")(_softmax(False))
kernel("LogSoftmaxV2")(_softmax(True))


@kernel("SGD")
def _sgd(op: Op, inputs: list) -> list:
    parameters, gradient, learning_rate, accum, momentum, stat = inputs
    sgd = _sgd_double if op.lifted else reference.sgd
    new_parameters, new_accum, new_stat = sgd(
        parameters,
        gradient,
        learning_rate,
        accum,
        momentum,
        stat,
        dampening=float(op.attrs.get("dampening", 0.0)),
        weight_decay=float(op.attrs.get("weight_decay", 0.0)),
        nesterov=bool(op.attrs.get("nesterov", False)),
    )
    # In place, as the kernel does: the arrays are the variables' own storage.
    parameters[...] = new_parameters
    accum[...] = new_accum
    stat[...] = new_stat
    return [parameters]


def _sgd_double(parameters, gradient, learning_rate, accum, momentum, stat, *, dampening: float, weight_decay: float,
                nesterov: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contract's formula (:func:`sgdfuse.reference.sgd`, line for line) in DOUBLE, for a lifted run:
    every operand and the FLOAT attributes as stored (``dampening``, ``weight_decay`` rounded to FLOAT first)."""
    f64 = np.float64
    p, g, a, s = (np.asarray(x, dtype=f64) for x in (parameters, gradient, accum, stat))
    lr = np.asarray(learning_rate, dtype=f64).reshape(())
    m = np.asarray(momentum, dtype=f64).reshape(())
    d, wd = f64(np.float32(dampening)), f64(np.float32(weight_decay))
    with np.errstate(all="ignore"):
        grad = g + p * wd if wd != 0 else g
        accum_t = a * m + grad
        if d != 0:
            accum_t = accum_t - grad * (f64(1) - s) * d
        parameters_out = p - (grad + accum_t * m) * lr if nesterov else p - accum_t * lr
        if m != 0:
            return parameters_out, accum_t, np.zeros_like(s)
        return parameters_out, a.copy(), s.copy()


class GEModelRunner:
    """Runs a :class:`~sgdfuse.lowering.ge_model.GEModel`: the init graph once, then training steps.

    Names are the ONNX model's: :meth:`initialise` takes initial values of the state inputs (``w``,
    ``buf_w``...), :meth:`step` the runtime inputs and returns the ONNX outputs by name.
    """

    def __init__(self, model, *, lifted: bool = False) -> None:
        self.model = model
        self.executor = GEExecutor(lifted=lifted)
        self._step_plan: RunPlan | None = None  # the step graph decoded at the first step, reused after

    @property
    def variables(self) -> dict[str, np.ndarray]:
        return self.executor.variables

    def initialise(self, values: Mapping[str, np.ndarray]) -> None:
        """Run the init graph: state variables get ``values`` (ONNX graph input name → array), or their
        initializer, or zeros.

        Raises:
            ExecutorError: a state input's value is missing.
        """
        feeds = {}
        for data_op, onnx_name in self.model.init_inputs.items():
            if onnx_name not in values:
                raise ExecutorError(f"no initial value for state input {onnx_name}")
            feeds[data_op] = values[onnx_name]
        self.executor.run(self.model.init_model.graph[0], feeds)

    def step(self, feeds: Mapping[str, np.ndarray], *, watch=frozenset()) -> dict[str, np.ndarray]:
        """One run of the step graph; ``feeds`` by ONNX input name (extra names, e.g. state, are ignored);
        ``watch``: as for :meth:`GEExecutor.run`."""
        names = {op: self.model.onnx_input(op) for op in self.model.inputs}
        missing: Sequence[str] = [name for name in names.values() if name not in feeds]
        if missing:
            raise ExecutorError(f"no value for input(s) {', '.join(missing)}")
        if self._step_plan is None:
            self._step_plan = self.executor.plan(self.model.graph)
        results = self.executor.run(self.model.graph, {op: feeds[name] for op, name in names.items()}, plan=self._step_plan, watch=watch)
        return dict(zip(self.model.outputs, results))


# The layer, indexing and activation kernels register themselves in KERNELS on import.
from sgdfuse.lowering import kernels_nn  # noqa: E402,F401
