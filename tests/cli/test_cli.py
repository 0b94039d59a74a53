"""The command line: each command's output and exit code, and clean errors."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from miras.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_validate_ok_and_bad(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nbias: huberr\nmemory: {kind: mlp, depht: 2}\n")
    result = invoke("validate", ROOT / "specs/deltanet.yaml", bad)
    assert result.exit_code == 1
    assert "ok" in result.stdout and "deltanet" in result.stdout
    assert "bad.yaml: 2 problems" in result.stderr
    assert "did you mean 'huber'" in result.stderr and "did you mean 'depth'" in result.stderr
    assert "Traceback" not in result.output


def test_components_catalogue():
    result = invoke("components")
    assert result.exit_code == 0
    for kind in ("huber", "elastic_net", "muon", "taylor", "gated_mlp", "bregman"):
        assert kind in result.stdout
    assert "(0, 1]" in result.stdout  # the decay gate's range
    only = invoke("components", "retention")
    assert "elastic_net" in only.stdout and "muon" not in only.stdout
    wrong = invoke("components", "biass")
    assert wrong.exit_code == 2 and "allowed: memory, feature_map, bias" in wrong.stderr


def test_derive_text_latex_and_code():
    path = ROOT / "specs/gated_deltanet.yaml"
    text = invoke("derive", path)
    assert text.exit_code == 0
    assert "w = decay*w0 - u" in text.stdout and "W_e = decay_t * W_{t-1}" in text.stdout
    latex = invoke("derive", path, "--latex")
    assert latex.exit_code == 0 and "\\begin{aligned}" in latex.stdout
    code = invoke("derive", path, "--code")
    assert "def retention_step(w0, u, decay):" in code.stdout


def test_check_table_and_exit_code():
    result = invoke("check", ROOT / "specs/examples/cauchy_memory.yaml")
    assert result.exit_code == 0
    assert "dL/dy derived vs autograd" in result.stdout and "pass" in result.stdout
    assert "FAIL" not in result.stdout


def test_check_exit_code_one_on_failure(monkeypatch):
    from miras.derive.check import CheckResult
    from miras.rule import MemoryRule

    monkeypatch.setattr(
        MemoryRule, "check", lambda self, seed=0: [CheckResult("piece", 1.0, 1e-10)]
    )
    result = invoke("check", ROOT / "specs/deltanet.yaml")
    assert result.exit_code == 1 and "FAIL" in result.stdout


def test_errors_are_one_clean_message(tmp_path):
    missing = invoke("derive", tmp_path / "nope.yaml")
    assert missing.exit_code == 1 and "nope.yaml" in missing.stderr
    assert "Traceback" not in missing.output
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("name: x\nbias: {kind: custom, loss: \"__import__('os').system('true')\"}\n")
    result = invoke("check", unsafe)
    assert result.exit_code == 1 and "bias.loss" in result.stderr
    assert "cannot be called" in result.stderr


def test_kernel_prints_writes_and_refuses(tmp_path):
    printed = invoke("kernel", ROOT / "specs/deltanet.yaml")
    assert printed.exit_code == 0 and "import triton" in printed.stdout
    target = tmp_path / "k" / "retnet.py"
    written = invoke("kernel", ROOT / "specs/retnet.yaml", "-o", target)
    assert written.exit_code == 0 and target.read_text().startswith("# Triton chunk kernels")
    refused = invoke("kernel", ROOT / "specs/moneta.yaml")  # residual_norm: not covered
    assert refused.exit_code == 1 and "mlp memory" in refused.stderr
    assert "backend='chunk'" in refused.stderr and "Traceback" not in refused.output
