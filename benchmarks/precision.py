"""bf16 against float32 training: step time and accuracy on a short MQAR run.

    python benchmarks/precision.py                      # 800 steps of DeltaNet d_model 32
    python benchmarks/precision.py --steps 400 --spec specs/gated_deltanet.yaml

Both runs in this process, one after the other, with the same seed, data and settings: MQAR
with 2 pairs in 16 tokens, vocabulary 32 (small enough to be learnt in a few hundred steps:
float32 passed 0.9 by step 300 in a trial run), d_model 32, 2 layers of 2 heads, chunk 4, batch 32, AdamW lr
1e-2. `--precision bf16` autocasts the projections, the memory rule stays float32. Step time
is the run's wall time over its steps (its evaluations, 16 batches every 100 steps, included:
the same work in both); accuracy is printed at each evaluation, loss at the last, the load
average beside them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import miras
from miras.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spec", type=Path, default=ROOT / "specs" / "deltanet.yaml")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    spec = miras.load_spec(args.spec).normalized()
    spec["model"] = {**spec["model"], "d_model": args.d_model, "n_heads": 2, "chunk_size": 4}
    task = make_task("mqar", seq_len=16, num_pairs=2, vocab_size=32)
    settings = dict(steps=args.steps, batch_size=32, lr=1e-2, warmup=30, weight_decay=0.0)
    settings["seed"] = args.seed
    print(f"{args.spec.name}, seed {args.seed}, load average before {os.getloadavg()}", flush=True)
    rows = []
    for precision in ("fp32", "bf16"):
        result = miras.train(
            spec, task, **settings, eval_every=100, eval_batches=16, progress=False,
            precision=precision,
        )  # fmt: skip
        seconds = result.history[-1]["seconds"]  # the steps and the evaluations
        rows.append((precision, 1000 * seconds / args.steps, result.history))
    base = rows[0][1]
    steps = " | ".join(str(h["step"]) for h in rows[0][2])
    print(f"| precision | ms per step | vs fp32 | accuracy at step {steps} | final loss |")
    print("| --- | ---: | ---: | " + "---: | " * len(rows[0][2]) + "---: |")
    for precision, ms, history in rows:
        accuracy = " | ".join(f"{h['accuracy']:.3f}" for h in history)
        print(
            f"| {precision} | {ms:.1f} | {ms / base:.2f} | {accuracy} | {history[-1]['loss']:.3f} |"
        )
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
