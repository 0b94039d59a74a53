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

from miras.models.layer import ShortConv
from miras.models.padding import Cache, left_aligned, take, token_mask

ROTARY_BASE = 10000.0


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x [B, H, T, D] by positions [T] (or [B, T], one
    row each) * base^(-2i/D)."""
    half = x.shape[-1] // 2
    freq = ROTARY_BASE ** (-torch.arange(half, dtype=x.dtype, device=x.device) / half)
    angle = positions.to(x.dtype)[..., None] * freq  # [T, D/2] or [B, T, D/2]
    if angle.dim() == 3:
        angle = angle[:, None]  # [B, 1, T, D/2]: the same for every head
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)  # an odd last channel stays


def visible_keys(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """[..., Tq, Tk] bool from positions [..., Tq] and [..., Tk] (per row or shared): True where
    query i may read key j, j <= i and i - j < window."""
    distance = query_pos[..., :, None] - key_pos[..., None, :]
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


class Attention(nn.Module):
    """Causal multi-head softmax attention (SDPA), full or over the last `window` tokens.

    x [B, T, D] -> y [B, T, D]. `positions`: "rotary", "conv" (a short causal conv + SiLU on
    q, k, v, as in the memory layers) or "none". `persistent_tokens` learnable vectors are
    projected to keys and values that every query sees (Titans section 3.3), outside the window.
    Decoding keeps a KV cache (the last `window` tokens for SWA), left-aligned: each row's
    keys at the end, in order, and `pos` [B] the tokens each row has seen, so the rows of a
    batch may have different lengths.
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

    def merge(self, o: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D/H] -> the output projection, [B, T, D]."""
        return self.out_proj(o.transpose(1, 2).flatten(-2))

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
        pos = torch.zeros(batch, dtype=torch.long, device=like.device)
        return {"conv": self.conv.empty_cache(batch, like), "k": empty, "v": empty, "pos": pos}

    def forward(
        self,
        x: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        """x [B, T, D] -> (y [B, T, D], the new cache or None when no cache was given).

        `attention_mask` [B, T] (1 a token, 0 padding; left or right padding): padding is
        never a key, each row's first token is position 0 after its cached past, and the
        outputs at padding are 0, so a padded batch equals the unpadded sequences."""
        if cache is None and attention_mask is None:
            qkv, _ = self.conv(self.qkv(x))
            q, k, v = (self.heads(z) for z in qkv.chunk(3, dim=-1))
            pos = torch.arange(x.shape[1], device=x.device)
            q, k = self.rotate(q, pos), self.rotate(k, pos)
            if self.window is None and self.persistent is None:
                return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)), None
            return self.merge(self.attend(q, k, v, visible_keys(pos, pos, self.window))), None
        return self.forward_aligned(x, cache, attention_mask)

    def forward_aligned(self, x: torch.Tensor, cache: Cache | None, attention_mask):
        """The padded or cached forward: rows left-aligned, each at its own positions."""
        b, t = x.shape[:2]
        if attention_mask is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=x.device)
        else:
            valid = token_mask(attention_mask, (b, t))
        order = left_aligned(valid)  # each row's tokens at the end, in order
        x, valid = take(x, order, 1), take(valid, order, 1)
        past = self.empty_cache(b) if cache is None else cache
        seen = past["pos"]  # [B] the tokens each row has seen
        qkv, conv_cache = self.conv(self.qkv(x), past["conv"], valid)
        q, k, v = (self.heads(z) for z in qkv.chunk(3, dim=-1))
        end = seen + valid.sum(1)  # [B] after these tokens
        pos = end[:, None] - t + torch.arange(t, device=x.device)  # [B, T]; < seen at padding
        q, k = self.rotate(q, pos.clamp(min=0)), self.rotate(k, pos.clamp(min=0))
        # A left-aligned cache holds each row's last min(seen, Tc) keys in its last slots.
        tc = past["k"].shape[2]
        cached = torch.arange(tc, device=x.device) >= tc - seen.clamp(max=tc)[:, None]
        is_key = torch.cat([cached, valid], dim=1)  # [B, Tc + T]
        keys = left_aligned(is_key)
        k = take(torch.cat([past["k"], k], dim=2), keys, 2)
        v = take(torch.cat([past["v"], v], dim=2), keys, 2)
        is_key = take(is_key, keys, 1)
        tk = k.shape[2]
        key_pos = end[:, None] - tk + torch.arange(tk, device=x.device)  # right where is_key
        visible = visible_keys(pos, key_pos, self.window) & is_key[:, None, :]
        visible = visible | ~valid[:, :, None]  # padding reads every key: finite, then zeroed
        y = self.merge(self.attend(q, k, v, visible[:, None])) * valid[..., None]
        y = take(y, order.argsort(dim=1), 1)  # back to the caller's layout
        if cache is None:
            return y, None
        keep = tk if self.window is None else min(self.window, tk)
        new_cache = {"conv": conv_cache, "k": k[:, :, tk - keep :], "v": v[:, :, tk - keep :]}
        return y, {**new_cache, "pos": end}

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotary(x, positions) if self.positions == "rotary" else x

    def attend(self, q, k, v, visible: torch.Tensor) -> torch.Tensor:
        """q [B, H, Tq, d], k, v [B, H, Tk, d], visible [..., Tq, Tk] bool (which keys each
        query reads) -> [B, H, Tq, d]. Every query also reads the persistent keys."""
        extra = self.persistent_kv(q.shape[0])
        if extra is not None:
            k, v = torch.cat([extra[0], k], dim=2), torch.cat([extra[1], v], dim=2)
            always = visible.new_ones(*visible.shape[:-1], extra[0].shape[2])
            visible = torch.cat([always, visible], dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
