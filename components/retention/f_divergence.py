"""f-divergence retention: an f-divergence to the previous state, with an entropic global term."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import field_validator, model_validator

from miras.components.base import DECAY_GATE, UNIT, GateDefaults, Range, Retention, gate_or

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp

GENERALIZED_KL = "t*log(t) - t + 1"


def ratio():
    """The generator's variable: the ratio t = W / W_{t-1} of new to previous entry."""
    import sympy as sp

    return sp.Symbol("t", positive=True)


def generator(text: str) -> sp.Expr:
    """f(t) from its formula, checked to generate a divergence: f(1) = 0 (no change costs
    nothing), f'(1) = 0 and f''(1) > 0 (zero at, and curving up around, t = 1)."""
    import sympy as sp

    from miras.derive.formula import parse_formula

    t = ratio()
    f = parse_formula(text, {"t": t})
    if not f.has(t):
        raise ValueError(f"the generator f(t) = {text!r} does not depend on t")
    from miras.derive.formula import bounded_simplify

    for what, value, ok in (
        ("f(1)", f.subs(t, 1), lambda x: x == 0),
        ("f'(1)", sp.diff(f, t).subs(t, 1), lambda x: x == 0),
        ("f''(1)", sp.diff(f, t, 2).subs(t, 1), lambda x: x.is_positive),
    ):
        simplified = bounded_simplify(value)  # None: too large to simplify, kept as it is
        value = value if simplified is None else simplified
        if not ok(value):
            need = "> 0" if what == "f''(1)" else "= 0"
            raise ValueError(
                f"the generator f(t) = {text!r} has {what} = {value}; a divergence needs "
                f"{what} {need} (e.g. t*log(t) - t + 1)"
            )
    return f


class FDivergenceRetention(Retention):
    """f-divergence retention: each positive entry kept near the previous one, entropy forgets.

    The local term is D_f(W, W_{t-1}) = sum W_{t-1} f(W / W_{t-1}) for a generator f (MIRAS
    section 5 generalizes KL retention to f-divergences); the global term is negative entropy,
    and no row constraint is imposed (KL retention's rows sum to c).

    Equation: W_t = argmin_W <u_t, W> + a_t D_f(W, W_{t-1}) + (1 - a_t) sum (W log W - W); f = t log t - t + 1 gives W_t = W_{t-1}^{a_t} exp(-u_t)
    """

    kind: Literal["f_divergence"] = "f_divergence"
    f: str = GENERALIZED_KL  # the generator f(t), a formula in t
    decay: gate_or(UNIT) = "gate"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"decay": DECAY_GATE}
    decay_gate: ClassVar[str | None] = "decay"

    @field_validator("f")
    @classmethod
    def _parse(cls, text: str) -> str:
        generator(text)  # a ValueError (pydantic reports it at `retention.f`)
        return text

    @model_validator(mode="after")
    def _derivable(self) -> FDivergenceRetention:
        """Refuse here what `miras derive` refuses: a generator whose step sympy cannot solve in
        closed form, or solves with a function the torch printer lacks ((t - 1)**2 gives
        LambertW). The default generator is derived by the shipped specs' golden copies."""
        if self.f != GENERALIZED_KL:
            from miras.derive.retention_derive import check_derivable  # sympy, no torch

            check_derivable(self)
        return self

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + (1/eta) W_{t-1} f(W / W_{t-1}) + (1/alpha) (W log W - W)."""
        import sympy as sp

        from miras.derive.symbols import alpha, eta, u, w, w0

        f = generator(self.f)
        return u * w + w0 * f.subs(ratio(), w / w0) / eta + (w * sp.log(w) - w) / alpha

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """As for l2 and KL: 1/eta = a, 1/alpha = 1 - a."""
        from miras.derive.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def domain(self) -> str:
        """Entries are positive: f reads the ratio W / W_{t-1}, and W log W needs W > 0."""
        return "positive"
