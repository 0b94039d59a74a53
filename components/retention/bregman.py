"""Bregman retention with a potential written as a formula."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import field_validator, model_validator

from miras.components.base import Range, Retention, number

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp

BINARY_ENTROPY = "w*log(w) + (1 - w)*log(1 - w)"


def potential_domain(potential: sp.Expr) -> str:
    """The domain of F inferred from its terms: every log(g) and non-integer power g**p needs
    g(w) > 0, and the domain is where all of them hold. It must be one of the intervals below;
    e.g. log(w) and log(1 - w) (binary entropy) give "unit_interval"."""
    import sympy as sp
    from sympy.solvers.inequalities import solve_univariate_inequality

    from miras.derive.symbols import w

    domains = {  # the state domains a potential may have, as intervals of w
        "real": sp.S.Reals,
        "positive": sp.Interval.open(0, sp.oo),
        "unit_interval": sp.Interval.open(0, 1),
    }
    arguments = [f.args[0] for f in potential.atoms(sp.log)]
    arguments += [p.base for p in potential.atoms(sp.Pow) if not p.exp.is_integer]
    domain = sp.S.Reals
    for g in arguments:
        if g.has(w):
            try:
                domain &= solve_univariate_inequality(g > 0, w, relational=False)
            except NotImplementedError:
                raise ValueError(f"cannot tell where {g} > 0 (the domain of F)") from None
    for name, interval in domains.items():
        if domain == interval:
            return name
    raise ValueError(
        f"the domain of F inferred from its log and root terms is {domain}; supported "
        "domains: all reals, w > 0 (log(w)), 0 < w < 1 (log(w) and log(1 - w))"
    )


class BregmanRetention(Retention):
    """Bregman divergence of a convex potential F(w) as the retention (mirror descent).

    Equation: W_t = (F')^(-1)(F'(W_{t-1}) - u_t); binary entropy F gives the sigmoid   (MIRAS eq. 22)
    """

    kind: Literal["bregman"] = "bregman"
    potential: str = BINARY_ENTROPY  # F(w), a formula in `w`
    # closed_form: sympy must invert F'; newton: if it cannot, safeguarded Newton on F'(w) = z
    # (bracketed, bisecting where a step leaves the bracket), iterated until it converges.
    solver: Literal["closed_form", "newton"] = "closed_form"
    # The most Newton/bisection iterations per step; the solve stops earlier once converged.
    newton_steps: number(Range(1, 1000, lo_closed=True, hi_closed=True), integer=True) = 100

    @field_validator("potential")
    @classmethod
    def _parse(cls, text: str) -> str:
        from miras.derive.formula import parse_formula
        from miras.derive.symbols import w

        # A FormulaError is a ValueError: pydantic reports it at `retention.potential`.
        potential = parse_formula(text, {"w": w})
        if not potential.has(w):
            raise ValueError(f"the potential F(w) = {text!r} does not depend on w")
        potential_domain(potential)  # a ValueError if the domain is not a supported one
        return text

    @model_validator(mode="after")
    def _derivable(self) -> BregmanRetention:
        """Refuse here what `miras derive` refuses: a potential that is not strictly convex, whose
        F' does not run from -oo to oo, or (closed_form) that sympy cannot invert. The default
        potential is derived by the shipped specs' golden copies and is not derived again."""
        if self.potential != BINARY_ENTROPY or self.solver != "closed_form":
            from miras.derive.retention_derive import check_derivable  # sympy, no torch

            check_derivable(self)
        return self

    def derive_step(self) -> tuple[list, sp.Expr]:
        """The mirror step (F')^{-1}(F'(w0) - u), with F checked strictly convex and F' onto
        (components/retention/mirror.py)."""
        from miras.components.retention.mirror import mirror_step

        return mirror_step(self)

    def potential_expr(self) -> sp.Expr:
        """F(w) as a sympy expression."""
        from miras.derive.formula import parse_formula
        from miras.derive.symbols import w

        return parse_formula(self.potential, {"w": w})

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) D_F(W, W_{t-1}), with the Bregman divergence
        D_F(w, w0) = F(w) - F(w0) - F'(w0) (w - w0); no G."""
        import sympy as sp

        from miras.derive.symbols import eta, u, w, w0

        F = self.potential_expr()
        slope = sp.diff(F, w).subs(w, w0)
        return u * w + (F - F.subs(w, w0) - slope * (w - w0)) / eta

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """eta = 1: the step size already lives in u_t (the optimizer's lr gate)."""
        import sympy as sp

        from miras.derive.symbols import eta

        return {eta: sp.Integer(1)}

    def domain(self) -> str:
        """Where the state lives: "real", "positive" or "unit_interval" (from F's terms)."""
        return potential_domain(self.potential_expr())

    def solved_by_newton(self) -> bool:
        return self.solver == "newton"

    def update_lines(self, step) -> list:
        """Newton: the step is inverse_slope(z_t) with z_t = F'(W_{t-1}) - u_t; name z_t."""
        if self.solver != "newton":
            return super().update_lines(step)
        import sympy as sp

        from miras.derive.terms import NEWTON_NOTE, Line, Math

        expr = step("W_{t-1}")
        z_t = sp.Symbol("z_t")
        return [
            Line(Math(z_t), Math(expr.args[0]), "(F'(W_{t-1}) - u_t)"),
            Line(Math(sp.Symbol("W_t")), Math(expr.func(z_t)), NEWTON_NOTE),
        ]
