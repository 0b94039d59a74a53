"""Does a trial's sweep bracket its selection?

A trial with sweeps selects the point with the best mean validation value (objective.py). When
the selected value of a numeric swept setting is the lowest or the highest value the trial ran,
the best value may lie past it: the sweep did not bracket it, and comparing that trial with
another compares two settings that were not both tuned. The trial records this (`at_edge`) and
the summary and the report say so; an extending logspace sweep runs the values past the edge
instead (objective.extension_points).

    edges_of([{"lr": 1e-3}, {"lr": 1e-2}], {"lr": 1e-2})   # {"lr": "high"}
    edge_text({"lr": "high"})                               # "lr at the high edge"

Pure functions of the points run and the point selected, so the report can also mark trials
stored before `at_edge` existed, from their `sweep` records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def edge(value: Any, values: Iterable[Any]) -> str | None:
    """'low' when `value` is the smallest of `values`, 'high' when it is the largest, None
    when it lies between them. None too when the values are not all numbers (a sweep over
    text or null has no order) or hold fewer than two distinct ones (nothing to bracket)."""
    distinct = set(values)
    if len(distinct) < 2 or not all(_is_number(v) for v in distinct) or not _is_number(value):
        return None
    if value == min(distinct):
        return "low"
    if value == max(distinct):
        return "high"
    return None


def edges_of(points: Iterable[Mapping[str, Any]], chosen: Mapping[str, Any]) -> dict[str, str]:
    """{setting: 'low' | 'high'} for each swept setting whose value at the `chosen` point is
    at an edge of its values over `points` (every point run, a diverged one included: it was
    tried and not selected, so a diverged neighbour brackets the choice)."""
    points = list(points)
    found = {}
    for name, value in chosen.items():
        side = edge(value, (p[name] for p in points if name in p))
        if side is not None:
            found[name] = side
    return found


def edge_text(edges: Mapping[str, str]) -> str:
    """'lr at the high edge, weight_decay at the low edge'; '' when every sweep brackets."""
    return ", ".join(f"{name} at the {side} edge" for name, side in edges.items())
