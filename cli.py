"""The `miras` command line (installed as `miras.cli`)."""

from __future__ import annotations

import inspect
import os
import shlex
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from miras.components import CATALOGUE
from miras.errors import DerivationError, SpecError
from miras.spec import load_spec
from miras.training.config import RANK_TIMEOUT, TrainConfig

app = typer.Typer(
    help="Explore the MIRAS design space: validate, derive and check memory-rule specs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

# Off a terminal (a CI log, `make demo | tee`) rich lays tables out in 80 columns and folds
# every longer cell ("comple / te"). Tables do not expand, so there a wide console gives each
# table the width its cells need; an explicit COLUMNS still decides.
OFF_TERMINAL_WIDTH = 1000


@app.callback()
def _console_width() -> None:
    # Runs before every command: the stream is the one this command prints to.
    off_terminal = not out.is_terminal and "COLUMNS" not in os.environ
    out.width = OFF_TERMINAL_WIDTH if off_terminal else None


SpecPath = Annotated[Path, typer.Argument(help="A spec YAML file.", show_default=False)]


def _fail(error: Exception, code: int = 1) -> typer.Exit:
    # escape: a message's own brackets (a list of solutions, [elementwise]) are not markup.
    err.print(f"[red]error:[/red] {escape(str(error))}", markup=True, highlight=False)
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
            formula = f"{cls.summary()}\n{cls.equation()}"  # brackets in a formula are not markup
            table.add_row(*(escape(c) for c in (name, "\n".join(params), gates, formula)))
        out.print(table)


@app.command()
def derive(
    spec: SpecPath,
    latex: Annotated[bool, typer.Option("--latex", help="Print LaTeX instead of text.")] = False,
    code: Annotated[
        bool, typer.Option("--code", help="Also print the emitted torch code.")
    ] = False,
) -> None:
    """Derive a spec's update rule and print it; exit 1, with compile's error, on a rule that
    compile refuses (one whose derivation fails, or whose derived pieces fail their checks)."""
    from miras.rule import compile as compile_spec  # torch and sympy: only where a rule is made

    try:
        # Checked, as miras.compile is: derive never prints a rule that compile then refuses.
        rule = compile_spec(load_spec(spec))
    except (SpecError, DerivationError) as error:
        raise _fail(error) from None
    derivation = rule.derivation()
    out.print(derivation.latex if latex else derivation.text, highlight=False, markup=False)
    if code:
        out.print("\n# emitted torch code\n" + rule.source, highlight=False, markup=False)


@app.command()
def kernel(
    spec: SpecPath,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the source to FILE.")
    ] = None,
    report: Annotated[
        bool,
        typer.Option(
            "--report",
            help="Compile every kernel for a GPU (no GPU needed) and print registers, spills "
            "and shared memory per kernel and autotune config.",
        ),
    ] = False,
    target: Annotated[str, typer.Option(help="With --report: sm_80 or sm_90.")] = "sm_90",
    dim: Annotated[int, typer.Option(help="With --report: head width, 64, 128 or 256.")] = 128,
    chunk_size: Annotated[
        int | None,
        typer.Option(
            help="With --report: the chunk size (default: the spec's, 64 // window.c with the "
            "exact form, else 16)."
        ),
    ] = None,
    shape: Annotated[
        str, typer.Option(help="With --report: B,T,H of the launch grid.")
    ] = "1,2048,8",
    precision: Annotated[
        str,
        typer.Option(
            help="With --report: tl.dot's input precision on float32 tiles: tf32 (the "
            "default, TF32 tensor cores as fla), or the accuracy options ieee (float32 FMA "
            "products) and tf32x3 (three TF32 products)."
        ),
    ] = "tf32",
    dtype: Annotated[
        str,
        typer.Option(
            help="With --report: the inputs' dtype the launches are built for, fp32 or bf16 "
            "(a launcher that does not take it yet is named, exit 1)."
        ),
    ] = "fp32",
) -> None:
    """Print (or write) the Triton module the compiler emits for a matrix-memory spec; with
    --report, compile its kernels for a GPU and print what each uses."""
    from miras.compiler.pipeline import kernel_source

    if report:
        _kernel_report(spec, target, dim, chunk_size, shape, precision, dtype)
        return
    try:
        source = kernel_source(load_spec(spec))
    except (SpecError, DerivationError, ValueError) as error:
        raise _fail(error) from None
    if output is None:
        out.print(source, highlight=False, markup=False)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(source)
    out.print(f"wrote {output} ({len(source.splitlines())} lines)", highlight=False)


def _kernel_report(
    spec: Path,
    target: str,
    dim: int,
    chunk_size: int | None,
    shape: str,
    precision: str,
    dtype: str,
) -> None:
    from miras.checks import gpu_compile
    from miras.derive.emit import cache_dir
    from miras.runtime.inputs import TRITON_PRECISIONS

    try:
        found = gpu_compile.check_target(target)
        gpu_compile.check_width(dim)
        grid_shape = gpu_compile.parse_shape(shape)
        if chunk_size is None:
            chunk_size = gpu_compile.default_chunk(load_spec(spec))
        if chunk_size < 1:
            raise ValueError(f"chunk-size: expected a positive integer, got {chunk_size}")
        if precision not in TRITON_PRECISIONS:
            raise ValueError(
                f"precision: expected one of {', '.join(TRITON_PRECISIONS)}, got {precision!r}"
            )
        gpu_compile.check_dtype(dtype)
        rows = gpu_compile.compile_report(
            load_spec(spec),
            target,
            dim,
            chunk_size,
            grid_shape,
            cache_dir() / "gpu_compile",
            precision,
            dtype,
        )
    except (SpecError, DerivationError, ValueError) as error:
        raise _fail(error) from None
    title = (
        f"{load_spec(spec).name} on {found.name} ({found.gpu}): d = {dim}, chunk {chunk_size}, "
        f"tl.dot {precision}, {dtype} inputs, (B, T, H) = {grid_shape}; shared limit {found.shared_limit} B, spill "
        f"bound {gpu_compile.SPILL_BOUND} B"
    )
    grid = Table(title=title, title_justify="left")
    for column in gpu_compile.COLUMNS:
        grid.add_column(column)
    for cells in gpu_compile.table(rows):
        grid.add_row(*(escape(c) for c in cells))
    out.print(grid)
    problems = gpu_compile.over_limits(rows)
    for line in problems:
        err.print(escape(line), highlight=False)
    if problems:
        raise typer.Exit(1)


@app.command()
def check(
    spec: SpecPath,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
) -> None:
    """Check every derived piece against autograd or a numerical argmin, then the whole rule
    end to end on every backend against an autograd oracle; exit 1 on a failure."""
    from miras.resources import ResourceError, check_fits
    from miras.rule import compile as compile_spec

    try:
        rule = compile_spec(load_spec(spec), checked=False)
        check_fits(rule)  # before the check allocates its traces
    except (SpecError, DerivationError, ResourceError) as error:
        raise _fail(error) from None
    results = rule.check(seed=seed)
    title = f"checks of {rule.spec.name} (float64 unless marked, seed {seed})"
    table = Table(title=title, title_justify="left")
    for column in ("piece", "max rel. error", "tolerance", "result"):
        table.add_column(column)
    for r in results:
        verdict = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
        table.add_row(r.piece, f"{r.error:.2e}", f"{r.tolerance:.0e}", verdict)
    out.print(table)
    from miras.checks.end_to_end import triton_reason

    left_out = triton_reason(rule)
    if left_out is not None:
        out.print(f"end-to-end triton: not run ({left_out})", highlight=False)
    if not all(r.passed for r in results):
        raise typer.Exit(1)


# Training and evaluation (docs/training.md) ----------------------------------------------------

KeyValues = Annotated[
    list[str] | None,
    typer.Option(
        help="key=value, repeatable; values are read as YAML scalars.", show_default=False
    ),
]


def _key_values(pairs: list[str] | None, what: str) -> dict:
    import yaml

    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: expected key=value, got {pair!r}")
        options[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return options


def _make_task(name: str, options: dict):
    """The task named `name` with `options`; a bad name or option is one ValueError."""
    from miras.tasks import TASKS, make_task

    if name not in TASKS:
        raise ValueError(f"--task: unknown task {name!r}; allowed: {', '.join(TASKS)}")
    try:
        return make_task(name, **options)
    except TypeError as error:  # an option the task's constructor does not take
        raise ValueError(f"--task-option: task {name!r}: {error}") from None


def _setting(name: str) -> str:
    return TrainConfig.model_fields[name].description or ""


# The help of a training setting where the command line says more than its description.
SETTING_HELP = {
    "steps": _setting("steps") + " With --resume --extend: the new total.",
    "log_every": "Steps between training records in metrics.jsonl; off a terminal, a progress "
    "line comes about every tenth of the run, at a multiple of this.",
}


def _option_type(annotation: Any) -> Any:
    """A setting's type as typer takes it: `X | None` stays optional; a Literal of strings is
    a str (TrainConfig names a bad value with the allowed ones)."""
    args = typing.get_args(annotation)
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is Union
    optional = union and type(None) in args
    inner = next(a for a in args if a is not type(None)) if optional else annotation
    if typing.get_origin(inner) is Literal:
        inner = type(typing.get_args(inner)[0])
    return inner | None if optional else inner


def setting_options(config: type[TrainConfig] = TrainConfig) -> list[inspect.Parameter]:
    """One typer option per field of `config`, in field order: --name-with-dashes, the
    field's type, default and description (`SETTING_HELP` where the command line says more).
    A default of None (one that depends on other settings) is not shown."""
    options = []
    for name, info in config.model_fields.items():
        option = typer.Option(
            help=SETTING_HELP.get(name, info.description or ""),
            show_default=info.default is not None,
        )
        kind = Annotated[_option_type(info.annotation), option]
        keyword = inspect.Parameter.KEYWORD_ONLY
        options.append(inspect.Parameter(name, keyword, default=info.default, annotation=kind))
    return options


def with_settings(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with its `**settings` replaced by `setting_options()`, placed before its
    first keyword-only parameter: every TrainConfig field is an option of the command, with
    the defaults and help that miras.train and studies use, and a new field needs no edit
    here. typer reads the signature; the settings reach `command` as keywords."""
    signature = inspect.signature(command, eval_str=True)
    params = list(signature.parameters.values())
    if params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{command.__name__}: takes the settings as **settings")
    params.pop()
    at = next((i for i, p in enumerate(params) if p.kind is p.KEYWORD_ONLY), len(params))
    params[at:at] = setting_options()
    command.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return command


@app.command()
@with_settings
def train(
    ctx: typer.Context,
    spec: SpecPath,
    task: Annotated[str, typer.Option(help="The task: mqar, mad, niah, text, ...")],
    task_option: KeyValues = None,
    model: KeyValues = None,
    # Here: one option per TrainConfig field (with_settings), the one set of settings and
    # defaults that miras.train and studies use.
    *,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Run directory (metrics.jsonl, checkpoint.pt); default runs/SPEC-TASK-seedSEED "
            "(SPEC the spec's name, e.g. runs/deltanet-mqar-seed0).",
            show_default=False,
        ),
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out.")] = False,
    extend: Annotated[
        bool,
        typer.Option(
            "--extend",
            help="With --resume: train on to a larger --steps than the run planned. The "
            "learning-rate schedule is re-planned over the new total, so the result differs "
            "from a run planned that long.",
        ),
    ] = False,
    time_limit: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (then evaluate).")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch CPU threads (1 is fastest for tiny models).")
    ] = None,
    progress: Annotated[
        bool, typer.Option(help="Show progress on stderr (plain lines off a terminal).")
    ] = True,
    rank_timeout: Annotated[
        float,
        typer.Option(
            help="Under torchrun: seconds a rank waits for the others (a step, rank 0's "
            "evaluation and checkpoint) before it gives up on them."
        ),
    ] = RANK_TIMEOUT,
    **settings: Any,
) -> None:
    """Train the spec's model on a task; --model key=value overrides the spec's model section.
    Ctrl-C saves a checkpoint and prints the command that resumes it (exit code 130).
    Several processes: torchrun --nproc_per_node N -m miras.cli train ... (docs/training.md)."""
    import torch

    from miras.training import train as run_training

    try:
        loaded = load_spec(spec)
        overrides = _key_values(model, "--model")
        if overrides:
            data = loaded.normalized()
            data["model"] = {**data["model"], **overrides}
            try:
                loaded = load_spec(data)
            except SpecError as error:
                raise SpecError(f"{spec} with --model {overrides}", error.problems) from None
        the_task = _make_task(task, _key_values(task_option, "--task-option"))
        if threads is not None:
            torch.set_num_threads(threads)
        directory = out_dir or Path("runs") / f"{loaded.name}-{task}-seed{settings['seed']}"
        result = run_training(
            loaded,
            the_task,
            **settings,
            out_dir=directory,
            resume=resume,
            extend=extend,
            time_limit=time_limit,
            progress=progress,
            rank_timeout=rank_timeout,
        )
    except (ValueError, FileNotFoundError) as error:  # SpecError, TrainingDiverged, options
        raise _fail(error) from None
    except KeyboardInterrupt as stop:
        raise _interrupted(stop, ctx) from None
    except RuntimeError as error:
        raise _rank_failed(error, ctx) from None
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun, rank 0 reports (every rank has the same result)
    out.print(f"{loaded.name} on {task}: step {result.steps}", highlight=False)
    _print_metrics(result.metrics)
    out.print(f"run directory: {directory}", highlight=False)


def _interrupted(stop: KeyboardInterrupt, ctx: typer.Context) -> typer.Exit:
    """Ctrl-C: where the checkpoint is and the command that resumes it; exit code 130. Under
    torchrun every rank stops at the same step and rank 0 alone says so."""
    from miras.training import TrainingInterrupted

    if os.environ.get("RANK", "0") != "0":
        return typer.Exit(130)
    if isinstance(stop, TrainingInterrupted) and stop.checkpoint is not None:
        err.print(str(stop), highlight=False, markup=False)
        err.print(
            f"resume with: {_resume_command(ctx, stop.checkpoint.parent)}",
            highlight=False,
            markup=False,
        )
    else:
        err.print("interrupted before the run wrote a checkpoint: nothing was saved")
    return typer.Exit(130)


def _rank_failed(error: RuntimeError, ctx: typer.Context) -> Exception:
    """Under torchrun, another rank died: where the run stands and how to resume (exit 1)."""
    from miras.training import RankFailure

    if not isinstance(error, RankFailure):
        return error
    err.print(f"error: {error}", highlight=False, markup=False)
    if error.checkpoint is not None:
        err.print(
            f"resume with: {_resume_command(ctx, error.checkpoint.parent)}",
            highlight=False,
            markup=False,
        )
    return typer.Exit(1)


def _resume_command(ctx: typer.Context, directory: Path) -> str:
    """This command line as given (defaults left out), with --out DIRECTORY --resume; under
    torchrun, the torchrun command that starts as many processes."""
    import shlex

    from miras.training.distributed import launcher

    words = [*launcher(), ctx.info_name or "train"]
    for param in ctx.command.params:
        name = param.name
        source = ctx.get_parameter_source(name) if name else None
        if name in ("out_dir", "resume") or source is None or source.name == "DEFAULT":
            continue
        value = ctx.params[name]
        if not param.opts[0].startswith("-"):  # an argument
            words.append(str(value))
        elif isinstance(value, bool):
            words.append(param.opts[0] if value else param.secondary_opts[0])
        elif isinstance(value, list | tuple):
            words += [word for item in value for word in (param.opts[0], str(item))]
        else:
            words += [param.opts[0], str(value)]
    return shlex.join([*words, "--out", str(directory), "--resume"])


def _print_metrics(metrics: dict[str, float]) -> None:
    table = Table()
    table.add_column("metric")
    table.add_column("value")
    for name, value in metrics.items():
        table.add_row(name, f"{value:.4f}")
    out.print(table)


@app.command(name="eval")
def evaluate_command(
    checkpoint: Annotated[Path, typer.Argument(help="checkpoint.pt or its run directory.")],
    task: Annotated[
        str | None,
        typer.Option(
            help="The task the model is scored on. Default: the one it trained on, with the "
            "options it trained with.",
            show_default=False,
        ),
    ] = None,
    task_option: Annotated[
        list[str] | None,
        typer.Option(
            help="key=value, repeatable (values read as YAML scalars); replaces the run's "
            "option of that name.",
            show_default=False,
        ),
    ] = None,
    batches: Annotated[int, typer.Option(help="Batches (of each slice).")] = 8,
    batch_size: Annotated[
        int | None, typer.Option(help="Default: the training batch size.")
    ] = None,
    split: Annotated[
        str, typer.Option(help="valid, or test (per slice: MQAR's test_grid).")
    ] = "valid",
) -> None:
    """Score a checkpoint on a task's validation batches (by default the run's own task)."""
    from miras.training import evaluate, load_checkpoint, recorded_task

    try:
        options = _key_values(task_option, "--task-option")
        data = load_checkpoint(checkpoint)
        the_task, notes = recorded_task(data, task, options)
        for note in notes:
            err.print(f"note: {note}", highlight=False, markup=False)
        metrics = evaluate(data, the_task, batches=batches, batch_size=batch_size, split=split)
    except (ValueError, FileNotFoundError) as error:
        raise _fail(error) from None
    shown = ", ".join(f"{key}={value}" for key, value in the_task.options().items())
    out.print(f"{checkpoint} on {the_task.name} ({shown})", highlight=False)
    _print_metrics(metrics)


@app.command(name="export-hf")
def export_hf(
    run_dir: Annotated[Path, typer.Argument(help="A training run's directory (or checkpoint.pt).")],
    out_dir: Annotated[Path, typer.Argument(help="The transformers directory to write.")],
) -> None:
    """Write a run's trained model as a transformers model (config.json + model.safetensors):
    AutoModelForCausalLM.from_pretrained(OUT_DIR) after `import miras.hf` (docs/hf.md)."""
    try:
        from miras.hf.convert import export_run
    except ImportError as error:
        raise _fail(
            ImportError(f"export-hf needs the hf extra (pip install 'miras[hf]'): {error}")
        ) from None
    try:
        model = export_run(run_dir, out_dir)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise _fail(error) from None
    out.print(
        f"wrote {out_dir}: {model.config.model['variant']} model of spec "
        f"'{model.model.lm.spec.name}', vocabulary {model.config.vocab_size}",
        highlight=False,
    )


# ---------------------------------------------------------------------------------------------
# Search (miras.search, docs/search.md). Imports stay inside the commands: optuna and torch
# load only for the commands that need them.

StudyArg = Annotated[
    str,
    typer.Argument(
        help="A study YAML file (or, for report/export, a study name).", show_default=False
    ),
]
StorageOpt = Annotated[
    str | None,
    typer.Option(
        "--storage",
        help="SQLAlchemy URL, e.g. postgresql://user:pass@host/db. Default: sqlite:///runs/<study>.db",
        show_default=False,
    ),
]
NameOpt = Annotated[
    str | None,
    typer.Option(
        "--name", help="Study name in the storage. Default: the YAML's name.", show_default=False
    ),
]


@app.command()
def search(
    study: StudyArg,
    trials: Annotated[
        int | None,
        typer.Option(
            help="Finished trials the study should hold (default: the YAML's).", show_default=False
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(help="Start no trial after this many seconds.", show_default=False),
    ] = None,
    storage: StorageOpt = None,
    workers: Annotated[int, typer.Option(help="Worker processes on this machine.")] = 1,
    name: NameOpt = None,
    threads: Annotated[
        int, typer.Option(help="torch threads per worker (small models: 1 is fastest).")
    ] = 1,
) -> None:
    """Run a study; re-running it resumes, and the same --storage on other machines joins it."""
    import optuna

    from miras.search import SearchError, StudyError, load_study
    from miras.search import search as run_search
    from miras.search.progress import SearchProgress
    from miras.search.run import Terminated

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        definition = load_study(Path(study))
        budget = trials or definition.trials
        bar = SearchProgress(name or definition.name, budget, definition.metrics[0], err)
        with bar:
            summary = run_search(
                definition, trials=budget, timeout=timeout, storage=storage, workers=workers,
                name=name, threads=threads, progress=bar,
            )  # fmt: skip
    except (StudyError, SearchError) as error:
        raise _fail(error) from None
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        err.print(
            f"interrupted{' (SIGTERM)' if terminated else ''}: the running trials are marked "
            "failed and queued again, the storage is consistent; re-run the same command to "
            "resume",
            highlight=False,
        )
        raise typer.Exit(143 if terminated else 130) from None
    c = summary.counts
    out.print(
        f"study {summary.name}: {c.finished} finished ({c.complete} complete, {c.pruned} pruned"
        f"{f', {c.retried} retried' if c.retried else ''}), {c.failed} failed, "
        f"in {summary.seconds:.0f} s; storage {summary.storage}",
        highlight=False,
    )
    if summary.table is not None and not summary.table.empty:
        print_summary(out, summary.table, definition.metrics, top=10, name=summary.name)
    # The same study in the same storage: a search under --name is reported under it too.
    where = [f"--storage {shlex.quote(storage)}"] if storage else []
    where += [f"--name {shlex.quote(name)}"] if name else []
    out.print(" ".join(["next: miras report", shlex.quote(study), *where]), highlight=False)


@app.command()
def report(
    study: StudyArg,
    storage: StorageOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Folder. Default: runs/<study>-report.", show_default=False
        ),
    ] = None,
    name: NameOpt = None,
    top: Annotated[int, typer.Option(help="Rows of the terminal table.")] = 10,
) -> None:
    """Leaderboard (CSV and a table) and an HTML report with plotly figures."""
    import optuna

    from miras.search import SearchError
    from miras.search.report import write_report
    from miras.search.storage import open_existing
    from miras.search.study import StudyError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        handle, definition = open_existing(study, storage, name)
        result = write_report(
            handle, definition, output or Path("runs") / f"{handle.study_name}-report"
        )
    except (StudyError, SearchError) as error:
        raise _fail(error) from None
    board = result.leaderboard
    print_summary(out, result.summary, definition.metrics, top=top, name=handle.study_name)
    # Why trials were pruned, one line per reason (the leaderboard CSV has every column).
    pruned = board[board["state"] == "pruned"] if not board.empty else board
    reasons: dict[str, list[str]] = {}
    for _, row in pruned.iterrows():
        reasons.setdefault(str(row.get("reason") or "no reason recorded"), []).append(
            str(row["trial"])
        )
    for reason, numbers in reasons.items():
        out.print(f"pruned (trial {', '.join(numbers)}): {reason}", highlight=False)
    for note in result.notes:
        out.print(f"note: {note}", highlight=False, markup=False)  # notes hold [lo, hi, n]
    out.print(
        f"wrote {result.csv} and {result.html} ({len(result.figures)} figures)", highlight=False
    )


SUMMARY_WIDTH = 100  # the terminal summary's most columns, at any terminal width


def _interval(row, metric: str, bracket: bool) -> str:
    """`mean [low, high]` (bracket) or `mean ±half`; the mean alone without an interval."""
    mean, low, high = row[metric], row[f"{metric}_low"], row[f"{metric}_high"]
    if low != low or high != high or low == high:  # NaN: one seed; equal: no spread
        return f"{mean:.4g}"
    if bracket:
        return f"{mean:.4g} [{low:.3g}, {high:.3g}]"
    return f"{mean:.4g} ±{max(high - mean, mean - low):.2g}"


def print_summary(console: Console, frame, metrics: list[str], *, top: int, name: str) -> None:
    """The compact summary of a study (miras.search.report.summary_data): one row per
    configuration, each objective's mean [95% t interval over the seeds], and whether Welch's
    test separates it from the best on the first objective; at most SUMMARY_WIDTH columns. A
    configuration whose sweep did not bracket its selected value says so after its label:
    `lr=0.01 (lr at the high edge)`."""
    from rich import box

    width = min(console.width, SUMMARY_WIDTH)
    intervals = frame[[f"{m}_low" for m in metrics]].notna().to_numpy().any()
    bracket = len(metrics) <= 2
    what = "mean [95% t interval over the seeds]" if bracket else "mean ±95% t half-width"
    table = Table(
        title=f"study {name}: best {min(top, len(frame))} of {len(frame)} complete"
        + (f"; {what}" if intervals else ""),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # Narrow consoles fold the label first, then break a number from its interval; nothing
    # is cut short.
    table.add_column("trial", justify="right", no_wrap=True, min_width=5)
    table.add_column("configuration", overflow="fold", min_width=12)
    for metric in metrics:
        table.add_column(metric, justify="right", overflow="fold")
    if intervals:
        table.add_column("differs", no_wrap=True, min_width=7)
    edged = False
    for _, row in frame.head(top).iterrows():
        at_edge = row.get("at_edge")
        at_edge = at_edge if isinstance(at_edge, str) else ""  # None, NaN: no mark
        edged = edged or bool(at_edge)
        # The edge names the setting and the side, beside the values it qualifies.
        label = f"{row['configuration']} ({at_edge})" if at_edge else str(row["configuration"])
        cells = [str(row["trial"]), label]
        cells += [_interval(row, m, bracket) for m in metrics]
        if intervals:
            differs = row["differs"]
            cells.append("best" if differs is None else ("yes" if differs else "no"))
        table.add_row(*cells)
    console.print(table, width=width)
    if intervals:
        console.print(
            f"differs: Welch's t-test against the best on {metrics[0]}, p < 0.05",
            highlight=False,
            width=width,
        )
    if edged:
        console.print(
            "at the low/high edge: the selected value is the lowest/highest its sweep ran, so "
            "the sweep did not bracket it; widen it or let it extend (docs/search.md)",
            highlight=False,
            width=width,
        )


@app.command()
def export(
    study: StudyArg,
    output: Annotated[
        Path, typer.Option("-o", "--output", help="The spec file to write.", show_default=False)
    ],
    best: Annotated[
        bool, typer.Option("--best", help="The best trial on the first objective (ties: the next).")
    ] = False,
    trial: Annotated[
        int | None, typer.Option(help="This trial number instead.", show_default=False)
    ] = None,
    storage: StorageOpt = None,
    name: NameOpt = None,
) -> None:
    """Write a trial's spec (the best one with --best) as a spec YAML that validates and trains."""
    from miras.search import SearchError
    from miras.search.report import export_text, pick_trial
    from miras.search.storage import open_existing
    from miras.search.study import StudyError

    if best == (trial is not None):
        raise _fail(ValueError("give exactly one of --best or --trial N"), 2)
    try:
        handle, definition = open_existing(study, storage, name)
        chosen = pick_trial(handle.get_trials(deepcopy=False), definition.directions, trial)
        text = export_text(chosen, definition, handle.study_name, str(output))
        load_spec(text)  # what is written must load back
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    except (StudyError, SearchError, SpecError, ValueError, OSError) as error:
        raise _fail(error) from None
    out.print(
        f"wrote {output}: trial {chosen.number} of study {handle.study_name}", highlight=False
    )


@app.command()
def probe(
    name: Annotated[
        str,
        typer.Argument(
            help="capacity, interference, outliers, recency, nonlinear or repetition.",
            show_default=False,
        ),
    ],
    specs: Annotated[list[Path], typer.Argument(help="Spec YAML files.", show_default=False)],
    seeds: Annotated[int, typer.Option(help="Scoring seeds (the interval is over them).")] = 5,
    seed: Annotated[int, typer.Option(help="Tuning seed; scoring seeds follow it.")] = 0,
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option",
            help="A probe option as key=value (YAML value), e.g. keys=orthogonal, d_k=8, "
            "pair_counts=[4,8,16]. Repeatable.",
            show_default=False,
        ),
    ] = None,
    gate: Annotated[
        list[str] | None,
        typer.Option(
            "--gate",
            help="Fix a gate as name=value instead of tuning it (give every gate). Repeatable.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Figure (HTML). Default: runs/probe-<name>.html.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a probe of the bare rule (no training) on each spec: a table of the mean recall
    error with its 95% interval over the seeds, and a plotly figure (docs/probes.md)."""
    from miras.probes import PROBES
    from miras.probes.base import SCALE
    from miras.probes.plots import page
    from miras.resources import probe_estimate, require

    if name not in PROBES:
        raise _fail(ValueError(f"unknown probe {name!r}; allowed: {', '.join(PROBES)}"), 2)
    results = []
    try:
        options = _key_values(option, "--option")
        fixed = _key_values(gate, "--gate") or None
        for path in specs:
            spec = load_spec(path)
            need = probe_estimate(spec, options)
            if need is not None:  # before the probe allocates its states
                require(need, f"probe {name} of {path}")
            try:
                results.append(PROBES[name](spec, seeds=seeds, seed=seed, gates=fixed, **options))
            except TypeError as error:  # an option the probe does not take
                raise ValueError(f"--option: probe {name!r}: {error}") from None
    except (SpecError, DerivationError, ValueError) as error:
        raise _fail(error) from None
    first = results[0]
    table = Table(
        title=f"probe {name}: recall error, mean and 95% interval over {seeds} seeds",
        caption=f"recall error ||M(phi(k)) - v|| / ||v||: {SCALE}",
        title_justify="left",
        caption_justify="left",
    )
    for column in ("spec", "gates", first.x_name, "mean", "95% interval"):
        table.add_column(column, overflow="fold")
    for result in results:
        gates = ", ".join(f"{k}={v:g}" for k, v in result.gates.items())
        for row in result.rows():
            interval = f"[{row['low']:.4g}, {row['high']:.4g}]"
            if row["diverged"]:
                interval = f"diverged on {row['diverged']} of {row['seeds']} seeds"
            x = f"{row[first.x_name]:g}"
            table.add_row(result.spec, gates, x, f"{row['mean']:.4g}", interval)
    out.print(table)
    for result in results:
        for note in result.notes():
            out.print(f"note: {note}", highlight=False, markup=False)
    path = output or Path("runs") / f"probe-{name}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(results), encoding="utf-8")
    out.print(f"wrote {path}", highlight=False)


if __name__ == "__main__":
    app()
