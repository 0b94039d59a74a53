"""The project's errors cross process boundaries whole: a search runs trials and validates
studies in worker processes, and an error whose constructor takes more than its message could
not be rebuilt there (pickle calls it with the message alone), so the pool broke
(`BrokenProcessPool`) instead of reporting the problem."""

import pickle

import pytest

from miras.errors import ForwardDiverged, Problem, SpecError, TrainingDiverged
from miras.search.study import StudyError

PROBLEMS = [Problem("name", "a study name may not contain '.'"), Problem("", "no trials")]


@pytest.mark.parametrize(
    ("error", "fields"),
    [
        (SpecError("specs/x.yaml", PROBLEMS), ("source", "problems")),
        (StudyError("studies/x.yaml", PROBLEMS), ("source", "problems")),
        (
            TrainingDiverged(7, "loss", float("inf"), "layer 0 at token 3"),
            ("step", "what", "detail"),
        ),
        (ForwardDiverged("layer 0 went non-finite at token 3", 3), ("token",)),
    ],
    ids=["spec", "study", "training", "forward"],
)
def test_an_error_survives_pickling(error, fields):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error)
    for name in fields:
        assert getattr(back, name) == getattr(error, name)
