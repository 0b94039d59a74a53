"""The retention check's samples (miras/derive/retention_check.py): previous states across the
whole range of float32 and float64, not only near 0, and every branch of a soft-thresholding
step, with the count of entries on each."""

import dataclasses

import pytest
import torch

from miras.components.retention.bregman import BregmanRetention
from miras.components.retention.elastic_net import ElasticNetRetention
from miras.components.retention.l2 import L2Retention
from miras.derive.retention_check import _branch_counts, check_retention, range_states
from miras.derive.retention_derive import derive_retention

COSH = BregmanRetention(potential="cosh(w)")


def by_piece(results):
    return {r.piece.split(":")[0]: r for r in results}


@pytest.fixture(scope="module")
def cosh_rule():
    return derive_retention(COSH)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_range_states_reach_both_ends_of_the_dtype(dtype):
    """Real states from 1e-3 to near the largest float, both signs; positive ones from near
    the smallest normal float; unit-interval ones at both ends."""
    info = torch.finfo(dtype)
    real = range_states(L2Retention(), dtype)
    assert float(real.max()) > info.max**0.9 and float(real.min()) < -(info.max**0.9)
    assert float(real.abs().min()) <= 1.001e-3
    positive = range_states(BregmanRetention(potential="w*log(w)"), dtype)
    assert float(positive.min()) < info.tiny**0.9 and float(positive.max()) > info.max**0.9
    assert bool((positive > 0).all())
    unit = range_states(BregmanRetention(), dtype)
    assert bool((unit > 0).all() and (unit <= 1).all())
    assert float(unit.min()) < info.tiny**0.9 and float((1 - unit[unit < 1]).min()) < 1e-6


def test_cosh_range_checks_pass_far_from_zero(cosh_rule):
    """The stable step passes in both dtypes, at states out to |w0| = 40 (float32) and 150
    (float64) on both sides: where cosh is finite."""
    checks = by_piece(check_retention(COSH, cosh_rule))
    for name, reach in (("float32", "-42, 42"), ("float64", "-150, 150")):
        check = checks[f"range ({name})"]
        assert check.passed, f"{check.piece}: {check.error:.3g}"
        assert f"[{reach}]" in check.piece


def test_range_check_catches_the_cancelling_cosh_step(cosh_rule):
    """The step as sympy wrote it, log(z + sqrt(z**2 + 1)): the checks near 0 pass it, the
    range checks do not (wrong from w0 = -9 in float32, -inf from -20 in float64)."""
    cancelling = (
        "def retention_step(w0, u):\n"
        "    t0 = torch.sinh(w0)\n"
        "    return torch.log((t0 + torch.sqrt((1 + ((t0 - u)**2))) - u))\n"
    )
    _, _, read = cosh_rule.source.partition("\n\ndef retention_read")
    rule = dataclasses.replace(cosh_rule, source=cancelling + "\n\ndef retention_read" + read)
    checks = by_piece(check_retention(COSH, rule))
    assert checks["stationarity"].passed and checks["argmin"].passed
    assert not checks["range (float32)"].passed
    assert not checks["range (float64)"].passed
    assert "non-finite" in checks["range (float64)"].piece


@pytest.mark.parametrize(
    "retention", [ElasticNetRetention(), ElasticNetRetention(threshold="gate")], ids=str
)
def test_elastic_net_samples_hit_every_branch(retention):
    """A third of the entries on each branch of soft_threshold(a w0 - u, gamma): the zero
    branch (before: "at the 0 of 360 entries") is exercised and its subgradient checked."""
    checks = by_piece(check_retention(retention, derive_retention(retention)))
    branches = checks["branches"]
    assert branches.passed
    assert "z > t at 120, z < -t at 120, |z| <= t (W_t = 0) at 120 of 360" in branches.piece
    assert "at the 120 of 360 entries that are exactly 0" in checks["stationarity"].piece
    assert checks["stationarity"].passed and checks["argmin"].passed


def test_branch_count_fails_on_a_missed_branch():
    result = _branch_counts(torch.tensor([1.0, -2.0, 3.0]))
    assert not result.passed
    assert "|z| <= t (W_t = 0) at 0 of 3" in result.piece
