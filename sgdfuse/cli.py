"""The ``sgdfuse`` command line. Commands are thin: they call the library and format its reports."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import sys
import traceback
from collections import Counter
from pathlib import Path
from collections.abc import Callable
from typing import Optional

import onnx
import typer
from rich.console import Console
from rich.table import Table

import sgdfuse
from sgdfuse import contract
from sgdfuse import api, external_data
from sgdfuse.errors import ModelNameError, OutputWriteError, SgdfuseError
from sgdfuse.passes.rewrite import ROLES_BY_PLAUSIBILITY
from sgdfuse.passes.sgd_match import RolePins
from sgdfuse.output import OutputBatch, resolve_destination, write_bytes
from sgdfuse.report import Report, format_value
from sgdfuse.runtime import ONNXRUNTIME_ERRORS

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fuse momentum-SGD updates in training graphs into one Ascend SGD operator, and prove it.",
    pretty_exceptions_enable=False,
)
# Piped output (CI logs) gets a wide console so table cells are not cut to "parame…".
_out = Console(width=None if sys.stdout.isatty() else 160)
_err = Console(stderr=True)


def _command(name: str) -> Callable:
    """``app.command(name)`` with the function's docstring as its help, each paragraph on one line: typer's rich
    help keeps a docstring's single line breaks past its first paragraph, which a terminal of another width
    then shows as lines broken mid-sentence."""

    def register(function: Callable) -> Callable:
        paragraphs = inspect.cleandoc(function.__doc__ or "").split("\n\n")
        text = "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines()) for paragraph in paragraphs)
        return app.command(name, help=text)(function)

    return register


def _version(value: bool) -> None:
    if value:
        _out.print(f"sgdfuse {sgdfuse.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Fuse momentum-SGD updates in training graphs into one Ascend SGD operator, and prove it."""


@_command("contract")
def contract_command() -> None:
    """Print the Ascend SGD operator contract: ports, attributes, formula and product lines."""
    ports = Table(title="SGD inputs (contract order)")
    for column in ("#", "name", "writable", "description"):
        ports.add_column(column)
    for port in contract.INPUTS:
        ports.add_row(str(port.index), port.name, "in place" if port.writable else "", port.description)
    _out.print(ports)
    _out.print(f"Declared output: [bold]{contract.OUTPUT}[/bold] (accum and stat are written in place)")

    attrs = Table(title="Attributes")
    for column in ("name", "type", "default", "rule"):
        attrs.add_column(column)
    for spec in contract.ATTRIBUTES:
        attrs.add_row(spec.name, spec.kind, str(spec.default), spec.rule)
    _out.print(attrs)

    from sgdfuse import reference

    _out.print("Formula (FLOAT intermediates, round-to-nearest-even back to the input dtype):")
    formula = reference.__doc__.split("read it side by side:")[1].split("Intermediate arithmetic")[0]
    _out.print(formula.rstrip(), markup=False, highlight=False)
    _out.print(
        "momentum == 0 stops only the write-back of accum and stat: accum * m is still computed, so an infinite "
        "accum gives 0 * Inf = NaN in parameters_out.",
        markup=False, highlight=False,
    )

    lines = Table(title="Product lines")
    for column in ("product line", "SoC versions", "dtypes", "formats", "dynamic shape"):
        lines.add_column(column)
    for line in contract.PRODUCT_LINES:
        lines.add_row(
            line.name,
            contract.describe_soc_versions(line),
            ", ".join(contract.dtype_name(d) for d in line.dtypes),
            ", ".join(line.formats),
            "yes" if line.dynamic_shape else "no",
        )
    _out.print(lines)


def _default_output(source: Path) -> Path:
    name = source.name[: -len(".onnx")] if source.name.endswith(".onnx") else source.name
    return source.with_name(name + ".sgdfused.onnx")


TABLE_ROWS = 20
"""Past this many fused updates (or refusals), the console shows a grouped summary instead of one row each;
``--verbose`` prints every row, and the JSON report (``--report``) always holds everything."""


def _print_report(report: Report, verbose: bool = False) -> None:
    _print_existing(report, verbose)
    _print_fused(report, verbose)
    if report.refused and (verbose or len(report.refused) <= TABLE_ROWS):
        table = Table(title=f"Refused candidates ({len(report.refused)})")
        for column in ("candidate", "reason", "why"):
            table.add_column(column)
        for r in report.refused:
            table.add_row(r.candidate, r.reason, "\n".join(r.explanation()))
        _out.print(table)
    elif report.refused:
        _print_refusal_groups(report)
    if report.fused:
        from sgdfuse.passes.traffic import fmt_bytes

        traffic = report.memory_traffic()
        if traffic["before_bytes"]:
            _out.print(
                f"Memory traffic of the updates per step (estimate): {fmt_bytes(traffic['before_bytes'])} before, "
                f"{fmt_bytes(traffic['after_bytes'])} after fusion"
                + (f" ({traffic['unknown']} update(s) with dynamic shapes not counted)" if traffic["unknown"] else "")
            )
    if report.verification.enabled and report.verification.updates:
        _out.print(_verification_line(report), markup=False, highlight=False)
        notes = [u["note"] for u in report.verification.updates if u.get("note")]
        if notes:
            # A precision or size that could not be run is said, never passed over in silence.
            _out.print(f"Verification note ({len(notes)} update(s)): {notes[0]}", markup=False)
    elif not report.verification.enabled:
        _out.print("Verification: off" + ("" if report.written else " (inspect is a dry run; add --verify to run the check)"))


def _print_refusal_groups(report: Report) -> None:
    """The refusals grouped by reason: how many, and the first one's candidate and explanation."""
    groups: dict[str, list] = {}
    for r in report.refused:
        groups.setdefault(r.reason, []).append(r)
    table = Table(title=f"Refused candidates ({len(report.refused)}) by reason (--verbose lists each, --report writes all)")
    for column in ("reason", "count", "example", "why (example)"):
        table.add_column(column)
    for reason, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        table.add_row(reason, str(len(members)), members[0].candidate, "\n".join(members[0].explanation()))
    _out.print(table)


def _print_existing(report: Report, verbose: bool = False) -> None:
    """The ``ai.sgdfuse::SGD`` nodes the input already had, one row each (grouped by hyper-parameters past
    :data:`TABLE_ROWS`, as the fused updates are)."""
    if not report.existing_sgd:
        return
    numbers = ("lr", "momentum", "dampening", "weight decay")

    def cells(e: dict) -> list[str]:
        return [format_value(e[k], "FLOAT") if not isinstance(e[k], str) else e[k] for k in ("learning_rate", "momentum", "dampening", "weight_decay")] + [
            "nesterov" if e["nesterov"] else "plain"
        ]

    if verbose or len(report.existing_sgd) <= TABLE_ROWS:
        table = Table(title=f"SGD nodes already in the model ({len(report.existing_sgd)})")
        for column in ("node", "parameters", "gradient", "momentum buffer", *numbers, "form"):
            table.add_column(column, no_wrap=column in numbers)
        for e in report.existing_sgd:
            table.add_row(e["node"], e["parameters"], e["gradient"], e["accum"], *cells(e))
    else:
        groups: dict[tuple, list[dict]] = {}
        for e in report.existing_sgd:
            groups.setdefault(tuple(cells(e)), []).append(e)
        table = Table(title=f"SGD nodes already in the model ({len(report.existing_sgd)}) by hyper-parameters (--verbose lists each)")
        for column in ("count", *numbers, "form", "example (node / parameters)"):
            table.add_column(column, no_wrap=column in numbers)
        for key, members in sorted(groups.items(), key=lambda item: -len(item[1])):
            table.add_row(str(len(members)), *key, f"{members[0]['node']} / {members[0]['parameters']}")
    _out.print(table)


def _fused_columns(f) -> tuple[list[str], str]:
    """The hyper-parameter cells of a fused update (as the console shows them) and its form."""
    form = ", ".join(x for x in ("nesterov" if f.nesterov else "", "maximize" if f.maximize else "") if x) or "plain"
    values = [format_value(v, f.dtype) for v in (f.learning_rate, f.momentum, f.dampening, f.weight_decay)]
    for position, name in enumerate(("learning_rate", "momentum")):
        if name in f.rounded:
            values[position] += f" (rounded from {f.rounded[name]})"
    return values, form


def _print_fused(report: Report, verbose: bool = False) -> None:
    if not report.fused:
        return
    numbers = ("lr", "momentum", "dampening", "weight decay")
    if verbose or len(report.fused) <= TABLE_ROWS:
        table = Table(title=f"Fused updates ({len(report.fused)})")
        for column in ("parameters", "gradient", "momentum buffer", *numbers, "form", "roles from"):
            # Numbers stay on one line (a FLOAT16 value and its exact value read as one); names may wrap.
            table.add_column(column, no_wrap=column in numbers)
        for f in report.fused:
            values, form = _fused_columns(f)
            table.add_row(f.parameters, f.gradient, f.accum, *values, form, f.roles_from)
    else:
        # Grouped by what the fused op computes with (dtype, hyper-parameters, form) and by what decided the
        # roles: one row per group with its size and first member.
        groups: dict[tuple, list] = {}
        for f in report.fused:
            values, form = _fused_columns(f)
            groups.setdefault((f.dtype, *values, form, f.roles_from), []).append(f)
        table = Table(title=f"Fused updates ({len(report.fused)}) by hyper-parameters (--verbose lists each, --report writes all)")
        for column in ("count", "dtype", *numbers, "form", "roles from", "example (parameters / gradient / buffer)"):
            table.add_column(column, no_wrap=column in numbers)
        for key, members in sorted(groups.items(), key=lambda item: -len(item[1])):
            example = members[0]
            table.add_row(str(len(members)), *key, f"{example.parameters} / {example.gradient} / {example.accum}")
    # The legend explains "0.1 (FLOAT16 = 0.099975586)": only when a cell is written that way.
    narrow = sorted({
        f.dtype for f in report.fused
        if f.dtype in ("FLOAT16", "BFLOAT16") and any(f"({f.dtype} = " in v for v in _fused_columns(f)[0])
    })
    _out.print(table)
    if any(f.roles_from == "plausibility" for f in report.fused):
        _out.print(
            "roles from plausibility: nothing but the hyper-parameters (momentum in (0, 1), dampening 0) told the buffer "
            "from the gradient; pin them with --state NEW=OLD or --buffers GLOB if that is wrong.",
            markup=False, highlight=False,
        )
    # The equations are written when first read (report._Text): a grouped table looks at the examples it shows,
    # not at every equation of a large step.
    listed = verbose or len(report.fused) <= TABLE_ROWS
    shown = report.fused if listed else [members[0] for members in groups.values()]
    scaled = [f for f in shown if f.source.startswith("pattern") and not _names_in(f.gradient, str(f.accum_equation))]
    if scaled:
        f = scaled[0]
        others = len(scaled) - 1
        which = f"{f.parameters} and {others} more" if others else f.parameters
        if not listed:
            which += f" among the examples of {len(report.fused)} updates"
        _out.print(
            f"gradient {f.gradient} ({which}): a value the "
            f"graph computes from its gradient before the buffer ({f.accum_equation}); the fused op reads it as the "
            "gradient, so a scale the graph writes (a clip factor, a dampening applied on every step, Keras's -lr) stays in the "
            "graph, and dampening shows only what the op applies.",
            markup=False, highlight=False,
        )
    if narrow:
        _out.print(
            f"{' and '.join(narrow)} values: the decimal written in the graph's {narrow[0]} constant, then after = "
            "its exact value, which the fused op computes with.",
            markup=False, highlight=False,
        )


def _names_in(name: str, equation: str) -> bool:
    """Whether ``name`` is one of the value names of a normalised equation (``add = 0.9*b0 + 0.1*g0``): found
    with a space, ``*``, ``(`` or the start before it and a space, ``)`` or the end after it."""
    start = 0
    while (at := equation.find(name, start)) >= 0:
        end = at + len(name)
        if (at == 0 or equation[at - 1] in " *(") and (end == len(equation) or equation[end] in " )"):
            return True
        start = at + 1
    return False


def _number(value: object, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is not a number (a report may hold None)."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _verification_line(report: Report) -> str:
    """One line: how many updates ran, how many agree, and the worst ratio to the derived bound among those
    that have one (an ONNX ``Momentum`` conversion is compared with its own bound and records no ratio)."""
    checks = report.verification
    updates = checks.updates
    failed = sum(1 for u in updates if not u.get("passed"))
    ratios = [u["max_bound_ratio"] for u in updates if isinstance(u.get("max_bound_ratio"), (int, float))]
    ratios = [r for r in ratios if not math.isnan(r)]
    text = (
        f"Verification: {len(updates)} update(s) run in {checks.runner} for {checks.steps} chained steps; "
        f"{len(updates) - failed} agree within the derived bound"
    )
    if ratios:
        text += f" (worst {max(ratios):.2g} of the bound)"
    shared = sum(1 for u in updates if u.get("verified_as"))
    if shared:
        # sgdfuse.verify.verify_plans: a class of updates with slices identical up to names shares a run.
        text += f"; {len(updates) - shared} run, {shared} identical up to names to a run one of their class"
    unrated = [u for u in updates if not isinstance(u.get("max_bound_ratio"), (int, float))]
    if unrated:
        errors = [u["max_abs_error"] for u in unrated if isinstance(u.get("max_abs_error"), (int, float))]
        how = "; ".join(sorted({u.get("message") or "compared without a recorded ratio" for u in unrated}))
        text += f"; {len(unrated)} of them: {how}" + (f", largest |difference| {max(errors):.3g}" if errors else "")
    if failed:
        text += f"; {failed} failed and were left unfused"
    return text


def _summary(report: Report) -> str:
    """The end of the last line of ``optimize`` and ``inspect``: how many updates fused (or would), how many
    were refused and for which reasons (lower case: ``fused 0 update(s), refused 2 (...)``)."""
    reasons = Counter(r.reason for r in report.refused)
    refused = f"refused {len(report.refused)}" + (
        " (" + ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items())) + ")" if reasons else ""
    )
    verb = "fused" if report.written else "would fuse"
    text = f"{verb} {len(report.fused)} update(s), {refused}"
    if not report.fused and not report.refused:
        already = f"; the model already has {report.already_fused} ai.sgdfuse::SGD node(s)" if report.already_fused else ""
        text += f": no momentum-SGD update candidates found{already}"
    elif not report.fused:
        text += ": nothing fused (`sgdfuse inspect` explains each refusal)"
    return text


PROGRESS_NODE_THRESHOLD = 20_000
"""Graphs with more nodes than this (about a second of work) show a progress bar on stderr."""

_STAGES = ("load", "index", "match", "verify", "rewrite", "save")


def _progress(model: Path, quiet: bool):
    """A rich progress bar over the pass's stages, on stderr; a no-op when quiet or the file is small."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    large = model.is_file() and model.stat().st_size > PROGRESS_NODE_THRESHOLD * 60  # ~60 bytes a node
    if quiet or not large:
        return nullcontext(lambda stage: None)

    class _Bar:
        def __enter__(self):
            self.progress = Progress(TextColumn("{task.description:<8}"), BarColumn(), TimeElapsedColumn(), console=_err, transient=True)
            self.progress.__enter__()
            self.task = self.progress.add_task("load", total=len(_STAGES))
            return self.advance

        def advance(self, stage: str) -> None:
            self.progress.update(self.task, description=stage, completed=_STAGES.index(stage) if stage in _STAGES else 0)

        def __exit__(self, *exc):
            return self.progress.__exit__(*exc)

    return _Bar()


@contextlib.contextmanager
def _about_file(path: Path):
    """Errors raised inside name the model file ``path``: a :class:`ModelNameError` without a file, and a
    lowering error about "model" (its subject) or about one of its nodes or values."""
    from sgdfuse.lowering.errors import LoweringError

    try:
        yield
    except ModelNameError as error:
        raise error if error.path else error.in_file(path) from None
    except LoweringError as error:
        if error.subject == os.fspath(path) or error.subject.startswith(f"{os.fspath(path)}: "):
            raise
        text = str(error)
        raise SgdfuseError(f"{path}: {text[len('model: '):] if error.subject == 'model' else text}") from error


def _require_text_names(model: onnx.ModelProto, path: Path, table=None) -> None:
    """:func:`sgdfuse.passes.index.require_text_names`, the error naming the file ``path``; ``table``: the
    model's node table, when the caller has it."""
    from sgdfuse.passes.index import require_text_names

    try:
        require_text_names(model, table=table)
    except ModelNameError as error:
        raise error.in_file(path) from None


def _check_destinations(destinations, inputs) -> None:
    """Each output can be written (before the work, not after it) and none of them is an input: the input is
    never modified, so ``optimize m.onnx -o m.onnx`` is refused rather than overwriting the model."""
    sources = {os.path.realpath(os.fspath(path)) for path in inputs if path is not None}
    # The data files an input model names are input too (a report written over one corrupts the model).
    data = {name: (item, path) for path in inputs if path is not None for name, item in external_data.data_files(path).items()}
    taken: set[str] = set()
    for path in destinations:
        if path is None:
            continue
        target = resolve_destination(path)
        if target in sources:
            raise OutputWriteError(os.fspath(path), "is an input of this command; sgdfuse never overwrites its input: give another output path")
        if target in data:
            item, model = data[target]
            raise OutputWriteError(
                os.fspath(path),
                f"is the external data file {item.location!r} of tensor {item.tensor!r} of the input {model}; sgdfuse never "
                "overwrites its input: give another output path",
            )
        if target in taken:
            raise OutputWriteError(os.fspath(path), "is named twice among the files to write (two outputs would be one file): give each output its own path")
        taken.add(target)


def _pins(state: Optional[list[str]], buffers: Optional[list[str]]) -> RolePins:
    """``--state NEW=OLD`` and ``--buffers GLOB`` as :class:`RolePins`; a malformed pair is one error line."""
    pairs: dict[str, str] = {}
    for item in state or []:
        new, sep, old = item.partition("=")
        if not sep or not new or not old:
            raise typer.BadParameter(f"--state takes NEW=OLD (a graph output and the input it replaces), got {item!r}")
        pairs[new] = old
    return RolePins(state=pairs, buffers=tuple(buffers or ()))


@_command("optimize")
def optimize_command(
    model: Path = typer.Argument(..., help="ONNX training graph to optimise."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Where to write the fused model (default: MODEL.sgdfused.onnx)."),
    report_path: Optional[Path] = typer.Option(None, "--report", help="Also write the report as JSON here."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check every rewrite in onnxruntime before writing it."),
    steps: int = typer.Option(3, "--steps", min=1, max=10_000, help="Chained steps of the check."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    allow_rounding: bool = typer.Option(
        False, "--allow-rounding", help="Fuse even when the op's dtype (the parameters') rounds the graph's learning rate or momentum."
    ),
    state: Optional[list[str]] = typer.Option(
        None, "--state", help="NEW=OLD: graph output NEW is the next value of input OLD, written into it in place (repeatable)."
    ),
    buffers: Optional[list[str]] = typer.Option(None, "--buffers", help="Glob of the momentum-buffer inputs, e.g. 'b*' (repeatable)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=f"One console row per update and refusal, even past {TABLE_ROWS}."),
) -> None:
    """Fuse every momentum-SGD update of MODEL into one ai.sgdfuse::SGD node each, verify, and write the result."""
    _require_input(model)
    mindir = model.name.endswith(".mindir")  # a MindSpore MindIR train step: sgdfuse.mindspore
    if mindir:
        from sgdfuse.mindspore.mindir import MindIRResult, optimize_mindir_file

        output = output or Path(MindIRResult.default_output(model))
    destination = output or _default_output(model)
    _check_destinations((destination, report_path), (model,))
    with _progress(model, quiet) as tell:
        if mindir:
            result = optimize_mindir_file(model, verify=verify, steps=steps)
        else:
            result = api.optimize(
                model, verify=verify, steps=steps, progress=tell, allow_rounding=allow_rounding, pins=_pins(state, buffers)
            )
        tell("save")
        with OutputBatch() as batch:  # the model and the report are written together or not at all
            result.save(destination, batch=batch)
            if report_path is not None:
                batch.stage(report_path, (result.report.to_json() + "\n").encode())
            batch.commit()
    _print_report(result.report, verbose)
    report = result.report
    nodes = (
        f"{report.nodes_before} → {report.nodes_after} nodes" if report.fused else f"{report.nodes_after} nodes, the input's graph unchanged"
    )
    _out.print(f"Wrote {destination} ({nodes}): {_summary(report)}", markup=False, highlight=False, soft_wrap=True)
    if report.sorted_nodes:
        _out.print(f"Note: {model.name}'s nodes were not in topological order (ONNX requires every node after the producers "
                   "of its inputs); the output holds them sorted.", markup=False, highlight=False, soft_wrap=True)


@_command("inspect")
def inspect_command(
    model: Path = typer.Argument(..., help="ONNX training graph to analyse."),
    report_path: Optional[Path] = typer.Option(None, "--report", help="Write the report as JSON here."),
    verify: bool = typer.Option(False, "--verify/--no-verify", help="Also run the differential check."),
    allow_rounding: bool = typer.Option(
        False, "--allow-rounding", help="Accept a learning rate or momentum that the op's dtype rounds."
    ),
    state: Optional[list[str]] = typer.Option(None, "--state", help="NEW=OLD: output NEW replaces input OLD in place (repeatable)."),
    buffers: Optional[list[str]] = typer.Option(None, "--buffers", help="Glob of the momentum-buffer inputs (repeatable)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=f"One console row per update and refusal, even past {TABLE_ROWS}."),
) -> None:
    """Report which updates of MODEL would fuse and why the other candidates would not; write nothing else."""
    _require_input(model)
    _check_destinations((report_path,), (model,))
    report = api.inspect(model, verify=verify, allow_rounding=allow_rounding, pins=_pins(state, buffers))
    if report_path is not None:
        _write_text(report_path, report.to_json())
    _print_report(report, verbose)
    written = f"wrote only the report {report_path}" if report_path is not None else "nothing written"
    summary = _summary(report)
    _out.print(f"{summary[0].upper()}{summary[1:]}; {written} (a dry run)", markup=False, highlight=False, soft_wrap=True)


def _check_rows(result) -> list[tuple[str, str, object, object, bool, str]]:
    """(name, kind, max |difference|, ratio to the bound or None, agrees, message) per compared output and
    per in-place state write of :func:`sgdfuse.verify.check_models`'s result."""
    rows = []
    for entry in result.outputs:
        ratio = entry.get("max_bound_ratio") if entry["kind"] != "exact" else None
        rows.append((entry["name"], entry["kind"], entry.get("max_abs_error"), ratio, bool(entry["passed"]), entry["message"]))
    for entry in result.in_place:
        # The value each side writes into a state the SGD op updates in place, steps chained per side.
        name = f"{entry['name']} (in place: {entry['original']} / {entry['fused']})"
        rows.append((name, entry["kind"], entry["max_abs_error"], entry["max_bound_ratio"], bool(entry["passed"]), entry["message"]))
    return rows


def _check_table(result, title: str, verbose: bool) -> Table:
    """One row per output (``verbose`` or at most :data:`TABLE_ROWS` rows), else one row per (how compared,
    agrees) with its count, the largest difference and ratio, and its first member as the example."""
    rows = _check_rows(result)
    table = Table(title=title)
    if verbose or len(rows) <= TABLE_ROWS:
        for column in ("output", "compared as", "max |difference|", "of bound", "agrees"):
            table.add_column(column)
        for name, kind, error, ratio, passed, message in rows:
            table.add_row(name, kind, _number(error, ".3g"), _number(ratio, ".2g"), "yes" if passed else "NO: " + message)
        return table
    groups: dict[tuple[str, bool], list] = {}
    for row in rows:
        groups.setdefault((row[1], row[4]), []).append(row)
    table.title = f"{title}: {len(rows)} outputs by comparison (--verbose lists each)"
    for column in ("compared as", "agrees", "count", "max |difference|", "worst of bound", "example"):
        table.add_column(column)
    for (kind, passed), members in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0])):
        errors = [r[2] for r in members if isinstance(r[2], (int, float)) and not math.isnan(r[2])]
        ratios = [r[3] for r in members if isinstance(r[3], (int, float)) and not math.isnan(r[3])]
        example = members[0][0] if passed else f"{members[0][0]}: {members[0][5]}"
        table.add_row(kind, "yes" if passed else "NO", str(len(members)), _number(max(errors) if errors else None, ".3g"),
                      _number(max(ratios) if ratios else None, ".2g"), example)
    return table


@_command("check")
def check_command(
    original: Path = typer.Argument(..., help="The original ONNX model."),
    fused: Path = typer.Argument(..., help="Its fused form (from sgdfuse optimize)."),
    steps: int = typer.Option(3, "--steps", min=1, max=10_000, help="Chained steps to run."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of the random inputs."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=f"One console row per output, even past {TABLE_ROWS}."),
    state: Optional[list[str]] = typer.Option(
        None, "--state", help="NEW=OLD: the original's output NEW is the next value of input OLD (as given to optimize; repeatable)."
    ),
) -> None:
    """Run ORIGINAL and FUSED in onnxruntime on the same seeded inputs for STEPS chained steps, natively and in DOUBLE, in lockstep and in place; exit 0 only if every output and every in-place state write agrees and every fused update's gradient was non-zero on some compared step (one that stays zero on every input fed fails as never compared)."""
    from sgdfuse.passes.scan import node_table
    from sgdfuse.verify import check_models

    _require_input(original)
    _require_input(fused)
    models = []
    tables = []  # read once, for the names' check and for the check itself
    for path in (original, fused):
        models.append(api.load_model(path, load_external_data=True))
        tables.append(node_table(models[-1], details=True))  # check's class keys read overloads and attributes from it
        _require_text_names(models[-1], path, tables[-1])
    try:
        result = check_models(models[0], models[1], steps=steps, seed=seed, pinned=_pins(state, None).state,
                              node_tables=(tables[0], tables[1]))
    except ValueError as error:
        raise SgdfuseError(f"{fused}: {error}") from error
    except SgdfuseError:
        raise
    except ONNXRUNTIME_ERRORS as error:  # onnxruntime refuses a model it cannot run (e.g. a preview training op)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SgdfuseError(f"{original} / {fused}: onnxruntime cannot run the models: {first_line}") from error
    _out.print(_check_table(result, f"{original.name} vs {fused.name}: {steps} chained steps", verbose))
    grouped = ""
    if result.groups_run < result.groups:
        grouped = (f"; {result.groups} independent groups of outputs, {result.groups_run} run, each other one verified as a run "
                   "group identical to it up to value names")
    _out.print(f"Ran: {', '.join(result.runs)}{grouped}", markup=False)
    if result.note:
        _out.print(f"Note: {result.note}", markup=False)
    if not result.passed:
        failed = [e["name"] for e in result.outputs + result.in_place if not e["passed"]]
        if set(failed) <= set(result.uncompared):
            # Nothing disagreed: what failed was never compared (NaN everywhere, a gradient zero on every input fed).
            _err.print(f"error: {len(failed)} outputs and state writes were never compared (see the table): the models "
                       "are not shown to agree", markup=False, highlight=False, soft_wrap=True)
        else:
            _err.print("error: the models disagree", markup=False)
        raise typer.Exit(1)
    _out.print("All outputs agree.")


def _names(names: list[str]) -> str:
    """``names`` joined for a table cell; past :data:`TABLE_ROWS` names, the first few and the count."""
    if not names:
        return "-"
    if len(names) <= TABLE_ROWS:
        return ", ".join(names)
    return f"{', '.join(names[:5])}, ... ({len(names)} in all)"


@_command("lower")
def lower_command(
    model: Path = typer.Argument(..., help="Fused ONNX model (an unfused one is optimised first)."),
    soc: str = typer.Option(..., "--soc", help="ATC SoC version (any case), e.g. Ascend910B2, Ascend310P3, Ascend950PR_9599."),
    output: Optional[Path] = typer.Option(
        None, "-o", "--output", help="Output file (default: MODEL.air, or MODEL.atc.onnx with --format onnx-atc)."
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the step graph as JSON (the layout of atc --mode=1)."),
    output_format: str = typer.Option(
        "air",
        "--format",
        help="air: the GE IR step graph (.air) and its init graph (.init.air); "
        "onnx-atc: ONNX for ATC's own parser (SGD as ai.sgdfuse::1::SGD) and the op plugin source beside it.",
    ),
    verify: bool = typer.Option(
        True, "--verify/--no-verify",
        help="Run the GE graph in sgdfuse's executor against onnxruntime on the fused model before writing it.",
    ),
    steps: int = typer.Option(3, "--steps", min=1, max=10_000, help="Chained steps of the check."),
    explicit_onnx_domain: bool = typer.Option(
        False,
        "--explicit-onnx-domain",
        help="onnx-atc only: write standard nodes in domain ai.onnx instead of \"\", for ATC parsers that refuse "
        "an empty domain beside ai.sgdfuse (onnx.checker refuses that form; see docs/atc.md).",
    ),
) -> None:
    """Lower MODEL to the Ascend Graph Engine for one SoC (GE IR .air, or ONNX prepared for ATC).

    An unfused MODEL is optimised first (with verification); one line says what fused, what was refused and
    why, and whether verification ran, and a warning says so when no update fused at all. The GE graph is
    then run in place in sgdfuse's executor for a few steps against onnxruntime on the fused model; a
    disagreement is an error and nothing is written (unless --no-verify).
    """
    from sgdfuse import lowering
    from sgdfuse.fused_op import is_sgd_node
    from sgdfuse.lowering import onnx_atc
    from sgdfuse.lowering.lower import prepare

    if output_format not in ("air", "onnx-atc"):
        raise typer.BadParameter(f"{output_format!r} is not one of 'air', 'onnx-atc'", param_hint="--format")
    if output_format == "onnx-atc" and json_path is not None:
        raise typer.BadParameter("--json describes a GE graph; use it with --format air", param_hint="--json")
    if output_format != "onnx-atc" and explicit_onnx_domain:
        raise typer.BadParameter("--explicit-onnx-domain shapes the ONNX for ATC; use it with --format onnx-atc", param_hint="--explicit-onnx-domain")
    # An unknown SoC fails before the work, not after it; any case is accepted, ATC's spelling is written.
    soc = contract.canonical_soc(soc)
    _require_input(model)
    stem = model.name[: -len(".onnx")] if model.name.endswith(".onnx") else model.name
    if output_format == "onnx-atc":
        destination = output or model.with_name(stem + ".atc.onnx")
        destinations = [destination, onnx_atc.plugin_path_for(destination)]
    else:
        destination = output or model.with_name(stem + ".air")
        init_destination = destination.with_name(
            (destination.name[: -len(".air")] if destination.name.endswith(".air") else destination.name) + ".init.air"
        )
        destinations = [destination, init_destination, json_path]
    _check_destinations(destinations, (model,))

    with _about_file(model):  # an error about "model" names the file
        fused, report = prepare(model)
        _require_text_names(fused, model)
        if report is not None:
            reasons = Counter(r.reason for r in report.refused)
            refused = f"{len(report.refused)} refused" + (
                " (" + ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items())) + ")" if reasons else ""
            )
            checks = report.verification
            if checks.enabled:
                failed = sum(1 for u in checks.updates if not u["passed"])
                verified = f"verification ran ({len(checks.updates)} update(s), {checks.steps} chained steps in {checks.runner}, {failed} failed)"
            else:
                verified = "verification did not run"
            _out.print(
                f"{model.name} had no ai.sgdfuse::SGD node, so it was optimised first: {len(report.fused)} update(s) fused, "
                f"{refused}; {verified}",
                markup=False, highlight=False, soft_wrap=True,
            )
        guessed = [node.name for node in fused.graph.node if is_sgd_node(node) and ROLES_BY_PLAUSIBILITY in node.doc_string]
        if guessed:
            _err.print(
                f"warning: the roles of {len(guessed)} SGD node(s) ({', '.join(guessed[:3])}{', ...' if len(guessed) > 3 else ''}) were "
                "decided by plausibility alone (momentum in (0, 1), dampening 0): the buffer written in place is a guess. "
                "Pin it with `sgdfuse optimize --state NEW=OLD` or `--buffers GLOB` if it is wrong.",
                markup=False, highlight=False, soft_wrap=True,
            )
        if not any(is_sgd_node(node) for node in fused.graph.node):
            _err.print(
                f"warning: {model.name} has no momentum-SGD update to lower (no ai.sgdfuse::SGD node after optimising); "
                f"the output has no SGD op. `sgdfuse inspect {model}` shows why candidates were refused.",
                markup=False, highlight=False, soft_wrap=True,
            )

        if output_format == "onnx-atc":
            written, plugin = onnx_atc.write_onnx_atc(
                fused, destination, soc=soc, optimise=False, explicit_onnx_domain=explicit_onnx_domain
            )
            domains = (
                f"standard nodes in domain {onnx_atc.STANDARD_DOMAIN} (onnx.checker refuses this form)"
                if explicit_onnx_domain
                else 'standard nodes in the default domain ""'
            )
            _out.print(f"Wrote {written} (SGD nodes as {onnx_atc.ATC_OP_KEY}, {domains})", markup=False, highlight=False, soft_wrap=True)
            _out.print(f"Wrote {plugin} (ATC op plugin source mapping {onnx_atc.ATC_OP_KEY} to GE SGD)", markup=False, highlight=False, soft_wrap=True)
            return
        lowered = lowering.lower(fused, soc=soc, optimise=False)
        if verify:
            from sgdfuse.lowering.verify import LoweringVerificationError, verify_lowering

            check = verify_lowering(fused, lowered, steps=steps)
            if not check.passed:
                raise LoweringVerificationError(
                    str(model), f"the lowered GE graph disagrees with onnxruntime on the fused model: {check.message}; nothing was written"
                )
            _out.print(f"Verified: the GE graph agrees with onnxruntime over {check.steps} chained in-place steps, natively and "
                       "lifted to DOUBLE, within sgdfuse check's bounds.", markup=False, highlight=False, soft_wrap=True)
            if check.note:
                _out.print(f"Note: {check.note}", markup=False, highlight=False, soft_wrap=True)
        with OutputBatch() as batch:  # step graph, init graph and JSON together or not at all
            lowered.save_air(destination, batch=batch)
            lowered.save_init_air(init_destination, batch=batch)
            if json_path is not None:
                batch.stage_text(json_path, itertools.chain(lowered.json_pieces(), ("\n",)))
            batch.commit()
        table = Table(title=f"GE graph for {soc} ({lowered.product_line.name})")
        for column in ("ops", "SGD ops", "state variables", "inputs (Data)", "outputs"):
            table.add_column(column)
        table.add_row(
            str(lowered.op_count()), str(len(lowered.sgd_ops)), str(len(lowered.state)),
            _names(lowered.inputs), _names(lowered.outputs),
        )
        _out.print(table)
        _out.print(f"Wrote {destination} (step graph) and {init_destination} (init graph: assigns the state variables)")
        if json_path is not None:
            _out.print(f"Wrote {json_path}")


@_command("state")
def state_command(
    checkpoint: Path = typer.Argument(..., help="Checkpoint: .npz or .safetensors (flat layout), .pt/.pth (needs torch), .ckpt (needs mindspore)."),
    model: Path = typer.Option(..., "--model", help="The fused ONNX model (sgdfuse optimize's output)."),
    output: Path = typer.Option(..., "-o", "--output", help="Feeds to write (.npz, keys the ONNX input names)."),
    name_map: Optional[list[str]] = typer.Option(
        None, "--map", metavar="NAME=INPUT", help="CHECKPOINT_NAME=ONNX_INPUT for a parameter the exporter renamed (repeatable)."
    ),
    soc: Optional[str] = typer.Option(
        None, "--soc", help="Also write the GE init graph's <state>/initial_value inputs for this SoC (the model is lowered to learn them)."
    ),
    init_output: Optional[Path] = typer.Option(
        None, "--init-output", help="Where to write the GE init feeds (.npz; default: OUTPUT with .init.npz); needs --soc."
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the mapping as JSON."),
) -> None:
    """Map CHECKPOINT onto the state inputs of a fused MODEL: parameters, momentum buffers (accum) and the
    first-step flag (stat = 1 for a parameter with no buffer yet), written as .npz feeds by ONNX input name
    and, with --soc, as the GE init graph's initial values. A missing parameter or a shape or dtype mismatch is
    an error and nothing is written; a checkpoint tensor that maps to nothing is a warning."""
    from sgdfuse.checkpoint import checkpoint_feeds, parse_name_map

    if init_output is not None and soc is None:
        raise typer.BadParameter("the GE init feeds need the SoC the model is lowered for; give --soc", param_hint="--init-output")
    if soc is not None:
        soc = contract.canonical_soc(soc)
        if init_output is None:
            stem = output.name[: -len(".npz")] if output.name.endswith(".npz") else output.name
            init_output = output.with_name(stem + ".init.npz")
    _check_destinations((output, init_output, json_path), (model, checkpoint))
    _require_input(model)
    result = checkpoint_feeds(checkpoint, model, name_map=parse_name_map(name_map), soc=soc)
    for line in result.warnings:
        _err.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    table = Table(title=f"{checkpoint.name} → {model.name}")
    for column in ("checkpoint", "parameters", "accum", "buffer", "stat", "how stat reaches the model"):
        table.add_column(column)
    for entry in result.updates:
        buffer = "yes" if entry.has_buffer else "none (first step): zeros"
        table.add_row(entry.checkpoint_name, entry.parameters, entry.accum, buffer, str(entry.stat), entry.stat_fed)
    with OutputBatch() as batch:
        result.save(output, init_path=init_output, batch=batch)
        if json_path is not None:
            batch.stage(json_path, (result.to_json() + "\n").encode())
        batch.commit()
    _out.print(table)
    written = [str(output)] + [str(p) for p in (init_output, json_path) if p is not None]
    _out.print(f"Wrote {', '.join(written)}.", markup=False, highlight=False)


def _write_text(path: Path, text: str) -> None:
    write_bytes(path, (text + "\n").encode())


def _require_input(path: Path) -> None:
    """Refuse an input file that cannot be a model before any work: an empty file says so (a parser would
    call it "not a model" for a reason the user cannot see). Missing files and directories are the loaders'
    to report."""
    if path.is_file() and path.stat().st_size == 0:
        raise SgdfuseError(f"{path}: the file is empty (0 bytes); was it fully written or copied?")


TRACEBACK_ENV = "SGDFUSE_TRACEBACK"
"""Set this environment variable to 1 to see the Python traceback of an internal error."""


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point. Usage errors are typer's (exit 2); a :class:`SgdfuseError` becomes one
    line on stderr and exit 1. Any other exception is a bug in sgdfuse: it too is one ``error:`` line (exit
    1) naming the exception and where it was raised, unless ``SGDFUSE_TRACEBACK=1`` asks for the traceback.
    Outputs are staged and committed together, so an error leaves nothing half-written."""
    # typer's usage errors derive from its BadParameter's base (click's UsageError, vendored by typer >= 0.16).
    usage_error = typer.BadParameter.__mro__[1]
    try:
        code = app(args=argv, prog_name="sgdfuse", standalone_mode=False)
    except usage_error as error:
        # One line, like every other error (the README's promise), naming the command's --help.
        command = error.ctx.command_path if error.ctx is not None else "sgdfuse"
        _err.print(f"error: {error.format_message()} (see `{command} --help`)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Abort:
        _err.print("error: aborted", markup=False)
        sys.exit(1)
    except SgdfuseError as error:
        _err.print(f"error: {error}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)
    except Exception as error:  # noqa: BLE001 - the last line of defence: no traceback for users
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        frame = traceback.extract_tb(error.__traceback__)[-1]
        _err.print(
            f"error: internal error in sgdfuse: {type(error).__name__}: {error} "
            f"(at {Path(frame.filename).name}:{frame.lineno} in {frame.name}); please report it with the model "
            f"and the command; {TRACEBACK_ENV}=1 shows the traceback",
            markup=False, highlight=False, soft_wrap=True,
        )
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)  # as typer's standalone mode does, success included


if __name__ == "__main__":  # pragma: no cover
    main()
