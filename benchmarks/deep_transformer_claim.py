"""ATLAS section 4's claim, measured: the linear DeepTransformer (matrix memory from zero, dot
bias, lr 1, no retention, the exp-kernel map phi_P; specs/examples/linear_deep_transformer.yaml)
outputs sum_{i<=t} (sum_{p<=P} (q_t . k_i)^p / p!) v_i, which tends to unnormalized causal
softmax attention sum_{i<=t} exp(q_t . k_i) v_i as P grows.

Prints, for P = 1..6, the relative error (Frobenius norm over every output) against that
attention, and of the normalized variant (divided by the same memory run on v = 1) against
torch's scaled_dot_product_attention with scale 1, on random unit-norm q, k (|q . k| <= 1).

    python benchmarks/deep_transformer_claim.py [--length 64] [--d 8] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import miras

SPEC = Path(__file__).resolve().parents[1] / "specs/examples/linear_deep_transformer.yaml"


def errors(order: int, q, k, v) -> tuple[float, float]:
    """(unnormalized, normalized) relative errors at order P; q, k, v [B, T, H, D] float64."""
    base = miras.load_spec(SPEC)
    fm = base.feature_map.model_copy(update={"order": order, "max_features": 10**6})
    rule = miras.compile(base.model_copy(update={"feature_map": fm}), checked=False)
    num, _ = rule(q, k, v, backend="chunk", chunk_size=16)
    den, _ = rule(q, k, torch.ones_like(v[..., :1]), backend="chunk", chunk_size=16)
    scores = torch.einsum("bthd,bshd->bhts", q, k).exp().tril()  # [B, H, T, T]
    attention = torch.einsum("bhts,bshd->bthd", scores, v)
    sdpa = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=1.0
    ).transpose(1, 2)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    return rel(num, attention), rel(num / den, sdpa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--d", type=int, default=8, help="channels per head")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    shape = (1, args.length, args.heads, args.d)
    q, k = (
        F.normalize(torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(*shape, generator=gen, dtype=torch.float64)
    print(f"T = {args.length}, d = {args.d}, heads = {args.heads}, seed = {args.seed}, float64")
    print("| P | Dphi | rel. error vs sum_i exp(q.k_i) v_i | normalized vs SDPA (scale 1) |")
    print("| --- | --- | --- | --- |")
    for order in range(1, 7):
        unnormalized, normalized = errors(order, q, k, v)
        width = miras.load_spec(SPEC).feature_map.model_copy(update={"order": order})
        print(f"| {order} | {width.output_dim(args.d)} | {unnormalized:.2e} | {normalized:.2e} |")


if __name__ == "__main__":
    main()
