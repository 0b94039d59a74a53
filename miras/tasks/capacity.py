"""The capacity probe: how many key-value pairs can a memory rule store and give back?

No outer training and no model: N random pairs (k_i, v_i) are written into a memory by the
compiled rule alone, then every key is read back (query = key) from the final state, and the
recall error is the mean of ||M(phi(k_i)) - v_i|| / ||v_i||.

Writing (`store`): the pairs are fed to the rule as one sequence, `epochs` passes over them in a
fresh random order each pass, with the learning-rate gate (the optimizer's `step_size_gate`)
lr_i = omega_e / ||phi(k_i)||^2 and the retention's decay gate at 1 (no forgetting).
For an l2 bias on a matrix memory (the delta rule) that step is Kaczmarz's projection
(omega = 1: after the write, W phi(k_i) = v_i exactly); repeated passes converge to an
interpolating W while one exists, i.e. while N <= rank(Phi). Past that point no W fits every
pair and a constant step cycles, so omega is 1 for the first half of the passes and then falls
linearly towards 0, which takes the iterates to the least-squares solution.

The least-squares view (`least_squares_curve`) is the limit of that procedure for a matrix
memory: W* = argmin sum_i ||W phi(k_i) - v_i||^2, exact for N <= r = rank(phi(K)) and with a
relative error of about sqrt(1 - r / N) beyond (the residual of a projection of random values
onto an r-dimensional space). r is the capacity: d_k for `identity`, C(d_k + 2, 2) for the
degree-2 tensor map `taylor`, one less when keys are unit vectors (sum_j k_j^2 = 1 ties the
squared features to the constant one). `feature_rank` measures it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from miras.rule import MemoryRule
from miras.rule import compile as compile_rule
from miras.spec import Spec

Keys = Literal["unit", "orthogonal", "gaussian"]
KEYS: tuple[str, ...] = ("unit", "orthogonal", "gaussian")
# The gates held constant while storing, by role (`GateInfo.role`): no forgetting.
CONSTANT_ROLES: dict[str, float] = {"decay": 1.0}


def delta_rule_spec(feature_map: str = "identity") -> dict:
    """DeltaNet's rule (l2 bias, no retention, gd with an lr gate) with a feature map."""
    return {
        "name": f"delta-{feature_map}",
        "memory": "matrix",
        "feature_map": feature_map,
        "bias": "l2",
        "retention": "none",
        "optimizer": {"kind": "gd", "lr": "gate"},
    }


def as_rule(rule_or_spec: MemoryRule | Spec | str | dict) -> MemoryRule:
    return rule_or_spec if isinstance(rule_or_spec, MemoryRule) else compile_rule(rule_or_spec)


def draw_pairs(
    d_k: int, d_v: int, n: int, *, trials: int, seed: int, keys: Keys = "unit"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [trials, n, d_k] and values [trials, n, d_v], float64, seeded by (seed, n).

    unit: uniform on the sphere (in general position); gaussian: N(0, I / d_k); orthogonal:
    orthonormal within each block of d_k consecutive keys (so exactly orthogonal for n <= d_k),
    a fresh random rotation per block. Values are N(0, I)."""
    if keys not in KEYS:
        raise ValueError(f"keys: expected one of {', '.join(KEYS)}, got {keys!r}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
    if keys == "orthogonal":
        blocks = -(-n // d_k)
        q, _ = torch.linalg.qr(torch.randn(trials, blocks, d_k, d_k, generator=gen).double())
        k = q.transpose(-1, -2).reshape(trials, blocks * d_k, d_k)[:, :n]
    else:
        k = torch.randn(trials, n, d_k, generator=gen, dtype=torch.float64)
        k = torch.nn.functional.normalize(k, dim=-1) if keys == "unit" else k / math.sqrt(d_k)
    v = torch.randn(trials, n, d_v, generator=gen, dtype=torch.float64)
    return k, v


def relaxation(epochs: int) -> torch.Tensor:
    """[epochs] step factors omega_e: 1 for the first half, then linearly towards 0."""
    e = torch.arange(epochs, dtype=torch.float64)
    return torch.clamp(2 * (1 - e / epochs), max=1.0)


def features(rule: MemoryRule, k: torch.Tensor) -> torch.Tensor:
    """phi(k): [..., d_k] -> [..., d_phi] with the rule's feature map (default parameters)."""
    return rule.program.feature(k)


def store(
    rule: MemoryRule,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    epochs: int,
    seed: int = 0,
    backend: str = "recurrent",
    chunk_size: int = 64,
    gates: dict[str, float] | None = None,
    lr_scale: float = 1.0,
):
    """Write pairs k [B, N, d_k], v [B, N, d_v] with the rule over `epochs` passes; return the
    final state (the rule's public form: [B, 1, d_v, d_phi] for a matrix memory with gd).
    `lr_scale` multiplies the Kaczmarz step (an MLP memory may need less than 1)."""
    n = k.shape[1]
    gen = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(n, generator=gen) for _ in range(epochs)]).reshape(-1)
    seq_k, seq_v = k[:, order, None], v[:, order, None]  # [B, E*N, 1, D]: one head
    norm2 = features(rule, k).pow(2).sum(-1)[:, order, None]  # [B, E*N, 1]
    # [1, E*N, 1] in k's dtype: the rule takes gates in the inputs' dtype
    omega = relaxation(epochs).repeat_interleave(n)[None, :, None].to(norm2.dtype)
    held = {i.name: CONSTANT_ROLES[i.role] for i in rule.plan.gates if i.role in CONSTANT_ROLES}
    constant = {**held, **(gates or {})}
    step_gates = {}
    for info in rule.plan.gates:
        name = info.name
        if info.role == "step_size":
            step_gates[name] = lr_scale * omega / norm2
        elif name in constant:
            step_gates[name] = torch.full_like(norm2, constant[name])
        else:
            raise ValueError(
                f"gates: the rule takes gate '{name}', which the probe holds constant; pass "
                f"gates={{'{name}': value}}"
            )
    _, state = rule(
        seq_k,
        seq_k,
        seq_v,
        step_gates,
        backend=backend,
        chunk_size=chunk_size,
        output_final_state=True,
    )
    return state


def recall(rule: MemoryRule, state, k: torch.Tensor) -> torch.Tensor:
    """Read M(phi(k)) for k [B, N, d_k] from a one-head state -> [B, N, d_v]."""
    return rule.program.read(k[:, None], state)[:, 0]  # one head: [B, 1, N, d_k] in


def recall_error(predicted: torch.Tensor, v: torch.Tensor) -> float:
    """Mean over pairs and trials of ||predicted - v|| / ||v||; [B, N, d_v] each."""
    return ((predicted - v).norm(dim=-1) / v.norm(dim=-1)).mean().item()


def capacity_curve(
    rule_or_spec: MemoryRule | Spec | str | dict,
    d_k: int,
    pair_counts: Sequence[int],
    *,
    trials: int = 8,
    seed: int = 0,
    keys: Keys = "unit",
    epochs: int = 200,
    d_v: int | None = None,
    backend: str = "recurrent",
    chunk_size: int = 64,
    gates: dict[str, float] | None = None,
    lr_scale: float = 1.0,
) -> list[tuple[int, float]]:
    """[(N, mean relative recall error)] after storing N pairs with the rule (`store`)."""
    rule = as_rule(rule_or_spec)
    _check(d_k, pair_counts, trials, epochs)
    curve = []
    for n in pair_counts:
        k, v = draw_pairs(d_k, d_v or d_k, n, trials=trials, seed=seed, keys=keys)
        state = store(
            rule,
            k,
            v,
            epochs=epochs,
            seed=seed,
            backend=backend,
            chunk_size=chunk_size,
            gates=gates,
            lr_scale=lr_scale,
        )
        curve.append((n, recall_error(recall(rule, state, k), v)))
    return curve


def least_squares_curve(
    rule_or_spec: MemoryRule | Spec | str | dict,
    d_k: int,
    pair_counts: Sequence[int],
    *,
    trials: int = 8,
    seed: int = 0,
    keys: Keys = "unit",
    d_v: int | None = None,
) -> list[tuple[int, float]]:
    """[(N, error)] of the best matrix memory W* = V^T pinv(phi(K))^T on the same pairs: the
    limit of `capacity_curve` for a matrix memory with an l2 bias."""
    rule = as_rule(rule_or_spec)
    _check(d_k, pair_counts, trials, 1)
    curve = []
    for n in pair_counts:
        k, v = draw_pairs(d_k, d_v or d_k, n, trials=trials, seed=seed, keys=keys)
        phi = features(rule, k)  # [B, N, d_phi]
        fit = phi @ (torch.linalg.pinv(phi) @ v)  # projection of v onto the span of phi's columns
        curve.append((n, recall_error(fit, v)))
    return curve


def feature_rank(
    rule_or_spec: MemoryRule | Spec | str | dict, d_k: int, *, keys: Keys = "unit", seed: int = 0
) -> int:
    """rank(phi(K)) over many random keys: the number of pairs a matrix memory can fit."""
    rule = as_rule(rule_or_spec)
    d_phi = features(rule, torch.zeros(1, d_k, dtype=torch.float64)).shape[-1]
    k, _ = draw_pairs(d_k, 1, 2 * d_phi + d_k, trials=1, seed=seed, keys=keys)
    return int(torch.linalg.matrix_rank(features(rule, k)[0]).item())


def theory_error(n: int, rank: int) -> float:
    """sqrt(1 - r / N) past capacity, 0 before: the least-squares residual of random values."""
    return math.sqrt(max(0.0, 1.0 - rank / n))


def transition(curve: Sequence[tuple[int, float]], threshold: float = 0.1) -> int | None:
    """The last N of the curve before the error first exceeds `threshold` (None if at once)."""
    last = None
    for n, error in curve:
        if error > threshold:
            break
        last = n
    return last


def capacity_table(
    memories: dict[str, MemoryRule | Spec | str | dict],
    d_k: int,
    pair_counts: Sequence[int],
    *,
    trials: int = 8,
    seed: int = 0,
    keys: Keys = "unit",
    epochs: int = 200,
) -> list[dict]:
    """One row per (memory, N): the rule's error, the least-squares error, the prediction
    sqrt(1 - r / N) and the measured rank r. What benchmarks/capacity.py prints and draws."""
    rows = []
    for label, memory in memories.items():
        rule = as_rule(memory)
        rank = feature_rank(rule, d_k, keys=keys, seed=seed)
        options = {"trials": trials, "seed": seed, "keys": keys}
        stored = capacity_curve(rule, d_k, pair_counts, epochs=epochs, **options)
        best = least_squares_curve(rule, d_k, pair_counts, **options)
        for (n, error), (_, ls) in zip(stored, best, strict=True):
            rows.append(
                {
                    "memory": label,
                    "n_pairs": n,
                    "rule_error": error,
                    "least_squares_error": ls,
                    "theory_error": theory_error(n, rank),
                    "rank": rank,
                }
            )
    return rows


def _check(d_k: int, pair_counts: Sequence[int], trials: int, epochs: int) -> None:
    for name, value in (("d_k", d_k), ("trials", trials), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if not pair_counts or any(not isinstance(n, int) or n < 1 for n in pair_counts):
        raise ValueError(f"pair_counts: expected positive integers, got {list(pair_counts)!r}")
