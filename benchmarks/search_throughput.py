"""Trials per hour of a study with 1 and 2 workers, and how many trials the pruner stopped.

    python benchmarks/search_throughput.py                      # studies/quickstart.yaml
    python benchmarks/search_throughput.py --workers 1 2 4 --trials 20

Each setting runs the whole study from scratch in a fresh SQLite file (under a temporary
folder), one torch thread per worker, and prints a markdown table. Wall-clock figures on a
shared machine move with its load: the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import optuna

from miras.search import load_study, search
from miras.search.storage import open_existing

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "quickstart.yaml")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--trials", type=int, default=None, help="default: the study's")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = load_study(args.study)
    trials = args.trials or study.trials
    print(f"study {study.name}: {trials} trials, cores {os.cpu_count()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for workers in args.workers:
            storage = f"sqlite:///{Path(folder) / f'w{workers}.db'}"
            load = os.getloadavg()[0]
            began = time.perf_counter()
            summary = search(study, trials=trials, workers=workers, storage=storage, threads=1)
            seconds = time.perf_counter() - began
            handle, _ = open_existing(str(args.study), storage)
            states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
            done = [t for t in handle.get_trials(deepcopy=False) if t.state in states]
            pruned = [t for t in done if t.state == optuna.trial.TrialState.PRUNED]
            early = [t for t in pruned if t.user_attrs.get("reason", "").startswith("pruned at")]
            # Training steps done: a pruned trial stopped at its last evaluation. Trials per hour
            # move with how many the pruner stops; steps per second is the work rate.
            steps = sum(_steps_done(t) for t in done)
            best = summary.best.values[0] if summary.best else float("nan")
            row = (
                workers, summary.counts.finished, seconds, 3600 * summary.counts.finished / seconds,
                len(pruned), len(early), steps / seconds, best, load, os.getloadavg()[0],
            )  # fmt: skip
            rows.append(row)
            print(f"  workers {workers}: {seconds:.0f} s, {row[3]:.0f} trials/hour", flush=True)
    print()
    print(
        "| workers | trials | seconds | trials / hour | pruned | of which by the pruner "
        f"| training steps / s | best {study.metrics[0]} | load before | load after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w, n, s, rate, pruned, early, speed, best, l0, l1 in rows:
        print(
            f"| {w} | {n} | {s:.0f} | {rate:.0f} | {pruned} | {early} | {speed:.1f} | {best:.3f} "
            f"| {l0:.1f} | {l1:.1f} |"
        )


def _steps_done(trial: optuna.trial.FrozenTrial) -> int:
    if trial.state == optuna.trial.TrialState.PRUNED:
        return max(trial.intermediate_values, default=0)
    return trial.user_attrs.get("train", {}).get("steps", 0)


if __name__ == "__main__":
    main()
