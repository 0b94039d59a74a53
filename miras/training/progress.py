"""Training progress on stderr: a rich bar on a terminal, plain flushed lines elsewhere
(docs/training.md, "What a run does")."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    """Training progress on stderr. On a terminal, a rich bar with the loss, the task's metric
    (on the training batch) and tokens per second. Elsewhere (a log file, a pipe, a batch job)
    plain lines, flushed: one every `every` steps (about a tenth of the run, a multiple of
    `log_every`, where the metric is computed) and one per evaluation. Silent when disabled."""

    def __init__(
        self,
        enabled: bool,
        total: int,
        start: int,
        metric: str,
        log_every: int,
        console: Console | None = None,
    ):
        self.total, self.metric, self.shown = total, metric, "-"
        self.console = console or Console(stderr=True)
        live = self.console.is_terminal or self.console.is_jupyter
        self.mode = "off" if not enabled else "bar" if live else "lines"
        self.every = log_every * max(1, round(total / 10 / log_every))
        self.began = time.perf_counter()
        if self.mode != "bar":
            return
        self.progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn(f"{metric} {{task.fields[metric]}}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task(
            "train", total=total, completed=start, loss="-", metric="-", speed="-"
        )

    def __enter__(self) -> TrainProgress:
        if self.mode == "bar":
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode == "bar":
            self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, metric: float | None, speed: float) -> None:
        if metric is not None:
            self.shown = f"{metric:.3f}"
        if self.mode == "bar":
            self.progress.update(
                self.task,
                completed=step,
                loss=f"{loss:.4f}",
                metric=self.shown,
                speed=f"{speed:,.0f}",
            )
        elif self.mode == "lines" and step % self.every == 0:
            self._line(step, f"loss {loss:.4f}  {self.metric} {self.shown}  {speed:,.0f} tok/s")

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        if self.mode == "lines":
            self._line(step, "valid  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def _line(self, step: int, text: str) -> None:
        seconds = int(time.perf_counter() - self.began)
        clock = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        self.console.print(
            f"train step {step}/{self.total}  {text}  elapsed {clock}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        self.console.file.flush()
