"""Whether a spec's chunk-start form is the dual form (`miras.runtime.dual`), a question the
pipeline's chunk_form pass and the dual Triton kernel's coverage (`miras.compiler.triton_dual`)
both ask: its own module, so neither imports the other."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from miras.ir import LinearStep
    from miras.spec import Spec


def dual_reason(spec: Spec, step: LinearStep | None = None) -> str | None:
    """Why the chunk-start form of `spec` runs in its dual form (`miras.runtime.dual`), or
    None: a memory that writes its per-weight gradient factors (`Memory.has_gradient_factors`:
    each token's gradient of a weight matrix is the outer product of the backpropagated error
    and the layer's input), a linear step (`step`, the compiler's `LinearStep`: retention none
    or l2 and a linear optimizer, so each token's weights are a masked sum of the gradients),
    and a finite window (a global one would keep O(T^2) error vectors for the backward)."""
    memory, retention, optimizer = spec.memory, spec.retention, spec.optimizer
    if not memory.has_gradient_factors():
        return None
    if step is None or spec.window.is_global:
        return None
    return (
        f"the {memory.kind} memory's gradient is a product of per-token factors, and retention "
        f"{retention.kind} and optimizer {optimizer.kind} are linear in it"
    )


__all__ = ["dual_reason"]
