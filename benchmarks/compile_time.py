"""Compile time of every shipped spec: first compile (derive + emit + check) and cached.

    .venv/bin/python benchmarks/compile_time.py [--no-check]

Goals (issue 2): first compile under 2 s per spec on a 2-core CPU, cached under 20 ms.
Each spec is compiled once from a cold in-process cache (sympy's own caches warm up across
specs, as they would in a real session), then 200 more times from the cache (median).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import miras
from miras.compiler import pipeline

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true", help="skip the checks in compile")
    args = parser.parse_args()
    paths = sorted((ROOT / "specs").glob("*.yaml")) + sorted(
        (ROOT / "specs/examples").glob("*.yaml")
    )
    rows = []
    for path in paths:
        spec = miras.load_spec(path)
        pipeline._CACHE.clear()
        start = time.perf_counter()
        miras.compile(spec, checked=not args.no_check)
        first = time.perf_counter() - start
        cached = []
        for _ in range(200):
            start = time.perf_counter()
            miras.compile(spec, checked=not args.no_check)
            cached.append(time.perf_counter() - start)
        rows.append((spec.name, first, statistics.median(cached)))

    print(f"{'spec':24s} {'first compile (s)':>18s} {'cached (ms)':>12s}")
    for name, first, cached in rows:
        print(f"{name:24s} {first:18.3f} {cached * 1e3:12.3f}")
    worst_first = max(r[1] for r in rows)
    worst_cached = max(r[2] for r in rows)
    print(f"\nworst first compile: {worst_first:.3f} s (goal < 2 s)")
    print(f"worst cached compile: {worst_cached * 1e3:.3f} ms (goal < 20 ms)")


if __name__ == "__main__":
    main()
