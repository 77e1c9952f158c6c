"""Exception types of sgdfuse.

Every error carries the name of what it is about (a file, node, tensor or attribute) so that the one
line the CLI prints tells the user where to look and what to do.
"""

from __future__ import annotations

__all__ = [
    "SgdfuseError",
    "ModelLoadError",
    "OutputWriteError",
    "InvalidOutputError",
    "ContractError",
    "AttributeContractError",
    "ShapeContractError",
    "DtypeContractError",
    "ProductLineError",
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
    """A clause of the SGD operator contract (shared/SGD-OPERATOR.md) is broken.

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
