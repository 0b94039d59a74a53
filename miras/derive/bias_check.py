"""Bias pass, verification: the derived dL/dy against autograd of the printed loss and, for a
built-in bias, of its hand-written reference loss.
"""

from __future__ import annotations

import math

import torch

from miras.derive.check import CheckResult, max_relative_error
from miras.derive.emit import load_module, module_source
from miras.derive.protocols import BiasParts
from miras.ir import BiasRule


def sample_gates(
    bias: BiasParts, shape: tuple[int, ...], dtype, generator
) -> dict[str, torch.Tensor]:
    """Random in-range values for each gate of `bias`, [..., 1] (one per vector)."""
    return {
        name: 0.05 + torch.rand(*shape[:-1], 1, dtype=dtype, generator=generator)
        for name in bias.gates()
    }


def check_bias(
    bias: BiasParts, rule: BiasRule, *, dtype=torch.float64, seed: int = 0, tolerance: float = 1e-10
) -> list[CheckResult]:
    """The derived dL/dy against autograd of the printed L and, for built-in biases, of the
    hand-written reference L; and the printed L against the reference."""
    module = load_module(module_source(f"bias {bias.kind}", [rule.source]))
    gen = torch.Generator().manual_seed(seed)
    shape = (6, 3, 7)  # [vectors, heads, Dv]: odd sizes on purpose
    y_ = torch.randn(shape, dtype=dtype, generator=gen, requires_grad=True)
    v_ = torch.randn(shape, dtype=dtype, generator=gen)
    gates = sample_gates(bias, shape, dtype, gen)
    derived = module.bias_grad(y_, v_, *gates.values())

    printed_loss = module.bias_loss(y_, v_, *gates.values())
    overflow = _not_finite(printed_loss, derived, (y_ - v_).detach())
    if overflow is not None:
        return [CheckResult(overflow, math.inf, tolerance)]
    (autograd_printed,) = torch.autograd.grad(printed_loss.sum(), y_)
    results = [
        CheckResult(
            "dL/dy derived vs autograd(printed L)",
            max_relative_error(derived, autograd_printed),
            tolerance,
        )
    ]
    try:
        reference = reference_loss(bias, y_, v_, gates)
    except NotImplementedError:
        return results  # a custom formula has no hand-written oracle
    (autograd_reference,) = torch.autograd.grad(reference.sum(), y_)
    results += [
        CheckResult(
            "dL/dy derived vs autograd(reference L)",
            max_relative_error(derived, autograd_reference),
            tolerance,
        ),
        CheckResult(
            "L printed vs reference L",
            max_relative_error(printed_loss.squeeze(-1), reference),
            tolerance,
        ),
    ]
    return results


# What `Bias.reference_loss` is handed and gives back (docs/architecture.md).
REFERENCE_SHAPES = (
    "reference_loss receives y and v as [..., Dv] and each gate of the bias (a field set to "
    "'gate') as a keyword argument of shape [..., 1], one value per vector, which broadcasts "
    "against y (a fixed field is not passed: the component reads its own value); it returns L "
    "summed over the value axis, [...]"
)


def reference_loss(
    bias: BiasParts, y: torch.Tensor, v: torch.Tensor, gates: dict[str, torch.Tensor]
) -> torch.Tensor:
    """`bias.reference_loss(y, v, **gates)`, held to REFERENCE_SHAPES: a ValueError naming the
    component, the shapes it was given and what it gave back when the call fails on them
    (torch's broadcasting RuntimeError, a TypeError for a keyword it does not take) or its
    result is not [...]. NotImplementedError passes through (no hand-written oracle)."""
    given = ", ".join(f"{n} {list(x.shape)}" for n, x in {"y": y, "v": v, **gates}.items())
    call = f"{bias.label()} ({type(bias).__name__}): reference_loss({given})"
    try:
        loss = bias.reference_loss(y, v, **gates)
    except NotImplementedError:
        raise  # a RuntimeError to Python, but no hand-written oracle rather than a failure
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{call} failed: {err}; {REFERENCE_SHAPES}") from err
    expected = list(y.shape[:-1])
    if not isinstance(loss, torch.Tensor) or list(loss.shape) != expected:
        got = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"{call} returned {got}, expected {expected}; {REFERENCE_SHAPES}")
    return loss


def _not_finite(loss: torch.Tensor, gradient: torch.Tensor, error: torch.Tensor) -> str | None:
    """What is not finite on the check inputs ('L overflows float64 ...'), or None: an inf
    minus an inf is NaN, and a comparison would report only 'error nan'."""
    bad = [(n, t) for n, t in (("L", loss), ("dL/dy", gradient)) if not torch.isfinite(t).all()]
    if not bad:
        return None
    names = " and ".join(n for n, _ in bad)
    what = "overflow" if any(torch.isinf(t).any() for _, t in bad) else "are NaN"
    if len(bad) == 1:
        what = {"overflow": "overflows", "are NaN": "is NaN"}[what]
    return (
        f"{names} {what} in {str(loss.dtype).removeprefix('torch.')} on the check inputs "
        f"(standard normal y and v, |y - v| up to {float(error.abs().max()):.3g})"
    )
