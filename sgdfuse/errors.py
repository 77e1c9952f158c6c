"""Exception types of sgdfuse.

Every error carries the name of what it is about (a file, node, tensor or attribute) so that the one
line the CLI prints tells the user where to look and what to do.
"""

from __future__ import annotations

import os

__all__ = [
    "SgdfuseError",
    "ModelLoadError",
    "ExternalDataError",
    "ModelNameError",
    "GraphCycleError",
    "DuplicateValueError",
    "OutputWriteError",
    "InvalidOutputError",
    "ContractError",
    "AttributeContractError",
    "ShapeContractError",
    "DtypeContractError",
    "ProductLineError",
    "UnknownSocError",
    "CheckpointError",
    "RolePinError",
    "NativeBuildError",
]


class SgdfuseError(Exception):
    """Base class of every error sgdfuse raises on purpose."""


class ModelLoadError(SgdfuseError):
    """A model file is missing, unreadable, truncated or not an ONNX ``ModelProto``.

    Attributes:
        path: the file that could not be loaded.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class ExternalDataError(ModelLoadError):
    """A model names external tensor data that sgdfuse will not read: a location that is absolute or climbs
    out with ``..``, a link out of the model's directory, something that is not a regular file, or an offset
    or length past the end of the file (rules: :mod:`sgdfuse.external_data`).

    Attributes:
        path: the model file. tensor: the tensor's name. location: the location as the model gives it.
    """

    def __init__(self, path: str, tensor: str, location: str, reason: str) -> None:
        super().__init__(
            path,
            f"tensor {tensor!r}: external data location {location!r} {reason}; refused: sgdfuse reads external "
            "data only from regular files inside the model's directory",
        )
        self.tensor = tensor
        self.location = location


class ModelNameError(SgdfuseError):
    """A name in the model (of a value a node reads or writes, a graph input or output, a value info, an
    initializer) is not valid UTF-8. ONNX names are protobuf ``string`` fields (onnx/onnx.proto), which hold
    UTF-8 text; protobuf hands such a field out as ``bytes``, which equals no other name in the graph.

    Attributes:
        name: the raw bytes of the name. where: what carries it (e.g. ``"an output of node 'Mul_3'"``).
        path: the model file, when known ("" otherwise).
    """

    def __init__(self, name: bytes, where: str, path: str = "") -> None:
        self.name, self.where, self.path = name, where, path
        super().__init__(
            (f"{path}: " if path else "")
            + f"{where} ({name!r}) is not valid UTF-8 (ONNX's names and strings are UTF-8 text); rename it in the "
            "exporter or with onnx's Python API, and run again"
        )

    def in_file(self, path: str | os.PathLike) -> "ModelNameError":
        """The same error naming the model file ``path``."""
        return ModelNameError(self.name, self.where, os.fspath(path))


class GraphCycleError(SgdfuseError):
    """The graph's nodes form a cycle: a value is computed, through other nodes, from itself. ONNX graphs are
    acyclic (IR spec, "Graphs": nodes are topologically sortable), so no runtime can run the model.

    Attributes:
        value: a value on the cycle.
    """

    def __init__(self, value: str) -> None:
        super().__init__(
            f"the graph has a cycle: {value} is computed from itself through other nodes; an ONNX graph must be "
            "acyclic (no runtime can run this model): fix the model or the exporter that wrote it"
        )
        self.value = value


class DuplicateValueError(SgdfuseError):
    """Two nodes output the same value. ONNX graphs define each value once (IR spec: static single
    assignment), so which one a reader sees is undefined, and onnxruntime refuses the model.

    Attributes:
        value: the value defined twice. first, second: the two nodes (name, or position and op type).
    """

    def __init__(self, value: str, first: str, second: str) -> None:
        super().__init__(
            f"the value {value} is the output of two nodes ({first} and {second}); an ONNX graph defines each value "
            "once: rename one of them"
        )
        self.value, self.first, self.second = value, first, second


class OutputWriteError(SgdfuseError):
    """An output file could not be written; nothing was left at the destination.

    Attributes:
        path: the destination that could not be written.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class InvalidOutputError(SgdfuseError):
    """A model sgdfuse made fails ``onnx.checker``; it is not written (the final guard before any write)."""


class ContractError(SgdfuseError):
    """A clause of the SGD operator contract (docs/contract.md) is broken.

    Attributes:
        clause: short name of the contract clause, e.g. ``"nesterov requires dampening == 0"``.
        subject: the tensor, attribute or node the violation is about.
    """

    def __init__(self, clause: str, subject: str, message: str) -> None:
        super().__init__(f"{subject}: {message} (contract: {clause})")
        self.clause = clause
        self.subject = subject


class AttributeContractError(ContractError):
    """An attribute (``dampening``, ``weight_decay``, ``nesterov``) breaks the contract."""


class ShapeContractError(ContractError):
    """A tensor's shape breaks the contract (rank 1..8, not empty, same shape as ``parameters``,
    exactly one element for ``learning_rate`` and ``momentum``)."""


class DtypeContractError(ContractError):
    """A tensor's element type breaks the contract (FLOAT/FLOAT16/BFLOAT16, all the same)."""


class ProductLineError(ContractError):
    """A model breaks the limits of the Ascend product line chosen by ``--soc``."""


class UnknownSocError(ProductLineError):
    """``--soc`` names no known Ascend SoC version.

    The message is one line (with the nearest known spellings, when there are any) followed by the accepted
    SoC versions, one product line per indented line.

    Attributes:
        soc: the string given.
        suggestions: the nearest known spellings, best first (may be empty).
    """

    def __init__(self, soc: str, suggestions: list[str], accepted: list[str]) -> None:
        hint = f"; did you mean {' or '.join(suggestions)}?" if suggestions else ""
        text = f"--soc {soc}: unknown SoC version{hint} (spelling is not case-sensitive); accepted:\n" + "\n".join(
            f"  {line}" for line in accepted
        )
        SgdfuseError.__init__(self, text)
        self.clause = "known SoC version"
        self.subject = f"--soc {soc}"
        self.soc = soc
        self.suggestions = list(suggestions)


class CheckpointError(SgdfuseError):
    """A checkpoint does not fit the fused model it is mapped onto (a missing parameter, a shape or dtype
    mismatch, a first step the model cannot express), or cannot be read; nothing is written.

    Attributes:
        path: the checkpoint file. tensor: the tensor the message is about ("" when about the whole file).
    """

    def __init__(self, path: str, tensor: str, message: str) -> None:
        super().__init__(f"{path}: {'tensor ' + repr(tensor) + ': ' if tensor else ''}{message}")
        self.path = path
        self.tensor = tensor


class RolePinError(SgdfuseError):
    """A role pin (``--state NEW=OLD``, ``--buffers GLOB``, ``RolePins``) names nothing in the model: a graph
    output or input that does not exist, or a glob that matches no graph input.

    Attributes:
        pin: the pin as given.
    """

    def __init__(self, pin: str, message: str) -> None:
        super().__init__(f"{pin}: {message}")
        self.pin = pin


class NativeBuildError(SgdfuseError):
    """A C++ library that sgdfuse builds on first use (:mod:`sgdfuse.native`) could not be built.

    Attributes:
        reason: ``"no-compiler"``, ``"no-headers"`` or ``"compile-failed"``.
        log: the compiler's output (empty unless the compiler ran).
    """

    def __init__(self, reason: str, message: str, log: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.log = log
