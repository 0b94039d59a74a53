"""benchmarks/quality.py: runs parsed from MODEL[:CHUNK], and the per-run summary's interval
computed from that run's seeds only."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
spec = importlib.util.spec_from_file_location("quality_benchmark", PATH)
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


def row(model: str, chunk: int, seed: int, accuracy: float, seconds: float = 10.0) -> dict:
    return {
        "model": model,
        "chunk": chunk,
        "seed": seed,
        "accuracy": accuracy,
        "loss": 1.0,
        "steps": 100,
        "seconds": seconds,
        "parameters": 1234,
    }


def test_parse_run_takes_the_default_chunk_or_its_own():
    parser = argparse.ArgumentParser()
    assert quality.parse_run("deltanet", 64, parser) == ("deltanet", 64)
    assert quality.parse_run("gated_deltanet:4", 64, parser) == ("gated_deltanet", 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [("deltanett", "unknown model 'deltanett'"), ("deltanet:0", "positive integer")],
)
def test_parse_run_names_the_bad_run(text, message, capsys):
    with pytest.raises(SystemExit):
        quality.parse_run(text, 64, argparse.ArgumentParser())
    assert message in capsys.readouterr().err


def test_summary_interval_is_over_each_runs_own_seeds():
    rows = [
        row("deltanet", 64, 0, 0.90, seconds=20.0),
        row("deltanet", 4, 0, 0.10),
        row("deltanet", 64, 1, 0.80, seconds=40.0),
        row("deltanet", 4, 1, 0.10),
        row("deltanet", 64, 2, 0.70, seconds=30.0),
        row("deltanet", 4, 2, 0.10),
    ]
    exact, start = quality.summarize(rows, [("deltanet", 64), ("deltanet", 4)])
    # mean 0.8, sd 0.1, t(0.975, 2) = 4.302653: half-width 4.302653 * 0.1 / sqrt(3)
    half = 4.302653 * 0.1 / 3**0.5
    assert exact["accuracy"] == pytest.approx(0.8)
    assert (exact["low"], exact["high"]) == pytest.approx((0.8 - half, 0.8 + half))
    assert exact["seeds"] == [0.9, 0.8, 0.7]
    assert exact["ms_per_step"] == pytest.approx(300.0)  # 20, 40, 30 s over 100 steps
    assert (start["accuracy"], start["low"], start["high"]) == pytest.approx((0.1, 0.1, 0.1))
