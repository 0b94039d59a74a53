"""One trial: sample a spec and training settings, validate and compile, train, score.

What a finished trial keeps (Optuna user attributes, all JSON):
  spec       the full spec, YAML (long form), which `miras export` writes out
  train      the training arguments used
  replicates one record per seed, {seed, metrics, seconds}, written as each seed finishes
  metrics    the means over the seeds: the final evaluation, the measures (state_size,
             state_bytes, params, throughput) and each probe objective
  reason     why a trial was pruned: 'invalid: ...' (the sampled combination is impossible),
             'diverged: ...', or 'pruned at step N' (the pruner)
  worker     host:pid of the process that ran it

A study with sweeps (`train: {lr: {sweep: [...]}}`) runs every grid point on every seed inside
the trial (`run_sweep`) and keeps besides:
  sweep      one record per (point, seed), {point, values, seed, valid, test, seconds}, written
             as each finishes: the validation and test metrics of that run (`valid` holds
             `diverged` instead when training diverged)
  selected   {point, values, valid}: the point with the best mean validation value of the
             first objective over the seeds (ties: the earlier point)
  at_edge    {setting: 'low' | 'high'}: each numeric swept setting whose selected value is
             the lowest or highest value run (the sweep did not bracket it); {} when none is
  extended   with an extending logspace sweep, {setting: {low: k, high: m}}: the values run
             past its written ends (points appended to the grid, each on every seed)
Its `replicates`, `metrics` and `train` are then the selected point's, scored on the test split.
"""

from __future__ import annotations

import inspect
import math
import os
import socket
import tempfile
import time
from typing import Any

import optuna

from miras.errors import DerivationError, SpecError, TrainingDiverged
from miras.rule import compile as compile_rule
from miras.search.edges import edge, edges_of
from miras.search.space import Sweep, sample, sweeps
from miras.search.study import MEASURES, Objective, StudyDef
from miras.spec import Spec, load_spec
from miras.training.config import TrainConfig

# Bytes per float of recurrent state: the runtime keeps it in float32 (under bf16 too).
STATE_BYTES_PER_FLOAT = 4


class TrialInvalid(optuna.TrialPruned):
    """The sampled combination cannot be built (the spec or the model rejects it)."""


class SeedDiverged(optuna.TrialPruned):
    """Training one seed diverged (a NaN loss, a non-finite objective)."""


def trial_spec(study: StudyDef, trial: optuna.Trial) -> dict[str, Any]:
    """The spec of this trial as a dict (the sampled values in the template)."""
    return {"name": f"{study.name}-t{trial.number}", **sample(study.spec_space, trial)}


def trial_train(
    study: StudyDef,
    trial: optuna.Trial,
    point: dict[str, Any] | None = None,
    primary_metric: str | None = None,
) -> dict[str, Any]:
    """The trial's training settings, step-dependent defaults resolved (miras.TrainConfig):
    at sweep `point` (one of `study.sweep_points`), with the study's default early stop for a
    task scored by `primary_metric`."""
    settings = sample(study.train_space, trial, point)
    threshold = study.early_stop(primary_metric or "")
    if threshold is not None:
        settings.setdefault("early_stop", threshold)
    return TrainConfig.model_validate(settings).resolved()


def build(
    study: StudyDef, trial: optuna.Trial, primary_metric: str | None = None
) -> tuple[Spec, dict[str, Any]]:
    """Sample, validate and compile; an impossible combination prunes the trial with its reason.
    The training settings returned are the first sweep point's."""
    data = trial_spec(study, trial)
    train = trial_train(study, trial, study.sweep_points[0], primary_metric)
    try:
        spec = load_spec(data)
        compile_rule(spec)  # derived and checked against autograd; cached per process
    except (SpecError, DerivationError) as err:
        raise _invalid(trial, err) from None
    trial.set_user_attr("spec", spec.to_yaml())
    trial.set_user_attr("train", train)
    return spec, train


def _invalid(trial: optuna.Trial, err: Exception) -> TrialInvalid:
    reason = "invalid: " + " ".join(str(err).split())
    trial.set_user_attr("reason", reason)
    return TrialInvalid(reason)


def run_trial(study: StudyDef, task: Any, trial: optuna.Trial) -> float | list[float]:
    """The Optuna objective: every replicate seed, then the means. Intermediate evaluations of
    the first seed feed the pruner (single objective); each seed's result is stored as it
    finishes, and seeds a retried trial inherited are not run again."""
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    if study.sweeps:
        return run_sweep(study, task, trial)
    spec, args = build(study, trial, task.primary_metric)
    records = {r["seed"]: r for r in trial.user_attrs.get("replicates", [])}
    seeds = [args["seed"] + r for r in range(study.replicates)]
    sizes = sizes_of(spec, task)
    for seed in seeds:
        if seed in records:
            continue
        began = time.perf_counter()
        metrics = replicate(study, task, trial, spec, {**args, "seed": seed}, seed == seeds[0])
        metrics.update(sizes)  # the same for every seed: each record holds every objective
        records[seed] = {"seed": seed, "metrics": metrics, "seconds": time.perf_counter() - began}
        trial.set_user_attr("replicates", [records[s] for s in sorted(records)])
    done = [records[s]["metrics"] for s in seeds]
    names = [name for name in done[0] if all(name in m for m in done)]
    metrics = {name: sum(m[name] for m in done) / len(done) for name in names}
    trial.set_user_attr("metrics", metrics)
    trial.set_user_attr("seconds", sum(records[s]["seconds"] for s in seeds))
    values = [metrics[name] for name in study.metrics]
    return values[0] if len(values) == 1 else values


def sizes_of(spec: Spec, task: Any) -> dict[str, float]:
    """The recurrent state per sequence at the task's length, in floats and in bytes."""
    state = state_size(spec, task.seq_len)
    return {"state_size": float(state), "state_bytes": float(state * STATE_BYTES_PER_FLOAT)}


def _mean(records: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each metric every record holds."""
    names = [name for name in records[0] if all(name in r for r in records)]
    return {name: sum(r[name] for r in records) / len(records) for name in names}


def run_sweep(study: StudyDef, task: Any, trial: optuna.Trial) -> float | list[float]:
    """A trial with sweeps: every grid point on every seed, the point with the best mean
    validation value of the first objective selected (ties: the earlier point), and that
    point's test-split metrics, averaged over the seeds, returned. Each (point, seed) run is
    stored as it finishes; the runs a retried trial inherited are not run again. Only the
    first point's first seed reports to the pruner, so a pruned trial stops its whole sweep.
    A diverged run scores nothing; the trial is pruned when every point has one. An extending
    sweep whose selected value lies at its edge runs the next value past it, and the selection
    is made again, until it is bracketed or `max_extend` values lie past that end."""
    spec, _ = build(study, trial, task.primary_metric)
    sweep = SweepRuns(study, task, trial, spec)
    for index in range(len(sweep.points)):
        sweep.run(index)
    chosen = sweep.select()
    if chosen is None:
        points = len(sweep.points)
        trial.set_user_attr("reason", f"diverged: every one of the {points} sweep points")
        raise optuna.TrialPruned("every sweep point diverged")
    while extra := extension_points(study, sweep.points, chosen):
        for values in extra:
            sweep.run(sweep.add(values))
        chosen = sweep.select()  # never None here: the points that scored before still do
    return sweep.finish(chosen)


class SweepRuns:
    """The (point, seed) runs of one trial's sweep: `points` (the grid, then any extension
    points, in the order they were added: a run's `point` is its index here), and `runs`,
    stored in the trial's `sweep` attribute as each finishes."""

    def __init__(self, study: StudyDef, task: Any, trial: optuna.Trial, spec: Spec):
        self.study, self.task, self.trial, self.spec = study, task, trial, spec
        self.points: list[dict[str, Any]] = list(study.sweep_points)
        self.runs = {(r["point"], r["seed"]): r for r in trial.user_attrs.get("sweep", [])}
        self.sizes = sizes_of(spec, task)
        first = trial_train(study, trial, self.points[0], task.primary_metric)
        self.seeds = [first["seed"] + r for r in range(study.replicates)]  # never swept
        self.settings: dict[int, dict[str, Any]] = {}

    def add(self, values: dict[str, Any]) -> int:
        """A point past the grid (an extension); its index."""
        self.points.append(values)
        return len(self.points) - 1

    def run(self, index: int) -> None:
        """Point `index` on every seed, but for the runs already recorded at these values
        (a retried trial's: an extension point is found again at the same index, since the
        selection that added it is made again from the same records)."""
        point = self.points[index]
        args = trial_train(self.study, self.trial, point, self.task.primary_metric)
        self.settings[index] = args
        for seed in self.seeds:
            kept = self.runs.get((index, seed))
            if kept is not None and kept["values"] == point:
                continue
            began = time.perf_counter()
            first = index == 0 and seed == self.seeds[0]
            try:
                valid, test = sweep_run(
                    self.study, self.task, self.trial, self.spec, {**args, "seed": seed}, first
                )
                valid, test = {**valid, **self.sizes}, {**test, **self.sizes}
            except SeedDiverged as err:
                valid, test = {"diverged": str(err)}, {}
            seconds = time.perf_counter() - began
            record = {"point": index, "values": point, "seed": seed, "valid": valid, "test": test}
            self.runs[(index, seed)] = {**record, "seconds": seconds}
            self.trial.set_user_attr("sweep", [self.runs[key] for key in sorted(self.runs)])

    def scores(self) -> dict[int, float]:
        """The mean validation value of the first objective, per point none of whose seeds
        diverged."""
        first = self.study.metrics[0]
        scores = {}
        for index in range(len(self.points)):
            done = [self.runs[(index, seed)]["valid"] for seed in self.seeds]
            if all(first in v and math.isfinite(v[first]) for v in done):
                scores[index] = sum(v[first] for v in done) / len(done)
        return scores

    def select(self) -> int | None:
        """The point with the best score (ties: the earlier point); None when none scores."""
        scores = self.scores()
        sign = 1 if self.study.directions[0] == "minimize" else -1
        return min(scores, key=lambda i: (sign * scores[i], i)) if scores else None

    def finish(self, chosen: int) -> float | list[float]:
        """Store the selection and its test metrics; the trial's values."""
        trial, first, scores = self.trial, self.study.metrics[0], self.scores()
        points = self.points
        selected = {"point": chosen, "values": points[chosen], "valid": scores[chosen]}
        trial.set_user_attr("selected", selected)
        trial.set_user_attr("at_edge", edges_of(points, points[chosen]))
        extending = [s for s in sweeps(self.study.train_space) if s.extend]
        if extending:
            trial.set_user_attr("extended", {s.spec_path: _past_ends(s, points) for s in extending})
        diverged = len(points) - len(scores)
        trial.set_user_attr(
            "reason", f"{diverged} of {len(points)} sweep points diverged" if diverged else ""
        )
        picked = [self.runs[(chosen, seed)] for seed in self.seeds]
        trial.set_user_attr(
            "replicates",
            [{"seed": r["seed"], "metrics": r["test"], "seconds": r["seconds"]} for r in picked],
        )
        metrics = _mean([r["test"] for r in picked])
        metrics[f"valid_{first}"] = scores[chosen]
        trial.set_user_attr("metrics", metrics)
        trial.set_user_attr("train", self.settings[chosen])
        trial.set_user_attr("seconds", sum(r["seconds"] for r in self.runs.values()))
        values = [metrics[name] for name in self.study.metrics]
        return values[0] if len(values) == 1 else values


def extension_points(
    study: StudyDef, points: list[dict[str, Any]], chosen: int
) -> list[dict[str, Any]]:
    """The points an extending sweep runs next: for each logspace sweep with `extend: true`
    whose value at the selected point is the lowest or highest value run, the selected point
    with that value moved one step (the logspace's ratio) past it; none for a sweep that
    already has `max_extend` values past its ends (the trial then keeps its edge mark)."""
    picked = points[chosen]
    extra = []
    for sweep in sweeps(study.train_space):
        name = sweep.spec_path
        side = edge(picked[name], (p[name] for p in points)) if sweep.extend else None
        past = _past_ends(sweep, points)
        if side is None or sum(past.values()) >= sweep.max_extend:
            continue
        # The selection only moves to a point just added, so the values past an end are
        # positions -1, -2, ... (below lo) or n, n + 1, ... (above hi), in that order.
        index = -(past["low"] + 1) if side == "low" else len(sweep.values) + past["high"]
        extra.append({**picked, name: sweep.value_at(index)})
    return extra


def _past_ends(sweep: Sweep, points: list[dict[str, Any]]) -> dict[str, int]:
    """How many values of `sweep` the points hold below its lowest written value and above
    its highest: {'low': k, 'high': m}."""
    values = {p[sweep.spec_path] for p in points}
    low, high = min(sweep.values), max(sweep.values)
    return {"low": sum(v < low for v in values), "high": sum(v > high for v in values)}


def sweep_run(
    study: StudyDef,
    task: Any,
    trial: optuna.Trial,
    spec: Spec,
    args: dict[str, Any],
    prunes: bool,
) -> tuple[dict[str, float], dict[str, float]]:
    """One (point, seed) run of a sweep: (validation metrics, test metrics). Both hold the
    measures (params, throughput, each probe, `stopped_at` after an early stop); the task's
    metrics of the test split come from the model as training left it."""
    if not study.trains:
        valid = replicate(study, task, trial, spec, args, prunes)
        return valid, dict(valid)
    with tempfile.TemporaryDirectory(prefix="miras-sweep-") as folder:
        valid = replicate(study, task, trial, spec, args, prunes, out_dir=folder)
        scored = test_metrics(folder, task, args)
    kept = {k: v for k, v in valid.items() if k in MEASURES or k == "stopped_at"}
    kept |= {o.metric: valid[o.metric] for o in study.objectives if o.probe is not None}
    return valid, {**kept, **scored}


def test_metrics(run_dir: str, task: Any, args: dict[str, Any]) -> dict[str, float]:
    """The task's metrics on `eval_batches` test batches, of the model in `run_dir`'s
    checkpoint: overall and per slice (`accuracy_n64`, miras.training.evaluate_model)."""
    from miras.training.evaluation import evaluate

    batches, size = args["eval_batches"], args["batch_size"]
    return evaluate(run_dir, task, batches=batches, batch_size=size, split="test")


def replicate(
    study: StudyDef,
    task: Any,
    trial: optuna.Trial,
    spec: Spec,
    args: dict[str, Any],
    prunes: bool,
    out_dir: str | None = None,
) -> dict[str, float]:
    """One seed's metrics: the final evaluation and throughput (when the study trains), the
    parameter count, and each probe objective. `prunes`: report evaluations to the pruner;
    `out_dir`: where the run writes its checkpoint (none by default)."""
    import torch  # torch and the models: only in processes that train

    from miras.training.launcher import train_on_ranks
    from miras.training.recipe import train

    first = study.metrics[0]
    prunes = prunes and not study.multi_objective and study.pruner_def().kind != "none"

    def report(step: int, metrics: dict[str, float]) -> None:
        if not prunes or first not in metrics or not math.isfinite(metrics[first]):
            return
        trial.report(metrics[first], step)
        if trial.should_prune():
            trial.set_user_attr("reason", f"pruned at step {step}: {first} {metrics[first]:.4g}")
            raise optuna.TrialPruned(f"pruned at step {step}")

    seed = args["seed"]
    metrics: dict[str, float] = {}
    if study.trains:
        began = time.perf_counter()
        try:
            if study.ranks > 1:  # torchrun in a subprocess (docs/search.md, "Several ranks")
                result = train_on_ranks(
                    spec.normalized(),
                    study.task.name,
                    study.task.options,
                    args,
                    ranks=study.ranks,
                    threads=torch.get_num_threads(),
                    callback=report,
                )
            else:
                result = train(spec, task, **args, callback=report, progress=False, out_dir=out_dir)
        except TrainingDiverged as err:
            trial.set_user_attr("reason", f"diverged (seed {seed}): {err}")
            raise SeedDiverged(str(err)) from None
        except optuna.TrialPruned:
            raise
        except ValueError as err:
            # The model or trainer refused the sampled combination (a variant that needs a
            # parametric memory, a size that does not fit): a named input error, so prune.
            raise _invalid(trial, err) from None
        seconds = time.perf_counter() - began
        metrics.update(result.metrics)
        metrics["throughput"] = (
            result.steps * args["batch_size"] * task.seq_len / max(seconds, 1e-9)
        )
        metrics["params"] = float(result.parameters)
    else:
        metrics["params"] = float(parameter_count(spec, task, trial))
    for objective in study.objectives:
        if objective.probe is not None:
            metrics[objective.metric] = probe_error(objective, spec, seed, trial)
    bad = [name for name in study.metrics if not math.isfinite(metrics.get(name, 0.0))]
    if bad:
        trial.set_user_attr("reason", f"diverged (seed {seed}): {', '.join(bad)} is not finite")
        raise SeedDiverged(f"{', '.join(bad)} is not finite")
    return metrics


def parameter_count(spec: Spec, task: Any, trial: optuna.Trial) -> int:
    """Trainable parameters of the model the spec builds for `task`, with the task's own input
    and output layers where it has them, as training builds it (a model that cannot be built
    prunes the trial as invalid, as training it would)."""
    from miras.models.model import build_model
    from miras.training.checkpoint import task_io

    try:
        model = build_model(spec, task.vocab_size, task_io(task, spec.model.d_model))
    except ValueError as err:
        raise _invalid(trial, err) from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def probe_error(objective: Objective, spec: Spec, seed: int, trial: optuna.Trial) -> float:
    """The probe's mean recall error over its sweep points and scoring seeds, on the spec's
    rule. Seed `seed` (train.seed + replicate) moves the probe's tuning seed by seed x (seeds
    + 1), so no two replicates share a stream."""
    from miras.probes import PROBES

    if spec.memory.closed_form() is not None:
        raise _invalid(
            trial,
            ValueError(
                f"probe {objective.probe}: memory {spec.memory.kind!r} keeps every pair (no "
                "weights to read back); the probes take a parametric memory"
            ),
        )
    run = PROBES[objective.probe]
    defaults = inspect.signature(run).parameters
    options = dict(objective.options)
    seeds = options.get("seeds", defaults["seeds"].default)
    options["seed"] = options.get("seed", defaults["seed"].default) + seed * (seeds + 1)
    result = run(compile_rule(spec), **options)
    means = [point.mean for point in result.points]
    return sum(means) / len(means)


# ---------------------------------------------------------------------------------------------
# Measures


def state_size(spec: Spec, seq_len: int) -> int:
    """Floats of recurrent state a decoder keeps per sequence at length `seq_len`, over all
    layers: the memory's parameters W (and momentum S), the Omega window's last c - 1 keys
    (as features phi(k)) and values, and softmax attention's key-value cache (full, or
    windowed). The window's per-token flags and gates (a float each) and the short conv's few
    cached inputs are left out."""
    model = spec.model
    heads, d_head = model.n_heads, model.head_dim
    kv = 2 * d_head * heads  # one token's key and value over the heads

    def attention(window: int | None) -> int:
        return kv * min(seq_len, window or seq_len)

    variant = model.variant
    if variant == "attention":
        per_layer = attention(None)
    elif variant == "swa":
        per_layer = attention(model.swa_window)
    elif spec.memory.closed_form() is not None:  # softmax attention: its KV cache
        per_layer = attention(spec.memory.lookback(spec))
    else:
        # The window's carried tokens: c - 1, or the whole prefix for `window: global`.
        # Each carries phi(k) at the feature width d_phi and v at d_head (per head).
        past = seq_len if spec.window.is_global else spec.window.c - 1
        d_phi = spec.feature_map.output_dim(d_head)
        per_layer = (_memory_state(spec, d_head) + past * (d_phi + d_head)) * heads
        if variant in ("mal", "mag"):
            per_layer += attention(model.swa_window)
        elif variant == "mac":
            per_layer += kv * (model.mac_segment + model.persistent_tokens)
    return per_layer * model.n_layers


def _memory_state(spec: Spec, d_head: int) -> int:
    """Floats of one head's memory state: W's matrices (MLP layers), doubled with momentum."""
    rule = compile_rule(spec, checked=False)
    d_phi = spec.feature_map.output_dim(d_head)
    rt = rule.program.runtime
    count = sum(math.prod(shape) for shape in rt.shapes(d_phi, d_head).values())
    return count * (2 if rt.has_momentum else 1)
