"""Nonparametric memory: softmax attention as the closed-form solution.

The closed-form minimizer of sum_i exp(q . k_i) ||v - v_i||^2 (Nadaraya-Watson), so attention
and SWA are points of the same space as the parametric memories. The rule applies no scaling
to q (docs/architecture.md, the public call); a layer that wants 1/sqrt(d) scales q itself.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from miras.components.base import Memory, Range, number


class NonparametricMemory(Memory):
    """Softmax attention over the whole past, or the last `window` tokens (SWA).

    Equation: M_t(q) = sum_{i <= t} softmax_i(q . k_i) v_i, the Nadaraya-Watson minimizer of sum_i s(q, k_i) ||v - v_i||^2 (MIRAS section 3)
    """

    kind: Literal["nonparametric"] = "nonparametric"
    parametric: ClassVar[bool] = False
    window: number(Range(1, 1 << 20, lo_closed=True, hi_closed=True), integer=True) | None = None

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        return {}

    def whole_step_lines(self, spec) -> list:
        return self.update_lines(spec.window)

    def state_lines(self) -> list[str]:
        window = f"last {self.window}" if self.window else "all"
        return [f"keys and values of the {window} past tokens (a KV cache)"]

    def update_lines(self, window) -> list:
        """The whole step: the closed-form read over the window of past tokens."""
        from miras.derive.terms import SOFTMAX_I, Call, Dot, Juxt, Line, WindowSum, sym

        lo = "1" if not self.window else ("t" if self.window == 1 else f"t-{self.window - 1}")
        weights = Call(SOFTMAX_I, (Dot(sym("q_t"), sym("k_i")),))
        return [
            Line(sym("o_t"), WindowSum(lo, Juxt((weights, sym("v_i"))))),
            Line(None, None, "(the closed-form minimizer of the l2 bias: no inner optimization)"),
        ]

    # The hooks the code outside asks (components/base.py, Memory): attention keeps its keys
    # and values, not weights, and runs in closed form.
    def closed_form(self) -> str:
        return "softmax attention"

    def run_closed_form(self, q, k, v):
        """Causal softmax attention, unscaled; token t sees t - window + 1 .. t.
        q, k [B, H, T, Dk], v [B, H, T, Dv] -> o [B, H, T, Dv]."""
        import torch
        import torch.nn.functional as F

        if self.window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        i = torch.arange(q.shape[2], device=q.device)
        distance = i[:, None] - i[None, :]
        mask = (distance >= 0) & (distance < self.window)  # token t sees t-window+1 .. t
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)

    def reference_closed_form(self, q, k, v):
        """softmax(q k^T + mask) v written out, unscaled; token t sees t - window + 1 .. t.
        q, k [B, T, H, Dk]; v [B, T, H, Dv] -> o [B, T, H, Dv]."""
        import torch

        scores = torch.einsum("bthd,bshd->bhts", q, k)  # [B, H, T, T]
        t = torch.arange(q.shape[1])
        distance = t[:, None] - t[None, :]
        allowed = (distance >= 0) & (distance < (self.window or q.shape[1]))
        scores = scores.masked_fill(~allowed, -math.inf)
        return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v)

    def schedule(self) -> str:
        return "closed form: causal softmax attention (no inner optimization)"

    def feature_width(self, spec: Any, d: int) -> int:
        return d  # attention reads q and k as they are

    def lookback(self, spec: Any) -> int | None:
        return self.window

    def lookback_fields(self, spec: Any) -> dict[str, Any]:
        return {"memory.window": self.window or "the sequence"}

    def oracle_cost(self, spec: Any, length: int) -> tuple[int, int]:
        return 0, length  # one masked matmul: the [T, T] scores of each head, no window terms
