"""One typed training config with one set of defaults: `miras.train`, `miras train` and a
study's `train:` section all read them from miras.training.config.TrainConfig."""

from __future__ import annotations

import inspect

import pytest
import typer.main

import miras
from miras.cli import app
from miras.search import load_study
from miras.search.objective import trial_train
from miras.training.config import DEFAULTS, TrainConfig
from tests.search_support import TINY


def cli_defaults() -> dict[str, object]:
    command = typer.main.get_command(app).commands["train"]
    return {p.name: p.default for p in command.params}


def test_the_cli_defaults_are_the_configs():
    defaults = cli_defaults()
    for name, field in TrainConfig.model_fields.items():
        assert defaults[name] == field.default, name


def test_miras_train_takes_no_defaults_of_its_own():
    """The settings are keywords of `train` only through **settings: no second default."""
    names = set(inspect.signature(miras.train).parameters)
    assert names.isdisjoint(TrainConfig.model_fields)


class Trial:
    """What trial_train asks of an Optuna trial when nothing is searched."""

    number = 0


def test_a_studys_unset_settings_are_the_configs():
    study = load_study({**TINY, "train": {"lr": 1.0e-3}})
    args = trial_train(study, Trial())
    assert args == TrainConfig(lr=1.0e-3).resolved()
    assert args["steps"] == DEFAULTS.steps and args["eval_batches"] == DEFAULTS.eval_batches


def test_step_dependent_defaults_are_a_tenth_of_the_steps():
    config = TrainConfig(steps=500)
    assert (config.warmup_steps, config.eval_interval) == (50, 50)
    assert TrainConfig(steps=3).eval_interval == 1  # at least one step apart
    assert TrainConfig(steps=500, warmup=0, eval_every=7).resolved()["warmup"] == 0
    assert DEFAULTS.resolved()["warmup"] == 100 and DEFAULTS.eval_interval == 100


def test_an_unknown_setting_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError) as info:
        TrainConfig.make(stepz=10)
    message = str(info.value)
    assert "unknown setting 'stepz'; allowed settings: steps, batch_size, lr, warmup" in message
    assert "(did you mean 'steps'?)" in message
    with pytest.raises(ValueError, match="unknown setting 'learning_rate'"):
        miras.train("specs/deltanet.yaml", object(), learning_rate=1e-3)


def test_every_bad_setting_at_once():
    with pytest.raises(ValueError) as info:
        TrainConfig.make({"steps": 0}, lr=-1.0, eval_batches=0)
    assert str(info.value) == (
        "training: steps: expected an integer >= 1, got 0; lr: expected a number > 0, got -1.0; "
        "eval_batches: expected an integer >= 1, got 0"
    )


def test_a_studys_train_section_uses_the_same_words():
    with pytest.raises(ValueError) as info:
        load_study({**TINY, "train": {"stepz": 10}})
    assert "train.stepz: unknown setting 'stepz'; allowed settings: steps" in str(info.value)


def test_make_layers_settings_over_a_config():
    base = TrainConfig(steps=20, lr=1e-2)
    assert TrainConfig.make(base, lr=2e-2) == TrainConfig(steps=20, lr=2e-2)
    assert TrainConfig.make({"steps": 5}, seed=3) == TrainConfig(steps=5, seed=3)
