"""The training settings, typed, with the one set of defaults that `miras.train`, `miras train`
and a study's `train:` section all use (docs/training.md).

    config = TrainConfig.make(steps=500, lr=1e-2)   # every problem at once, as a ValueError
    config.warmup_steps, config.eval_interval       # the defaults that depend on `steps`
    config.trajectory()                             # what a checkpoint records and resume checks

Imports no torch: the CLI reads its option defaults from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miras.spec.validation import translate

# The settings a resumed run must share with its checkpoint to continue exactly.
TRAJECTORY = (
    "steps",
    "batch_size",
    "lr",
    "warmup",
    "weight_decay",
    "grad_clip",
    "seed",
    "precision",
)
RANK_TIMEOUT = 300.0  # seconds a rank waits for the others under torchrun (not a setting)
# Upper bounds (docs/spec.md, Limits): far past any run, short of an int64 or a day's allocation.
MAX_STEPS = 10**9
MAX_BATCH = 1 << 16


class TrainConfig(BaseModel):
    """How a model is trained: AdamW, linear warmup then cosine decay, gradient clipping,
    evaluations on validation batches. Immutable; unknown settings are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(1000, ge=1, le=MAX_STEPS, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, le=MAX_BATCH, description="Sequences per step.")
    lr: float = Field(3e-3, gt=0, allow_inf_nan=False, description="Peak learning rate (AdamW).")
    warmup: int | None = Field(
        None, ge=0, le=MAX_STEPS, description="Linear warmup steps; default: a tenth of the steps."
    )
    weight_decay: float = Field(0.1, ge=0, allow_inf_nan=False, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, allow_inf_nan=False, description="Gradient-norm clip.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the model's initialization.")
    eval_every: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="Steps between evaluations; default: a tenth of the steps.",
    )
    eval_batches: int = Field(
        4, ge=1, le=MAX_BATCH, description="Validation batches per evaluation."
    )
    log_every: int = Field(10, ge=1, le=MAX_STEPS, description="Steps between training records.")
    early_stop: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Stop at the first evaluation whose primary metric (validation) reaches "
        "this value, in the task's direction (>= for accuracy, <= for perplexity); "
        "default: off.",
    )
    precision: Literal["fp32", "bf16"] | None = Field(
        None,
        description="fp32, or bf16: autocast for the projections, the memory state and loss "
        "in float32. Default: fp32 (a resumed run keeps its checkpoint's).",
    )

    @classmethod
    def make(
        cls, config: TrainConfig | Mapping[str, Any] | None = None, **settings: Any
    ) -> TrainConfig:
        """`config` (a TrainConfig or a mapping) with `settings` replacing its values; a
        ValueError names every bad or unknown setting and the allowed ones."""
        base = config.model_dump(exclude_unset=True) if isinstance(config, TrainConfig) else {}
        if isinstance(config, Mapping):
            base = dict(config)
        try:
            return cls.model_validate({**base, **settings})
        except ValidationError as error:
            problems = translate(error, cls, noun="setting")
            raise ValueError("training: " + "; ".join(str(p) for p in problems)) from None

    @property
    def warmup_steps(self) -> int:
        return self.steps // 10 if self.warmup is None else self.warmup

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)

    @property
    def precision_name(self) -> str:
        return self.precision or "fp32"

    def resolved(self) -> dict[str, Any]:
        """Every setting with the defaults filled in (a study's record of a trial;
        `miras.train(spec, task, **resolved)` repeats it)."""
        return {
            **self.model_dump(),
            "warmup": self.warmup_steps,
            "eval_every": self.eval_interval,
            "precision": self.precision_name,
        }

    def trajectory(self) -> dict[str, Any]:
        """The settings that decide the parameters a run reaches, resolved: a checkpoint
        records them and a resumed run must use the same ones."""
        resolved = self.resolved()
        return {name: resolved[name] for name in TRAJECTORY}


DEFAULTS = TrainConfig()
