"""Local and global l2 retention: the decay / forget gate (RetNet, Gated DeltaNet, Titans)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import SerializerFunctionWrapHandler, model_serializer

from miras.components.base import DECAY_GATE, UNIT, GateDefaults, Range, Retention, gate_or

if TYPE_CHECKING:  # annotations only: sympy is imported where used (components/base.py)
    import sympy as sp


class L2Retention(Retention):
    """Local l2 (stay near W_{t-1}) plus global l2 (stay small): a decay a_t on the state.

    Equation: W_t = argmin_W <u_t, W> + 1/(2 eta_t) ||W - W_{t-1}||^2 + 1/(2 alpha_t) ||W||^2 = a_t W_{t-1} - u_t   (MIRAS eq. 16)
    """

    kind: Literal["l2"] = "l2"
    decay: gate_or(UNIT) = "gate"
    # Where the bias gradient is taken: at W_{t-1} (MIRAS, Titans) or at the retained state
    # a_t W_{t-1} (the Gated DeltaNet order).
    grad_at: Literal["state", "retained"] = "state"
    # The channel axis a decay gate may carry besides the head: "value", [B, T, H, Dv] (one
    # decay per row of W [Dv, Dphi]), or "key", [B, T, H, Dphi] (one per column: KDA's decay
    # per key channel). Per head, [B, T, H], either way. Declared, not read off the shape,
    # since Dv = Dk would make the shape ambiguous.
    decay_channels: Literal["value", "key"] = "value"
    gateable: ClassVar[dict[str, Range]] = {"decay": UNIT}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {"decay": DECAY_GATE}
    linear_step: ClassVar[bool] = True
    decay_gate: ClassVar[str | None] = "decay"

    def objective(self) -> sp.Expr:
        """One entry of <u, W> + 1/(2 eta) ||W - W_{t-1}||^2 + 1/(2 alpha) ||W||^2."""
        from miras.derive.symbols import alpha, eta, u, w, w0

        return u * w + (w - w0) ** 2 / (2 * eta) + w**2 / (2 * alpha)

    def reparameterization(self) -> dict[sp.Symbol, sp.Expr]:
        """1/eta = a and 1/alpha = 1 - a: the curvature 1/eta + 1/alpha is 1, so u_t enters
        unscaled and a_t multiplies W_{t-1}. At a = 1 the global term vanishes (1/alpha = 0)."""
        from miras.derive.symbols import alpha, eta, gate_symbol

        a = gate_symbol("decay")
        return {eta: 1 / a, alpha: 1 / (1 - a)}

    def retained_factor(self) -> str | None:
        return "decay" if self.grad_at == "retained" else None

    @model_serializer(mode="wrap")
    def _long_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The long form leaves out `decay_channels: value`, so a spec without a per-key decay
        keeps the digest it had before the field existed (compile caches, stored studies)."""
        data = handler(self)
        if data.get("decay_channels") == "value":
            data.pop("decay_channels")
        return data

    @property
    def key_channel_gates(self) -> tuple[str, ...]:  # type: ignore[override]
        """("decay",) with `decay_channels: key` and the decay a gate: it then scales the
        columns of W, one decay per key feature."""
        return ("decay",) if self.decay_channels == "key" and self.decay == "gate" else ()

    def spec_problems(self, spec: Any) -> list:
        """A decay per key channel scales the columns of a matrix memory W [Dv, Dphi]: it
        needs that memory, and a gate to vary."""
        from miras.errors import Problem

        if self.decay_channels != "key":
            return []
        why = "decay_channels: key gives one decay per column of a matrix memory W [Dv, Dphi]"
        problems = []
        if not spec.memory.linear or not spec.memory.parametric:
            problems.append(
                Problem("retention.decay_channels", f"{why}; memory {spec.memory.kind!r} has none")
            )
        if self.decay != "gate":
            problems.append(
                Problem(
                    "retention.decay_channels",
                    f"{why}; a fixed decay ({self.decay}) is one number for every channel: "
                    "set decay: gate or drop decay_channels",
                )
            )
        return problems
