"""Quality on MQAR where state size binds: linear attention, DeltaNet and Gated DeltaNet (and
any model of MODELS) trained for the same number of steps over several seeds, scored on
validation batches, with the mean and a 95% t interval per model.

    .venv/bin/python benchmarks/quality.py                        # docs/benchmarks.md's table
    .venv/bin/python benchmarks/quality.py --runs deltanet linear_attention --seeds 0 1
    .venv/bin/python benchmarks/quality.py --runs deltanet --step-times 4 64  # no training

Not a test: 15 runs of 1000 steps at the defaults, about 4 minutes on a quiet 2-core machine
(23 to 29 ms a step), 41 minutes at load averages of 7 to 12 (docs/benchmarks.md).

Zoology (Arora et al. 2023) separates the models when the pairs approach or exceed what a
head's d_k x d_v state holds (about d_k pairs, fewer when keys interfere). The defaults put 8
pairs against heads of d_k = 8 channels (d_model 32, 4 heads, one layer), with keys drawn from
31 tokens, so a head cannot store them on orthogonal keys; easier pair counts are mixed into
training as Zoology does. Every run takes the same number of steps, so the result does not
depend on the machine's load; the time per step is reported beside it (it does).

A run is `MODEL` or `MODEL:CHUNK` (chunk size; default --chunk-size). The defaults add
DeltaNet and Gated DeltaNet at chunk 4 beside chunk 64: their rules are affine in the memory,
so chunk_mode "auto" solves each chunk exactly and the chunk size should change the time per
step, not the accuracy (docs/chunking.md).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import ClassVar

import torch

import miras
from miras.models import build_model
from miras.stats import confidence_interval
from miras.tasks import make_task
from miras.tasks.base import Task

ROOT = Path(__file__).resolve().parents[1]

# name -> (spec file, model-section overrides). Attention gets rotary positions (the fair
# baseline of the issue); the memory layers get the short conv they are defined with.
MODELS: dict[str, tuple[str, dict]] = {
    "attention": ("specs/attention.yaml", {"positions": "conv"}),
    "attention_rotary": ("specs/attention.yaml", {"positions": "rotary"}),
    "deltanet": ("specs/deltanet.yaml", {}),
    "gated_deltanet": ("specs/gated_deltanet.yaml", {}),
    "linear_attention": ("specs/linear_attention.yaml", {}),
    "retnet": ("specs/retnet.yaml", {}),
    "titans": ("specs/titans.yaml", {}),
}
DEFAULT_RUNS = [
    "linear_attention",
    "deltanet",
    "gated_deltanet",
    "deltanet:4",
    "gated_deltanet:4",
]


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--runs",
        nargs="+",
        default=DEFAULT_RUNS,
        metavar="MODEL[:CHUNK]",
        help=f"models ({', '.join(MODELS)}), each optionally at its own chunk size",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument(
        "--curriculum",
        type=int,
        nargs="*",
        default=[2, 4],
        help="smaller pair counts mixed into training (evaluation stays at --pairs)",
    )
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument(
        "--step-times",
        type=int,
        nargs="+",
        metavar="CHUNK",
        help="only time a training step of each run's model at these chunk sizes and exit",
    )
    p.add_argument("--workers", type=int, default=2, help="runs trained side by side")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "quality")
    args = p.parse_args()
    args.runs = [parse_run(text, args.chunk_size, p) for text in args.runs]
    return args


def parse_run(text: str, default_chunk: int, parser: argparse.ArgumentParser) -> tuple[str, int]:
    """'deltanet:4' -> ('deltanet', 4); 'deltanet' -> ('deltanet', default_chunk)."""
    name, _, chunk = text.partition(":")
    if name not in MODELS:
        parser.error(f"--runs: unknown model {name!r}; allowed: {', '.join(MODELS)}")
    if chunk and not (chunk.isdigit() and int(chunk) > 0):
        parser.error(f"--runs: {text!r}: the chunk size after ':' must be a positive integer")
    return name, int(chunk) if chunk else default_chunk


class Curriculum(Task):
    """Training batches cycle through MQAR tasks with fewer pairs (the same sequence length
    and vocabulary); validation batches and metrics are the target task's. Zoology trains MQAR
    on a mixture of pair counts the same way: the easy ones end the loss plateau sooner."""

    higher_is_better: ClassVar[bool] = True
    target: Task
    easier: list[Task]

    @property
    def name(self) -> str:
        return f"{self.target.name}-curriculum"

    @property
    def primary_metric(self) -> str:
        return self.target.primary_metric

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def seq_len(self) -> int:
        return self.target.seq_len

    def batch(self, split: str, index: int, batch_size: int):
        if split != "train":
            return self.target.batch(split, index, batch_size)
        tasks = [*self.easier, self.target]
        return tasks[index % len(tasks)].batch(split, index, batch_size)

    def metrics(self, logits, labels):
        return self.target.metrics(logits, labels)


def make_mqar(args: argparse.Namespace, seed: int):
    """The target task (with its curriculum for training) at `seed`."""

    def mqar(pairs: int):
        return make_task(
            "mqar", seq_len=args.seq_len, num_pairs=pairs, vocab_size=args.vocab, seed=seed
        )

    task = mqar(args.pairs)
    if not args.curriculum:
        return task
    return Curriculum(target=task, easier=[mqar(n) for n in args.curriculum])


def spec_of(name: str, chunk: int, args: argparse.Namespace) -> miras.Spec:
    path, overrides = MODELS[name]
    data = miras.load_spec(ROOT / path).normalized()
    data["model"] = {
        **data["model"],
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "chunk_size": chunk,
        **overrides,
    }
    return miras.load_spec(data)


def seconds_per_step(spec: miras.Spec, task, batch_size: int, repeats: int = 5) -> float:
    """The time of one training step (forward, backward, AdamW), after one warm-up step."""
    torch.manual_seed(0)
    model = build_model(spec, task.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = task.batch("train", 0, batch_size)
    for i in range(repeats + 1):
        if i == 1:
            start = time.perf_counter()
        logits = model(batch.inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / repeats


def print_step_times(args: argparse.Namespace) -> None:
    """Milliseconds per training step of each model at each chunk size, side by side."""
    torch.set_num_threads(args.threads)
    task = make_mqar(args, 0)
    print(f"| model | {' | '.join(f'chunk {b}' for b in args.step_times)} |")
    print(f"| --- |{' ---: |' * len(args.step_times)}")
    for name in dict.fromkeys(name for name, _ in args.runs):
        times = [
            seconds_per_step(spec_of(name, b, args), task, args.batch_size) for b in args.step_times
        ]
        print(f"| {name} | {' | '.join(f'{1000 * t:.0f} ms' for t in times)} |", flush=True)


def train_one(args: argparse.Namespace, name: str, chunk: int, seed: int) -> dict:
    """One run: `name` at chunk size `chunk`, model and data seeded with `seed`."""
    torch.set_num_threads(args.threads)
    run_dir = args.out / f"{name}-chunk{chunk}-seed{seed}"
    for stale in ("checkpoint.pt", "metrics.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    result = miras.train(
        spec_of(name, chunk, args),
        make_mqar(args, seed),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        seed=seed,
        eval_every=args.steps,
        eval_batches=args.eval_batches,
        out_dir=run_dir,
        progress=False,
    )
    row = {
        "model": name,
        "chunk": chunk,
        "seed": seed,
        "accuracy": result.metrics["accuracy"],
        "loss": result.metrics["loss"],
        "steps": result.steps,
        "seconds": result.seconds,
        "parameters": result.parameters,
    }
    print(json.dumps(row), flush=True)
    return row


def summarize(rows: list[dict], runs: list[tuple[str, int]]) -> list[dict]:
    """One line per run: accuracy mean and 95% t interval over the seeds, time per step."""
    lines = []
    for name, chunk in runs:
        mine = [r for r in rows if (r["model"], r["chunk"]) == (name, chunk)]
        mean, low, high = confidence_interval([r["accuracy"] for r in mine])
        lines.append(
            {
                "model": name,
                "chunk": chunk,
                "accuracy": mean,
                "low": low,
                "high": high,
                "seeds": [round(r["accuracy"], 3) for r in mine],
                "ms_per_step": 1000 * sum(r["seconds"] / r["steps"] for r in mine) / len(mine),
                "parameters": mine[0]["parameters"],
            }
        )
    return lines


def main() -> None:
    args = arguments()
    if args.step_times:
        return print_step_times(args)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(name, chunk, seed) for seed in args.seeds for name, chunk in args.runs]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(train_one, *zip(*[(args, *job) for job in jobs], strict=True)))
    wall = time.perf_counter() - start
    lines = summarize(rows, args.runs)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(
        json.dumps({"settings": settings, "rows": rows, "summary": lines}, indent=1)
    )
    print(f"\n{len(jobs)} runs of {args.steps} steps, {args.workers} workers: {wall:.0f} s\n")
    print("| model | chunk | accuracy (mean [95% CI]) | per seed | ms / step | parameters |")
    print("| --- | ---: | --- | --- | ---: | ---: |")
    for x in lines:
        print(
            f"| {x['model']} | {x['chunk']} | {x['accuracy']:.3f} [{x['low']:.3f}, "
            f"{x['high']:.3f}] | {', '.join(f'{a:.3f}' for a in x['seeds'])} | "
            f"{x['ms_per_step']:.0f} | {x['parameters']:,} |"
        )


if __name__ == "__main__":
    main()
