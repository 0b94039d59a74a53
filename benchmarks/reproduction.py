"""Shared parts of the trained-answer reproductions (benchmarks/zoology_forgetting.py,
benchmarks/zoology_continuous.py, benchmarks/mad_protocol.py): one study per model spec, run
two at a time, and the rows of their one table.

    base = yaml.safe_load(open("studies/zoology_forgetting.yaml"))
    studies = [model_study(base, "deltanet", spec_fields("specs/deltanet.yaml"))]
    results, cpu = run_studies(studies, workers=2, folder="runs/zoology_forgetting")
    rows = [row for r in results for row in r.rows]          # one per complete trial

Why one study per model: a study searches spec *fields* (`bias: {choices: ...}`); a choice
sits on one field, so it cannot pick a whole spec (linear attention differs from DeltaNet in
its bias and its learning-rate gate, Titans from Gated DeltaNet in its memory and optimizer,
and so on). Each model's study is the reproduction's study file with its component fields
replaced by the model's spec file (`specs/<model>.yaml`); the `model:` section, the task, the
sweep, the seeds and the protocol stay the study file's. A study with one configuration has
one trial, so a second Optuna worker on it would idle: the studies run `workers` at a time,
each in its own process with one torch thread (`search(..., workers=1, threads=1)`), which
keeps two cores busy the way `--workers 2` does on a study with many trials.

CPU time is `time.process_time()` of this process plus `resource.getrusage(RUSAGE_CHILDREN)`
(user + system) of the worker processes, which are joined before it is read.
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import resource
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miras.search.space import logspace_value
from miras.stats import confidence_interval, welch_p

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("memory", "feature_map", "bias", "retention", "optimizer", "window")
SIGNIFICANCE = 0.05


# ---------------------------------------------------------------------------------------------
# Studies


def load_yaml(path: str | Path) -> dict[str, Any]:
    with open(ROOT / path) as handle:
        return yaml.safe_load(handle)


def spec_fields(path: str | Path, **changes: Any) -> dict[str, Any]:
    """A spec file's component fields (memory, feature_map, bias, ...; no name, description
    or model section), with `changes` put over them."""
    data = load_yaml(path)
    fields = {k: v for k, v in data.items() if k in COMPONENTS}
    return {**fields, **changes}


def model_study(
    base: dict[str, Any],
    label: str,
    fields: dict[str, Any],
    model: dict[str, Any] | None = None,
    task_options: dict[str, Any] | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """The study `base` (a study file's dict) for one model: its spec's component fields
    replaced by `fields`, `model` put over its model section, `task_options` over its task's,
    named `<base name>-<label>` unless `name` is given."""
    study = copy.deepcopy(base)
    spec = {k: v for k, v in study["spec"].items() if k not in COMPONENTS}
    spec.update(copy.deepcopy(fields))
    if model:
        spec["model"] = {**spec.get("model", {}), **model}
    study["spec"] = spec
    if task_options:
        study["task"]["options"] = {**study["task"].get("options", {}), **task_options}
    study["name"] = name or f"{base['name']}-{label}"
    return study


def sweep_values(sweep: list | dict[str, Any]) -> list:
    """A sweep's values in order: the list, or a logspace mapping's n values from lo to hi
    (`{logspace: [lo, hi, n], extend: ...}`, docs/search.md; the points an extension may add
    are not listed)."""
    if isinstance(sweep, dict):
        low, high, count = sweep["logspace"]
        return [logspace_value((low, high, count), i) for i in range(count)]
    return list(sweep)


def quick_study(study: dict[str, Any], steps: int = 8, points: int = 1, seeds: int = 2) -> dict:
    """The study at a budget that only checks that everything runs: `steps` steps, the first
    `points` values of each sweep (a logspace's lowest values, as a list: it does not
    extend), `seeds` replicates, one evaluation batch."""
    study = copy.deepcopy(study)
    train = study["train"]
    train.update(steps=steps, warmup=0, eval_every=max(1, steps // 2), eval_batches=1)
    for key, value in train.items():
        if isinstance(value, dict) and "sweep" in value:
            train[key] = {"sweep": sweep_values(value["sweep"])[:points]}
    study["replicates"] = seeds
    return study


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class Row:
    """One complete trial: a model at one configuration, scored on the test split.

    `seeds` holds the test metric per seed at the selected sweep point; `slices` the same per
    test slice where the task has several (`{"n16": [...]}`, MQAR's `test_grid`); `at_edge`
    the trial's mark where a sweep did not bracket its selection (`{"lr": "low"}`) and
    `extended` the values an extending sweep ran past its ends (`{"lr": {"low": 1}}`);
    `points` every sweep point the trial ran, in run order, with its mean validation value of
    the first objective over the seeds (NaN where a seed diverged or is missing)."""

    model: str
    family: str
    seeds: list[float]
    selected: dict[str, Any]
    state_bytes: float
    params: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's (a MAD subtask)
    slices: dict[str, list[float]] = field(default_factory=dict)
    at_edge: dict[str, str] = field(default_factory=dict)
    extended: dict[str, dict[str, int]] = field(default_factory=dict)
    points: list[tuple[dict[str, Any], float]] = field(default_factory=list)  # (values, valid)

    @property
    def interval(self) -> tuple[float, float, float]:
        return confidence_interval(self.seeds)

    @property
    def mean(self) -> float:
        return self.interval[0]


def sweep_points(records: list[dict[str, Any]], metric: str) -> list[tuple[dict, float]]:
    """(values, mean validation `metric` over the seeds) per point of a trial's `sweep`
    records, in point order; NaN where a run diverged."""
    by: dict[int, tuple[dict, list[float]]] = {}
    for record in records:
        by.setdefault(record["point"], (record["values"], []))[1].append(
            record["valid"].get(metric, math.nan)
        )
    return [(values, sum(s) / len(s)) for _, (values, s) in sorted(by.items())]


@dataclass
class StudyResult:
    name: str
    label: str
    rows: list[Row]
    failed: list[str]  # pruned or failed trials: their reasons
    seconds: float
    resumed: bool = False  # its storage existed before this run (earlier work is not timed)


def _run_one(job: tuple[dict[str, Any], str, str, str, dict[str, Any]]) -> StudyResult:
    """One model's study, in a worker process: searched to its budget, then read back."""
    import optuna
    from optuna.trial import TrialState

    from miras.search import search

    study, label, family, storage, extra = job
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    metric = study["objectives"][0]
    metric = metric if isinstance(metric, str) else metric["metric"]
    resumed = Path(storage.removeprefix("sqlite:///")).exists()
    began = time.perf_counter()
    summary = search(study, storage=storage, workers=1, threads=1)
    rows, failed = [], []
    for t in summary.trials:
        if t.state == TrialState.COMPLETE and t.user_attrs.get("replicates"):
            runs = t.user_attrs["replicates"]
            seeds = [r["metrics"][metric] for r in runs]
            prefix = f"{metric}_"  # per-slice test metrics: accuracy_n16 (not valid_accuracy)
            names = [k for k in runs[0]["metrics"] if k.startswith(prefix)]
            slices = {k.removeprefix(prefix): [r["metrics"][k] for r in runs] for k in names}
            metrics = t.user_attrs.get("metrics") or {}
            selected = (t.user_attrs.get("selected") or {}).get("values") or {}
            rows.append(
                Row(label, family, seeds, selected, metrics.get("state_bytes", math.nan),
                    dict(t.params), dict(extra), slices,
                    dict(t.user_attrs.get("at_edge") or {}),
                    dict(t.user_attrs.get("extended") or {}),
                    sweep_points(t.user_attrs.get("sweep") or [], metric))
            )  # fmt: skip
        elif t.state in (TrialState.PRUNED, TrialState.FAIL):
            reason = t.user_attrs.get("reason") or t.user_attrs.get("error") or "failed"
            failed.append(f"{label} trial {t.number}: {reason}")
    seconds = time.perf_counter() - began
    return StudyResult(study["name"], label, rows, failed, seconds, resumed)


@dataclass
class Job:
    study: dict[str, Any]
    label: str  # the model's name in the table
    family: str = ""  # what kind of model it is (shown beside the name)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Cost:
    cpu: float  # seconds: this process plus its joined workers
    wall: float


def run_studies(jobs: list[Job], workers: int, folder: str | Path) -> tuple[list, Cost]:
    """Every job's study, `workers` at a time (spawned processes, one torch thread each), each
    in its own SQLite file `folder/<study name>.db` (a finished study there is read back, not
    run again). Returns the results in job order and the CPU and wall time they took."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    wall, own = time.perf_counter(), time.process_time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tasks = [
        (j.study, j.label, j.family, f"sqlite:///{folder / (j.study['name'] + '.db')}", j.extra)
        for j in jobs
    ]
    # One thread per worker from the start: the workers inherit this before torch loads (the
    # search also sets torch's threads to 1; OpenMP threads that spin would slow both cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = multiprocessing.get_context("spawn")  # torch does not survive fork well
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        results = list(pool.map(_run_one, tasks))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the pool's processes are joined
    children = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cost = Cost(time.process_time() - own + children, time.perf_counter() - wall)
    return results, cost


# ---------------------------------------------------------------------------------------------
# Tables


def interval_text(seeds: list[float]) -> str:
    mean, low, high = confidence_interval(seeds)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def p_value(a: list[float], b: list[float]) -> float:
    """Welch's two-sided p, NaN where a side has fewer than two seeds."""
    return welch_p(a, b) if len(a) > 1 and len(b) > 1 else math.nan


def beats(a: list[float], b: list[float]) -> tuple[bool, float]:
    """(a's mean is above b's and Welch's test separates them at p < 0.05, p)."""
    p = p_value(a, b)
    higher = sum(a) / len(a) > sum(b) / len(b)
    return bool(higher and p < SIGNIFICANCE), p


def selected_text(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def selected_label(row: Row) -> str:
    """The selected sweep point, with a note per swept setting whose selection sits at the
    edge of what the trial ran (`lr=0.001 (lr at the low edge)`) and the values an extending
    sweep ran past its ends (`lr +1 below`)."""
    text = selected_text(row.selected)
    notes = [f"{k} at the {side} edge" for k, side in row.at_edge.items()]
    for k, ends in row.extended.items():
        past = [f"+{n} {'below' if end == 'low' else 'above'}" for end, n in ends.items() if n]
        if past:
            notes.append(f"{k} {', '.join(past)}")
    return f"{text} ({'; '.join(notes)})" if notes else text


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_results(results: Sequence[StudyResult], cost: Cost, workers: int, table) -> list:
    """Prints the studies' rows as `table(rows)` draws them, each failed trial's line and the
    cost line; returns the rows (for the script's verdict)."""
    rows = [row for result in results for row in result.rows]
    print(table(rows))
    for result in results:
        for line in result.failed:
            print(f"  {line}")
    print(cost_line(cost, workers, results))
    return rows


def cost_line(cost: Cost, workers: int, results: Sequence[StudyResult] = ()) -> str:
    """The CPU and wall time of this run; studies resumed from storage are named, since the
    time they took before is not in it."""
    line = (
        f"CPU time {cost.cpu:.0f} s (this process and its {workers} workers), wall "
        f"{cost.wall:.0f} s"
    )
    resumed = [r.name for r in results if r.resumed]
    if resumed:
        line += f"; {len(resumed)} of {len(results)} studies resumed from storage, their earlier"
        line += " time not counted: " + ", ".join(resumed)
    return line


# ---------------------------------------------------------------------------------------------
# A claim that every model of one group beats every model of another (the delta rule against
# additive memories, benchmarks/zoology_mqar.py and zoology_forgetting.py)


def comparisons(rows: list[Row], winners: Sequence[str], losers: Sequence[str]) -> list:
    """(winner, loser, it beats it at p < 0.05, Welch p) for each pair present in `rows`."""
    by = {r.model: r for r in rows}
    found = []
    for a in winners:
        for b in losers:
            if a in by and b in by:
                won, p = beats(by[a].seeds, by[b].seeds)
                found.append((a, b, won, p))
    return found


def pairwise_verdict(
    rows: list[Row], winners: Sequence[str], losers: Sequence[str], claim: str
) -> str:
    """'verdict: reproduced: <claim>' when every winner beats every loser at p < 0.05."""
    missing = [m for m in (*winners, *losers) if m not in {r.model for r in rows}]
    if missing:
        return f"verdict: not reproduced (no test result for {', '.join(missing)})"
    pairs = comparisons(rows, winners, losers)
    failed = [f"{a} vs {b} (p = {p:.3g})" for a, b, won, p in pairs if not won]
    if not failed:
        return f"verdict: reproduced: {claim}"
    return "verdict: not reproduced: not above at p < 0.05: " + "; ".join(failed)


def pairwise_table(rows: list[Row], winners: Sequence[str], losers: Sequence[str]) -> str:
    """One row per model, best first: family, test accuracy mean [95% t interval], per seed,
    the selected sweep point, and Welch p of each winner against each loser."""
    pairs = comparisons(rows, winners, losers)
    header = ["model", "family", "test accuracy [95% interval]", "seeds", "selected",
              *(f"Welch p vs {b}" for b in losers)]  # fmt: skip
    body = []
    for r in sorted(rows, key=lambda r: -r.mean):
        against = {b: p for a, b, _, p in pairs if a == r.model}
        ps = [f"{against[b]:.3g}" if b in against else "" for b in losers]
        seeds = ", ".join(f"{v:.3f}" for v in r.seeds)
        body.append([r.model, r.family, interval_text(r.seeds), seeds,
                     selected_label(r), *ps])  # fmt: skip
    return markdown(header, body)


def main(
    doc: str,
    name: str,
    jobs: Callable[[bool], list[Job]],
    table: Callable[[list[Row]], str],
    verdict: Callable[[list[Row]], str | list[str]],
) -> None:
    """A reproduction script's command line: --quick, --workers, --out runs/<name>; then its
    table, the failed trials, the cost line and the verdict."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny budget: checks that it runs")
    p.add_argument("--workers", type=int, default=2, help="studies run at a time")
    p.add_argument("--out", default=f"runs/{name}", help="one SQLite file per model (full runs)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix=f"miras-{name}-") as scratch:
        folder = scratch if args.quick else args.out  # a quick run leaves nothing behind
        results, cost = run_studies(jobs(args.quick), args.workers, folder)
    rows = print_results(results, cost, args.workers, table)
    lines = verdict(rows)
    for line in [lines] if isinstance(lines, str) else lines:
        print(line)
