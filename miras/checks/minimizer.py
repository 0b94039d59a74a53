"""The end-to-end check of an optimizer that solves exactly (exact, MesaNet) against an
autograd oracle that never forms the statistics H_kk, H_vk.

At every token t the oracle writes the objective out with the printed `bias_loss`, over the
window's tokens i (all i <= t, or the last c),

    J_t(W) = sum_i a_{i+1..t} gamma_i L(W phi(k_i), v_i) + 1/2 sum_j ridge_t,j ||W_{:,j}||^2,

takes its gradient at W = 0 and its Hessian by autograd (float64), and lands on the minimizer
with one Newton step, W_t = -Hess^-1 grad J_t(0) (exact for a quadratic J_t;
`miras.derive.numerics.newton_minimize`); o_t = W_t phi(q_t).
The runtime's final state is compared through the W it implies,
W_T = H_vk (s H_kk + diag(ridge_T))^-1 (with a finite window, the sums of its carried tokens).
"""

from __future__ import annotations

import torch

from miras.checks.inputs import DTYPE, TOLERANCE, Rule, heads_first, random_inputs, sizes_for
from miras.derive.check import CheckResult, max_relative_error
from miras.derive.numerics import newton_minimize


def _fixed_or_gate(component, name: str | None, gates, t: int, like: torch.Tensor):
    """A gate at token t [B, H, X] or the fixed value (1 without the field)."""
    value = 1.0 if name is None else getattr(component, name)
    return gates[name][:, :, t] if value == "gate" else torch.full_like(like[..., :1], value)


def oracle(rule: Rule, q, k, v, gates) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, T, Dv], W_T [B, H, Dv, Dphi]): the argmin of J_t by a Newton step from 0."""
    spec = rule.spec
    phi_q, phi_k, v_, gates_ = heads_first(rule, q, k, v, gates)
    b, h, length, d_phi = phi_k.shape
    d_v = v_.shape[-1]
    decay_name = spec.retention.decay_gate

    def objective(flat: torch.Tensor, t: int) -> torch.Tensor:
        w = flat.view(b, h, d_v, d_phi)
        total = 0.0
        weight = torch.ones(b, h, 1, dtype=DTYPE)  # a_{i+1..t}, from i = t down
        first = 0 if spec.window.is_global else max(0, t - spec.window.c + 1)
        for i in range(t, first - 1, -1):
            y = (w @ phi_k[:, :, i].unsqueeze(-1)).squeeze(-1)  # [B, H, Dv]
            bias_args = [gates_[n][:, :, i] for n in spec.bias.gates()]
            term = rule.functions.bias_loss(y, v_[:, :, i], *bias_args)  # [B, H, 1]
            gamma = _fixed_or_gate(spec.window, spec.window.weight_gate, gates_, i, phi_k[:, :, i])
            total = total + (weight * gamma * term).sum()
            weight = weight * _fixed_or_gate(spec.retention, decay_name, gates_, i, phi_k[:, :, i])
        ridge = _fixed_or_gate(spec.optimizer, spec.optimizer.ridge_gate, gates_, t, phi_k[:, :, t])
        ridge = ridge.expand(b, h, d_phi).unsqueeze(-2)  # [B, H, 1, Dphi]: one per column
        return total + 0.5 * (ridge * w**2).sum()

    zero = torch.zeros(b * h * d_v * d_phi, dtype=DTYPE)
    outputs, w = [], None
    for t in range(length):
        w = newton_minimize(lambda x, t=t: objective(x, t), zero, iterations=1)
        w = w.view(b, h, d_v, d_phi)
        outputs.append((w @ phi_q[:, :, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(outputs, dim=2), w


def implied_weights(rule: Rule, final: dict, ridge: torch.Tensor) -> torch.Tensor:
    """W_T = H_vk (s H_kk + diag(ridge))^-1 from the runtime's final state (the statistics, or
    the window's last c tokens, summed here); ridge [B, H, Dphi]."""
    from miras.runtime.exact_minimizer import window_statistics

    kk, vk = (final["H_kk"], final["H_vk"]) if "H_kk" in final else window_statistics(final)
    system = rule.plan.chunk_form.slope * kk + torch.diag_embed(ridge)
    return torch.linalg.solve(system, vk, left=False)


def check_minimizer_end_to_end(rule: Rule, *, seed: int = 0) -> list[CheckResult]:
    """One `CheckResult` per backend (recurrent; chunk at size 4, so a chunk boundary falls
    inside the sequence): outputs and the final state's W against the oracle, float64."""
    sizes = sizes_for(rule)
    q, k, v, gates = random_inputs(rule, sizes, seed)
    expected_o, expected_w = oracle(rule, q, k, v, gates)
    _, phi_k, _, gates_ = heads_first(rule, q, k, v, gates)
    opt = rule.spec.optimizer
    last = _fixed_or_gate(opt, opt.ridge_gate, gates_, sizes.length - 1, phi_k[:, :, -1])
    ridge = last.expand(*phi_k.shape[:2], phi_k.shape[-1])
    what = (
        f"end-to-end {{}} (chunk size {{}}) vs the autograd argmin: T={sizes.length}, "
        f"c={rule.spec.window.c}"
    )
    results = []
    for backend, chunk_size in (("recurrent", 1), ("chunk", 4)):
        o, final = rule(
            q, k, v, gates, backend=backend, chunk_size=chunk_size, output_final_state=True
        )
        error = max(
            max_relative_error(o.transpose(1, 2), expected_o),
            max_relative_error(implied_weights(rule, final, ridge), expected_w),
        )
        results.append(CheckResult(what.format(backend, chunk_size), error, TOLERANCE))
    return results
