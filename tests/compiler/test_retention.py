"""Retention pass: each derived step minimizes its objective and is the published rule.

`RetentionContract` is the battery; every retention (and every notable setting of one) is a
subclass that names the component and writes its published rule by hand in `expected`.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import sympy as sp
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from miras.cli import app
from miras.components.base import Retention
from miras.components.retention.bregman import BregmanRetention
from miras.components.retention.elastic_net import ElasticNetRetention
from miras.components.retention.kl import KLRetention
from miras.components.retention.l2 import L2Retention
from miras.components.retention.lq import LqRetention
from miras.components.retention.none import NoRetention
from miras.derive.emit import load_module, module_source
from miras.derive.retention_check import SHAPE, check_retention, sample_gates, sample_state
from miras.derive.retention_derive import _solve_unique, derive_retention
from miras.derive.symbols import gate_symbol, sigmoid, soft_threshold, u, w, w0
from miras.errors import DerivationError
from miras.ir import RetentionRule

STATIONARITY_TOL = 1e-8  # |autograd grad of the objective| at the derived W_t, float64
ARGMIN_TOL = 1e-6  # derived W_t vs a numerical minimizer (golden section / L-BFGS), float64
runner = CliRunner()

PUBLISHED_TOL = 1e-12  # emitted step vs the published formula written in torch below

a, gamma = gate_symbol("decay"), gate_symbol("threshold")
QUARTIC_EXP = "w**4/4 + w**2/2 + exp(w)"  # convex; sympy cannot invert F' = w^3 + w + e^w


def load(rule: RetentionRule):
    return load_module(module_source(f"test retention {rule.kind}", [rule.source]))


# Not helpers.random_inputs: the retention step takes a state and an update (w0, u) and
# per-entry gates, not q, k, v.
def inputs(retention: Retention, seed: int = 7, shape=SHAPE):
    """w0 in the retention's domain, u, and per-entry gates, float64."""
    gen = torch.Generator().manual_seed(seed)
    w0_ = sample_state(retention, shape, torch.float64, gen)
    u_ = 0.5 * torch.randn(shape, dtype=torch.float64, generator=gen)
    return w0_, u_, sample_gates(retention, shape, torch.float64, gen)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((actual - expected).abs() / expected.abs().clamp_min(1.0)).max())


def tampered(rule: RetentionRule) -> RetentionRule:
    """The same rule with its step off by a small, non-uniform factor: the checks must fail."""
    source = rule.source.replace("def retention_step(", "def exact_step(")
    source += (
        "\n\ndef retention_step(w0, u, *gates):\n"
        "    return exact_step(w0, u, *gates) * (1 + 1e-3 * torch.cos(3 * u))\n"
    )
    return dataclasses.replace(rule, source=source)


class RetentionContract:
    """Every retention passes these. Subclass: set `retention`, write `expected`."""

    retention: Retention

    def expected(self, w0_, u_, gates: dict[str, torch.Tensor]) -> torch.Tensor:
        """The published step (the state after one step), written by hand in torch."""
        raise NotImplementedError

    def read(self, state: torch.Tensor) -> torch.Tensor:
        """The published read map; the identity except for lq."""
        return state

    @pytest.fixture(scope="class")
    @classmethod
    def rule(cls) -> RetentionRule:
        return derive_retention(cls.retention)

    @pytest.fixture(scope="class")
    @classmethod
    def checks(cls, rule):
        """Check results at seed 0, by piece name: stationarity, argmin, ..."""
        return {c.piece.split(":")[0]: c for c in check_retention(cls.retention, rule, seed=0)}

    def test_objective_gradient_vanishes_at_step(self, checks):
        check = checks["stationarity"]
        assert check.tolerance <= STATIONARITY_TOL
        assert check.passed, f"{check.piece}: {check.error:.3g}"

    def test_step_is_numerical_minimizer(self, checks):
        check = checks["argmin"]
        assert check.tolerance <= ARGMIN_TOL
        assert check.passed, f"{check.piece}: {check.error:.3g}"

    def test_checks_pass_on_other_inputs(self, rule):
        results = check_retention(self.retention, rule, seed=1)
        assert [r.piece for r in results if not r.passed] == []

    def test_checks_catch_a_wrong_step(self, rule):
        failed = {
            r.piece.split(":")[0]
            for r in check_retention(self.retention, tampered(rule))
            if not r.passed
        }
        assert {"stationarity", "argmin"} <= failed

    def test_step_is_published_rule(self, rule):
        w0_, u_, gates = inputs(self.retention)
        new = load(rule).retention_step(w0_, u_, *gates.values())
        assert new.shape == w0_.shape
        assert relative_error(new, self.expected(w0_, u_, gates)) <= PUBLISHED_TOL

    def test_read_is_published_map(self, rule):
        w0_, u_, gates = inputs(self.retention)
        module = load(rule)
        state = module.retention_step(w0_, u_, *gates.values())
        assert relative_error(module.retention_read(state), self.read(state)) <= PUBLISHED_TOL

    def test_gates_are_step_arguments(self, rule):
        assert rule.gates == tuple(self.retention.gates())
        params = list(inspect.signature(load(rule).retention_step).parameters)
        assert params == ["w0", "u", *rule.gates]

    def test_step_uses_only_state_update_and_gates(self, rule):
        allowed = {w0, u, *(gate_symbol(g) for g in rule.gates)}
        assert rule.step.free_symbols <= allowed

    def test_per_row_gates_broadcast(self, rule):
        if not rule.gates:  # nothing to broadcast: the step takes the state and update only
            assert "def retention_step(w0, u):" in rule.source
            return
        w0_, u_, gates = inputs(self.retention)
        per_row = {n: g[..., :1] for n, g in gates.items()}  # [B, H, Dv, 1]: one per row
        module = load(rule)
        broadcast = module.retention_step(w0_, u_, *per_row.values())
        expanded = module.retention_step(w0_, u_, *(g.expand_as(w0_) for g in per_row.values()))
        assert torch.equal(broadcast, expanded)
        assert relative_error(broadcast, self.expected(w0_, u_, per_row)) <= PUBLISHED_TOL

    def test_step_is_differentiable(self, rule):
        w0_, u_, gates = inputs(self.retention, shape=(2, 3))
        args = [x.requires_grad_() for x in (w0_, u_, *gates.values())]
        assert torch.autograd.gradcheck(load(rule).retention_step, args)

    def test_derivation_reads(self, rule):
        heading, *lines = rule.text().splitlines()
        assert heading.startswith(f"retention {rule.kind}: W_t = argmin_W <u_t, W>")
        labels = [label for label, _ in rule.steps]
        assert [line.split("  ")[1] for line in lines] == labels  # one line per step, in order
        assert labels[0] in ("objective", "potential")
        assert any("step" in label for label in labels)
        latex = rule.latex()
        assert latex.startswith("\\begin{aligned}\n") and latex.endswith("\n\\end{aligned}")
        rows = latex.splitlines()[1:-1][-len(labels) :]  # the steps' rows end the block
        for row, label in zip(rows, labels, strict=True):
            word = label.split()[0].replace("_", r"\_")
            assert row.startswith(r"\text{" + word) and " &: " in row, (label, row)


class TestNone(RetentionContract):
    retention = NoRetention()

    def expected(self, w0_, u_, gates):
        return w0_ - u_

    def test_step_is_structurally_w0_minus_u(self, rule):
        assert sp.simplify(rule.step - (w0 - u)) == 0


class TestL2(RetentionContract):
    retention = L2Retention()

    def expected(self, w0_, u_, gates):
        return gates["decay"] * w0_ - u_

    def test_step_is_structurally_decay_w0_minus_u(self, rule):
        assert sp.simplify(rule.step - (a * w0 - u)) == 0

    def test_reparameterization_is_the_papers(self):
        assert self.retention.reparameterization() == {
            sp.Symbol("eta", positive=True): 1 / a,
            sp.Symbol("alpha", positive=True): 1 / (1 - a),
        }


class TestL2FixedDecay(RetentionContract):
    retention = L2Retention(decay=0.9, grad_at="retained")

    def expected(self, w0_, u_, gates):
        return 0.9 * w0_ - u_

    def test_fixed_decay_is_a_literal(self, rule):
        assert rule.gates == ()
        assert "decay" not in inspect.signature(load(rule).retention_step).parameters
        assert "0.9" in rule.source
        assert rule.step == sp.Rational(9, 10) * w0 - u

    def test_derivation_mentions_grad_at(self, rule):
        assert "grad_at: retained" in rule.text()


class TestLq(RetentionContract):
    retention = LqRetention()  # Moneta: q = 4

    def expected(self, w0_, u_, gates):
        return gates["decay"] * w0_ - u_  # the accumulator A_t

    def read(self, state):
        q = 4.0
        norm = (state.abs() ** q).sum(dim=(-1, -2), keepdim=True) ** (1 / q)
        return state / norm ** (q - 2)

    def test_zero_state_reads_as_zero(self, rule):
        zero = torch.zeros(2, 3, 4, dtype=torch.float64)
        assert torch.equal(load(rule).retention_read(zero), zero)

    def test_derivation_says_read_is_not_an_argmin(self, rule):
        assert "not an argmin" in rule.text()


class TestLqCubic(TestLq):
    retention = LqRetention(q=3.0, decay=0.8)

    def expected(self, w0_, u_, gates):
        return 0.8 * w0_ - u_

    def read(self, state):
        norm = (state.abs() ** 3).sum(dim=(-1, -2), keepdim=True) ** (1 / 3)
        return state / norm


class TestKL(RetentionContract):
    retention = KLRetention()

    def expected(self, w0_, u_, gates):
        logits = gates["decay"] * torch.log(w0_) - u_
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))
        return self.retention.scale * weights / weights.sum(-1, keepdim=True)

    def test_rows_positive_with_declared_sum(self, rule):
        w0_, u_, gates = inputs(self.retention)
        new = load(rule).retention_step(w0_, u_, *gates.values())
        assert bool((new > 0).all())
        sums = new.sum(-1)
        assert relative_error(sums, torch.full_like(sums, self.retention.scale)) <= 1e-12

    def test_step_is_logits_of_row_softmax(self, rule):
        assert sp.simplify(rule.step - (a * sp.log(w0) - u)) == 0
        assert "torch.softmax(z, dim=-1)" in rule.source


class TestKLScaled(TestKL):
    retention = KLRetention(scale=2.5)


class TestElasticNet(RetentionContract):
    retention = ElasticNetRetention(threshold="gate")

    def expected(self, w0_, u_, gates):
        z = gates["decay"] * w0_ - u_
        return torch.sign(z) * torch.relu(z.abs() - gates["threshold"])

    def test_step_is_soft_threshold(self, rule):
        assert isinstance(rule.step, soft_threshold)
        z, t = rule.step.args
        assert sp.simplify(z - (a * w0 - u)) == 0
        assert t == gamma

    def test_some_entries_are_thresholded_to_zero(self, rule, checks):
        w0_, u_, gates = inputs(self.retention)
        new = load(rule).retention_step(w0_, u_, *gates.values())
        assert 0 < int((new == 0).sum()) < new.numel()  # both branches are exercised
        assert "exactly 0" in checks["stationarity"].piece


class TestElasticNetFixedThreshold(RetentionContract):
    retention = ElasticNetRetention(threshold=0.3)

    def expected(self, w0_, u_, gates):
        z = gates["decay"] * w0_ - u_
        return torch.sign(z) * torch.relu(z.abs() - 0.3)

    def test_threshold_is_a_literal(self, rule):
        assert rule.gates == ("decay",)
        assert rule.step == soft_threshold(a * w0 - u, sp.Rational(3, 10))


class TestBregmanBinaryEntropy(RetentionContract):
    retention = BregmanRetention()

    def expected(self, w0_, u_, gates):
        return torch.sigmoid(torch.logit(w0_) - u_)

    def test_step_is_sigmoid_of_logit(self, rule):
        assert isinstance(rule.step, sigmoid)
        assert sp.simplify(rule.step.args[0] - (sp.log(w0) - sp.log(1 - w0) - u)) == 0
        assert "torch.sigmoid(" in rule.source

    def test_domain_is_unit_interval(self):
        assert self.retention.domain() == "unit_interval"


class TestBregmanExponentiated(RetentionContract):
    """A custom potential sympy inverts: F = w log w - w, F' = log w, so W_t = W_{t-1} e^{-u}."""

    retention = BregmanRetention(potential="w*log(w) - w")

    def expected(self, w0_, u_, gates):
        return w0_ * torch.exp(-u_)

    def test_domain_is_positive(self):
        assert self.retention.domain() == "positive"


class TestBregmanNewton(RetentionContract):
    retention = BregmanRetention(potential=QUARTIC_EXP, solver="newton")

    def expected(self, w0_, u_, gates):
        """(F')^{-1}(F'(w0) - u) by bisection: F' = w^3 + w + e^w is increasing."""

        def slope(x):
            return x**3 + x + torch.exp(x)

        target = slope(w0_) - u_
        lo, hi = torch.full_like(w0_, -20.0), torch.full_like(w0_, 20.0)
        for _ in range(200):
            mid = (lo + hi) / 2
            below = slope(mid) < target
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        return (lo + hi) / 2

    def test_derivation_states_newton(self, rule):
        assert "at most 100 iterations" in rule.text()  # newton_steps: the cap, default 100
        assert "for _ in range(100):" in rule.source


# Errors --------------------------------------------------------------------------------------


def test_uninvertible_potential_asks_for_newton():
    # Refused when the retention is validated, with derive's message ...
    with pytest.raises(ValidationError) as refused:
        BregmanRetention(potential=QUARTIC_EXP)
    # ... which derive gives for one built without validation.
    with pytest.raises(DerivationError) as info:
        derive_retention(BregmanRetention.model_construct(potential=QUARTIC_EXP))
    for message in (str(info.value), str(refused.value)):
        assert "sympy cannot invert F'(w) = w**3 + w + exp(w)" in message
        assert "retention.solver: newton" in message


@pytest.mark.parametrize(
    ("potential", "words"),
    [
        ("w**3", "not strictly convex"),  # F'' = 6w < 0 for w < 0
        ("exp(w)", "tends to 0"),  # F' = e^w > 0: no minimizer once u > e^{w0}
        ("w*log(w) - w + w**2/2", "LambertW"),  # inverse exists, but no printer for it
        ("w**4/4", "none of its solutions .* is a real inverse"),  # cube roots of negatives
    ],
)
def test_bad_potentials_are_explained(potential, words):
    with pytest.raises(ValidationError, match=words):  # refused when validated, as derive does
        BregmanRetention(potential=potential)
    with pytest.raises(DerivationError, match=words):
        derive_retention(BregmanRetention.model_construct(potential=potential))


@pytest.mark.parametrize(
    ("potential", "words"),
    [
        ("w*log(w", "syntax error"),
        ("w*log(x)", "unknown symbol 'x'"),
        ("2", "does not depend on w"),
        ("w*log(1 + w)", "domain"),  # w > -1 is not a supported domain
    ],
)
def test_potential_errors_name_the_field(potential, words):
    with pytest.raises(ValidationError, match=words) as info:
        BregmanRetention(potential=potential)
    assert info.value.errors()[0]["loc"] == ("potential",)


# The derivation's text and errors: the lq equation names the spec's q, Bregman errors say what
# sympy found ---------------------------------------------------------------------------------


def test_lq_equation_names_the_specs_q(tmp_path):
    assert "||A_t||_3^1" in LqRetention(q=3).spec_equation()
    assert "q = 3 here, 4 in Moneta" in LqRetention(q=3).spec_equation()
    assert "||A_t||_4^2" in LqRetention().spec_equation()
    path = tmp_path / "lq3.yaml"
    path.write_text("name: lq3\nmemory: matrix\nbias: l2\nretention: {kind: lq, q: 3}\n")
    text = runner.invoke(app, ["derive", str(path)]).stdout
    assert "||A_t||_3^1   (MIRAS eq. 24; q = 3 here, 4 in Moneta)" in text
    assert "q = 4)" not in text


def test_bregman_error_when_sympy_finds_no_solution():
    with pytest.raises(DerivationError) as info:  # F' = w^5 + w; unvalidated (validation refuses)
        derive_retention(BregmanRetention.model_construct(potential="w**6/6 + w**2/2"))
    message = str(info.value)
    assert "sympy found no closed-form solution for w" in message
    assert "no solution was not" not in message and "retention.solver: newton" in message


def test_bregman_error_lists_the_rejected_solutions_on_the_command_line(tmp_path):
    path = tmp_path / "cubic.yaml"
    path.write_text(
        "name: cubic\nmemory: matrix\nbias: l2\nretention: {kind: bregman, potential: 'w**4/4'}\n"
    )
    result = runner.invoke(app, ["derive", str(path)])
    assert result.exit_code == 1
    # rich used to read the bracketed list as markup and print "its solutions  are not"
    assert "none of its solutions for w (z**(1/3), " in result.stderr, result.stderr
    assert "is a real inverse at every sample point" in result.stderr


def test_solve_unique_says_how_many_solutions_sympy_found():
    with pytest.raises(DerivationError, match=r"sympy found no solution of exp\(w\) = 0 for w"):
        _solve_unique(sp.exp(w), w, "case")
    with pytest.raises(DerivationError, match=r"sympy found 2: -1, 1"):
        _solve_unique(w**2 - 1, w, "case")
