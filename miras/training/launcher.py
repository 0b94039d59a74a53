"""Training on several ranks from one process: `train_on_ranks` starts torchrun as a
subprocess and waits for it (a study trial with `train: {ranks: N}`, docs/search.md); each rank
runs this module's `_rank_main` on a job file (docs/training.md, "Several processes").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miras.errors import TrainingDiverged
from miras.tasks import make_task
from miras.training.checkpoint import METRICS
from miras.training.distributed import RankFailure
from miras.training.recipe import TrainResult, train


def train_on_ranks(
    spec: dict[str, Any],
    task: str,
    task_options: dict[str, Any],
    settings: dict[str, Any],
    *,
    ranks: int,
    threads: int = 1,
    callback: Callable[[int, dict[str, float]], None] | None = None,
    poll: float = 0.2,
) -> Any:
    """`miras.train(spec, make_task(task, **task_options), **settings)` on `ranks` processes:
    torchrun (`--standalone`, gloo on the CPU, nccl on GPUs) starts them, this process waits
    and returns rank 0's `TrainResult` (metrics, steps, parameters, seconds; no history).

    The run's directory is temporary. `callback(step, metrics)` is called here for each
    evaluation record as rank 0 appends it to metrics.jsonl (polled every `poll` s); when it
    raises (optuna.TrialPruned) the ranks are stopped and the error propagates. The ranks'
    errors come back as they would in one process: `TrainingDiverged`, a `ValueError` (a bad
    setting, a batch that does not split), or a RuntimeError with the ranks' own message
    (a rank that died: `RankFailure`'s text)."""

    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: expected an integer >= 1, got {ranks!r}")
    with tempfile.TemporaryDirectory(prefix="miras-ranks-") as folder:
        root = Path(folder)
        job = {"spec": spec, "task": task, "task_options": task_options, "settings": settings}
        job |= {"out": str(root / "run"), "result": str(root / "result.json")}
        (root / "job.json").write_text(json.dumps(job))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [
            f"--nproc_per_node={ranks}",
            "-m",
            "miras.training.launcher",
            str(root / "job.json"),
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(root / "log", "wb") as log:
            # Its own session: Ctrl-C here does not reach the ranks, the except below ends them.
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                start_new_session=True,
            )  # fmt: skip
            try:
                metrics = _Records(root / "run" / METRICS)
                while True:
                    ended = process.poll() is not None
                    for record in metrics.new():
                        if record.get("split") == "valid" and callback is not None:
                            keep = {k: v for k, v in record.items() if k not in _NOT_METRICS}
                            callback(record["step"], keep)
                    if ended:
                        break
                    time.sleep(poll)
            except BaseException:
                _stop(process)
                raise
        answer_file = root / "result.json"
        answer = json.loads(answer_file.read_text()) if answer_file.is_file() else None
        if answer is None or "error" in answer:
            log_text = (root / "log").read_text(errors="replace")
            if answer is not None and answer["error"] == "TrainingDiverged":
                raise TrainingDiverged(answer["step"], answer["what"], answer["value"])
            if answer is not None and answer["error"] == "ValueError":
                raise ValueError(answer["message"])
            said = [line for line in log_text.splitlines() if line.startswith("error: ")]
            message = answer["message"] if answer is not None else "; ".join(said)
            tail = "\n".join(log_text.strip().splitlines()[-5:])
            raise RuntimeError(
                f"training on {ranks} ranks failed (exit code {process.returncode}): "
                f"{message or tail}"
            )
        return TrainResult(
            metrics=answer["metrics"],
            steps=answer["steps"],
            parameters=answer["parameters"],
            seconds=answer["seconds"],
        )


_NOT_METRICS = ("step", "split", "seconds")


class _Records:
    """The complete lines appended to a JSON-lines file since the last look."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read()
        done = text[: text.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(done)
        return [json.loads(line) for line in done.splitlines() if line.strip()]


def _stop(process: Any) -> None:
    """End torchrun and its ranks (their own process group): SIGTERM, SIGKILL after 10 s."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _rank_main(job_file: str) -> None:
    """One rank of `train_on_ranks`: train, then rank 0 writes the result (or the error)."""

    job = json.loads(Path(job_file).read_text())
    rank = int(os.environ.get("RANK", "0"))
    answer: dict[str, Any]
    try:
        task = make_task(job["task"], **job["task_options"])
        result = train(job["spec"], task, **job["settings"], out_dir=job["out"], progress=False)
        answer = {"metrics": result.metrics, "steps": result.steps}
        answer |= {"parameters": result.parameters, "seconds": result.seconds}
    except TrainingDiverged as error:
        answer = {"error": "TrainingDiverged", "message": str(error)}
        answer |= {"step": error.step, "what": error.what, "value": error.value}
    except ValueError as error:
        answer = {"error": "ValueError", "message": str(error)}
    except Exception as error:  # a rank that died (RankFailure) or anything unforeseen
        traceback.print_exc()  # into the run's log
        said = str(error) if isinstance(error, RankFailure) else f"{type(error).__name__}: {error}"
        answer = {"error": type(error).__name__, "message": said}
    if rank == 0:
        written = Path(job["result"]).with_suffix(".part")
        written.write_text(json.dumps(answer))
        written.replace(job["result"])
    if "error" in answer:
        print(f"error: {answer['message']}", file=sys.stderr, flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    _rank_main(sys.argv[1])
