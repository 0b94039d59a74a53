"""Memory architectures at run time: the component's forward M_W(x) and explicit backward
dL/dW, with the compiled rule's activation and its derived derivative.

Parameters are a dict name -> tensor `[*batch, out, in]`; inputs `[*batch, in]`; batch axes
broadcast (`miras.components.base.Memory`). The backward is assembled from derived pieces (the
bias gradient dL/dy arrives as `grad_y`; activation derivatives are emitted by the compiler)
as batched products; it never calls autograd. Tests check it against torch.func.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from miras.components.base import Memory

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class MemoryModel:
    """A memory component joined with the compiled rule's activation functions."""

    memory: Memory
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None
    activation_grad: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shapes(self, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
        return self.memory.parameter_shapes(d_in, d_out)

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return self.memory.forward(params, x, self.activation)[0]

    def backward(self, params: Params, x: torch.Tensor, grad_y: torch.Tensor) -> Params:
        """dL/dW for every parameter, given dL/dy at y = M_W(x)."""
        return self.memory.backward(params, x, grad_y, self.activation, self.activation_grad)
