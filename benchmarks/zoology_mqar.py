"""MQAR where the state binds: does the delta rule (DeltaNet) beat linear attention?

    .venv/bin/python benchmarks/zoology_mqar.py            # the full budget (below)
    .venv/bin/python benchmarks/zoology_mqar.py --quick    # 8 steps: checks that it runs

Zoology (Arora et al. 2023) and DeltaNet (Yang et al. 2024) find that the delta rule recalls
where linear attention's additive state saturates. The study is studies/zoology_mqar.yaml (its
header has the task and the sizes): 8 pairs in 32 tokens, two layers, d_model 32 in 4 heads
(d_k = 8), scored on test slices of 8 pairs in 32 tokens and 16 pairs in 64 (the test accuracy
is their mean). Each model runs that study with its spec file's component fields
(`specs/<model>.yaml`): one study per model, run two at a time with one torch thread each
(benchmarks/reproduction.py). Protocol (docs/search.md, "Sweeps inside a trial"): every lr of
the sweep on seeds 0, 1, 2; the lr with the best mean validation accuracy is selected; its runs
are scored on the test split; early stop at 0.99.

The verdict: reproduced when DeltaNet's test mean is above linear attention's and Welch's
two-sided test separates them at p < 0.05; otherwise not reproduced, with the figures.

Budget (process time per training step at these sizes, one thread, measured under load 7-10:
DeltaNet 64 ms, linear attention 48 ms): 2 models x 3 lr x 3 seeds = 18 runs of at most 1000
steps, 9 x 1000 x (64 + 48) ms = 1008 CPU-s plus evaluations, about 9 minutes on 2 cores at
most; runs that reach 0.99 stop early, and a quiet machine steps faster.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path


def _sibling(name: str):
    """benchmarks/<name>.py as module `name` (registered, so the worker processes unpickle
    its functions by name)."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rep = _sibling("reproduction")

STUDY = "studies/zoology_mqar.yaml"
# name -> (spec file, family): the delta rule overwrites, the dot bias only adds.
MODELS = {
    "deltanet": ("specs/deltanet.yaml", "delta rule"),
    "linear_attention": ("specs/linear_attention.yaml", "additive"),
}
DELTA = ("deltanet",)
ADDITIVE = ("linear_attention",)


def jobs(quick: bool) -> list:
    base = rep.load_yaml(STUDY)
    if quick:
        base = rep.quick_study(base)
        base["name"] += "-quick"
    return [
        rep.Job(rep.model_study(base, name, rep.spec_fields(path)), name, family)
        for name, (path, family) in MODELS.items()
    ]


def comparisons(rows: list) -> list[tuple[str, str, bool, float]]:
    """(delta-rule model, additive model, it beats it at p < 0.05, Welch p) for each pair
    present in `rows`."""
    by = {r.model: r for r in rows}
    found = []
    for a in DELTA:
        for b in ADDITIVE:
            if a in by and b in by:
                won, p = rep.beats(by[a].seeds, by[b].seeds)
                found.append((a, b, won, p))
    return found


def verdict(rows: list) -> str:
    pairs = comparisons(rows)
    missing = [m for m in (*DELTA, *ADDITIVE) if m not in {r.model for r in rows}]
    if missing:
        return f"verdict: not reproduced (no test result for {', '.join(missing)})"
    failed = [f"{a} vs {b} (p = {p:.3g})" for a, b, won, p in pairs if not won]
    if not failed:
        return (
            "verdict: reproduced: DeltaNet beats linear attention on test accuracy at "
            "p < 0.05 (Welch, 3 seeds)"
        )
    return "verdict: not reproduced: not above at p < 0.05: " + "; ".join(failed)


def table(rows: list) -> str:
    """One row per model, best first: family, test accuracy mean [95% t interval], per seed,
    the selected lr, and Welch p of each delta-rule model against each additive one."""
    pairs = comparisons(rows)
    header = ["model", "family", "test accuracy [95% interval]", "seeds", "selected",
              "Welch p vs linear_attention"]  # fmt: skip
    body = []
    for r in sorted(rows, key=lambda r: -r.mean):
        against = {b: p for a, b, _, p in pairs if a == r.model}
        ps = [f"{against[b]:.3g}" if b in against else "" for b in ADDITIVE]
        seeds = ", ".join(f"{v:.3f}" for v in r.seeds)
        body.append([r.model, r.family, rep.interval_text(r.seeds), seeds,
                     rep.selected_text(r.selected), *ps])  # fmt: skip
    return rep.markdown(header, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny budget: checks that it runs")
    p.add_argument("--workers", type=int, default=2, help="studies run at a time")
    p.add_argument(
        "--out", default="runs/zoology_mqar", help="one SQLite file per model (full runs)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="miras-mqar-") as scratch:
        folder = scratch if args.quick else args.out  # a quick run leaves nothing behind
        results, cost = rep.run_studies(jobs(args.quick), args.workers, folder)
    rows = [row for result in results for row in result.rows]
    print(table(rows))
    for result in results:
        for line in result.failed:
            print(f"  {line}")
    print(rep.cost_line(cost, args.workers, results))
    print(verdict(rows))


if __name__ == "__main__":
    main()
