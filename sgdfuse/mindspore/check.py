"""Run an original and a rewritten MindIR train step side by side and compare every output and Parameter.

Both files are loaded with ``mindspore.load`` and run with ``nn.GraphCell`` (which updates the Parameters in
place, as a train step does) for several chained steps on the same seeded inputs. After every step each
output and each Parameter of the two cells is compared element by element:
``|rewritten - original| <= atol + rtol * |original|`` with ``rtol=1e-5, atol=1e-6`` (both sides do the same
FLOAT operations, only their rounding order may differ; a wrong dampening, first step or learning rate is
off by orders of magnitude more). Integer values (the step counter) must be equal.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from sgdfuse.mindspore.errors import MindIRCheckError, MindSporeMissingError

__all__ = ["CheckResult", "check_mindir", "RTOL", "ATOL"]

RTOL = 1e-5
ATOL = 1e-6
# mind_ir TensorProto.DataType -> numpy dtype, for the graph inputs the check has to make.
_NUMPY = {1: np.float32, 10: np.float16, 11: np.float64, 17: np.float64, 6: np.int32, 7: np.int64, 9: np.bool_, 2: np.uint8}


@dataclasses.dataclass
class CheckResult:
    """What :func:`check_mindir` found.

    Attributes:
        steps: chained steps run.
        values: per output and Parameter: ``{"name", "kind", "passed", "max_abs_error", "max_bound_ratio",
            "message"}`` (worst over the steps).
    """

    steps: int
    values: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        return all(v["passed"] for v in self.values)


def _as_file(model: Any, directory: Path, name: str) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    path = directory / name
    path.write_bytes(model if isinstance(model, (bytes, bytearray)) else model.SerializeToString())
    return str(path)


def _inputs(model_path: str, steps: int, seed: int) -> list[list[np.ndarray]]:
    from sgdfuse.mindspore.mindir import load_mindir

    model, _ = load_mindir(model_path)
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        batch = []
        for spec in model.graph.input:
            dtype = _NUMPY.get(spec.tensor[0].data_type) if spec.tensor else None
            if dtype is None:
                raise MindIRCheckError(f"{model_path}: input {spec.name} has a type the check cannot make")
            dims = list(spec.tensor[0].dims)
            if any(d < 0 for d in dims):
                raise MindIRCheckError(f"{model_path}: input {spec.name} has a dynamic shape {dims}; pass concrete inputs")
            if np.issubdtype(dtype, np.floating):
                batch.append(rng.standard_normal(dims).astype(dtype))
            else:
                batch.append(rng.integers(0, 2, size=dims).astype(dtype))
        batches.append(batch)
    return batches


def _compare(name: str, kind: str, a: np.ndarray, b: np.ndarray, worst: dict[str, dict]) -> None:
    entry = worst.setdefault(name, {"name": name, "kind": kind, "passed": True, "max_abs_error": 0.0, "max_bound_ratio": 0.0, "message": ""})
    if a.shape != b.shape or a.dtype != b.dtype:
        entry.update(passed=False, message=f"shape/dtype {b.shape} {b.dtype} != {a.shape} {a.dtype}")
        return
    if not np.issubdtype(a.dtype, np.floating):
        if not np.array_equal(a, b):
            entry.update(passed=False, message="integer values differ")
        return
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    same_nonfinite = (np.isnan(a64) & np.isnan(b64)) | (np.isinf(a64) & (a64 == b64))
    error = np.where(same_nonfinite, 0.0, np.abs(b64 - a64))
    ratio = error / (ATOL + RTOL * np.abs(a64))
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    if error.size:
        entry["max_abs_error"] = max(entry["max_abs_error"], float(np.nanmax(np.where(np.isnan(error), np.inf, error))))
        entry["max_bound_ratio"] = max(entry["max_bound_ratio"], float(ratio.max()))
    if entry["max_bound_ratio"] > 1.0 and entry["passed"]:
        entry.update(passed=False, message=f"differs by {entry['max_abs_error']:.3g} (> atol {ATOL} + rtol {RTOL} * |value|)")


def check_mindir(original: Any, rewritten: Any, *, steps: int = 3, seed: int = 0) -> CheckResult:
    """Run both models (paths, bytes or ``mind_ir_pb2.ModelProto``) for ``steps`` chained steps and compare.

    Raises:
        MindSporeMissingError: MindSpore is not installed.
        MindIRCheckError: a model cannot be loaded or run, or the two have different Parameters or outputs.
        ExternalDataError: a file names a data file sgdfuse refuses to read (:mod:`sgdfuse.external_data`).
    """
    try:
        import mindspore as ms
        from mindspore import nn
    except ImportError as error:
        raise MindSporeMissingError(f"the MindIR check runs MindSpore, which cannot be imported: {error}") from error
    if steps < 1:
        raise ValueError("steps must be >= 1")
    from sgdfuse.mindspore.mindir import load_mindir
    from sgdfuse.mindspore.plugin import paused

    # Were the registered custom pass to run when GraphCell compiles the *original* file, the check would
    # compare the rewrite with itself. MindSpore 2.10 runs no FULL_GRAPH pass there (seen: no pass record);
    # pause it anyway so that no later version can make the check vacuous.
    with paused(), tempfile.TemporaryDirectory(prefix="sgdfuse-mindir-check-") as tmp:
        directory = Path(tmp)
        paths = [_as_file(original, directory, "original.mindir"), _as_file(rewritten, directory, "rewritten.mindir")]
        load_mindir(paths[1])  # its data file locations are checked before MindSpore reads them (paths[0]: below)
        batches = _inputs(paths[0], steps, seed)
        cells = []
        for path in paths:
            try:
                cells.append(nn.GraphCell(ms.load(path)))
            except Exception as error:  # MindSpore raises RuntimeError/ValueError with its own message
                raise MindIRCheckError(f"{path}: mindspore.load + nn.GraphCell failed: {error}") from error
        names = [sorted(p.name for p in cell.get_parameters()) for cell in cells]
        if names[0] != names[1]:
            raise MindIRCheckError(f"the models hold different Parameters: {sorted(set(names[0]) ^ set(names[1]))}")
        worst: dict[str, dict] = {}
        for batch in batches:
            outputs = []
            for path, cell in zip(paths, cells):
                try:
                    out = cell(*[ms.Tensor(x) for x in batch])
                except Exception as error:
                    raise MindIRCheckError(f"{path}: running the graph failed: {error}") from error
                outputs.append(out if isinstance(out, (tuple, list)) else (out,))
            if len(outputs[0]) != len(outputs[1]):
                raise MindIRCheckError("the models return different numbers of outputs")
            for i, (a, b) in enumerate(zip(*outputs)):
                _compare(f"output {i}", "output", a.asnumpy(), b.asnumpy(), worst)
            params = [{p.name: p.asnumpy() for p in cell.get_parameters()} for cell in cells]
            for name in names[0]:
                _compare(name, "parameter", params[0][name], params[1][name], worst)
        return CheckResult(steps, list(worst.values()))
