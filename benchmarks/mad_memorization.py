"""MAD's memorization at its hardest setting, where it does not saturate: is Atlas the best
model (ATLAS, Behrouz et al. 2025), against linear attention, Gated DeltaNet, Titans and
sliding-window attention?

    .venv/bin/python benchmarks/mad_memorization.py            # the full budget (below)
    .venv/bin/python benchmarks/mad_memorization.py --quick    # 8 steps: checks that it runs

benchmarks/mad_protocol.py ran memorization at MAD's baseline (V 256, T 32, fresh sequences
every step), where every model reaches 1.000. MAD's harder memorization settings (Poli et al.
2024, App. B) keep T 32 and fix the training set at 256 sequences while the vocabulary grows
from 256 to 8192, so each fact is shown less often (32 times an epoch down to once). The study
is studies/mad_memorization.yaml: MAD's hardest setting, V 8192 (4095 facts) with 256 training
sequences (the task option `train_examples`, docs/tasks.md), one layer, d_model 32 in 2 heads,
100 steps of batch 32 (12.5 epochs); lr over logspace(3e-3, 3e-2, 3) that extends past the
selected edge up to twice (docs/search.md, "Logspace sweeps that extend"), seeds 0, 1, 2,
selected on validation, scored on test, early stop at 0.99. The models are mad_protocol.py's
(sliding-window attention over 16 tokens), each in its own study, two at a time
(benchmarks/reproduction.py), Atlas first.

Valid and test are new sequences over the same map, so a test fact whose key never appeared in
the 256 training sequences cannot be answered: the script prints that ceiling (the fraction of
the scored test positions whose key the training set holds, about 1 - e^-1 = 0.63). A model
can sit at the ceiling (it stored every fact it was shown); accuracy under it is facts shown
about a dozen times and not yet stored at this budget.

The verdict is mad_protocol.py's: ATLAS's "best on memorization" holds when Atlas has the
highest test mean and Welch's two-sided test separates it from every other model at p < 0.05
(3 seeds); it fails when another model is above it at p < 0.05; otherwise not shown.

Calibration (2026-12-07, single `miras train` runs, lr 1e-2, seed 0, load average 5 to 8 on
the 2 cores; validation accuracy): at V 4096 with 256 training sequences Gated DeltaNet and
sliding-window attention both sat at that setting's ceiling, 0.873, from step 150 (0.854 and
0.862 at step 100), so V 4096 saturates at its ceiling as V 256 does at 1.0. At V 8192: step
50 / 75 / 100 / 150, sliding-window attention 0.067 / 0.340 / 0.627 / 0.640 (the ceiling from
step 100), Gated DeltaNet 0.010 / 0.126 / - / 0.528, linear attention 0.008 / 0.032 / 0.095 /
0.329. So 100 steps: the models are spread, and the ceiling is reached by at most the fastest.

Budget (measured in calibration, wall time a step at V 8192 on the loaded cores, with
evaluations): about 0.25 s for the four cheaper models, about 1.5 s for Atlas (Muon's
Newton-Schulz steps on an MLP memory; the V 8192 head adds to each model's step). 3 lr x 3
seeds x 100 steps per model, plus 3 runs per extension (at most 2): the four cheaper models
36 to 72 runs x 100 x 0.25 s, Atlas 9 to 18 runs x 100 x 1.5 s; 1000 to 2000 s of CPU with
evaluations. --quick: 8 steps, one lr, 2 seeds.
"""

from __future__ import annotations

import math

import mad_protocol as mad  # benchmarks/: the script's sys.path[0]
import reproduction as rep

from miras.tasks import make_task

STUDY = "studies/mad_memorization.yaml"
TASK = "memorization"


def jobs(quick: bool) -> list:
    base = rep.load_yaml(STUDY)
    if quick:
        base = rep.quick_study(base)
        base["name"] += "-quick"
    found = []
    for name, (path, changes, family) in mad.MODELS.items():  # Atlas first: the longest
        study = rep.model_study(base, name, rep.spec_fields(path, **changes))
        found.append(rep.Job(study, name, family, {"task": TASK}))
    return found


def ceiling(study: dict | None = None) -> float:
    """The fraction of the test split's scored positions (the batches the search scores)
    whose key appears in the fixed training set: the most any model can answer."""
    study = study or rep.load_yaml(STUDY)
    task = make_task(study["task"]["name"], **study["task"]["options"])
    seen = set(task.train_set()[0][:, 0::2].ravel().tolist())
    train = study["train"]
    known = total = 0
    for i in range(train["eval_batches"]):
        keys = task.batch("test", i, train["batch_size"]).inputs[:, 0::2].ravel().tolist()
        known += sum(k in seen for k in keys)
        total += len(keys)
    return known / total


def points_text(row) -> str:
    """Each lr run with its mean validation accuracy, in lr order."""
    points = sorted(row.points, key=lambda p: p[0].get("lr", 0.0))
    return ", ".join(f"{p[0]['lr']:.3g}: {p[1]:.3f}" for p in points)


def table(rows: list) -> str:
    """One row per model, best test mean first: family, test accuracy mean [95% t interval],
    per seed, the selected lr (and whether it sits at the edge of what ran), every lr's mean
    validation accuracy, Welch p against Atlas."""
    header = ["model", "family", "test accuracy [95% interval]", "seeds 0, 1, 2", "selected",
              "validation mean per lr", f"Welch p vs {mad.CLAIMANT}"]  # fmt: skip
    claimant = next((r for r in rows if r.model == mad.CLAIMANT), None)
    body = []
    for r in sorted(rows, key=lambda r: -r.mean):
        p = (
            ""
            if claimant is None or r is claimant
            else f"{rep.p_value(r.seeds, claimant.seeds):.3g}"
        )
        seeds = ", ".join(f"{v:.3f}" for v in r.seeds)
        body.append([r.model, r.family, rep.interval_text(r.seeds), seeds, rep.selected_label(r),
                     points_text(r), p])  # fmt: skip
    return rep.markdown(header, body)


def verdict(rows: list) -> list[str]:
    lines = [f"ceiling (test facts the training set shows): {ceiling():.3f}"]
    lines.append(mad.verdict(rows))
    if any(math.isnan(r.mean) for r in rows):
        lines.append("note: a NaN mean is a seed whose test metric was not finite")
    return lines


if __name__ == "__main__":
    rep.main(__doc__, "mad_memorization", jobs, table, verdict)
