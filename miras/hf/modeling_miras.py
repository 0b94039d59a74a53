"""MirasModel and MirasForCausalLM: miras's LanguageModel as transformers models.

    model = MirasForCausalLM.from_spec("specs/titans.yaml", vocab_size=V, d_model=64)
    out = model(input_ids, attention_mask=mask, labels=input_ids)   # loss, logits [B, T, V]
    model.save_pretrained(path); AutoModelForCausalLM.from_pretrained(path)  # import miras.hf
    model.generate(input_ids, attention_mask=mask, max_new_tokens=8)

The network is `miras.models.LanguageModel` (embedding, blocks, final norm, tied head), held as
`MirasModel.lm`; these classes add transformers' interfaces around it: the config, the
`MirasCache`, labels, `logits_to_keep`, packed sequences (`cu_seqlens`) and activation
checkpointing. Exactness (docs/hf.md): a cached forward in pieces equals the uncached forward
for every memory rule, the chunk-start and dual forms included (their cache keeps the
chunk-start memory and the partial chunk: docs/models.md, "Decoding").
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from miras.hf.cache_miras import MirasCache
from miras.hf.configuration_miras import MirasConfig
from miras.models.model import LanguageModel, check_length
from miras.models.padding import token_mask

IGNORE_INDEX = -100  # transformers' label for "no target here"
SHIM = "miras_hf.py"
SHIM_TEXT = (
    '"""The miras model classes, from the installed miras (pip install \'miras[hf]\')."""\n'
    "from miras.hf import MirasConfig, MirasForCausalLM, MirasModel  # noqa: F401\n"
)
AUTO_MAP = {
    "AutoConfig": "miras_hf.MirasConfig",
    "AutoModel": "miras_hf.MirasModel",
    "AutoModelForCausalLM": "miras_hf.MirasForCausalLM",
}


class MirasPreTrainedModel(PreTrainedModel):
    config_class = MirasConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _is_stateful = True  # a recurrent state: no assisted decoding (it needs a rollback)

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: LanguageModel initializes its own weights (the memory layers' gate biases
        and initial states are not a normal draw), and from_pretrained loads every one."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading, then every weight copied into memory of its own: safetensors
        leaves them at offsets of a mapped file (8 or 24 bytes past a 64-byte boundary), where
        the CPU's matrix kernels take other paths and the logits differ in the last bits
        (5.6e-17 in float64). Copied, they equal the saved model's bit for bit."""
        model = super().from_pretrained(*args, **kwargs)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = tensor.data.clone()
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' saving, plus `miras_hf.py`, a two-line module that imports these
        classes from the installed miras, named in config.json's `auto_map`: tools that load
        with `trust_remote_code=True` (the plain `lm_eval` command) find the model without
        importing miras.hf themselves. The directory holds no other code."""
        self.config.auto_map = AUTO_MAP
        super().save_pretrained(save_directory, *args, **kwargs)
        (Path(save_directory) / SHIM).write_text(SHIM_TEXT)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its MirasCache; a DynamicCache holds only keys and values


class MirasModel(MirasPreTrainedModel):
    """input_ids [B, T] -> last_hidden_state [B, T, D] (after the final norm), and the cache."""

    def __init__(self, config: MirasConfig):
        super().__init__(config)
        # from_pretrained builds on the meta device; a memory layer's constructor computes
        # its gates' starting biases from its feature map (real numbers), so it is built on
        # the CPU there, and the loaded weights replace every value.
        building = torch.get_default_device()
        with torch.device("cpu") if building.type == "meta" else contextlib.nullcontext():
            self.lm = LanguageModel(config.miras_spec(), config.vocab_size)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.lm.embed = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: MirasCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """`attention_mask` [B, T] (or [B, seen + T] while generating: its last T columns are
        these tokens'), 1 a token and 0 padding, left or right padding. `cu_seqlens` [N + 1]
        (int, 0 = s_0 < ... < s_N = T) packs N sequences in one row of input_ids [1, T]:
        each runs alone, from the empty state. transformers' packing collator
        (DataCollatorWithFlattening) gives the same as `cu_seq_lens_q`, or as `position_ids`
        [1, T] that restart at 0 (read only for one row without a cache or a mask); positions
        otherwise come from the mask and the cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("MirasModel: pass exactly one of input_ids and inputs_embeds")
        cu_seqlens = packed_offsets(cu_seqlens, kwargs, attention_mask, past_key_values)
        x = self.lm.embed(input_ids) if inputs_embeds is None else inputs_embeds
        check_length(x)
        if use_cache is None:  # by default no cache in training (Trainer) or for packed rows
            use_cache = past_key_values is not None or (
                self.config.use_cache and not self.training and cu_seqlens is None
            )
        if past_key_values is not None and not isinstance(past_key_values, MirasCache):
            raise TypeError(
                f"past_key_values: expected a MirasCache (or None), got "
                f"{type(past_key_values).__name__}"
            )
        cache = past_key_values
        if use_cache and cache is None:
            cache = MirasCache(len(self.lm.blocks))
        mask = self._mask(attention_mask, x, cache)
        if cu_seqlens is not None:
            if cache is not None or mask is not None:
                raise ValueError(
                    "cu_seqlens: packed sequences run from the empty state, without a cache or "
                    "an attention_mask (pass use_cache=False)"
                )
            x, mask, unpack = packed_rows(x, cu_seqlens)
        hidden = [x] if output_hidden_states else None
        for i, block in enumerate(self.lm.blocks):
            if cache is not None:
                layer = cache.layers[i]
                state = layer.state
                if state is None:
                    state = block.mixer.empty_cache(x.shape[0])
                x, layer.state = block(x, state, mask)
            elif self.gradient_checkpointing and self.training:
                x, _ = self._gradient_checkpointing_func(block.__call__, x, None, mask)
            else:
                x, _ = block(x, attention_mask=mask)
            if hidden is not None:
                hidden.append(x)
        x = self.lm.norm(x)
        if cu_seqlens is not None:
            x = unpack(x)
            hidden = None if hidden is None else [unpack(h) for h in hidden]
        if cache is not None:
            cache.seen += x.shape[1]
        return BaseModelOutputWithPast(
            last_hidden_state=x,
            past_key_values=cache if use_cache else None,
            hidden_states=None if hidden is None else tuple(hidden),
        )

    @staticmethod
    def _mask(attention_mask, x: torch.Tensor, cache: MirasCache | None):
        """The mask of these T tokens [B, T], or None where every entry is a token."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            got = (
                list(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise ValueError(
                f"attention_mask: expected a 2-D padding mask [B, T] (1 a token, 0 padding), "
                f"got {got}; miras models make their own causal masks"
            )
        t = x.shape[1]
        seen = 0 if cache is None else cache.seen
        if attention_mask.shape[1] == seen + t and seen:
            attention_mask = attention_mask[:, seen:]
        token_mask(attention_mask, x.shape[:2])  # names the expected shape
        return None if bool((attention_mask != 0).all()) else attention_mask


def packed_offsets(cu_seqlens, kwargs: dict, attention_mask, cache):
    """The packing of one row [1, T]: `cu_seqlens`, else the packing collator's
    `cu_seq_lens_q`, else the starts of `position_ids` [1, T] where they restart at 0 (for one
    row without a cache or a padding mask: a generate step's positions are not a packing)."""
    if cu_seqlens is not None:
        return cu_seqlens
    if kwargs.get("cu_seq_lens_q") is not None:
        return kwargs["cu_seq_lens_q"]
    positions = kwargs.get("position_ids")
    if positions is None or cache is not None or attention_mask is not None:
        return None
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[0] != 1:
        return None
    starts = (positions[0] == 0).nonzero().flatten()
    if len(starts) < 2 or int(starts[0]) != 0:
        return None  # one sequence (or positions that do not start at 0): nothing packed
    return torch.cat([starts, starts.new_tensor([positions.shape[1]])])


def packed_rows(x: torch.Tensor, cu_seqlens):
    """x [1, T, D] holding N sequences at cu_seqlens [N + 1] -> (rows [N, L, D] right-padded,
    their mask [N, L], unpack: [N, L, D'] -> [1, T, D'])."""
    if x.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens: expected packed sequences in one row, input of shape [1, T], got "
            f"batch {x.shape[0]}"
        )
    bounds = torch.as_tensor(cu_seqlens).tolist()
    t = x.shape[1]
    ok = len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == t
    if not ok or any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"cu_seqlens: expected increasing offsets from 0 to the tokens T = {t} (each "
            f"sequence at least one token), got {bounds}"
        )
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    longest = max(lengths)
    rows = x.new_zeros(len(lengths), longest, *x.shape[2:])
    mask = torch.zeros(len(lengths), longest, dtype=torch.long, device=x.device)
    for n, (a, length) in enumerate(zip(bounds, lengths, strict=False)):
        rows[n, :length], mask[n, :length] = x[0, a : a + length], 1

    def unpack(y: torch.Tensor) -> torch.Tensor:
        return torch.cat([y[n, :length] for n, length in enumerate(lengths)])[None]

    return rows, (None if len(set(lengths)) == 1 else mask), unpack


class MirasForCausalLM(MirasPreTrainedModel, GenerationMixin):
    """MirasModel and the tied head: logits = hidden @ E^T (E the token embedding)."""

    def __init__(self, config: MirasConfig):
        super().__init__(config)
        self.model = MirasModel(config)
        self.post_init()

    @classmethod
    def from_spec(cls, spec, vocab_size: int, **model_overrides) -> MirasForCausalLM:
        """A fresh model of `spec` (a path, YAML text, a dict or a Spec) for `vocab_size`
        tokens; `model_overrides` set fields of its `model:` section (d_model=32, ...)."""
        return cls(MirasConfig.from_spec(spec, vocab_size, **model_overrides))

    @classmethod
    def from_language_model(cls, lm: LanguageModel) -> MirasForCausalLM:
        """The transformers model of a trained `LanguageModel`, with its weights (a copy)."""
        if lm.readout is not None:
            raise ValueError(
                "from_language_model: the model has a task's own input and output layers "
                "(not token ids through an embedding); only token models convert"
            )
        model = cls.from_spec(lm.spec, lm.vocab_size)
        model.model.lm.load_state_dict(lm.state_dict())
        return model.to(next(lm.parameters()).dtype)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.lm.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.lm.embed = value

    def generate(self, inputs=None, *args, **kwargs):
        """transformers' `generate`, refusing an empty batch (B = 0) by name: transformers'
        decoding loop stops on the max of the rows' unfinished flags, which has no value for
        no rows. (`LanguageModel.generate` returns [0, steps] for one.)"""
        for name, x in (
            ("inputs", inputs),
            ("input_ids", kwargs.get("input_ids")),
            ("inputs_embeds", kwargs.get("inputs_embeds")),
        ):
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == 0:
                raise ValueError(
                    f"{name}: generate needs at least one row (B >= 1), got shape "
                    f"{list(x.shape)}; an empty batch has nothing to continue"
                )
        return super().generate(inputs, *args, **kwargs)

    def get_output_embeddings(self):
        return None  # the head is the embedding itself (tied), not a module

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: MirasCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`labels` [B, T] are the input ids (shifted here: position t predicts label t + 1;
        -100, padding and, with `cu_seqlens`, each sequence's first token are no target).
        `logits_to_keep`: n > 0 keeps the last n positions' logits, a tensor of indices keeps
        those; the loss is taken on the kept logits."""
        cu_seqlens = packed_offsets(cu_seqlens, kwargs, attention_mask, past_key_values)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = hidden[:, keep] @ self.model.lm.embed.weight.T  # the tied head
        loss = None
        if labels is not None:
            labels = labels.clone()
            if attention_mask is not None and attention_mask.shape == labels.shape:
                labels[attention_mask == 0] = IGNORE_INDEX
            if cu_seqlens is not None:
                labels[:, torch.as_tensor(cu_seqlens)[:-1]] = IGNORE_INDEX  # no cross-sequence
            loss = shifted_loss(logits, labels[:, keep], num_items_in_batch)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
        )


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor, num_items=None) -> torch.Tensor:
    """Cross-entropy of logits [B, T, V] at t against labels [B, T] at t + 1 (at least float32), the
    mean over targets, or their sum / `num_items` (the Trainer's count over accumulated
    batches). Without targets (an empty batch, B = 0, or every label -100) the mean is 0, the
    sum over none (its gradients zero), not cross_entropy's 0 / 0 = NaN: an empty shard adds
    nothing to the losses summed or averaged across shards."""
    targets = labels[:, 1:].reshape(-1).to(logits.device)
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    flat = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
    loss = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items is None:
        count = (targets != IGNORE_INDEX).sum().clamp_min(1)
    else:
        count = torch.as_tensor(num_items, device=loss.device)
    return loss / count
