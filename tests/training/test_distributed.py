"""Training on several processes (issue 15): two gloo ranks on the CPU reach what one process
reaches with the same global batch, and a rank killed mid-run stops the other with a message
that names it, the last checkpoint and the resume command, from which the run resumes.

Tolerance of the two-rank comparison: the ranks see the same sequences as the one process, so
the only difference is the order of float32 sums (each rank's gradient over its half of the
batch, added by the all-reduce, against one backward over the whole batch): a few ulp per
gradient entry, which AdamW carries into the parameters. Measured over 20 steps of this model:
losses within 4.8e-7 of each other (about 1.4e-7 relative, one float32 ulp at loss 3.5) and
parameters within 1.3e-7. TOL = 1e-5 is about 20 times the measured drift and 1/6000 of the
distance AdamW moves a parameter in these 20 steps (up to lr x steps = 0.06), so a rank that
trained on other rows, or gradients weighted wrongly, would exceed it by far.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import miras
from miras import training
from miras.tasks import make_task
from miras.training import recipe

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "tiny-dn",
    "model": {"d_model": 16, "n_heads": 1, "n_layers": 1, "chunk_size": 8},
}
TASK = {"vocab_size": 32, "seq_len": 16, "num_pairs": 2}
RUN = {"batch_size": 8, "lr": 3e-3, "warmup": 2, "eval_batches": 1, "progress": False}
TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


def task():
    return make_task("mqar", **TASK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: Path, seen: Path) -> None:
    """One of two forked ranks: its own process group (gloo), then miras.train, recording the
    rows of every batch this rank's loss was taken over."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    real = recipe.loss_of

    def recording(logits, labels):
        rows.append(labels.shape[0])
        return real(logits, labels)

    recipe.loss_of = recording
    try:
        miras.train(SPEC, task(), steps=20, eval_every=10, out_dir=out, device="cpu", **RUN)
    finally:
        Path(seen).write_text(json.dumps(rows))
        dist.destroy_process_group()


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_reach_what_one_process_reaches_with_the_same_global_batch(tmp_path):
    one = miras.train(SPEC, task(), steps=20, eval_every=10, out_dir=tmp_path / "one", **RUN)
    port, fork = free_port(), multiprocessing.get_context("fork")
    ranks = [
        fork.Process(target=_rank, args=(r, port, tmp_path / "two", tmp_path / f"rows{r}"))
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    for p in ranks:
        if p.is_alive():  # hung: end it so the test fails instead of waiting
            p.kill()
            p.join()
    assert [p.exitcode for p in ranks] == [0, 0]
    for r in range(2):  # each rank took its loss over its half of every global batch
        assert json.loads((tmp_path / f"rows{r}").read_text()) == [4] * 20
    two = training.load_checkpoint(tmp_path / "two")
    assert two["step"] == 20 and len(two["losses"]) == 20
    assert max(abs(a - b) for a, b in zip(one.losses, two["losses"], strict=True)) < TOL
    assert max_difference(training.load_checkpoint(tmp_path / "one")["model"], two["model"]) < TOL
    # Rank 0 alone wrote the metrics: one start record, two evaluations.
    records = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if r["split"] != "train"] == ["run", "valid", "valid"]


def test_a_batch_that_does_not_split_across_the_ranks_is_refused():
    from miras.training.distributed import Ranks

    with pytest.raises(ValueError, match="batch_size: the global batch of 9 does not split"):
        Ranks(rank=0, world=2, backend="gloo").shard(9)
    assert Ranks(rank=1, world=2, backend="gloo").shard(8) == slice(4, 8)
    assert Ranks(world=2, backend="gloo").describe(32) == "2 ranks, gloo, global batch 32 = 2 x 16"


# A rank killed mid-run ------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers in /proc")
def test_a_killed_rank_stops_the_run_with_a_message_and_it_resumes(tmp_path):
    out = tmp_path / "run"
    options = [w for k, v in TASK.items() for w in ("--task-option", f"{k}={v}")]
    model = ["--model", "d_model=16", "--model", "n_layers=1"]
    settings = ["--batch-size", "8", "--warmup", "2", "--eval-batches", "1", "--lr", "3e-3"]
    command = [
        *("train", str(ROOT / "specs" / "deltanet.yaml"), "--task", "mqar"),
        *options,
        *model,
        *settings,
        *("--steps", "400", "--eval-every", "10", "--threads", "1", "--no-progress"),
        *("--out", str(out)),
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [*launch, "-m", "miras.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (out / "checkpoint.pt").is_file():
            assert agent.poll() is None, agent.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 90 s"
            time.sleep(0.05)
        [victim] = [p for p in children(agent.pid) if rank_of(p) == 1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode != 0
    assert time.monotonic() - killed < 60
    step = training.load_checkpoint(out)["step"]
    assert 10 <= step < 400 and step % 10 == 0
    message = re.search(r"error: rank 0 of 2 stopped: (.*)", output)
    assert message, output
    assert "rank 1 is gone" in message.group(1)
    assert f"the last checkpoint is {out / 'checkpoint.pt'} (step {step})" in message.group(1)
    resume = re.search(r"resume with: (.*)", output).group(1)
    assert resume.startswith("torchrun --nproc_per_node 2 -m miras.cli train ")
    assert resume.endswith(f"--out {out} --resume")

    # Resumed in one process (the same global batch), it continues from that checkpoint: its
    # next step is the one an uninterrupted one-process run takes (stopped at the same step by
    # its callback, then one more step).
    spec = training.load_checkpoint(out)["spec"]
    again = {"steps": 400, "eval_every": 10, "time_limit": 0, "resume": True, **RUN}
    resumed = miras.train(spec, task(), out_dir=out, **again)
    assert resumed.steps == step + 1 and training.load_checkpoint(out)["step"] == step + 1

    def stop_at(at, metrics):
        if at == step:
            raise StopIteration

    with pytest.raises(StopIteration):
        miras.train(
            spec,
            task(),
            steps=400,
            eval_every=10,
            out_dir=tmp_path / "ref",
            callback=stop_at,
            **RUN,
        )
    reference = miras.train(spec, task(), out_dir=tmp_path / "ref", **again)
    assert len(reference.losses) == len(resumed.losses) == step + 1
    assert max(abs(a - b) for a, b in zip(reference.losses, resumed.losses, strict=True)) < TOL
