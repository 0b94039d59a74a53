"""Tables off a terminal (issue 10, item 8): CliRunner's output is not a terminal, as a CI log
or `make demo | tee` is not; there rich used to lay every table out in 80 columns and fold the
longer cells ("comple / te"). Each command's table must keep its cells whole, unless COLUMNS
asks for a width."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from typer.testing import CliRunner

from miras.cli import app
from miras.components import CATALOGUE
from miras.derive.check import CheckResult
from miras.rule import MemoryRule

ROOT = Path(__file__).resolve().parents[2]
DELTANET = ROOT / "specs" / "deltanet.yaml"
LONG_PIECE = (
    "stationarity: autograd grad of the objective at the derived W_t, from the default initial "
    "state through the window padding"
)


def cli(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": None, **(env or {})})


def whole(text: str, output: str) -> bool:
    return any(text in line for line in output.splitlines())


@pytest.fixture
def long_piece(monkeypatch):
    """`miras check` with one result whose piece name is longer than 80 columns."""

    def check(self, *args, **kwargs):
        return [CheckResult(LONG_PIECE, 1e-12, 1e-10)]

    monkeypatch.setattr(MemoryRule, "check", check)


def test_check_keeps_a_long_piece_name_on_one_line(long_piece):
    result = cli("check", DELTANET)
    assert result.exit_code == 0, result.output
    assert len(LONG_PIECE) > 80 and whole(LONG_PIECE, result.stdout), result.stdout


def test_an_explicit_columns_still_sets_the_width(long_piece):
    result = cli("check", DELTANET, env={"COLUMNS": "60"})
    assert result.exit_code == 0, result.output
    assert not whole(LONG_PIECE, result.stdout)
    assert max(len(line) for line in result.stdout.splitlines()) <= 60


def test_components_keeps_every_formula_on_one_line():
    result = cli("components")
    assert result.exit_code == 0, result.output
    equations = [cls.equation() for members in CATALOGUE.values() for cls in members.values()]
    assert any(len(e) > 80 for e in equations)  # some do not fit 80 columns
    broken = [e for e in equations for part in e.splitlines() if not whole(part, result.stdout)]
    assert not broken


def test_report_keeps_a_long_reason_on_one_line(monkeypatch, tmp_path):
    from miras.search import report, storage

    reason = (
        "invalid: model.variant: 'mca' needs a parametric memory (memory: mlp), and the sampled "
        "spec has memory: matrix"
    )
    board = pd.DataFrame(
        [
            {"rank": 1, "trial": 3, "state": "complete", "accuracy": 0.98, "bias": "l2", "reason": ""},
            {"rank": 2, "trial": 1, "state": "pruned", "accuracy": None, "bias": "dot", "reason": reason},
        ]
    )  # fmt: skip
    handle = SimpleNamespace(study_name="tiny")
    definition = SimpleNamespace(metrics=["accuracy"])
    written = SimpleNamespace(
        leaderboard=board, notes=[], csv=tmp_path / "a.csv", html=tmp_path / "a.html", figures=[],
        summary=report.summary_data([], ["accuracy"], ["maximize"]),
    )  # fmt: skip
    monkeypatch.setattr(storage, "open_existing", lambda *args: (handle, definition))
    monkeypatch.setattr(report, "write_report", lambda *args: written)
    result = cli("report", "tiny")
    assert result.exit_code == 0, result.output
    assert whole(reason, result.stdout), result.stdout


def test_train_and_eval_headings_are_whole_lines(tmp_path):
    run = tmp_path / "a-run-directory-whose-path-is-much-longer-than-the-metrics-table-is-wide"
    task = ["--task", "mqar", "--task-option", "seq_len=16", "--task-option", "num_pairs=2"]
    model = ["--model", "d_model=16", "--model", "n_layers=1", "--threads", "1"]
    small = ["--batch-size", "2", "--eval-batches", "1", "--no-progress"]
    trained = cli("train", DELTANET, *task, *model, *small, "--steps", "2", "--out", run)
    assert trained.exit_code == 0, trained.output
    assert whole("deltanet on mqar: step 2", trained.stdout), trained.stdout
    assert whole(f"run directory: {run}", trained.stdout)
    scored = cli("eval", run, "--batches", "1")
    assert scored.exit_code == 0, scored.output
    assert whole(f"{run} on mqar (vocab_size=256, seq_len=16, num_pairs=2", scored.stdout)
