"""The compiler end to end: every shipped spec derives and passes its checks; passes, cache."""

from __future__ import annotations

from pathlib import Path

import pytest

import miras
from miras.compiler import pipeline
from miras.errors import DerivationError, SpecError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(ROOT.glob("specs/*.yaml")) + sorted(ROOT.glob("specs/examples/*.yaml"))


def test_every_known_model_of_the_design_table_ships():
    names = {p.stem for p in ROOT.glob("specs/*.yaml")}
    table = {
        "linear_attention",
        "retnet",
        "deltanet",
        "gated_deltanet",
        "titans",
        "moneta",
        "yaad",
        "memora",
        "omeganet",
        "atlas",
        "dla",
        "swla",
        "attention",
        "swa",
    }
    assert table <= names
    assert len(list(ROOT.glob("specs/examples/*.yaml"))) >= 2


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_spec_compiles_and_checks(path):
    header = path.read_text().splitlines()[:12]
    assert any(line.startswith("# Run: miras") for line in header), "header must say how to run it"
    rule = miras.compile(path)
    assert rule.checks and all(r.passed for r in rule.checks)
    text = str(rule.derivation())
    assert rule.spec.name in text and "Update rule" in text
    assert rule.derivation().latex
    assert set(rule.gates) == {g.name for g in rule.plan.gates}


def test_examples_use_custom_formulas():
    kinds = {
        (miras.load_spec(p).bias.kind, miras.load_spec(p).retention.kind)
        for p in ROOT.glob("specs/examples/*.yaml")
    }
    assert any(b == "custom" for b, _ in kinds)
    potentials = [miras.load_spec(p).retention for p in ROOT.glob("specs/examples/*.yaml")]
    assert any(
        r.kind == "bregman" and r.potential != "w*log(w) + (1 - w)*log(1 - w)" for r in potentials
    )


def test_repeat_compile_is_cached():
    spec = miras.load_spec(ROOT / "specs/deltanet.yaml")
    first = miras.compile(spec)
    again = miras.compile(miras.load_spec(spec.to_yaml()))  # an equal spec, loaded anew
    assert again is first


def test_debug_dumps_every_pass(monkeypatch, capsys):
    monkeypatch.setenv("MIRAS_DEBUG", "1")
    pipeline.run_passes(miras.load_spec(ROOT / "specs/yaad.yaml"))
    err = capsys.readouterr().err
    for name, _ in pipeline.PASSES:
        assert f"=== pass {name} ===" in err


def test_emitted_module_is_what_derive_shows():
    rule = miras.compile(ROOT / "specs/yaad.yaml")
    assert "def bias_grad(y, v, delta):" in rule.source
    assert "torch.where" in rule.source  # Huber's two branches
    assert "def activation_grad(x):" in rule.source  # the MLP's derived derivative


def test_the_triton_pass_emits_the_kernels_or_names_why_not():
    """The compiler's triton pass prints the kernel module of a covered rule (what the runtime
    loads, and `miras kernel` prints), and records the reason for any other."""
    covered = miras.compile(ROOT / "specs/gated_deltanet.yaml").ir
    assert covered.triton_refusal is None
    assert "def general_forward(" in covered.triton_source
    assert "def linear_state(" in covered.triton_source
    assert "def linear_output(" in covered.triton_source
    assert pipeline.kernel_source(ROOT / "specs/gated_deltanet.yaml") == covered.triton_source
    deep = miras.compile(ROOT / "specs/yaad.yaml").ir  # an MLP memory
    assert deep.triton_source is None and "mlp memory" in deep.triton_refusal
    with pytest.raises(ValueError, match="do not cover mlp memory"):
        pipeline.kernel_source(deep)


def test_failing_check_raises(monkeypatch):
    """A derived piece that disagrees with its reference stops the compile."""
    from miras.derive import bias_derive as bias_pass

    original = bias_pass.derive_bias

    def broken(bias):
        rule = original(bias)
        return rule.__class__(**{**rule.__dict__, "source": rule.source.replace("+ e", "+ 2*e")})

    monkeypatch.setattr(pipeline, "derive_bias", broken)
    pipeline._CACHE.clear()
    with pytest.raises(DerivationError, match="disagrees with its reference"):
        miras.compile({"name": "broken", "bias": "l2"})
    pipeline._CACHE.clear()


def test_non_invertible_potential_needs_newton():
    spec = {
        "name": "quartic",
        "retention": {"kind": "bregman", "potential": "w**4/4 + w**2/2 + exp(w)"},
    }
    with pytest.raises(SpecError, match="newton"):  # refused when the spec is validated
        miras.compile(spec)
    spec["retention"]["solver"] = "newton"
    rule = miras.compile(spec)
    assert "then w <- w - (F'(w) - z)/F''(w), bisecting in s" in str(rule.derivation())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_first_compile_under_no_grad_still_checks(mode):
    """The check pass differentiates: a rule first compiled under the caller's torch.no_grad()
    (a benchmark timing a forward) or inference_mode raised autograd's RuntimeError ('element 0
    of tensors does not require grad')."""
    import torch

    spec = {"name": f"first_compile_{mode}", "bias": "huber", "retention": "l2"}
    with getattr(torch, mode)():
        rule = miras.compile(spec)
    assert rule.gates == ["delta", "decay", "lr"]
