"""What a report shows, computed apart from its drawing (plots.py draws; plotly is not imported
here). Every function takes the study's trials (Optuna FrozenTrials) and returns a pandas frame
or a small dataclass (report_data.py), so each is tested without plotly.

    write_report(handle, study, "runs/quickstart-report")  # leaderboard.csv + report.html
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from miras.search.edges import edge_text, edges_of
from miras.search.report_data import Dimension
from miras.search.study import StudyDef, objective_order
from miras.stats import confidence_interval, welch_p

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
SIGNIFICANCE = 0.05  # Welch's two-sided test against the best trial


def _sign(direction: str) -> int:
    return 1 if direction == "minimize" else -1


def _text(value: Any) -> str:
    return "none" if value is None else str(value)


# ---------------------------------------------------------------------------------------------
# Tables


def seed_values(trial: FrozenTrial, metric: str) -> list[float]:
    """The trial's per-seed values of `metric` (its `replicates` records, in seed order)."""
    records = trial.user_attrs.get("replicates") or []
    return [r["metrics"][metric] for r in records if metric in r["metrics"]]


def trial_edges(trial: FrozenTrial) -> dict[str, str]:
    """{setting: 'low' | 'high'}: the swept settings whose selected value lies at an edge of
    the values the trial ran (miras.search.edges). Read from `at_edge`, or worked out from the
    `sweep` records of a trial stored before that attribute existed; {} without a selection."""
    if "at_edge" in trial.user_attrs:
        return dict(trial.user_attrs["at_edge"] or {})
    selected = trial.user_attrs.get("selected") or {}
    runs = trial.user_attrs.get("sweep") or []
    if not selected or not runs:
        return {}
    return edges_of((run["values"] for run in runs), selected["values"])


def trials_frame(trials: list[FrozenTrial], metrics: list[str]) -> pd.DataFrame:
    """One row per trial: number, state, each objective (the mean over the seeds), with
    replicated trials its 95% t interval (`<objective>_low`, `_high`) and the number of
    `seeds`, the other measures, every parameter (missing where a branch was not taken),
    the selected sweep values and, in a study with sweeps, `at_edge` (edge_text: the settings
    whose sweep did not bracket the selected value, '' when every one did), seconds, the
    reason of a prune, a retry's origin."""
    replicated = any(len(t.user_attrs.get("replicates") or []) > 1 for t in trials)
    swept = any(t.user_attrs.get("sweep") for t in trials)
    rows = []
    for t in trials:
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name.lower()}
        complete = t.state == TrialState.COMPLETE and t.values
        values = t.values if complete else [None] * len(metrics)
        row.update(dict(zip(metrics, values, strict=True)))
        if replicated:
            row["seeds"] = len(seed_values(t, metrics[0])) if complete else None
            for metric in metrics:
                seeds = seed_values(t, metric)
                _, low, high = confidence_interval(seeds) if complete and seeds else (None,) * 3
                row[f"{metric}_low"], row[f"{metric}_high"] = low, high
        for name, value in (t.user_attrs.get("metrics") or {}).items():
            row.setdefault(name, value)
        row.update(t.params)
        selected = t.user_attrs.get("selected") or {}
        row.update({f"train.{k}": v for k, v in (selected.get("values") or {}).items()})
        if swept:
            row["at_edge"] = edge_text(trial_edges(t))
        row["seconds"] = t.user_attrs.get("seconds")
        row["reason"] = t.user_attrs.get("reason") or t.user_attrs.get("error") or ""
        row["retry_of"] = t.system_attrs.get("failed_trial")
        rows.append(row)
    frame = pd.DataFrame(rows)
    if not frame.empty:  # a trial number or missing: not a float with NaN (3.0 in the CSV)
        frame["retry_of"] = frame["retry_of"].astype("Int64")
    return frame


def leaderboard(
    trials: list[FrozenTrial], metrics: list[str], directions: list[str]
) -> pd.DataFrame:
    """Finished trials, best first: complete trials by the first objective's mean (ties by
    the next objectives in order, then trial number), then pruned ones. `rank` counts from 1; with several objectives, `pareto`
    marks the trials no other beats on every objective; with replicated trials, `p_vs_best`
    and `differs` compare each trial's seeds with the best trial's (`significance_data`)."""
    frame = trials_frame([t for t in trials if t.state in FINISHED], metrics)
    if frame.empty:
        return frame
    if len(metrics) > 1:
        front = pareto_data(trials, metrics, directions)
        on_front = set(front.loc[front["pareto"], "trial"])
        frame.insert(2, "pareto", [n in on_front for n in frame["trial"]])
    if "seeds" in frame:
        tests = significance_data(trials, metrics[0], directions[0]).set_index("trial")
        at = frame.columns.get_loc(f"{metrics[0]}_high") + 1  # beside the first objective
        for i, column in enumerate(("p_vs_best", "differs")):
            frame.insert(at + i, column, [tests[column].get(n) for n in frame["trial"]])
    # By the first objective's mean, ties by the next objectives in order, then trial number.
    keys = {
        f"_key{i}": frame[metric].astype(float) * _sign(direction)
        for i, (metric, direction) in enumerate(zip(metrics, directions, strict=True))
    }
    frame = frame.assign(_pruned=frame["state"] != "complete", **keys)
    frame = frame.sort_values(["_pruned", *keys, "trial"], na_position="last")
    frame = frame.drop(columns=["_pruned", *keys]).reset_index(drop=True)
    frame.insert(0, "rank", range(1, len(frame) + 1))
    return frame


def _number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else _text(value)


def config_labels(trials: list[FrozenTrial]) -> dict[int, str]:
    """A short label per trial from its searched parameters and selected sweep values,
    `bias=l2 n_heads=4 lr=0.003`: each name's last part, or the whole name where two
    parameters share that part."""
    names: list[str] = []
    for t in trials:
        values = (t.user_attrs.get("selected") or {}).get("values") or {}
        for name in [*t.params, *(f"train.{k}" for k in values)]:
            if name not in names:
                names.append(name)
    tails = [n.rsplit(".", 1)[-1] for n in names]
    short = {n: tail if tails.count(tail) == 1 else n for n, tail in zip(names, tails, strict=True)}
    labels = {}
    for t in trials:
        values = (t.user_attrs.get("selected") or {}).get("values") or {}
        pairs = {**t.params, **{f"train.{k}": v for k, v in values.items()}}
        # A choice over whole specs has the empty name: its label alone (`deltanet lr=0.01`).
        labels[t.number] = " ".join(
            f"{short[n]}={_number(v)}" if n else str(v) for n, v in pairs.items()
        ) or (f"trial {t.number}")
    return labels


def summary_data(
    trials: list[FrozenTrial], metrics: list[str], directions: list[str]
) -> pd.DataFrame:
    """The compact summary: complete trials, best first (as on the leaderboard), with
    `trial`, `configuration` (config_labels), per objective its mean and, with replicates,
    the 95% t interval over the seeds (`<metric>_low`, `_high`), `differs`: True when
    Welch's test separates the trial from the best on the first objective (p < 0.05), False
    when it does not, None for the best itself and without replicates, and `at_edge`: the
    settings whose sweep did not bracket the selected value ('lr at the high edge'; '' when
    every sweep did, and without sweeps)."""
    board = leaderboard([t for t in trials if t.state == TrialState.COMPLETE], metrics, directions)
    columns = ["trial", "configuration"]
    for m in metrics:
        columns += [m, f"{m}_low", f"{m}_high"]
    if board.empty:
        return pd.DataFrame(columns=[*columns, "differs", "at_edge"])
    labels = config_labels(trials)
    frame = pd.DataFrame({"trial": board["trial"]})
    frame["configuration"] = [labels[n] for n in board["trial"]]
    for m in metrics:
        frame[m] = board[m].astype(float)
        for end in ("low", "high"):
            name = f"{m}_{end}"
            frame[name] = board[name].astype(float) if name in board else math.nan
    if "p_vs_best" in board:
        frame["differs"] = [
            None if p is None or (isinstance(p, float) and math.isnan(p)) else bool(d)
            for p, d in zip(board["p_vs_best"], board["differs"], strict=True)
        ]
    else:
        frame["differs"] = None
    frame["at_edge"] = list(board["at_edge"]) if "at_edge" in board else ""
    return frame.reset_index(drop=True)


def edge_note(trials: list[FrozenTrial]) -> str | None:
    """One sentence naming the complete trials whose sweep did not bracket the selected
    value, and which setting at which edge; None when every sweep brackets its selection."""
    marked = [
        f"trial {t.number} ({edge_text(trial_edges(t))})"
        for t in sorted(trials, key=lambda t: t.number)
        if t.state == TrialState.COMPLETE and trial_edges(t)
    ]
    if not marked:
        return None
    return (
        f"the selected sweep value lies at the edge of its sweep in {', '.join(marked)}: "
        "the sweep did not bracket it, so a better value may lie past it and the comparison "
        "with other trials is not settled; widen the sweep, or let it extend "
        "({sweep: {logspace: [lo, hi, n], extend: true}})"
    )


# ---------------------------------------------------------------------------------------------
# Figure data


def _seed_interval(trial: FrozenTrial, metric: str) -> tuple[float, float, float] | None:
    seeds = seed_values(trial, metric)
    return confidence_interval(seeds) if seeds else None


def state_size_data(
    trials: list[FrozenTrial], metric: str, family: list[str], size: str = "state_bytes"
) -> pd.DataFrame:
    """Per complete trial: its model `family` (the values of the `family` parameters, as
    `bias=l2 retention=none`), its state size (`size`, from the trial's metrics), and the
    objective `metric` as the mean over seeds with its 95% t interval (`low`, `high`; the
    mean itself for one seed). Sorted by family, then size."""
    rows = []
    for t in trials:
        if t.state != TrialState.COMPLETE or size not in (t.user_attrs.get("metrics") or {}):
            continue
        interval = _seed_interval(t, metric)
        if interval is None:
            value = (t.user_attrs.get("metrics") or {}).get(metric)
            if value is None:
                continue
            interval = (value, value, value)
        # A conditional parameter the trial lacks (bias.lp.p under bias=l2) is left out.
        name = " ".join(
            f"{p}={_number(t.params[p])}" if p else str(t.params[p])  # "": whole specs
            for p in family
            if p in t.params
        ) or ("all")
        rows.append([t.number, name, float(t.user_attrs["metrics"][size]), *interval])
    frame = pd.DataFrame(rows, columns=["trial", "family", size, "mean", "low", "high"])
    return frame.sort_values(["family", size, "trial"], ignore_index=True)


def slice_data(trials: list[FrozenTrial], metric: str) -> pd.DataFrame:
    """Per complete trial with a sweep and slice of the test split: the slice's `metric` (the
    selected point's test records, `<metric>_<slice>`, e.g. accuracy_n64), the mean over
    seeds with its 95% t interval. Empty when no trial recorded per-slice test metrics (a
    trial without a sweep holds validation metrics only)."""
    labels = config_labels(trials)
    rows = []
    prefix = f"{metric}_"
    for t in trials:
        if t.state != TrialState.COMPLETE or not t.user_attrs.get("sweep"):
            continue
        records = t.user_attrs.get("replicates") or []
        names = [n for n in (records[0]["metrics"] if records else {}) if n.startswith(prefix)]
        for name in names:
            interval = _seed_interval(t, name)
            if interval is not None:
                label = labels[t.number]
                rows.append([t.number, label, name[len(prefix) :], *interval])
    columns = ["trial", "configuration", "slice", "mean", "low", "high"]
    return pd.DataFrame(rows, columns=columns)


def sweep_data(trials: list[FrozenTrial], metric: str) -> pd.DataFrame:
    """Every sweep point of every complete trial: its swept values (one column each), the
    mean over seeds of `metric` on validation (`valid`; NaN where a seed diverged) and on
    test (`test`), and `selected` for the point the trial reports."""
    rows = []
    for t in trials:
        runs = t.user_attrs.get("sweep") or []
        if t.state != TrialState.COMPLETE or not runs:
            continue
        chosen = (t.user_attrs.get("selected") or {}).get("point")
        points: dict[int, list[dict[str, Any]]] = {}
        for run in runs:
            points.setdefault(run["point"], []).append(run)
        for index, group in sorted(points.items()):
            row: dict[str, Any] = {"trial": t.number, "point": index, **group[0]["values"]}
            for split in ("valid", "test"):
                values = [r[split].get(metric, math.nan) for r in group]
                row[split] = sum(values) / len(values) if values else math.nan
            row["selected"] = index == chosen
            rows.append(row)
    return pd.DataFrame(rows)


def history_data(trials: list[FrozenTrial], direction: str, index: int = 0) -> pd.DataFrame:
    """Complete trials in order: the objective `index` and the best value so far."""
    done = sorted(
        (t for t in trials if t.state == TrialState.COMPLETE and t.values), key=lambda t: t.number
    )
    values = [t.values[index] for t in done]
    sign = _sign(direction)
    best, running = [], math.inf
    for v in values:
        running = min(running, sign * v)
        best.append(sign * running)
    return pd.DataFrame({"trial": [t.number for t in done], "value": values, "best": best})


def parallel_data(trials: list[FrozenTrial], metric: str, index: int = 0) -> list[Dimension]:
    """Axes over the complete trials: every parameter set in all of them (a conditional one
    would leave gaps), categories coded 0..k-1 in their declared order, then the objective."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    if not done:
        return []
    names = [n for n in done[0].params if all(n in t.params for t in done)]
    dimensions = []
    for name in sorted(names):
        distribution = done[0].distributions[name]
        raw = [t.params[name] for t in done]
        if isinstance(distribution, CategoricalDistribution):
            labels = [_text(c) for c in distribution.choices]
            codes = [float(labels.index(_text(v))) for v in raw]
            used = sorted(set(codes))
            dimensions.append(Dimension(name, codes, used, [labels[int(c)] for c in used]))
        else:
            dimensions.append(Dimension(name, [float(v) for v in raw]))
    dimensions.append(Dimension(metric, [float(t.values[index]) for t in done]))
    return dimensions


def importance_data(
    trials: list[FrozenTrial], directions: list[str], index: int = 0
) -> pd.DataFrame:
    """Parameter importances for the objective `index` (PED-ANOVA, Optuna 5's default), over
    parameters set in every complete trial. Empty when there are too few trials or nothing
    varies."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    empty = pd.DataFrame({"parameter": [], "importance": []})
    if len(done) < 3:
        return empty
    study = optuna.create_study(directions=directions)
    study.add_trials(done)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental evaluators, constant parameters
        try:
            scores = optuna.importance.get_param_importances(
                study,
                evaluator=optuna.importance.PedAnovaImportanceEvaluator(),  # no scikit-learn
                target=lambda t: t.values[index],
            )
        except (RuntimeError, ValueError, ZeroDivisionError):
            return empty
    frame = pd.DataFrame({"parameter": list(scores), "importance": list(scores.values())})
    return frame.sort_values("importance", ascending=False, ignore_index=True)


def pareto_data(
    trials: list[FrozenTrial], metrics: list[str], directions: list[str]
) -> pd.DataFrame:
    """Complete trials on every objective, with `pareto` true for the trials no other trial
    dominates (at least as good on each objective, better on one)."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    frame = pd.DataFrame({"trial": [t.number for t in done]})
    for i, metric in enumerate(metrics):
        frame[metric] = [t.values[i] for t in done]
    signs = [_sign(d) for d in directions]
    points = [tuple(s * v for s, v in zip(signs, t.values, strict=True)) for t in done]

    def dominated(p: tuple[float, ...]) -> bool:
        return any(q != p and all(a <= b for a, b in zip(q, p, strict=True)) for q in points)

    frame["pareto"] = [not dominated(p) for p in points]
    return frame


def significance_data(trials: list[FrozenTrial], metric: str, direction: str) -> pd.DataFrame:
    """Per complete trial with two seeds or more: the mean of `metric` over its seeds, the 95%
    Student t interval (`low`, `high`), the p-value of Welch's two-sided t-test against the
    best trial's seeds (`p_vs_best`; NaN for the best itself) and `differs` (p < 0.05). The
    best is the trial with the best mean (ties: the lowest number), as on the leaderboard."""
    samples = {
        t.number: seed_values(t, metric)
        for t in trials
        if t.state == TrialState.COMPLETE and len(seed_values(t, metric)) > 1
    }
    columns = ["trial", "mean", "low", "high", "seeds", "p_vs_best", "differs"]
    if not samples:
        return pd.DataFrame(columns=columns)
    means = {n: sum(s) / len(s) for n, s in samples.items()}
    best = min(samples, key=lambda n: (_sign(direction) * means[n], n))
    rows = []
    for number, seeds in samples.items():
        mean, low, high = confidence_interval(seeds)
        p = math.nan if number == best else welch_p(seeds, samples[best])
        rows.append([number, mean, low, high, len(seeds), p, bool(p < SIGNIFICANCE)])
    return pd.DataFrame(rows, columns=columns)


def component_data(trials: list[FrozenTrial], index: int = 0) -> dict[str, pd.DataFrame]:
    """For each categorical parameter (a component, the variant, a size picked from a list):
    the objective `index` of every complete trial against the option it took. Parameters with
    one option seen are left out (nothing to compare)."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    names: list[str] = []
    for t in done:
        for name, d in t.distributions.items():
            if isinstance(d, CategoricalDistribution) and name not in names:
                names.append(name)
    result = {}
    for name in names:
        rows = [(_text(t.params[name]), t.values[index]) for t in done if name in t.params]
        frame = pd.DataFrame(rows, columns=["option", "value"])
        if frame["option"].nunique() > 1:
            result[name] = frame
    return result


# ---------------------------------------------------------------------------------------------
# The report


@dataclass
class Report:
    leaderboard: pd.DataFrame
    csv: Path
    html: Path
    figures: list[str]  # titles of the figures drawn, in page order
    notes: list[str]  # figures left out, and why
    summary: pd.DataFrame = field(default_factory=pd.DataFrame)  # summary_data, for a terminal


def write_report(handle: optuna.Study, study: StudyDef, out_dir: str | Path) -> Report:
    """leaderboard.csv and report.html (plotly.js embedded: the page needs no network)."""
    from miras.search import plots  # plotly: imported only to draw

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials = handle.get_trials(deepcopy=False)
    metrics, directions = study.metrics, study.directions
    board = leaderboard(trials, metrics, directions)
    csv = out / "leaderboard.csv"
    board.to_csv(csv, index=False)

    figures: list[tuple[str, Any]] = []
    tables: list[tuple[str, pd.DataFrame]] = []
    notes: list[str] = []
    intervals = significance_data(trials, metrics[0], directions[0])
    if not intervals.empty:
        title = f"{metrics[0]}: mean and 95% interval over the seeds"
        figures.append((title, plots.interval_figure(intervals, metrics[0], directions[0])))
    history = history_data(trials, directions[0])
    if history.empty:
        notes.append("no complete trial yet: nothing to plot")
    else:
        figures.append(("Optimization history", plots.history_figure(history, metrics[0])))
        dims = parallel_data(trials, metrics[0])
        figures.append(("Parallel coordinates", plots.parallel_figure(dims)))
    importance = importance_data(trials, directions)
    if importance.empty:
        notes.append(
            "parameter importances: needs at least 3 complete trials with varied parameters"
        )
    else:
        figures.append(("Parameter importances", plots.importance_figure(importance, metrics[0])))
    if len(metrics) > 1:
        pareto = pareto_data(trials, metrics, directions)
        if not pareto.empty:
            figures.append(("Pareto front", plots.pareto_figure(pareto, metrics)))
            optimal = board[board["pareto"]].drop(columns=["rank", "state", "pareto"])
            tables.append(("Pareto-optimal configurations", optimal))
    for name, frame in component_data(trials).items():
        figures.append((f"{metrics[0]} by {name}", plots.component_figure(frame, name, metrics[0])))
    sized = state_size_data(trials, metrics[0], study.family_params())
    if not sized.empty:
        title = f"{metrics[0]} against state size, per model family"
        figures.append((title, plots.state_size_figure(sized, metrics[0])))
    slices = slice_data(trials, metrics[0])
    if not slices.empty:
        title = f"{metrics[0]} per slice of the test split"
        figures.append((title, plots.slice_figure(slices, metrics[0])))
    swept = sweep_data(trials, metrics[0])
    if not swept.empty:
        for field_name in study.sweep_points[0]:
            title = f"validation {metrics[0]} against {field_name} (the sweep inside each trial)"
            figures.append((title, plots.sweep_figure(swept, field_name, metrics[0])))
        tables.append(("Sweep points (mean over the seeds; selected on validation)", swept))

    edges = edge_note(trials)
    if edges is not None:
        notes.append(edges)

    html = out / "report.html"
    counts = board["state"].value_counts().to_dict() if not board.empty else {}
    heading = (
        f"Study {handle.study_name}: {len(trials)} trials "
        f"({counts.get('complete', 0)} complete, {counts.get('pruned', 0)} pruned); "
        f"objectives: {', '.join(f'{m} ({d})' for m, d in zip(metrics, directions, strict=True))}"
    )
    tables.append(("Leaderboard", board))
    html.write_text(plots.page(f"miras study {handle.study_name}", heading, figures, tables, notes))
    summary = summary_data(trials, metrics, directions)
    return Report(board, csv, html, [title for title, _ in figures], notes, summary)


# ---------------------------------------------------------------------------------------------
# Export


def pick_trial(
    trials: list[FrozenTrial], directions: list[str], number: int | None = None
) -> FrozenTrial:
    """Trial `number`, or the best complete trial on the first objective, ties broken by the
    next objectives in order (with several objectives that trial is on the Pareto front)."""
    if number is not None:
        found = [t for t in trials if t.number == number]
        if not found or "spec" not in found[0].user_attrs:
            raise ValueError(f"trial {number}: no such trial with a spec in this study")
        return found[0]
    done = [
        t for t in trials if t.state == TrialState.COMPLETE and t.values and "spec" in t.user_attrs
    ]
    if not done:
        raise ValueError("the study has no complete trial yet: nothing to export")
    return min(done, key=lambda t: (objective_order(t.values, directions), t.number))


def export_text(trial: FrozenTrial, study: StudyDef, study_name: str, path: str) -> str:
    """The trial's spec YAML, headed by where it came from and how to train it again."""
    values = ", ".join(
        f"{m} = {v:.6g} ({d})"
        for m, v, d in zip(study.metrics, trial.values or [], study.directions, strict=False)
    )
    train = trial.user_attrs.get("train", {})
    task = " ".join(f"--task-option {k}={v}" for k, v in study.task.options.items())
    flags = " ".join(
        f"--{k.replace('_', '-')} {v:.6g}"
        if isinstance(v, float)
        else f"--{k.replace('_', '-')} {v}"
        for k, v in train.items()
        if v is not None  # a setting left off (early_stop): the command's default is off too
    )
    header = [
        f"# Trial {trial.number} of study {study_name} ({trial.state.name.lower()}): {values}"
    ]
    seeds = [r["seed"] for r in trial.user_attrs.get("replicates") or []]
    if len(seeds) > 1:
        listed = ", ".join(map(str, seeds))
        header.append(f"# Means over seeds {listed}; the run trains seed {seeds[0]} (--seed S).")
    header += [
        "# Run (the trial's task and training):",
        f"#   miras train {path} --task {study.task.name} {task} \\".replace("  \\", " \\"),
        f"#     {flags}",
    ]
    return "\n".join(header) + "\n" + trial.user_attrs["spec"]
