"""The memory estimate (`miras.resources`): a run whose sizes add up to more than the machine
has is refused before anything is allocated, naming the sizes to lower."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import miras
from miras import resources
from miras.cli import app
from miras.resources import GiB, ResourceError, require, training_estimate
from miras.tasks import make_task

runner = CliRunner()
# Within every size bound, about 1.6 TB to train: more than any machine these tests run on.
HUGE = {"name": "huge", "model": {"d_model": 65536, "n_heads": 64}}


def estimate(batch_size=32, seq_len=128, vocab_size=256, **spec):
    spec = miras.load_spec({"name": "sizes", **spec})
    return training_estimate(spec, batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)


def test_the_default_model_fits_in_well_under_a_gib():
    assert 10 << 20 < estimate().total < GiB // 4


@pytest.mark.parametrize(
    ("grown", "field"),
    [
        ({"batch_size": 64}, "batch_size"),
        ({"seq_len": 256}, "seq_len"),
        ({"vocab_size": 4096}, "vocab_size"),
        ({"model": {"d_model": 128}}, "model.d_model"),
        ({"model": {"n_layers": 4}}, "model.n_layers"),
        ({"memory": {"kind": "mlp", "expansion": 16}}, "memory.expansion"),
        ({"window": "global"}, "window.c"),
        ({"feature_map": "taylor"}, "feature_map.kind"),
        ({"optimizer": {"kind": "gd", "steps": 4}}, "optimizer.steps"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_each_size_grows_the_estimate_and_is_named(grown, field):
    base = estimate(**({"memory": "mlp"} if "memory" in grown else {}))
    bigger = estimate(**grown)
    assert bigger.total > base.total
    assert field in {name for part in bigger.parts for name in part.fields}


def test_a_refusal_names_the_sizes_and_both_amounts():
    need = training_estimate(miras.load_spec(HUGE), batch_size=32, seq_len=128, vocab_size=256)
    with pytest.raises(ResourceError) as caught:
        require(need, "training", available=GiB)
    text = str(caught.value)
    assert text.startswith(
        f"training needs about {need.total / GiB:.1f} GiB (model.d_model = 65536"
    )
    assert "the machine has 1.0 GiB available" in text
    require(need, "training", available=need.total)  # exactly enough is enough


def test_available_memory_is_the_machines():
    have = resources.available_bytes()
    pages = resources.os.sysconf("SC_PHYS_PAGES") * resources.os.sysconf("SC_PAGE_SIZE")
    assert 0 < have <= pages


def test_train_refuses_before_it_builds_the_model(monkeypatch):
    """d_model 65536 validated, then training died in the allocator building the model."""
    import miras.training.recipe as training

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the estimate refused it")

    monkeypatch.setattr(training, "build_model", build_model)
    task = make_task("mqar", vocab_size=64, seq_len=32, num_pairs=4)
    start = time.perf_counter()
    with pytest.raises(ResourceError, match=r"training needs about .* \(model\.d_model = 65536"):
        training.train(HUGE, task, steps=1, batch_size=2, progress=False)
    assert time.perf_counter() - start < 5


def test_cli_train_prints_the_refusal(tmp_path: Path):
    spec = tmp_path / "huge.yaml"
    spec.write_text("name: huge\nmodel: {d_model: 65536, n_heads: 64}\n")
    args = ["train", str(spec), "--task", "mqar", "--steps", "1", "--out", str(tmp_path / "run")]
    result = runner.invoke(app, [*args, "--no-progress"])
    assert result.exit_code == 1
    assert "error: training needs about" in result.output
    assert "the machine has" in result.output
    assert not (tmp_path / "run").exists()


def test_cli_check_refuses_a_window_its_oracle_cannot_sum(tmp_path: Path):
    """c = 2^20: the check runs c + 3 tokens through an oracle that sums every window, 10^12
    terms (it ran for hours; at c = 1e9 it died allocating 64 GB)."""
    spec = tmp_path / "wide.yaml"
    spec.write_text("name: wide\nwindow: 1048576\noptimizer: {kind: gd, lr: 0.5}\n")
    start = time.perf_counter()
    result = runner.invoke(app, ["check", str(spec)])
    assert result.exit_code == 1
    assert "end-to-end check runs T = 1048579 tokens" in result.output
    assert "window.c = 1048576" in result.output
    assert time.perf_counter() - start < 30


def test_cli_check_refuses_an_attention_window_it_cannot_hold(tmp_path: Path):
    spec = tmp_path / "attention.yaml"
    spec.write_text("name: attention\nmemory: {kind: nonparametric, window: 1048576}\n")
    result = runner.invoke(app, ["check", str(spec)])
    assert result.exit_code == 1
    assert "the end-to-end check needs about" in result.output
    assert "memory.window = 1048576" in result.output


def test_cli_probe_refuses_a_key_width_it_cannot_hold(tmp_path: Path):
    spec = tmp_path / "delta.yaml"
    spec.write_text("name: delta\n")
    result = runner.invoke(app, ["probe", "capacity", str(spec), "--option", "d_k=200000"])
    assert result.exit_code == 1
    assert "probe capacity of" in result.output and "needs about" in result.output
    assert "d_k = 200000" in result.output
