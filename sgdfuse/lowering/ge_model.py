"""The result of lowering: the step graph and the init graph as GE IR ``ModelDef`` messages.

- :attr:`GEModel.model` — the training step (``graph[0]``): ``Data`` ops for the runtime inputs (named as
  the ONNX graph inputs), ``Variable`` ops for the state, ``SGD`` ops updating it in place, and a
  ``NetOutput`` whose inputs are, in order, the ONNX graph's outputs. Written by :meth:`GEModel.save_air`
  as an ``.air`` file (a binary ``ModelDef``, what ATC reads with ``--framework=1``).
- :attr:`GEModel.init_model` — run once before the first step: ``Assign`` s every state variable its
  initial value (``Data`` ``<name>/initial_value`` for state that was an ONNX graph input, the initializer
  for state that was one, zeros for ``stat``). Written by :meth:`GEModel.save_init_air`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

from sgdfuse.output import OutputBatch, write_bytes

from sgdfuse.contract import ProductLine
from sgdfuse.report import Report
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering.atc_json import message_json_pieces, message_to_json
from sgdfuse.lowering.state import StateVariable

__all__ = ["GEModel", "write_atomically", "read_varint"]


class _ModelDef:
    """A :class:`GEModel` field holding a ``ModelDef``, which may be given as its serialised bytes: they are
    parsed when the field is first read, and written out as they are when it never is (a parsed 10,000-update
    step graph takes about 280 MB, its bytes 40 MB). The bytes must be canonical (fields in number order, map
    entries sorted by key, what protobuf's deterministic serialisation writes), as lowering writes them."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, instance, owner=None):
        if instance is None:
            raise AttributeError(self.slot[1:])  # no class-level default: the dataclass field stays required
        value = instance.__dict__[self.slot]
        if isinstance(value, bytes):
            message = ge_ir.ModelDef()
            message.ParseFromString(value)
            instance.__dict__[self.slot] = value = message
        return value

    def __set__(self, instance, value) -> None:
        instance.__dict__[self.slot] = value

    def wire(self, instance) -> bytes:
        """The field's canonical bytes, without parsing them when they were never read."""
        value = instance.__dict__[self.slot]
        return value if isinstance(value, bytes) else value.SerializeToString(deterministic=True)


def _first_graph(model_def: bytes) -> bytes:
    """The bytes of ``graph[0]`` in a serialised ``ModelDef``."""
    pos, end = 0, len(model_def)
    while pos < end:
        tag, pos = read_varint(model_def, pos)
        wire = tag & 7
        if wire == 2:
            length, pos = read_varint(model_def, pos)
            if tag >> 3 == _GRAPH_FIELD:
                return model_def[pos: pos + length]
            pos += length
        elif wire == 0:
            _, pos = read_varint(model_def, pos)
        else:
            pos += 8 if wire == 1 else 4
    return b""


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``data[pos]`` (base-128, least significant group first; protobuf's wire format)
    and the position after it."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


_GRAPH_FIELD = ge_ir.ModelDef.DESCRIPTOR.fields_by_name["graph"].number
_OP_FIELD = ge_ir.GraphDef.DESCRIPTOR.fields_by_name["op"].number


@dataclasses.dataclass
class GEModel:
    """A lowered model.

    Attributes:
        model: the step graph's ``ModelDef`` (may be given as its canonical bytes, parsed when first read).
        init_model: the init graph's ``ModelDef`` (likewise).
        soc: the ATC SoC version it was built for.
        product_line: that SoC's product line.
        inputs: ``Data`` op names of the step graph, in ``index`` order (the ONNX graph inputs that are not
            state). An op name is the ONNX name with ``:`` replaced (GE splits edges at ``:``) and made unique.
        input_names: ``Data`` op name → the ONNX graph input it takes (what :meth:`runner` is fed by).
        outputs: the ONNX graph output each ``NetOutput`` input stands for, in order.
        state: the state variables (see :mod:`sgdfuse.lowering.state`).
        init_inputs: init-graph ``Data`` op name → the ONNX graph input whose initial value it takes.
        sgd_ops: names of the GE ``SGD`` ops.
        optimization: when :func:`~sgdfuse.lowering.lower` optimised an unfused model first, that run's
            report (what fused, what was refused and why, whether verification ran); else None.
    """

    model: object = _ModelDef()
    init_model: object = _ModelDef()
    soc: str
    product_line: ProductLine
    inputs: list[str]
    outputs: list[str]
    state: list[StateVariable]
    init_inputs: dict[str, str]
    sgd_ops: list[str]
    optimization: Report | None = None
    input_names: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def graph(self):
        """The step ``GraphDef`` (``model.graph[0]``)."""
        return self.model.graph[0]

    def onnx_input(self, data_op: str) -> str:
        """The ONNX graph input a step-graph ``Data`` op takes."""
        return self.input_names.get(data_op, data_op)

    def op(self, name: str):
        """The step graph's ``OpDef`` called ``name``.

        Raises:
            KeyError: no such op.
        """
        for op in self.graph.op:
            if op.name == name:
                return op
        raise KeyError(name)

    def to_bytes(self) -> bytes:
        """The ``.air`` bytes: the serialised step ``ModelDef`` (deterministic: map entries sorted by key, so
        the same model always gives the same bytes)."""
        return GEModel.__dict__["model"].wire(self)

    def init_bytes(self) -> bytes:
        """The ``.init.air`` bytes: the serialised init ``ModelDef`` (deterministic)."""
        return GEModel.__dict__["init_model"].wire(self)

    def graph_bytes(self, *, init: bool = False) -> bytes:
        """The step (or init) ``GraphDef``'s canonical bytes, read without parsing the model when it was
        never parsed."""
        return _first_graph(self.init_bytes() if init else self.to_bytes())

    def op_count(self) -> int:
        """Ops in the step graph (counted in its bytes when the model was never parsed)."""
        if not isinstance(self.__dict__["_model"], bytes):
            return len(self.graph.op)
        data, pos, count = self.graph_bytes(), 0, 0
        size = len(data)
        while pos < size:
            # Every GraphDef field is length-delimited, with a one-byte tag (field numbers below 16); most lengths
            # take one or two bytes, read here without a call (the op fields of a 50,000-update graph: 313,000).
            tag = data[pos]
            if tag < 0x80 and pos + 2 < size:
                length = data[pos + 1]
                if length < 0x80:
                    pos += 2
                elif data[pos + 2] < 0x80:
                    length, pos = (length & 0x7F) | data[pos + 2] << 7, pos + 3
                else:
                    length, pos = read_varint(data, pos + 1)
            else:
                tag, pos = read_varint(data, pos)
                length, pos = read_varint(data, pos)
            count += tag >> 3 == _OP_FIELD
            pos += length
        return count

    def save_air(self, path: str | os.PathLike, *, batch: OutputBatch | None = None) -> None:
        """Write the step ``ModelDef`` to ``path`` atomically (temporary file, then ``os.replace``).

        Raises:
            OutputWriteError: the directory is missing or not writable; nothing is left at ``path``.
        """
        (batch.stage if batch is not None else write_atomically)(path, self.to_bytes())

    def save_init_air(self, path: str | os.PathLike, *, batch: OutputBatch | None = None) -> None:
        """Write the init ``ModelDef`` to ``path`` atomically."""
        (batch.stage if batch is not None else write_atomically)(path, self.init_bytes())

    def to_json(self, *, init: bool = False) -> str:
        """The step (or init) ``ModelDef`` as JSON in the layout of ``atc --mode=1``
        (:mod:`sgdfuse.lowering.atc_json`)."""
        return message_to_json(self.init_model if init else self.model)

    def json_pieces(self, *, init: bool = False) -> Iterator[str]:
        """:meth:`to_json`'s text in pieces (about one per op), for writing a large graph to a file
        (:func:`sgdfuse.lowering.atc_json.message_json_pieces`)."""
        return message_json_pieces(self.init_model if init else self.model)

    def runner(self, *, lifted: bool = False):
        """A :class:`~sgdfuse.lowering.executor.GEModelRunner` executing this model in numpy (with ``lifted``,
        every float value as DOUBLE)."""
        from sgdfuse.lowering.executor import GEModelRunner

        return GEModelRunner(self, lifted=lifted)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (:func:`sgdfuse.output.write_bytes`).

    Raises:
        OutputWriteError: the destination cannot be written; nothing is left at ``path``.
    """
    write_bytes(path, data)

