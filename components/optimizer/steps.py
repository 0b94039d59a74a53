"""Several steps per token: the fields and behaviour that the optimizers taking n steps per token
share (gd, momentum, nesterov, muon; docs/spec.md, "Several steps per token").

The runtime runs the n steps as n sub-steps of the one-step rule (`miras.runtime.substeps`):
the optimizer's update and state advance at every step, the retention's decay applies at the
first step of each token only, and the read follows the last.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import SerializerFunctionWrapHandler, model_serializer

from miras.components.base import POSITIVE, GateDefaults, Optimizer, Range, number

# The most gradient steps a token may take (`steps`): each one is a step of the sequence the
# runtime runs, so n multiplies its length.
MAX_STEPS = 16


class SteppedOptimizer(Optimizer):
    """An optimizer that may take `steps: n` steps per token, on the token's key and value or
    (`keys: per_step`) on n keys and values of its own (DeltaProduct, Siems et al. 2025,
    arXiv:2502.10297, eq. 4)."""

    # n steps per token, the one-step rule composed n times; the retention's decay applies
    # once per token, at its first step.
    steps: number(Range(1, MAX_STEPS, lo_closed=True, hi_closed=True), integer=True) = 1
    # "same": every step reads the token's k, v and lr; "per_step": k, v and lr carry n per
    # token, packed [B, T*n, ...] (fla's DeltaProduct packing: step j of token t at t*n + j).
    keys: Literal["same", "per_step"] = "same"
    # The ceiling of the learned step size in a model layer: lr = lr_max sigmoid(.), so the
    # gate spans (0, lr_max). On unit keys the l2 delta rule's transition I - lr k k^T has the
    # eigenvalue 1 - lr along k: lr_max 1 keeps it in [0, 1), 2 lets it reach down to -1
    # (fla's allow_neg_eigval; Grazzi et al. 2025, "Unlocking State-Tracking in Linear RNNs
    # Through Negative Eigenvalues"), where it still contracts (|1 - lr| < 1).
    lr_max: number(POSITIVE) = 1.0

    @model_serializer(mode="wrap")
    def _long_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The long form leaves out `steps: 1` and `keys: same`, and `lr_max: 1`, so a spec
        without them keeps the digest it had before these fields existed (compile caches,
        stored studies)."""
        data = handler(self)
        if data.get("steps") == 1 and data.get("keys") == "same":
            data.pop("steps")
            data.pop("keys")
        if data.get("lr_max") == 1.0:
            data.pop("lr_max")
        return data

    def defaults_of(self, name: str) -> GateDefaults:
        """The step size's ceiling is `lr_max` (the declared start and probe values stay)."""
        declared = super().defaults_of(name)
        if name != self.step_size_gate:
            return declared
        return dataclasses.replace(declared, ceiling=self.lr_max)

    def steps_per_token(self) -> int:
        return self.steps

    def per_step_inputs(self) -> tuple[str, ...]:
        return ("k", "v", "lr") if self.keys == "per_step" else ()

    def spec_problems(self, spec: Any) -> list:
        """Where n steps per token are not defined: they run as n sub-steps of one-step rule,
        with the retention's decay at the first one only and no window."""
        from miras.errors import Problem

        problems = []
        step_size = getattr(self, self.step_size_gate or "", "gate")
        if self.lr_max != 1.0 and step_size != "gate":
            problems.append(
                Problem(
                    "optimizer.lr_max",
                    f"lr_max bounds the learned {self.step_size_gate} gate in a model layer; "
                    f"{self.step_size_gate} is fixed at {step_size!r}: set "
                    f"{self.step_size_gate}: gate, or leave lr_max out",
                )
            )
        if self.keys == "per_step" and self.steps == 1:
            problems.append(
                Problem(
                    "optimizer.steps",
                    "keys: per_step gives each of a token's steps its own key and value; it "
                    "needs steps >= 2, got steps: 1 (or use keys: same)",
                )
            )
        if self.steps == 1:
            return problems
        why = f"steps: {self.steps} runs n {self.kind} steps per token"
        if not spec.memory.parametric:
            problems.append(
                Problem(
                    "optimizer.steps",
                    f"{why}; nonparametric memory is softmax attention, which takes no "
                    "gradient step: use steps 1",
                )
            )
            return problems
        retention = spec.retention
        if not retention.linear_step:
            problems.append(
                Problem(
                    "optimizer.steps",
                    f"{why}, with the retention's decay once per token and none in between: "
                    "the retention must be none or l2 (W_t = a_t W_(t-1) - u_t), got "
                    f"{retention.kind!r}",
                )
            )
        elif retention.decay_gate and getattr(retention, retention.decay_gate) not in ("gate", 1):
            problems.append(
                Problem(
                    f"retention.{retention.decay_gate}",
                    f"{why}, with the decay once per token: the decay must be 'gate' (a "
                    "per-token input, which the steps after the first see as 1) or 1, got "
                    f"{getattr(retention, retention.decay_gate)!r}",
                )
            )
        if spec.window.c != 1:
            problems.append(
                Problem(
                    "window.c",
                    f"{why} on the token's own objective; an Omega window (c > 1) sums earlier "
                    f"tokens' losses into each step, which it does not define: use window 1, got "
                    f"{spec.window.c!r}",
                )
            )
        return problems

    def steps_lines(self) -> list:
        """The display note under u_t when the step is taken n times per token."""
        from miras.derive.terms import Line

        if self.steps == 1:
            return []
        each = (
            "on k_t,j, v_t,j with lr_t,j, j = 1..n (keys: per_step)"
            if self.keys == "per_step"
            else "on the same k_t, v_t"
        )
        note = (
            f"(steps: {self.steps}: the whole step n times per token {each}; the decay a_t at "
            "the first only, o_t after the last)"
        )
        return [Line(None, None, note)]
