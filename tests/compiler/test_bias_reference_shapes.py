"""The shapes `Bias.reference_loss` is handed in the bias check (y, v: [..., Dv]; each gate:
[..., 1]) and gives back ([...]), docs/architecture.md: a reference loss that breaks them is
a ValueError naming the component, what it was given and what it gave back, not torch's
broadcasting error or a comparison that broadcasts silently."""

from __future__ import annotations

import pytest

from miras.components import CustomBias, HuberBias, L2Bias
from miras.derive.bias_check import check_bias
from miras.derive.bias_derive import derive_bias


class KeepsTheValueAxis(L2Bias):
    """Sums with keepdim: [..., 1], which a comparison with [...] would broadcast."""

    def reference_loss(self, y, v, **scalars):
        return super().reference_loss(y, v, **scalars).unsqueeze(-1)


class SumsEverything(L2Bias):
    def reference_loss(self, y, v, **scalars):
        return super().reference_loss(y, v, **scalars).sum()


class GateWithoutItsAxis(HuberBias):
    """Takes its gate as [...] (one per vector, without the trailing axis)."""

    def reference_loss(self, y, v, delta=None, **scalars):
        return super().reference_loss(y, v, delta=delta.squeeze(-1), **scalars)


class OtherGateName(HuberBias):
    """Names its gate's keyword differently from the field."""

    def reference_loss(self, y, v, threshold=None):
        return super().reference_loss(y, v, delta=threshold)


def check(bias):
    return check_bias(bias, derive_bias(bias), seed=0)


@pytest.mark.parametrize(
    "bias, got",
    [(KeepsTheValueAxis(), r"returned \[6, 3, 1\]"), (SumsEverything(), r"returned \[\]")],
    ids=["keepdim", "scalar"],
)
def test_a_reference_loss_of_the_wrong_shape_is_named(bias, got):
    with pytest.raises(ValueError, match=rf"the l2 bias \({type(bias).__name__}\)") as err:
        check(bias)
    assert err.match(rf"reference_loss\(y \[6, 3, 7\], v \[6, 3, 7\]\) {got}, expected \[6, 3\]")
    assert err.match(r"returns L summed over the value axis, \[\.\.\.\]")


@pytest.mark.parametrize("bias", [GateWithoutItsAxis(), OtherGateName()], ids=["shape", "name"])
def test_a_reference_loss_that_fails_on_the_gates_it_is_given_is_named(bias):
    name = type(bias).__name__
    with pytest.raises(ValueError, match=rf"the huber bias \({name}\): reference_loss\(") as err:
        check(bias)
    assert err.match(r"delta \[6, 3, 1\]\) failed: ")
    assert err.match(r"each gate of the bias .* as a keyword argument of shape \[\.\.\., 1\]")


@pytest.mark.parametrize("bias", [L2Bias(), HuberBias(), HuberBias(delta=0.5)])
def test_the_shipped_reference_losses_keep_the_shapes(bias):
    results = check(bias)
    assert len(results) == 3 and all(r.passed for r in results), [str(r) for r in results]


def test_a_custom_formula_has_no_reference_and_is_checked_against_its_printed_loss():
    """Its reference_loss raises NotImplementedError (a RuntimeError to Python): no oracle, no
    error."""
    results = check(CustomBias(loss="a*e**2/2", params={"a": "gate"}))
    assert [r.piece for r in results] == ["dL/dy derived vs autograd(printed L)"]
    assert results[0].passed
