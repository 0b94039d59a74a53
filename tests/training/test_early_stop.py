"""Early stopping (`early_stop`): a run ends at the first evaluation whose primary metric on
validation reaches the threshold in the task's direction, and says at which step; a study with
a sweep on an accuracy task stops at 0.99 unless told otherwise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from miras.search import StudyError, load_study
from miras.search.objective import trial_train
from miras.tasks import make_task
from miras.training.config import TrainConfig
from miras.training.recipe import reached, train
from tests.search_support import TINY

SPEC = {
    "name": "tiny",
    "memory": "matrix",
    "bias": "l2",
    "retention": "none",
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 1, "chunk_size": 16},
}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_run(tmp_path, **settings):
    task = make_task("mqar", seq_len=32, num_pairs=4, vocab_size=32)
    base = {"steps": 12, "batch_size": 8, "eval_every": 4, "eval_batches": 1, "warmup": 1}
    return train(SPEC, task, **{**base, **settings}, progress=False, out_dir=tmp_path)


def test_a_reached_threshold_ends_the_run_at_that_evaluation(tmp_path, one_thread):
    # Accuracy >= 0 holds at the first evaluation (step 4): the run stops there.
    result = tiny_run(tmp_path, early_stop=0.0)
    assert result.steps == 4 and len(result.losses) == 4
    assert result.metrics["stopped_at"] == 4.0
    assert [h["step"] for h in result.history] == [4]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "split": "run", "event": "early_stop"} in records


def test_an_unreached_threshold_or_none_trains_every_step(tmp_path, one_thread):
    for threshold in (None, 1.5):  # accuracy never exceeds 1
        result = tiny_run(tmp_path / str(threshold), early_stop=threshold)
        assert result.steps == 12 and "stopped_at" not in result.metrics
        assert [h["step"] for h in result.history] == [4, 8, 12]


def test_the_threshold_follows_the_tasks_direction():
    accuracy = SimpleNamespace(primary_metric="accuracy", higher_is_better=True)
    perplexity = SimpleNamespace(primary_metric="perplexity", higher_is_better=False)
    assert reached(0.99, accuracy, {"accuracy": 0.995})
    assert not reached(0.99, accuracy, {"accuracy": 0.98})
    assert reached(2.0, perplexity, {"perplexity": 1.9})
    assert not reached(2.0, perplexity, {"perplexity": 2.5})
    assert not reached(None, accuracy, {"accuracy": 1.0})
    assert not reached(0.5, accuracy, {"accuracy": float("nan")})
    assert not reached(0.5, accuracy, {"loss": 1.0}), "no primary metric: not reached"


def test_a_threshold_must_be_a_finite_number():
    with pytest.raises(ValueError, match="early_stop"):
        TrainConfig.make(early_stop=float("nan"))
    with pytest.raises(ValueError, match="early_stop"):
        TrainConfig.make(early_stop="high")


class Trial:
    """What trial_train asks of an Optuna trial when nothing is searched."""

    number = 0


def test_a_sweep_on_an_accuracy_task_stops_at_0_99_by_default():
    swept = {**TINY["train"], "lr": {"sweep": [1.0e-3, 1.0e-2]}}
    study = load_study({**TINY, "train": swept})
    assert trial_train(study, Trial(), {"lr": 1e-3}, "accuracy")["early_stop"] == 0.99
    assert trial_train(study, Trial(), {"lr": 1e-3}, "perplexity")["early_stop"] is None
    off = load_study({**TINY, "train": {**swept, "early_stop": None}})
    assert trial_train(off, Trial(), {"lr": 1e-3}, "accuracy")["early_stop"] is None
    own = load_study({**TINY, "train": {**swept, "early_stop": 0.9}})
    assert trial_train(own, Trial(), {"lr": 1e-3}, "accuracy")["early_stop"] == 0.9
    fixed = load_study({**TINY, "train": {"lr": 1.0e-3}})
    assert trial_train(fixed, Trial(), None, "accuracy")["early_stop"] is None, "no sweep: off"


def test_a_studys_bad_threshold_names_its_path():
    with pytest.raises(StudyError, match=r"train\.early_stop"):
        load_study({**TINY, "train": {**TINY["train"], "early_stop": "soon"}})


def test_the_exported_command_leaves_an_unset_threshold_out():
    from optuna.trial import TrialState, create_trial

    from miras.search.report import export_text

    study = load_study(TINY)
    for threshold, flag in ((None, None), (0.99, "--early-stop 0.99")):
        train = {**TrainConfig(steps=20).resolved(), "early_stop": threshold}
        trial = create_trial(
            state=TrialState.COMPLETE, values=[0.5], user_attrs={"train": train, "spec": "x\n"}
        )
        header = export_text(trial, study, "tiny", "best.yaml")
        assert "None" not in header
        assert flag in header if flag else "--early-stop" not in header
