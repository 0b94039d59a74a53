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

    def __reduce__(self):  # rebuilt from its fields across processes (a search's workers)
        return type(self), (self.source, self.problems)


class DerivationError(ValueError):
    """The compiler cannot derive a rule the spec asks for (e.g. F' has no closed-form inverse)."""


class TrainingDiverged(ValueError):
    """The training loss, the gradient norm or a memory layer's forward pass became NaN or
    infinite; `step` names where, `detail` the layer's report (`ForwardDiverged`) if any."""

    def __init__(self, step: int, what: str, value: float, detail: str | None = None):
        self.step, self.what, self.value, self.detail = step, what, value, detail
        if step == 1:  # before any update: the model as initialized, not the learning rate
            advice = (
                "this is before any update, so the cause is the model at initialization (its "
                "starting values, or the inputs), not the learning rate"
            )
        else:
            advice = "lower the learning rate, tighten grad_clip, or check the gates' ranges"
        where = f"; {detail}" if detail else ""
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}; {advice}{where}"
        )

    def __reduce__(self):
        return type(self), (self.step, self.what, self.value, self.detail)


class ForwardDiverged(ValueError):
    """A model's forward pass went non-finite: `token` (the first in time) and the message say
    where, and the likely cause. Training reports it as `TrainingDiverged`."""

    def __init__(self, message: str, token: int):
        self.token = token
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.args[0], self.token)
