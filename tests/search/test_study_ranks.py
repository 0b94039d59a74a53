"""A study trial on several ranks (issue 15): `train: {ranks: 2}` trains each trial under
torchrun (gloo, two CPU processes) and reaches the values, and the intermediate evaluations the
pruner sees, of the same trials on one rank; a bad `ranks` is named with the study file.

Tolerance: TOL of tests/training/test_distributed.py, for its reason. Two ranks see the same sequences
as one process; only the order of float32 sums differs (each rank's half-batch gradient, added
by the all-reduce), a few ulp that AdamW carries on: measured 5e-7 over 20 steps there.
"""

from __future__ import annotations

import optuna
import pytest
import yaml

from miras.search import search
from miras.search.study import StudyError, load_study
from tests.search_support import TINY
from tests.training.test_distributed import TOL

# The search tests' tiny study (a 1-layer d_model 16 model, 20 steps), on a smaller MQAR, with
# the default heartbeat (starting the ranks takes seconds). Median pruning after 5 finished
# trials never prunes these 2, but every evaluation is reported, so the ranked trials'
# intermediate values (read from the run's metrics file as rank 0 writes them) are compared.
STUDY = {
    **{key: value for key, value in TINY.items() if key != "heartbeat"},
    "name": "ranked",
    "task": {"name": "mqar", "options": {"seq_len": 16, "num_pairs": 2, "vocab_size": 32}},
    "train": {**TINY["train"], "batch_size": 8},
    "pruner": {"kind": "median", "startup_trials": 5},
    "trials": 2,
}

pytestmark = pytest.mark.usefixtures("one_thread")


def run(tmp_path, ranks: int) -> list[optuna.trial.FrozenTrial]:
    data = {**STUDY, "train": {**STUDY["train"], "ranks": ranks}}
    storage = f"sqlite:///{tmp_path / f'ranks{ranks}.db'}"
    summary = search(data, storage=storage)
    assert summary.counts.complete == 2
    return optuna.load_study(study_name="ranked", storage=storage).get_trials()


def test_trials_on_two_ranks_reach_the_values_of_one_rank(tmp_path):
    one, two = run(tmp_path, 1), run(tmp_path, 2)
    for a, b in zip(one, two, strict=True):
        assert a.params == b.params  # the same sampled trials
        assert abs(a.values[0] - b.values[0]) < TOL
        assert a.intermediate_values.keys() == b.intermediate_values.keys() == {5, 10, 15, 20}
        for step, value in a.intermediate_values.items():
            assert abs(value - b.intermediate_values[step]) < TOL
        assert a.user_attrs["metrics"]["params"] == b.user_attrs["metrics"]["params"]


def test_a_batch_that_does_not_split_prunes_the_trial_with_the_ranks_message(tmp_path):
    """A searched batch_size is checked where it is sampled: by the ranks, whose ValueError
    comes back from the subprocess and marks the sampled combination invalid."""
    data = {**STUDY, "trials": 1}
    data["train"] = {**STUDY["train"], "ranks": 2, "batch_size": {"choices": [9]}}
    storage = f"sqlite:///{tmp_path / 'odd.db'}"
    assert search(data, storage=storage).counts.pruned == 1
    (trial,) = optuna.load_study(study_name="ranked", storage=storage).get_trials()
    assert trial.user_attrs["reason"] == (
        "invalid: batch_size: the global batch of 9 does not split evenly across 2 ranks; "
        "pass a multiple of 2"
    )


@pytest.mark.parametrize(
    "ranks,batch,message",
    [
        (0, 8, "train.ranks: expected an integer >= 1 (processes per trial, not searched), got 0"),
        ("two", 8, "got 'two'"),
        ({"choices": [1, 2]}, 8, "got {'choices': [1, 2]}"),
        (4, 10, "train.ranks: the global batch_size 10 does not split across 4 ranks"),
    ],
)
def test_bad_ranks_are_named_with_the_study_file(tmp_path, ranks, batch, message):
    path = tmp_path / "bad.yaml"
    data = {**STUDY, "train": {**STUDY["train"], "ranks": ranks, "batch_size": batch}}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(StudyError) as raised:
        load_study(path)
    assert str(path) in str(raised.value) and message in str(raised.value)


def test_ranks_do_not_change_the_study_it_resumes():
    with_ranks = {**STUDY, "train": {**STUDY["train"], "ranks": 2}}
    assert load_study(with_ranks).digest() == load_study(STUDY).digest()
    assert load_study(with_ranks).ranks == 2 and load_study(STUDY).ranks == 1
