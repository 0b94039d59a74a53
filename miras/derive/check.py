"""Results of the derived-vs-reference checks that `miras check` prints and tests assert."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckResult:
    """One comparison: `piece` (what was checked, against what), its error and tolerance."""

    piece: str
    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max(|expected|, 1): relative where values are large, absolute
    where they are near zero (so an exact zero is not divided by)."""
    scale = expected.abs().clamp_min(1.0)
    return float(((actual - expected).abs() / scale).max().detach())
