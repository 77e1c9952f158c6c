"""The library API: :func:`optimize` and :func:`inspect` on ONNX models, and model file I/O.

Flow (shared/DESIGN.md): load → index → find candidates → match → check → plan → verify → rewrite → save.
A pass is a function from a model to a new model plus a report; the input model is never mutated, and an
output file is written whole or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
import os
import shutil

import onnx
from google.protobuf.message import DecodeError

from sgdfuse.errors import ModelLoadError, OutputWriteError
from sgdfuse.output import OutputBatch, resolve_destination, write_bytes
from sgdfuse.fused_op import MIN_OPSET, function_opset
from sgdfuse.passes.index import build_index
from sgdfuse.passes.linear import Normaliser
from sgdfuse.passes.onnx_momentum import TRAINING_DOMAIN, convert_momentum_nodes
from sgdfuse.passes import traffic
from sgdfuse.passes.rewrite import Planner, apply_plans, describe_scalar, shortest_float32
from sgdfuse.passes.sgd_match import Match, Miss, find_updates
from sgdfuse.report import FusedUpdate, Refusal, Report, Verification
from sgdfuse.contract import dtype_name
from sgdfuse import verify as verification

__all__ = ["OptimizeResult", "optimize", "inspect", "load_model", "save_model"]

logger = logging.getLogger(__name__)


def load_model(path: str | os.PathLike, *, load_external_data: bool = False) -> onnx.ModelProto:
    """Read an ONNX model file.

    Tensor data stored outside the file (ONNX external data, ``TensorProto.data_location == EXTERNAL``) is
    left on disk unless ``load_external_data``: the pass reads only shapes and small scalars, so a model far
    past protobuf's 2 GB limit costs no more memory than its graph. Every external file is checked to exist.

    Raises:
        ModelLoadError: the file is missing, unreadable, empty, truncated or not an ONNX ``ModelProto``, or an
            external data file it references is missing.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "no such file")
    if os.path.isdir(path):
        raise ModelLoadError(path, "is a directory, not an ONNX model file")
    try:
        model = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeWarning) as error:
        raise ModelLoadError(path, f"not an ONNX model, or truncated (protobuf parse failed: {error})") from error
    except OSError as error:
        raise ModelLoadError(path, f"cannot read: {error.strerror or error}") from error
    except Exception as error:  # onnx raises ValueError/RuntimeError for malformed files
        raise ModelLoadError(path, f"cannot load: {error}") from error
    if not model.HasField("graph") or model.ir_version == 0:
        raise ModelLoadError(path, "not an ONNX model (no graph or no IR version); is this the right file?")
    if not model.opset_import:
        # Every exporter writes opset_import, after the graph: a model without one is truncated or broken.
        raise ModelLoadError(path, "the model declares no opset_import; the file is truncated or not a complete ONNX model")
    base = os.path.dirname(os.path.abspath(path))
    for tensor in _external_tensors(model):
        location = _external_location(tensor)
        if not os.path.isfile(os.path.join(base, location)):
            raise ModelLoadError(
                path,
                f"external data file {location!r} of tensor {tensor.name!r} is missing (looked in {base}); "
                "keep the data files beside the model",
            )
    if load_external_data:
        try:
            onnx.load_external_data_for_model(model, base)
        except Exception as error:
            raise ModelLoadError(path, f"cannot read external data: {error}") from error
    return model


def _external_tensors(model: onnx.ModelProto):
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_location == onnx.TensorProto.EXTERNAL:
                yield attribute.t


def _external_location(tensor: onnx.TensorProto) -> str:
    for entry in tensor.external_data:
        if entry.key == "location":
            return entry.value
    return ""


def save_model(
    model: onnx.ModelProto, path: str | os.PathLike, *, source_dir: str | None = None, batch: OutputBatch | None = None
) -> None:
    """Write ``model`` to ``path`` whole or not at all (see :mod:`sgdfuse.output`).

    Tensors whose data is external keep their ``location``; when the model is written to another directory
    than ``source_dir`` (the one it was read from), each data file is copied there first, since ONNX resolves
    external data only inside the model's directory (and refuses hard links). An existing different file at a
    data file's destination is never overwritten.

    Args:
        batch: stage the file in this :class:`~sgdfuse.output.OutputBatch` (committed by the caller together
            with other outputs) instead of writing it now.

    Raises:
        OutputWriteError: the destination cannot be written (missing directory, a directory, a device), a
            data file's destination is taken by another file, or a write failed.
    """
    target = resolve_destination(path)
    directory = os.path.dirname(target)
    if source_dir and os.path.abspath(source_dir) != directory:
        locations = sorted({_external_location(t) for t in _external_tensors(model)})
        for location in locations:
            _place_data_file(os.path.join(source_dir, location), os.path.join(directory, location), os.fspath(path))
    data = model.SerializeToString()
    if batch is not None:
        batch.stage(path, data)
    else:
        write_bytes(path, data)


def _place_data_file(source: str, destination: str, model_path: str) -> None:
    """Make ``destination`` hold the external data file ``source``: a copy written to a temporary name, then
    renamed (the kernel copies it; the bytes never pass through Python)."""
    if os.path.exists(destination):
        if os.path.samefile(source, destination) or _same_bytes(source, destination):
            return
        raise OutputWriteError(
            model_path, f"external data file {destination} already exists with other contents; write the model elsewhere"
        )
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    # A copy, not a link: onnx refuses external data outside the model's directory and files with several
    # hard links (its hardlink-attack check), so the written model would not load.
    temporary = destination + ".sgdfuse-tmp"
    try:
        shutil.copyfile(source, temporary)
        os.replace(temporary, destination)
    except OSError as error:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise OutputWriteError(model_path, f"cannot place external data file {destination}: {error.strerror or error}") from error


def _same_bytes(a: str, b: str) -> bool:
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as x, open(b, "rb") as y:
        while True:
            chunk = x.read(1 << 20)
            if chunk != y.read(1 << 20):
                return False
            if not chunk:
                return True


@dataclasses.dataclass
class OptimizeResult:
    """The outcome of :func:`optimize`.

    Attributes:
        model: the new ``ModelProto`` (the input model is untouched).
        report: what was fused, refused and verified.
    """

    model: onnx.ModelProto
    report: Report
    source_dir: str | None = None
    """Directory the input was read from: external data locations are relative to it."""

    def save(self, path: str | os.PathLike, *, batch: OutputBatch | None = None) -> None:
        """Write :attr:`model` to ``path`` whole or not at all, external data placed beside it (see
        :func:`save_model`); with ``batch``, staged there for the caller to commit."""
        save_model(self.model, path, source_dir=self.source_dir, batch=batch)


def _as_model(model: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str, str | None]:
    if isinstance(model, onnx.ModelProto):
        return model, "<ModelProto>", None
    return load_model(model), os.fspath(model), os.path.dirname(os.path.abspath(os.fspath(model)))


def optimize(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    verify: bool = True,
    steps: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> OptimizeResult:
    """Fuse every momentum-SGD update of an ONNX model into ``ai.sgdfuse::SGD`` nodes.

    Args:
        model: a path to an ``.onnx`` file or a ``ModelProto`` (never mutated).
        verify: run each rewrite's slice before and after in onnxruntime for ``steps`` chained steps and
            drop (and report) any update whose numbers differ beyond the derived bound
            (:mod:`sgdfuse.verify`).
        steps: chained steps of the check (at least 1).
        seed: seed of the check's random inputs.
        progress: called with the name of each stage as it starts (``"load"``, ``"index"``, ``"match"``,
            ``"verify"``, ``"rewrite"``), for progress display.

    Returns:
        :class:`OptimizeResult` with the new model and the report.

    Raises:
        ModelLoadError: ``model`` is a path that cannot be loaded as ONNX.
    """
    tell = progress or (lambda stage: None)
    tell("load")
    source_model, source, source_dir = _as_model(model)
    report, plans, index, base = _analyse(source_model, source, verify=verify, steps=steps, seed=seed, tell=tell)
    tell("rewrite")
    new_model = apply_plans(base, index, plans)
    report.nodes_after = len(new_model.graph.node)
    return OptimizeResult(new_model, report, source_dir)


def inspect(model: str | os.PathLike | onnx.ModelProto, *, verify: bool = False, steps: int = 3, seed: int = 0) -> Report:
    """The analysis of :func:`optimize` with nothing rewritten (a dry run): which updates would fuse,
    which candidates are refused and why. ``verify`` runs the differential check as well."""
    source_model, source, _ = _as_model(model)
    report, plans, _, _ = _analyse(source_model, source, verify=verify, steps=steps, seed=seed)
    report.written = False
    report.nodes_after = report.nodes_before
    return report


def _analyse(model: onnx.ModelProto, source: str, *, verify: bool, steps: int, seed: int, tell: Callable[[str], None] = lambda stage: None):
    """Returns (report, plans, index, base): ``base`` is the model the plans apply to (``model`` with any
    ONNX ``Momentum`` nodes already converted)."""
    report = Report(source=source, nodes_before=len(model.graph.node))
    report.already_fused = sum(1 for n in model.graph.node if n.domain == "ai.sgdfuse")
    report.verification = Verification(enabled=verify, steps=steps if verify else 0, tolerance=_tolerance_text())
    misses: list[Miss] = []

    base = model
    tell("index")
    index = build_index(model)
    if any(n.op_type == "Momentum" and n.domain == TRAINING_DOMAIN for n in model.graph.node):
        base, conversions, momentum_misses = convert_momentum_nodes(model, index, verify=verify, steps=steps, seed=seed)
        misses.extend(momentum_misses)
        for c in conversions:
            report.fused.append(_momentum_entry(c))
            if verify:
                report.verification.updates.append(
                    {"parameters_out": c.parameters_out, "steps": steps, "passed": True, "max_abs_error": c.max_abs_error,
                     "max_bound_ratio": None, "message": "original run with onnx.reference.ReferenceEvaluator"}
                )
        if conversions:
            index = build_index(base)

    tell("match")
    normaliser = Normaliser(index)
    matches, found_misses = find_updates(index, normaliser)
    misses.extend(found_misses)

    opset = function_opset(base)
    if matches and opset < MIN_OPSET:
        for match in matches:
            misses.append(
                Miss(
                    match.parameters_out,
                    "opset",
                    f"the model imports default-domain opset {opset}; the fused op's function needs >= {MIN_OPSET} "
                    "(CastLike). Re-export with a newer opset.",
                )
            )
        matches = []

    planner = Planner(index, opset)
    plans = [planner.plan(match) for match in matches]
    if verify and plans:
        tell("verify")
        checks = verification.verify_plans(base, index, plans, steps=steps, seed=seed)
        kept = []
        for plan, check in zip(plans, checks):
            report.verification.updates.append(dataclasses.asdict(check))
            if check.passed:
                kept.append(plan)
            else:
                misses.append(Miss(plan.match.parameters_out, "verification-failed", check.message))
        plans = kept

    for plan in plans:
        report.fused.append(_fused_entry(plan, index))
        if plan.match.maximize:
            report.added_state.append(
                {"name": plan.gradient_input, "what": f"Neg({plan.match.gradient}): maximize feeds the negated gradient", "initial": "-"}
            )
    report.refused = [Refusal(m.candidate, m.reason, m.detail, str(m.equation), m.nearest, m.differing) for m in misses]
    return report, plans, index, base


def _momentum_entry(c) -> FusedUpdate:
    return FusedUpdate(
        node=c.sgd_node,
        parameters=c.parameters,
        gradient=c.gradient,
        accum=c.accum,
        parameters_out=c.parameters_out,
        accum_out=c.accum_out,
        learning_rate=c.learning_rate,
        momentum=shortest_float32(c.momentum),
        learning_rate_input=c.learning_rate,
        momentum_input="",
        dampening=shortest_float32(c.dampening),
        weight_decay=shortest_float32(c.weight_decay),
        nesterov=c.nesterov,
        maximize=False,
        stat=f"1 where {c.step_count} <= 0 (ONNX Momentum's first step: beta_adjusted = 1), else 0",
        dtype=dtype_name(c.dtype),
        shape=list(c.shape) if c.shape is not None else [],
        parameter_equation=f"converted from ai.onnx.preview.training::Momentum node {c.node}",
        accum_equation="",
        source="onnx-momentum",
    )


def _fused_entry(plan, index) -> FusedUpdate:
    match: Match = plan.match
    after = traffic.fused_traffic(index, match.parameters, traffic.helper_passes([n.op_type for n in plan.nodes]))
    return FusedUpdate(
        traffic_before_bytes=traffic.cone_traffic(index, match.nodes),
        traffic_after_bytes=after,
        node=plan.sgd_node.name,
        parameters=match.parameters,
        gradient=match.gradient,
        accum=match.accum,
        parameters_out=match.parameters_out,
        accum_out=match.accum_out,
        learning_rate=describe_scalar(match.learning_rate),
        momentum=describe_scalar(match.momentum),
        learning_rate_input=plan.learning_rate_input,
        momentum_input=plan.momentum_input,
        dampening=shortest_float32(match.dampening),
        weight_decay=shortest_float32(match.weight_decay),
        nesterov=bool(match.nesterov),
        maximize=bool(match.maximize),
        stat=plan.stat,
        dtype=dtype_name(match.dtype),
        shape=[d for d in match.shape] if match.shape is not None else [],
        parameter_equation=str(match.parameter_equation),
        accum_equation=str(match.accum_equation),
        matched_nodes=len(match.nodes),
        source="pattern" if match.first_step is None else "pattern with first-step Where",
    )


def _tolerance_text() -> str:
    return (
        f"per element and step, natively and lifted to DOUBLE, state carried in place: each coefficient within "
        f"{verification.COEFFICIENT_ROUNDINGS} roundings of its storage type relative to itself, applied to the "
        "error-free terms of the update; plus the propagation of state differences already checked; plus, natively, "
        f"2*{verification.OPERATIONS}*u*S (u the unit roundoff of the parameters' dtype, S the magnitudes of the terms "
        "either side forms) (see sgdfuse.verify)"
    )
