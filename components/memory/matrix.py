"""Matrix memory: the state of linear attention and the delta rule."""

from __future__ import annotations

from typing import Literal

from miras.components.base import Memory


class MatrixMemory(Memory):
    """A matrix W in R^{Dv x Dphi} read as a linear map.

    Equation: M_W(x) = W x
    """

    kind: Literal["matrix"] = "matrix"
    # Initial state W_0: zeros, or every entry 1/Dphi (times KL's row sum), which KL and
    # Bregman retentions need. Unset: chosen from the retention.
    init: Literal["zeros", "uniform"] | None = None

    def parameter_shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        return {"W": (d_out, d_in)}
