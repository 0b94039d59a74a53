"""benchmarks/state_tracking.py: its specs load, and its table and verdict read hand-made
per-seed numbers as stated (solved at a test mean >= 0.9, the named model above every other at
Welch p < 0.05, no other model solving). No training here: `--quick` is the end-to-end run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from miras.spec import load_spec
from miras.tasks import make_task

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "state_tracking_script", ROOT / "benchmarks/state_tracking.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules["state_tracking_script"] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)


def results(claim: str, tests: dict[str, list[float]]) -> list[dict]:
    """One result per (model, seed) with every slice at the given test accuracy."""
    lengths = bench.CLAIMS[claim].options["test_lengths"]
    return [
        {
            "run": bench.Run(claim, label, bench.CLAIMS[claim].models[label], seed, 10, 1e-2),
            "valid": 1.0,
            "test": value,
            "slices": dict.fromkeys(lengths, value),
            "cpu": 1.0,
        }
        for label, values in tests.items()
        for seed, value in enumerate(values)
    ]


@pytest.mark.parametrize("claim", sorted(bench.CLAIMS))
def test_every_model_and_task_loads(claim):
    spec = bench.CLAIMS[claim]
    make_task(spec.task, **spec.options)
    for path in spec.models.values():
        load_spec(ROOT / path)


def test_reproduced_when_the_named_model_solves_and_separates():
    labels = list(bench.CLAIMS["parity"].models)
    tests = {labels[0]: [0.99, 1.0, 0.98], **{m: [0.50, 0.52, 0.51] for m in labels[1:]}}
    table, verdict = bench.report("parity", results("parity", tests))
    assert verdict.startswith("parity (Grazzi et al. 2025): reproduced at 3 seeds")
    assert table.count("\n") == 1 + len(labels)  # header, rule, one row per model
    assert "0.990 [" in table  # the mean and its interval


@pytest.mark.parametrize(
    ("named", "other", "why"),
    [
        ([0.85, 0.86, 0.84], [0.50, 0.51, 0.52], "does not solve it"),
        ([0.99, 1.0, 0.98], [0.95, 0.97, 0.99], "solves it too"),
        ([0.99, 0.60, 0.98], [0.50, 0.52, 0.70], "not above"),
    ],
)
def test_not_reproduced_says_why(named, other, why):
    labels = list(bench.CLAIMS["s3"].models)
    tests = {labels[0]: named, **{m: other for m in labels[1:]}}
    _, verdict = bench.report("s3", results("s3", tests))
    assert "not reproduced" in verdict and why in verdict
