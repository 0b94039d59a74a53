"""The symbolic layer below the components: sympy analyses of a rule's parts, their printers
and emitters, and the numerics their checks and emitted solves share. Components call into it
while a spec validates, so it imports nothing from `miras.spec` or `miras.compiler`
(docs/architecture.md, "Layers")."""
