"""The compile cache shares derivations between specs with the same rule, never their specs."""

import miras
from miras.compiler import pipeline


def test_specs_differing_only_in_model_keep_their_own_model():
    small = {"name": "cached", "bias": "l2", "model": {"d_model": 32, "n_heads": 2}}
    large = {"name": "cached", "bias": "l2", "model": {"d_model": 64, "n_heads": 4}}
    first, second = miras.compile(small), miras.compile(large)
    assert first.spec.model.d_model == 32
    assert second.spec.model.d_model == 64
    # Both rules come from one derivation: the model section is not part of the rule.
    assert first.spec.digest() == second.spec.digest()
    assert first.source == second.source
    assert len([k for k in pipeline._CACHE if k == first.spec.digest()]) == 1


def test_description_is_the_callers():
    a = miras.compile({"name": "described", "description": "first"})
    b = miras.compile({"name": "described", "description": "second"})
    assert (a.spec.description, b.spec.description) == ("first", "second")
