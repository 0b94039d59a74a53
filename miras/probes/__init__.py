"""Probes of the bare rule: in-context memorization on synthetic streams, no outer training.

docs/probes.md says how to run them; docs/claims.md what they measured."""

from miras.probes.base import (
    Episode,
    Point,
    ProbeResult,
    confidence_interval,
    declared_grid,
    gate_grid,
    recall_errors,
    run_probe,
)
from miras.probes.suite import (
    PROBES,
    capacity,
    interference,
    nonlinear,
    outliers,
    recency,
    repetition,
)

__all__ = [
    "PROBES",
    "Episode",
    "Point",
    "ProbeResult",
    "capacity",
    "confidence_interval",
    "declared_grid",
    "gate_grid",
    "interference",
    "nonlinear",
    "outliers",
    "recall_errors",
    "recency",
    "repetition",
    "run_probe",
]
