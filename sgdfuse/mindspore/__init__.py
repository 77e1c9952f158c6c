"""sgdfuse for MindSpore: fuse ``mindspore.mint.optim.SGD`` updates into the ``SGD`` op.

Two entry points (docs/mindspore.md):

- :func:`register` -- inside MindSpore's compile pipeline: builds (first use, cached) and registers a C++
  custom pass plugin that rewrites every per-parameter ``mint.optim.SGD`` update of graphs compiled later.
- :func:`optimize_mindir` -- on MindIR files exported from a ``mint.optim.SGD`` train step; the rewrite is
  checked by running original and rewritten files with ``mindspore.load`` + ``nn.GraphCell``
  (:func:`check_mindir`).

Both report through :class:`sgdfuse.report.Report`. MindSpore is imported only when needed, so this
package imports without it.
"""

from __future__ import annotations

from sgdfuse.mindspore.errors import (
    MindIRCheckError,
    MindIRLoadError,
    MindSporeMissingError,
    PluginBuildError,
    PluginRegisterError,
)
from sgdfuse.mindspore.plugin import PASS_NAME, PluginBuild, Registration, build_plugin, paused, register

__all__ = [
    "PASS_NAME",
    "PluginBuild",
    "Registration",
    "build_plugin",
    "register",
    "paused",
    "optimize_mindir",
    "check_mindir",
    "load_mindir",
    "save_mindir",
    "MindIRCheckError",
    "MindIRLoadError",
    "MindSporeMissingError",
    "PluginBuildError",
    "PluginRegisterError",
]


def __getattr__(name: str):
    # The MindIR side needs MindSpore's protobuf module; import it on first use only.
    if name in ("optimize_mindir", "load_mindir", "save_mindir"):
        from sgdfuse.mindspore import mindir

        return getattr(mindir, name)
    if name == "check_mindir":
        from sgdfuse.mindspore.check import check_mindir

        return check_mindir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
