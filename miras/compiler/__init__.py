"""The compiler: spec -> named passes -> `CompiledRule` (miras.ir; see `pipeline.py` for the
pass list). `miras.rule` turns that into the callable `MemoryRule`."""
