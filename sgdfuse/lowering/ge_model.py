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

from sgdfuse.output import OutputBatch, write_bytes

from sgdfuse.contract import ProductLine
from sgdfuse.report import Report
from sgdfuse.lowering.atc_json import message_to_json
from sgdfuse.lowering.state import StateVariable

__all__ = ["GEModel", "write_atomically"]


@dataclasses.dataclass
class GEModel:
    """A lowered model.

    Attributes:
        model: the step graph's ``ModelDef``.
        init_model: the init graph's ``ModelDef``.
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

    model: object
    init_model: object
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
        return self.model.SerializeToString(deterministic=True)

    def save_air(self, path: str | os.PathLike, *, batch: OutputBatch | None = None) -> None:
        """Write the step ``ModelDef`` to ``path`` atomically (temporary file, then ``os.replace``).

        Raises:
            OutputWriteError: the directory is missing or not writable; nothing is left at ``path``.
        """
        (batch.stage if batch is not None else write_atomically)(path, self.to_bytes())

    def save_init_air(self, path: str | os.PathLike, *, batch: OutputBatch | None = None) -> None:
        """Write the init ``ModelDef`` to ``path`` atomically."""
        (batch.stage if batch is not None else write_atomically)(path, self.init_model.SerializeToString(deterministic=True))

    def to_json(self, *, init: bool = False) -> str:
        """The step (or init) ``ModelDef`` as JSON in the layout of ``atc --mode=1``
        (:mod:`sgdfuse.lowering.atc_json`)."""
        return message_to_json(self.init_model if init else self.model)

    def runner(self):
        """A :class:`~sgdfuse.lowering.executor.GEModelRunner` executing this model in numpy."""
        from sgdfuse.lowering.executor import GEModelRunner

        return GEModelRunner(self)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (:func:`sgdfuse.output.write_bytes`).

    Raises:
        OutputWriteError: the destination cannot be written; nothing is left at ``path``.
    """
    write_bytes(path, data)

