"""Nonparametric memory: softmax attention as the closed-form solution."""

from __future__ import annotations

from typing import ClassVar, Literal

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
        from miras.terms import SOFTMAX_I, Call, Dot, Juxt, Line, WindowSum, sym

        lo = "1" if not self.window else ("t" if self.window == 1 else f"t-{self.window - 1}")
        weights = Call(SOFTMAX_I, (Dot(sym("q_t"), sym("k_i")),))
        return [
            Line(sym("o_t"), WindowSum(lo, Juxt((weights, sym("v_i"))))),
            Line(None, None, "(the closed-form minimizer of the l2 bias: no inner optimization)"),
        ]
