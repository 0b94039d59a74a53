"""A tie on the first objective goes to the next objectives, in order: the progress line's best
(`run.best`), `miras export --best` (`pick_trial`) and the leaderboard agree."""

from __future__ import annotations

from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from miras.search.report import leaderboard, pick_trial
from miras.search.run import best

METRICS = ["interference", "accuracy", "state_bytes"]
DIRECTIONS = ["minimize", "maximize", "minimize"]


def _trials():
    values = [
        (0.90, 0.59, 512),  # trial 0: ties trial 1 on the first objective, lower accuracy
        (0.90, 0.85, 1024),  # trial 1: the best
        (0.92, 0.99, 256),  # trial 2: worse on the first objective
        (0.90, 0.85, 2048),  # trial 3: ties trial 1 on two objectives, more state
    ]
    return [
        create_trial(
            values=list(v),
            params={"bias": "l2"},
            distributions={"bias": CategoricalDistribution(["l2", "dot"])},
            user_attrs={"spec": {"name": f"t{i}"}, "metrics": dict(zip(METRICS, v, strict=True))},
            state=TrialState.COMPLETE,
        )
        for i, v in enumerate(values)
    ]


def _numbered(trials):
    for i, t in enumerate(trials):
        t.number = i
    return trials


def test_ties_on_the_first_objective_go_to_the_next_ones():
    trials = _numbered(_trials())
    assert best(trials, DIRECTIONS).number == 1
    assert pick_trial(trials, DIRECTIONS).number == 1
    board = leaderboard(trials, METRICS, DIRECTIONS)
    assert list(board["trial"]) == [1, 3, 0, 2]
