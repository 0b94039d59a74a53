"""The study summary: the compact terminal table after `search` and `report` (one row per
configuration, mean [interval] per objective, whether it differs from the best; at most 100
columns), and the report's data for accuracy against state size, per slice and per sweep
point (computed without plotly)."""

from __future__ import annotations

import io
import math

import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from rich.console import Console

from miras.cli import print_summary
from miras.search import StudyError, load_study
from miras.search.report import (
    config_labels,
    slice_data,
    state_size_data,
    summary_data,
    sweep_data,
)
from miras.stats import confidence_interval
from tests.search_support import TINY

DISTRIBUTIONS = {
    "bias": CategoricalDistribution(["l2", "dot"]),
    "model.n_heads": CategoricalDistribution([1, 2, 4]),
    "retention": CategoricalDistribution(["none", "l2", "a-retention-with-a-long-name"]),
    "": CategoricalDistribution(["deltanet", "linear_attention"]),  # a choice of whole specs
}


def made(number, params, seeds, state_bytes=1024.0, sweep=None, selected=None, pruned=False):
    """A finished trial: `seeds` are per-seed {metric: value} test records."""
    means = {m: sum(s[m] for s in seeds) / len(seeds) for m in seeds[0]} if seeds else {}
    attrs = {
        "replicates": [{"seed": i, "metrics": s, "seconds": 1.0} for i, s in enumerate(seeds)],
        "metrics": {**means, "state_bytes": state_bytes},
    }
    if sweep is not None:
        attrs |= {"sweep": sweep, "selected": selected}
    trial = create_trial(
        state=TrialState.PRUNED if pruned else TrialState.COMPLETE,
        values=None if pruned else [means["accuracy"], means["loss"]],
        params=params,
        distributions={k: DISTRIBUTIONS[k] for k in params},
        user_attrs=attrs,
    )
    trial.number = number
    return trial


def seeds(*accuracies, loss=1.0):
    return [{"accuracy": a, "loss": loss + i / 10} for i, a in enumerate(accuracies)]


TRIALS = [
    made(0, {"bias": "l2", "model.n_heads": 4, "retention": "none"}, seeds(0.90, 0.92, 0.91)),
    made(1, {"bias": "dot", "model.n_heads": 4, "retention": "none"}, seeds(0.60, 0.62, 0.61)),
    made(
        2,
        {"bias": "l2", "model.n_heads": 1, "retention": "a-retention-with-a-long-name"},
        seeds(0.89, 0.93, 0.90),
        state_bytes=256.0,
    ),
    made(3, {"bias": "dot", "model.n_heads": 1, "retention": "l2"}, [], pruned=True),
]


def test_the_summary_is_one_row_per_configuration_best_first():
    frame = summary_data(TRIALS, ["accuracy", "loss"], ["maximize", "minimize"])
    assert list(frame["trial"]) == [0, 2, 1], "complete trials only, best first"
    assert frame.loc[0, "configuration"] == "bias=l2 n_heads=4 retention=none"
    mean, low, high = confidence_interval([0.90, 0.92, 0.91])
    row = frame.iloc[0]
    assert (row["accuracy"], row["accuracy_low"], row["accuracy_high"]) == pytest.approx(
        (mean, low, high)
    )
    assert list(frame["differs"]) == [None, False, True]


def render(width: int, metrics=("accuracy", "loss")) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    frame = summary_data(TRIALS, list(metrics), ["maximize", "minimize"][: len(metrics)])
    print_summary(console, frame, list(metrics), top=10, name="tiny")
    return console.export_text()


def test_the_table_fits_100_columns_on_a_wide_console_and_the_console_on_a_narrow_one():
    wide = render(400)
    assert max(map(len, wide.splitlines())) <= 100
    lines = [line.split() for line in wide.splitlines()]
    row = {line[0]: line for line in lines if line and line[0] in ("0", "1", "2")}
    assert row["0"] == [
        "0", "bias=l2", "n_heads=4", "retention=none",
        "0.91", "[0.885,", "0.935]", "1.1", "[0.852,", "1.35]", "best",
    ]  # fmt: skip
    assert row["1"][-1] == "yes" and row["2"][-1] == "no"
    assert "…" not in wide
    narrow = render(60)
    assert max(map(len, narrow.splitlines())) <= 60
    assert "…" not in narrow, "nothing is cut short: the label and the intervals fold"
    for piece in ("0.91", "[0.885,", "0.935]", "best", "yes"):
        assert piece in narrow.split()


def test_three_objectives_print_half_widths():
    frame = summary_data(TRIALS, ["accuracy", "loss"], ["maximize", "minimize"])
    frame["loss2"], frame["loss2_low"], frame["loss2_high"] = 1.0, 0.9, 1.2
    console = Console(width=300, file=io.StringIO(), record=True)
    print_summary(console, frame, ["accuracy", "loss", "loss2"], top=10, name="tiny")
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 100
    assert "0.91 ±0.025" in text and "1 ±0.2" in text and "[" not in text


def test_labels_use_the_whole_name_where_two_parameters_end_alike():
    a = made(0, {"bias": "l2"}, seeds(0.5, 0.6))
    b = made(1, {"bias": "dot"}, seeds(0.5, 0.6))
    b.params["model.bias"] = 3
    assert config_labels([a, b]) == {0: "bias=l2", 1: "bias=dot model.bias=3"}


def test_accuracy_against_state_size_per_family():
    frame = state_size_data(TRIALS, "accuracy", ["bias", "bias.lp.p"])
    assert list(frame["family"]) == ["bias=dot", "bias=l2", "bias=l2"], "no p: left out"
    assert list(frame["state_bytes"]) == [1024.0, 256.0, 1024.0]
    row = frame[frame["trial"] == 2].iloc[0]
    assert (row["mean"], row["low"], row["high"]) == pytest.approx(
        confidence_interval([0.89, 0.93, 0.90])
    )


def test_per_slice_data_reads_the_slice_metrics_of_the_records():
    records = [{"accuracy": 0.8, "accuracy_n4": 0.9, "accuracy_n8": 0.7, "loss": 1.0}] * 2
    run = {"point": 0, "values": {"lr": 1e-3}, "seed": 0, "valid": {}, "test": records[0]}
    selected = {"point": 0, "values": {"lr": 1e-3}, "valid": 0.8}
    trial = made(5, {"bias": "l2"}, records, sweep=[run], selected=selected)
    validation_only = made(6, {"bias": "dot"}, records)  # no sweep: its records are validation
    frame = slice_data([trial, validation_only, *TRIALS], "accuracy")
    assert list(frame["slice"]) == ["n4", "n8"] and set(frame["trial"]) == {5}
    assert list(frame["mean"]) == pytest.approx([0.9, 0.7])
    assert frame.loc[0, "configuration"] == "bias=l2 lr=0.001"
    assert slice_data(TRIALS, "accuracy").empty


def test_sweep_data_holds_every_point_and_marks_the_selected_one():
    sweep = []
    for point, lr in enumerate((1e-3, 1e-2)):
        for seed in (0, 1):
            valid = {"accuracy": 0.5 + point / 4 + seed / 10}
            test = {"accuracy": 0.4 + point / 4}
            sweep.append({"point": point, "values": {"lr": lr}, "seed": seed, "valid": valid})
            sweep[-1]["test"] = test
    sweep[0]["valid"] = {"diverged": "loss is nan"}
    selected = {"point": 1, "values": {"lr": 1e-2}, "valid": 0.8}
    trial = made(7, {"bias": "l2"}, seeds(0.65, 0.65), sweep=sweep, selected=selected)
    frame = sweep_data([trial, *TRIALS], "accuracy")
    assert list(frame["lr"]) == [1e-3, 1e-2] and list(frame["selected"]) == [False, True]
    assert math.isnan(frame.loc[0, "valid"]) and frame.loc[1, "valid"] == pytest.approx(0.8)
    assert list(frame["test"]) == pytest.approx([0.4, 0.65])
    assert config_labels([trial])[7] == "bias=l2 lr=0.01"


def test_the_report_family_names_searched_parameters():
    study = load_study({**TINY, "report": {"family": ["spec.bias"]}})
    assert study.family_params() == ["bias"]
    assert load_study(TINY).family_params() == ["bias"], "default: spec params outside model"
    with pytest.raises(StudyError) as caught:
        load_study({**TINY, "report": {"family": ["spec.bais", "retention"]}})
    paths = {p.path: p.message for p in caught.value.problems}
    assert (
        "allowed: bias, model.chunk_size, train.lr (did you mean 'bias'?)"
        in paths["report.family[0]"]
    )
    assert "report.family[1]" in paths


def test_a_measure_without_spread_prints_its_mean_alone():
    frame = summary_data(TRIALS, ["accuracy", "loss"], ["maximize", "minimize"])
    frame["loss_low"] = frame["loss_high"] = frame["loss"] = 1024.0
    console = Console(width=300, file=io.StringIO(), record=True)
    print_summary(console, frame, ["accuracy", "loss"], top=10, name="tiny")
    row = next(line.split() for line in console.export_text().splitlines() if " 0 " in line)
    assert row[-2:] == ["1024", "best"] and "[0.885," in row


def test_a_choice_over_whole_specs_is_labelled_by_its_option_alone():
    # `spec: {choices: [{label: deltanet, ...}, ...]}`: the parameter's name is empty.
    a = made(0, {"": "deltanet"}, seeds(0.5, 0.6))
    b = made(1, {"": "linear_attention", "model.n_heads": 4}, seeds(0.5, 0.6))
    assert config_labels([a, b]) == {0: "deltanet", 1: "linear_attention n_heads=4"}
    assert list(state_size_data([a, b], "accuracy", [""])["family"]) == [
        "deltanet",
        "linear_attention",
    ]
