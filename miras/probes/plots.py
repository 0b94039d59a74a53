"""Probe figures: the rows of `ProbeResult.rows()` drawn with plotly (imported only here)."""

from __future__ import annotations

from miras.probes.base import ProbeResult

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
        yaxis={"title": "mean ||M(phi(k)) - v|| / ||v||"},
        template="plotly_white",
    )
    return fig
