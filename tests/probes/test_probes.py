"""The probes of the bare rule (miras/probes): each metric on a case with a known answer, the
interval from the seeds, the tuning seed kept apart, and the `miras probe` command."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from scipy import stats
from typer.testing import CliRunner

from miras.cli import app
from miras.components.bias.huber import HuberBias
from miras.probes import (
    Episode,
    capacity,
    confidence_interval,
    gate_grid,
    interference,
    nonlinear,
    outliers,
    recency,
    repetition,
    run_probe,
)
from miras.probes.suite import teacher_values
from miras.rule import compile as compile_rule

ROOT = Path(__file__).resolve().parents[2]
DELTANET = str(ROOT / "specs/deltanet.yaml")
HEBBIAN = str(ROOT / "specs/linear_attention.yaml")  # W += v k^T, lr 1, no gates
SMALL = {"d_k": 8, "trials": 4, "seeds": 2}
EXACT = {"lr": 1.0}  # lr / ||k||^2 = 1: the exact delta rule (Kaczmarz projection)


def means(result):
    return [p.mean for p in result.points]


def test_exact_delta_rule_recalls_d_k_orthogonal_pairs_exactly():
    result = capacity(DELTANET, keys="orthogonal", pair_counts=[4, 8, 16], gates=EXACT, **SMALL)
    at_4, at_d_k, past = means(result)
    assert at_4 < 1e-12 and at_d_k < 1e-12
    # Past d_k no matrix fits every pair: the error is large, so the metric can fail.
    assert past > 0.3


def test_hebbian_recall_is_exact_for_one_unit_key_and_grows_with_n():
    result = capacity(HEBBIAN, keys="unit", pair_counts=[1, 4, 16, 64], **SMALL)
    errors = means(result)
    assert errors[0] < 1e-12
    assert all(a < b for a, b in itertools.pairwise(errors)), errors
    assert result.gates == {}  # linear attention has no gate to tune


def test_outliers_at_zero_corruption_equal_capacity():
    gates = {"lr": 0.5}
    clean = outliers(DELTANET, fractions=[0.0], n_pairs=8, gates=gates, **SMALL)
    plain = capacity(DELTANET, pair_counts=[8], gates=gates, **SMALL)
    assert clean.points[0].errors == plain.points[0].errors


def test_outliers_in_orthogonal_slots_leave_clean_pairs_exact_and_hurt_hebbian_nothing_else():
    # Orthogonal keys: a corrupted value only lands in its own key's direction, so the exact
    # delta rule still recalls every clean pair; the corrupted values are not read.
    result = outliers(
        DELTANET, fractions=[0.0, 0.25, 0.5], n_pairs=8, keys="orthogonal", gates=EXACT, **SMALL
    )
    assert max(means(result)) < 1e-12
    # Random keys: the outliers leak into the clean reads of a Hebbian memory.
    hebbian = outliers(HEBBIAN, fractions=[0.0, 0.5], n_pairs=8, **SMALL)
    assert means(hebbian)[1] > 2 * means(hebbian)[0]


def test_repetition_once_equals_capacity_and_repeating_helps_the_delta_rule():
    once = repetition(DELTANET, presentations=[1, 2, 8], n_pairs=4, gates=EXACT, **SMALL)
    plain = capacity(DELTANET, pair_counts=[4], gates=EXACT, **SMALL)
    assert once.points[0].errors == plain.points[0].errors
    # Repeated Kaczmarz passes over 4 < d_k consistent pairs converge to an exact fit.
    first, second, eighth = means(once)
    assert eighth < second < first and eighth < 0.2 * first


def test_recency_last_pair_exact_for_the_delta_rule_and_older_pairs_worse():
    result = recency(DELTANET, distances=[1, 2, 16], length=16, gates=EXACT, **SMALL)
    last, second, first = means(result)
    assert last < 1e-12 < second < first


def test_interference_of_correlated_keys_grows_for_hebbian_more_than_for_delta():
    options = {"pair_counts": [4, 32], "early": 4, "correlation": 0.6, **SMALL}
    hebbian = means(interference(HEBBIAN, **options))
    delta = means(interference(DELTANET, gates={"lr": 1.0}, **options))
    assert hebbian[0] < hebbian[1]
    assert delta[1] < hebbian[1]


def test_nonlinear_values_are_a_fixed_function_of_the_keys():
    k = torch.nn.functional.normalize(torch.randn(3, 5, 8, dtype=torch.float64), dim=-1)
    v = teacher_values(k, seed=1)
    assert v.shape == (3, 5, 8)
    assert v.pow(2).mean().item() == pytest.approx(1.0)
    # The same key gives the same value: a function, not noise.
    again = teacher_values(torch.cat([k, k[:, :1]], dim=1), seed=1)
    assert torch.allclose(again[:, -1] / again[:, 0], torch.ones(3, 8, dtype=torch.float64))
    # Even and centred: on many keys the best linear map explains almost nothing, while the
    # degree-2 tensor features [1, k, k(x)k] fit it exactly.
    keys = torch.nn.functional.normalize(torch.randn(1, 2000, 8, dtype=torch.float64), dim=-1)
    values = teacher_values(keys, seed=2)
    linear = keys @ (torch.linalg.pinv(keys) @ values)
    assert ((linear - values).norm() / values.norm()).item() > 0.95
    quad = torch.cat(
        [
            torch.ones_like(keys[..., :1]),
            keys,
            (keys[..., :, None] * keys[..., None, :]).flatten(-2),
        ],
        -1,
    )
    fit = quad @ (torch.linalg.pinv(quad) @ values)  # rank 72 of 73: sum k_j^2 = 1
    assert ((fit - values).norm() / values.norm()).item() < 1e-8
    # A Hebbian memory recalls one pair exactly (unit keys), whatever the values are.
    result = nonlinear(HEBBIAN, pair_counts=[1], **SMALL)
    assert means(result)[0] < 1e-12


def test_confidence_interval_matches_a_hand_computation():
    values = [0.2, 0.5, 0.3, 0.9]
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    got = confidence_interval(values)
    assert got[0] == pytest.approx(mean)
    assert got[2] - got[0] == pytest.approx(half, rel=1e-6)
    assert got[0] - got[1] == pytest.approx(half, rel=1e-6)
    assert confidence_interval([0.4]) == (0.4, 0.4, 0.4)
    # A diverged seed (inf) makes the whole interval NaN rather than a finite lie.
    assert all(math.isnan(x) for x in confidence_interval([0.4, math.inf]))


def test_points_carry_the_interval_of_their_seeds_and_the_tuning_seed_is_apart():
    seen = []
    rule = compile_rule(DELTANET)

    def make(x, seed):
        seen.append(seed)
        gen = torch.Generator().manual_seed(seed)
        k = torch.nn.functional.normalize(torch.randn(2, x, 4, generator=gen).double(), dim=-1)
        v = torch.randn(2, x, 4, generator=gen, dtype=torch.float64)
        return Episode(k, v, k, v)

    result = run_probe("t", rule, make, [6], x_name="pairs", seeds=3, seed=10)
    assert seen == [10, 11, 12, 13]  # the grid on seed 10, then scoring seeds 11..13
    point = result.points[0]
    assert len(point.errors) == 3 and len(set(point.errors)) == 3
    assert (point.mean, point.low, point.high) == confidence_interval(point.errors)
    assert result.gates in [c for c, _ in result.tuning]
    best = min(score for _, score in result.tuning)
    assert [s for c, s in result.tuning if c == result.gates] == [best]
    # Reproducible from the seed.
    again = run_probe("t", rule, make, [6], x_name="pairs", seeds=3, seed=10)
    assert again.points[0].errors == point.errors


def test_gate_grid_covers_every_gate_and_names_a_missing_one(monkeypatch):
    gdn = compile_rule(str(ROOT / "specs/gated_deltanet.yaml"))
    grid = gate_grid(gdn, grid={"lr": [0.5, 1.0], "decay": [1.0]})
    assert grid == [{"decay": 1.0, "lr": 0.5}, {"decay": 1.0, "lr": 1.0}]
    yaad = compile_rule(str(ROOT / "specs/yaad.yaml"))
    with pytest.raises(ValueError, match="delta"):
        capacity(yaad, gates={"lr": 1.0}, **SMALL)  # fixed gates must name all three
    monkeypatch.setattr(HuberBias, "gate_defaults", {})  # delta declares no probe values
    with pytest.raises(ValueError, match="no candidate values for delta"):
        gate_grid(yaad)


def test_cli_runs_one_probe_on_one_spec_and_writes_the_figure(tmp_path):
    figure = tmp_path / "probe.html"
    result = CliRunner().invoke(
        app,
        ["probe", "capacity", DELTANET, "--seeds", "2", "--option", "d_k=4",
         "--option", "trials=2", "--option", "pair_counts=[2,4]", "--gate", "lr=1", "-o",
         str(figure)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "deltanet" in result.output and "95% interval" in result.output
    assert figure.exists() and "plotly" in figure.read_text()[:100_000].lower()


def test_cli_names_a_bad_probe_and_a_bad_option():
    runner = CliRunner()
    bad = runner.invoke(app, ["probe", "capacityy", DELTANET])
    assert bad.exit_code == 2 and "capacity, interference" in bad.output
    attention = runner.invoke(app, ["probe", "capacity", str(ROOT / "specs/attention.yaml")])
    assert attention.exit_code == 1 and "parametric memory" in attention.output
    option = runner.invoke(app, ["probe", "capacity", DELTANET, "--option", "pairs=3"])
    assert option.exit_code == 1 and "--option" in option.output and "pairs" in option.output


@pytest.mark.parametrize(
    "path", sorted((ROOT / "specs/probes").glob("*.yaml")), ids=lambda p: p.stem
)
def test_probe_ablation_specs_compile(path):
    # The ablations docs/claims.md runs; the shipped-spec suites glob specs/ and specs/examples.
    rule = compile_rule(str(path))
    assert "Run: miras probe" in path.read_text()
    assert rule.gates and "lr" in rule.gates
