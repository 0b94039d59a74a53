"""What every backend shares: the compiled pieces of a rule, its state and its gates.

Layout inside the backends: tokens on axis 2, `[B, H, T, D]`; a gate is `[B, H, T, X]` with
X = 1 (per head) or Dv (per channel). Memory state is a dict name -> `[B, H, out, in]`, plus
`S.<name>` for the momentum of momentum and Muon.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from miras.runtime.memory import MemoryModel, Params
from miras.spec import Spec

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Tokens:
    """One sequence, heads first. The window's terms read `past` = c - 1 earlier tokens, carried
    in the state, so keys, values and the gates of the bias and of gamma come with them.

    phi_q [B, H, T, Dphi]; phi_k [B, H, P+T, Dphi]; v [B, H, P+T, Dv]; valid [B, H, P+T, 1]
    (0 where no earlier token exists); step_gates (optimizer, retention) [B, H, T, X];
    window_gates (bias, gamma) [B, H, P+T, X]. Token t's window is i = t + P - j, j < c."""

    phi_q: torch.Tensor
    phi_k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    step_gates: dict[str, torch.Tensor]
    window_gates: dict[str, torch.Tensor]
    past: int

    @property
    def length(self) -> int:
        return self.phi_q.shape[2]


@dataclass(frozen=True)
class Runtime:
    """The pieces a backend calls, from one compiled spec."""

    spec: Spec
    memory: MemoryModel
    functions: ModuleType  # the emitted module: bias_grad, retention_step, retention_read, ...

    # Gate names by where they act, in the order the emitted functions take them.
    @property
    def bias_gates(self) -> list[str]:
        return self.spec.bias.gates()

    @property
    def retention_gates(self) -> list[str]:
        return self.spec.retention.gates()

    @property
    def has_momentum(self) -> bool:
        return self.spec.optimizer.kind in ("momentum", "muon")

    @property
    def retained_gradient(self) -> bool:
        return getattr(self.spec.retention, "grad_at", "state") == "retained"

    @property
    def window_gate_names(self) -> list[str]:
        """Gates read by the window's terms at their own token: the bias's, and gamma."""
        return self.bias_gates + self.spec.window.gates()

    def scalar(
        self, component, name: str, gates: dict[str, torch.Tensor], t
    ) -> torch.Tensor | float:
        """A gate at token(s) t ([B, H, X] or [B, H, n, X]), or the spec's fixed value."""
        value = getattr(component, name)
        return value if value != "gate" else gates[name][:, :, t]

    # The feature map ------------------------------------------------------------------------
    def feature(self, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        fm = self.spec.feature_map
        if fm.kind == "polynomial":
            return fm.apply(x, params["feature_map"])
        if fm.kind == "custom":
            return self.functions.feature_map(x)
        return fm.apply(x)

    # State ----------------------------------------------------------------------------------
    def shapes(self, d_phi: int, d_v: int) -> dict[str, tuple[int, ...]]:
        return self.memory.shapes(d_phi, d_v)

    def initial_state(
        self, batch: int, heads: int, d_phi: int, d_v: int, dtype, device, seed: int = 0
    ) -> State:
        """The default W_0, inside the retention's domain. A matrix memory starts at zeros, or
        (`init: uniform`, or a positive domain) at c/Dphi per entry, so KL's rows sum to its
        c; at 1/2 in the unit interval (binary entropy). An MLP starts at a seeded random
        draw mapped into the domain. Momentum starts at zero."""
        domain = self.spec.retention.domain()
        uniform = domain == "positive" or getattr(self.spec.memory, "init", None) == "uniform"
        scale = getattr(self.spec.retention, "scale", 1.0)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        state: State = {}
        for name, (d_out, d_in) in self.shapes(d_phi, d_v).items():
            shape = (batch, heads, d_out, d_in)
            if self.spec.memory.kind == "matrix":
                value = 0.5 if domain == "unit_interval" else scale / d_in if uniform else 0.0
                w = torch.full(shape, value)
            else:
                draw = torch.randn(shape, generator=gen, dtype=torch.float64)
                if domain == "unit_interval":
                    w = torch.sigmoid(draw)
                elif domain == "positive":
                    w = scale * torch.softmax(draw, -1)
                else:
                    w = draw / d_in**0.5
            state[name] = w.to(dtype=dtype, device=device)
        if self.has_momentum:
            state.update({f"S.{n}": torch.zeros_like(w) for n, w in list(state.items())})
        return state

    @property
    def param_names(self) -> list[str]:
        return list(self.shapes(1, 1))

    def weights(self, state: State) -> Params:
        """The memory's parameters as reads and gradients see them (lq's normalization)."""
        return {name: self.functions.retention_read(state[name]) for name in self.param_names}


def as_param_gate(g: torch.Tensor | float) -> torch.Tensor | float:
    """A gate [.., X] scales rows of a parameter [.., out, in]: -> [.., X, 1]."""
    return g.unsqueeze(-1) if isinstance(g, torch.Tensor) else g
