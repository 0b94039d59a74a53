"""Training on several processes: torchrun's environment, the process group, each rank's share
of the batch, and what a rank that dies leaves the others to say (docs/training.md, "Several
processes").

    ranks = join(device)                 # from torchrun's RANK / WORLD_SIZE; one rank without
    rows = ranks.shard(32)               # rank r of R takes rows [r * 32/R, (r + 1) * 32/R)
    total = ranks.sum(torch.tensor(x))   # all-reduced; the value itself on one rank

The global batch is `batch_size`: every rank draws the same batch (a function of the task's
seed and the step) and keeps its own rows, so R ranks of `batch_size / R` rows see exactly the
sequences one process of `batch_size` rows sees.

    result = train_on_ranks(spec, "mqar", {}, {"steps": 100}, ranks=2)   # torchrun, from here

starts the ranks from a process that is not one of them (a study trial, docs/search.md).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miras.training.checkpoint import load_checkpoint
from miras.training.config import RANK_TIMEOUT

LOST_RANK_WAIT = 2.0  # seconds a survivor looks for the rank that ended (`Ranks.lost`)


class RankFailure(RuntimeError):
    """Another rank died or stopped answering (or torchrun stopped this one). `rank`: the rank
    that reports it, `lost`: the ranks seen gone (empty when it cannot tell, e.g. on another
    machine), `checkpoint`/`step`: the run's last checkpoint on disk (None when it has none)."""

    def __init__(
        self,
        rank: int,
        world: int,
        lost: list[int],
        reason: str,
        checkpoint: Path | None,
        step: int | None,
    ):
        self.rank, self.world, self.lost = rank, world, lost
        self.checkpoint, self.step = checkpoint, step
        who = (
            ", ".join(f"rank {r}" for r in lost) + (" is" if len(lost) == 1 else " are") + " gone"
            if lost
            else "another rank died or stopped answering"
        )
        last = (
            f"the last checkpoint is {checkpoint} (step {step})"
            if checkpoint is not None
            else "the run wrote no checkpoint yet: nothing was saved"
        )
        super().__init__(f"rank {rank} of {world} stopped: {who} ({reason}); {last}")


@dataclass
class Ranks:
    """This process's place among the ranks of a run. One process: rank 0 of 1, no group."""

    rank: int = 0
    world: int = 1
    backend: str | None = None
    owns_group: bool = False  # this run made the process group, so it closes it
    processes: list[tuple[str, int]] = field(default_factory=list)  # (host, pid) per rank

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes checkpoints, metrics and progress, and evaluates."""
        return self.rank == 0

    def shard(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of `batch_size` rows."""
        if batch_size % self.world:
            raise ValueError(
                f"batch_size: the global batch of {batch_size} does not split evenly across "
                f"{self.world} ranks; pass a multiple of {self.world}"
            )
        rows = batch_size // self.world
        return slice(self.rank * rows, (self.rank + 1) * rows)

    def describe(self, batch_size: int) -> str:
        """e.g. '2 ranks, gloo, global batch 32 = 2 x 16'."""
        return (
            f"{self.world} ranks, {self.backend}, global batch {batch_size} = "
            f"{self.world} x {batch_size // self.world}"
        )

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (the same on every rank)."""
        if self.world > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def share(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (plain data)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def lost(self, wait: float = LOST_RANK_WAIT) -> list[int]:
        """The ranks on this machine whose process has ended (torchrun reaps them late, so a
        zombie counts as ended). Ranks on other machines cannot be seen from here. A killed
        rank's sockets close while it is still exiting, before /proc shows it ended, so this
        looks again for up to `wait` seconds while it sees none gone."""
        here = socket.gethostname()
        deadline = time.monotonic() + wait
        while True:
            gone = [
                rank
                for rank, (host, pid) in enumerate(self.processes)
                if host == here and rank != self.rank and not _alive(pid)
            ]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def callback_stopped(
        self, callback: Callable[[int, dict[str, float]], None], step: int, metrics: dict
    ) -> bool:
        """Call `callback` on rank 0 and tell every rank whether it raised; rank 0 then
        re-raises its error (optuna's TrialPruned), the other ranks get True and stop."""
        error: BaseException | None = None
        if self.main:
            try:
                callback(step, metrics)
            except BaseException as raised:  # whatever it is, the other ranks must hear of it
                error = raised
        stopped = self.share(error is not None)
        if error is not None:
            raise error
        return stopped

    def failure(self, error: BaseException, checkpoint: Path | None) -> RankFailure | None:
        """What a surviving rank says when `error` comes from losing another rank (None: it
        does not, or this is the only rank): who is gone and the checkpoint on disk at
        `checkpoint` (read back, since rank 0 may have died after writing one this rank has
        not heard of)."""
        if self.world == 1 or not is_rank_failure(error, self):
            return None
        step = None
        if checkpoint is not None and checkpoint.is_file():
            step = load_checkpoint(checkpoint)["step"]
        # gloo's first line, without its source location and advice: "Read error
        # [127.0.0.1]:46805: Connection reset by peer".
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        reason = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text).split(". ")[0]
        where = checkpoint if step is not None else None
        return RankFailure(self.rank, self.world, self.lost(), reason, where, step)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def launched() -> bool:
    """Whether this process is one of several ranks (torchrun sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    )


def join(device: str | None, timeout: float = RANK_TIMEOUT) -> tuple[Ranks, torch.device]:
    """This process's ranks and device. Under torchrun (WORLD_SIZE > 1) the process group is
    made here, with `timeout` seconds for any collective, on gloo for the CPU and nccl for
    CUDA (each rank on GPU LOCAL_RANK); a group the caller made already is used as it is."""
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not launched():
        return Ranks(), chosen
    kind, owns = chosen.type, not dist.is_initialized()
    if kind == "cuda":
        chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(chosen)
    if owns:
        if timeout <= 0:
            raise ValueError(f"rank_timeout: expected seconds > 0, got {timeout}")
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout),
        )
    processes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(processes, (socket.gethostname(), os.getpid()))
    ranks = Ranks(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        backend=dist.get_backend(),
        owns_group=owns,
        processes=[tuple(p) for p in processes],
    )
    return ranks, chosen


class Terminated(Exception):
    """SIGTERM reached a rank: torchrun stops the other ranks this way when one has failed."""


class TerminateRaises:
    """While active (several ranks, main thread), SIGTERM raises `Terminated` so that the rank
    can say where the run stands before it ends, instead of vanishing silently. Left by an
    error, it ignores SIGTERM from then on: the process is ending, and torchrun's SIGTERM to
    the survivors would otherwise cut the message short (torchrun still SIGKILLs a rank that
    has not ended after its grace period)."""

    def __init__(self, enabled: bool):
        import threading

        self.active = enabled and threading.current_thread() is threading.main_thread()
        self.previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        raise Terminated("stopped by SIGTERM, as torchrun stops the ranks when one fails")

    def __enter__(self) -> TerminateRaises:
        if self.active:
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, self.previous if kind is None else signal.SIG_IGN)


def launcher() -> list[str]:
    """The words that start this run again: `miras`, or torchrun with as many processes per
    machine when it runs under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ["miras"]
    per_node = os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    return ["torchrun", "--nproc_per_node", per_node, "-m", "miras.cli"]


def is_rank_failure(error: BaseException, ranks: Ranks) -> bool:
    """Whether `error` comes from losing another rank: SIGTERM from torchrun, a collective's
    error (a closed connection, the timeout), or a rank on this machine seen gone."""
    text = str(error)
    return (
        isinstance(error, Terminated | dist.DistError)
        or "/gloo/" in text  # gloo's errors name its source file: a reset connection, a timeout
        or bool(ranks.lost())
    )
