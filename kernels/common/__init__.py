"""Shared building blocks of the emitted chunk kernels (STYLE item 1: shared chunk steps live
once, here). Every function is a `@triton.jit` helper the templates in `miras.kernels.templates`
call; none depends on a spec.

- `io`: row blocks of a [rows, width] tensor: masked loads, read-modify-write adds, zero fill.
- `intra`: the intra-chunk pieces of the linear path: decay matrices, reversed cumulative sums.
- `state`: the state maps around a retention step: KL's row softmax and l_q's normalized read,
  with their vector-Jacobian products.
- `math`: elementwise functions `triton.language` lacks, for the printer's output.
"""
