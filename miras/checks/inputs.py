"""The inputs of the end-to-end checks: small sizes, random inputs with every gate inside its
range, and their heads-first layout with the feature map applied (`miras.checks.end_to_end` for
the one-step rules, `miras.checks.minimizer` for the optimizers that solve exactly)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from miras.ir import BiasRule, Plan
from miras.runtime import per_channel_gates
from miras.runtime.core import Runtime
from miras.runtime.program import Program
from miras.spec import Spec


class Rule(Protocol):
    """What the checks read of a compiled rule, a `miras.MemoryRule`: its IR, the runtime's
    `Program` and pieces, and the facade's call. Named by its shape, not imported: the checks
    sit above the facade, which calls them (`MemoryRule.check`)."""

    spec: Spec
    plan: Plan
    bias: BiasRule
    functions: ModuleType
    program: Program

    @property
    def runtime(self) -> Runtime: ...

    @property
    def gates(self) -> list[str]: ...

    def default_params(self, dtype: torch.dtype = ...) -> dict[str, torch.Tensor]: ...

    def __call__(self, q, k, v, gates=None, **options): ...


DTYPE = torch.float64
# Outputs and final state vs the oracle after T tokens. The oracle's argmin is found to about
# 1e-14 (safeguarded Newton on the slope; for kl also on the row multiplier); a wrong piece is
# off by far more.
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Sizes:
    """One run's inputs: q, k [B, T, H, Dk]; v [B, T, H, Dv]. T covers c - 1 padded tokens
    and a few full windows."""

    batch: int = 1
    length: int = 9
    heads: int = 2
    d_key: int = 4
    d_value: int = 4


def sizes_for(rule: Rule) -> Sizes:
    """Small sizes that still reach past the window (c, or an attention window) by 3 tokens."""
    spec = rule.spec
    reach = spec.memory.lookback(spec) or 1  # the Omega window, or softmax attention's
    return Sizes(length=max(9, reach + 3))


def random_inputs(rule: Rule, sizes: Sizes, seed: int, per_channel: bool = False):
    """q, k with unit rows (as the layer feeds them), v, and every gate inside its range:
    q, k [B, T, H, Dk], v [B, T, H, Dv], gates name -> [B, T, H], or [B, T, H, Dv] with
    `per_channel` for the gates the runtime takes per channel (`per_channel_gates`)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h = sizes.batch, sizes.length, sizes.heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    # Inputs with one entry per optimizer step (DeltaProduct's k, v, lr) are [B, T*n, ...].
    per_step = rule.spec.optimizer.per_step_inputs()
    n = rule.spec.optimizer.steps_per_token()

    def length(name: str) -> int:
        return t * n if name in per_step else t

    q = torch.nn.functional.normalize(randn(b, t, h, sizes.d_key), dim=-1)
    k = torch.nn.functional.normalize(randn(b, length("k"), h, sizes.d_key), dim=-1)
    v = randn(b, length("v"), h, sizes.d_value)
    channels = per_channel_gates(rule)
    gates = {}
    for info in rule.plan.gates:
        width = (sizes.d_value,) if per_channel and info.name in channels else ()
        r = torch.rand(b, length(info.name), h, *width, generator=gen, dtype=DTYPE)
        lo, hi = info.allowed.lo, info.allowed.hi
        ceiling = info.defaults.ceiling  # where a layer keeps the gate (a step size's lr_max)
        if math.isfinite(lo) and math.isfinite(hi):
            gates[info.name] = lo + (hi - lo) * (0.1 + 0.8 * r)  # a decay, a momentum
        elif math.isfinite(lo):
            # A learning rate, a scale, gamma: (lo + 0.1, lo + 1) scaled to a ceiling above 1,
            # so a step size with lr_max 2 is checked up to 2 (the delta rule's eigenvalue -1).
            span = max(1.0, ceiling - lo) if ceiling is not None else 1.0
            gates[info.name] = lo + (0.1 + 0.9 * r) * span
        else:
            gates[info.name] = 2 * r - 1
    return q, k, v, gates


def heads_first(rule: Rule, q, k, v, gates):
    """[B, T, H, D] -> [B, H, T, D]; phi applied to q and k; gates [B, H, T, X], X = 1 (per
    head) or Dv (per channel)."""
    rt = rule.runtime
    params = rule.default_params(DTYPE)
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))
    gates_ = {n: (g if g.dim() == 4 else g.unsqueeze(-1)).transpose(1, 2) for n, g in gates.items()}
    return rt.feature(q_, params), rt.feature(k_, params), v_, gates_
