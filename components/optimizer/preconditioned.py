"""Preconditioned gradient descent: a diagonal preconditioner over the key channels, from a
running sum of the loss's curvature (fla's precond_gated_delta_rule)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miras.components.base import (
    DECAY_GATE,
    NONNEGATIVE,
    POSITIVE,
    STEP_SIZE_GATE,
    UNIT,
    GateDefaults,
    Optimizer,
    Range,
    gate_or,
    number,
)

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)

# Any real number: the preconditioner's center, a log-curvature.
REAL = Range()
# The preconditioner's range x: M lies in (1/x, x), so x > 1 (x = 1 would be plain gd).
ABOVE_ONE = Range(1, math.inf)
WHY = "the preconditioner scales the step per key channel, the columns of W [Dv, Dphi]"


class Preconditioned(Optimizer):
    """Gradient descent with a diagonal preconditioner over the key channels: a running sum
    A_t of the diagonal of the loss's curvature in W's columns (the key factor of the
    Gauss-Newton matrix, s phi(k_t)^2 with s = d2L/dy^2), squashed into a bounded inverse power.

    Equation: A_t = a'_t A_{t-1} + b'_t s phi(k_t)^2,  M_t = x^(-r_t / (1 + |r_t|)), r_t = log(A_t + eps) - c_t,  u_t = b_t g_t diag(M_t)

    fla's `precond_gated_delta_rule` (its ATK state, gates g_atk = log a' and beta_atk = b',
    center log_atk_scale = c) on the l2 bias, where s = 1. M_t is about (A_t e^-c)^(-log x)
    near the center and bounded to (1/x, x): key channels that have seen much curvature take
    smaller steps. The preconditioner reads the keys and its gates, never W, so the runtime
    computes it once for the sequence before any form runs (`miras.runtime.precondition`);
    `update` then takes gd's step with the step size b_t M_t, one per key channel.
    """

    kind: Literal["preconditioned"] = "preconditioned"
    lr: gate_or(NONNEGATIVE) = "gate"
    # a'_t, the decay of the curvature sum (fla's exp(g_atk)).
    precond_decay: gate_or(UNIT) = "gate"
    # b'_t, the weight of the token's curvature in it (fla's beta_atk).
    precond_lr: gate_or(NONNEGATIVE) = "gate"
    # c_t, the log-curvature where M = 1 (fla's log_atk_scale, default -0.2).
    precond_center: gate_or(REAL) = -0.2
    # x: M lies in (1/x, x) (fla's x).
    precond_range: number(ABOVE_ONE) = 1.5
    # eps inside log(A + eps), so an empty sum (A = 0) has a finite log (fla's eps).
    precond_eps: number(POSITIVE) = 1e-6
    gateable: ClassVar[dict[str, Range]] = {
        "lr": NONNEGATIVE,
        "precond_decay": UNIT,
        "precond_lr": NONNEGATIVE,
        "precond_center": REAL,
    }
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "lr": STEP_SIZE_GATE,
        "precond_decay": DECAY_GATE,
        "precond_lr": GateDefaults(start=1.0, probe_values=(0.1, 1.0)),
        "precond_center": GateDefaults(start=-0.2, probe_values=(-0.2,)),
    }
    step_size_gate: ClassVar[str | None] = "lr"
    # Every gate acts on key channels (the preconditioner's state is one number per key channel),
    # so each may come per key channel, [B, T, H, Dphi], and none per value channel.
    key_channel_gates: ClassVar[tuple[str, ...]] = tuple(gateable)
    preconditioned: ClassVar[bool] = True

    def update(self, grad: torch.Tensor, state: torch.Tensor | None, lr: Any, **_: Any):
        """`grad`: [..., Dv, Dphi]; `lr` the preconditioned step size b_t M_t, already made by
        the runtime (`miras.runtime.precondition`), [..., 1, Dphi] per key channel (or one per
        matrix). Returns (u_t, no state)."""
        return lr * grad, None

    def update_expressions(self) -> tuple:
        """u_t = lr_t g_t with lr_t the preconditioned step size b_t M_t (per key channel: the
        runtime's forms read which channel axis it has)."""
        from miras.derive.symbols import g, gate_symbol

        return gate_symbol("lr") * g, None

    def accumulate(self, previous: Any, curvature: Any, precond_decay: Any, precond_lr: Any):
        """A_t = a'_t A_{t-1} + b'_t c_t for one token: `previous`, `curvature` [..., Dphi], the
        gates broadcasting against them. The runtime scans the whole sequence at once; the
        end-to-end check's oracle steps this."""
        return precond_decay * previous + precond_lr * curvature

    def factor(self, accumulated: torch.Tensor, precond_center: Any) -> torch.Tensor:
        """M = x^(-r / (1 + |r|)), r = log(A + eps) - c: the symmetric fast squash of fla's
        precond_gated_delta_rule, strictly inside (1/x, x) and decreasing in A. [..., Dphi]."""
        import torch

        r = torch.log(accumulated + self.precond_eps) - precond_center
        return torch.exp(-math.log(self.precond_range) * (r / (1 + r.abs())))

    def spec_problems(self, spec: Any) -> list:
        """The preconditioner is per column of a matrix memory, its curvature s phi(k)^2 needs
        a bias with a constant slope s >= 0, and it reads one token's loss (c = 1)."""
        from miras.errors import Problem

        if not spec.memory.parametric:
            return []  # softmax attention takes gd only (its own rule says so)
        problems = []
        if not spec.memory.linear:
            problems.append(
                Problem(
                    "optimizer.kind",
                    f"{WHY}; the {spec.memory.kind} memory has no such columns: use memory: "
                    "matrix, or optimizer: gd",
                )
            )
        slope, why = spec.bias.constant_slope()
        if slope is None:
            problems.append(
                Problem(
                    "optimizer.kind",
                    "the preconditioner sums the diagonal of the loss's curvature in W's "
                    "columns, s phi(k)_j^2, which is one number per key channel only for a bias "
                    f"with a constant d2L/dy^2 = s (l2, a custom quadratic): {why}",
                )
            )
        elif slope < 0:
            problems.append(
                Problem(
                    "optimizer.kind",
                    f"the preconditioner's curvature s phi(k)^2 must be >= 0 (log(A + eps) needs "
                    f"A > -eps), but d2L/dy^2 = {slope:g} for {spec.bias.label()}",
                )
            )
        if spec.window.c != 1:
            problems.append(
                Problem(
                    "window.c",
                    "the preconditioner sums each token's own curvature (c = 1); a window of "
                    f"c tokens would count a token's curvature c times, got c = {spec.window.c}; "
                    "use window: 1",
                )
            )
        return problems

    def update_lines(self) -> list:
        import sympy as sp

        from miras.derive.terms import PHI, Call, Juxt, Line, Name, Plus, Power, scalar, sym, times

        curvature = times(
            scalar(self.precond_lr, "precond_lr"),
            sym("s"),
            Power(Call(PHI, (sym("k_t"),)), "2"),
        )
        decayed = times(scalar(self.precond_decay, "precond_decay"), sym("A_{t-1}"))
        center = "precond_center_t" if self.precond_center == "gate" else f"{self.precond_center:g}"
        eps = f"{self.precond_eps:g}"
        r = Name(
            f"log(A_t + {eps}) - ({center})",
            rf"\log\left(A_{{t}} + {eps}\right) - \left({sp.latex(sp.Symbol(center))}\right)",
        )
        diag = Call(Name("diag", r"\operatorname{diag}"), (sym("M_t"),))
        step = times(scalar(self.lr, "lr"), Juxt((sym("g_t"), diag)))
        return [
            Line(sym("A_t"), Plus((decayed, curvature)), "(per key channel; s = d2L/dy^2)"),
            Line(sym("r_t"), r),
            Line(sym("M_t"), Power(Name(f"{self.precond_range:g}"), "(-r_t / (1 + |r_t|))")),
            Line(sym("u_t"), step, "(the step scales W's columns)"),
        ]
