"""The recurrences' token loops with Python's cycle collector paused (`recurrent.collector_paused`,
"new") against the same loops with the pause replaced by a no-op ("old"), in one process.

    .venv/bin/python benchmarks/recurrent_gc.py [--passes fwd fwd+bwd] [--rounds 9] [--threads 2]

gated_deltanet on `backend="recurrent"`, the roofline's inputs (benchmarks/roofline.py: B 2,
H 4, d 64, float32). Each round runs new then old, each at the short length and then the long
one, so the machine's drift touches both alike. Per variant it prints the medians over the
rounds of the time at each length, of time(long) / time(short), and of the time spent inside
the collector's collections at each length (`gc.callbacks`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import types

import torch
from roofline import ROOT, gate_values, make_inputs

import miras
from miras.runtime import recurrent

# The no-op pause: the decorator's `gc` module seen through a stand-in whose disable does
# nothing, so the loops run exactly as before the pause.
NO_PAUSE = types.SimpleNamespace(isenabled=gc.isenabled, disable=lambda: None, enable=gc.enable)


class CollectionClock:
    """Seconds spent inside the cycle collector's collections since the last `reset`."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.seconds = 0.0


def ab(lengths=(2048, 8192), passes=("fwd",), rounds: int = 9) -> list[dict]:
    """One row per (pass, variant): medians of times, ratios and collection times."""
    rule = miras.compile(ROOT / "specs" / "gated_deltanet.yaml")
    inputs = {}
    for t in lengths:
        q, k, v, gen = make_inputs(t)
        inputs[t] = (q, k, v, gate_values(rule, t, gen))
    clock = CollectionClock()

    def run(t: int, backward: bool) -> tuple[float, float]:
        q, k, v, gates = inputs[t]
        leaves = [x.clone().requires_grad_(backward) for x in (q, k, v)]
        clock.reset()
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            o = rule(*leaves, gates, backend="recurrent")[0]
            if backward:
                o.sum().backward()
        return time.perf_counter() - start, clock.seconds

    short, long = min(lengths), max(lengths)
    rows = []
    try:
        for what in passes:
            backward = what == "fwd+bwd"
            run(short, backward)  # warmup
            found = {v: {"short": [], "long": [], "gc_short": [], "gc_long": []} for v in ("new", "old")}  # fmt: skip
            for _ in range(rounds):
                for variant, module in (("new", gc), ("old", NO_PAUSE)):
                    recurrent.gc = module
                    (a, gc_a), (b, gc_b) = run(short, backward), run(long, backward)
                    for key, value in zip(found[variant], (a, b, gc_a, gc_b), strict=True):
                        found[variant][key].append(value)
            for variant, f in found.items():
                rows.append(dict(
                    what=what, variant=variant, rounds=rounds, short=short, long=long,
                    ms_short=1e3 * statistics.median(f["short"]),
                    ms_long=1e3 * statistics.median(f["long"]),
                    ratio=statistics.median(b / a for a, b in zip(f["short"], f["long"], strict=True)),
                    gc_ms_short=1e3 * statistics.median(f["gc_short"]),
                    gc_ms_long=1e3 * statistics.median(f["gc_long"]),
                ))  # fmt: skip
    finally:
        recurrent.gc = gc
        gc.callbacks.remove(clock._callback)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[2048, 8192])
    parser.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = ab(tuple(args.lengths), tuple(args.passes), args.rounds)
    s, l_ = min(args.lengths), max(args.lengths)
    print(f"| pass | variant | rounds | ms {s} | ms {l_} | time({l_}) / time({s}) "
          f"| in collections {s} | in collections {l_} |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['what']} | {r['variant']} | {r['rounds']} | {r['ms_short']:.0f} "
              f"| {r['ms_long']:.0f} | {r['ratio']:.2f} | {r['gc_ms_short']:.0f} ms "
              f"| {r['gc_ms_long']:.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
