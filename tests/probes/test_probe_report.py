"""What a probe reports besides its numbers (miras/probes/base.py, plots.py, `miras probe`):
the page's title, what the recall error's 0 and 1 mean, and the gates tuned at the edge of the
grid they were tuned on."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from miras.cli import app
from miras.probes import capacity
from miras.probes.base import SCALE

ROOT = Path(__file__).resolve().parents[2]
DELTANET = str(ROOT / "specs/deltanet.yaml")
GATED = str(ROOT / "specs/gated_deltanet.yaml")
# d_k orthogonal pairs or fewer: lr 1 (the exact delta rule) recalls them exactly, so it is the
# best learning rate, and with no pair overwritten no forgetting (decay 1) is the best decay.
EXACT_CASE = {"keys": "orthogonal", "pair_counts": [2, 4], "d_k": 4, "trials": 2, "seeds": 2}


def _probe(*extra: str, output: Path) -> str:
    result = CliRunner().invoke(
        app,
        ["probe", "capacity", DELTANET, "--seeds", "2", "--option", "d_k=4",
         "--option", "trials=2", "--option", "pair_counts=[2,4]", *extra, "-o", str(output)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.output


def test_the_page_has_a_title_and_both_say_what_the_error_means(tmp_path):
    page = tmp_path / "probe.html"
    output = _probe("--gate", "lr=1", output=page)
    text = page.read_text()
    assert re.search(r"<title>probe capacity: deltanet</title>", text)
    assert SCALE == "0 is exact recall; 1 is no better than reading zero"
    assert SCALE in text and SCALE in " ".join(output.split())  # the table's caption
    assert "note:" not in output  # a fixed gate was not tuned: nothing to flag


def test_a_gate_tuned_at_the_end_of_its_grid_is_flagged():
    narrow = capacity(DELTANET, grid={"lr": [0.1, 0.3]}, **EXACT_CASE)
    assert narrow.gates == {"lr": 0.3} and narrow.edges == {"lr": "largest"}
    (note,) = narrow.notes()
    assert "lr=0.3 is the largest value the tuning tried (0.1, 0.3)" in note
    assert "grid={lr: [...]}" in note
    wide = capacity(DELTANET, grid={"lr": [0.5, 1.0, 1.5]}, **EXACT_CASE)
    assert wide.gates == {"lr": 1.0} and wide.edges == {} and wide.notes() == []


def test_a_gate_at_the_end_of_its_range_is_not_flagged():
    """decay 1 is no forgetting: the largest the grid tried, and the largest there is."""
    result = capacity(GATED, grid={"lr": [0.5, 1.0, 1.5], "decay": [0.9, 1.0]}, **EXACT_CASE)
    assert result.gates == {"lr": 1.0, "decay": 1.0}
    assert result.edges == {}


def test_the_command_prints_the_edge_note_and_the_page_shows_it(tmp_path):
    page = tmp_path / "probe.html"
    output = _probe("--option", "keys=orthogonal", "--option", "grid={lr: [0.1, 0.3]}", output=page)
    flat = " ".join(output.split())
    assert "note: deltanet: lr=0.3 is the largest value the tuning tried (0.1, 0.3)" in flat
    assert "lr=0.3 is the largest value the tuning tried" in page.read_text()
