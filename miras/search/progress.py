"""A rich progress bar for a search: trials finished of the budget, best value, ETA."""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from miras.search.run import Counts


class SearchProgress:
    """Use as a context manager; call it with (counts, best) to update."""

    def __init__(self, name: str, budget: int, metric: str, console: Console | None = None):
        self.metric = metric
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = self.bar.add_task(name, total=budget, detail="", completed=0)

    def __enter__(self) -> SearchProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def __call__(self, counts: Counts, best: FrozenTrial | None) -> None:
        detail = f"pruned {counts.pruned}"
        if counts.running:
            detail += f", running {counts.running}"
        if best is not None:
            detail = f"best {self.metric} {best.values[0]:.4g} (#{best.number}), " + detail
        self.bar.update(self.task, completed=counts.finished, detail=detail)
