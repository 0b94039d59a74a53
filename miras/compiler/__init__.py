"""The compiler: spec -> named passes -> `MemoryRule` (see `pipeline.py` for the pass list)."""
