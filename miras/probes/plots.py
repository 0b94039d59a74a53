"""Probe figures and their page: the rows of `ProbeResult.rows()` drawn with plotly (imported
only here)."""

from __future__ import annotations

import html

from miras.probes.base import SCALE, ProbeResult

LOG_X = {"pairs", "distance"}


def draw(results: list[ProbeResult]):
    """One line per spec: mean recall error against the sweep, the 95% interval as error bars."""
    import plotly.graph_objects as go

    if not results:
        raise ValueError("draw: expected at least one probe result, got none")
    first = results[0]
    fig = go.Figure()
    for result in results:
        rows = result.rows()
        gates = ", ".join(f"{k}={v:g}" for k, v in result.gates.items())
        fig.add_trace(
            go.Scatter(
                x=[r[result.x_name] for r in rows],
                y=[r["mean"] for r in rows],
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [r["high"] - r["mean"] for r in rows],
                    "arrayminus": [r["mean"] - r["low"] for r in rows],
                },
                mode="lines+markers",
                name=f"{result.spec} ({gates})" if gates else result.spec,
            )
        )
    seeds = first.rows()[0]["seeds"]
    fig.update_layout(
        title=f"probe {first.probe}: mean over {seeds} seeds, 95% t interval "
        f"({', '.join(f'{k}={v}' for k, v in first.settings.items())})",
        xaxis={"title": first.x_name, "type": "log" if first.x_name in LOG_X else "linear"},
        yaxis={"title": f"mean ||M(phi(k)) - v|| / ||v|| ({SCALE})"},
        template="plotly_white",
    )
    return fig


def title(results: list[ProbeResult]) -> str:
    """`probe capacity: deltanet, linear_attention` (the page's title and heading)."""
    specs = ", ".join(dict.fromkeys(r.spec for r in results))
    return f"probe {results[0].probe}: {specs}"


def page(results: list[ProbeResult]) -> str:
    """One self-contained HTML page (plotly.js inline): a title, what the error means, the
    notes on gates tuned at the edge of their grid, and the figure."""
    from plotly.offline import get_plotlyjs

    name = html.escape(title(results))
    notes = [note for result in results for note in result.notes()]
    figure = draw(results).to_html(
        full_html=False, include_plotlyjs=False, config={"displaylogo": False}
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{name}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        "</head><body>",
        f"<h1>{name}</h1>",
        f"<p>Recall error ||M(phi(k)) - v|| / ||v||: {html.escape(SCALE)}.</p>",
        *(f"<p><em>note: {html.escape(note)}</em></p>" for note in notes),
        figure,
        "</body></html>",
    ]
    return "\n".join(parts)
