"""Kernel templates: the text of the chunk kernels, with `$name` slots that
`miras.compiler.triton` fills for one spec (its gates: pointers, loads, arguments and gradient
stores). A slot alone on its line is a block of lines, each indented as the slot is; a slot
inside a line is text. The spec's math reaches the kernels only through the printed functions they call
(`bias_grad`, `bias_vjp`, `retention_step`, `retention_vjp`, `retention_map`,
`retention_read` and their VJPs); its structure through the module's constants (`WINDOW`,
`PAST`, `MOMENTUM`, `RETAINED`, ...).

- `linear`: retention none or l2 with a per-head decay, gd: each chunk is a few masked matmuls
  (the chunk backend's fast path), forward and backward.
- `general`: any matrix-memory spec: the chunk's gradients as matmuls at the chunk-start state,
  then the optimizer and the (possibly nonlinear) retention map token by token, forward and
  backward (the backward recomputes each chunk from its stored start state).
- `exact`: the scan over chunk states of the exact chunk form, forward and backward; no slots
  (the spec reaches it only through tensors prepared in torch), imported as it stands.
- `dual`: the dual form's forward for a two-layer MLP memory; no slots (the spec reaches it
  through its printed `activation`, `activation_grad` and `bias_grad`, and tensors prepared in
  torch); `miras.compiler.triton_dual` emits it.
- `choice`: which template a compiled rule takes (`linear_applies`), read by the compiler's
  Triton pass and the runtime's launcher alike.

docs/kernels.md derives both.
"""
