"""sgdfuse: find unfused momentum-SGD updates in training graphs, fuse each into one ``SGD`` operator
(docs/contract.md), lower the result to the Ascend Graph Engine, and prove the numbers are the same.

Library API:
    :func:`optimize` — fuse the updates of an ONNX model (returns a new model and a report);
    :func:`inspect` — the same analysis with nothing rewritten;
    :func:`checkpoint_feeds` — a PyTorch/MindSpore checkpoint as the fused model's state feeds.
"""

from __future__ import annotations

__version__ = "0.1.0"

from sgdfuse.errors import (  # noqa: E402
    CheckpointError,
    ContractError,
    ModelLoadError,
    OutputWriteError,
    SgdfuseError,
)
from sgdfuse.api import OptimizeResult, inspect, load_model, optimize, save_model  # noqa: E402
from sgdfuse.passes.sgd_match import RolePins  # noqa: E402
from sgdfuse.report import FusedUpdate, Refusal, Report, Verification  # noqa: E402
from sgdfuse.lowering import GEModel, lower  # noqa: E402
from sgdfuse.checkpoint import Checkpoint, StateFeeds, checkpoint_feeds, read_checkpoint  # noqa: E402

__all__ = [
    "__version__",
    "SgdfuseError",
    "ContractError",
    "ModelLoadError",
    "OutputWriteError",
    "optimize",
    "inspect",
    "load_model",
    "save_model",
    "OptimizeResult",
    "RolePins",
    "Report",
    "FusedUpdate",
    "Refusal",
    "Verification",
    "lower",
    "GEModel",
    "CheckpointError",
    "Checkpoint",
    "StateFeeds",
    "checkpoint_feeds",
    "read_checkpoint",
]
