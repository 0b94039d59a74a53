"""Tokens per second of `miras train` on one process and on two gloo ranks (torchrun, CPU).

    python benchmarks/distributed.py                 # MQAR, DeltaNet d_model 64, 100 steps
    python benchmarks/distributed.py --steps 200 --ranks 1 2

Each setting is a fresh `miras train` run (one torch thread per rank) with the same global
batch; the figure is the median of the per-step tokens/s the run logs in metrics.jsonl (the
global batch's tokens over the step's time) and the steps' wall time from its evaluations.
Ratios taken in one run of the script; the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(ranks: int, out: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [
        *("train", str(ROOT / "specs" / "deltanet.yaml"), "--task", "mqar"),
        *("--task-option", f"seq_len={args.seq_len}", "--task-option", "num_pairs=16"),
        *("--model", f"d_model={args.d_model}", "--model", "chunk_size=4"),
        *("--steps", str(args.steps), "--batch-size", str(args.batch_size)),
        *("--eval-every", str(args.steps), "--eval-batches", "1", "--log-every", "5"),
        *("--threads", "1", "--no-progress", "--out", str(out)),
    ]
    if ranks == 1:
        launch = [sys.executable, "-m", "miras.cli"]
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        launch += ["-m", "miras.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*launch, *command], check=True, env=env, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if r["split"] == "train"]
    [valid] = [r for r in records if r["split"] == "valid"]
    return {"tokens_per_s": statistics.median(speeds), "seconds": valid["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    args = p.parse_args()
    print(f"cores {os.cpu_count()}, load average before {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for ranks in args.ranks:
            rows.append((ranks, run(ranks, Path(folder) / f"r{ranks}", args)))
    base = rows[0][1]["tokens_per_s"]
    print("| ranks | global batch | tokens/s (median step) | vs first | training seconds |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for ranks, r in rows:
        split = f"{args.batch_size} = {ranks} x {args.batch_size // ranks}"
        speed, ratio = r["tokens_per_s"], r["tokens_per_s"] / base
        print(f"| {ranks} | {split} | {speed:,.0f} | {ratio:.2f} | {r['seconds']:.1f} |")
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
