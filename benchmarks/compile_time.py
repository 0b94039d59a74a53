"""Compile time of every shipped spec: first compile (derive + emit + check) and cached.

    .venv/bin/python benchmarks/compile_time.py [--no-check]

Goals (issue 2): first compile under 2 s per spec on a 2-core CPU, cached under 20 ms.
"First" is measured in a fresh Python process per spec (imports done, nothing derived yet,
no emitted module loaded), so no spec profits from another's sympy caches. "Cached" is the
median of 200 repeat compiles of an equal spec in one process (the digest, then a dict hit).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import miras

ROOT = Path(__file__).resolve().parent.parent

FIRST = """
import sys, time
import miras
spec = miras.load_spec(sys.argv[1])
start = time.perf_counter()
miras.compile(spec, checked=sys.argv[2] == "1")
print(time.perf_counter() - start)
"""


def first_compile(path: Path, checked: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", FIRST, str(path), "1" if checked else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def cached_compile(path: Path, checked: bool) -> float:
    spec = miras.load_spec(path)
    miras.compile(spec, checked=checked)
    times = []
    for _ in range(200):
        again = miras.load_spec(spec.to_yaml())  # an equal spec, not the same object
        start = time.perf_counter()
        miras.compile(again, checked=checked)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true", help="skip the checks in compile")
    args = parser.parse_args()
    checked = not args.no_check
    paths = sorted((ROOT / "specs").glob("*.yaml")) + sorted(
        (ROOT / "specs/examples").glob("*.yaml")
    )
    print(f"{'spec':24s} {'first compile (s)':>18s} {'cached (ms)':>12s}")
    rows = []
    for path in paths:
        row = (path.stem, first_compile(path, checked), cached_compile(path, checked))
        rows.append(row)
        print(f"{row[0]:24s} {row[1]:18.3f} {row[2] * 1e3:12.3f}", flush=True)
    print(f"\nworst first compile: {max(r[1] for r in rows):.3f} s (goal < 2 s)")
    print(f"worst cached compile: {max(r[2] for r in rows) * 1e3:.3f} ms (goal < 20 ms)")


if __name__ == "__main__":
    main()
