"""Every derivation once (issue 38): a compile derives each component once, its passes read
the compiled rule, a checked compile after an unchecked one runs only the check pass, and
validation's derivations are the compile's. Derivations are cached by the component's class
and fields, never shared between different ones.

Each test uses component values no other test uses, so that its derivations are new in this
process however the suite is ordered; it counts the calls of `sympy.solve` and the cache's
derivations (`computed`) and lookups (`asked`) around what it does.
"""

from __future__ import annotations

import threading
from typing import ClassVar, Literal

import pytest
import sympy

import miras
from miras.components.retention.none import NoRetention
from miras.derive.bias_derive import BIASES
from miras.derive.retention_derive import RETENTIONS
from miras.registry import registered


@pytest.fixture
def solves(monkeypatch) -> list:
    """The equations passed to `sympy.solve` (every module calls it as `sp.solve`)."""
    calls: list = []
    original = sympy.solve

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(sympy, "solve", counting)
    return calls


class Counts:
    """Derivations run and lookups made by the bias and retention caches since creation."""

    def __init__(self):
        self.start = {memo.name: (memo.computed, memo.asked) for memo in (BIASES, RETENTIONS)}

    def __call__(self) -> dict[str, tuple[int, int]]:
        now = {memo.name: (memo.computed, memo.asked) for memo in (BIASES, RETENTIONS)}
        return {k: (now[k][0] - self.start[k][0], now[k][1] - self.start[k][1]) for k in now}


def elastic_net_spec(name: str, threshold: float, delta: float) -> dict:
    return {
        "name": name,
        "bias": {"kind": "huber", "delta": delta},
        "retention": {"kind": "elastic_net", "threshold": threshold},
    }


def test_an_elastic_net_compile_derives_each_piece_once(solves):
    """The issue's case: unchecked, the retention was derived twice (the chunk-form analysis
    derived it again, 4 solves); the checked compile after it ran every pass again (4
    retention and 2 bias derivations, 9 solves in all)."""
    spec = elastic_net_spec("derive_once_elastic", threshold=0.0031, delta=0.71)
    counts = Counts()
    unchecked = miras.compile(spec, checked=False)
    assert not unchecked.checks
    # The two subgradient cases w > 0 and w < 0 are the retention's only solves.
    assert len(solves) == 2
    # One derivation of each, asked once: by its own pass, no other pass asks again.
    assert counts() == {"bias": (1, 1), "retention": (1, 1)}

    checked = miras.compile(spec)
    assert checked.checks and all(r.passed for r in checked.checks)
    # The check pass alone: its one solve (the update that puts z on each branch of the soft
    # threshold), nothing derived or asked again.
    assert len(solves) == 3
    assert counts() == {"bias": (1, 1), "retention": (1, 1)}
    # The check pass ran on the cached rule: its derived pieces are the same objects.
    assert checked.retention is unchecked.retention and checked.bias is unchecked.bias
    assert checked.source == unchecked.source

    # Idempotent: checking again, or rule.check() on it, solves nothing anew.
    assert miras.compile(spec) is checked
    checked.check(triton=False)
    assert len(solves) == 3
    assert counts()["retention"][0] == 1 and counts()["bias"][0] == 1


def test_specs_share_a_derivation_only_where_a_component_is_equal(solves):
    first = miras.compile(elastic_net_spec("derive_once_a", threshold=0.0047, delta=0.53))
    assert len(solves) == 3
    counts = Counts()
    # Another bias, the same retention: the retention is not derived again.
    second = miras.compile(elastic_net_spec("derive_once_b", threshold=0.0047, delta=0.59))
    assert counts()["retention"][0] == 0 and counts()["bias"][0] == 1
    assert second.retention is first.retention
    assert len(solves) == 3
    # Another threshold: a derivation of its own, with its own value in the step.
    third = miras.compile(elastic_net_spec("derive_once_c", threshold=0.0053, delta=0.53))
    assert counts()["retention"][0] == 1
    assert third.bias is first.bias
    assert third.retention.step.args[1] == sympy.Rational(53, 10000)
    assert first.retention.step.args[1] == sympy.Rational(47, 10000)


def test_validation_derives_for_the_compile():
    """A Bregman potential other than the default is derived while the spec validates (to
    refuse one sympy cannot invert); the compile reads that derivation."""
    spec = {
        "name": "derive_once_bregman",
        "retention": {"kind": "bregman", "potential": "w**2/2 + w**2/11"},
    }
    counts = Counts()
    loaded = miras.load_spec(spec)
    assert counts()["retention"] == (1, 1)
    miras.load_spec(loaded.to_yaml())  # validated again: read, not derived
    assert counts()["retention"][0] == 1
    rule = miras.compile(loaded)
    assert rule.checks and all(r.passed for r in rule.checks)
    assert counts()["retention"][0] == 1


def test_a_kind_registered_anew_is_derived_anew():
    """The caches key a component by its class: a class registered under a kind another
    class had gets its own derivation and compiled rule, not the earlier class's."""

    class Whole(NoRetention):
        kind: Literal["derive_once_probe"] = "derive_once_probe"

    class Half(NoRetention):
        kind: Literal["derive_once_probe"] = "derive_once_probe"
        linear_step: ClassVar[bool] = False

        def objective(self):
            from miras.derive.symbols import eta, u, w, w0

            return u * w + (w - w0) ** 2 / eta  # W_t = W_(t-1) - u_t / 2

    spec = {"name": "derive_once_probe", "retention": "derive_once_probe"}
    with registered(Whole):
        whole = miras.compile(spec)
    with registered(Half):
        half = miras.compile(spec)
    w0, u = sympy.Symbol("w0", real=True), sympy.Symbol("u", real=True)
    assert sympy.simplify(whole.retention.step - (w0 - u)) == 0
    assert sympy.simplify(half.retention.step - (w0 - u / 2)) == 0
    assert type(half.spec.retention) is Half


def test_threads_compiling_one_rule_derive_it_once():
    spec = elastic_net_spec("derive_once_threads", threshold=0.0061, delta=0.67)
    counts = Counts()
    rules, errors = [], []
    start = threading.Barrier(4)

    def compile_it():
        start.wait()
        try:
            rules.append(miras.compile(spec))
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=compile_it) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(rules) == 4 and all(rule is rules[0] for rule in rules)
    assert counts()["retention"][0] == 1 and counts()["bias"][0] == 1


def test_a_refusal_is_cached_and_raised_afresh():
    from miras.components.retention.bregman import BregmanRetention
    from miras.errors import DerivationError

    retention = BregmanRetention.model_construct(potential="w**6/6 + w**2/2 + w**4/13")
    counts = Counts()
    from miras.derive.retention_derive import derive_retention

    with pytest.raises(DerivationError) as first:
        derive_retention(retention)
    with pytest.raises(DerivationError) as again:
        derive_retention(retention)
    assert str(again.value) == str(first.value)
    assert again.value is not first.value
    assert counts()["retention"] == (1, 2)
