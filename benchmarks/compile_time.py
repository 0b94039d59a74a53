"""Compile time of every shipped spec: first compile (derive + emit + check) and cached.

    .venv/bin/python benchmarks/compile_time.py [--no-check] [SPEC ...]

Goals (issue 2): first compile under 2 s per spec on a 2-core CPU, cached under 20 ms.
"First" is measured in a fresh Python process per spec (imports done, nothing derived yet,
no emitted module loaded), so no spec profits from another's sympy caches. "Cached" is the
median of 200 repeat compiles of an equal spec in one process (the digest, then a dict hit).

Beside them, in a second fresh process: loading the spec (validation, which may derive), an
unchecked compile, then a checked compile of the same spec (what `miras derive` after a
training run does): its seconds, and the work done from the load on, counted as calls of
`sympy.solve`, of a retention's `derive_step` and of the bias's emission (one per bias
derivation). Counting wraps those functions; it costs microseconds per call.
"""

from __future__ import annotations

import argparse
import json
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
import miras.rule  # the compiler, torch and the runtime: imports are not compile time
spec = miras.load_spec(sys.argv[1])
start = time.perf_counter()
miras.compile(spec, checked=sys.argv[2] == "1")
print(time.perf_counter() - start)
"""

# Counts what is derived from the load on: sympy.solve calls, retention derivations (a
# component's derive_step) and bias derivations (bias_source, called once per derive_bias).
SEQUENCE = """
import functools, json, sys, time
import sympy
import miras
import miras.derive.bias_derive as bias_derive
import miras.rule
from miras.components.base import Retention
from miras.components import CATALOGUE

counts = {"solve": 0, "retention": 0, "bias": 0}

def counting(name, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return wrapped

sympy.solve = counting("solve", sympy.solve)
bias_derive.bias_source = counting("bias", bias_derive.bias_source)
for cls in {Retention, *CATALOGUE["retention"].values()}:
    if "derive_step" in vars(cls):
        cls.derive_step = counting("retention", vars(cls)["derive_step"])
times = []
start = time.perf_counter()
spec = miras.load_spec(sys.argv[1])
times.append(time.perf_counter() - start)
for checked in (False, True):
    start = time.perf_counter()
    miras.compile(spec, checked=checked)
    times.append(time.perf_counter() - start)
print(json.dumps({"times": times, **counts}))
"""


def first_compile(path: Path, checked: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", FIRST, str(path), "1" if checked else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def sequence(path: Path) -> dict:
    """Load, unchecked compile, checked compile in one fresh process: seconds and counts."""
    out = subprocess.run(
        [sys.executable, "-c", SEQUENCE, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    parser.add_argument("specs", nargs="*", type=Path, help="default: specs/, specs/examples/")
    args = parser.parse_args()
    checked = not args.no_check
    paths = args.specs or sorted((ROOT / "specs").glob("*.yaml")) + sorted(
        (ROOT / "specs/examples").glob("*.yaml")
    )
    print(
        f"{'spec':30s} {'first (s)':>9s} {'cached (ms)':>11s} | {'load (s)':>8s} "
        f"{'unchecked (s)':>13s} {'then checked (s)':>16s} {'solve':>5s} {'ret.':>4s} "
        f"{'bias':>4s}"
    )
    rows = []
    for path in paths:
        seq = sequence(path)
        row = (path.stem, first_compile(path, checked), cached_compile(path, checked), seq)
        rows.append(row)
        load, unchecked, then_checked = seq["times"]
        print(
            f"{row[0]:30s} {row[1]:9.3f} {row[2] * 1e3:11.3f} | {load:8.3f} {unchecked:13.3f} "
            f"{then_checked:16.3f} {seq['solve']:5d} {seq['retention']:4d} {seq['bias']:4d}",
            flush=True,
        )
    print(f"\nworst first compile: {max(r[1] for r in rows):.3f} s (goal < 2 s)")
    print(f"worst cached compile: {max(r[2] for r in rows) * 1e3:.3f} ms (goal < 20 ms)")
    print(f"total first compile: {sum(r[1] for r in rows):.2f} s over {len(rows)} specs")


if __name__ == "__main__":
    main()
