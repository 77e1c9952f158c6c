"""Exception types of the MindSpore side. All derive from :class:`sgdfuse.errors.SgdfuseError`, so the CLI
prints them as one line and exits 1."""

from __future__ import annotations

from sgdfuse.errors import ModelLoadError, NativeBuildError, SgdfuseError

__all__ = [
    "MindSporeMissingError",
    "PluginBuildError",
    "PluginRegisterError",
    "MindIRLoadError",
    "MindIRCheckError",
]


class MindSporeMissingError(SgdfuseError):
    """MindSpore is not importable here (install ``sgdfuse[mindspore]``)."""


class PluginBuildError(NativeBuildError):
    """The custom pass plugin could not be built.

    Attributes:
        reason: ``"no-compiler"``, ``"no-headers"`` or ``"compile-failed"``.
        log: the compiler's output (empty unless the compiler ran).
    """


class PluginRegisterError(SgdfuseError):
    """``mindspore.graph.register_custom_pass`` refused the built plugin."""


class MindIRLoadError(ModelLoadError):
    """A file is missing, unreadable, or not a MindIR ``ModelProto``."""


class MindIRCheckError(SgdfuseError):
    """The original and rewritten MindIR files could not be run side by side (not a numeric mismatch: that
    is reported in the :class:`~sgdfuse.report.Verification` of the result)."""
