"""The exact minimizer: the whole quadratic objective solved per token (MesaNet)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miras.components.base import POSITIVE, GateDefaults, Optimizer, Range, gate_or

if TYPE_CHECKING:  # the spec by what it offers: miras.spec imports this component
    from miras.derive.protocols import SpecParts


class Exact(Optimizer):
    """The exact minimizer of the decayed, gamma-weighted objective over the Omega window (the
    whole prefix, or the last c tokens) plus a ridge term, instead of one step on it (MesaNet,
    von Oswald et al. 2025, arXiv:2506.05233, with window: global).

    Equation: W_t = argmin_W sum_{i<=t} a_{i+1..t} gamma_i L(W phi(k_i), v_i) + 1/2 sum_j lambda_j ||W_{:,j}||^2 = H_vk (s H_kk + diag(lambda_t))^-1
    """

    kind: Literal["exact"] = "exact"
    # The name of the ridge gate, lambda_t: what the minimizer form and its check read it by.
    ridge_gate: ClassVar[str] = "ridge"
    # lambda_t, the ridge on each key feature j: MesaNet's lamb, one per head and key channel,
    # here a gate [B, T, H] or [B, T, H, Dphi] (per token, as the solve is per token) or a
    # fixed positive number.
    ridge: gate_or(POSITIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"ridge": POSITIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "ridge": GateDefaults(probe_values=(0.001, 0.01, 0.1, 1.0))  # lambda on diag(H_kk)
    }
    # The gates that may vary per key feature (the ridge is added to diag(H_kk)), not per value
    # channel: [B, T, H, Dphi].
    key_channel_gates: ClassVar[tuple[str, ...]] = ("ridge",)
    # The memory's state is the objective's sufficient statistics, not W: the compiler's
    # minimizer form (miras.compiler.minimizer) runs it.
    solves_exactly: ClassVar[bool] = True

    def update(self, grad: Any, state: Any, **gates: Any) -> tuple[Any, Any]:
        raise ValueError(
            "optimizer exact has no per-token update u_t: it solves the whole objective "
            "(miras.runtime.exact_minimizer)"
        )

    def spec_problems(self, spec: SpecParts) -> list:
        """Where the objective is not quadratic in W: a matrix memory, a bias with one
        curvature d2L/dy2 = s (l2: 1, dot: 0), retention none or l2 (the decay of the past
        terms). Any window: the whole prefix (statistics) or the last c tokens (carried)."""
        from miras.errors import Problem

        memory = spec.memory
        if not memory.parametric:
            return []  # softmax attention takes optimizer gd only (nonparametric_is_attention)
        why = "optimizer exact solves the objective in closed form, which needs it quadratic in W"
        problems = []
        if not memory.linear:
            problems.append(
                Problem(
                    "memory.kind",
                    f"{why}: the {memory.kind} memory's prediction is not linear in its "
                    "weights; use memory: matrix",
                )
            )
        # A bias whose curvature is negative is refused by its own validation (not bounded
        # below), so one number s here is s >= 0.
        slope, not_quadratic = spec.bias.constant_slope()
        if slope is None:
            problems.append(Problem("bias.kind", f"{why}: {not_quadratic}"))
        retention = spec.retention
        if not retention.linear_step:
            problems.append(
                Problem(
                    "retention.kind",
                    f"{why}: the {retention.kind} retention is not a decay of the past terms "
                    "(none or l2: each term weighted by the product of the decays since)",
                )
            )
        elif retention.retained_factor() is not None:
            problems.append(
                Problem(
                    "retention.grad_at",
                    "optimizer exact takes no gradient, so there is no gradient point to "
                    "choose; leave grad_at unset (state)",
                )
            )
        return problems

    def update_lines(self) -> list:
        from miras.derive.terms import Line

        return [Line(None, None, "(no update: the objective is solved exactly)")]

    def whole_step_lines(self, spec: SpecParts) -> list:
        """The step t in the sufficient statistics, then W_t, the minimizer, and the read."""
        from miras.derive.terms import (
            PHI,
            Call,
            Juxt,
            Line,
            Name,
            Plus,
            Power,
            Transpose,
            WindowSum,
            sym,
            times,
        )
        from miras.derive.terms import scalar as gate

        decay = getattr(spec.retention, "decay", 1.0)
        a, gamma = gate(decay, "decay"), gate(spec.window.gamma, "gamma")
        k = Call(PHI, (sym("k_t"),))
        kk = times(gamma, Juxt((k, Transpose(k))))
        vk = times(
            gamma,
            Juxt(
                (
                    Name("-dL/dy(0, v_t)", r"-\frac{\partial \mathcal{L}}{\partial y}(0, v_{t})"),
                    Transpose(k),
                )
            ),
        )
        curvature = Plus(
            (
                Juxt((sym("s"), sym("H_kk,t"))),
                Name("diag(ridge_t)", r"\operatorname{diag}(\mathrm{ridge}_{t})"),
            )
        )
        c = spec.window.c
        if c == "global":  # running sums
            sums = [
                Line(sym("H_kk,t"), Plus((times(a, sym("H_kk,t-1")), kk))),
                Line(sym("H_vk,t"), Plus((times(a, sym("H_vk,t-1")), vk))),
            ]
        else:  # the last c tokens, each decayed by the decays after it
            k = Call(PHI, (sym("k_i"),))
            # a_{i+1..t}: the product of the decays after token i (a^(t-i) for a fixed a).
            if decay == "gate":
                after = Name("decay_{i+1..t}", r"\mathrm{decay}_{i+1..t}")
            else:
                after = None if decay == 1 else Name(f"{decay:g}^(t-i)", f"{decay:g}^{{t-i}}")
            weight = times(after, gate(spec.window.gamma, "gamma", "i"))
            lo = "t" if c == 1 else f"t-{c - 1}"
            sums = [
                Line(sym("H_kk,t"), WindowSum(lo, times(weight, Juxt((k, Transpose(k)))))),
                Line(
                    sym("H_vk,t"),
                    WindowSum(
                        lo,
                        times(
                            weight,
                            Juxt(
                                (
                                    Name(
                                        "-dL/dy(0, v_i)",
                                        r"-\frac{\partial \mathcal{L}}{\partial y}(0, v_{i})",
                                    ),
                                    Transpose(k),
                                )
                            ),
                        ),
                    ),
                ),
            ]
        return [
            *sums,
            Line(sym("W_t"), Juxt((sym("H_vk,t"), Power(curvature, "-1")))),
            Line(
                None,
                None,
                "(the exact minimizer, s = d2L/dy2; the read solves by Cholesky, W_t never formed)",
            ),
            Line(sym("o_t"), Call(Name("M_{W_t}"), (Call(PHI, (sym("q_t"),)),))),
        ]
