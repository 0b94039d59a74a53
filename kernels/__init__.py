"""Triton chunk kernels (installed as `miras.kernels`).

- `common/`: the shared `@triton.jit` building blocks (row-block I/O, intra-chunk decay
  matrices, the state maps around a retention step, elementwise math).
- `templates/`: the text of the chunk kernels (`linear`, `general`), forward and backward, with
  slots for a spec's gates; and `exact`, the exact form's scan over chunks, the same for every
  spec.

`miras.compiler.triton` fills the templates and prints the spec's pieces next to them; the
emitted module is cached outside the repository ($MIRAS_CACHE_DIR/triton/) and
`miras kernel SPEC` prints it. docs/kernels.md describes the design.
"""
