"""Study definitions: a YAML file read and validated like a spec, every problem at once.

    study = load_study("studies/quickstart.yaml")   # a path, YAML text or a dict
    study.spec_space, study.train_space             # templates (miras.search.space)

A study names the task and its options, a spec template and a training template (fixed values,
or distributions to search), the objectives, the sampler, the pruner and the trial budget.
docs/search.md is the reference for every field. A bad study raises one `StudyError` listing
each problem with its dotted path ('spec.bias.choices[1].kind'), the allowed values and a
did-you-mean.
"""

from __future__ import annotations

import hashlib
import json
import math
import typing
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from miras.errors import Problem, SpecError, did_you_mean
from miras.search.grid_sampler import grid_problems, grid_size
from miras.search.space import (
    MAX_SWEEP_POINTS,
    Node,
    Sweep,
    check_template,
    distributions,
    grid,
    parse,
    sweeps,
)
from miras.spec import load_spec
from miras.spec.validation import SOURCE_DICT, Slug, read_mapping, translate
from miras.training.config import TrainConfig


class StudyError(ValueError):
    """Every problem found in one study definition, reported at once (like `SpecError`)."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{source}: {n} problem{'s' if n != 1 else ''} in the study"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))

    def __reduce__(self):  # rebuilt from its fields across processes (a search's workers)
        return type(self), (self.source, self.problems)


# Default directions of the metrics the search knows. The task's primary metric follows the
# task's `higher_is_better`; any other metric needs `direction:`.
DIRECTIONS: dict[str, str] = {
    "loss": "minimize",
    "perplexity": "minimize",
    "accuracy": "maximize",
    "exact_match": "maximize",
    "state_size": "minimize",  # floats of recurrent state per sequence (miras.search.objective)
    "state_bytes": "minimize",  # the same state in bytes (float32)
    "params": "minimize",  # trainable parameters of the model
    "throughput": "maximize",  # training tokens per second
}
SIZES = ("state_size", "state_bytes", "params")  # read off the spec: no training needed
EARLY_STOP = 0.99  # the default threshold of a sweep on an accuracy task (docs/search.md)
MEASURES = (*SIZES, "throughput")  # computed by the search, not by the task


def _short(field: str) -> Any:
    """`sampler: tpe` means `sampler: {kind: tpe}`."""

    def expand(value: Any) -> Any:
        return {field: value} if isinstance(value, str) else value

    return BeforeValidator(expand)


class TaskDef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    options: dict[str, Any] = {}


def _probe_objective(value: Any) -> Any:
    """`{probe: capacity, name: cap}` is the objective named `cap` (default: the probe's name),
    which `metric` then holds: every objective has one column name."""
    if isinstance(value, dict) and "probe" in value and "metric" not in value:
        value = dict(value)
        value["metric"] = value.pop("name", value["probe"])
    return value


class Objective(BaseModel):
    """One value to optimize: a metric of the final evaluation, a measure of the model, or a
    probe's mean recall error on the spec's bare rule (`probe`, with its `options`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str
    direction: Literal["maximize", "minimize"] | None = None
    probe: str | None = None
    options: dict[str, Any] = {}

    @model_validator(mode="after")
    def _probe_fields(self) -> Objective:
        if self.probe is None and self.options:
            raise ValueError("options: only a probe objective takes options ({probe: NAME})")
        if self.probe is not None and self.direction == "maximize":
            raise ValueError(f"direction: probe {self.probe!r} is a recall error: minimize")
        return self


class SamplerDef(BaseModel):
    """TPE (default for one objective), NSGA-II (default for several), random search, or a grid
    of every configuration (miras.search.grid_sampler)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["tpe", "nsga2", "random", "grid"]
    seed: int | None = 0
    startup_trials: int | None = Field(None, ge=0)  # TPE's random start (Optuna's default 10)
    population_size: int | None = Field(None, ge=2)  # NSGA-II's generation size


class PrunerDef(BaseModel):
    """Stops unpromising trials from their intermediate evaluations (single objective only).

    median: prune when the value is worse than the median of earlier trials at the same step,
    after `startup_trials` finished trials and `warmup_evals` evaluations of the trial itself.
    hyperband: successive halving over training steps, from `eval_every` to `steps`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["median", "hyperband", "none"]
    startup_trials: int = Field(3, ge=0)
    warmup_evals: int = Field(1, ge=0)
    reduction_factor: int = Field(3, ge=2)


class HeartbeatDef(BaseModel):
    """A running trial writes a heartbeat every `interval` s; one silent for `grace` s is
    failed and re-queued by the next worker that looks (a killed worker's trial)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: int = Field(10, ge=1)
    grace: int = Field(30, ge=1)

    @model_validator(mode="after")
    def _grace_after_interval(self) -> HeartbeatDef:
        if self.grace <= self.interval:
            raise ValueError(
                f"grace ({self.grace}) must exceed interval ({self.interval}): a live trial "
                "would be failed between two heartbeats"
            )
        return self


class ReportDef(BaseModel):
    """What the report groups by. `family`: the parameters (leaderboard names, `spec.` in
    front allowed) whose values make a model family in the accuracy-against-state-size figure;
    default: every searched spec parameter outside `model`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: list[str] | None = None


class StudyDef(BaseModel):
    """A validated study. Build it with `load_study` to get every problem as one StudyError."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Slug
    description: str = ""
    task: TaskDef
    spec: dict[str, Any]
    train: dict[str, Any] = {}
    objectives: Annotated[
        list[Annotated[Objective, _short("metric"), BeforeValidator(_probe_objective)]],
        Field(min_length=1),
    ]
    replicates: int = Field(1, ge=1)  # seeds per configuration: train.seed + r
    sampler: Annotated[SamplerDef, _short("kind")] | None = None
    pruner: Annotated[PrunerDef, _short("kind")] | None = None
    trials: int = Field(20, ge=1)
    timeout: float | None = Field(None, gt=0)
    heartbeat: HeartbeatDef = HeartbeatDef()
    report: ReportDef = ReportDef()

    @cached_property
    def spec_space(self) -> Node:
        return parse(self.spec, "spec")[0]

    @cached_property
    def train_space(self) -> Node:
        return parse(_settings(self.train), "train", name="train")[0]

    @cached_property
    def sweep_points(self) -> list[dict[str, Any]]:
        """The grid of the train section's sweeps, [{field: value}] (one empty point: none)."""
        return grid(self.train_space)

    @property
    def sweeps(self) -> bool:
        return bool(next(sweeps(self.train_space), None))

    def early_stop(self, primary_metric: str) -> float | None:
        """The early-stopping threshold a trial trains with when `train.early_stop` is not
        given: EARLY_STOP for a study with a sweep on a task scored by accuracy, else off."""
        if "early_stop" in self.train:
            return None  # the template holds it (a value, null, a sweep or a distribution)
        return EARLY_STOP if self.sweeps and primary_metric == "accuracy" else None

    def family_params(self) -> list[str]:
        """The parameter names that make a model family (report.family, or the default)."""
        if self.report.family is not None:
            return [_param_name(name) for name in self.report.family]
        return [d.name for d in distributions(self.spec_space) if not d.name.startswith("model.")]

    @property
    def ranks(self) -> int:
        """Processes that train each trial (`train.ranks`; torchrun, docs/search.md)."""
        return self.train.get("ranks", 1)

    @property
    def directions(self) -> list[str]:
        return [
            o.direction or ("minimize" if o.probe else DIRECTIONS[o.metric])
            for o in self.objectives
        ]

    @property
    def metrics(self) -> list[str]:
        return [o.metric for o in self.objectives]

    @property
    def trains(self) -> bool:
        """Whether a trial trains: some objective is a task metric or the throughput."""
        return any(o.probe is None and o.metric not in SIZES for o in self.objectives)

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    def sampler_def(self) -> SamplerDef:
        return self.sampler or SamplerDef(kind="nsga2" if self.multi_objective else "tpe")

    @property
    def grid_size(self) -> int:
        """The configurations of the spec and train templates (what `sampler: grid` tries)."""
        return grid_size(self.spec_space) * grid_size(self.train_space)

    def pruner_def(self) -> PrunerDef:
        # Optuna prunes on one reported value, so several objectives cannot prune.
        return self.pruner or PrunerDef(kind="none" if self.multi_objective else "median")

    def digest(self) -> str:
        """sha256 of what decides the trials (not the budget, timeout or heartbeat): a study in
        storage made from another definition is not resumed with this one."""
        keep = ("task", "spec", "train", "objectives", "sampler", "pruner")
        data = self.model_dump(mode="json", include=set(keep))
        data["train"] = _settings(data["train"])  # the ranks change how a trial runs, not what
        data["sampler"], data["pruner"] = (
            self.sampler_def().model_dump(mode="json"),
            self.pruner_def().model_dump(mode="json"),
        )
        data["objectives"] = [
            [o.metric, d, *([o.probe, o.options] if o.probe else [])]
            for o, d in zip(self.objectives, self.directions, strict=True)
        ]
        if self.replicates > 1:  # a single-seed study keeps the digest it had before replicates
            data["replicates"] = self.replicates
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def make_task(self):
        from miras.tasks import make_task  # the tasks import torch: only when a study runs

        return make_task(self.task.name, **self.task.options)


# ---------------------------------------------------------------------------------------------
# Loading


def load_study(source: str | Path | Mapping[str, Any] | StudyDef) -> StudyDef:
    """A study from a file path, YAML text or a dict. Raises `StudyError` with every problem."""
    if isinstance(source, StudyDef):
        return source
    if isinstance(source, Mapping):
        return _validate(dict(source), SOURCE_DICT)
    data, name = read_mapping(source, "study", StudyError, StudyDef.model_fields)
    return _validate(data, name)


def _validate(data: dict[str, Any], source: str) -> StudyDef:
    try:
        study = StudyDef.model_validate(data)
    except ValidationError as err:
        # Report the templates' problems too: all at once. The task and the objectives are
        # checked once the structure is right.
        problems = translate(err, StudyDef)
        spec, train = data.get("spec"), data.get("train", {})
        if isinstance(spec, dict) and isinstance(train, dict):
            problems += _check_templates(spec, train)
        raise StudyError(source, problems) from None
    problems = _check_templates(study.spec, study.train)
    problems += _sweep_problems(study)
    problems += _grid_problems(study)
    problems += _report_problems(study)
    problems += _check_task_and_objectives(study)
    if problems:
        raise StudyError(source, problems)
    if study.sampler_def().kind == "grid" and "trials" not in study.model_fields_set:
        return study.model_copy(update={"trials": study.grid_size})  # each configuration once
    return study


def _settings(train: dict[str, Any]) -> dict[str, Any]:
    """The `train:` section without `ranks`: the training settings (miras.TrainConfig)."""
    return {name: value for name, value in train.items() if name != "ranks"}


def _ranks_problems(train: dict[str, Any]) -> list[Problem]:
    """`ranks`: a fixed integer >= 1 that splits a fixed batch_size evenly."""
    if "ranks" not in train:
        return []
    ranks, batch = train["ranks"], train.get("batch_size", TrainConfig().batch_size)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        message = f"expected an integer >= 1 (processes per trial, not searched), got {ranks!r}"
        return [Problem("train.ranks", message)]
    if isinstance(batch, int) and batch % ranks:
        message = (
            f"the global batch_size {batch} does not split across {ranks} ranks; "
            f"use a batch_size that is a multiple of {ranks}"
        )
        return [Problem("train.ranks", message)]
    return []


def _check_templates(spec: dict[str, Any], train: dict[str, Any]) -> list[Problem]:
    spec_node, problems = parse(spec, "spec")
    problems += _ranks_problems(train)
    train = _settings(train)
    train_node, found = parse(train, "train", name="train")
    problems += found  # malformed distributions; the probes leave them out
    if "name" in spec:
        message = "the search names each trial's spec <study>-t<number>; remove it"
        problems.append(Problem("spec.name", message))
    problems += check_template(spec_node, "spec", _spec_problems)
    problems += check_template(train_node, "train", _train_problems)
    return problems


def _sweep_problems(study: StudyDef) -> list[Problem]:
    """Sweeps sit on `train:` fields (not in the spec, not inside a choice, not the seed), and
    their grid holds at most MAX_SWEEP_POINTS points."""
    problems = [
        Problem(s.path, "a sweep runs over train: settings only; search a spec value with choices")
        for s in sweeps(study.spec_space)
    ]
    found = list(sweeps(study.train_space))
    for s in found:
        if s.path != f"train.{s.spec_path}":
            message = "a sweep is a whole train: value, not an option of a choice"
            problems.append(Problem(s.path, message))
        elif s.spec_path == "seed":
            message = "the seeds are the replicates (replicates: N), not a sweep"
            problems.append(Problem(s.path, message))
    problems += _logspace_problems(found)
    points = math.prod(len(s.values) for s in found)
    extra = sum(s.max_extend for s in found)  # at most this many past the sweeps' edges
    if points + extra > MAX_SWEEP_POINTS:
        sizes = " x ".join(f"{s.spec_path} {len(s.values)}" for s in found)
        more = f", and up to {extra} more past their edges (extend)" if extra else ""
        message = (
            f"the sweeps make {points} points ({sizes}){more}; at most {MAX_SWEEP_POINTS}, "
            "each trained on every seed"
        )
        problems.append(Problem("train", message))
    if found and study.ranks > 1:
        message = (
            "a sweep scores each point on the test split in the search's own process; "
            "train it on one rank (remove ranks)"
        )
        problems.append(Problem("train.ranks", message))
    return problems


def _logspace_problems(found: list[Sweep]) -> list[Problem]:
    """A logspace gives real numbers (1e-4, 4.64e-4, ...): it sweeps a real-valued setting
    (lr, weight_decay, grad_clip, early_stop), not an integer one such as steps."""
    problems = []
    for s in found:
        field = TrainConfig.model_fields.get(s.spec_path)
        if s.logspace is None or field is None or float in _types(field.annotation):
            continue
        message = (
            f"a logspace gives real numbers, and {s.spec_path} is not one; give its values as "
            f"a list ({{sweep: [...]}})"
        )
        problems.append(Problem(f"{s.path}.sweep.logspace", message))
    return problems


def _types(annotation: Any) -> tuple[Any, ...]:
    """float | None -> (float, NoneType); float -> (float,)."""
    return typing.get_args(annotation) or (annotation,)


def _grid_problems(study: StudyDef) -> list[Problem]:
    """`sampler: grid`: every distribution lists its values, and `trials` is at most the grid."""
    if study.sampler_def().kind != "grid":
        return []
    problems = grid_problems(study.spec_space) + grid_problems(study.train_space)
    given = "trials" in study.model_fields_set  # else the trials are the grid (_validate)
    if not problems and given and study.trials > study.grid_size:
        message = (
            f"the grid has {study.grid_size} configurations and each is tried once; give "
            f"trials <= {study.grid_size}, or leave trials out to try them all"
        )
        problems.append(Problem("trials", message))
    return problems


def _param_name(name: str) -> str:
    """`spec.bias` -> `bias` (the leaderboard's name); other names as written."""
    return name.removeprefix("spec.")


def _report_problems(study: StudyDef) -> list[Problem]:
    if study.report.family is None:
        return []
    known = [d.name for d in (*distributions(study.spec_space), *distributions(study.train_space))]
    problems = []
    for i, name in enumerate(study.report.family):
        if _param_name(name) not in known:
            allowed = ", ".join(known) or "none (the study searches no parameter)"
            problems.append(
                Problem(
                    f"report.family[{i}]",
                    f"{name!r} is not a searched parameter; allowed: {allowed}"
                    f"{did_you_mean(_param_name(name), known)}",
                )
            )
    return problems


def _spec_problems(value: dict[str, Any]) -> list[Problem]:
    try:
        load_spec({**value, "name": "probe"})
    except SpecError as err:
        return err.problems
    return []


def _train_problems(value: dict[str, Any]) -> list[Problem]:
    try:
        TrainConfig.model_validate(value)
    except ValidationError as err:
        return translate(err, TrainConfig, noun="setting")
    return []


def _check_task_and_objectives(study: StudyDef) -> list[Problem]:
    problems: list[Problem] = []
    try:
        task = study.make_task()
    except (ValueError, TypeError, KeyError) as err:
        # make_task names the task or the option at fault; pydantic errors are ValueErrors.
        return [Problem("task", _one_line(err))]
    known = dict(DIRECTIONS)
    known[task.primary_metric] = "maximize" if task.higher_is_better else "minimize"
    reported = _task_metrics(task)
    for i, objective in enumerate(study.objectives):
        metric = objective.metric
        if objective.probe is not None:
            problems += _probe_problems(objective, f"objectives[{i}]")
        elif metric not in reported and metric not in MEASURES:
            allowed = [*reported, *MEASURES]
            problems.append(
                Problem(
                    f"objectives[{i}].metric",
                    f"task {task.name} does not report {metric!r}; allowed: "
                    f"{', '.join(allowed)}{did_you_mean(metric, allowed)}",
                )
            )
        elif objective.direction is None and metric not in known:
            problems.append(
                Problem(f"objectives[{i}].direction", f"give maximize or minimize for {metric!r}")
            )
    if len(set(study.metrics)) != len(study.metrics):
        problems.append(
            Problem("objectives", "a metric appears twice (give a probe objective a name:)")
        )
    if study.multi_objective and study.pruner is not None and study.pruner.kind != "none":
        problems.append(
            Problem(
                "pruner.kind",
                "a study with several objectives cannot prune (Optuna prunes on one reported "
                "value); use pruner: none or one objective",
            )
        )
    return problems


def _probe_problems(objective: Objective, path: str) -> list[Problem]:
    """The probe exists and takes each option (by name: a wrong value fails the trials, with
    the probe's own message)."""
    import inspect

    from miras.probes import PROBES

    if objective.probe not in PROBES:
        allowed = list(PROBES)
        return [
            Problem(
                f"{path}.probe",
                f"unknown probe {objective.probe!r}; allowed: {', '.join(allowed)}"
                f"{did_you_mean(objective.probe, allowed)}",
            )
        ]
    takes = [n for n in inspect.signature(PROBES[objective.probe]).parameters if n != "rule"]
    return [
        Problem(
            f"{path}.options.{key}",
            f"probe {objective.probe} takes no option {key!r}; allowed: {', '.join(takes)}"
            f"{did_you_mean(key, takes)}",
        )
        for key in objective.options
        if key not in takes
    ]


def objective_order(values, directions: list[str]) -> tuple[float, ...]:
    """A sort key that puts the better trial first: the first objective, ties broken by the
    next ones in order (each turned so that smaller is better)."""
    return tuple(v if d == "minimize" else -v for v, d in zip(values, directions, strict=True))


def resolve_directions(study: StudyDef) -> StudyDef:
    """The study with every objective's direction filled in (the primary metric's from the
    task's `higher_is_better`)."""
    task = study.make_task()
    objectives = []
    for o in study.objectives:
        direction = o.direction
        if direction is None and o.probe is not None:
            direction = "minimize"
        elif direction is None:
            primary = o.metric == task.primary_metric
            better = "maximize" if task.higher_is_better else "minimize"
            direction = better if primary else DIRECTIONS[o.metric]
        objectives.append(o.model_copy(update={"direction": direction}))
    return study.model_copy(update={"objectives": objectives})


def _task_metrics(task: Any) -> list[str]:
    """The names `task.metrics` reports, read off one validation batch scored with zeros."""
    import torch

    batch = task.batch("valid", 0, 2)
    logits = torch.zeros(*batch.labels.shape, task.vocab_size)  # [B, T, V]: inputs may be vectors
    return list(task.metrics(logits, batch.labels))


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
