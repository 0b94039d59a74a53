"""The quality benchmark with DeltaNet's chunk solved exactly: is the chunk-start gradient what
holds DeltaNet back at large chunk sizes?

    .venv/bin/python benchmarks/exact_delta_rule.py --chunk-size 16 --budget 300

miras's chunk backend takes every gradient in a chunk at the chunk-start state (docs/architecture.md), so
for the delta rule it is Hebbian inside a chunk. fla's kernels instead solve each chunk exactly
in the WY form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule").
This script swaps that exact solve into the DeltaNet layer and runs benchmarks/quality.py
with the remaining arguments (`--models deltanet` is implied). Before training it checks the
swap against the `recurrent` backend, the exact step, in float64. docs/training.md quotes the
result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import miras
from miras.models.layer import MirasLayer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # the benchmark this one modifies, found through the path above


def exact_delta_rule(q, k, v, beta, state, chunk_size: int):
    """The delta rule W_t = W_{t-1} - beta_t (W_{t-1} k_t - v_t) k_t^T, o_t = W_t q_t, solved
    exactly per chunk. q, k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H], state
    [B, H, Dv, Dk] -> o [B, T, H, Dv], the final state.

    In a chunk starting from S = W^T, the writes u_t = beta_t (v_t - W_{t-1} k_t) satisfy
    (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S): one triangular solve."""
    T, C = q.shape[1], chunk_size
    pad = (-T) % C

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...], zero-padded at the end
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.unflatten(2, (x.shape[2] // C, C))

    q, k, v, beta = chunks(q), chunks(k), chunks(v), chunks(beta)[..., None]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    solve = eye + torch.tril((beta * k) @ k.transpose(-1, -2), -1)  # [B, H, N, C, C]
    u0 = torch.linalg.solve_triangular(solve, beta * v, upper=False)  # the writes if S = 0
    w = torch.linalg.solve_triangular(solve, beta * k, upper=False)  # and how S changes them
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    S = state.transpose(-1, -2)  # [B, H, Dk, Dv]
    out = []
    for n in range(q.shape[2]):
        qn, kn = q[:, :, n], k[:, :, n]
        u = u0[:, :, n] - w[:, :, n] @ S  # [B, H, C, Dv]
        out.append(qn @ S + (qn @ kn.transpose(-1, -2)).masked_fill(~causal, 0) @ u)
        S = S + kn.transpose(-1, -2) @ u
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T].transpose(1, 2)
    return o, S.transpose(-1, -2)


def check_against_recurrent() -> None:
    """The swap must be the exact delta rule: equal to miras's recurrent backend in float64."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 37, 2, 8  # T not a multiple of the chunk
    q, k = (
        F.normalize(torch.randn(B, T, H, D, generator=g, dtype=torch.float64), dim=-1) for _ in "qk"
    )
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    state = torch.randn(B, H, D, D, generator=g, dtype=torch.float64)
    rule = miras.compile(miras.load_spec(quality.ROOT / "specs" / "deltanet.yaml"))
    ref, ref_state = rule(
        q, k, v, {"lr": beta}, backend="recurrent", initial_state=state, output_final_state=True
    )
    o, final = exact_delta_rule(q, k, v, beta, state, chunk_size=16)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final, ref_state, rtol=1e-9, atol=1e-9)
    print("exact chunked delta rule == recurrent backend (float64, T = 37, chunk 16)")


def exact_run(self, x, cache, backend, keep_state=True):
    """MirasLayer.run with the rule replaced by the exact chunked delta rule."""
    q, k, v, gates, conv_cache = self.memory_inputs(x, cache["conv"])
    o, state = exact_delta_rule(q, k, v, gates["lr"], cache["memory"], self.chunk_size)
    return self.output(o, x), {"conv": conv_cache, "memory": state}


def main() -> None:
    check_against_recurrent()
    MirasLayer.run = exact_run
    sys.argv = [sys.argv[0], "--models", "deltanet", *sys.argv[1:]]
    quality.main()


if __name__ == "__main__":
    main()
