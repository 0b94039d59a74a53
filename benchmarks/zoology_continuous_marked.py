"""Continuous MQAR with marked queries: test accuracy against state size for DeltaNet, Gated
DeltaNet and linear attention, with an lr sweep that brackets and a budget past the delta
rule's rise, and the learning curves that show it (issue 36, item 3).

    .venv/bin/python benchmarks/zoology_continuous_marked.py            # the full budget
    .venv/bin/python benchmarks/zoology_continuous_marked.py --quick    # checks that it runs
    .venv/bin/python benchmarks/zoology_continuous_marked.py --retnet   # RetNet as a fourth
    .venv/bin/python benchmarks/zoology_continuous_marked.py --heads 4  # one head count only

benchmarks/zoology_continuous.py found linear attention above the delta rule at every head
count, with its lr sweep's smallest value (3e-3) selected in 17 of 18 configurations and a
600-step budget on which DeltaNet was still rising; the quickstart's study without the marker
(docs/claims.md) then found that the queries' own writes are what hurt the delta rule. This
script runs zoology_continuous.py's task and sizes with the queries marked
(studies/zoology_continuous_marked.yaml has the sizes and the budget): 16 pairs of frozen random
vectors (V 64, d_e 32), one layer, no short convolution, d_model 32 in 1, 2 or 4 heads; lr over
logspace(1e-3, 1e-2, 3) extended past the selected edge up to twice (3.16e-4 and 1e-4 below,
3.16e-2 and 0.1 above; docs/search.md, "Logspace sweeps that extend"); seeds 0, 1, 2, selected
on validation, scored on test, early stop at 0.99. One study per model, two at a time
(benchmarks/reproduction.py).

Learning curves: after the studies, seed 0 of DeltaNet and linear attention is trained again
with `miras train` at each head count's selected lr and the study's budget (early stop off),
and the validation accuracy of its metrics log (runs/<out>/curves/*/metrics.jsonl) is printed
against the step. The verdict is zoology_continuous.py's: DeltaNet and Gated DeltaNet each
above linear attention at every head count at p < 0.05 (Welch, 3 seeds); and per model, whether
the largest state beats the smallest.

Budget: CPU time a step at d_model 32, T 32, about 13 to 32 ms (zoology_continuous.py's
figures); 3 models x 9 to 15 runs x 1000 steps per head count, 500 to 700 CPU-s each.
Measured 2026-12-07 one head count at a time (`--heads 4`, then 2, then 1; docs/claims.md has
the tables and the curves): 712, 526 and 499 s of CPU; 49, 15 and 4 min wall on 2 cores shared
at a load average of 2 to 14. DeltaNet beat linear attention at 1 and 2 heads (Welch p = 0.012,
0.036), not at 4 (p = 0.198); Gated DeltaNet was above in the mean and separated at none. RetNet
was not run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import reproduction as rep  # benchmarks/: the script's sys.path[0]
import zoology_continuous as zc

STUDY = "studies/zoology_continuous_marked.yaml"
MODELS = {  # name -> (spec file, family)
    "linear_attention": ("specs/linear_attention.yaml", "additive"),
    "gated_deltanet": ("specs/gated_deltanet.yaml", "delta rule + decay"),
    "deltanet": ("specs/deltanet.yaml", "delta rule"),
}
RETNET = ("specs/retnet.yaml", "additive + fixed decay")
CURVES = ("deltanet", "linear_attention")
ORDER = ["deltanet", "gated_deltanet", "linear_attention", "retnet"]


def jobs(quick: bool, retnet: bool = False, heads: list[int] | None = None) -> list:
    base = rep.load_yaml(STUDY)
    if heads:
        base["spec"]["model"]["n_heads"] = {"choices": list(heads)}
        base["name"] += "-h" + "-".join(str(h) for h in heads)
    if quick:
        base = rep.quick_study(base)
        base["name"] += "-quick"
        base["spec"]["model"]["n_heads"] = {"choices": [2]}
    models = dict(MODELS)
    if retnet:
        models["retnet"] = RETNET
    return [
        rep.Job(rep.model_study(base, name, rep.spec_fields(path)), name, family)
        for name, (path, family) in models.items()
    ]


def points_text(row) -> str:
    points = sorted(row.points, key=lambda p: p[0].get("lr", 0.0))
    return ", ".join(f"{p[0]['lr']:.3g}: {p[1]:.3f}" for p in points)


def table(rows: list) -> str:
    """One row per (model, heads), by model then state size: state bytes, test accuracy mean
    [95% t interval], per seed, the selected lr (at an edge or not), every lr's mean validation
    accuracy, Welch p against linear attention at the same heads."""
    header = ["model", "heads", "state bytes", "test accuracy [95% interval]", "seeds 0, 1, 2",
              "selected", "validation mean per lr", "Welch p vs linear attention"]  # fmt: skip
    by = {(r.model, zc.heads(r)): r for r in rows}
    rank = {m: i for i, m in enumerate(ORDER)}
    body = []
    for r in sorted(rows, key=lambda r: (rank.get(r.model, len(ORDER)), r.state_bytes)):
        ref = by.get((zc.REFERENCE, zc.heads(r)))
        p = "" if ref is None or ref is r else f"{rep.p_value(r.seeds, ref.seeds):.3g}"
        size = f"{r.state_bytes:,.0f}" if math.isfinite(r.state_bytes) else "?"
        seeds = ", ".join(f"{v:.3f}" for v in r.seeds)
        body.append([r.model, str(zc.heads(r)), size, rep.interval_text(r.seeds), seeds,
                     rep.selected_label(r), points_text(r), p])  # fmt: skip
    return rep.markdown(header, body)


def curve_command(study: dict, spec: str, heads: int, lr: float, out: Path) -> list[str]:
    """`miras train` of the study's task and model at `heads` and `lr`, seed 0, early stop off."""
    train, model = study["train"], dict(study["spec"]["model"], n_heads=heads)
    task = study["task"]
    cmd = [str(Path(sys.executable).with_name("miras")), "train", spec, "--task", task["name"]]
    for k, v in task["options"].items():
        cmd += ["--task-option", f"{k}={json.dumps(v) if isinstance(v, bool) else v}"]
    for k, v in model.items():
        cmd += ["--model", f"{k}={v}"]
    cmd += ["--steps", str(train["steps"]), "--batch-size", str(train["batch_size"]),
            "--lr", repr(lr), "--warmup", str(train["warmup"]),
            "--weight-decay", str(train["weight_decay"]), "--eval-every",
            str(train["eval_every"]), "--eval-batches", str(train["eval_batches"]),
            "--seed", "0", "--threads", "1", "--no-progress", "--out", str(out)]  # fmt: skip
    return cmd


def validation_curve(path: Path) -> dict[int, float]:
    curve = {}
    with open(path) as handle:
        for line in handle:
            record = json.loads(line)
            if record.get("split") == "valid" and "accuracy" in record:
                curve[int(record["step"])] = float(record["accuracy"])
    return curve


def learning_curves(study: dict, rows: list, folder: Path, workers: int) -> dict:
    """(model, heads) -> {step: validation accuracy} of seed 0 at the selected lr."""
    wanted = [r for r in rows if r.model in CURVES and "lr" in r.selected]
    specs = {**{m: p for m, (p, _) in MODELS.items()}, "retnet": RETNET[0]}

    def one(r):
        out = folder / "curves" / f"{r.model}-h{zc.heads(r)}"
        log = out / "metrics.jsonl"
        if not log.exists() or not validation_curve(log):
            cmd = curve_command(study, specs[r.model], zc.heads(r), r.selected["lr"], out)
            subprocess.run(cmd, check=True, cwd=rep.ROOT, stdout=subprocess.DEVNULL)
        return (r.model, zc.heads(r)), validation_curve(log)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(one, wanted))


def curves_table(curves: dict) -> str:
    keys = sorted(curves, key=lambda k: (ORDER.index(k[0]), k[1]))
    steps = sorted({s for c in curves.values() for s in c})
    header = ["step", *(f"{m} h{h}" for m, h in keys)]
    body = [[str(s), *(f"{curves[k][s]:.3f}" if s in curves[k] else "" for k in keys)]
            for s in steps]  # fmt: skip
    return rep.markdown(header, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny budget: checks that it runs")
    p.add_argument("--workers", type=int, default=2, help="studies run at a time")
    p.add_argument("--retnet", action="store_true", help="RetNet as a fourth model")
    p.add_argument("--heads", type=int, nargs="+", help="run only these head counts (a cut budget)")
    p.add_argument("--no-curves", action="store_true", help="skip the learning-curve runs")
    p.add_argument("--out", default="runs/zoology_continuous_marked", help="SQLite files, curves")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    found = jobs(args.quick, args.retnet, args.heads)
    with tempfile.TemporaryDirectory(prefix="miras-zcm-") as scratch:
        folder = Path(scratch if args.quick else args.out)
        results, cost = rep.run_studies(found, args.workers, folder)
        rows = rep.print_results(results, cost, args.workers, table)
        for line in zc.verdict([r for r in rows if r.model in (*zc.DELTA, zc.REFERENCE)]):
            print(line)
        if not args.no_curves:
            wall, cpu = time.perf_counter(), _children_cpu()
            curves = learning_curves(found[0].study, rows, folder, args.workers)
            print("validation accuracy against step, seed 0 at the selected lr:")
            print(curves_table(curves))
            print(f"curves: CPU time {_children_cpu() - cpu:.0f} s, wall "
                  f"{time.perf_counter() - wall:.0f} s")  # fmt: skip


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
