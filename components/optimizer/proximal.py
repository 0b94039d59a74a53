"""Proximal (implicit) step: the exact minimizer of one token's loss near W_e (Longhorn)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from miras.components.base import (
    NONNEGATIVE,
    STEP_SIZE_GATE,
    GateDefaults,
    Optimizer,
    Range,
    gate_or,
)

if TYPE_CHECKING:
    import torch  # annotations only; imported where used (loading a spec needs no torch)

WHY = (
    "the proximal step argmin_W l(W; k_t, v_t) + ||W - W_e||^2 / (2 lr_t) is solved in closed form"
)


class Proximal(Optimizer):
    """The implicit step: W_e - u_t minimizes the token's loss plus ||W - W_e||^2 / (2 lr_t).

    Longhorn, Liu et al. 2024, arXiv:2407.14207, eq. 4 and its solution.

    Equation: u_t = W_e - argmin_W [l(W; k_t, v_t) + ||W - W_e||^2 / (2 b_t)] = b_t / (1 + b_t s ||phi(k_t)||^2) g_t

    On a matrix memory with a quadratic bias (d2L/dy^2 = s: l2 gives 1, dot 0) the loss's
    Hessian in W is s phi(k) phi(k)^T per row, and g_t = dL/dy(W_e phi(k)) phi(k)^T lies in its
    eigenspace of eigenvalue s ||phi(k)||^2: the solve (I + b_t H)^(-1) b_t g_t (Sherman-Morrison)
    is the gradient step with the step size b_t / (1 + b_t s ||phi(k_t)||^2), never a d x d
    inverse. With l2 it is the delta rule with that step size, which stays below
    1 / ||phi(k)||^2: the write never overshoots v_t, whatever b_t. With dot (s = 0) it is gd.
    """

    kind: Literal["proximal"] = "proximal"
    lr: gate_or(NONNEGATIVE) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"lr": NONNEGATIVE}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"lr": STEP_SIZE_GATE}
    step_size_gate: ClassVar[str | None] = "lr"
    # After the step size is transformed (`step_size`), the update is gd's u_t = lr_t g_t
    # (`update_expressions`), so the exact and linear chunk forms unroll it as they unroll gd.
    implicit: ClassVar[bool] = True

    def step_size(self, lr: Any, curvature: Any) -> Any:
        """eta_t = lr_t / (1 + lr_t c_t), c_t = gamma_t s ||phi(k_t)||^2 >= 0 (validated:
        s >= 0; gamma_t > 0 the window's weight), so eta_t <= lr_t and eta_t c_t < 1. `lr`
        [..., X], `curvature` [..., 1]."""
        return lr / (1 + lr * curvature)

    def update(
        self, grad: torch.Tensor, state: torch.Tensor | None, lr: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """`grad`: [..., *param]; `lr` the step size eta_t (`step_size`, already applied by the
        runtime), broadcasting against it. Returns (u_t, no state)."""
        return lr * grad, None

    def update_expressions(self) -> tuple:
        """u_t = lr_t g_t, no state, with lr_t the step size `step_size` has already made."""
        from miras.derive.symbols import g, gate_symbol

        return gate_symbol("lr") * g, None

    def update_lines(self) -> list:
        from miras.derive.terms import (
            PHI,
            Call,
            Frac,
            Line,
            Name,
            Norm,
            Plus,
            Power,
            scalar,
            sym,
            times,
        )

        lr = scalar(self.lr, "lr") or Name("1")
        norm = Power(Norm(Call(PHI, (sym("k_t"),)), "2"), "2")
        step = Frac(lr, Plus((Name("1"), times(scalar(self.lr, "lr"), sym("s"), norm))))
        note = "(the proximal step in closed form; s = d2L/dy^2 of the bias, in the plan)"
        return [Line(sym("u_t"), times(step, sym("g_t")), note)]

    def spec_problems(self, spec: Any) -> list[Any]:
        """The closed form needs a matrix memory, one token per step (c = 1) and a bias with a
        constant slope s >= 0; anything else would need a Newton solve per token (with
        implicit gradients for the backward), which miras does not run: refused here."""
        from miras.errors import Problem

        if not spec.memory.parametric:
            return []  # softmax attention takes gd only (its own rule says so)
        newton = "would need a Newton solve per token, which miras does not run"
        problems = []
        if not spec.memory.linear:
            problems.append(
                Problem(
                    "optimizer.kind",
                    f"{WHY} on a matrix memory only (y = W phi(k), linear in W); the "
                    f"{spec.memory.kind} memory {newton}; use memory: matrix, or optimizer: gd",
                )
            )
        if spec.window.c != 1:
            problems.append(
                Problem(
                    "window.c",
                    f"{WHY} for one token's loss (c = 1); a window of c tokens needs a c x c "
                    f"solve per token, got c = {spec.window.c}; use window: 1",
                )
            )
        slope, why = spec.bias.constant_slope()
        if slope is None:
            problems.append(
                Problem(
                    "optimizer.kind",
                    f"{WHY} for a bias whose dL/dy is affine in y with a constant slope (l2, "
                    f"dot, a custom quadratic) only: {why}; any other bias {newton}; use "
                    "optimizer: gd",
                )
            )
        elif slope < 0:
            problems.append(
                Problem(
                    "optimizer.kind",
                    f"{WHY} for a convex bias only: d2L/dy^2 = {slope:g} < 0 for "
                    f"{spec.bias.label()}, so 1 + lr s ||phi(k)||^2 reaches 0 and the "
                    "objective has no minimum",
                )
            )
        return problems
