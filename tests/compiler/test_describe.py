"""`miras derive`: the text and the LaTeX state the same update rule, for every shipped spec;
the LaTeX is well formed; derive refuses what compile refuses, with compile's message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sympy as sp
from typer.testing import CliRunner

import miras
import miras.rule
from miras.cli import app
from miras.compiler import pipeline
from miras.derive.check import CheckResult
from miras.derive.describe import LatexPrinter, Line, Math, Name, PlainPrinter, Times
from miras.errors import DerivationError, SpecError

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(ROOT.glob("specs/*.yaml")) + sorted(ROOT.glob("specs/examples/*.yaml"))
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


# Line kinds the shipped specs do not show: gamma gated at c = 1 (the runtime still weighs the
# single term), fixed momentum and lr, a KL row sum of 2, lq with q = 3, the sigmoid of binary
# entropy, a gated soft threshold, a gated MLP.
EXTRA = {
    "muon_fixed": {
        "name": "muon_fixed",
        "bias": "huber",
        "retention": {"kind": "lq", "q": 3, "decay": 0.9},
        "optimizer": {"kind": "muon", "momentum": 0.5, "lr": 0.1},
        "window": {"c": 1, "gamma": "gate"},
    },
    "kl_scale": {
        "name": "kl_scale",
        "memory": {"kind": "gated_mlp"},
        "bias": "robust",
        "retention": {"kind": "kl", "scale": 2.0},
    },
    "entropy_window": {
        "name": "entropy_window",
        "retention": {"kind": "bregman"},
        "window": {"c": 3, "gamma": 0.5},
    },
    "gated_threshold": {
        "name": "gated_threshold",
        "bias": "dot",
        "retention": {"kind": "elastic_net", "threshold": "gate"},
    },
}
CASES = {**{p.stem: p for p in SPECS}, **EXTRA}


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def derivation(request):
    return miras.compile(request.param, checked=False).derivation()


def update_rows(derivation) -> tuple[list[str], list[str]]:
    """The update rule's rows in the text (indent removed) and in the LaTeX block."""
    text = derivation.text.split("Update rule, one step t")[1].split("\n\n")[0]
    text_rows = [row[2:] for row in text.splitlines()[1:]]
    latex = derivation.latex.split("% Update rule, one step t")[1]
    body = latex.split("\\begin{aligned}\n")[1].split("\n\\end{aligned}")[0]
    return text_rows, body.split(" \\\\\n")


# Rows that must appear, each as (text pieces, LaTeX pieces) on the same line of the rule.
KEY_ROWS = {
    "memora": [
        (
            ["W_t = softmax_row(", "log(W_{t-1}) - u_t)"],
            [
                r"W_{t} &= \operatorname{softmax}_{\mathrm{row}}\left(",
                r"\log{\left(W_{t-1} \right)}",
            ],
        )
    ],
    "moneta": [
        (["A_t = A_{t-1}*decay_t - u_t"], [r"A_{t} &= A_{t-1} \mathrm{decay}_{t} - u_{t}"]),
        (
            ["W_t = A_t / ||A_t||_4^2"],
            [r"W_{t} &= \frac{A_{t}}{{\left\lVert A_{t} \right\rVert_{4}}^{2}}"],
        ),
    ],
    "atlas": [
        (
            ["g_t = sum_{i=t-3..t} gamma_i * grad_W L(M_{W_e}(phi(k_i)), v_i)"],
            [r"g_{t} &= \sum_{i=t-3}^{t} \gamma_{i} \nabla_W \mathcal{L}\left(M_{W_e}"],
        ),
        (
            ["S_t = momentum_t * S_{t-1} + g_t"],
            [r"S_{t} &= \mathrm{momentum}_{t} S_{t-1} + g_{t}"],
        ),
        (
            ["u_t = lr_t * NewtonSchulz5(S_t)"],
            [r"u_{t} &= \mathrm{lr}_{t} \operatorname{NewtonSchulz}_{5}\left(S_{t}\right)"],
        ),
    ],
    "omeganet": [
        (
            ["g_t = sum_{i=t-3..t} gamma_i * grad_W L("],
            [r"g_{t} &= \sum_{i=t-3}^{t} \gamma_{i} \nabla_W \mathcal{L}"],
        ),
        (
            ["    = sum_{i=t-3..t} gamma_i * dL/dy(W_e phi(k_i), v_i) phi(k_i)^T"],
            [
                r"&= \sum_{i=t-3}^{t} \gamma_{i} \frac{\partial \mathcal{L}}{\partial y}"
                r"\left(W_{e} \phi\left(k_{i}\right), v_{i}\right) {\phi\left(k_{i}\right)}^{\top}"
            ],
        ),
    ],
    "swla": [
        (
            ["g_t = sum_{i=t-7..t} grad_W L("],  # gamma is fixed at 1: no factor
            [r"g_{t} &= \sum_{i=t-7}^{t} \nabla_W \mathcal{L}"],
        )
    ],
    "titans": [
        (
            ["S_t = momentum_t * S_{t-1} + lr_t * g_t"],
            [r"S_{t} &= \mathrm{momentum}_{t} S_{t-1} + \mathrm{lr}_{t} g_{t}"],
        ),
        (["u_t = S_t"], [r"u_{t} &= S_{t}"]),
    ],
    "gated_deltanet": [
        (
            ["W_e = decay_t * W_{t-1}    (grad_at: retained)"],
            [r"W_{e} &= \mathrm{decay}_{t} W_{t-1} \quad \text{(grad\_at: retained)}"],
        )
    ],
    "attention": [
        (
            ["o_t = sum_{i=1..t} softmax_i(q_t . k_i) v_i"],
            [
                r"o_{t} &= \sum_{i=1}^{t} \operatorname{softmax}_{i}\left(q_{t} \cdot k_{i}\right) v_{i}"
            ],
        )
    ],
    "swa": [
        (
            ["o_t = sum_{i=t-127..t} softmax_i(q_t . k_i) v_i"],
            [r"o_{t} &= \sum_{i=t-127}^{t} \operatorname{softmax}_{i}"],
        )
    ],
    "linear_attention": [(["u_t = g_t"], [r"u_{t} &= g_{t}"])],
    "cauchy_memory": [
        (
            ["W_t = soft_threshold(W_{t-1}*decay_t - u_t, 1/2000)"],
            [
                r"W_{t} &= \operatorname{soft\_threshold}\left(W_{t-1} \mathrm{decay}_{t} - u_{t}, "
                r"\frac{1}{2000}\right)"
            ],
        )
    ],
    "exponentiated_memory": [(["W_t = W_{t-1}*exp(-u_t)"], [r"W_{t} &= W_{t-1} e^{- u_{t}}"])],
    "muon_fixed": [
        (["g_t = gamma_t * grad_W L("], [r"g_{t} &= \gamma_{t} \nabla_W \mathcal{L}"]),
        (["S_t = 0.5 * S_{t-1} + g_t"], [r"S_{t} &= 0.5 S_{t-1} + g_{t}"]),
        (["u_t = 0.1 * NewtonSchulz5(S_t)"], [r"u_{t} &= 0.1 \operatorname{NewtonSchulz}_{5}"]),
        (["A_t = 9*A_{t-1}/10 - u_t"], [r"A_{t} &= \frac{9 A_{t-1}}{10} - u_{t}"]),
        (["W_t = A_t / ||A_t||_3^1"], [r"\right\rVert_{3}}^{1}}"]),
    ],
    "kl_scale": [
        (["W_t = 2 * softmax_row("], [r"W_{t} &= 2 \operatorname{softmax}_{\mathrm{row}}\left("]),
        (["    (the explicit backward through the MLP"], [r"&\quad \text{(the explicit backward"]),
    ],
    "entropy_window": [
        (
            ["g_t = sum_{i=t-2..t} 0.5 * grad_W L("],
            [r"g_{t} &= \sum_{i=t-2}^{t} 0.5 \nabla_W \mathcal{L}"],
        ),
        (
            ["W_t = sigmoid(", "log(1 - W_{t-1})"],
            [r"W_{t} &= \sigma\left(", r"\log{\left(1 - W_{t-1}"],
        ),
    ],
    "gated_threshold": [
        (["W_t = soft_threshold(", ", threshold_t)"], [r", \mathrm{threshold}_{t}\right)"]),
    ],
}


def test_every_case_with_key_rows_exists():
    assert set(KEY_ROWS) <= set(CASES)


def test_text_and_latex_have_the_same_lines(derivation):
    text_rows, latex_rows = update_rows(derivation)
    assert len(text_rows) == len(latex_rows) == len(derivation.update)
    for text, latex in zip(text_rows, latex_rows, strict=True):
        # The same left-hand side (W_t and W_{t}), or both a continuation / a note.
        text_lhs = text.split(" = ")[0].strip() if not text.startswith("    ") else ""
        latex_lhs = latex.split("&")[0].strip()
        assert re.sub(r"[{}]", "", latex_lhs) == text_lhs, (text, latex)


def test_key_rows_agree(derivation, request):
    name = request.node.callspec.id
    text_rows, latex_rows = update_rows(derivation)
    for text_pieces, latex_pieces in KEY_ROWS.get(name, []):
        (index,) = [i for i, row in enumerate(text_rows) if all(p in row for p in text_pieces)]
        assert all(p in latex_rows[index] for p in latex_pieces), latex_rows[index]


def test_parametric_rules_read_their_memory(derivation):
    text_rows, latex_rows = update_rows(derivation)
    if text_rows[0].startswith("o_t = sum"):  # softmax attention: one closed-form read
        assert "softmax_i(q_t . k_i) v_i" in text_rows[0]
        assert r"\operatorname{softmax}_{i}" in latex_rows[0]
        return
    if text_rows[0].startswith("H_kk,t = "):  # an exact optimizer: its statistics, then W_t
        assert latex_rows[0].startswith("H_{kk,t} &= ")
        assert text_rows[-1] == "o_t = M_{W_t}(phi(q_t))"
        return
    assert text_rows[0].startswith("W_e = ") and latex_rows[0].startswith("W_{e} &= ")
    assert text_rows[-1] == "o_t = M_{W_t}(phi(q_t))"
    assert latex_rows[-1] == r"o_{t} &= M_{W_t}\left(\phi\left(q_{t}\right)\right)"


# LaTeX structure -------------------------------------------------------------------------------

# Every command the derivations may use: LaTeX and amsmath, nothing undefined.
COMMANDS = {
    "alpha", "arg", "begin", "beta", "cdot", "cosh", "delta", "end", "eta", "exp", "frac",
    "gamma", "geq", "lVert", "lambda", "langle", "left", "leq", "log", "mathcal", "mathrm",
    "min", "mu", "nabla", "operatorname", "partial", "phi", "quad", "rVert", "rangle", "right",
    "sigma", "sqrt", "sum", "tanh", "text", "textgreater", "textless", "theta", "top",
}  # fmt: skip
SYMBOLS = set("[]\\_^{}:,; ")  # \[ \] \\ \_ \^ \{ \} and spacing


def braces_balanced(latex: str) -> bool:
    depth, i = 0, 0
    while i < len(latex):
        if latex[i] == "\\":
            i += 2  # a command's first character, or an escaped brace
            continue
        depth += {"{": 1, "}": -1}.get(latex[i], 0)
        if depth < 0:
            return False
        i += 1
    return depth == 0


def text_arguments(latex: str) -> list[str]:
    """The contents of each \\text{...}."""
    found = []
    for start in (m.end() for m in re.finditer(r"\\text\{", latex)):
        depth, i = 1, start
        while depth:
            if latex[i] == "\\":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(latex[i], 0)
            i += 1
        found.append(latex[start : i - 1])
    return found


def check_structure(latex: str) -> None:
    assert braces_balanced(latex)
    assert len(re.findall(r"\\left(?![a-zA-Z])", latex)) == len(
        re.findall(r"\\right(?![a-zA-Z])", latex)
    )
    environments = re.findall(r"\\(begin|end)\{(\w+)\}", latex)
    stack = []
    for kind, name in environments:
        if kind == "begin":
            stack.append(name)
        else:
            assert stack and stack.pop() == name, environments
    assert not stack
    displays = re.findall(r"^\\[\[\]]$", latex, flags=re.MULTILINE)
    assert displays == ["\\[", "\\]"] * (len(displays) // 2) and displays
    commands = set(re.findall(r"\\([a-zA-Z]+)", latex))
    assert commands <= COMMANDS, commands - COMMANDS
    assert set(re.findall(r"\\([^a-zA-Z])", latex)) <= SYMBOLS
    for words in text_arguments(latex):
        # Text mode: ^ and _ are errors, < and > other glyphs, unless escaped.
        assert not re.search(r"(?<!\\)[\^_<>$%&#]", words), words


def test_latex_is_well_formed(derivation):
    check_structure(derivation.latex)


def test_structure_check_finds_the_old_faults():
    """The check refuses what the LaTeX of this project used to contain."""
    with pytest.raises(AssertionError):  # an unescaped ^ in a note (lq's read)
        check_structure("\\[\n\\text{||A\\_t||\\_q^(q-2)}\n\\]")
    with pytest.raises(AssertionError):  # a label with a raw underscore
        check_structure("\\[\n\\text{grad_at: retained} &: x\n\\]")
    with pytest.raises(AssertionError):
        check_structure("\\[\n\\frac{a}{b\n\\]")
    check_structure("\\[\n\\begin{aligned}\nx &= \\frac{a}{b} \\\\\n&= 1\n\\end{aligned}\n\\]")


def test_printers_render_the_same_terms():
    line = Line(Math(sp.Symbol("u_t")), Times((Name("lr_t"), Name("g_t"))))
    assert PlainPrinter().line(line) == "u_t = lr_t * g_t"
    assert LatexPrinter().line(line) == "u_{t} &= lr_t g_t"
    note = Line(None, None, "(a_b <- c^2)")
    assert PlainPrinter().line(note) == "    (a_b <- c^2)"
    assert LatexPrinter().line(note) == r"&\quad \text{(a\_b \textless{}- c\^{}2)}"
    with pytest.raises(TypeError, match="cannot print"):
        PlainPrinter().doprint("W_t")


# derive refuses what compile refuses (issue 10, item 6) ----------------------------------------

# F'(w) = w**3 + w + exp(w): sympy has no closed-form inverse, so only `solver: newton` works.
NEWTON_ONLY = "w**4/4 + w**2/2 + exp(w)"


def write_spec(tmp_path, name: str, retention: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nmemory: matrix\nbias: l2\nretention: {retention}\n")
    return path


def assert_same_refusal(path: Path) -> None:
    with pytest.raises(DerivationError) as refused:
        miras.compile(path)
    result = invoke("derive", path)
    assert result.exit_code == 1
    assert str(refused.value) in result.stderr and result.stdout == ""


def test_derive_refuses_a_rule_whose_check_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "_CACHE", {})
    monkeypatch.setattr(miras.rule, "_RULES", {})
    failing = [CheckResult("argmin: a stand-in for a failing piece", 1.0, 1e-6)]
    monkeypatch.setattr(pipeline, "check_retention", lambda retention, rule: failing)
    assert_same_refusal(write_spec(tmp_path, "failing", "l2"))


def test_derive_refuses_too_few_newton_steps(tmp_path):
    """One Newton step does not solve F'(w) = z: compile's check refuses it, so derive does."""
    retention = f'{{kind: bregman, potential: "{NEWTON_ONLY}", solver: newton, newton_steps: 1}}'
    assert_same_refusal(write_spec(tmp_path, "one_newton_step", retention))


def test_derive_refuses_a_potential_without_closed_form(tmp_path):
    path = write_spec(tmp_path, "quartic", f'{{kind: bregman, potential: "{NEWTON_ONLY}"}}')
    with pytest.raises(SpecError) as refused:  # validating the spec derives its step already
        miras.compile(path)
    result = invoke("derive", path)
    assert result.exit_code == 1 and result.stdout == ""
    assert str(refused.value) in result.stderr and "solver: newton" in result.stderr
    assert invoke("validate", path).exit_code == 1


def test_newton_solve_is_named_as_such(tmp_path):
    retention = f'{{kind: bregman, potential: "{NEWTON_ONLY}", solver: newton}}'
    result = invoke("derive", write_spec(tmp_path, "quartic_newton", retention))
    assert result.exit_code == 0, result.stderr
    assert (
        "Retention (derived: Newton solve of the Learning-Retaining stationarity" in result.stdout
    )
    assert "closed-form argmin" not in result.stdout
    text_rows, latex_rows = update_rows(
        miras.compile(tmp_path / "quartic_newton.yaml").derivation()
    )
    (z_row,) = [i for i, row in enumerate(text_rows) if row.startswith("z_t = ")]
    assert "exp(W_{t-1})" in text_rows[z_row] and "- u_t" in text_rows[z_row]
    assert latex_rows[z_row].startswith("z_{t} &= ") and r"e^{W_{t-1}}" in latex_rows[z_row]
    assert text_rows[z_row + 1].startswith("W_t = (F')^-1(z_t)    (solved per entry by Newton")
    assert latex_rows[z_row + 1].startswith(r"W_{t} &= (F')^{-1}\left(z_{t}\right) \quad")


def test_closed_form_heading_stays(tmp_path):
    result = invoke("derive", ROOT / "specs/examples/exponentiated_memory.yaml")
    assert result.exit_code == 0
    assert "Retention (derived: closed-form argmin of the Learning-Retaining objective)" in (
        result.stdout
    )
    assert "Newton" not in result.stdout
