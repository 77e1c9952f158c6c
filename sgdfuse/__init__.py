"""sgdfuse: find unfused momentum-SGD updates in training graphs, fuse each into one ``SGD`` operator
(shared/SGD-OPERATOR.md), lower the result to the Ascend Graph Engine, and prove the numbers are the same.

Library API:
    :func:`optimize` — fuse the updates of an ONNX model (returns a new model and a report);
    :func:`inspect` — the same analysis with nothing rewritten.
"""

from __future__ import annotations

__version__ = "0.1.0"

from sgdfuse.errors import (  # noqa: E402
    ContractError,
    ModelLoadError,
    OutputWriteError,
    SgdfuseError,
)

__all__ = [
    "__version__",
    "SgdfuseError",
    "ContractError",
    "ModelLoadError",
    "OutputWriteError",
]
