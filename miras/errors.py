"""Errors that name what is wrong and what is allowed."""

from __future__ import annotations

import difflib
from dataclasses import dataclass


def did_you_mean(word: str, choices) -> str:
    """' (did you mean 'x'?)' for a near miss, '' otherwise."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class FormulaError(ValueError):
    """A formula in a spec is malformed or uses something outside the whitelist."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where it is (a dotted field path) and what to do."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class SpecError(ValueError):
    """Every problem found in one spec, reported at once.

    `source` names the file (or '<dict>', '<yaml text>'); `problems` lists each bad field.
    """

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{source}: {n} problem{'s' if n != 1 else ''} in the spec"
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


class DerivationError(ValueError):
    """The compiler cannot derive a rule the spec asks for (e.g. F' has no closed-form inverse)."""


class TrainingDiverged(ValueError):
    """The training loss (or the gradient norm) became NaN or infinite; `step` names where."""

    def __init__(self, step: int, what: str, value: float):
        self.step, self.what, self.value = step, what, value
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}; lower the learning rate, "
            "tighten grad_clip, or check the gates' ranges"
        )
