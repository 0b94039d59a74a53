"""`miras train`'s training options come from TrainConfig's fields (cli.with_settings): every
field is an option, with the field's default and help, and a field added to TrainConfig becomes
an option without an edit to cli.py."""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import Field
from typer.testing import CliRunner

from miras import cli
from miras.cli import app
from miras.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def train_options() -> dict:
    command = typer.main.get_command(app).commands["train"]
    return {param.name: param for param in command.params}


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def test_every_train_config_field_is_an_option_of_miras_train():
    options = train_options()
    for name, info in TrainConfig.model_fields.items():
        assert name in options, f"TrainConfig.{name} is not an option of miras train"
        option = options[name]
        assert option.opts == [option_name(name)]
        assert option.default == info.default, name
        assert option.help == cli.SETTING_HELP.get(name, info.description), name
        assert option.help, name
        assert option.show_default == (info.default is not None), name


def test_the_help_lists_every_setting_with_its_help():
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for name, info in TrainConfig.model_fields.items():
        line = next((ln for ln in result.stdout.splitlines() if option_name(name) in ln), None)
        assert line is not None, name
        help_text = cli.SETTING_HELP.get(name, info.description)
        assert help_text.split(";")[0][:40] in line, (name, line)


def test_the_other_options_of_miras_train_stay():
    options = train_options()
    others = {"spec", "task", "task_option", "model", "out_dir", "resume", "extend"}
    others |= {"time_limit", "threads", "progress", "rank_timeout"}
    assert others <= set(options)
    assert set(options) == others | set(TrainConfig.model_fields)


def test_a_new_field_becomes_an_option_without_an_edit_here():
    class Wider(TrainConfig):
        momentum: float = Field(0.9, ge=0, description="Heavy-ball momentum.")
        schedule: str | None = Field(None, description="The learning-rate schedule.")

    options = {p.name: p for p in cli.setting_options(Wider)}
    assert list(options)[-2:] == ["momentum", "schedule"]
    assert options["momentum"].default == 0.9
    assert options["schedule"].default is None


def test_a_setting_from_the_command_line_reaches_train(tmp_path, monkeypatch):
    seen = {}

    def fake_train(spec, task, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr("miras.training.train", fake_train)
    args = [
        "train",
        str(ROOT / "specs/deltanet.yaml"),
        "--task",
        "mqar",
        "--steps",
        "7",
        "--lr",
        "0.5",
    ]
    result = runner.invoke(app, [*args, "--precision", "bf16", "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and "stop here" in result.output
    assert seen["steps"] == 7 and seen["lr"] == 0.5 and seen["precision"] == "bf16"
    assert {"warmup", "eval_every", "early_stop", "seed"} <= set(seen)
    assert seen["warmup"] is None and seen["seed"] == 0
