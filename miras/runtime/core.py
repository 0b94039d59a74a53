"""What every backend shares: the compiled pieces of a rule, its state and its gates.

Layout inside the backends: tokens on axis 2, `[B, H, T, D]`; a gate is `[B, H, T, X]` with
X = 1 (per head) or Dv (per channel), or Dphi for a gate per key channel. Memory state is a
dict name -> `[B, H, out, in]`, plus `S.<name>` for the momentum of momentum and Muon and
`P.<name>` `[B, H, 1, in]` for the preconditioned optimizer's curvature sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from miras.ir import LinearStep
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
    # How the chunk-start form runs, as the compiler recorded it (`ChunkForm.start_path`):
    # "linear" (`miras.runtime.linear`) or "general" (`miras.runtime.chunk`).
    start_path: str
    # The step as the compiler proved it linear (`miras.ir.LinearStep`), read by every fast
    # form (`miras.runtime.unroll`); None where it is not.
    linear_step: LinearStep | None = None

    # Gate names by where they act, in the order the emitted functions take them.
    @property
    def bias_gates(self) -> list[str]:
        return self.spec.bias.gates()

    @property
    def retention_gates(self) -> list[str]:
        return self.spec.retention.gates()

    @property
    def has_momentum(self) -> bool:
        """The optimizer carries a state s_t per parameter, kept as "S.<name>"."""
        return self.spec.optimizer.stateful

    @property
    def retained_gradient(self) -> bool:
        return self.spec.retention.retained_factor() is not None

    def gradient_point(self, weights: Params, gates: dict[str, torch.Tensor], t, like=None):
        """W_e: the weights the bias gradient is taken at, W_{t-1} or a_t W_{t-1} (the
        retention's `retained_factor`). `t`: a token, or a chunk's slice of tokens: then the
        factor is the product a_s ... a_t from the chunk's start (the chunk-start form),
        `weights` are [B, H, 1, out, in] and `like` [B, H, n, .] is the chunk's queries."""
        factor = self.spec.retention.retained_factor()
        if factor is None:
            return weights
        if isinstance(t, slice):
            value = torch.cumprod(gate_values(self.spec.retention, factor, gates, t, like), dim=2)
        else:
            value = self.scalar(self.spec.retention, factor, gates, t)
        decay = self.param_gate(factor, value)
        return {n: decay * w for n, w in weights.items()}

    @property
    def key_gates(self) -> set[str]:
        """The gates the retention and the optimizer declare per key channel
        (`key_channel_gates`): a decay per column of W (KDA), a step size per column (the
        preconditioned optimizer's)."""
        spec = self.spec
        return {*spec.retention.key_channel_gates, *spec.optimizer.key_channel_gates}

    def param_gate(self, name: str, g: torch.Tensor | float) -> torch.Tensor | float:
        """Gate `name` of the retention or the optimizer at a token or a chunk's tokens
        ([.., X]) shaped to scale a parameter [.., out, in]: by rows ([.., X, 1]), or by
        columns ([.., 1, X]) for a gate per key channel (`key_gates`; X = 1 is the same either
        way)."""
        if isinstance(g, torch.Tensor) and name in self.key_gates:
            return g.unsqueeze(-2)
        return as_param_gate(g)

    def optimizer_step(self, grads: Params, state: State, gates: dict, t) -> Params:
        """u_t for every parameter from g_t (the optimizer component's `update`); the
        optimizer's states "S.<name>" are updated in `state`."""
        opt = self.spec.optimizer
        values = {n: self.param_gate(n, self.scalar(opt, n, gates, t)) for n in opt.gateable}
        updates = {}
        for n, g in grads.items():
            u, s = opt.update(g, state.get(f"S.{n}"), **values)
            if opt.stateful:
                state[f"S.{n}"] = s
            updates[n] = u
        return updates

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
        return self.spec.feature_map.phi(x, params, self.functions)

    # State ----------------------------------------------------------------------------------
    def shapes(self, d_phi: int, d_v: int) -> dict[str, tuple[int, ...]]:
        return self.memory.shapes(d_phi, d_v)

    def initial_state(
        self, batch: int, heads: int, d_phi: int, d_v: int, dtype, device, seed: int = 0
    ) -> State:
        """The default W_0, inside the retention's domain (the memory component's
        `initial_weights`; a seeded draw for a deep memory). The optimizer's state starts at
        zero."""
        retention = self.spec.retention
        domain, row_sum = retention.domain(), retention.row_sum()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        state: State = {}
        for name, (d_out, d_in) in self.shapes(d_phi, d_v).items():
            shape = (batch, heads, d_out, d_in)
            w = self.spec.memory.initial_weights(shape, domain, row_sum, gen)
            state[name] = w.to(dtype=dtype, device=device)
        weights = dict(state)
        if self.has_momentum:
            state.update({f"S.{n}": torch.zeros_like(w) for n, w in list(state.items())})
        if self.spec.optimizer.preconditioned:  # the curvature sum A per key channel: [B, H, 1, in]
            state.update({f"P.{n}": torch.zeros_like(w[..., :1, :]) for n, w in weights.items()})
        return state

    @property
    def param_names(self) -> list[str]:
        return list(self.shapes(1, 1))

    def weights(self, state: State) -> Params:
        """The memory's parameters as reads and gradients see them (lq's normalization)."""
        return {name: self.functions.retention_read(state[name]) for name in self.param_names}


def gate_values(component, name: str, gates, sl: slice, like: torch.Tensor) -> torch.Tensor:
    """A gate over tokens `sl` [B, H, n, X], or its fixed value broadcast the same way;
    `like` [B, H, n, .] (the same tokens) gives the shape."""
    value = getattr(component, name)
    if value != "gate":
        return torch.full_like(like[..., :1], float(value))
    return gates[name][:, :, sl]


def as_param_gate(g: torch.Tensor | float) -> torch.Tensor | float:
    """A gate [.., X] scales rows of a parameter [.., out, in]: -> [.., X, 1]."""
    return g.unsqueeze(-1) if isinstance(g, torch.Tensor) else g
