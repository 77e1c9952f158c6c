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
from sgdfuse.errors import SgdfuseError

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fuse momentum-SGD updates in training graphs into one Ascend SGD operator, and prove it.",
    pretty_exceptions_enable=False,
)
_out = Console()
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
