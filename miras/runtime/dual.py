"""The dual form for deep memories: reserved (issue 13), not implemented.

A deep (MLP) memory's chunk can be computed in its dual form instead of the chunk-start
gradients of `miras.runtime.chunk`. When it lands, the compiler's `chunk_form` pass records
`form="dual"` in the plan, `exact_chunk.resolve_mode` lets `chunk_mode` select it, and
`miras.runtime.run` sends `mode == "dual"` here, with the signature of `chunk.forward`.
"""

from __future__ import annotations

from miras.runtime.core import Runtime, State, Tokens


def forward(rt: Runtime, seq: Tokens, state: State, chunk_size: int):
    """Would return o [B, H, T, Dv] and the final state, like `chunk.forward`."""
    raise NotImplementedError(
        f"spec '{rt.spec.name}': the dual chunk form is not implemented yet (issue 13); use "
        "chunk_mode='start'"
    )
