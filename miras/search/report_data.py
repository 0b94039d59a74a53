"""The plain data a report's figures are drawn from, shared by report.py (which computes it)
and plots.py (which draws it). Data flows one way: report_data <- plots <- report, and
report_data imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Dimension:
    """One axis of the parallel-coordinates plot: numbers, with tick labels for categories."""

    name: str
    values: list[float]
    ticks: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
