"""Softmax attention mixers: causal attention over the whole past or a sliding window.

The baselines of the memory layers (and the attention branches of the hybrids). Positions come
from rotary embeddings (RoFormer, Su et al. 2021) or from the same short causal conv the memory
layers use (`positions="conv"`), so the comparison on recall tasks is fair: attention without
any position signal cannot tell a key from the value that follows it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miras.models.layer import Cache, ShortConv

ROTARY_BASE = 10000.0


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, H, T, D] by positions [T] * base^(-2i/D)."""
    half = x.shape[-1] // 2
    freq = ROTARY_BASE ** (-torch.arange(half, dtype=x.dtype, device=x.device) / half)
    angle = positions.to(x.dtype)[:, None] * freq[None, :]  # [T, D/2]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)  # an odd last channel stays


def attention_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, persistent: int
) -> torch.Tensor:
    """[Tq, P + Tk] bool, True where query i may read key j: j <= i and i - j < window;
    the P persistent keys (in front) are visible to every query."""
    distance = query_pos[:, None] - key_pos[None, :]
    mask = distance >= 0
    if window is not None:
        mask = mask & (distance < window)
    always = torch.ones(len(query_pos), persistent, dtype=torch.bool, device=mask.device)
    return torch.cat([always, mask], dim=1)


class Attention(nn.Module):
    """Causal multi-head softmax attention (SDPA), full or over the last `window` tokens.

    x [B, T, D] -> y [B, T, D]. `positions`: "rotary", "conv" (a short causal conv + SiLU on
    q, k, v, as in the memory layers) or "none". `persistent_tokens` learnable vectors are
    projected to keys and values that every query sees (Titans section 3.3), outside the window.
    Decoding keeps a KV cache (the last `window` tokens for SWA).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        window: int | None = None,
        positions: str = "rotary",
        conv_size: int = 4,
        persistent_tokens: int = 0,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads ({n_heads}) must divide d_model ({d_model})")
        if positions not in ("rotary", "conv", "none"):
            raise ValueError(f"positions: expected rotary, conv or none, got {positions!r}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.window, self.positions = window, positions
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.conv = ShortConv(3 * d_model, conv_size if positions == "conv" else 0)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.persistent = (
            nn.Parameter(torch.randn(persistent_tokens, d_model) * 0.02)
            if persistent_tokens
            else None
        )

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, H, T, D/H]."""
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)

    def persistent_kv(self, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of the persistent tokens, [B, H, P, D/H] each (no rotation)."""
        if self.persistent is None:
            return None
        _, k, v = self.qkv(self.persistent).chunk(3, dim=-1)
        return (
            self.heads(k[None]).expand(batch, -1, -1, -1),
            self.heads(v[None]).expand(batch, -1, -1, -1),
        )

    def empty_cache(self, batch: int) -> Cache:
        like = self.qkv.weight
        empty = like.new_zeros(batch, self.n_heads, 0, self.head_dim)
        return {"conv": self.conv.empty_cache(batch, like), "k": empty, "v": empty, "pos": 0}

    def forward(self, x: torch.Tensor, cache: Cache | None = None):
        """x [B, T, D] -> (y [B, T, D], the new cache or None when no cache was given)."""
        t = x.shape[1]
        start = 0 if cache is None else cache["pos"]
        qkv, conv_cache = self.conv(self.qkv(x), None if cache is None else cache["conv"])
        q, k, v = (self.heads(z) for z in qkv.chunk(3, dim=-1))
        pos = torch.arange(start, start + t, device=x.device)
        if self.positions == "rotary":
            q, k = rotary(q, pos), rotary(k, pos)
        if cache is not None:
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
        key_pos = torch.arange(start + t - k.shape[2], start + t, device=x.device)
        new_cache = None
        if cache is not None:
            keep = k.shape[2] if self.window is None else min(self.window, k.shape[2])
            new_cache = {"conv": conv_cache, "k": k[:, :, -keep:], "v": v[:, :, -keep:]}
            new_cache["pos"] = start + t
        o = self.attend(q, k, v, pos, key_pos)
        return self.out_proj(o.transpose(1, 2).flatten(-2)), new_cache

    def attend(self, q, k, v, query_pos, key_pos) -> torch.Tensor:
        """q [B, H, Tq, d], k, v [B, H, Tk, d] at positions query_pos, key_pos -> [B, H, Tq, d]."""
        extra = self.persistent_kv(q.shape[0])
        plain = extra is None and self.window is None
        if plain and q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        p = 0
        if extra is not None:
            k, v = torch.cat([extra[0], k], dim=2), torch.cat([extra[1], v], dim=2)
            p = extra[0].shape[2]
        mask = attention_mask(query_pos, key_pos, self.window, p)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
