"""benchmarks/recurrent_gc.py: the A/B of the token loops' collector pause runs both variants
and leaves the process as it found it."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

from miras.runtime import recurrent

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports roofline beside it
    try:
        spec = importlib.util.spec_from_file_location(
            "recurrent_gc", BENCHMARKS / "recurrent_gc.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_both_variants_run_and_the_collector_comes_back():
    bench = load()
    callbacks = list(gc.callbacks)
    rows = bench.ab(lengths=(8, 16), passes=("fwd", "fwd+bwd"), rounds=2)
    assert [(r["what"], r["variant"]) for r in rows] == [
        ("fwd", "new"), ("fwd", "old"), ("fwd+bwd", "new"), ("fwd+bwd", "old"),
    ]  # fmt: skip
    for r in rows:
        assert r["ms_short"] > 0 and r["ms_long"] > 0 and r["ratio"] > 0 and r["rounds"] == 2
        assert r["gc_ms_short"] >= 0 and r["gc_ms_long"] >= 0
    assert recurrent.gc is gc and gc.callbacks == callbacks and gc.isenabled()


def test_the_old_variant_does_not_pause():
    """The stand-in's disable is a no-op: the loop under it runs with the collector on."""
    bench = load()
    recurrent.gc = bench.NO_PAUSE
    try:
        seen = []

        @recurrent.collector_paused()
        def loop():
            seen.append(gc.isenabled())

        loop()
    finally:
        recurrent.gc = gc
    assert seen == [True]
