"""The checks above the facade: a compiled rule run end to end on every backend against an
autograd oracle (`end_to_end`, with the random inputs it draws in `inputs` and the exact
optimizer's minimizer oracle in `minimizer`), and the compile-only GPU checks of the emitted
kernels (`gpu_compile`). They call the `MemoryRule` they are handed (`rule.check()` calls
`end_to_end`) and the runtime; the piece checks of a derivation live below, in `miras.derive`
(docs/architecture.md, "The layers")."""
