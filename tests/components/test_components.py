"""The catalogue and the torch pieces of optimizers and feature maps."""

import math

import pytest
import torch

from miras.components import CATALOGUE, GD, Momentum, Muon, PolynomialMap, TaylorMap
from miras.components.base import Range
from miras.components.optimizer.muon import newton_schulz
from miras.derive.emit import function_source, load_module, module_source


@pytest.mark.parametrize(
    "cls", [c for members in CATALOGUE.values() for c in members.values()], ids=lambda c: c.__name__
)
def test_every_component_documents_its_math(cls):
    assert cls.summary(), f"{cls.__name__} needs a one-line docstring"
    # The whole first sentence or paragraph, not its first docstring line.
    assert cls.summary().endswith((".", ")")), cls.summary()
    assert cls.equation(), f"{cls.__name__} needs an 'Equation:' line in its docstring"
    for name, allowed in cls.gateable.items():
        assert name in cls.model_fields, f"gateable {name} is not a field"
        assert isinstance(allowed, Range) and allowed.lo < allowed.hi, f"{name}: {allowed}"
        default = cls.model_fields[name].default
        assert default == "gate" or default in allowed, f"{name}: {default} not in {allowed}"


def test_catalogue_keys_match_kinds():
    for members in CATALOGUE.values():
        for kind, cls in members.items():
            assert cls.model_fields["kind"].default == kind


@pytest.mark.parametrize("shape", [(8, 8), (5, 12), (12, 5), (2, 3, 16, 9)])
def test_newton_schulz_orthogonalizes(shape):
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(shape, dtype=torch.float64, generator=gen)
    o = newton_schulz(s, steps=5)
    assert o.shape == s.shape
    singular = torch.linalg.svdvals(o)
    # Muon's quintic drives singular values into roughly [0.7, 1.2] in five steps, not to 1.
    assert singular.min() > 0.5 and singular.max() < 1.3
    # The singular vectors are kept: o and s share their polar factor's sign pattern.
    u, _, vh = torch.linalg.svd(s, full_matrices=False)
    polar = u @ vh
    assert (
        torch.nn.functional.cosine_similarity(o.flatten(-2), polar.flatten(-2), dim=-1).min() > 0.95
    )


def test_gd_and_momentum_updates():
    g = torch.randn(3, 4, dtype=torch.float64)
    lr = torch.tensor(0.3, dtype=torch.float64)
    theta = torch.tensor(0.9, dtype=torch.float64)
    u, state = GD().update(g, None, lr)
    torch.testing.assert_close(u, 0.3 * g)
    assert state is None
    _, s1 = Momentum().update(g, None, lr, theta)
    u2, s2 = Momentum().update(2 * g, s1, lr, theta)
    torch.testing.assert_close(u2, 0.9 * 0.3 * g + 0.3 * 2 * g)
    torch.testing.assert_close(u2, s2)
    u3, s3 = Muon().update(g, s1, lr, theta)
    torch.testing.assert_close(s3, 0.9 * s1 + g)  # the raw gradient: lr comes after NS5
    torch.testing.assert_close(u3, 0.3 * newton_schulz(s3, 5))


@pytest.mark.parametrize("d", [1, 3, 8])
def test_taylor_map_kernel_and_dimension(d):
    fm = TaylorMap()
    a, b = torch.randn(2, 5, d, dtype=torch.float64).unbind(0)
    pa, pb = fm.apply(a), fm.apply(b)
    assert pa.shape[-1] == fm.output_dim(d) == math.comb(d + 2, 2)
    dot = (a * b).sum(-1)
    torch.testing.assert_close((pa * pb).sum(-1), 1 + dot + dot**2 / 2)


def test_polynomial_map_matches_its_formula():
    fm = PolynomialMap(degree=3)
    x = torch.randn(4, 6, dtype=torch.float64)
    coefficients = torch.tensor([0.5, -0.2, 0.1], dtype=torch.float64)
    names = [s.name for s in fm.coefficient_symbols()]
    source = function_source("phi", ["x", *names], fm.expression())
    printed = load_module(module_source("test", [source])).phi(x, *coefficients)
    torch.testing.assert_close(fm.apply(x, coefficients), printed)
    torch.testing.assert_close(fm.initial_coefficients(), torch.tensor([1.0, 0.5, 1 / 6]))


def test_fixed_values_and_gates():
    opt = Momentum(lr=0.5)
    assert opt.gates() == ["momentum"]
    assert opt.fixed() == {"lr": 0.5}
