"""Start a fused training step from a checkpoint: optimizer state as the fused model's feeds.

A fused model (``sgdfuse optimize``) takes the state of each ``ai.sgdfuse::SGD`` node as graph inputs: the
weights (port ``parameters``) and the momentum buffer (port ``accum``). The third piece of state, the
first-step flag ``stat``, is whatever the graph computes for that port (:mod:`sgdfuse.passes.rewrite`):

- zeros (``ConstantOfShape``): the original graph dampens on every step; a parameter on its first step is
  then exact only when its dampening is 0 (``accum`` fed as zeros gives ``m·0 + grad = grad``, the first
  step of ``torch.optim.SGD`` and ``mint.optim.SGD``), and refused otherwise;
- ``Expand(Cast(condition))`` with the condition a boolean graph input (``first_step``) or a comparison of an
  integer graph input with a constant (a step counter: ``Equal(step, 0)``, ONNX ``Momentum``'s ``T <= 0``),
  possibly through ``Not``: that input is fed so the condition says "first step" exactly for parameters with
  no buffer;
- a graph input itself: fed ``stat`` (1 or 0 in every element).

The checkpoint decides ``stat`` as the optimizers do: 1 for a parameter with no momentum buffer yet (PyTorch:
``state[p]["momentum_buffer"]`` is ``None`` or absent, the first ``step()`` then sets ``buf = grad``;
MindSpore ``mint.optim.SGD``: ``step_t == 0``, when every buffer is replaced by the gradient), 0 otherwise.
A parameter with no buffer is fed a zero buffer.

Checkpoint files (:func:`read_checkpoint`; every one is untrusted, nothing in it is executed):

- ``.npz`` (numpy, ``allow_pickle=False``) and ``.safetensors`` (the ``safetensors`` package, an optional
  extra) in the *flat layout*: each model tensor under its name (``model.state_dict()`` keys), each momentum
  buffer under ``<name>/momentum_buffer`` (absent before the parameter's first step);
- ``.pt``/``.pth`` (PyTorch, the optional ``torch`` package): ``torch.load(weights_only=True)`` of
  ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` (also ``model_state_dict`` /
  ``optimizer_state_dict``); the optimizer must have been built from named parameters (its ``param_groups``
  then hold ``param_names``, torch >= 2.5), since integer ids alone do not name a parameter;
- ``.ckpt`` (MindSpore, the optional ``mindspore`` package, ``mindspore.load_checkpoint``): parameters by
  name, ``mint.optim.SGD`` buffers ``momentum_buf.<name>`` and the step counter ``step_t``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from sgdfuse.api import load_model
from sgdfuse.contract import dtype_name
from sgdfuse.errors import CheckpointError, ModelNameError
from sgdfuse.fused_op import is_sgd_node, read_sgd_attributes
from sgdfuse.output import OutputBatch
from sgdfuse.passes.index import GraphIndex, build_index
from sgdfuse.runtime import onnx_to_numpy_dtype

__all__ = [
    "BUFFER_SUFFIX",
    "Checkpoint",
    "StatSource",
    "UpdateState",
    "MappedUpdate",
    "StateFeeds",
    "read_checkpoint",
    "model_state",
    "checkpoint_feeds",
    "parse_name_map",
]

logger = logging.getLogger(__name__)

BUFFER_SUFFIX = "/momentum_buffer"
"""Key suffix of a momentum buffer in the flat layout: ``fc1.weight/momentum_buffer``."""

_MINDSPORE_BUFFER_PREFIX = "momentum_buf."  # mint.optim.SGD: self.parameters.clone(prefix="momentum_buf")
_MINDSPORE_STEP = "step_t"


# ---------------------------------------------------------------------------------------------------------
# Reading checkpoints
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Checkpoint:
    """A checkpoint as name → numpy array.

    Attributes:
        source: the file it was read from (for messages).
        format: ``"npz"``, ``"safetensors"``, ``"torch"`` or ``"mindspore"``.
        tensors: model tensors by name (parameters, and whatever else the model saved, e.g. BatchNorm
            statistics).
        buffers: parameter name → its momentum buffer; a parameter with no entry has none yet (first step).
        step: the optimizer's step counter when the checkpoint has one (MindSpore ``step_t``), else None.
    """

    source: str
    format: str
    tensors: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    step: int | None = None

    @classmethod
    def from_flat(cls, flat: Mapping[str, np.ndarray], *, source: str = "<checkpoint>", format: str = "npz") -> "Checkpoint":
        """Split a flat mapping (the ``.npz``/``.safetensors`` layout) into tensors and buffers."""
        tensors = {k: np.asarray(v) for k, v in flat.items() if not k.endswith(BUFFER_SUFFIX)}
        buffers = {k[: -len(BUFFER_SUFFIX)]: np.asarray(v) for k, v in flat.items() if k.endswith(BUFFER_SUFFIX)}
        return cls(source, format, tensors, buffers)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint file; the format comes from the extension (module docstring).

    Raises:
        CheckpointError: the file is missing, unreadable, of an unknown extension, not in the expected layout,
            or needs an optional package that is not installed (the message names it).
    """
    shown = os.fspath(path)
    if not os.path.isfile(shown):
        raise CheckpointError(shown, "", "no such file" if not os.path.exists(shown) else "is not a regular file")
    extension = os.path.splitext(shown)[1].lower()
    readers = {".npz": _read_npz, ".safetensors": _read_safetensors, ".pt": _read_torch, ".pth": _read_torch, ".ckpt": _read_mindspore}
    reader = readers.get(extension)
    if reader is None:
        raise CheckpointError(shown, "", f"unknown checkpoint extension {extension or '(none)'!r}; expected one of {', '.join(readers)}")
    return reader(shown)


def _read_npz(path: str) -> Checkpoint:
    try:
        with np.load(path, allow_pickle=False) as data:  # no pickle: an untrusted file runs no code
            flat = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:  # a truncated archive is a BadZipFile
        raise CheckpointError(path, "", f"not a readable .npz archive of plain arrays ({error})") from error
    return Checkpoint.from_flat(flat, source=path, format="npz")


def _read_safetensors(path: str) -> Checkpoint:
    try:
        from safetensors.numpy import load_file
    except ImportError as error:
        raise CheckpointError(path, "", "reading .safetensors needs the safetensors package: pip install 'sgdfuse[checkpoint]'") from error
    try:
        flat = load_file(path)
    except Exception as error:  # safetensors raises its own SafetensorError and ValueError/TypeError for bad headers
        raise CheckpointError(path, "", f"not a readable safetensors file ({error})") from error
    return Checkpoint.from_flat(flat, source=path, format="safetensors")


def _torch_array(value: Any) -> np.ndarray:
    import torch

    tensor = value.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits as ml_dtypes' type
        return tensor.view(torch.int16).numpy().view(onnx_to_numpy_dtype(onnx.TensorProto.BFLOAT16))
    return tensor.numpy().copy()


def _read_torch(path: str) -> Checkpoint:
    try:
        import torch
    except ImportError as error:
        raise CheckpointError(path, "", "reading .pt needs PyTorch: pip install 'sgdfuse[torch]', or export the checkpoint to .npz/.safetensors (docs/checkpoint.md)") from error
    try:
        # weights_only: the file is untrusted; only tensors and plain containers are unpickled.
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, EOFError... for bad files
        raise CheckpointError(path, "", f"torch.load(weights_only=True) refused it: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}") from error
    if not isinstance(content, dict):
        raise CheckpointError(path, "", "expected a dict {'model': state_dict, 'optimizer': optimizer state_dict}")
    model = content.get("model", content.get("model_state_dict"))
    optimizer = content.get("optimizer", content.get("optimizer_state_dict"))
    if not isinstance(model, dict) or not isinstance(optimizer, dict):
        raise CheckpointError(path, "", f"expected keys 'model' and 'optimizer' (or 'model_state_dict' and 'optimizer_state_dict'); found {sorted(map(str, content))}")
    tensors = {str(k): _torch_array(v) for k, v in model.items() if isinstance(v, torch.Tensor)}
    names: dict[int, str] = {}
    for group in optimizer.get("param_groups", []):
        ids, group_names = group.get("params", []), group.get("param_names")
        if group_names is None:
            raise CheckpointError(
                path, "", "the optimizer state_dict has no param_names (the optimizer was built from model.parameters()); "
                "build it from model.named_parameters(), or export the checkpoint to the .npz layout (docs/checkpoint.md)"
            )
        names.update(zip(ids, map(str, group_names)))
    buffers: dict[str, np.ndarray] = {}
    for key, state in optimizer.get("state", {}).items():
        buffer = state.get("momentum_buffer") if isinstance(state, dict) else None
        if buffer is not None:  # None: the parameter has had no step yet
            if key not in names:
                raise CheckpointError(path, f"optimizer.state[{key}]", "is in no param_group; the optimizer state_dict is inconsistent")
            buffers[names[key]] = _torch_array(buffer)
    return Checkpoint(path, "torch", tensors, buffers)


def _read_mindspore(path: str) -> Checkpoint:
    try:
        import mindspore
    except ImportError as error:
        raise CheckpointError(path, "", "reading .ckpt needs MindSpore: pip install 'sgdfuse[mindspore]'") from error
    try:
        content = mindspore.load_checkpoint(path)
    except Exception as error:  # MindSpore raises ValueError/RuntimeError for files it cannot parse
        raise CheckpointError(path, "", f"mindspore.load_checkpoint refused it: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}") from error
    arrays = {str(name): np.asarray(value.asnumpy()) for name, value in content.items()}
    step_array = arrays.pop(_MINDSPORE_STEP, None)
    step = int(step_array.reshape(-1)[0]) if step_array is not None and step_array.size == 1 else None
    buffers = {k[len(_MINDSPORE_BUFFER_PREFIX):]: v for k, v in arrays.items() if k.startswith(_MINDSPORE_BUFFER_PREFIX)}
    tensors = {k: v for k, v in arrays.items() if not k.startswith(_MINDSPORE_BUFFER_PREFIX)}
    if step is None and buffers:
        raise CheckpointError(path, _MINDSPORE_STEP, "missing: a mint.optim.SGD checkpoint holds step_t, which says whether its buffers are used")
    if step == 0:
        # mint.optim.SGD's step with step_t == 0 copies the gradient into every buffer (buf.copy_(d_p)): the
        # zero buffers it saved are not state yet, exactly like torch's None.
        buffers = {}
    return Checkpoint(path, "mindspore", tensors, buffers, step)


# ---------------------------------------------------------------------------------------------------------
# What the fused model takes
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StatSource:
    """How a fused node's ``stat`` port gets its value.

    Attributes:
        kind: ``"zeros"`` (computed as zeros), ``"input"`` (the graph input ``input`` is ``stat`` itself),
            ``"condition"`` (``stat`` is 1 where the boolean graph input ``input`` equals ``when``),
            ``"step"`` (``stat`` is 1 where ``input relation value`` equals ``when``; ``input`` an integer
            step counter, ``relation`` one of ``== < <= > >=``), ``"computed"`` (none of these; ``inputs`` lists the graph inputs it depends on).
        only_compared: for ``"step"``: the counter is read by nothing but this same comparison, so sgdfuse
            may pick its value.
    """

    kind: str
    input: str = ""
    when: bool = True
    value: int = 0
    relation: str = "=="
    only_compared: bool = False
    inputs: tuple[str, ...] = ()
    input_shape: tuple | None = None
    input_dtype: int = 0

    def describe(self) -> str:
        """One phrase for tables and JSON."""
        if self.kind == "zeros":
            return "computed as 0 in the graph"
        if self.kind == "input":
            return f"graph input {self.input}"
        if self.kind == "condition":
            return f"from graph input {self.input} (first step where it is {str(self.when).lower()})"
        if self.kind == "step":
            negation = "" if self.when else "not "
            return f"from graph input {self.input} (first step where {negation}{self.input} {self.relation} {self.value})"
        return f"computed from {', '.join(self.inputs) or 'constants'} (not set from a checkpoint)"


@dataclasses.dataclass(frozen=True)
class UpdateState:
    """The state inputs of one ``ai.sgdfuse::SGD`` node of a fused model.

    Attributes:
        node: the node's name.
        parameters, accum: the graph inputs fed to ports ``parameters`` and ``accum`` (through ``Identity``,
            ``Cast``, and for ``accum`` the rewrite's first-step ``Where(first, 0, buffer)``): the report's
            ``parameters`` and ``accum`` names.
        dtype: ONNX element type of ``parameters``; shape: its dims (ints, or str/None where not static).
        dampening: the node's ``dampening`` attribute.
        stat: how ``stat`` is provided.
    """

    node: str
    parameters: str
    accum: str
    dtype: int
    shape: tuple | None
    accum_dtype: int
    accum_shape: tuple | None
    dampening: float
    stat: StatSource
    gradient_scaling: str = ""
    """When the node's gradient is the graph's value times a constant that can be a ``1 - dampening`` (``Mul`` by,
    or ``Div`` by the inverse of, a one-element constant of magnitude in (0, 1): PyTorch's ``(1 - dampening)*grad``
    read with dampening 0): that node, described. The optimizers' first step copies the unscaled gradient into
    the buffer, which such a node cannot be fed exactly. A factor of magnitude above 1 is no dampening in [0, 1)
    but the gradient's own (``g2 = 2*w1_new``), as the matcher reads it (``sgd_match._reading_order``)."""


def _gradient_scaling(index: GraphIndex, gradient: str) -> str:
    """:attr:`UpdateState.gradient_scaling` of the SGD port ``gradient`` (past copies), or ""."""
    value, seen = gradient, set()
    while value not in seen:
        seen.add(value)
        producer = index.node(value)
        if producer is None:
            return ""
        if producer.op_type in ("Identity", "Cast", "CastLike") and producer.input:
            value = producer.input[0]
            continue
        if producer.op_type in ("Mul", "Div") and len(producer.input) == 2:
            # Mul by either operand; Div only by its divisor (c / x is no scaling of x).
            for position, operand in enumerate(producer.input):
                constant = index.constant(operand) if operand and (producer.op_type == "Mul" or position == 1) else None
                if constant is None or constant.size != 1:
                    continue
                c = float(np.asarray(constant, np.float64).reshape(-1)[0])
                factor = c if producer.op_type == "Mul" else (1.0 / c if c else math.inf)
                if 0.0 < abs(factor) < 1.0:
                    return f"{producer.op_type} node {producer.name or value!r} scales it by the constant {c:g}"
        return ""
    return ""


def model_state(model: onnx.ModelProto, *, source: str = "<model>") -> list[UpdateState]:
    """The state inputs of every ``ai.sgdfuse::SGD`` node of ``model``, in node order.

    Raises:
        CheckpointError: the model has no SGD node (not fused), or a ``parameters``/``accum`` port is not fed
            from a graph input (an initializer cannot be replaced by a checkpoint's value).
        ModelNameError: a name that is not UTF-8 (as every command refuses it), naming the file ``source``.
    """
    try:
        index = build_index(model)
    except ModelNameError as error:
        raise error if error.path or source.startswith("<") else error.in_file(source) from None
    updates = []
    for node in model.graph.node:
        if not is_sgd_node(node):
            continue
        name = node.name or node.output[0]
        parameters = _state_input(index, node.input[0], source, name, "parameters", follow=("Identity", "Cast", "CastLike"))
        accum = _state_input(index, node.input[3], source, name, "accum", follow=("Identity", "Cast", "CastLike", "Where"))
        p_spec, a_spec = index.spec(parameters), index.spec(accum)
        updates.append(
            UpdateState(
                name, parameters, accum, p_spec.dtype, p_spec.shape, a_spec.dtype, a_spec.shape,
                read_sgd_attributes(node).dampening, _stat_source(index, node.input[5]), _gradient_scaling(index, node.input[1]),
            )
        )
    if not updates:
        raise CheckpointError(source, "", "the model has no ai.sgdfuse::SGD node; run `sgdfuse optimize` on it first and give the fused model")
    return updates


def _state_input(index: GraphIndex, value: str, source: str, node: str, port: str, *, follow: tuple[str, ...]) -> str:
    """The graph input whose value reaches ``value`` through ``follow`` ops (``Where``: its third input, the
    buffer in the rewrite's ``Where(first_step, 0, buffer)``)."""
    start = value
    while not _is_feedable(index, value):
        producer = index.node(value)
        if producer is None or producer.op_type not in follow:
            made = f"by {producer.op_type} node {producer.name!r}" if producer is not None else "as an initializer or constant"
            raise CheckpointError(
                source, start, f"port {port} of SGD node {node!r} is made {made}, not fed from a graph input; "
                "a checkpoint can only replace graph inputs (export the step with its state as inputs)"
            )
        value = producer.input[2] if producer.op_type == "Where" else producer.input[0]
    return value


def _is_feedable(index: GraphIndex, value: str) -> bool:
    # A graph input, also one with an initializer (its default): onnxruntime lets a feed replace it.
    return index.is_input_name(value)


def _stat_source(index: GraphIndex, value: str) -> StatSource:
    """Read the chain the rewrite (or an exporter) builds for ``stat``; ``when`` tracks ``Not`` s."""
    when = True
    while True:
        if _is_feedable(index, value):
            spec = index.spec(value)
            if spec.dtype == onnx.TensorProto.BOOL:
                return StatSource("condition", value, when=when, input_shape=spec.shape, input_dtype=spec.dtype)
            # A float input reaching the port through Identity/Cast/Expand is stat itself.
            return StatSource("input", value) if when and spec.dtype not in _INTEGER_TYPES else StatSource("computed", inputs=(value,))
        constant = index.constant(value)
        if constant is not None:
            return StatSource("zeros") if not np.any(constant) and when else StatSource("computed")
        producer = index.node(value)
        if producer is None:
            return StatSource("computed")
        if producer.op_type == "ConstantOfShape":
            fill = next((a.t for a in producer.attribute if a.name == "value"), None)
            is_zero = fill is None or not np.any(onnx.numpy_helper.to_array(fill))
            return StatSource("zeros") if is_zero and when else StatSource("computed")
        if producer.op_type in ("Identity", "Cast", "CastLike", "Expand"):
            value = producer.input[0]
        elif producer.op_type == "Not":
            when, value = not when, producer.input[0]
        elif producer.op_type in _COMPARISONS:
            return _step_source(index, producer, when)
        else:
            return StatSource("computed", inputs=tuple(sorted(_graph_inputs_reaching(index, value))))


_INTEGER_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
                  onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}


_COMPARISONS = {"Equal": "==", "Less": "<", "LessOrEqual": "<=", "Greater": ">", "GreaterOrEqual": ">="}
_MIRRORED = {"==": "==", "<": ">", "<=": ">=", ">": "<", ">=": "<="}  # C < t is t > C


def _comparison(index: GraphIndex, node: onnx.NodeProto, counter: str) -> tuple[str, int] | None:
    """``(relation, C)`` when ``node`` compares ``counter`` with a one-element integer constant C, read as
    ``counter relation C``; else None."""
    relation = _COMPARISONS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if relation is None or len(node.input) != 2 or counter not in node.input or node.input[0] == node.input[1]:
        return None
    other = node.input[1] if node.input[0] == counter else node.input[0]
    constant = index.constant(other)
    if constant is None or constant.size != 1 or constant.dtype.kind not in "iu":
        return None
    return (relation if node.input[0] == counter else _MIRRORED[relation]), int(constant.reshape(-1)[0])


def _step_source(index: GraphIndex, compare: onnx.NodeProto, when: bool) -> StatSource:
    """``counter relation C`` on an integer graph input (``Equal(step, 0)``, ONNX ``Momentum``'s ``T <= 0``)
    → a ``"step"`` source; else ``"computed"``."""
    for counter in compare.input:
        found = _comparison(index, compare, counter) if _is_feedable(index, counter) else None
        if found is None or index.spec(counter).dtype not in _INTEGER_TYPES:
            continue
        relation, value = found
        readers = [index.graph.node[i] for i in index.consumers.get(counter, [])]
        only = (
            counter not in index.graph_outputs
            and counter not in index.subgraph_reads
            and all(_comparison(index, r, counter) == found for r in readers)
        )
        spec = index.spec(counter)
        return StatSource("step", counter, when=when, value=value, relation=relation, only_compared=only, input_shape=spec.shape, input_dtype=spec.dtype)
    return StatSource("computed", inputs=tuple(sorted(_graph_inputs_reaching(index, compare.output[0]))))


def _counter_for(relation: str, value: int, truth: bool) -> int:
    """A counter value ``t`` with ``(t relation value) == truth``."""
    choices = {"==": (value, value + 1), "<=": (value, value + 1), "<": (value - 1, value), ">": (value + 1, value), ">=": (value, value - 1)}
    return choices[relation][0 if truth else 1]


def _holds(relation: str, counter: int, value: int) -> bool:
    return {"==": counter == value, "<": counter < value, "<=": counter <= value, ">": counter > value, ">=": counter >= value}[relation]


def _graph_inputs_reaching(index: GraphIndex, value: str) -> set[str]:
    seen, found, stack = set(), set(), [value]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if _is_feedable(index, name):
            found.add(name)
        producer = index.node(name)
        if producer is not None:
            stack.extend(x for x in producer.input if x)
    return found


# ---------------------------------------------------------------------------------------------------------
# The mapping
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MappedUpdate:
    """One fused update fed from the checkpoint.

    Attributes:
        node: the SGD node. checkpoint_name: the checkpoint's name of the parameter.
        parameters, accum: the graph inputs fed. has_buffer: the checkpoint holds a momentum buffer for it.
        stat: 1 (first step: no buffer yet) or 0, as ``torch.optim.SGD``/``mint.optim.SGD`` decide it.
        stat_fed: how that value reaches the model (a sentence).
    """

    node: str
    checkpoint_name: str
    parameters: str
    accum: str
    has_buffer: bool
    stat: int
    stat_fed: str


@dataclasses.dataclass
class StateFeeds:
    """The result of :func:`checkpoint_feeds`.

    Attributes:
        checkpoint, model: where they were read from.
        feeds: ONNX graph input name → array: every ``parameters`` and ``accum`` input, and the input a
            first-step flag comes from when the model has one.
        updates: one entry per SGD node.
        warnings: one line each (checkpoint tensors that map to nothing, stat inputs sgdfuse cannot set).
        init_feeds: with ``soc``: GE init graph ``Data`` op name (``<state>/initial_value``) → array.
    """

    checkpoint: str
    model: str
    feeds: dict[str, np.ndarray]
    updates: list[MappedUpdate]
    warnings: list[str]
    init_feeds: dict[str, np.ndarray] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (arrays as shape and dtype)."""
        def shapes(arrays: Mapping[str, np.ndarray] | None) -> dict | None:
            return None if arrays is None else {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in arrays.items()}

        return {
            "checkpoint": self.checkpoint,
            "model": self.model,
            "updates": [dataclasses.asdict(u) for u in self.updates],
            "feeds": shapes(self.feeds),
            "init_feeds": shapes(self.init_feeds),
            "warnings": list(self.warnings),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | os.PathLike, *, init_path: str | os.PathLike | None = None, batch: OutputBatch | None = None) -> None:
        """Write :attr:`feeds` (and :attr:`init_feeds` to ``init_path``) as ``.npz`` (``np.savez``, keys the
        input names), whole or not at all; with ``batch``, staged there for the caller to commit.

        Raises:
            ValueError: ``init_path`` given without init feeds (no ``soc`` was given).
            OutputWriteError: a destination cannot be written; nothing is left behind.
        """
        if init_path is not None and self.init_feeds is None:
            raise ValueError("no GE init feeds: map the checkpoint with soc= to get them")
        if batch is None:
            with OutputBatch() as own:
                self.save(path, init_path=init_path, batch=own)
                own.commit()
            return
        batch.stage(path, _npz_bytes(self.feeds))
        if init_path is not None:
            batch.stage(init_path, _npz_bytes(self.init_feeds or {}))


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def parse_name_map(items: list[str] | None) -> dict[str, str]:
    """``["fc1.weight=w1", ...]`` → ``{"fc1.weight": "w1"}`` (checkpoint name → ONNX input name).

    Raises:
        CheckpointError: an item without ``=``, with an empty side, or a checkpoint name given twice.
    """
    mapping: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise CheckpointError("--map", item, "expected CHECKPOINT_NAME=ONNX_INPUT")
        if key in mapping:
            raise CheckpointError("--map", key, f"mapped twice ({mapping[key]!r} and {value!r})")
        mapping[key] = value
    return mapping


def checkpoint_feeds(
    checkpoint: str | os.PathLike | Checkpoint,
    model: str | os.PathLike | onnx.ModelProto,
    *,
    name_map: Mapping[str, str] | None = None,
    soc: str | None = None,
) -> StateFeeds:
    """Map a checkpoint onto the state inputs of a fused model (module docstring).

    Each SGD node's ``parameters`` input takes the checkpoint tensor of the same name, or the one ``name_map``
    maps to it (checkpoint name → ONNX input name); its ``accum`` input takes that parameter's momentum
    buffer, or zeros when it has none (first step, ``stat`` = 1).

    Args:
        checkpoint: a file (see :func:`read_checkpoint`) or a :class:`Checkpoint`.
        model: the fused ONNX model (path or ``ModelProto``), loaded with :func:`sgdfuse.load_model`.
        name_map: checkpoint name → ONNX parameter input, for names the exporter changed.
        soc: also compute the GE init graph's feeds for this SoC (the model is lowered with
            :func:`sgdfuse.lower` to learn the init graph's ``<state>/initial_value`` inputs).

    Raises:
        CheckpointError: a parameter missing from the checkpoint, a shape or dtype mismatch, a ``name_map``
            entry naming no parameter input, a first step the model cannot express (dampening != 0 with
            ``stat`` computed as 0), first and later steps sharing one flag input, or an unreadable file.
        ModelLoadError: the model cannot be loaded.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint)
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    model_name = "<ModelProto>" if isinstance(model, onnx.ModelProto) else os.fspath(model)
    updates = model_state(proto, source=model_name)
    names = _checkpoint_names(ckpt, updates, dict(name_map or {}))
    feeds: dict[str, np.ndarray] = {}
    mapped: list[MappedUpdate] = []
    for update in updates:
        name = names[update.parameters]
        parameters = _checked(ckpt, name, ckpt.tensors.get(name), update.dtype, update.shape, update.parameters)
        buffer = ckpt.buffers.get(name)
        if buffer is not None:
            buffer = _checked(ckpt, name + BUFFER_SUFFIX, buffer, update.accum_dtype, update.accum_shape, update.accum)
        else:
            buffer = np.zeros(parameters.shape, dtype=onnx_to_numpy_dtype(update.accum_dtype))
        feeds[update.parameters] = parameters
        feeds[update.accum] = buffer
        stat = 0 if name in ckpt.buffers else 1
        mapped.append(MappedUpdate(update.node, name, update.parameters, update.accum, stat == 0, stat, ""))
    warnings = _stat_feeds(ckpt, updates, mapped, feeds)
    warnings = _extra_tensors(ckpt, set(names.values())) + warnings
    for name, array in feeds.items():
        values = np.asarray(array)
        if values.dtype.kind == "f" or values.dtype.name == "bfloat16":
            bad = int(np.count_nonzero(~np.isfinite(values.astype(np.float64))))
            if bad:
                # Training from NaN or Inf state is rarely meant; the feeds are still written as given.
                warnings.append(f"{name}: {bad} of {values.size} element(s) are NaN or infinite in the checkpoint")
    for line in warnings:
        logger.warning("%s", line)
    result = StateFeeds(ckpt.source, model_name, feeds, mapped, warnings)
    if soc is not None:
        result.init_feeds = _init_feeds(model, soc, feeds)
    return result


def _checkpoint_names(ckpt: Checkpoint, updates: list[UpdateState], name_map: dict[str, str]) -> dict[str, str]:
    """ONNX parameter input → checkpoint name; errors for map entries naming nothing and missing tensors."""
    inputs = [u.parameters for u in updates]
    for key, target in name_map.items():
        if target not in inputs:
            raise CheckpointError(ckpt.source, key, f"--map {key}={target}: {target!r} is not a parameters input of the fused model (those are: {', '.join(inputs)})")
    inverse = {target: key for key, target in name_map.items()}
    names: dict[str, str] = {}
    used: dict[str, str] = {}
    for onnx_name in inputs:
        name = inverse.get(onnx_name, onnx_name)
        if name not in ckpt.tensors:
            hint = f" (mapped from --map {name}={onnx_name})" if onnx_name in inverse else "; give --map CHECKPOINT_NAME=" + onnx_name + " if it is saved under another name"
            raise CheckpointError(ckpt.source, name, f"missing: the fused model's parameters input {onnx_name!r} has no tensor in the checkpoint{hint}")
        if name in used and used[name] != onnx_name:
            raise CheckpointError(ckpt.source, name, f"would feed two parameters inputs ({used[name]!r} and {onnx_name!r})")
        used[name] = onnx_name
        names[onnx_name] = name
    return names


def _checked(ckpt: Checkpoint, name: str, array: np.ndarray | None, dtype: int, shape: tuple | None, onnx_input: str) -> np.ndarray:
    """``array`` if its dtype and shape are those of the ONNX input (symbolic dims accept any size)."""
    assert array is not None
    want = onnx_to_numpy_dtype(dtype) if dtype else None
    if want is not None and array.dtype != want:
        if array.dtype.kind == "V" and array.dtype.itemsize == want.itemsize and dtype == onnx.TensorProto.BFLOAT16:
            array = array.view(want)  # np.savez keeps ml_dtypes' bfloat16 as raw 2-byte records
        else:
            raise CheckpointError(ckpt.source, name, f"dtype {array.dtype} but the fused model's input {onnx_input!r} is {dtype_name(dtype)} ({want}); cast it when exporting")
    if shape is not None:
        fits = len(shape) == array.ndim and all(not isinstance(d, int) or d == n for d, n in zip(shape, array.shape))
        if not fits:
            shown = "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"
            raise CheckpointError(ckpt.source, name, f"shape {list(array.shape)} but the fused model's input {onnx_input!r} has shape {shown}")
    return array


def _extra_tensors(ckpt: Checkpoint, used: set[str]) -> list[str]:
    lines = [f"{ckpt.source}: tensor {k!r} maps to no state input of the fused model; ignored" for k in ckpt.tensors if k not in used]
    lines += [f"{ckpt.source}: tensor {k + BUFFER_SUFFIX!r} is the buffer of no parameter the fused model updates; ignored" for k in ckpt.buffers if k not in used]
    return lines


def _stat_feeds(ckpt: Checkpoint, updates: list[UpdateState], mapped: list[MappedUpdate], feeds: dict[str, np.ndarray]) -> list[str]:
    """Feed (or check) how each update's ``stat`` is provided; returns warnings. Fills ``stat_fed``."""
    warnings: list[str] = []
    shared: dict[str, tuple[int, MappedUpdate]] = {}  # flag input → (stat it was fed for, first update)
    for update, entry in zip(updates, mapped):
        source = update.stat
        if source.kind == "zeros":
            if entry.stat == 1 and update.dampening != 0:
                raise CheckpointError(
                    ckpt.source, entry.checkpoint_name,
                    f"has no momentum buffer yet, so its next step is its first (which does not dampen), but SGD node {update.node!r} computes "
                    f"stat = 0 and dampens by {update.dampening:g} on every step: that first step cannot be expressed; "
                    "take the checkpoint after one more step, or export the step with a first-step condition as an input",
                )
            if entry.stat == 1 and update.gradient_scaling:
                raise CheckpointError(
                    ckpt.source, entry.checkpoint_name,
                    f"has no momentum buffer yet, so its next step is its first, which copies the gradient into the buffer, but SGD "
                    f"node {update.node!r} takes a scaled gradient ({update.gradient_scaling}: a dampening read into the gradient, "
                    "say); the first step's buffer would be the scaled one. Take the checkpoint after one more step, or export the "
                    "step with a first-step condition as an input",
                )
            # With dampening 0, stat has no effect: a zero buffer gives m*0 + grad = grad, the optimizers' first step.
            entry.stat_fed = source.describe() + ("; exact: zero buffer and dampening 0 give buf = grad" if entry.stat == 1 else "")
        elif source.kind == "input":
            spec_dtype = onnx_to_numpy_dtype(update.dtype)
            feeds[source.input] = np.full(feeds[update.parameters].shape, entry.stat, dtype=spec_dtype)
            entry.stat_fed = source.describe()
        elif source.kind in ("condition", "step"):
            if source.input in shared and shared[source.input][0] != entry.stat:
                other = shared[source.input][1]
                raise CheckpointError(
                    ckpt.source, entry.checkpoint_name,
                    f"stat {entry.stat} but {other.checkpoint_name!r} needs stat {other.stat}, and both take the first-step flag from the one input {source.input!r}",
                )
            shared.setdefault(source.input, (entry.stat, entry))
            feeds[source.input] = _flag_value(ckpt, update, entry)
            entry.stat_fed = f"{source.describe()}: fed {feeds[source.input].tolist()}"
        else:
            if entry.stat == 1:
                raise CheckpointError(
                    ckpt.source, entry.checkpoint_name,
                    f"has no momentum buffer (first step), but SGD node {update.node!r} has its stat {source.describe()}; "
                    "sgdfuse cannot make it 1 from a checkpoint",
                )
            entry.stat_fed = source.describe()
            warnings.append(f"{update.node}: stat is {source.describe()}; feed those inputs so that stat is 0 (not the first step)")
    return warnings


def _flag_value(ckpt: Checkpoint, update: UpdateState, entry: MappedUpdate) -> np.ndarray:
    """The value of a boolean first-step input or step counter that makes ``stat`` equal ``entry.stat``."""
    source = update.stat
    first = entry.stat == 1
    shape = _flag_shape(ckpt, source)
    if source.kind == "condition":
        return np.full(shape, first == source.when, dtype=np.bool_)
    truth = first == source.when  # what the comparison must give
    if not source.only_compared:
        if ckpt.step is None:
            raise CheckpointError(
                ckpt.source, source.input,
                f"the step counter {source.input!r} is read by more than the first-step test, and the checkpoint has no step count; feed it yourself",
            )
        if _holds(source.relation, ckpt.step, source.value) != truth:
            raise CheckpointError(ckpt.source, source.input, f"the checkpoint's step count {ckpt.step} contradicts its buffers for {entry.checkpoint_name!r}")
        value = ckpt.step
    else:
        # Only this comparison reads the counter: any value on the right side of it decides the flag alone.
        value = _counter_for(source.relation, source.value, truth)
    return np.full(shape, value, dtype=onnx_to_numpy_dtype(source.input_dtype))


def _flag_shape(ckpt: Checkpoint, source: StatSource) -> tuple[int, ...]:
    """The flag input's shape: a scalar or a tensor of static dims (every element gets the one value)."""
    if source.input_shape is None or not all(isinstance(d, int) for d in source.input_shape):
        raise CheckpointError(ckpt.source, source.input, "the first-step input has no static shape in the fused model; feed it yourself")
    return tuple(source.input_shape)


def _init_feeds(model: str | os.PathLike | onnx.ModelProto, soc: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GE init graph's ``Data`` inputs (``<state>/initial_value``) from the ONNX feeds."""
    from sgdfuse.lowering import lower

    lowered = lower(model, soc=soc)
    init: dict[str, np.ndarray] = {}
    for data_op, onnx_input in lowered.init_inputs.items():
        if onnx_input not in feeds:
            raise CheckpointError(str(model) if not isinstance(model, onnx.ModelProto) else "<ModelProto>", onnx_input,
                                  f"the GE init graph takes {data_op!r} from ONNX input {onnx_input!r}, which the checkpoint does not set")
        init[data_op] = feeds[onnx_input]
    return init
