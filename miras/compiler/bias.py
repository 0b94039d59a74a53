"""Derivation of the attentional bias gradient dL/dy, and its check against autograd.

A bias is `L = G(S_1, ..., S_m)` where each `S_i = sum_j f_i(e_j, y_j, v_j)` is a channel sum
(`ChannelSum`). By the chain rule, per channel j,

    dL/dy_j = sum_i dG/dS_i * df_i/dy (e_j, y_j, v_j),     e = y - v.

When every dG/dS_i is a constant (the usual `L = sum_j f(e_j)`), the gradient is elementwise;
otherwise (a norm term, as in the robust bias) it needs the channel sums S_i first, which the
emitted code computes once per vector. For a memory M_W the gradient in W follows by the chain
rule through M (for a matrix, dL/dW = dL/dy phi(k)^T), assembled by the runtime.
"""

from __future__ import annotations

import sympy as sp
import torch

from miras.check import CheckResult, max_relative_error
from miras.compiler.describe import Line, Math, Name, latex_lines, plain_lines
from miras.compiler.emit import load_module, module_source
from miras.compiler.printer import torch_code
from miras.components.base import Bias
from miras.errors import DerivationError
from miras.ir import BiasRule
from miras.symbols import ChannelSum, channel_gradient, e, v, y


def bias_lines(loss: sp.Expr, sums, gradient: sp.Expr, elementwise: bool) -> list[Line]:
    """L, e, the channel sums the gradient reads, and dL/dy_j, as display lines."""
    lines = [
        Line(Name("L(y, v)", r"\mathcal{L}(y, v)"), Math(loss)),
        Line(Math(e), Name("y - v")),
    ]
    lines += [Line(Math(s), Math(ChannelSum(f))) for s, f in sums]
    form = "elementwise" if elementwise else "needs channel sums"
    name = Name("dL/dy_j", r"\frac{\partial \mathcal{L}}{\partial y_j}")
    lines.append(Line(name, Math(gradient), f"[{form}]"))
    return lines


def _sign_to_abs(expr: sp.Expr) -> sp.Expr:
    """s**n * sign(s) -> s**(n - 1) * |s| for a positive integer n (s * sign(s) = |s|), which
    sympy does not do by itself: the l_p gradient e**2*sign(e) + 2*e*|e| becomes 3*e*|e|. Both
    sides are the same function everywhere, e = 0 included, so nothing is divided."""

    def rewrite(term: sp.Mul) -> sp.Expr:
        factors = list(term.args)
        for sign in [f for f in factors if isinstance(f, sp.sign)]:
            s = sign.args[0]
            for i, f in enumerate(factors):
                base, n = f.as_base_exp()
                if base == s and n.is_integer and n.is_positive:
                    factors[i] = s ** (n - 1) * sp.Abs(s)
                    factors.remove(sign)
                    break
        return sp.Mul(*factors)

    return expr.replace(lambda t: isinstance(t, sp.Mul) and t.has(sp.sign), rewrite)


def _tidy(expr: sp.Expr) -> sp.Expr:
    """The shortest of a few rewritings, refusing any that adds special cases (simplify likes
    to turn e**2*sign(e) into a Piecewise around e = 0)."""
    best = expr
    expanded = sp.expand_mul(expr)
    for candidate in (expanded, _sign_to_abs(expanded), sp.simplify(expr)):
        added_cases = candidate.has(sp.Piecewise) and not expr.has(sp.Piecewise)
        if not added_cases and sp.count_ops(candidate) < sp.count_ops(best):
            best = candidate
    return best


def derive_bias(bias: Bias) -> BiasRule:
    """dL/dy of `bias` by the chain rule through its channel sums."""
    loss = bias.expression()
    sums, outer, gradient = channel_gradient(loss)
    if not sums:
        raise DerivationError(f"bias {bias.kind}: the loss has no channel sum: {loss}")
    stray = outer.free_symbols & {e, y, v}
    if stray:
        raise DerivationError(f"bias {bias.kind}: {sorted(map(str, stray))} outside a channel sum")
    gradient = _tidy(gradient)
    used = tuple((s, f) for s, f in sums if gradient.has(s))
    gates = tuple(bias.gates())
    lines = bias_lines(loss, used, gradient, not used)
    return BiasRule(
        kind=bias.kind,
        loss=loss,
        sums=used,
        gradient=gradient,
        elementwise=not used,
        gates=gates,
        source=_source(loss, used, gradient, gates, bias.fixed()),
        display="\n".join(plain_lines(lines)),
        display_latex=latex_lines(lines),
    )


def _source(loss, sums, gradient, gates, fixed) -> str:
    """bias_loss and bias_grad; fixed parameters become literals."""
    values = {sp.Symbol(n, positive=True): sp.nsimplify(x) for n, x in fixed.items()}
    args = ", ".join(["y", "v", *gates])
    loss_body = torch_code(loss.subs(values))
    lines = [
        f"def bias_loss({args}):",
        '    """L per vector: [..., Dv] -> [..., 1]."""',
        "    e = y - v",
        f"    return torch.zeros_like(e[..., :1]) + {loss_body}",
        "",
        "",
        f"def bias_grad({args}):",
        '    """dL/dy: [..., Dv] -> [..., Dv]."""',
        "    e = y - v",
    ]
    lines += [f"    {s} = {torch_code(ChannelSum(f).subs(values))}" for s, f in sums]
    # zeros_like keeps the output a full tensor when the gradient is constant or misses e.
    lines.append(f"    return torch.zeros_like(e) + {torch_code(gradient.subs(values))}")
    return "\n".join(lines) + "\n"


def sample_gates(bias: Bias, shape: tuple[int, ...], dtype, generator) -> dict[str, torch.Tensor]:
    """Random in-range values for each gate of `bias`, [..., 1] (one per vector)."""
    return {
        name: 0.05 + torch.rand(*shape[:-1], 1, dtype=dtype, generator=generator)
        for name in bias.gates()
    }


def check_bias(
    bias: Bias, rule: BiasRule, *, dtype=torch.float64, seed: int = 0, tolerance: float = 1e-10
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
    (autograd_printed,) = torch.autograd.grad(printed_loss.sum(), y_)
    results = [
        CheckResult(
            "dL/dy derived vs autograd(printed L)",
            max_relative_error(derived, autograd_printed),
            tolerance,
        )
    ]
    try:
        reference = bias.reference_loss(y_, v_, **gates)
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
