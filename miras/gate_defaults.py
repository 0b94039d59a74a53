"""`GateDefaults`: what the code outside a component needs to know about one of its gates.

A leaf module (it imports nothing of miras), so both the components that declare them
(`miras.components.base`: `Component.gate_defaults`, which offers `GateDefaults` under its own
name too) and the IR's gate records (`miras.ir.GateInfo.defaults`) name it without importing
each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GateDefaults:
    """How the code outside a component treats one of its gates, besides its range (the
    component's `gateable`); the component declares it in `gate_defaults`, by the gate's name.

    `start`: the natural-space value a model layer's learned gate starts at
    (`miras.models.layer.GateMaps`), a number or a function of the head index (a per-head
    schedule). `ceiling`: the upper end the layer keeps the gate below, inside a range open
    above (None: the range's own). `probe_values`: the candidates the probes' grid search tries
    (`miras.probes.gate_grid`; None: none, so a probe asks for them)."""

    start: float | Callable[[int], float] = 1.0
    ceiling: float | None = None
    probe_values: tuple[float, ...] | None = None

    def start_at(self, head: int) -> float:
        """The start of head `head`."""
        return self.start(head) if callable(self.start) else self.start
