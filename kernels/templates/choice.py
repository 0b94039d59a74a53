"""Which Triton template a compiled rule takes: a fact of the IR that the compiler reads to
emit the kernels (`miras.compiler.triton_kernels`) and the runtime reads to launch them
(`miras.runtime.triton_backend.choose_kernels`). It imports nothing of either."""

from __future__ import annotations


def linear_applies(compiled) -> bool:
    """The linear template: where the compiler recorded the linear chunk-start path
    (`ChunkForm.start_path`: matrix memory, step a w0 - u), with the update u_t = b_t g_t, b_t
    one gate (fixed or per token) and no optimizer state (`plan.linear_step`). `compiled`:
    anything with the IR's `plan` (a `CompiledRule`, a runtime `Program`)."""
    step = compiled.plan.linear_step
    if compiled.plan.chunk_form.start_path != "linear" or step is None or step.stateful:
        return False
    size = step.from_gradient
    return size.constant == 1.0 and len(size.gates) == 1
