"""Memory capacity of the delta rule: a matrix memory vs the degree-2 tensor feature map.

    .venv/bin/python benchmarks/capacity.py [--d-k 8] [--trials 8] [--epochs 200] [--seed 0]
                                            [--keys unit] [--out runs/capacity.html]

Stores N random key-value pairs with the compiled rule alone (specs/deltanet.yaml, and the same
rule with `feature_map: taylor`), reads every key back, and prints the mean relative recall
error against N with the least-squares optimum and the prediction sqrt(1 - r/N). The capacity r
is d_k for the matrix memory and C(d_k + 2, 2) for the tensor map (one less with unit keys).
The figure (plotly HTML) goes to --out. Procedure: miras/tasks/capacity.py; figures: docs/tasks.md.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import yaml

from miras.tasks.capacity import capacity_table, transition

ROOT = Path(__file__).resolve().parent.parent


def memories() -> dict[str, dict]:
    """DeltaNet's shipped spec, and the same rule with the degree-2 tensor map."""
    deltanet = yaml.safe_load((ROOT / "specs" / "deltanet.yaml").read_text())
    return {
        "matrix (identity)": deltanet,
        "taylor (degree 2)": {**deltanet, "name": "deltanet-taylor", "feature_map": "taylor"},
    }


def pair_counts(d_k: int) -> list[int]:
    """N around both transitions: d_k / 4 .. 3 d_k and C(d_k + 2, 2) / 4 .. 3 C(d_k + 2, 2)."""
    big = math.comb(d_k + 2, 2)
    points = set()
    for r in (d_k, big):
        points |= {r // 4, r // 2, (3 * r) // 4, r - 1, r, r + 1, (3 * r) // 2, 2 * r, 3 * r}
    points |= {big - 4, big + 4}
    return sorted(p for p in points if p >= 1)


def draw(rows: list[dict], d_k: int):
    """The figure: recall error against N, one colour per memory; plotly is imported here."""
    import plotly.graph_objects as go

    fig = go.Figure()
    colours = ["#1f77b4", "#d62728"]
    for colour, memory in zip(colours, dict.fromkeys(r["memory"] for r in rows), strict=False):
        mine = [r for r in rows if r["memory"] == memory]
        n = [r["n_pairs"] for r in mine]
        for column, dash, label in (
            ("rule_error", "solid", "delta rule"),
            ("least_squares_error", "dot", "least squares"),
            ("theory_error", "dash", "sqrt(1 - r/N)"),
        ):
            fig.add_trace(
                go.Scatter(
                    x=n,
                    y=[r[column] for r in mine],
                    mode="lines+markers" if column == "rule_error" else "lines",
                    line={"color": colour, "dash": dash},
                    name=f"{memory}: {label}",
                )
            )
        fig.add_vline(x=mine[0]["rank"], line={"color": colour, "dash": "dot", "width": 1})
    fig.update_layout(
        title=f"Capacity of the delta rule, d_k = {d_k} (vertical lines: r = rank of phi(K))",
        xaxis={"title": "stored pairs N", "type": "log"},
        yaxis={"title": "mean ||M(k) - v|| / ||v||"},
        template="plotly_white",
    )
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-k", type=int, default=8)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keys", default="unit", choices=["unit", "gaussian", "orthogonal"])
    parser.add_argument("--out", type=Path, default=Path("runs/capacity.html"))
    args = parser.parse_args()

    start = time.perf_counter()
    rows = capacity_table(
        memories(),
        args.d_k,
        pair_counts(args.d_k),
        trials=args.trials,
        seed=args.seed,
        keys=args.keys,
        epochs=args.epochs,
    )
    seconds = time.perf_counter() - start
    print(f"d_k = {args.d_k}, {args.keys} keys, {args.trials} trials, {args.epochs} passes")
    print(f"{'memory':20s} {'N':>5s} {'rule':>8s} {'lstsq':>8s} {'theory':>8s}")
    for r in rows:
        print(
            f"{r['memory']:20s} {r['n_pairs']:5d} {r['rule_error']:8.3f} "
            f"{r['least_squares_error']:8.3f} {r['theory_error']:8.3f}"
        )
    print()
    for memory in dict.fromkeys(r["memory"] for r in rows):
        mine = [r for r in rows if r["memory"] == memory]
        rule = [(r["n_pairs"], r["rule_error"]) for r in mine]
        best = [(r["n_pairs"], r["least_squares_error"]) for r in mine]
        print(
            f"{memory}: rank r = {mine[0]['rank']}; last N with error <= 0.1: "
            f"delta rule {transition(rule)}, least squares {transition(best)}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(rows, args.d_k).write_html(args.out, include_plotlyjs=True)
    print(f"\nfigure: {args.out} ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
