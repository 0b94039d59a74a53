"""The symbolic layer below the components: sympy analyses of a rule's parts (the chunk form,
the linear-step proof, the bias and retention derivations), their printers and emitters, the
checks of each derived piece, and the numerics their checks and emitted solves share; with its
leaves, the vocabularies (`symbols`, `formula`, `terms`, `ranges`), `check` and `protocols`.
Components call into it while a spec validates, so it imports nothing from the components,
`miras.spec` or `miras.compiler`, not even for annotations: it names them by the Protocols of
`protocols` (docs/architecture.md, "The layers")."""
