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

import reproduction as rep  # benchmarks/reproduction.py: benchmarks/ is the script's sys.path[0]

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


CLAIM = "DeltaNet beats linear attention on test accuracy at p < 0.05 (Welch, 3 seeds)"


def verdict(rows: list) -> str:
    """Reproduced when DeltaNet beats linear attention at p < 0.05."""
    return rep.pairwise_verdict(rows, DELTA, ADDITIVE, CLAIM)


def table(rows: list) -> str:
    return rep.pairwise_table(rows, DELTA, ADDITIVE)


if __name__ == "__main__":
    rep.main(__doc__, "zoology_mqar", jobs, table, verdict)
