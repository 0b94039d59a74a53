"""Every size has a documented upper bound (docs/spec.md, Limits), enforced at validation: the
value at the bound is accepted, one past it is refused with the field and the bound."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import miras
from miras.components.base import MAGNITUDE
from miras.errors import SpecError
from miras.tasks import make_task
from miras.training.config import TrainConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "spec.md"


def limits_table() -> dict[tuple[str, str], str]:
    """(field, where) -> 'at most' of the Limits table."""
    section = DOCS.read_text().split("## Limits", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[(cells[0].strip("`"), cells[1])] = cells[2]
    return rows


def spec_with(path: str, value, **context) -> dict:
    """A spec dict with `path` (dotted) set to `value`; `context` fills the component's kind."""
    data: dict = {"name": "bounds"}
    head, _, leaf = path.partition(".")
    data[head] = {**context.get(head, {}), leaf: value}
    for key, extra in context.items():
        if key != head:
            data[key] = extra
    return data


# (field, where) of the table -> how to set the field: a spec's context, a training setting or
# a task's options. The bound itself is read from the docs.
SPEC_ROWS = {
    ("window.c", "every spec (`window: N`)"): [{}],
    ("memory.window", "`nonparametric`"): [{"memory": {"kind": "nonparametric"}}],
    ("memory.depth", "`mlp`"): [{"memory": {"kind": "mlp"}}],
    ("memory.expansion", "`mlp`, `gated_mlp`"): [
        {"memory": {"kind": "mlp"}},
        {"memory": {"kind": "gated_mlp"}},
    ],
    ("feature_map.degree", "`polynomial`"): [{"feature_map": {"kind": "polynomial"}}],
    ("feature_map.order", "`exp_kernel`"): [
        {"feature_map": {"kind": "exp_kernel", "max_features": 1 << 20}, "model": {"n_heads": 64}}
    ],
    ("feature_map.max_features", "`exp_kernel`"): [{"feature_map": {"kind": "exp_kernel"}}],
    ("bias.p", "`lp`"): [{"bias": {"kind": "lp"}}],
    ("retention.q", "`lq`"): [{"retention": {"kind": "lq"}}],
    ("retention.newton_steps", "`bregman`"): [{"retention": {"kind": "bregman"}}],
    ("optimizer.ns_steps", "`muon`"): [{"optimizer": {"kind": "muon"}}],
    ("optimizer.steps", "`gd`, `momentum`, `nesterov`, `muon`"): [
        {"optimizer": {"kind": kind}} for kind in ("gd", "momentum", "nesterov", "muon")
    ],
    ("model.d_model", ""): [{"model": {"n_heads": 1}}],
    ("model.n_heads", ""): [{"model": {"d_model": 4096}}],
    ("model.n_layers", ""): [{}],
    ("model.chunk_size", ""): [{}],
    ("model.swa_window", ""): [{}],
    ("model.mac_segment", ""): [{}],
    ("model.persistent_tokens", ""): [{}],
    ("model.gate_rank", ""): [{}],
    ("model.conv_size", ""): [{}],
    ("model.mlp_expansion", ""): [{}],
}
TRAIN_ROWS = {
    ("steps", "training ([training.md](training.md))"): [
        "steps",
        "warmup",
        "eval_every",
        "log_every",
    ],
    ("batch_size", "training"): ["batch_size", "eval_batches"],
    ("seed", "training"): ["seed"],
}
TASK_ROWS = {
    ("vocab_size", "task `mqar`"): ("mqar", ["vocab_size"], {"seq_len": 64}),
    ("seq_len", "task `mqar`"): ("mqar", ["seq_len"], {}),
    ("num_pairs", "task `mqar`"): (
        "mqar",
        ["num_pairs"],
        {"seq_len": 1 << 16, "vocab_size": 1 << 16},
    ),
    ("vocab_size", "task `mad`"): (
        "mad",
        ["vocab_size", "seq_len"],
        {"vocab_size": 16, "seq_len": 128, "subtask": "in_context_recall"},
    ),
    ("lengths", "task `niah`"): ("niah", ["lengths"], {}),
    ("seq_len", "task `text`"): ("text", ["seq_len"], {}),
}


def test_the_table_lists_every_bounded_field_once():
    assert set(limits_table()) == {*SPEC_ROWS, *TRAIN_ROWS, *TASK_ROWS}
    fixed = next(line for line in DOCS.read_text().splitlines() if line.startswith("| fixed"))
    found = re.search(r"magnitude (\S+), and at least (\S+) unless 0", fixed)
    assert (float(found[2]), float(found[1])) == MAGNITUDE


def bound(text: str) -> int:
    return int(re.match(r"\d+", text).group())


@pytest.mark.parametrize("row", list(SPEC_ROWS), ids=lambda r: r[0])
def test_spec_sizes_stop_at_their_documented_bound(row):
    limit = bound(limits_table()[row])
    for context in SPEC_ROWS[row]:
        miras.load_spec(spec_with(row[0], limit, **context))
        with pytest.raises(SpecError) as caught:
            miras.load_spec(spec_with(row[0], limit + 1, **context))
        [problem] = caught.value.problems
        assert problem.path == row[0]
        assert str(limit) in problem.message and str(limit + 1) in problem.message


@pytest.mark.parametrize("row", list(TRAIN_ROWS), ids=lambda r: r[0])
def test_training_settings_stop_at_their_documented_bound(row):
    limit = bound(limits_table()[row])
    for name in TRAIN_ROWS[row]:
        TrainConfig.make(**{name: limit})
        with pytest.raises(ValueError, match=rf"{name}.*{limit}"):
            TrainConfig.make(**{name: limit + 1})


@pytest.mark.parametrize("row", list(TASK_ROWS), ids=lambda r: " ".join(r))
def test_task_options_stop_at_their_documented_bound(row):
    limit = bound(limits_table()[row])
    task, names, base = TASK_ROWS[row]
    for name in names:
        value = (limit,) if name == "lengths" else limit
        if task != "text":  # the bundled corpus is shorter than the bound
            make_task(task, **{**base, name: value})
        over = (limit + 1,) if name == "lengths" else limit + 1
        with pytest.raises(ValueError, match=rf"{name}.*{limit}"):
            make_task(task, **{**base, name: over})


# The sizes that validated and then died in derive, check or train (a MemoryError after 43 s
# for p = 1e6, an OverflowError in the emitted code for a = 1e300, int(inf) at validation).
@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        ({"bias": {"kind": "lp", "p": 1.0e6}}, "bias.p", ["[1, 64]"]),
        ({"window": 1_000_000_000}, "window.c", ["[1, 1048576]", "1000000000"]),
        ({"memory": {"kind": "mlp", "expansion": 1_000_000}}, "memory.expansion", ["(0, 64]"]),
        ({"model": {"d_model": 100_000_000}}, "model.d_model", ["[1, 65536]"]),
        ({"model": {"d_model": float("inf")}}, "model.d_model", ["[1, 65536]", "inf"]),
        ({"model": {"n_layers": float("nan")}}, "model.n_layers", ["[1, 64]", "nan"]),
        (
            {"bias": {"kind": "custom", "loss": "a*e**2", "params": {"a": 1.0e300}}},
            "bias.params.a",
            ["1e+12", "1e+300"],
        ),
        (
            {"bias": {"kind": "custom", "loss": "a*e**2", "params": {"a": 1.0e-30}}},
            "bias.params.a",
            ["1e-12", "1e-30"],
        ),
        ({"optimizer": {"kind": "gd", "lr": 1.0e19}}, "optimizer.lr", ["1e+12"]),
        ({"retention": {"kind": "kl", "scale": 1.0e300}}, "retention.scale", ["1e+12"]),
    ],
    ids=[
        "lp-p",
        "window",
        "mlp-expansion",
        "d_model",
        "d_model-inf",
        "n_layers-nan",
        "param-huge",
        "param-tiny",
        "lr-huge",
        "kl-scale",
    ],
)
def test_a_size_past_its_bound_is_refused_at_validation(data, path, words):
    start = time.perf_counter()
    with pytest.raises(SpecError) as caught:
        miras.load_spec({"name": "bounds", **data})
    assert time.perf_counter() - start < 1.0
    [problem] = caught.value.problems
    assert problem.path == path
    for word in words:
        assert word in problem.message


@pytest.mark.parametrize("a", [1.0e12, 1.0e-12])
def test_fixed_values_at_the_magnitude_bounds_compile(a):
    """The magnitude bound stops where the emitted code still runs: 1e19 and 1e-30 raised
    OverflowError in the emitted bias (an exact integer past int64 times a tensor)."""
    loss = "a*e**2 + e**2/2"
    miras.compile({"name": "edge", "bias": {"kind": "custom", "loss": loss, "params": {"a": a}}})


def test_lp_at_its_largest_p_derives_in_seconds():
    start = time.perf_counter()
    miras.compile({"name": "lp64", "bias": {"kind": "lp", "p": 64}})
    assert time.perf_counter() - start < 10.0
