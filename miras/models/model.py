"""The language model around the mixers: embedding, N pre-norm blocks, final norm, tied head.

    tokens [B, T] -> embedding [B, T, D]
                  -> N x (x + mixer(norm(x)); x + SwiGLU(norm(x)))
                  -> norm -> logits [B, T, V] = x E^T   (the head is the embedding, tied)

`build_model(spec, vocab_size)` picks the mixer of every block from the spec's `model:` section
(docs/models.md). A task whose inputs are not token ids gives its own input and output layers
(`build_model(spec, V, io=task.model_io(d_model))`): they replace the embedding and the head.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from miras.models.hybrid import MAC, MAG, MAL
from miras.models.layer import MirasLayer
from miras.models.mixers import Attention
from miras.models.padding import Cache, padding_spans, token_mask
from miras.spec import ModelConfig, Spec, load_spec

INIT_STD = 0.02  # GPT-2's initialization of every projection and of the embedding


class SwiGLU(nn.Module):
    """W_2 (SiLU(W_1 x) * W_3 x) (Shazeer 2020). x [B, T, D] -> [B, T, D]; hidden width
    2/3 * expansion * D rounded up to a multiple of 8, so the parameter count matches a
    plain MLP of that expansion."""

    def __init__(self, d_model: int, expansion: float):
        super().__init__()
        hidden = max(8, -(-round(2 * expansion * d_model / 3) // 8) * 8)
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build_mixer(spec: Spec, config: ModelConfig) -> nn.Module:
    """The mixer of one block for the spec's variant (docs/models.md)."""
    d, h, variant = config.d_model, config.n_heads, config.variant
    p = config.persistent_tokens

    def attention(window: int | None, persistent: int = p) -> Attention:
        return Attention(
            d,
            h,
            window=window,
            positions=config.positions,
            conv_size=config.conv_size,
            persistent_tokens=persistent,
        )

    if variant == "attention":
        return attention(None)
    if variant == "swa":
        return attention(config.swa_window)
    if spec.memory.closed_form() is not None:  # attention / swa specs: the softmax mixers
        if variant != "lmm":
            raise ValueError(
                f"model.variant: {variant!r} mixes a memory layer with attention; spec "
                f"'{spec.name}' has nonparametric memory (attention itself): use variant lmm"
            )
        return attention(spec.memory.lookback(spec))

    def memory(persistent: int = 0) -> MirasLayer:
        return MirasLayer(
            spec,
            d,
            h,
            chunk_size=config.chunk_size,
            backend=config.backend,
            chunk_mode=config.chunk_mode,
            conv_size=config.conv_size,
            gate_rank=config.gate_rank,
            persistent_tokens=persistent,
        )

    if variant == "lmm":
        return memory(p)  # no attention: the persistent tokens prime the memory
    if variant == "mal":
        return MAL(memory(), attention(config.swa_window))
    if variant == "mag":
        return MAG(memory(), attention(config.swa_window))
    return MAC(memory(), h, config.mac_segment, p)


class Block(nn.Module):
    """x + mixer(norm(x)), then x + SwiGLU(norm(x)). x [B, T, D] -> [B, T, D]."""

    def __init__(self, mixer: nn.Module, d_model: int, expansion: float):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(d_model), mixer
        self.mlp_norm, self.mlp = nn.RMSNorm(d_model), SwiGLU(d_model, expansion)

    def forward(self, x: torch.Tensor, cache: Cache | None = None, attention_mask=None):
        y, cache = self.mixer(self.mixer_norm(x), cache, attention_mask)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), cache


class LanguageModel(nn.Module):
    """tokens [B, T] int64 -> logits [B, T, V] (with a task's `io`: its inputs, e.g. vectors
    [B, T, E], through its input layer, and its readout for the head).

    `model(tokens)` runs in parallel. Decoding: `cache = model.empty_cache(B)`, then
    `logits, cache = model.decode(tokens_t, cache)` for tokens_t [B, 1] (or any [B, T]).
    `attention_mask` [B, T] (1 a token, 0 padding; left or right padding) makes a padded batch
    equal its unpadded sequences, in `forward` and in `decode`: prefill prompts of different
    lengths, then decode all rows at once (`generate`).
    """

    def __init__(
        self,
        spec: Spec | str | dict,
        vocab_size: int,
        io: tuple[nn.Module, nn.Module] | None = None,
    ):
        super().__init__()
        self.spec = load_spec(spec)
        config = self.spec.model
        if vocab_size < 2:
            raise ValueError(f"vocab_size: expected at least 2, got {vocab_size}")
        self.vocab_size = vocab_size
        # io: the task's (input layer [B, T, ...] -> [B, T, D], readout [B, T, D] -> logits).
        if io is None:
            self.embed, self.readout = nn.Embedding(vocab_size, config.d_model), None
        else:
            self.embed, self.readout = io
        self.blocks = nn.ModuleList(
            Block(build_mixer(self.spec, config), config.d_model, config.mlp_expansion)
            for _ in range(config.n_layers)
        )
        self.norm = nn.RMSNorm(config.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, 0.02) for the embedding and every projection; the memory layers' gate
        biases, conv weights and initial states keep their own initialization."""
        if isinstance(self.embed, nn.Embedding):
            nn.init.normal_(self.embed.weight, std=INIT_STD)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is None:
                nn.init.normal_(module.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """tokens [B, T] -> logits [B, T, V]; at padding (attention_mask 0) they are don't-care."""
        check_length(tokens)
        if attention_mask is not None:
            token_mask(attention_mask, tokens.shape[:2])  # a bad mask fails before any work
        x = self.embed(tokens)
        for block in self.blocks:
            x, _ = block(x, attention_mask=attention_mask)
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if self.readout is not None:
            return self.readout(self.norm(x))
        return self.norm(x) @ self.embed.weight.T  # tied

    def empty_cache(self, batch: int) -> list[Cache]:
        return [block.mixer.empty_cache(batch) for block in self.blocks]

    def decode(self, tokens: torch.Tensor, cache: list[Cache], attention_mask=None):
        """tokens [B, T] continuing `cache` -> (logits [B, T, V], the new cache). With
        `attention_mask`, each row continues from its own last token: padding is skipped."""
        check_length(tokens)
        if attention_mask is not None:
            token_mask(attention_mask, tokens.shape[:2])
        x = self.embed(tokens)
        new = []
        for block, block_cache in zip(self.blocks, cache, strict=True):
            x, block_cache = block(x, block_cache, attention_mask)
            new.append(block_cache)
        return self.head(x), new

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, steps: int, attention_mask=None) -> torch.Tensor:
        """Greedy decoding of all rows at once: prompts [B, T] (padded, with `attention_mask`,
        when their lengths differ) -> the next `steps` tokens of each row, [B, steps] (steps
        = 0: [B, 0], nothing run)."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"steps: expected an integer >= 0 (tokens to generate), got {steps!r}")
        spans = [(0, prompts.shape[1])] * prompts.shape[0]
        if attention_mask is not None:
            spans = padding_spans(attention_mask, prompts.shape)
        if any(stop == start for start, stop in spans):
            raise ValueError("prompts: every row needs at least one token to continue")
        if steps == 0:
            return prompts.new_zeros(len(spans), 0)
        logits, cache = self.decode(prompts, self.empty_cache(len(spans)), attention_mask)
        last = logits[torch.arange(len(spans)), [stop - 1 for _, stop in spans]]  # [B, V]
        generated = [last.argmax(-1, keepdim=True)]
        for _ in range(steps - 1):
            logits, cache = self.decode(generated[-1], cache)
            generated.append(logits[:, -1].argmax(-1, keepdim=True))
        return torch.cat(generated, dim=1)


def check_length(tokens: torch.Tensor) -> None:
    """The model's input [B, T, ...]: at least one token (the short conv and every mixer need
    one; an empty prompt has nothing to continue)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        shape = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens: expected a tensor [B, T], got {shape}")
    if tokens.shape[1] < 1:
        raise ValueError(
            f"tokens: expected at least one token (T >= 1), got shape {list(tokens.shape)}"
        )


def build_model(
    spec: Spec | str | dict, vocab_size: int, io: tuple[nn.Module, nn.Module] | None = None
) -> LanguageModel:
    """The model a spec describes (its `model:` section) for a vocabulary of `vocab_size`;
    `io`, a task's (input layer, output layer) (`Task.model_io`), replaces the token embedding
    and the tied head."""
    return LanguageModel(spec, vocab_size, io)
