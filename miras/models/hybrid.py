"""Hybrids of a memory layer and sliding-window attention (Titans section 4, MIRAS section 5).

Each is a mixer: x [B, T, D] -> (y [B, T, D], cache). `forward(x)` runs in parallel;
`forward(x, cache)` continues from `empty_cache(batch)` (one token at a time for decoding).

- MAL, memory as a layer: the memory layer, then SWA on its output (Titans eq. 29-31).
- MAG, memory as a gate: memory and SWA branches on the same input, mixed by a gate
  (Titans eq. 26-28).
- MAC, memory as context: per segment, retrieve from the memory, attend over
  [persistent tokens, retrieved, segment], update the memory with the attention output
  (Titans eq. 21-25).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miras.models.layer import MirasLayer, Norm
from miras.models.mixers import Attention, rotary, visible_keys
from miras.models.padding import Cache, rows_alone, select_rows


class GatedSum(nn.Module):
    """g * RMSNorm(a) + (1 - g) * RMSNorm(b), g = sigmoid(W x) per channel: Titans' nonlinear
    gating of two branches (each normalized so neither dominates by scale)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.gate = nn.Linear(d_model, d_model, bias=False)
        self.norm_a, self.norm_b = Norm(d_model), Norm(d_model)  # float32 under autocast

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.gate(x))
        return g * self.norm_a(a) + (1 - g) * self.norm_b(b)


class MAL(nn.Module):
    """Memory as a layer: m = memory(x), s = SWA(norm(x + m)); returns m + s, so the residual
    stream sees the memory's update and then the attention's, as two stacked sublayers."""

    def __init__(self, memory: MirasLayer, swa: Attention):
        super().__init__()
        self.memory, self.swa = memory, swa
        self.norm = nn.RMSNorm(memory.d_model)

    def empty_cache(self, batch: int) -> Cache:
        return {"memory": self.memory.empty_cache(batch), "swa": self.swa.empty_cache(batch)}

    def forward(self, x: torch.Tensor, cache: Cache | None = None, attention_mask=None):
        m, memory_cache = self.memory(x, None if cache is None else cache["memory"], attention_mask)
        swa_cache = None if cache is None else cache["swa"]
        s, swa_cache = self.swa(self.norm(x + m), swa_cache, attention_mask)
        new = None if cache is None else {"memory": memory_cache, "swa": swa_cache}
        return m + s, new


class MAG(nn.Module):
    """Memory as a gate: y = g * norm(memory(x)) + (1 - g) * norm(SWA(x))."""

    def __init__(self, memory: MirasLayer, swa: Attention):
        super().__init__()
        self.memory, self.swa = memory, swa
        self.combine = GatedSum(memory.d_model)

    def empty_cache(self, batch: int) -> Cache:
        return {"memory": self.memory.empty_cache(batch), "swa": self.swa.empty_cache(batch)}

    def forward(self, x: torch.Tensor, cache: Cache | None = None, attention_mask=None):
        m, memory_cache = self.memory(x, None if cache is None else cache["memory"], attention_mask)
        s, swa_cache = self.swa(x, None if cache is None else cache["swa"], attention_mask)
        new = None if cache is None else {"memory": memory_cache, "swa": swa_cache}
        return self.combine(x, m, s), new


class MAC(nn.Module):
    """Memory as context, segment by segment (segments of `segment` tokens):

        h   = W_h M_{S_{i-1}}(q_r(x_seg))                 retrieve at the segment-start memory
        y   = Attn(x_seg | [persistent, h, x_seg])        causal over h and x_seg
        m   = memory(y)                                    updates the memory (chunk backend)
        out = g * norm(m) + (1 - g) * norm(y)

    Token t attends to h_j and x_j for j <= t only (h_j depends on x_j), so nothing leaks from
    the future. The retrieval query q_r is its own projection. Decoding runs token by token: the
    cache keeps the segment-start memory for retrieval, the running memory, and the segment's
    keys and values (left-aligned, each row's at the end); at a segment boundary the running
    memory becomes the segment-start one. `pos` [B] counts each row's tokens, so the rows of a
    batch may be at different places in their segments.
    """

    def __init__(self, memory: MirasLayer, n_heads: int, segment: int, persistent_tokens: int):
        super().__init__()
        d = memory.d_model
        self.memory, self.segment = memory, segment
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.retrieve_q = nn.Linear(d, d, bias=False)
        self.retrieved = nn.Linear(d, d, bias=False)  # W_h: the read back to the model width
        self.attn = Attention(d, n_heads, persistent_tokens=persistent_tokens)
        self.combine = GatedSum(d)

    def retrieve(self, x: torch.Tensor, state) -> torch.Tensor:
        """x [B, T, D] -> the memory's read at `state` for queries q_r(x): [B, T, D]."""
        q = F.normalize(self.memory.split_heads(self.retrieve_q(x)), dim=-1)
        return self.retrieved(self.memory.read(q, state).flatten(-2))

    def context(self, x: torch.Tensor, h: torch.Tensor, pos: torch.Tensor):
        """Rotated queries of x and keys / values of h and x at positions pos ([T] or [B, T]):
        q [B, H, T, d]; k, v [B, H, 2T, d] ordered [h, x]."""
        qkv_x = self.attn.qkv(x).chunk(3, dim=-1)
        _, k_h, v_h = (self.attn.heads(z) for z in self.attn.qkv(h).chunk(3, dim=-1))
        q, k_x, v_x = (self.attn.heads(z) for z in qkv_x)
        q, k_x, k_h = rotary(q, pos), rotary(k_x, pos), rotary(k_h, pos)
        return q, torch.cat([k_h, k_x], dim=2), torch.cat([v_h, v_x], dim=2)

    def empty_cache(self, batch: int) -> Cache:
        memory = self.memory.empty_cache(batch)
        like = self.attn.qkv.weight
        empty = like.new_zeros(batch, self.n_heads, 0, self.head_dim)
        pos = torch.zeros(batch, dtype=torch.long, device=like.device)
        return {"memory": memory, "start": memory["memory"], "k": empty, "v": empty, "pos": pos}

    def forward(self, x: torch.Tensor, cache: Cache | None = None, attention_mask=None):
        """x [B, T, D] -> (y [B, T, D], the new cache or None when no cache was given).

        `attention_mask` [B, T] (left or right padding) runs each row's tokens alone (its
        segments start at its first token), from its own row of the cache if one is given;
        padding outputs 0. Cost: B sequential runs."""
        if attention_mask is not None:
            return rows_alone(self.forward, x, attention_mask, cache)
        if cache is not None:
            outputs = []
            for t in range(x.shape[1]):
                y, cache = self.step(x[:, t : t + 1], cache)
                outputs.append(y)
            return torch.cat(outputs, dim=1), cache
        memory_cache = self.memory.empty_cache(x.shape[0])
        outputs = []
        for s in range(0, x.shape[1], self.segment):
            xs = x[:, s : s + self.segment]
            n = xs.shape[1]
            h = self.retrieve(xs, memory_cache["memory"])
            pos = torch.arange(n, device=x.device)
            q, k, v = self.context(xs, h, pos)
            key_pos = torch.cat([pos, pos])  # h_j and x_j both sit at position j
            y = self.attn.merge(self.attn.attend(q, k, v, visible_keys(pos, key_pos, None)))
            m, memory_cache = self.memory.run(y, memory_cache, self.memory.backend)
            outputs.append(self.combine(xs, m, y))
        return torch.cat(outputs, dim=1), None

    def step(self, x: torch.Tensor, cache: Cache):
        """One token per row, x [B, 1, D] -> (y [B, 1, D], cache)."""
        in_segment = cache["pos"] % self.segment  # [B]
        # A row at a segment boundary retrieves from its memory as it is now: the parallel
        # forward runs the memory layer segment by segment, so its chunks restart there and
        # the last (partial) chunk of a segment is folded into the memory (`flush`).
        boundary = in_segment == 0
        memory_cache = cache["memory"]
        if bool(boundary.any()):
            memory_cache = select_rows(boundary, self.memory.flush(memory_cache), memory_cache)
        start = select_rows(boundary, memory_cache["memory"], cache["start"])
        h = self.retrieve(x, start)
        q, k, v = self.context(x, h, in_segment[:, None])
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
        # Each row reads the last 2 (in_segment + 1) slots: this segment's h_j and x_j, j <= t.
        tk = k.shape[2]
        slots = torch.arange(tk, device=x.device)
        visible = slots >= tk - 2 * (in_segment[:, None] + 1)  # [B, Tk]
        y = self.attn.merge(self.attn.attend(q, k, v, visible[:, None, None, :]))
        m, memory_cache = self.memory(y, memory_cache)
        keep = min(tk, 2 * self.segment)
        new = {"memory": memory_cache, "start": start, "k": k[:, :, tk - keep :]}
        new.update(v=v[:, :, tk - keep :], pos=cache["pos"] + 1)
        return self.combine(x, m, y), new
