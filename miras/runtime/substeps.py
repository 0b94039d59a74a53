"""Several optimizer steps per token (`optimizer: {kind: gd, steps: n}`), as n sub-steps of the
one-step rule.

A sequence of T tokens with n steps each becomes one of T*n sub-steps, sub-step j of token t
at t*n + j, which the one-step rule runs on any backend and execution form:
- k, v: the token's own at each of its sub-steps (`keys: same`: n steps on one loss), or the
  per-step inputs as given, packed [B, T*n, H, D] (`keys: per_step`: DeltaProduct);
- q: the token's at its last sub-step and zeros before it, so o_t reads the state after all
  n steps (the other sub-steps' outputs are dropped);
- the retention's decay gate: the token's at the first sub-step, 1 after it, so the decay
  applies once per token, before its steps (fla's naive_recurrent_gated_delta_product:
  h = h * exp(g_t), then the n Householder updates). With `grad_at: retained` the first step's
  gradient is taken at a_t W_{t-1}, the later ones at the current state;
- a per-step gate (lr with `keys: per_step`, beta in fla's packing [B, T*n, H]) as given;
  every other gate the token's, repeated.
So the recurrent backend is the n-fold composition of the one-step rule by construction.
`chunk_size` counts steps: the exact chunk form solves WY/UT systems over chunk_size steps
(n*b for a chunk of b tokens; any size is exact), and in the chunk-start and dual forms
chunk_size 1 is still the exact recurrence (a chunk's gradients are taken at its start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from miras.runtime.inputs import Shapes, check_cu_seqlens, check_finite, first_bad, inside_range

if TYPE_CHECKING:
    from miras.runtime.program import Program


def steps_of(rule: Program) -> int:
    """n, the optimizer steps per token of `rule` (1: the one-step rule itself)."""
    return rule.spec.optimizer.steps_per_token()


def _packing(rule: Program, n: int) -> str:
    return f"spec '{rule.spec.name}' takes n = {n} per token (optimizer.steps: {n}, keys: per_step)"


def _check_axes(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor [B, T, H, D], got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name}: expected 4 axes [B, T, H, D], got shape {tuple(x.shape)}")


def _check_length(rule: Program, name: str, x, length: int, n: int, axes: str) -> None:
    """A per-step input: `length` = T*n entries along axis 1, fla's packing."""
    if isinstance(x, torch.Tensor) and (x.dim() < 2 or x.shape[1] != length):
        raise ValueError(
            f"{name}: {_packing(rule, n)}, packed [B, T*n, {axes}] with T*n = {length} "
            f"(T = {length // n} tokens of q), got {list(x.shape)}"
        )


def _check_ranges(rule: Program, gates, shape: tuple[int, ...]) -> None:
    """Each per-token gate [B, T, H(, Dv)] inside its range, named at its own token (after the
    expansion, token t would be step t*n). The expanded run checks the rest."""
    infos = {info.name: info for info in rule.plan.gates}
    for name, g in (gates or {}).items():
        if name not in infos or not isinstance(g, torch.Tensor) or tuple(g.shape[:3]) != shape:
            continue
        if not g.dtype.is_floating_point:
            continue
        g = g.detach() if g.dim() == 4 else g.detach().unsqueeze(-1)  # [B, T, H, X]
        bad = ~inside_range(g, infos[name].allowed)
        if bool(bad.any()):
            token, row, head = first_bad(bad)
            value = g[row, token, head][bad[row, token, head]][0].item()
            raise ValueError(
                f"gates[{name!r}]: values must lie in {infos[name].allowed} (natural space), "
                f"found {value:g} at token {token} (batch row {row}, head {head}), the first "
                "in time"
            )


def expand(rule: Program, q, k, v, gates, cu_seqlens, *, check_inputs: bool = True):
    """The sub-step sequence of `rule`'s inputs (the module docstring): q, k [B, T*n, H, Dk],
    v [B, T*n, H, Dv], gates name -> [B, T*n, H(, Dv)] or a Python float, cu_seqlens * n.
    The inputs: q [B, T, H, Dk]; k, v [B, T, H, D] or, for the per-step inputs, [B, T*n, H, D];
    gates [B, T, H(, Dv)], the per-step ones [B, T*n, H(, Dv)]. With `check_inputs`, q, k, v
    are checked finite and the per-token gates in range here, so an error names the token (or,
    for a per-step input, the packed index) as given; shapes beyond the length axis, dtypes and
    the per-step gates' ranges are checked by the run of the expanded sequence."""
    n = steps_of(rule)
    per_step = set(rule.spec.optimizer.per_step_inputs())
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_axes(name, x)
    t = q.shape[1]
    if check_inputs:
        check_finite(q, k, v)

    def repeat(x: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [B, T*n, ...]
        return x.repeat_interleave(n, dim=1)

    def at(x: torch.Tensor, j: int, fill: float) -> torch.Tensor:
        """x at sub-step j of each token and `fill` at the others: [B, T, ...] -> [B, T*n, ...]."""
        steps = [x if i == j else torch.full_like(x, fill) for i in range(n)]
        return torch.stack(steps, dim=2).flatten(1, 2)

    def per_token(name: str, x: torch.Tensor, axes: str) -> None:
        if x.dim() >= 2 and x.shape[1] != t:
            raise ValueError(
                f"{name}: one per token, [B, T, {axes}] with T = {t} like q (spec "
                f"'{rule.spec.name}' takes n = {n} steps per token; only "
                f"{', '.join(sorted(per_step)) or 'none'} carry one per step), got {list(x.shape)}"
            )

    kv = []
    for name, x in (("k", k), ("v", v)):
        if name in per_step:
            _check_length(rule, name, x, t * n, n, "H, D")
            kv.append(x)
        else:
            per_token(name, x, "H, D")
            kv.append(repeat(x))
    if check_inputs:
        per_token_gates = {name: g for name, g in (gates or {}).items() if name not in per_step}
        _check_ranges(rule, per_token_gates, (q.shape[0], t, q.shape[2]))
    q = at(q, n - 1, 0.0)

    decay = rule.spec.retention.decay_gate
    expanded = {}
    for name, g in (gates or {}).items():
        if not isinstance(g, torch.Tensor):
            if name == decay and isinstance(g, (int, float)) and g != 1:  # once per token
                shape = (q.shape[0], t, q.shape[2])
                g = torch.full(shape, float(g), dtype=q.dtype, device=q.device)
            else:
                expanded[name] = g  # a constant (or a bad value, for the run to name)
                continue
        where = f"gates[{name!r}]"
        if name in per_step:
            _check_length(rule, where, g, t * n, n, "H")
            expanded[name] = g
            continue
        per_token(where, g, "H")
        expanded[name] = at(g, 0, 1.0) if name == decay else repeat(g)
    if cu_seqlens is not None:  # checked against the T tokens of q, then counted in sub-steps
        check_cu_seqlens(cu_seqlens, Shapes(q.shape[0], t, q.shape[2], 0, 0, q.dtype))
        cu_seqlens = cu_seqlens * n
    return q, kv[0], kv[1], expanded, cu_seqlens


def pick(o: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's output, the read after its last sub-step: [B, T*n, ...] -> [B, T, ...]."""
    return o[:, n - 1 :: n]
