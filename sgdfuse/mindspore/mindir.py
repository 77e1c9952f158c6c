"""MindIR files: read, rewrite ``mint.optim.SGD`` updates into ``SGD`` nodes, write.

A MindIR file is MindSpore's ``mind_ir.ModelProto`` (schema shipped in the wheel as
``mindspore.train.mind_ir_pb2``). An exported ``mint.optim.SGD`` train step holds, per parameter, the graph
that the compile pipeline sees after ``auto_monad_reorder`` (see ``sgdfuse_pass.cc``): a ``Switch`` on
``EqScalar(Load(step_t), 0)`` between two branch functions (``InplaceCopy`` / ``InplaceMuls`` +
``InplaceAddExt`` on the momentum buffer), called with no arguments, then ``InplaceAddExt(w, call, -lr)``,
ordered by ``UpdateState``. Node references are by name: ``REF::<primitive name>`` for an op,
``REF::<node name>`` for a call of a node's value, ``Constant`` nodes for scalars.

The rewrite is the plugin's, on protobuf: each branch function is evaluated symbolically to linear forms over
(old buffer, gradient), solved for momentum, dampening and Nesterov, and the update becomes

    stat = BroadcastTo(Cast(step_t == 0, dtype), shape)
    A    = Assign(buf, MaskedFill(Load(buf, U), Cast(step_t == 0, bool), 0), U)    the buffer zeroed on the first step
    SGD(w, g, lr, buf, m, stat, UpdateState(U, A))  {dampening, weight_decay, nesterov}

under the parameter update's name, so every later ``UpdateState`` and the graph output keep their references.
The Switch, Partials, branch functions and a folded weight-decay ``AddExt`` are dropped. The input model is
never mutated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from typing import Any

from sgdfuse.external_data import ExternalData, check_location, check_tensor, normalise_location, read_bytes, stage_data_files
from sgdfuse.mindspore.errors import MindIRLoadError, MindSporeMissingError
from sgdfuse.mindspore.plugin import report_from_records
from sgdfuse.report import Refusal, Report, Verification

__all__ = [
    "load_mindir",
    "save_mindir",
    "optimize_mindir",
    "optimize_mindir_file",
    "MindIRResult",
    "TOLERANCE",
    "external_tensors",
    "check_external_data",
]

logger = logging.getLogger(__name__)

# MindSpore TypeId values of the dtypes the SGD op takes (mindapi/base/type_id.h: Float16 = 42, Float32 = 43,
# Float64 = 44, BFloat16 = 45), keyed by mind_ir TensorProto.DataType.
_TYPE_ID = {1: 43, 10: 42, 16: 45}
_DTYPE_NAME = {1: "FLOAT", 10: "FLOAT16", 16: "BFLOAT16", 11: "DOUBLE", 17: "DOUBLE"}
_STRUCT = {1: "<f", 11: "<d", 17: "<d", 6: "<i", 7: "<q", 3: "<b", 5: "<h", 9: "<?"}
# The CPU SGD kernel takes FLOAT and FLOAT16; BFLOAT16 is Ascend-only (docs/contract.md).
_SUPPORTED = {1, 10, 16}
_INPLACE_BUFFER_OPS = {"InplaceCopy", "InplaceMuls", "InplaceAddExt", "InplaceSubExt"}
TOLERANCE = "rtol=1e-5, atol=1e-6 per element of every output and Parameter, after each of the chained steps"


def _mind_ir():
    try:
        from mindspore.train import mind_ir_pb2
    except ImportError as error:
        raise MindSporeMissingError(
            f"reading MindIR needs MindSpore's mind_ir protobuf module (pip install 'sgdfuse[mindspore]'): {error}"
        ) from error
    return mind_ir_pb2


def load_mindir(source: str | os.PathLike | bytes) -> tuple[Any, str]:
    """Parse a MindIR file (a path or its bytes) into a ``mind_ir_pb2.ModelProto``; returns (model, source name).

    Raises:
        MindIRLoadError: missing, unreadable, or not a MindIR model with a graph.
        ExternalDataError: a parameter's data file location is refused (see :mod:`sgdfuse.external_data`).
    """
    pb = _mind_ir()
    if isinstance(source, (bytes, bytearray)):
        data, name = bytes(source), "<bytes>"
    else:
        name = os.fspath(source)
        if not os.path.exists(name):
            raise MindIRLoadError(name, "no such file")
        if os.path.isdir(name):
            raise MindIRLoadError(name, "is a directory, not a MindIR file")
        try:
            with open(name, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise MindIRLoadError(name, f"cannot read: {error.strerror or error}") from error
    model = pb.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as error:  # protobuf's DecodeError
        raise MindIRLoadError(name, f"not a MindIR file, or truncated (protobuf parse failed: {error})") from error
    if not model.HasField("graph") or not model.graph.node:
        raise MindIRLoadError(name, "not a MindIR model (no graph); is this the right file?")
    # Parameters of a large model live in data files (``<name>_variables/data_N``) that the model names:
    # untrusted locations, checked before anything reads them (sgdfuse.external_data).
    check_external_data(model, None if isinstance(source, (bytes, bytearray)) else name)
    return model, name


def external_tensors(model: Any) -> list[Any]:
    """The ``mind_ir_pb2.TensorProto`` of ``model`` whose data is in a file (``external_data`` set):
    parameters of the graph and of every function, and tensors in node attributes."""
    found = []
    for graph in [model.graph, *model.functions]:
        found.extend(t for t in graph.parameter if t.HasField("external_data"))
        for node in graph.node:
            for attribute in node.attribute:
                tensors = [attribute.t] if attribute.HasField("t") else []
                found.extend(t for t in [*tensors, *attribute.tensors] if t.HasField("external_data"))
    return found


def check_external_data(model: Any, path: str | None) -> list[ExternalData]:
    """Check every external data reference of ``model`` read from the file ``path`` (relative to its
    directory) by the rules of :mod:`sgdfuse.external_data`; with no path (bytes), only the locations
    themselves (relative, no ``..``).

    Raises:
        ExternalDataError: a location, file, offset or length breaks a rule.
    """
    tensors = external_tensors(model)
    if path is None:
        for tensor in tensors:
            check_location(tensor.external_data.location, tensor=tensor.name, source="<bytes>")
        return []
    base = os.path.dirname(os.path.abspath(path))
    return [check_tensor(tensor, base, source=path) for tensor in tensors]


def _with_data_inline(model: Any, path: str) -> Any:
    """A copy of ``model`` (read from ``path``) with every external tensor's bytes read, through the checked
    path, into ``raw_data``: what the MindIR check runs, from a temporary directory where the data files
    are not."""
    checked = check_external_data(model, path)
    if not checked:
        return model
    copy = type(model)()
    copy.CopyFrom(model)
    for tensor, data in zip(external_tensors(copy), checked):
        tensor.raw_data = read_bytes(data, source=path)
        tensor.ClearField("external_data")
    return copy


def save_mindir(model: Any, path: str | os.PathLike, *, batch: Any = None, source: str | None = None) -> None:
    """Write ``model`` whole or not at all (:mod:`sgdfuse.output`); with ``batch``, staged there.

    A model read from the file ``source`` whose parameters live in data files gets those files copied into
    the output's directory, in the same batch (:func:`sgdfuse.external_data.stage_data_files`: never outside
    it, never through a symbolic link, never over another file), and its locations normalised.

    Raises:
        ExternalDataError: a data file location breaks a rule of :mod:`sgdfuse.external_data`.
        OutputWriteError: an output cannot be written.
    """
    from sgdfuse.output import OutputBatch, resolve_destination

    if batch is None:
        with OutputBatch() as own:
            save_mindir(model, path, batch=own, source=source)
            own.commit()
        return
    target = resolve_destination(path)
    checked = check_external_data(model, source)
    if source is not None:
        stage_data_files(checked, os.path.dirname(os.path.abspath(source)), target, batch, source=source)
    batch.stage(path, _normalised(model).SerializeToString())


def _normalised(model: Any) -> Any:
    """``model``, or a copy with every external location in normalised form (already checked)."""
    if all(normalise_location(t.external_data.location) == t.external_data.location for t in external_tensors(model)):
        return model
    copy = type(model)()
    copy.CopyFrom(model)
    for tensor in external_tensors(copy):
        tensor.external_data.location = normalise_location(tensor.external_data.location)
    return copy


# ---------------------------------------------------------------------------------------------------------
# An index over one graph (the main graph or a function).


class _Index:
    def __init__(self, graph: Any, model: Any) -> None:
        self.graph = graph
        self.producer = {node.output[0] if node.output else node.name: node for node in graph.node}
        self.params = {p.name: p for p in graph.parameter}
        self.inputs = {i.name: i for i in graph.input}
        # Refs: the main graph's Parameters, or a function's inputs that carry one (MindSpore shares one
        # update function between same-shaped parameters and calls it with (step, w, buf, grad, u)).
        self.refs = set(self.params) | {
            i.name for i in graph.input if i.tensor and any(t.ref_key for t in i.tensor)
        }
        self.prims = {p.name: p for p in model.primitives}
        self.functions = {f.name: f for f in model.functions}
        # Constant nodes are looked up by name across graphs: a branch function may use a Constant that
        # another function or the main graph defines.
        self.constants = _constants(model)
        self.users: dict[str, list[tuple[Any, int]]] = {}
        for node in graph.node:
            for position, name in enumerate(node.input):
                self.users.setdefault(name, []).append((node, position))

    def op(self, node: Any) -> str:
        """The primitive's op type, ``"Constant"``, or ``"call"`` for a call of another node's value."""
        if node.op_type == "Constant":
            return "Constant"
        if node.op_type.startswith("REF::"):
            ref = node.op_type[5:]
            if ref in self.prims:
                return self.prims[ref].op_type
            if ref in self.producer:
                return "call"
        return node.op_type

    def value_of(self, name: str) -> str:
        """Look through value-preserving wrappers (TensorMove copies, Depend) to the value's source."""
        node = self.producer.get(name)
        while node is not None and self.op(node) in ("TensorMove", "Depend") and node.input:
            name = node.input[0]
            node = self.producer.get(name)
        return name

    def op_of(self, name: str) -> str:
        node = self.producer.get(name)
        return self.op(node) if node is not None else ""

    def prim(self, node: Any):
        return self.prims.get(node.op_type[5:]) if node.op_type.startswith("REF::") else None

    def scalar(self, name: str) -> float | None:
        node = self.producer.get(name)
        if node is None:
            node = self.constants.get(name)
        if node is None or node.op_type != "Constant" or not node.attribute:
            return None
        value = node.attribute[0]
        kind = value.type
        if kind == 1:  # FLOAT
            return float(value.f)
        if kind == 11:  # DOUBLE
            return float(value.d)
        if kind in (3, 5, 6, 7, 9):  # ints and BOOL
            return float(value.i)
        if kind == 19 and len(value.tensors) == 1:  # TENSORS: a one-element constant tensor
            tensor = value.tensors[0]
            fmt = _STRUCT.get(tensor.data_type)
            if fmt is None or len(tensor.raw_data) != struct.calcsize(fmt):
                return None
            return float(struct.unpack(fmt, tensor.raw_data)[0])
        return None

    def is_monad(self, name: str) -> bool:
        if name in self.inputs:
            i = self.inputs[name]
            return i.denotation == "UMonadType" or (i.HasField("attr_info") and i.attr_info.type == 23)
        node = self.producer.get(name)
        if node is None:
            return False
        return any(a.name in ("value", "shape") and a.type == 23 for a in node.attribute)

    def side_effect(self, node: Any) -> bool:
        prim = self.prim(node)
        return prim is not None and any(a.name == "side_effect_mem" for a in prim.attribute)


def _constants(model: Any) -> dict[str, Any]:
    return {
        (n.output[0] if n.output else n.name): n
        for g in [model.graph, *model.functions]
        for n in g.node
        if n.op_type == "Constant"
    }


def _short(name: str) -> str:
    # "<graph name>:opt.l1.weight" -> "opt.l1.weight"
    return name.split(":", 1)[1] if ":" in name else name


def _tensor_of(index: _Index, name: str):
    """(data_type, dims) of a parameter or of a node's output tensor, or None."""
    if name in index.params:
        p = index.params[name]
        return p.data_type, list(p.dims)
    if name in index.inputs and index.inputs[name].tensor:
        t = index.inputs[name].tensor[0]
        return t.data_type, list(t.dims)
    node = index.producer.get(name)
    if node is None:
        return None
    for attribute in node.attribute:
        if attribute.name == "shape" and attribute.type == 19 and len(attribute.tensors) == 1:
            t = attribute.tensors[0]
            return t.data_type, list(t.dims)
    return None


# ---------------------------------------------------------------------------------------------------------
# Symbolic evaluation of a branch function: linear forms (buffer coefficient, gradient coefficient).

Lin = tuple  # (b, g)


def _add(x: Lin, y: Lin, alpha: float) -> Lin:
    return (x[0] + alpha * y[0], x[1] + alpha * y[1])


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= 1e-12 * max(1.0, abs(x), abs(y))


def _same(x: Lin, y: Lin) -> bool:
    return _close(x[0], y[0]) and _close(x[1], y[1])


@dataclasses.dataclass
class _Effect:
    buf: Lin
    ret: Lin
    nodes: int


def _evaluate(function: Any, model: Any, buf: str, grad: str, monad: str) -> _Effect | str:
    """Evaluate one branch in the order of its monad chain; a string says why it is not an SGD branch."""
    index = _Index(function, model)
    state: dict[str, Lin] = {monad: (1.0, 0.0)}
    effects: dict[str, Lin] = {}
    values: dict[str, Lin] = {grad: (0.0, 1.0)}
    writes = chained = 0
    cnodes = 0
    for node in function.node:
        op = index.op(node)
        if op == "Constant":
            continue
        cnodes += 1
        ins = list(node.input)
        name = node.output[0] if node.output else node.name
        if op in _INPLACE_BUFFER_OPS:
            if not ins or ins[0] != buf:
                return f"{op} writes something other than the momentum buffer"
            before = state.get(ins[-1])
            if before is None:
                return f"{op} is not ordered on the branch's monad chain"

            def operand(x: str) -> Lin | None:
                return before if x == buf else values.get(x)

            if op == "InplaceCopy":
                source = operand(ins[1]) if len(ins) == 4 else None
                if source is None:
                    return "InplaceCopy of an unsupported source"
                after = source
            elif op == "InplaceMuls":
                s = index.scalar(ins[1]) if len(ins) == 3 else None
                if s is None:
                    return "InplaceMuls by a non-constant"
                after = (before[0] * s, before[1] * s)
            else:
                x = operand(ins[1]) if len(ins) == 4 else None
                alpha = index.scalar(ins[2]) if len(ins) == 4 else None
                if x is None or alpha is None:
                    return f"{op} with an unsupported operand or a non-constant alpha"
                after = _add(before, x, alpha if op == "InplaceAddExt" else -alpha)
            effects[name] = after
            writes += 1
        elif op == "UpdateState":
            s = state.get(ins[0])
            if s is None:
                return "UpdateState off the branch's monad chain"
            attached = [effects[i] for i in ins[1:] if i in effects]
            if len(attached) > 1:
                return "two buffer writes attached to one UpdateState"
            if attached:
                s = attached[0]
                chained += 1
            state[name] = s
        elif op == "Load":
            if ins[0] != buf or ins[1] not in state:
                return "Load of something other than the buffer, or off the monad chain"
            values[name] = state[ins[1]]
        elif op == "Depend":
            if ins[0] in values:
                values[name] = values[ins[0]]
        elif op in ("AddExt", "SubExt"):
            x, y = values.get(ins[0]), values.get(ins[1])
            alpha = index.scalar(ins[2]) if len(ins) == 3 else None
            if x is None or y is None or alpha is None:
                return f"{op} over unsupported operands"
            values[name] = _add(x, y, alpha if op == "AddExt" else -alpha)
        elif op == "Muls":
            x, s = values.get(ins[0]), index.scalar(ins[1])
            if x is None or s is None:
                return "Muls over unsupported operands"
            values[name] = (x[0] * s, x[1] * s)
        elif op == "Neg":
            x = values.get(ins[0])
            if x is None:
                return "Neg over an unsupported operand"
            values[name] = (-x[0], -x[1])
        else:
            return f"op {op} in a branch is not part of mint.optim.SGD's update"
    outputs = [o.name for o in function.output]
    last = index.producer.get(outputs[0]) if len(outputs) == 1 else None
    if last is None or index.op(last) != "Depend" or len(last.input) != 2:
        return "the branch does not end in Depend(value, monad)"
    value_name, final_monad = last.input
    if final_monad not in state:
        return "the branch's writes are not all ordered before its result"
    if chained != writes:
        return "a write to the buffer is not on the branch's monad chain"
    final = state[final_monad]
    if value_name == buf:
        ret = final
    elif value_name in values:
        ret = values[value_name]
    else:
        return "the branch returns a value that is not a linear form of the buffer and gradient"
    return _Effect(final, ret, cnodes)


# ---------------------------------------------------------------------------------------------------------
# Matching.


@dataclasses.dataclass
class _Plan:
    graph: str
    uses: list  # per use: (parameter, gradient, buffer) names; one per call site of a shared function
    caller_decay: list  # weight decay folded from a shared function's callers: (caller, call, position, AddExt, raw grad)
    call: str
    switch: str
    update: str
    outer_nesterov: str | None
    folded_decay: str | None
    weight: str
    buf: str
    grad: str
    cond: str
    step: str
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    data_type: int
    dims: list
    matched_nodes: int


def _fmt(value: float) -> str:
    """The shortest decimal that round-trips to the FLOAT the value is stored as."""
    import numpy as np

    return str(np.float32(value)) if value else "0"


def _match(index: _Index, model: Any, call: Any, device: str, calls: dict) -> _Plan | Refusal | None:
    switch = index.producer.get(call.op_type[5:])
    if switch is None or index.op(switch) != "Switch" or len(call.input) != 0 or len(switch.input) != 3:
        return None
    cond_name, true_name, false_name = switch.input
    pt, pf = index.producer.get(true_name), index.producer.get(false_name)
    if pt is None or pf is None or index.op(pt) != "Partial" or index.op(pf) != "Partial":
        return None
    ft, ff = index.functions.get(pt.input[0]), index.functions.get(pf.input[0])
    if ft is None or ff is None:
        return None
    if not any(_writes_first_argument(f, model) for f in (ft, ff)):
        return None

    candidate = call.name

    def refuse(reason: str, detail: str) -> Refusal:
        return Refusal(candidate, reason, detail)

    if list(pt.input[1:]) != list(pf.input[1:]):
        return refuse("branch-arguments", "the two branches take different arguments")
    buf = grad = monad = None
    positions = {}
    for position, name in enumerate(pt.input[1:]):
        if index.is_monad(name):
            monad, positions["monad"] = name, position
        elif name in index.refs and buf is None:
            buf, positions["buf"] = name, position
        elif grad is None:
            grad, positions["grad"] = name, position
        else:
            return refuse("branch-arguments", "the branches capture more than a buffer, a gradient and a monad")
    if buf is None or grad is None or monad is None:
        return refuse("branch-arguments", "the branches do not take a buffer Parameter, a gradient and a monad")
    candidate = _short(buf)

    cond = index.producer.get(cond_name)
    step = None
    if cond is not None and index.op(cond) in ("EqScalar", "Equal") and len(cond.input) == 2:
        if index.scalar(cond.input[1]) == 0.0:
            step = _step_counter(index, model, cond.input[0], calls)
    if step is None:
        return refuse("condition", "the branch condition is not `step_t == 0` over a step counter Parameter")

    effects = []
    for label, function in (("first-step", ft), ("momentum", ff)):
        args = [i.name for i in function.input]
        if len(args) != 3:
            return refuse("branch-form", f"{label} branch: unexpected parameter count")
        effect = _evaluate(function, model, args[positions["buf"]], args[positions["grad"]], args[positions["monad"]])
        if isinstance(effect, str):
            return refuse("branch-form", f"{label} branch: {effect}")
        effects.append(effect)
    first, later = effects
    if not _same(first.buf, (0.0, 1.0)):
        return refuse("first-step", f"the step_t == 0 branch does not set buf = grad (found {first.buf[0]:g}*buf + {first.buf[1]:g}*grad)")
    m, one_minus_d = later.buf
    if not m > 0.0:
        return refuse("momentum", f"momentum {m:g} is not > 0; the contract's momentum path needs m > 0")
    if _same(first.ret, first.buf) and _same(later.ret, later.buf):
        nesterov = False
    elif _same(first.ret, _add((0.0, 1.0), first.buf, m)) and _same(later.ret, _add((0.0, 1.0), later.buf, m)):
        nesterov = True
    else:
        return refuse("update-form", "the branches return neither the new buffer nor grad + m*buffer (Nesterov)")

    update = outer = None
    for user, position in index.users.get(call.name, []):
        op = index.op(user)
        if op == "UpdateState":
            continue
        if op == "InplaceAddExt" and position == 1 and update is None:
            update = user
        elif op == "AddExt" and position == 1 and outer is None and not nesterov:
            outer = user
        else:
            return refuse("extra-consumer", f"the updated buffer is also read by {user.name}")
    if outer is not None:
        m2 = index.scalar(outer.input[2]) if len(outer.input) == 3 else None
        if update is not None or outer.input[0] != grad or m2 is None or not _close(m2, m):
            return refuse("update-form", "the buffer feeds an AddExt that is not grad + m*buffer")
        for user, position in index.users.get(outer.name, []):
            if index.op(user) == "InplaceAddExt" and position == 1 and update is None:
                update = user
            elif index.op(user) != "UpdateState":
                return refuse("extra-consumer", f"the Nesterov step is also read by {user.name}")
        nesterov = True
    if update is None:
        return refuse("no-parameter-update", "no InplaceAddExt(w, buffer, -lr) consumes the buffer")
    alpha = index.scalar(update.input[2]) if len(update.input) == 4 else None
    if alpha is None:
        return refuse("learning-rate", "the parameter update's alpha (-lr) is not a compile-time constant")
    weight = update.input[0]
    if weight not in index.refs or weight == buf:
        return refuse("no-parameter-update", "the updated tensor is not a Parameter distinct from the buffer")
    candidate = _short(weight)
    for user, _ in index.users.get(update.name, []):
        if index.op(user) != "UpdateState":
            return refuse("extra-consumer", f"the updated parameter's value is read by {user.name}")
    for ref in (weight, buf):
        for user, position in index.users.get(ref, []):
            if position == 0 and user is not update and index.side_effect(user):
                return refuse("other-writes", f"{_short(ref)} is also written by {user.name}")

    gradient, decay, folded = grad, 0.0, None
    add = index.producer.get(grad)
    if add is not None and index.op(add) == "AddExt" and len(add.input) == 3:
        c = index.scalar(add.input[2])
        load = index.producer.get(add.input[1])
        readers = {u.name for u, _ in index.users.get(grad, []) if index.op(u) != "UpdateState"}
        allowed = {pt.name, pf.name} | ({outer.name} if outer is not None else set())
        if c is not None and c > 0 and load is not None and index.op(load) == "Load" and load.input[0] == weight and readers <= allowed:
            gradient, decay, folded = add.input[0], c, add.name
    caller_decay: list = []
    if add is None and grad in index.inputs:
        decay, caller_decay = _caller_decay(index, model, calls, weight, grad)

    info = [_tensor_of(index, n) for n in (weight, gradient, buf)]
    if any(i is None for i in info):
        return refuse("shape", "the parameter, gradient or buffer has no static tensor shape")
    (data_type, dims), (gtype, gdims), (btype, bdims) = info
    if (gtype, gdims) != (data_type, dims) or (btype, bdims) != (data_type, dims):
        return refuse("shape", "parameter, gradient and buffer differ in dtype or shape")
    if data_type not in _SUPPORTED or (data_type == 16 and device == "cpu"):
        return refuse(
            "dtype",
            f"{_DTYPE_NAME.get(data_type, data_type)} is not supported by the SGD kernel on {device} "
            "(contract: FLOAT, FLOAT16, BFLOAT16; MindSpore's CPU kernel: FLOAT, FLOAT16)",
        )
    if not 1 <= len(dims) <= 8 or any(d <= 0 for d in dims):
        return refuse("shape", "the contract needs rank 1..8 and no empty tensors")
    dampening = 1.0 - one_minus_d
    if nesterov and not _close(dampening, 0.0):
        return refuse("nesterov-dampening", f"Nesterov with dampening {dampening:g} (contract: dampening must be 0)")
    maximize = index.op_of(gradient) == "Neg"
    return _Plan(
        graph=index.graph.name, uses=_uses(index, calls, (weight, gradient, buf), caller_decay),
        caller_decay=caller_decay, call=call.name, switch=switch.name, update=update.name, outer_nesterov=outer.name if outer else None,
        folded_decay=folded, weight=weight, buf=buf, grad=gradient, cond=cond.name, step=step, lr=-alpha, momentum=m,
        dampening=dampening, weight_decay=decay, nesterov=nesterov, maximize=maximize, data_type=data_type,
        dims=dims, matched_nodes=first.nodes + later.nodes + 5 + (outer is not None) + (folded is not None),
    )


def _call_sites(model: Any) -> dict[str, list[tuple[Any, Any]]]:
    """Function name -> [(call node, graph holding it)] for direct calls ``REF::<function>(args...)``."""
    functions = {f.name for f in model.functions}
    sites: dict[str, list[tuple[Any, Any]]] = {}
    for g in [model.graph, *model.functions]:
        for node in g.node:
            if node.op_type.startswith("REF::") and node.op_type[5:] in functions:
                sites.setdefault(node.op_type[5:], []).append((node, g))
    return sites


def _step_counter(index: _Index, model: Any, value: str, calls: dict) -> str | None:
    """The step counter Parameter ``value`` is a Load of -- here, or, for an input of a shared function, at
    every call site (all the same counter). None otherwise."""
    value = index.value_of(value)
    load = index.producer.get(value)
    if load is not None and index.op(load) == "Load" and load.input[0] in index.params:
        return load.input[0]
    names = [i.name for i in index.graph.input]
    if value not in names or not calls.get(index.graph.name):
        return None
    position, step = names.index(value), None
    for call, caller in calls[index.graph.name]:
        outer = _Index(caller, model)
        if position >= len(call.input):
            return None
        load = outer.producer.get(outer.value_of(call.input[position]))
        if load is None or outer.op(load) != "Load" or load.input[0] not in outer.params or step not in (None, load.input[0]):
            return None
        step = load.input[0]
    return step


def _uses(index: _Index, calls: dict, nodes: tuple, caller_decay: list) -> list[tuple[str, ...]]:
    names = [i.name for i in index.graph.input]
    if not any(n in names for n in nodes) or not calls.get(index.graph.name):
        return [tuple(_short(n) for n in nodes)]
    uses = [
        tuple(_short(call.input[names.index(n)]) if n in names else _short(n) for n in nodes)
        for call, _ in calls[index.graph.name]
    ]
    if len(caller_decay) == len(uses):  # the callers now pass their raw gradients
        uses = [(w, _short(decay[4]), b) for (w, _, b), decay in zip(uses, caller_decay)]
    return uses


def _caller_decay(index: _Index, model: Any, calls: dict, weight: str, grad: str) -> tuple[float, list]:
    """The weight decay every caller of a shared function applies to the gradient it passes: each call site
    passes AddExt(g, Load(w), wd) for its own parameter argument w, with one wd, read by nothing but the call
    (and UpdateStates). Returns (wd, edits) or (0.0, []) when that does not hold."""
    names = [i.name for i in index.graph.input]
    if weight not in names or grad not in names or not calls.get(index.graph.name):
        return 0.0, []
    wi, gi = names.index(weight), names.index(grad)
    wd, edits = None, []
    for call, caller in calls[index.graph.name]:
        outer = _Index(caller, model)
        if max(wi, gi) >= len(call.input):
            return 0.0, []
        add = outer.producer.get(call.input[gi])
        if add is None or outer.op(add) != "AddExt" or len(add.input) != 3:
            return 0.0, []
        c = outer.scalar(add.input[2])
        load = outer.producer.get(add.input[1])
        if c is None or not c > 0 or (wd is not None and c != wd) or load is None or outer.op(load) != "Load":
            return 0.0, []
        if load.input[0] != call.input[wi]:
            return 0.0, []
        if any(u is not call and outer.op(u) != "UpdateState" for u, _ in outer.users.get(add.name, [])):
            return 0.0, []
        # The op reads w when it runs, the term read it earlier: fold only when nothing in the caller can
        # write w in between (it is only loaded, ordered, or passed to this call); else the term stays.
        # Every graph, not only the caller: a function may use a main-graph Parameter by name.
        for graph in [model.graph, *model.functions]:
            where = outer if graph is caller else _Index(graph, model)
            for user, position in where.users.get(call.input[wi], []):
                if (user is call and position == wi) or where.op(user) == "UpdateState" or (where.op(user) == "Load" and position == 0):
                    continue
                return 0.0, []
        wd = c
        edits.append((caller.name, call.name, gi, add.name, add.input[0]))
    return wd or 0.0, edits


def _writes_first_argument(function: Any, model: Any) -> bool:
    index = _Index(function, model)
    args = {i.name for i in function.input}
    return any(index.op(n).startswith("Inplace") and n.input and n.input[0] in args for n in function.node)


# ---------------------------------------------------------------------------------------------------------
# The rewrite.


class _Rewriter:
    def __init__(self, model: Any, pb: Any) -> None:
        self.model = model
        self.pb = pb
        self.graph = model.graph
        self.prefix = self.graph.name
        self.counter = 0
        self.casts: dict[tuple[str, int], str] = {}
        self.prim_names: dict[tuple, str] = {}

    def _name(self, what: str) -> str:
        self.counter += 1
        return f"{self.prefix}:sgdfuse_{what}_{self.counter}:{900000 + self.counter}"

    def _primitive(self, op_type: str, attributes: tuple = (), prim_type: int = 2) -> str:
        key = (op_type, attributes, prim_type)
        if key not in self.prim_names:
            name = f"{op_type}:{990000 + len(self.prim_names)}"
            prim = self.model.primitives.add(name=name, op_type=op_type, instance_name="", prim_type=prim_type)
            for attr_name, kind, value in attributes:
                a = prim.attribute.add(name=attr_name, type=kind)
                if kind == 1:
                    a.f = value
                elif kind == 9:
                    a.i = int(value)
                elif kind == 21:
                    for s in value:
                        a.values.add(type=8, strings=[s.encode()])
            self.prim_names[key] = name
        return self.prim_names[key]

    def _constant(self, fill) -> Any:
        node = self.pb.NodeProto()
        name = self._name("const").split(":")[1]
        node.name = name
        node.output.append(name)
        node.op_type = "Constant"
        attribute = node.attribute.add(name="value")
        fill(attribute)
        return node

    def _scalar_tensor(self, value: float, data_type: int) -> Any:
        import numpy as np

        if data_type == 16:
            import ml_dtypes

            raw = np.asarray(value, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes()
        else:
            raw = np.asarray(value, dtype=np.float16 if data_type == 10 else np.float32).tobytes()

        def fill(a):
            a.type = 19
            a.tensors.add(data_type=data_type, name="value0", raw_data=raw)

        return self._constant(fill)

    def _op(self, prim: str, inputs: list[str], data_type: int, dims: list, what: str) -> Any:
        node = self.pb.NodeProto()
        name = self._name(what)
        node.name = name
        node.output.append(name)
        node.op_type = "REF::" + prim
        node.input.extend(inputs)
        shape = node.attribute.add(name="shape", type=19)
        shape.tensors.add(data_type=data_type, dims=dims)
        node.domain = f"Default/sgdfuse/{what}"
        return node

    def _zero_on_first_step(self, plan: _Plan, monad: str) -> tuple[list[Any], str]:
        """``Assign(buf, MaskedFill(Load(buf, U), step_t == 0, 0), U)`` and ``UpdateState(U, Assign)``: the
        nodes and the monad the SGD node is ordered after.

        mint's first step sets ``buf = grad`` whatever the buffer holds (a restarted ``step_t``, buffers
        restored without it); the contract with ``stat = 1`` computes ``accum*m + grad``. Zeroing the buffer
        on that step makes them agree. MaskedFill, not a multiplication by ``1 - stat``: ``Inf * 0`` is NaN.
        """
        nodes = []
        key = (plan.cond, "mask")
        if key not in self.casts:

            def fill_bool(a):
                a.type = 7
                a.i = 30  # MindSpore TypeId kNumberTypeBool

            dtype = self._constant(fill_bool)
            mask = self._op(self._primitive("Cast", (("input_names", 21, ("x", "dst_type")), ("output_names", 21, ("output",)))),
                            [plan.cond, dtype.name], 9, [], "first_step")
            nodes += [dtype, mask]
            self.casts[key] = mask.name
        load = self._op(self._primitive("Load", prim_type=1), [plan.buf, monad], plan.data_type, plan.dims, "accum_load")
        zero = self._scalar_tensor(0.0, plan.data_type)
        fill = self._op(self._primitive("MaskedFill"), [load.name, self.casts[key], zero.name], plan.data_type, plan.dims,
                        f"first_step_zero-{_short(plan.weight)}")
        assign = self._op(self._primitive("Assign", (("side_effect_mem", 9, True),)), [plan.buf, fill.name, monad],
                          plan.data_type, plan.dims, f"first_step_zero-{_short(plan.weight)}")
        ordered = self._op(self._primitive("UpdateState", prim_type=1), [monad, assign.name], plan.data_type, [], "first_step_done")
        del ordered.attribute[:]
        ordered.attribute.add(name="shape", type=23)  # UMONAD
        return nodes + [load, zero, fill, assign, ordered], ordered.name

    def new_nodes(self, plan: _Plan, update: Any) -> list[Any]:
        """The nodes that replace ``update`` (which keeps its name as the SGD node)."""
        nodes = []
        key = (plan.cond, plan.data_type)
        if key not in self.casts:

            def fill_type(a, type_id=_TYPE_ID[plan.data_type]):
                a.type = 7
                a.i = type_id

            dtype = self._constant(fill_type)
            cast = self._op(self._primitive("Cast", (("input_names", 21, ("x", "dst_type")), ("output_names", 21, ("output",)))),
                            [plan.cond, dtype.name], plan.data_type, [], "stat_scalar")
            nodes += [dtype, cast]
            self.casts[key] = cast.name

        def fill_shape(a, dims=tuple(plan.dims)):
            a.type = 20
            for d in dims:
                a.values.add(type=7, ints=[d])

        shape = self._constant(fill_shape)
        stat = self._op(self._primitive("BroadcastTo"), [self.casts[key], shape.name], plan.data_type, plan.dims, "stat")
        zeroing, monad = self._zero_on_first_step(plan, update.input[3])
        nodes += zeroing
        lr = self._scalar_tensor(plan.lr, plan.data_type)
        momentum = self._scalar_tensor(plan.momentum, plan.data_type)
        prim = self._primitive(
            "SGD",
            (
                ("dampening", 1, plan.dampening),
                ("weight_decay", 1, plan.weight_decay),
                ("nesterov", 9, plan.nesterov),
                ("side_effect_mem", 9, True),
                ("input_names", 21, ("parameters", "gradient", "learning_rate", "accum", "momentum", "stat")),
                ("output_names", 21, ("output",)),
            ),
            prim_type=1,
        )
        sgd = self.pb.NodeProto()
        sgd.CopyFrom(update)
        del sgd.input[:]
        sgd.input.extend([plan.weight, plan.grad, lr.name, plan.buf, momentum.name, stat.name, monad])
        sgd.op_type = "REF::" + prim
        del sgd.attribute[:]
        sgd.attribute.add(name="shape", type=19).tensors.add(data_type=plan.data_type, dims=plan.dims)
        sgd.domain = f"Default/sgdfuse/SGD-{_short(plan.weight)}"
        return nodes + [shape, stat, lr, momentum, sgd]

    def apply(self, plans: list[_Plan]) -> None:
        constants = _constants(self.model)
        graphs = {g.name: g for g in [self.model.graph, *self.model.functions]}
        # Callers of a shared function whose weight decay the SGD op now applies pass the raw gradient.
        detach_in: dict[str, set[str]] = {}
        for p in plans:
            for caller, call_name, position, add_name, raw in p.caller_decay:
                call = next(n for n in graphs[caller].node if n.name == call_name)
                call.input[position] = raw
                detach_in.setdefault(caller, set()).add(add_name)
        for name in dict.fromkeys([p.graph for p in plans] + list(detach_in)):
            self.graph, self.prefix = graphs[name], name
            self._apply_to_graph([p for p in plans if p.graph == name], detach_in.get(name, set()))
        _sweep(self.model, constants)

    def _apply_to_graph(self, plans: list[_Plan], extra_detach: set[str]) -> None:
        graph = self.graph
        by_update = {p.update: p for p in plans}
        # Values no longer carried by any UpdateState: the calls, and folded weight-decay AddExts.
        detach = {p.call for p in plans} | {p.folded_decay for p in plans if p.folded_decay} | extra_detach
        alias: dict[str, str] = {}
        kept = []
        for node in graph.node:
            name = node.output[0] if node.output else node.name
            if name in by_update:
                kept.extend(self.new_nodes(by_update[name], node))
                continue
            if node.op_type.startswith("REF::UpdateState") or _is_update_state(self.model, node):
                inputs = [i for i in node.input if i not in detach]
                if len(inputs) != len(node.input):
                    if len(inputs) == 1:
                        alias[name] = inputs[0]
                        continue
                    del node.input[:]
                    node.input.extend(inputs)
            kept.append(node)
        for node in kept:
            for position, name in enumerate(node.input):
                while name in alias:
                    name = alias[name]
                node.input[position] = name
        for output in graph.output:
            while output.name in alias:
                output.name = alias[output.name]
        del graph.node[:]
        graph.node.extend(kept)
        if graph is not self.model.graph:  # the main graph is swept with the whole model
            _sweep_function(graph)


def _is_update_state(model: Any, node: Any) -> bool:
    ref = node.op_type[5:] if node.op_type.startswith("REF::") else ""
    return any(p.name == ref and p.op_type == "UpdateState" for p in model.primitives)


def _references(node: Any) -> list[str]:
    refs = list(node.input)
    if node.op_type.startswith("REF::"):
        refs.append(node.op_type[5:])  # a primitive, a function, or the node whose value a call calls
    return refs


def _sweep_function(function: Any) -> None:
    """Drop a function's nodes its output no longer needs (the Switch, Partials and call it held)."""
    producer = {(n.output[0] if n.output else n.name): n for n in function.node}
    live: set[str] = set()
    stack = [o.name for o in function.output]
    while stack:
        name = stack.pop()
        if name in live or name not in producer:
            continue
        live.add(name)
        stack.extend(_references(producer[name]))
    keep = [n for n in function.node if (n.output[0] if n.output else n.name) in live]
    del function.node[:]
    function.node.extend(keep)


def _sweep(model: Any, constants: dict[str, Any]) -> None:
    """Keep what the graph outputs need: main-graph nodes reachable from the outputs, the functions those
    reach (through Partial inputs and calls), the main-graph nodes those functions use, and the primitives
    any of them name. A Constant that a surviving function uses but only a dropped function defined is
    moved into the main graph."""
    main = model.graph
    functions = {f.name: f for f in model.functions}
    producer = {(n.output[0] if n.output else n.name): n for n in main.node}
    live_nodes: set[str] = set()
    live_functions: set[str] = set()
    defined_in_live_functions: set[str] = set()
    stack = [o.name for o in main.output]
    while stack:
        name = stack.pop()
        if name in functions:
            if name not in live_functions:
                live_functions.add(name)
                for node in functions[name].node:
                    defined_in_live_functions.update(node.output)
                    stack.extend(_references(node))
            continue
        if name in live_nodes or name not in producer:
            continue
        live_nodes.add(name)
        stack.extend(_references(producer[name]))
    nodes = [n for n in main.node if (n.output[0] if n.output else n.name) in live_nodes]
    referenced = {r for g in [nodes, *(functions[f].node for f in live_functions)] for n in g for r in _references(n)}
    missing = [
        constants[r] for r in sorted(referenced)
        if r in constants and r not in live_nodes and r not in defined_in_live_functions
    ]
    del main.node[:]
    main.node.extend(missing + nodes)
    keep = [f for f in model.functions if f.name in live_functions]
    del model.functions[:]
    model.functions.extend(keep)
    keep = [p for p in model.primitives if p.name in referenced]
    del model.primitives[:]
    model.primitives.extend(keep)


def _count_nodes(model: Any) -> int:
    return sum(len(g.node) for g in [model.graph, *model.functions])


# ---------------------------------------------------------------------------------------------------------
# The entry point.


def optimize_mindir(
    source: str | os.PathLike | bytes | Any,
    *,
    verify: bool = True,
    steps: int = 3,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[Any, Report]:
    """Fuse every ``mint.optim.SGD`` update of a MindIR train step into one ``SGD`` node each.

    Args:
        source: a ``.mindir`` path, its bytes, or a ``mind_ir_pb2.ModelProto`` (never mutated).
        verify: run original and rewritten models with ``mindspore.load`` + ``nn.GraphCell`` for ``steps``
            chained steps on seeded inputs and compare every output and Parameter
            (:func:`sgdfuse.mindspore.check.check_mindir`). If they disagree, the original model is returned
            and every update is reported as refused (``verification-failed``).
        steps, seed: the check's chained steps and input seed.
        device: the target the fused file is for (``"cpu"`` refuses BFLOAT16, which MindSpore's CPU SGD
            kernel does not take; ``"ascend"`` allows it).

    Returns:
        (the new ``ModelProto``, the :class:`~sgdfuse.report.Report`).

    Raises:
        MindIRLoadError: ``source`` cannot be read as MindIR.
        MindSporeMissingError: MindSpore (its protobuf module) is not installed.
    """
    pb = _mind_ir()
    if isinstance(source, pb.ModelProto):
        original, name = source, "<ModelProto>"
        check_external_data(original, None)
    else:
        original, name = load_mindir(source)
    path = None if isinstance(source, (pb.ModelProto, bytes, bytearray)) else os.fspath(source)
    calls = _call_sites(original)
    plans: list[_Plan] = []
    records: list[dict] = []
    for graph in [original.graph, *original.functions]:
        index = _Index(graph, original)
        for node in graph.node:
            if index.op(node) != "call":
                continue
            outcome = _match(index, original, node, device, calls)
            if outcome is None:
                continue
            if isinstance(outcome, Refusal):
                records.append({"event": "refused", **dataclasses.asdict(outcome)})
            else:
                plans.append(outcome)
    model = pb.ModelProto()
    model.CopyFrom(original)
    if plans:
        _Rewriter(model, pb).apply(plans)
    fused_records = [record for p in plans for record in _records(p)]
    report = report_from_records(fused_records + records, source=name)
    report.nodes_before, report.nodes_after = _count_nodes(original), _count_nodes(model)
    report.verification = Verification(
        enabled=verify and bool(plans), steps=steps if verify and plans else 0, tolerance=TOLERANCE,
        runner="MindSpore (mindspore.load + nn.GraphCell)",
    )
    if verify and plans:
        from sgdfuse.mindspore.check import check_mindir

        # The check runs copies from a temporary directory: parameters in data files go inline, read
        # through the checked path (MindSpore would look for the data files there).
        if path is not None:
            result = check_mindir(_with_data_inline(original, path), _with_data_inline(model, path), steps=steps, seed=seed)
        else:
            result = check_mindir(original, model, steps=steps, seed=seed)
        report.verification.updates = [
            {"parameters_out": v["name"], "passed": v["passed"], "max_abs_error": v["max_abs_error"],
             "max_bound_ratio": v["max_bound_ratio"], "message": v["message"]}
            for v in result.values
        ]
        if not result.passed:
            failed = "; ".join(v["name"] + ": " + v["message"] for v in result.values if not v["passed"])
            logger.warning("MindIR rewrite of %s failed its check, returning the original: %s", name, failed)
            report.refused = [Refusal(f.parameters, "verification-failed", failed) for f in report.fused] + report.refused
            report.fused = []
            model = pb.ModelProto()
            model.CopyFrom(original)
            report.nodes_after = report.nodes_before
    return model, report


def _records(plan: _Plan) -> list[dict]:
    """One report record per use (per call site when the update sits in a shared function)."""
    base = _record(plan)
    return [base | {"parameters": w, "gradient": g, "accum": b} for w, g, b in plan.uses]


def _record(plan: _Plan) -> dict:
    m, lr = _fmt(plan.momentum), _fmt(plan.lr)
    accum_eq = f"accum <- {m}*accum + {_fmt(1.0 - plan.dampening)}*grad (first step: accum <- grad)"
    if plan.weight_decay:
        accum_eq += f", grad = gradient + {_fmt(plan.weight_decay)}*p"
    param_eq = f"p <- p - {lr}*(grad + {m}*accum)" if plan.nesterov else f"p <- p - {lr}*accum"
    return {
        "event": "fused", "node": plan.update, "parameters": _short(plan.weight), "gradient": _short(plan.grad),
        "accum": _short(plan.buf), "step": _short(plan.step), "learning_rate": float(_fmt(plan.lr)),
        "momentum": float(_fmt(plan.momentum)), "dampening": float(_fmt(plan.dampening)),
        "weight_decay": float(_fmt(plan.weight_decay)), "nesterov": plan.nesterov, "maximize": plan.maximize,
        "dtype": _DTYPE_NAME.get(plan.data_type, str(plan.data_type)), "shape": plan.dims,
        "parameter_equation": param_eq, "accum_equation": accum_eq, "matched_nodes": plan.matched_nodes,
    }


@dataclasses.dataclass
class MindIRResult:
    """The outcome of :func:`optimize_mindir_file` (the shape of :class:`sgdfuse.api.OptimizeResult`, for the CLI).

    Attributes:
        model: the new ``mind_ir_pb2.ModelProto``; report: what was fused, refused and checked.
    """

    model: Any
    report: Report
    source: str | None = None
    """The file the model was read from: its data file locations are relative to its directory."""

    def save(self, path: str | os.PathLike, *, batch: Any = None) -> None:
        """Write :attr:`model` whole or not at all to ``path`` (staged in ``batch`` when given), data files
        copied beside it (:func:`save_mindir`)."""
        save_mindir(self.model, path, batch=batch, source=self.source)

    @staticmethod
    def default_output(source: str | os.PathLike) -> str:
        """``NAME.mindir`` -> ``NAME.sgdfused.mindir`` beside it."""
        path = os.fspath(source)
        stem = path[: -len(".mindir")] if path.endswith(".mindir") else path
        return stem + ".sgdfused.mindir"


def optimize_mindir_file(source: str | os.PathLike, *, verify: bool = True, steps: int = 3) -> MindIRResult:
    """:func:`optimize_mindir` on a file, packaged for ``sgdfuse optimize NAME.mindir``."""
    model, report = optimize_mindir(source, verify=verify, steps=steps)
    return MindIRResult(model, report, os.fspath(source))
