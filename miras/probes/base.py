"""The probe engine: write a synthetic stream with a compiled rule, read keys back, score.

No outer training and no model. An `Episode` is one synthetic stream and the keys to read back
after it; the engine writes it with the rule's own recurrence (backend `recurrent`, float64),
reads M(phi(k)) from the final state and scores the mean relative recall error
||M(phi(k)) - v|| / ||v|| over the read pairs.

Gates: every gate the rule takes is held constant over the stream. The learning rate is
normalized by the feature norm, lr_t = lr / ||phi(k_t)||^2 (so lr = 1 on an l2 matrix memory is
the exact delta rule / Kaczmarz step; lr is the optimizer's `step_size_gate`). Each probe picks
the gate values per rule by a small grid search (`gate_grid`, over the candidates each gate's
component declares: `GateDefaults.probe_values`) on a tuning seed that no scoring seed shares;
every configuration of the grid runs at once, one per head of the rule's [B, T, H, D] inputs.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from miras.rule import MemoryRule
from miras.runtime import minimizer_weights
from miras.spec import Spec
from miras.stats import confidence_interval
from miras.tasks.capacity import as_rule


def declared_grid(spec: Spec) -> dict[str, tuple[float, ...]]:
    """Candidate values per gate name, as the spec's components (and its window, for gamma)
    declare them (`GateDefaults.probe_values`): the step size's multiply 1 / ||phi(k)||^2, a
    decay of 1 is no forgetting. A gate that declares none is left out."""
    owners = [*spec.components().values(), spec.window]
    return {
        name: defaults.probe_values
        for owner in owners
        for name, defaults in owner.gate_defaults.items()
        if defaults.probe_values is not None
    }


# What the recall error means, for every table and figure of a probe.
SCALE = "0 is exact recall; 1 is no better than reading zero"


@dataclass
class Episode:
    """One synthetic stream and what to read after it.

    write_k [B, T, d_k], write_v [B, T, d_v]: the stream, in order; read_k [B, M, d_k] and
    read_v [B, M, d_v]: the keys read from the final state and the values they should give."""

    write_k: torch.Tensor
    write_v: torch.Tensor
    read_k: torch.Tensor
    read_v: torch.Tensor


# (x, seed) -> the episode at that sweep point; trials are the batch dimension B.
EpisodeMaker = Callable[[int | float, int], Episode]


@dataclass
class Point:
    """One sweep point: the per-seed errors and their mean with a 95% t interval."""

    x: int | float
    errors: list[float]
    mean: float
    low: float
    high: float


@dataclass
class ProbeResult:
    """A probe's curve for one rule: `points` over the sweep `x_name`, the tuned gates, the
    tuning score (mean error over the sweep on the tuning seed) of every configuration tried,
    and `edges`: each tuned gate whose value is the smallest or largest its grid tried, where
    the gate's range goes on ({'lr': 'largest'}): the best value may lie past the grid."""

    probe: str
    spec: str
    x_name: str
    points: list[Point]
    gates: dict[str, float]
    tuning: list[tuple[dict[str, float], float]] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    edges: dict[str, str] = field(default_factory=dict)

    def notes(self) -> list[str]:
        """One line per gate in `edges`, naming the values tried and how to widen them."""
        lines = []
        for name, side in self.edges.items():
            tried = sorted({config[name] for config, _ in self.tuning})
            values = ", ".join(f"{v:g}" for v in tried)
            lines.append(
                f"{self.spec}: {name}={self.gates[name]:g} is the {side} value the tuning tried "
                f"({values}); the best may lie beyond: widen it with --option "
                f"grid={{{name}: [...]}}, or fix it with --gate {name}=VALUE"
            )
        return lines

    def rows(self) -> list[dict]:
        """One plain dict per point (what the table and the figure read)."""
        return [
            {
                "probe": self.probe,
                "spec": self.spec,
                self.x_name: p.x,
                "mean": p.mean,
                "low": p.low,
                "high": p.high,
                "seeds": len(p.errors),
                "diverged": sum(not math.isfinite(e) for e in p.errors),
            }
            for p in self.points
        ]


def gate_grid(
    rule: MemoryRule, *, grid: dict[str, Sequence[float]] | None = None, max_configs: int = 48
) -> list[dict[str, float]]:
    """Every combination of the declared candidates (`declared_grid`; or `grid`'s, per gate)
    for the rule's gates; a seeded subset of `max_configs` when there are more. [{}] for a rule
    without gates."""
    table = {**declared_grid(rule.spec), **(grid or {})}
    missing = [name for name in rule.gates if name not in table]
    if missing:
        raise ValueError(
            f"gates: no candidate values for {', '.join(missing)} (the rule takes "
            f"{', '.join(rule.gates)}); pass grid={{'{missing[0]}': [values]}} or fixed gates"
        )
    combos = [
        dict(zip(rule.gates, values, strict=True))
        for values in itertools.product(*(table[name] for name in rule.gates))
    ]
    if len(combos) > max_configs:
        combos = random.Random(0).sample(combos, max_configs)
    return combos


def grid_edges(
    rule: MemoryRule, configs: Sequence[dict[str, float]], chosen: dict[str, float]
) -> dict[str, str]:
    """The gates of `chosen` at the smallest or largest value `configs` tried, where the gate's
    range (its component's `gateable`) has room past it: decay = 1 (no forgetting) or
    momentum = 0 is the end of the range, not of the grid, and is not reported."""
    ranges = {
        name: comp.gateable[name]
        for comp in rule.spec.components().values()
        for name in comp.gates()
    }
    edges = {}
    for name, value in chosen.items():
        tried = sorted({config[name] for config in configs})
        allowed = ranges.get(name)
        if len(tried) < 2:
            continue
        if value == tried[0] and (allowed is None or value > allowed.lo):
            edges[name] = "smallest"
        elif value == tried[-1] and (allowed is None or value < allowed.hi):
            edges[name] = "largest"
    return edges


def recall_errors(
    rule: MemoryRule, episode: Episode, configs: Sequence[dict[str, float]]
) -> torch.Tensor:
    """Write the episode once per gate configuration (one head each) and read it back.
    Returns [H, B]: the mean relative recall error over the read pairs, per configuration
    (H = len(configs)) and trial."""
    k, v = episode.write_k, episode.write_v
    # A rule with n keys per token (DeltaProduct's `keys: per_step`) writes the stream n pairs
    # a token, after pad < n empty steps (lr 0) so that n divides its length.
    opt = rule.spec.optimizer
    n = opt.steps_per_token() if "k" in opt.per_step_inputs() else 1
    pad = (-k.shape[1]) % n
    k, v = (torch.cat([x.new_zeros(x.shape[0], pad, x.shape[2]), x], dim=1) for x in (k, v))
    b, t, _ = k.shape
    h = len(configs)
    seq_k = k[:, :, None].expand(b, t, h, k.shape[-1])  # [B, T, H, d_k]
    seq_v = v[:, :, None].expand(b, t, h, v.shape[-1])
    params = rule.default_params(k.dtype)
    norm2 = rule.program.feature(k, params).pow(2).sum(-1, keepdim=True)  # [B, T, 1]
    norm2[:, :pad] = math.inf  # the empty steps: lr 0
    gates = {}
    for info in rule.plan.gates:
        values = torch.tensor([c[info.name] for c in configs], dtype=k.dtype)  # [H]
        step_size = info.role == "step_size"
        gates[info.name] = values / norm2 if step_size else values.expand(b, t // n, h)
    seq_q = seq_k[:, n - 1 :: n]  # unread: the probe reads the final state
    _, state = rule(seq_q, seq_k, seq_v, gates, backend="recurrent", output_final_state=True)
    state = {"W": state} if isinstance(state, torch.Tensor) else state
    if rule.plan.chunk_form.form == "minimizer":  # statistics: W solves the normal equations
        name = rule.spec.optimizer.ridge_gate
        ridge = gates[name][:, -1, :, None] if name in gates else rule.spec.optimizer.ridge
        ridge = torch.as_tensor(ridge, dtype=k.dtype)
        state = {"W": minimizer_weights(rule.plan.chunk_form, state, ridge)}
    read_k = episode.read_k[:, None].expand(b, h, *episode.read_k.shape[1:])  # [B, H, M, d_k]
    read = rule.program.read(read_k, state)  # [B, H, M, d_v]
    target = episode.read_v[:, None]
    error = ((read - target).norm(dim=-1) / target.norm(dim=-1)).mean(-1)  # [B, H]
    return torch.nan_to_num(error, nan=float("inf")).transpose(0, 1)


def run_probe(
    name: str,
    rule_or_spec,
    make: EpisodeMaker,
    xs: Sequence[int | float],
    *,
    x_name: str,
    seeds: int = 5,
    seed: int = 0,
    gates: dict[str, float] | None = None,
    grid: dict[str, Sequence[float]] | None = None,
    settings: dict | None = None,
) -> ProbeResult:
    """Tune the gates on seed `seed` (unless `gates` fixes them), then score every x on seeds
    seed + 1 .. seed + seeds: each seed's error is the mean over its trials."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds: expected a positive integer, got {seeds!r}")
    if not xs:
        raise ValueError(f"{x_name}: expected at least one sweep value, got none")
    rule = as_rule(rule_or_spec)
    if rule.spec.memory.closed_form() is not None:
        raise ValueError(
            f"spec {rule.spec.name!r}: memory {rule.spec.memory.kind!r} keeps every pair (no "
            "weights to read back); the probes take a parametric memory (matrix, mlp, gated_mlp)"
        )
    tuning: list[tuple[dict[str, float], float]] = []
    if gates is None:
        configs = gate_grid(rule, grid=grid)
        scores = torch.stack([recall_errors(rule, make(x, seed), configs).mean(-1) for x in xs])
        per_config = scores.mean(0)  # [H]: mean over the sweep
        tuning = [(c, float(s)) for c, s in zip(configs, per_config.tolist(), strict=True)]
        chosen = configs[int(torch.argmin(per_config))]
        edges = grid_edges(rule, configs, chosen)
    else:
        unknown = sorted(set(gates) ^ set(rule.gates))
        if unknown:
            raise ValueError(
                f"gates: expected values for exactly {sorted(rule.gates)}, got {sorted(gates)}"
            )
        chosen = dict(gates)
        edges = {}  # fixed by the caller: nothing was tuned
    points = []
    for x in xs:
        errors = [
            float(recall_errors(rule, make(x, s), [chosen])[0].mean())
            for s in range(seed + 1, seed + 1 + seeds)
        ]
        mean, low, high = confidence_interval(errors)
        points.append(Point(x, errors, mean, low, high))
    return ProbeResult(name, rule.spec.name, x_name, points, chosen, tuning, settings or {}, edges)
