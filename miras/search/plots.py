"""Drawing only: plotly figures from the data of report.py, and the HTML page that holds them.

The page embeds plotly.js once, in its head, so it opens without a network. Data flows one way,
report.py -> plots.py -> report_data.py: report.py computes the data and imports this module to
draw it; this one reads the data's types from report_data.py and never imports report.py.
"""

from __future__ import annotations

import html
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from miras.search.report_data import Dimension

LAYOUT = {"template": "plotly_white", "height": 420, "margin": {"l": 60, "r": 30, "t": 40, "b": 50}}


def history_figure(data: pd.DataFrame, metric: str) -> go.Figure:
    fig = go.Figure()
    fig.add_scatter(x=data["trial"], y=data["value"], mode="markers", name=metric)
    fig.add_scatter(x=data["trial"], y=data["best"], mode="lines", name="best so far")
    fig.update_layout(**LAYOUT, xaxis_title="trial", yaxis_title=metric)
    return fig


def parallel_figure(dimensions: list[Dimension]) -> go.Figure:
    axes = []
    for d in dimensions:
        axis: dict[str, Any] = {"label": d.name, "values": d.values}
        if d.labels:
            axis.update(tickvals=d.ticks, ticktext=d.labels)
        axes.append(axis)
    objective = dimensions[-1].values if dimensions else []
    line = {"color": objective, "colorscale": "Viridis", "showscale": True}
    fig = go.Figure(go.Parcoords(dimensions=axes, line=line))
    fig.update_layout(**LAYOUT)
    return fig


def importance_figure(data: pd.DataFrame, metric: str) -> go.Figure:
    ordered = data.iloc[::-1]  # the most important on top
    fig = go.Figure(go.Bar(x=ordered["importance"], y=ordered["parameter"], orientation="h"))
    fig.update_layout(**LAYOUT, xaxis_title=f"importance for {metric}")
    return fig


def pareto_figure(data: pd.DataFrame, metrics: list[str]) -> go.Figure:
    """The first two objectives; the front (non-dominated on every objective) joined by a line
    when there are only two (with more, a front point may look dominated in this plane)."""
    a, b = metrics[:2]
    fig = go.Figure()
    for on_front, name in ((False, "dominated"), (True, "Pareto front")):
        part = data[data["pareto"] == on_front].sort_values(a)
        hover = [
            f"trial {row['trial']}<br>" + "<br>".join(f"{m} = {row[m]:.4g}" for m in metrics)
            for _, row in part.iterrows()
        ]
        fig.add_scatter(
            x=part[a],
            y=part[b],
            mode="markers+lines" if on_front and len(metrics) == 2 else "markers",
            name=name,
            text=hover,
            hoverinfo="text",
        )
    fig.update_layout(**LAYOUT, xaxis_title=a, yaxis_title=b)
    return fig


def interval_figure(data: pd.DataFrame, metric: str, direction: str) -> go.Figure:
    """Each replicated trial's mean with its 95% interval, best first: the best trial, those
    whose gap to it is not significant, and those that differ (p < 0.05), one trace each."""
    key = data["mean"] * (1 if direction == "minimize" else -1)
    ordered = data.assign(_key=key).sort_values(["_key", "trial"])
    best = ordered["p_vs_best"].isna()
    groups = (
        ("the best", best),
        ("not significantly different from the best", ~best & ~ordered["differs"]),
        ("differs from the best (p < 0.05)", ordered["differs"]),
    )
    fig = go.Figure()
    for name, rows in groups:
        part = ordered[rows]
        fig.add_scatter(
            x=[f"trial {n}" for n in part["trial"]],
            y=part["mean"],
            mode="markers",
            name=name,
            error_y={
                "type": "data",
                "symmetric": False,
                "array": part["high"] - part["mean"],
                "arrayminus": part["mean"] - part["low"],
            },
        )
    order = [f"trial {n}" for n in ordered["trial"]]
    fig.update_layout(
        **LAYOUT, yaxis_title=metric, xaxis={"categoryorder": "array", "categoryarray": order}
    )
    return fig


def _error_y(data: pd.DataFrame) -> dict[str, Any]:
    return {
        "type": "data",
        "symmetric": False,
        "array": data["high"] - data["mean"],
        "arrayminus": data["mean"] - data["low"],
    }


def state_size_figure(data: pd.DataFrame, metric: str, size: str = "state_bytes") -> go.Figure:
    """The objective against the state size (log), one line per model family, the 95%
    interval over the seeds as error bars; each point labelled by its `trial` number, or by
    `d_model` where the data has that column instead."""
    label = next((c for c in ("trial", "d_model") if c in data.columns), None)
    fig = go.Figure()
    for family, part in data.groupby("family", sort=True):
        part = part.sort_values(size)
        fig.add_scatter(
            x=part[size],
            y=part["mean"],
            mode="markers+lines",
            name=str(family),
            error_y=_error_y(part),
            text=[f"{label} {n}" for n in part[label]] if label else None,
        )
    fig.update_layout(**LAYOUT, xaxis={"type": "log", "title": size}, yaxis_title=metric)
    return fig


def slice_figure(data: pd.DataFrame, metric: str) -> go.Figure:
    """The objective per slice of the test split (x, in the task's order), one line per
    configuration, the 95% interval over the seeds as error bars."""
    order = list(dict.fromkeys(data["slice"]))
    fig = go.Figure()
    for (_, label), part in data.groupby(["trial", "configuration"], sort=False):
        fig.add_scatter(
            x=part["slice"], y=part["mean"], mode="markers+lines", name=str(label),
            error_y=_error_y(part),
        )  # fmt: skip
    fig.update_layout(
        **LAYOUT,
        yaxis_title=metric,
        xaxis={"title": "slice", "categoryorder": "array", "categoryarray": order},
    )
    return fig


def sweep_figure(data: pd.DataFrame, field: str, metric: str) -> go.Figure:
    """The validation metric against one swept value, one line per trial (other swept values
    at the trial's selected point), the selected point circled."""
    fig = go.Figure()
    for trial, part in data.groupby("trial", sort=True):
        chosen = part[part["selected"]]
        others = [c for c in data.columns if c not in (field, "trial", "point", "valid", "test")]
        others = [c for c in others if c != "selected"]
        if not chosen.empty:
            for column in others:
                part = part[part[column] == chosen.iloc[0][column]]
        part = part.sort_values(field)
        fig.add_scatter(x=part[field], y=part["valid"], mode="markers+lines", name=f"trial {trial}")
        if not chosen.empty:
            fig.add_scatter(
                x=chosen[field], y=chosen["valid"], mode="markers", showlegend=False,
                marker={"size": 14, "symbol": "circle-open"}, name=f"trial {trial}: selected",
            )  # fmt: skip
    numbers = pd.to_numeric(data[field], errors="coerce")
    log = bool(numbers.notna().all() and (numbers > 0).all() and numbers.max() > 10 * numbers.min())
    xaxis = {"title": field, **({"type": "log"} if log else {})}
    fig.update_layout(**LAYOUT, xaxis=xaxis, yaxis_title=f"validation {metric}")
    return fig


def component_figure(data: pd.DataFrame, parameter: str, metric: str) -> go.Figure:
    fig = go.Figure()
    for option, part in data.groupby("option", sort=True):
        fig.add_box(y=part["value"], name=str(option), boxpoints="all", jitter=0.3)
    fig.update_layout(**LAYOUT, xaxis_title=parameter, yaxis_title=metric, showlegend=False)
    return fig


def page(
    title: str,
    heading: str,
    figures: list[tuple[str, go.Figure]],
    tables: list[tuple[str, pd.DataFrame]],
    notes: list[str],
) -> str:
    """One self-contained HTML page: plotly.js inline, the figures, then the tables."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
        "padding:2px 6px}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        f'</head><body data-figures="{len(figures)}">',
        f"<h1>{html.escape(title)}</h1><p>{html.escape(heading)}</p>",
    ]
    for note in notes:
        parts.append(f"<p><em>{html.escape(note)}</em></p>")
    for i, (name, fig) in enumerate(figures):
        parts.append(f"<h2>{html.escape(name)}</h2>")
        parts.append(
            fig.to_html(
                full_html=False,
                include_plotlyjs=False,
                div_id=f"figure-{i}",
                config={"displaylogo": False, "responsive": True},
            )
        )
    for name, table in tables:
        parts.append(f"<h2>{html.escape(name)}</h2>")
        parts.append(table.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}"))
    parts.append("</body></html>")
    return "\n".join(parts)
