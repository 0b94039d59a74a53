"""One trial: sample a spec and training settings, validate and compile, train, score.

What a finished trial keeps (Optuna user attributes, all JSON):
  spec       the full spec, YAML (long form), which `miras export` writes out
  train      the training arguments used
  metrics    the final evaluation, plus the measures state_size and throughput
  reason     why a trial was pruned: 'invalid: ...' (the sampled combination is impossible),
             'diverged: ...', or 'pruned at step N' (the pruner)
  worker     host:pid of the process that ran it
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any

import optuna

from miras.errors import DerivationError, SpecError, TrainingDiverged
from miras.rule import compile as compile_rule
from miras.search.space import sample
from miras.search.study import StudyDef
from miras.spec import Spec, load_spec
from miras.training_config import TrainConfig


class TrialInvalid(optuna.TrialPruned):
    """The sampled combination cannot be built (the spec or the model rejects it)."""


def trial_spec(study: StudyDef, trial: optuna.Trial) -> dict[str, Any]:
    """The spec of this trial as a dict (the sampled values in the template)."""
    return {"name": f"{study.name}-t{trial.number}", **sample(study.spec_space, trial)}


def trial_train(study: StudyDef, trial: optuna.Trial) -> dict[str, Any]:
    """The trial's training settings, step-dependent defaults resolved (miras.TrainConfig)."""
    return TrainConfig.model_validate(sample(study.train_space, trial)).resolved()


def build(study: StudyDef, trial: optuna.Trial) -> tuple[Spec, dict[str, Any]]:
    """Sample, validate and compile; an impossible combination prunes the trial with its reason."""
    data = trial_spec(study, trial)
    train = trial_train(study, trial)
    try:
        spec = load_spec(data)
        compile_rule(spec)  # derived and checked against autograd; cached per process
    except (SpecError, DerivationError) as err:
        raise _invalid(trial, err) from None
    trial.set_user_attr("spec", spec.to_yaml())
    trial.set_user_attr("train", train)
    return spec, train


def _invalid(trial: optuna.Trial, err: Exception) -> TrialInvalid:
    reason = "invalid: " + " ".join(str(err).split())
    trial.set_user_attr("reason", reason)
    return TrialInvalid(reason)


def run_trial(study: StudyDef, task: Any, trial: optuna.Trial) -> float | list[float]:
    """The Optuna objective. Intermediate evaluations feed the pruner (single objective)."""
    from miras.training import train  # torch and the models: only in processes that train

    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    spec, args = build(study, trial)
    first = study.metrics[0]
    prunes = not study.multi_objective and study.pruner_def().kind != "none"

    def report(step: int, metrics: dict[str, float]) -> None:
        if not prunes or first not in metrics or not math.isfinite(metrics[first]):
            return
        trial.report(metrics[first], step)
        if trial.should_prune():
            trial.set_user_attr("reason", f"pruned at step {step}: {first} {metrics[first]:.4g}")
            raise optuna.TrialPruned(f"pruned at step {step}")

    began = time.perf_counter()
    try:
        result = train(spec, task, **args, callback=report, progress=False)
    except TrainingDiverged as err:
        trial.set_user_attr("reason", f"diverged: {err}")
        raise optuna.TrialPruned(str(err)) from None
    except optuna.TrialPruned:
        raise
    except ValueError as err:
        # The model or trainer refused the sampled combination (a variant that needs a
        # parametric memory, a size that does not fit): a named input error, so prune.
        raise _invalid(trial, err) from None
    seconds = time.perf_counter() - began
    metrics = dict(result.metrics)
    metrics["state_size"] = float(state_size(spec, task.seq_len))
    metrics["throughput"] = result.steps * args["batch_size"] * task.seq_len / max(seconds, 1e-9)
    trial.set_user_attr("metrics", metrics)
    trial.set_user_attr("seconds", seconds)
    values = [metrics[name] for name in study.metrics]
    bad = [
        name for name, value in zip(study.metrics, values, strict=True) if not math.isfinite(value)
    ]
    if bad:
        trial.set_user_attr("reason", f"diverged: {', '.join(bad)} is not finite")
        raise optuna.TrialPruned(f"{', '.join(bad)} is not finite")
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------------------------------------
# Measures


def state_size(spec: Spec, seq_len: int) -> int:
    """Floats of recurrent state a decoder keeps per sequence at length `seq_len`, over all
    layers: the memory's parameters W (and momentum S), the Omega window's last c - 1 keys and
    values, and softmax attention's key-value cache (full, or windowed). The short conv's few
    cached inputs are left out (a constant, the same for every spec)."""
    model = spec.model
    heads, d_head = model.n_heads, model.head_dim
    kv = 2 * d_head * heads  # one token's key and value over the heads

    def attention(window: int | None) -> int:
        return kv * min(seq_len, window or seq_len)

    variant = model.variant
    if variant == "attention":
        per_layer = attention(None)
    elif variant == "swa":
        per_layer = attention(model.swa_window)
    elif not spec.memory.parametric:  # softmax attention: its KV cache
        per_layer = attention(spec.memory.window)
    else:
        # The window's carried tokens: c - 1, or the whole prefix for `window: global`.
        past = seq_len if spec.window.is_global else spec.window.c - 1
        per_layer = _memory_state(spec, d_head) * heads + kv * past
        if variant in ("mal", "mag"):
            per_layer += attention(model.swa_window)
        elif variant == "mac":
            per_layer += kv * (model.mac_segment + model.persistent_tokens)
    return per_layer * model.n_layers


def _memory_state(spec: Spec, d_head: int) -> int:
    """Floats of one head's memory state: W's matrices (MLP layers), doubled with momentum."""
    rule = compile_rule(spec, checked=False)
    d_phi = spec.feature_map.output_dim(d_head)
    count = sum(math.prod(shape) for shape in rule.runtime.shapes(d_phi, d_head).values())
    return count * (2 if rule.runtime.has_momentum else 1)
