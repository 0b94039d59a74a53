"""Which Triton template a compiled rule takes: a fact of the IR that the compiler reads to
emit the kernels (`miras.compiler.triton_kernels`) and the runtime reads to launch them
(`miras.runtime.triton_backend.choose_kernels`). It imports nothing of either."""

from __future__ import annotations


def linear_applies(compiled) -> bool:
    """The linear template: where the compiler recorded the linear chunk-start path
    (`ChunkForm.start_path`: matrix memory, step a w0 - u), with the update u_t = lr_t g_t
    (no momentum). `compiled`: anything with the IR's `plan` and `spec` (a `CompiledRule`, a
    runtime `Program`)."""
    linear = compiled.plan.chunk_form.start_path == "linear"
    return linear and compiled.spec.optimizer.linear_form == "step"
