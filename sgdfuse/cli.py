"""The ``sgdfuse`` command line. Commands are thin: they call the library and format its reports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

import sgdfuse
from sgdfuse import contract
from sgdfuse import api
from sgdfuse.errors import SgdfuseError
from sgdfuse.output import OutputBatch, resolve_destination, write_bytes
from sgdfuse.report import Report
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


def _version(value: bool) -> None:
    if value:
        _out.print(f"sgdfuse {sgdfuse.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Fuse momentum-SGD updates in training graphs into one Ascend SGD operator, and prove it."""


@app.command("contract")
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

    lines = Table(title="Product lines")
    for column in ("product line", "SoC versions", "dtypes", "formats", "dynamic shape"):
        lines.add_column(column)
    for line in contract.PRODUCT_LINES:
        socs = ", ".join(line.soc_versions) if line.soc_versions else "Ascend950PR_95xx, Ascend950DT_95xx"
        lines.add_row(
            line.name,
            socs,
            ", ".join(contract.dtype_name(d) for d in line.dtypes),
            ", ".join(line.formats),
            "yes" if line.dynamic_shape else "no",
        )
    _out.print(lines)


def _default_output(source: Path) -> Path:
    name = source.name[: -len(".onnx")] if source.name.endswith(".onnx") else source.name
    return source.with_name(name + ".sgdfused.onnx")


def _print_report(report: Report) -> None:
    if report.fused:
        table = Table(title=f"Fused updates ({len(report.fused)})")
        for column in ("parameters", "gradient", "momentum buffer", "lr", "momentum", "dampening", "weight decay", "form"):
            table.add_column(column)
        for f in report.fused:
            form = ", ".join(x for x in ("nesterov" if f.nesterov else "", "maximize" if f.maximize else "") if x) or "plain"
            table.add_row(
                f.parameters, f.gradient, f.accum, str(f.learning_rate), str(f.momentum), f"{f.dampening:g}",
                f"{f.weight_decay:g}", form,
            )
        _out.print(table)
    if report.refused:
        table = Table(title=f"Refused candidates ({len(report.refused)})")
        for column in ("candidate", "reason", "why"):
            table.add_column(column)
        for r in report.refused:
            why = r.detail
            if r.equation:
                why += f"\nfound:   {r.equation}"
            if r.nearest:
                why += f"\nnearest: {r.nearest}"
            if r.differing:
                why += f"\ndiffers: {r.differing}"
            table.add_row(r.candidate, r.reason, why)
        _out.print(table)
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
        checked = len(report.verification.updates)
        failed = sum(1 for u in report.verification.updates if not u["passed"])
        worst = max((u["max_bound_ratio"] for u in report.verification.updates), default=0.0)
        _out.print(
            f"Verification: {checked} update(s) run in {report.verification.runner} for {report.verification.steps} chained steps; "
            f"{checked - failed} agree within the derived bound (worst {worst:.2g} of the bound)"
            + (f", {failed} failed and were left unfused" if failed else "")
        )
        notes = [u["note"] for u in report.verification.updates if u.get("note")]
        if notes:
            # A precision or size that could not be run is said, never passed over in silence.
            _out.print(f"Verification note ({len(notes)} update(s)): {notes[0]}", markup=False)
    elif not report.verification.enabled:
        _out.print("Verification: off" + ("" if report.written else " (inspect is a dry run; add --verify to run the check)"))
    if not report.fused and not report.refused:
        already = "already fused by sgdfuse; " if report.already_fused else ""
        _out.print(f"No momentum-SGD update candidates found ({already}nothing to do).")


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


@app.command("optimize")
def optimize_command(
    model: Path = typer.Argument(..., help="ONNX training graph to optimise."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Where to write the fused model (default: MODEL.sgdfused.onnx)."),
    report_path: Optional[Path] = typer.Option(None, "--report", help="Also write the report as JSON here."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Check every rewrite in onnxruntime before writing it."),
    steps: int = typer.Option(3, "--steps", min=1, help="Chained steps of the check."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Fuse every momentum-SGD update of MODEL into one ai.sgdfuse::SGD node each, verify, and write the result."""
    mindir = model.name.endswith(".mindir")  # a MindSpore MindIR train step: sgdfuse.mindspore
    if mindir:
        from sgdfuse.mindspore.mindir import MindIRResult, optimize_mindir_file

        output = output or Path(MindIRResult.default_output(model))
    destination = output or _default_output(model)
    for path in (destination, report_path):
        if path is not None:
            resolve_destination(path)  # fail before the work, not after it
    with _progress(model, quiet) as tell:
        if mindir:
            result = optimize_mindir_file(model, verify=verify, steps=steps)
        else:
            result = api.optimize(model, verify=verify, steps=steps, progress=tell)
        tell("save")
        with OutputBatch() as batch:  # the model and the report are written together or not at all
            result.save(destination, batch=batch)
            if report_path is not None:
                batch.stage(report_path, (result.report.to_json() + "\n").encode())
            batch.commit()
    _print_report(result.report)
    _out.print(f"Wrote {destination} ({result.report.nodes_before} → {result.report.nodes_after} nodes)")


@app.command("inspect")
def inspect_command(
    model: Path = typer.Argument(..., help="ONNX training graph to analyse."),
    report_path: Optional[Path] = typer.Option(None, "--report", help="Write the report as JSON here."),
    verify: bool = typer.Option(False, "--verify/--no-verify", help="Also run the differential check."),
) -> None:
    """Report which updates of MODEL would fuse and why the other candidates would not; write nothing else."""
    report = api.inspect(model, verify=verify)
    if report_path is not None:
        _write_text(report_path, report.to_json())
    _print_report(report)


@app.command("check")
def check_command(
    original: Path = typer.Argument(..., help="The original ONNX model."),
    fused: Path = typer.Argument(..., help="Its fused form (from sgdfuse optimize)."),
    steps: int = typer.Option(3, "--steps", min=1, help="Chained steps to run."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
) -> None:
    """Run ORIGINAL and FUSED in onnxruntime on the same seeded inputs for STEPS chained steps, natively and in DOUBLE, in lockstep and in place; exit 0 only if every output and every in-place state write agrees."""
    from sgdfuse.verify import check_models

    try:
        result = check_models(
            api.load_model(original, load_external_data=True), api.load_model(fused, load_external_data=True), steps=steps, seed=seed
        )
    except ValueError as error:
        raise SgdfuseError(f"{fused}: {error}") from error
    except SgdfuseError:
        raise
    except ONNXRUNTIME_ERRORS as error:  # onnxruntime refuses a model it cannot run (e.g. a preview training op)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SgdfuseError(f"{original} / {fused}: onnxruntime cannot run the models: {first_line}") from error
    table = Table(title=f"{original.name} vs {fused.name}: {steps} chained steps")
    for column in ("output", "compared as", "max |difference|", "of bound", "agrees"):
        table.add_column(column)
    for entry in result.outputs:
        table.add_row(
            entry["name"], entry["kind"], f"{entry['max_abs_error']:.3g}",
            f"{entry['max_bound_ratio']:.2g}" if entry["kind"] != "exact" else "-",
            "yes" if entry["passed"] else "NO: " + entry["message"],
        )
    for entry in result.in_place:
        # The value each side writes into a state the SGD op updates in place, steps chained per side.
        table.add_row(
            f"{entry['name']} (in place: {entry['original']} / {entry['fused']})", entry["kind"], f"{entry['max_abs_error']:.3g}",
            f"{entry['max_bound_ratio']:.2g}", "yes" if entry["passed"] else "NO: " + entry["message"],
        )
    _out.print(table)
    _out.print(f"Ran: {', '.join(result.runs)}", markup=False)
    if result.note:
        _out.print(f"Note: {result.note}", markup=False)
    if not result.passed:
        _err.print("error: the models disagree", markup=False)
        raise typer.Exit(1)
    _out.print("All outputs agree.")


@app.command("lower")
def lower_command(
    model: Path = typer.Argument(..., help="Fused ONNX model (an unfused one is optimised first)."),
    soc: str = typer.Option(..., "--soc", help="ATC SoC version, e.g. Ascend910B2, Ascend310P3, Ascend950PR_9599."),
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
) -> None:
    """Lower MODEL to the Ascend Graph Engine for one SoC (GE IR .air, or ONNX prepared for ATC).

    An unfused MODEL is optimised first (with verification); one line says what fused, what was refused and
    why, and whether verification ran, and a warning says so when no update fused at all.
    """
    from collections import Counter

    from sgdfuse import lowering
    from sgdfuse.fused_op import is_sgd_node
    from sgdfuse.lowering import onnx_atc
    from sgdfuse.lowering.lower import prepare

    if output_format not in ("air", "onnx-atc"):
        raise typer.BadParameter(f"{output_format!r} is not one of 'air', 'onnx-atc'", param_hint="--format")
    if output_format == "onnx-atc" and json_path is not None:
        raise typer.BadParameter("--json describes a GE graph; use it with --format air", param_hint="--json")
    contract.product_line_for_soc(soc)  # an unknown SoC fails before the work, not after it
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
    for path in destinations:
        if path is not None:
            resolve_destination(path)

    fused, report = prepare(model)
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
    if not any(is_sgd_node(node) for node in fused.graph.node):
        _err.print(
            f"warning: {model.name} has no momentum-SGD update to lower (no ai.sgdfuse::SGD node after optimising); "
            f"the output has no SGD op. `sgdfuse inspect {model}` shows why candidates were refused.",
            markup=False, highlight=False, soft_wrap=True,
        )

    if output_format == "onnx-atc":
        written, plugin = onnx_atc.write_onnx_atc(fused, destination, soc=soc, optimise=False)
        _out.print(f"Wrote {written} (SGD nodes as {onnx_atc.ATC_OP_KEY}, standard nodes in domain ai.onnx)")
        _out.print(f"Wrote {plugin} (ATC op plugin source mapping {onnx_atc.ATC_OP_KEY} to GE SGD)")
        return
    lowered = lowering.lower(fused, soc=soc, optimise=False)
    with OutputBatch() as batch:  # step graph, init graph and JSON together or not at all
        lowered.save_air(destination, batch=batch)
        lowered.save_init_air(init_destination, batch=batch)
        if json_path is not None:
            batch.stage(json_path, (lowered.to_json() + "\n").encode())
        batch.commit()
    table = Table(title=f"GE graph for {soc} ({lowered.product_line.name})")
    for column in ("ops", "SGD ops", "state variables", "inputs (Data)", "outputs"):
        table.add_column(column)
    table.add_row(
        str(len(lowered.graph.op)), str(len(lowered.sgd_ops)), str(len(lowered.state)),
        ", ".join(lowered.inputs) or "-", ", ".join(lowered.outputs) or "-",
    )
    _out.print(table)
    _out.print(f"Wrote {destination} (step graph) and {init_destination} (init graph: assigns the state variables)")
    if json_path is not None:
        _out.print(f"Wrote {json_path}")


def _write_text(path: Path, text: str) -> None:
    write_bytes(path, (text + "\n").encode())


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point. Usage errors are typer's (exit 2); a :class:`SgdfuseError` becomes one
    line on stderr and exit 1."""
    try:
        app(args=argv, prog_name="sgdfuse")
    except SgdfuseError as error:
        _err.print(f"error: {error}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
