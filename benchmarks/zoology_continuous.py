"""Continuous MQAR: test accuracy against state size (Zoology's curve) for linear attention,
DeltaNet, Gated DeltaNet, OmegaNet (c = 4), the delta rule on taylor features and Titans.

    .venv/bin/python benchmarks/zoology_continuous.py            # the full budget (below)
    .venv/bin/python benchmarks/zoology_continuous.py --quick    # 8 steps: checks that it runs

The study is studies/zoology_continuous.yaml (its header has the task and the sizes): 16 pairs
of frozen random vectors (V 64, d_e 32), T 32; one layer, no short conv, d_model 32 in 1, 2 or
4 heads (d_k 32, 16, 8; the state shrinks with the heads). Each model runs that study with its
spec file's component fields, one study per model because a study's choices pick one spec
field, not a whole spec; each study grids the head counts (3 trials), and
benchmarks/reproduction.py runs the studies two at a time, one torch thread each. Protocol
(docs/search.md, "Sweeps inside a trial"): every lr of the sweep on seeds 0, 1, 2; the lr with
the best mean validation accuracy is selected; its runs are scored on the test split; early
stop at 0.99. `miras report` on one model's SQLite file (under --out) draws its curve.

The verdict (Zoology's ordering at equal state): reproduced when, at every head count, DeltaNet
and Gated DeltaNet each have a higher test mean than linear attention, which has the same
state (d_model^2 / heads floats), and Welch's two-sided test separates them at p < 0.05. A
second line says, per model, whether its largest state beats its smallest at p < 0.05 (the
curve rises).

Budget (measured 2026-12-01, OMP_NUM_THREADS=1, `time.process_time()` over 50 training steps
at these sizes, batch 32, with one evaluation; load average 10-12 on the 2 cores), ms a step
at 1 / 2 / 4 heads: linear attention 27 / 31 / 32, DeltaNet 13 / 14 / 17, Gated DeltaNet
14 / 16 / 18, OmegaNet 28 / 35 / 49, Titans 32 / 32 / 29, taylor delta rule 59 / 35 / 27;
508 ms for one step of each of the 18 configurations.
18 configurations x 3 lr x 3 seeds = 162 runs of at most 600 steps:
  9 x 600 steps x 508 ms = 2743 CPU-s, plus evaluations and a test pass (about 1 s a run:
  162 s) = about 2905 CPU-s at most,
which is 1453 s (24 minutes) on 2 cores, under the 3600 CPU-s of 30 minutes; runs that reach
0.99 stop early. The studies start largest first so that the two workers finish together
(about 254 s of 508 ms-steps each). Pilot: DeltaNet at 2 heads, lr 1e-2, reached 0.50 test
accuracy at 800 steps, still rising, so 600 steps separate models that learn from ones that do
not, not the final accuracies. --quick: 8 steps, one lr, 2 seeds, 1 and 2 heads (24 runs).

Measured 2026-12-01 at the full budget (docs/claims.md has the table): 2627 CPU-s, 5878 s wall
on 2 cores shared at a load average of 9-15. Verdict: not reproduced (linear attention above
both delta-rule models at every head count; lr 3e-3, the sweep's smallest, selected in 17 of 18
configurations).
"""

from __future__ import annotations

import math

import reproduction as rep  # benchmarks/reproduction.py: benchmarks/ is the script's sys.path[0]

STUDY = "studies/zoology_continuous.yaml"
HEADS = "model.n_heads"  # the study's grid: the state size
# name -> (spec file, changes over it, family), largest cost first (the workers' order).
MODELS = {
    "deltanet_taylor": ("specs/deltanet.yaml", {"feature_map": "taylor"}, "delta rule, taylor"),
    "omeganet": ("specs/omeganet.yaml", {}, "Omega rule c=4, poly 2"),
    "titans": ("specs/titans.yaml", {}, "MLP memory, momentum"),
    "linear_attention": ("specs/linear_attention.yaml", {}, "additive"),
    "gated_deltanet": ("specs/gated_deltanet.yaml", {}, "delta rule + decay"),
    "deltanet": ("specs/deltanet.yaml", {}, "delta rule"),
}
ORDER = ["linear_attention", "deltanet", "gated_deltanet", "omeganet", "deltanet_taylor", "titans"]
DELTA = ("deltanet", "gated_deltanet")
REFERENCE = "linear_attention"


def jobs(quick: bool) -> list:
    base = rep.load_yaml(STUDY)
    if quick:
        base = rep.quick_study(base)
        base["name"] += "-quick"
        base["spec"]["model"]["n_heads"] = {"choices": [1, 2]}
    return [
        rep.Job(rep.model_study(base, name, rep.spec_fields(path, **changes)), name, family)
        for name, (path, changes, family) in MODELS.items()
    ]


def heads(row) -> int:
    return int(row.params[HEADS])


def best_at_heads(rows: list) -> dict[int, object]:
    """The row with the best test mean at each head count."""
    best: dict[int, object] = {}
    for r in rows:
        h = heads(r)
        if h not in best or r.mean > best[h].mean:
            best[h] = r
    return best


def verdict(rows: list) -> list[str]:
    """The verdict line (delta rule vs linear attention at every head count) and the curve
    line (largest state vs smallest, per model)."""
    by = {(r.model, heads(r)): r for r in rows}
    counts = sorted({heads(r) for r in rows})
    failed, missing = [], []
    for h in counts:
        for model in DELTA:
            if (model, h) not in by or (REFERENCE, h) not in by:
                missing.append(f"{model} or {REFERENCE} at {h} head{'s' if h != 1 else ''}")
                continue
            won, p = rep.beats(by[(model, h)].seeds, by[(REFERENCE, h)].seeds)
            if not won:
                failed.append(f"{model} at {h} head{'s' if h != 1 else ''} (p = {p:.3g})")
    if missing or not counts:
        first = "verdict: not reproduced (no test result for " + "; ".join(missing) + ")"
    elif failed:
        first = f"verdict: not reproduced: not above {REFERENCE} at p < 0.05: " + "; ".join(failed)
    else:
        first = (
            f"verdict: reproduced: DeltaNet and Gated DeltaNet beat {REFERENCE} at every head "
            "count (equal state) at p < 0.05 (Welch, 3 seeds)"
        )
    rises = []
    for model in ORDER:
        own = sorted((r for r in rows if r.model == model), key=lambda r: r.state_bytes)
        if len(own) < 2:
            continue
        won, p = rep.beats(own[-1].seeds, own[0].seeds)
        rises.append(f"{model} {'yes' if won else 'no'} (p = {p:.3g})")
    second = "curve rises (largest state above smallest at p < 0.05): " + ", ".join(rises)
    return [first, second]


def table(rows: list) -> str:
    """One row per (model, head count), by model then state size: family, heads (d_k), state
    bytes, test accuracy mean [95% t interval], the selected lr, Welch p against the best at
    the same head count."""
    best = best_at_heads(rows)
    header = ["model", "family", "heads", "state bytes", "test accuracy [95% interval]",
              "selected", "Welch p vs best (same heads)"]  # fmt: skip
    body = []
    rank = {m: i for i, m in enumerate(ORDER)}
    for r in sorted(rows, key=lambda r: (rank.get(r.model, len(ORDER)), r.state_bytes)):
        top = best[heads(r)]
        p = "best" if top is r else f"{rep.p_value(r.seeds, top.seeds):.3g}"
        size = f"{r.state_bytes:,.0f}" if math.isfinite(r.state_bytes) else "?"
        body.append([r.model, r.family, str(heads(r)), size, rep.interval_text(r.seeds),
                     rep.selected_text(r.selected), p])  # fmt: skip
    return rep.markdown(header, body)


if __name__ == "__main__":
    rep.main(__doc__, "zoology_continuous", jobs, table, verdict)
