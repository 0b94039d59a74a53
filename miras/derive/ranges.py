"""`Range`, an interval of allowed values: the bounds of a spec's parameters and gates.

A leaf module (it imports nothing of miras), so both the components that declare their bounds
(`miras.components.base`, which offers `Range` under its own name too) and the IR's gate
records (`miras.ir.GateInfo.allowed`) name it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """An interval of allowed values, printed the way the math writes it: (0, 1]."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_closed: bool = False
    hi_closed: bool = False

    def __contains__(self, value: float) -> bool:
        above = value >= self.lo if self.lo_closed else value > self.lo
        below = value <= self.hi if self.hi_closed else value < self.hi
        return above and below

    def __str__(self) -> str:
        left = "[" if self.lo_closed else "("
        right = "]" if self.hi_closed else ")"
        lo = "-inf" if self.lo == -math.inf else _bound(self.lo)
        hi = "inf" if self.hi == math.inf else _bound(self.hi)
        return f"{left}{lo}, {hi}{right}"


def _bound(value: float) -> str:
    """A bound as written in docs/spec.md: 1048576, not 1.04858e+06."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


__all__ = ["Range"]
