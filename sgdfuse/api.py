"""The library API: :func:`optimize` and :func:`inspect` on ONNX models, and model file I/O.

Flow (docs/design.md): load → index → find candidates → match → check → plan → verify → rewrite → save.
A pass is a function from a model to a new model plus a report; the input model is never mutated, and an
output file is written whole or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
import os

import onnx
from google.protobuf.message import DecodeError

from sgdfuse import collector
from sgdfuse import external_data
from sgdfuse import runtime
from sgdfuse.errors import InvalidOutputError, ModelLoadError, ModelNameError
from sgdfuse.output import OutputBatch, resolve_destination
from sgdfuse.fused_op import INPUT_NAMES, MIN_OPSET, function_opset, read_sgd_attributes
from sgdfuse.passes.index import build_index
from sgdfuse.passes.linear import Normaliser
from sgdfuse.passes.onnx_momentum import TRAINING_DOMAIN, convert_momentum_nodes
from sgdfuse.passes import output_check, traffic
from sgdfuse.passes.rewrite import Planner, apply_plans, describe_scalar, shortest_float32
from sgdfuse.passes.sgd_match import MEMO_CHECK_ENV, Match, Miss, RolePins, find_updates
from sgdfuse.report import FusedUpdate, Refusal, Report, Verification
from sgdfuse.contract import dtype_name
from sgdfuse import verify as verification

__all__ = ["OptimizeResult", "optimize", "inspect", "load_model", "save_model"]

logger = logging.getLogger(__name__)


def load_model(path: str | os.PathLike, *, load_external_data: bool = False) -> onnx.ModelProto:
    """Read an ONNX model file.

    Tensor data stored outside the file (ONNX external data, ``TensorProto.data_location == EXTERNAL``) is
    left on disk unless ``load_external_data``: the pass reads only shapes and small scalars, so a model far
    past protobuf's 2 GB limit costs no more memory than its graph. Every external location is untrusted and
    checked first (:mod:`sgdfuse.external_data`): a relative path to a regular file inside the model's
    directory, offset and length within the file; with ``load_external_data`` the bytes are read through
    the same checked path.

    Raises:
        ModelLoadError: the file is missing, unreadable, empty, truncated or not an ONNX ``ModelProto``, or an
            external data file it references is missing.
        ExternalDataError: an external data location is refused (absolute, ``..``, a link out of the model's
            directory, not a regular file, offset or length past the end of the file); nothing is read.
    """
    return _load(path, load_external_data)[0]


def _load(path: str | os.PathLike, load_external_data: bool) -> tuple[onnx.ModelProto, bool]:
    """:func:`load_model`, and whether the file may hold external data
    (:func:`sgdfuse.external_data.may_hold_external_data`; False: the checks were skipped, there is nothing
    external to check)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "no such file")
    if os.path.isdir(path):
        raise ModelLoadError(path, "is a directory, not an ONNX model file")
    try:
        # The bytes are read once: the same bytes are parsed and searched for external data markers.
        with open(path, "rb") as handle:
            content = handle.read()
        # As onnx.load: the serialisation format from the file's extension, protobuf by default.
        serialization_format = onnx.serialization.registry.get_format_from_file_extension(os.path.splitext(path)[1]) or "protobuf"
        # Only protobuf's binary format writes every string and enum one way; a text format can spell them
        # otherwise (JSON escapes, enum numbers), so such a model is always walked.
        external = serialization_format != "protobuf" or external_data.may_hold_external_data(content)
        model = onnx.load_model_from_string(content, format=serialization_format)
        del content
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
    if external:
        # Locations inside a model are untrusted: every one is checked before any data file is opened.
        checked = external_data.check_model(model, path)
        if load_external_data:
            external_data.load_external_data(model, path, checked=checked)
    return model, external


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    source_dir: str | None = None,
    batch: OutputBatch | None = None,
    source: str | None = None,
    has_external_data: bool = True,
) -> None:
    """Write ``model`` to ``path`` whole or not at all (see :mod:`sgdfuse.output`).

    Tensors whose data is external keep their ``location`` (normalised: ``/``-separated, no ``.`` parts);
    when the model is written to another directory than ``source_dir`` (the one it was read from), each data
    file is copied there, into the output's directory and never outside it, since ONNX resolves external
    data only inside the model's directory (and refuses hard links). Data files are written in the same
    batch as the model: all or nothing. An existing different file at a data file's destination is never
    overwritten, and no symbolic link is followed there (:func:`sgdfuse.external_data.copy_data_files`).

    Args:
        batch: stage the files in this :class:`~sgdfuse.output.OutputBatch` (committed by the caller together
            with other outputs) instead of writing them now.
        source: the model file it was read from, for messages (default: the directory).
        has_external_data: False when the caller knows ``model`` holds no tensor with external data (then its
            tensors are not walked).

    Raises:
        ExternalDataError: an external data location is absolute, climbs out with ``..``, or (with
            ``source_dir``) breaks another rule of :mod:`sgdfuse.external_data`.
        OutputWriteError: the destination cannot be written (missing directory, a directory, a device), a
            data file's destination is taken by another file, or a write failed.
    """
    if batch is None:
        with OutputBatch() as own:
            save_model(model, path, source_dir=source_dir, batch=own, source=source, has_external_data=has_external_data)
            own.commit()
        return
    target = resolve_destination(path)
    # With no external data, there is no location to normalise and no data file to copy.
    if has_external_data and source_dir:
        model = external_data.copy_data_files(model, source_dir, target, batch, source=source or source_dir)
    elif has_external_data:
        model = external_data.normalised_locations(model, os.fspath(path))
    batch.stage(path, model.SerializeToString())


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
    has_external_data: bool = True
    """False when the input file holds no external data (:func:`sgdfuse.external_data.may_hold_external_data`):
    then neither does :attr:`model`, whose tensors are the input's or sgdfuse's own."""

    def save(self, path: str | os.PathLike, *, batch: OutputBatch | None = None) -> None:
        """Write :attr:`model` to ``path`` whole or not at all, external data placed beside it (see
        :func:`save_model`); with ``batch``, staged there for the caller to commit."""
        save_model(self.model, path, source_dir=self.source_dir, batch=batch, source=self.report.source, has_external_data=self.has_external_data)


def _as_model(model: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str, str | None, bool]:
    """The model, its name for messages, the directory it was read from, and whether it may hold external
    data (a ``ModelProto`` given in memory may)."""
    if isinstance(model, onnx.ModelProto):
        return model, "<ModelProto>", None, True
    loaded, external = _load(model, load_external_data=False)
    return loaded, os.fspath(model), os.path.dirname(os.path.abspath(os.fspath(model))), external


def optimize(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    verify: bool = True,
    steps: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    allow_rounding: bool = False,
    pins: RolePins | None = None,
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
        allow_rounding: fuse an update even when the op, which takes learning rate and momentum in the
            parameters' dtype, rounds the graph's values (a FLOAT 0.1 in a BFLOAT16 model becomes
            0.10009765625); the report lists each rounded value. By default such an update is refused
            (``hyperparameter-precision``).
        pins: the user's word on roles (:class:`~sgdfuse.passes.sgd_match.RolePins`: which output replaces which
            input, which inputs are momentum buffers), consulted before any other evidence; each fused entry
            says in ``roles_from`` what decided its roles.

    Returns:
        :class:`OptimizeResult` with the new model and the report.

    Raises:
        ModelLoadError: ``model`` is a path that cannot be loaded as ONNX.
        sgdfuse.ortkernel.KernelBuildError: ``SGDFUSE_ORT_KERNEL=1`` asks verification to run the native kernel
            and it cannot be built.
    """
    tell = progress or (lambda stage: None)
    if verify:
        runtime.kernel_requested()  # a kernel asked for and missing is one error, not a refusal per update
    # The pass's own objects are dropped when _optimize returns, before the collector runs again.
    with collector.paused():
        return _optimize(model, verify=verify, steps=steps, seed=seed, tell=tell, allow_rounding=allow_rounding, pins=pins)


def _optimize(model, *, verify: bool, steps: int, seed: int, tell: Callable[[str], None], allow_rounding: bool, pins: RolePins | None) -> OptimizeResult:
    tell("load")
    source_model, source, source_dir, external = _as_model(model)
    report, plans, index, base = _analyse(
        source_model, source, verify=verify, steps=steps, seed=seed, tell=tell, allow_rounding=allow_rounding, pins=pins
    )
    tell("rewrite")
    new_model = apply_plans(base, index, plans)
    _check_output(new_model, source_model, rewrite=(base, index, plans))
    report.nodes_after = len(new_model.graph.node)
    report.sorted_nodes = bool(plans) and not index.in_order  # the rewrite writes the nodes it keeps sorted
    return OptimizeResult(new_model, report, source_dir, has_external_data=external)




def inspect(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    verify: bool = False,
    steps: int = 3,
    seed: int = 0,
    allow_rounding: bool = False,
    pins: RolePins | None = None,
) -> Report:
    """The analysis of :func:`optimize` with nothing rewritten (a dry run): which updates would fuse,
    which candidates are refused and why. ``verify`` runs the differential check as well;
    ``allow_rounding`` and ``pins`` as for :func:`optimize`."""
    if verify:
        runtime.kernel_requested()
    with collector.paused():
        source_model, source, _, _ = _as_model(model)
        # Only the report is kept: the index and plans are dropped before the collector runs again.
        report = _analyse(source_model, source, verify=verify, steps=steps, seed=seed, allow_rounding=allow_rounding, pins=pins)[0]
    report.written = False
    report.nodes_after = report.nodes_before
    return report


def _analyse(
    model: onnx.ModelProto,
    source: str,
    *,
    verify: bool,
    steps: int,
    seed: int,
    tell: Callable[[str], None] = lambda stage: None,
    allow_rounding: bool = False,
    pins: RolePins | None = None,
):
    """Returns (report, plans, index, base): ``base`` is the model the plans apply to (``model`` with any
    ONNX ``Momentum`` nodes already converted)."""
    report = Report(source=source, nodes_before=len(model.graph.node))
    report.verification = Verification(enabled=verify, steps=steps if verify else 0, tolerance=_tolerance_text())
    misses: list[Miss] = []

    base = model
    tell("index")
    try:
        index = build_index(model)
    except ModelNameError as error:
        raise error if error.path or source == "<ModelProto>" else error.in_file(source)
    report.already_fused = sum(1 for facts in index.nodes if facts[1] == "ai.sgdfuse")
    if report.already_fused:
        report.existing_sgd = _existing_sgd(index)
    if any(op == "Momentum" and domain == TRAINING_DOMAIN for op, domain, *_ in index.nodes):
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
    matches, found_misses = find_updates(index, normaliser, allow_rounding=allow_rounding, pins=pins)
    misses.extend(found_misses)
    if report.fused:
        # A converted Momentum node already writes its state in place: a second update of it is refused.
        converted = {name for f in report.fused for name in (f.parameters, f.accum)}
        kept_matches = []
        for match in matches:
            taken = sorted({match.parameters, match.accum} & converted)
            if taken:
                misses.append(Miss(match.parameters_out, "shared-state", f"{match.parameters_out}: {', '.join(taken)} is already "
                                   "updated by a converted Momentum node; fusing both would write it twice (one writer per state)."))
            else:
                kept_matches.append(match)
        matches = kept_matches

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
        checks = verification.verify_plans(base, index, plans, steps=steps, seed=seed, pinned=pins.state if pins is not None else None)
        kept = []
        for plan, check in zip(plans, checks):
            report.verification.updates.append(dataclasses.asdict(check))
            if check.passed:
                kept.append(plan)
            else:
                misses.append(Miss(plan.match.parameters_out, "verification-failed", check.message))
        plans = _keep_shared_initializers(kept, plans)

    parts = _EntryParts(index)
    for plan in plans:
        report.fused.append(_fused_entry(plan, index, parts))
        if plan.match.maximize:
            report.added_state.append(
                {"name": plan.gradient_input, "what": f"Neg({plan.match.gradient}): maximize feeds the negated gradient", "initial": "-"}
            )
    report.refused = [Refusal(m.candidate, m.reason, m.detail, str(m.equation), m.nearest, m.differing) for m in misses]
    return report, plans, index, base


def _existing_sgd(index) -> list[dict]:
    """The ``ai.sgdfuse::SGD`` nodes of the main graph (:attr:`Report.existing_sgd`): inputs in the contract's
    order (fused_op.INPUT_NAMES), a one-element constant learning rate or momentum as its value."""
    entries = []
    for k, facts in enumerate(index.nodes):
        if facts[:2] != ("SGD", "ai.sgdfuse"):
            continue
        node = index.graph.node[k]
        inputs = dict(zip(INPUT_NAMES, node.input))
        attributes = read_sgd_attributes(node)
        entry = {"node": node.name, **{role: inputs.get(role, "") for role in ("parameters", "gradient", "accum")}}
        for role in ("learning_rate", "momentum"):
            name = inputs.get(role, "")
            constant = index.constant(name) if name else None
            entry[role] = float(constant.reshape(-1)[0]) if constant is not None and constant.size == 1 else name
        entry.update(dampening=attributes.dampening, weight_decay=attributes.weight_decay, nesterov=attributes.nesterov)
        entries.append(entry)
    return entries


def _graph_reads(nodes) -> set[str]:
    """Every value the nodes (and their subgraphs, at any depth) read."""
    reads: set[str] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        reads.update(i for i in node.input if i)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                stack.extend(attribute.g.node)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                stack.extend(n for g in attribute.graphs for n in g.node)
    return reads


def _keep_shared_initializers(kept: list, planned: list) -> list:
    """``kept`` with every initializer they read that a dropped plan introduced moved to the first kept plan
    reading it: scalar initializers are shared between plans (:class:`~sgdfuse.passes.rewrite.Planner`),
    and rolling back one rewrite must leave every other one whole. New plan objects; none is mutated."""
    provided = {t.name for plan in kept for t in plan.initializers}
    # By identity: ``plan not in kept`` would compare plans field by field against every kept one (quadratic,
    # and a dataclass's __eq__ walks its node protos).
    kept_ids = {id(plan) for plan in kept}
    orphans = {t.name: t for plan in planned if id(plan) not in kept_ids for t in plan.initializers if t.name not in provided}
    if not orphans:
        return kept
    result = []
    for plan in kept:
        adopted = [orphans.pop(name) for name in sorted(_graph_reads(plan.nodes)) if name in orphans]
        result.append(dataclasses.replace(plan, initializers=list(plan.initializers) + adopted) if adopted else plan)
    return result


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as the checker can read it in memory: an initializer whose data stays on disk (external
    data, never loaded here) becomes a graph input of its type and shape. The checker would look for the
    data file relative to the working directory; every check but the bytes themselves is unchanged."""
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return model
    names = {t.name for t in external}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = [t for t in copy.graph.initializer if t.name not in names]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    listed = {i.name for i in copy.graph.input}
    copy.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external if t.name not in listed)
    return copy


def _check_output(model: onnx.ModelProto, source: onnx.ModelProto, *, rewrite: tuple | None = None) -> None:
    """The final guard: the model ``optimize`` returns passes ``onnx.checker`` (full check, with shape
    inference), so that no model sgdfuse made invalid is ever written.

    With ``rewrite`` = (base, index, plans), ``model`` being ``apply_plans(base, index, plans)`` and ``base``
    the input itself, the verdict is first proven from what changed (:mod:`sgdfuse.passes.output_check`, at
    a cost proportional to the rewrite): when it is, anything the checker would still reject was already in
    the input. Otherwise (and with no ``rewrite``) the checker runs on the whole output.

    An input model that already fails the check (a graph output without a shape, say; onnxruntime runs such
    models) is not sgdfuse's to fix: when the output fails with the very same first error as the input, it
    is logged and the output kept, since the rewrite added nothing to it.

    Raises:
        InvalidOutputError: the output fails the check and the input passes it, or fails it differently.
    """
    if rewrite is not None:
        base, index, plans = rewrite
        if base is source and not plans:
            return  # the output is a copy of the input: sgdfuse changed nothing
        if base is source:
            reason = output_check.unproven(model, source, index, plans)
            if reason is None:
                return
            logger.info("checking the whole output model: %s", reason)
    error = _checker_error(model)
    if error is None:
        return
    before = _checker_error(source)
    if before == error:
        logger.warning("the input model already fails onnx.checker (%s); the output fails it the same way", error)
        return
    cause = "the input passes it" if before is None else f"the input fails it otherwise ({before})"
    raise InvalidOutputError(f"the optimised model fails onnx.checker ({error}); {cause}, so this is a bug in sgdfuse; nothing was written")


def _checker_error(model: onnx.ModelProto) -> str | None:
    """The first line of ``onnx.checker``'s full-check error on ``model``, or None when it passes."""
    try:
        onnx.checker.check_model(_checkable(model), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        text = str(error).strip()
        return text.splitlines()[0] if text else type(error).__name__
    return None


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


class _EntryParts:
    """What the report entries of one run share, each computed once: the traffic of the original update per
    structural class of the matcher (the members' cones are one another's renaming, node for node, with the
    same dtypes and shapes, both in the class key, so they move the same bytes), and each constant's report
    value (:func:`~sgdfuse.passes.rewrite.shortest_float32`, a function of the float alone)."""

    def __init__(self, index) -> None:
        self.index = index
        self._traffic_by_class: dict = {}
        self._floats: dict[float, float] = {}
        # By identity (the object is kept, so its id is not reused): matches of a structural class share their
        # constant coefficients, and a Poly is not changed after matching.
        self._polys: dict[int, tuple[object, float | str]] = {}
        # Per replay template of the planner (by identity, kept alive by its plans): the helper passes of its
        # nodes' op types, the same for every plan replayed from it (Plan.op_types answers from the template).
        self._passes: dict[int, tuple[object, int]] = {}
        self._dtype_names: dict[int, str] = {}
        self._check_classes = os.environ.get(MEMO_CHECK_ENV) == "1"

    def dtype_name(self, dtype: int) -> str:
        """``dtype_name(dtype)`` (:func:`sgdfuse.contract.dtype_name`, a function of the code alone)."""
        found = self._dtype_names.get(dtype)
        if found is None:
            found = self._dtype_names[dtype] = dtype_name(dtype)
        return found

    def helper_passes(self, plan) -> int:
        """``traffic.helper_passes(plan.op_types())``, once per replay template: a replayed plan's op types are its
        template's (:meth:`sgdfuse.passes.rewrite.Plan.op_types`); any other plan's are read from it."""
        replay = plan._replay() if hasattr(plan, "_replay") else None
        if replay is None:
            return traffic.helper_passes(plan.op_types())
        template = replay.template
        known = self._passes.get(id(template))
        if known is not None and known[0] is template:
            if self._check_classes:
                direct = traffic.helper_passes(plan.op_types())
                assert known[1] == direct, f"{plan.match.parameters_out}: helper passes {known[1]} by template, {direct} directly"
            return known[1]
        passes = traffic.helper_passes(plan.op_types())
        self._passes[id(template)] = (template, passes)
        return passes

    def shortest(self, value: float) -> float:
        """``shortest_float32(value)``. Two floats that compare equal are the same number, except 0.0 and -0.0
        (and NaN, which equals nothing): zeros and NaN are not remembered."""
        if value != 0 and value == value:
            found = self._floats.get(value)
            if found is None:
                found = self._floats[value] = shortest_float32(value)
            return found
        return shortest_float32(value)

    def scalar(self, poly) -> float | str:
        """``describe_scalar(poly)``: a constant's report value, else its expression over graph values."""
        known = self._polys.get(id(poly))
        if known is not None and known[0] is poly:
            return known[1]
        value = self.shortest(poly.constant_value) if poly.is_constant else describe_scalar(poly)
        self._polys[id(poly)] = (poly, value)
        return value

    def traffic_before(self, match: Match) -> int | None:
        """:func:`sgdfuse.passes.traffic.cone_traffic` of ``match``'s nodes, once per structural class
        (``SGDFUSE_CHECK_CLASSES=1`` checks each member against its own figure)."""
        structural = match.structural_class
        if structural is None:
            return traffic.cone_traffic(self.index, match.nodes)
        before = self._traffic_by_class.get(structural, _UNKNOWN)
        if before is _UNKNOWN:
            before = self._traffic_by_class[structural] = traffic.cone_traffic(self.index, match.nodes)
        elif self._check_classes:
            direct = traffic.cone_traffic(self.index, match.nodes)
            assert before == direct, f"{match.parameters_out}: traffic {before} by class, {direct} directly"
        return before


def _fused_entry(plan, index, parts: _EntryParts | None = None) -> FusedUpdate:
    """The report entry of one applied ``plan``; ``parts`` holds what the entries of one run share."""
    if parts is None:
        parts = _EntryParts(index)
    match: Match = plan.match
    # (The plan's op types and names without making a replayed plan's nodes: rewrite.Plan.op_types.)
    after = traffic.fused_traffic(index, match.parameters, parts.helper_passes(plan))
    return FusedUpdate(
        traffic_before_bytes=parts.traffic_before(match),
        traffic_after_bytes=after,
        node=plan.sgd_node_name(),
        parameters=match.parameters,
        gradient=match.gradient,
        accum=match.accum,
        parameters_out=match.parameters_out,
        accum_out=match.accum_out,
        learning_rate=match.rounded.get("learning_rate", parts.scalar(match.learning_rate)),
        momentum=match.rounded.get("momentum", parts.scalar(match.momentum)),
        learning_rate_input=plan.learning_rate_input,
        momentum_input=plan.momentum_input,
        dampening=parts.shortest(match.dampening),
        weight_decay=parts.shortest(match.weight_decay),
        nesterov=bool(match.nesterov),
        maximize=bool(match.maximize),
        stat=plan.stat,
        dtype=parts.dtype_name(match.dtype),
        shape=[d for d in match.shape] if match.shape is not None else [],
        # Written when first read (sgdfuse.report._Text): the console summary shows no equation.
        parameter_equation=match.parameter_equation,
        accum_equation=match.accum_equation,
        matched_nodes=len(match.nodes),
        source="pattern" if match.first_step is None else "pattern with first-step Where",
        rounded={name: parts.scalar(match.learning_rate if name == "learning_rate" else match.momentum) for name in match.rounded},
        roles_from=match.roles_from,
        guard=match.guard.describe() if match.guard is not None else "",
    )


_UNKNOWN = object()


def _tolerance_text() -> str:
    return (
        f"per element and step, natively and lifted to DOUBLE, state carried in place: each coefficient within "
        f"{verification.COEFFICIENT_ROUNDINGS} FLOAT roundings relative to itself (the learning rate and momentum of "
        "FLOAT16/BFLOAT16 state one rounding of that dtype more), applied to the error-free terms of the update; plus the propagation of state differences already checked; plus, natively, "
        f"2*{verification.OPERATIONS}*u*S (u the unit roundoff of the parameters' dtype, S the magnitudes of the terms "
        "either side forms) (see sgdfuse.verify)"
    )
