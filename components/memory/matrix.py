"""Matrix memory: the state of linear attention and the delta rule."""

from __future__ import annotations

from typing import ClassVar, Literal

from miras.components.base import Memory, window_terms


class MatrixMemory(Memory):
    """A matrix W in R^{Dv x Dphi} read as a linear map.

    Equation: M_W(x) = W x
    """

    kind: Literal["matrix"] = "matrix"
    linear: ClassVar[bool] = True
    # Initial state W_0: zeros, or every entry 1/Dphi (times KL's row sum), which KL and
    # Bregman retentions need. Unset: chosen from the retention.
    init: Literal["zeros", "uniform"] | None = None

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        return {"W": (d_out, d_in)}

    def chosen_initial_state(self) -> str | None:
        return self.init

    def forward(self, params: dict, x, activation=None):
        from miras.components.memory.linalg import apply

        return apply(params["W"], x), None

    def backward(self, params: dict, x, grad_y, activation=None, grad=None) -> dict:
        """dL/dW = dL/dy phi(k)^T."""
        from miras.components.memory.linalg import outer

        return {"W": outer(grad_y, x)}

    def initial_weights(self, shape: tuple[int, ...], domain: str, row_sum: float, generator):
        """Zeros; or (`init: uniform`, or a positive domain) row_sum/Dphi per entry, so KL's
        rows sum to its c; 1/2 in the unit interval (binary entropy)."""
        import torch

        uniform = domain == "positive" or self.init == "uniform"
        value = 0.5 if domain == "unit_interval" else row_sum / shape[-1] if uniform else 0.0
        return torch.full(shape, value)

    def update_lines(self, window) -> list:
        """g_t, then its matrix form: the error dL/dy times phi(k)^T."""
        from miras.derive.terms import DL_DY, GRAD_L, PHI, Call, Juxt, Line, Name, Transpose, sym

        window_sum, index = window_terms(window)
        features = Call(PHI, (sym(f"k_{index}"),))
        gradient = Call(GRAD_L, (Call(Name("M_{W_e}"), (features,)), sym(f"v_{index}")))
        error = Call(DL_DY, (Juxt((sym("W_e"), features)), sym(f"v_{index}")))
        return [
            Line(sym("g_t"), window_sum(gradient)),
            Line(None, window_sum(Juxt((error, Transpose(features))))),
        ]
