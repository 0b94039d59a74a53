"""The compiler: spec -> named passes -> `CompiledRule` (miras.ir; see `pipeline.py` for the
pass list). `miras.rule` turns that into the callable `MemoryRule`. It sits above `miras.spec`
(its passes read a `Spec`); the analyses, printers and piece checks the passes call, which the
components call too, are below the components, in `miras.derive`."""
