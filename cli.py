"""The `miras` command line (installed as `miras.cli`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from miras.compiler.pipeline import compile as compile_spec
from miras.components import CATALOGUE
from miras.errors import DerivationError, SpecError
from miras.spec import load_spec

app = typer.Typer(
    help="Explore the MIRAS design space: validate, derive and check memory-rule specs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

SpecPath = Annotated[Path, typer.Argument(help="A spec YAML file.", show_default=False)]


def _fail(error: Exception, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {error}", markup=True, highlight=False)
    return typer.Exit(code)


@app.command()
def validate(
    specs: Annotated[list[Path], typer.Argument(help="Spec YAML files.", show_default=False)],
) -> None:
    """Check that specs are well formed; every problem is reported at once."""
    failed = 0
    for path in specs:
        try:
            spec = load_spec(path)
        except SpecError as error:
            failed += 1
            err.print(str(error), highlight=False, markup=False)
            continue
        out.print(f"[green]ok[/green]  {path}  ({spec.name})", highlight=False)
    if failed:
        raise typer.Exit(1)


@app.command()
def components(
    kind: Annotated[
        str | None,
        typer.Argument(
            help=f"One of: {', '.join(CATALOGUE)}. All when omitted.", show_default=False
        ),
    ] = None,
) -> None:
    """The component catalogue: every component, its parameters, gates and formula."""
    if kind is not None and kind not in CATALOGUE:
        raise _fail(ValueError(f"unknown kind {kind!r}; allowed: {', '.join(CATALOGUE)}"), 2)
    for field, members in CATALOGUE.items():
        if kind is not None and field != kind:
            continue
        table = Table(title=f"{field}", title_justify="left", show_lines=True)
        for column in ("kind", "parameters (defaults)", "gates", "formula"):
            table.add_column(column, overflow="fold")
        for name, cls in members.items():
            params = []
            for fname, info in cls.model_fields.items():
                if fname == "kind":
                    continue
                default = "required" if info.is_required() else repr(info.default)
                params.append(f"{fname} = {default}")
            gates = ", ".join(f"{g} in {r}" for g, r in cls.gateable.items())
            table.add_row(name, "\n".join(params), gates, f"{cls.summary()}\n{cls.equation()}")
        out.print(table)


@app.command()
def derive(
    spec: SpecPath,
    latex: Annotated[bool, typer.Option("--latex", help="Print LaTeX instead of text.")] = False,
    code: Annotated[
        bool, typer.Option("--code", help="Also print the emitted torch code.")
    ] = False,
) -> None:
    """Derive a spec's update rule and print it."""
    try:
        rule = compile_spec(load_spec(spec), checked=False)
    except (SpecError, DerivationError) as error:
        raise _fail(error) from None
    derivation = rule.derivation()
    out.print(derivation.latex if latex else derivation.text, highlight=False, markup=False)
    if code:
        out.print("\n# emitted torch code\n" + rule.source, highlight=False, markup=False)


@app.command()
def check(
    spec: SpecPath,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
) -> None:
    """Check every derived piece against autograd or a numerical argmin; exit 1 on a failure."""
    try:
        rule = compile_spec(load_spec(spec), checked=False)
    except (SpecError, DerivationError) as error:
        raise _fail(error) from None
    results = rule.check(seed=seed)
    table = Table(title=f"checks of {rule.spec.name} (float64, seed {seed})", title_justify="left")
    for column in ("piece", "max rel. error", "tolerance", "result"):
        table.add_column(column)
    for r in results:
        verdict = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
        table.add_row(r.piece, f"{r.error:.2e}", f"{r.tolerance:.0e}", verdict)
    out.print(table)
    if not all(r.passed for r in results):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
