"""MirasCache: a transformers `Cache` holding each block's decoding state.

One `MirasLayerCache` per block holds that block's mixer cache, the dict its mixer's
`empty_cache(batch)` makes and its forward returns (docs/models.md):

- a memory layer: `memory` (the memory state in the rule's form: W, its momentum S.W, and the
  Omega window's carried tokens for `window.c > 1` or `global`; for a chunk-start or dual
  form, the state at the current chunk's start), `conv` (the short conv's last
  `conv_size - 1` inputs [B, conv_size - 1, 3D]), and for a chunk-start or dual form
  `pending`, the partial chunk's q, k, v, gates [B, H, L, .] and `valid` [B, 1, L];
- attention and SWA: `k`, `v` [B, H, Tc, D/H] (the last `window` tokens for SWA, left-aligned),
  `conv`, and `pos` [B] (the tokens each row has seen);
- MAL / MAG: `memory` and `swa`, one of each; MAC: `memory`, `start` (the segment-start memory),
  the segment's `k`, `v` and `pos`.

Every tensor has the batch on axis 0, so beam search's reordering is an index on axis 0.
A recurrent state cannot be rolled back: `crop` refuses (assisted and speculative decoding
need it, and refuse with it).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def map_tensors(state, fn):
    """A nested cache dict with `fn` applied to every tensor."""
    if isinstance(state, dict):
        return {name: map_tensors(value, fn) for name, value in state.items()}
    return fn(state) if isinstance(state, torch.Tensor) else state


class MirasLayerCache(CacheLayerMixin):
    """One block's mixer cache (`state`, None before the block's first token)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state: dict | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        raise TypeError("MirasLayerCache holds a mixer's state, not keys and values to update")

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError(
            "MirasLayerCache holds a mixer's state (memory, conv, keys and values together); "
            "the miras model updates it itself"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0  # the count of tokens lives on MirasCache

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.state = map_tensors(self.state, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.state = map_tensors(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = map_tensors(self.state, lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "MirasCache: a recurrent memory state cannot be rolled back, so crop is not "
            "supported (assisted and speculative decoding need it); generate without them"
        )

    @property
    def batch_size(self) -> int:
        if self.state is None:
            return -1
        found = []
        map_tensors(self.state, lambda t: found.append(t.shape[0]))
        return found[0] if found else -1


class MirasCache(Cache):
    """The decoding state of a miras model: one `MirasLayerCache` per block, and `seen`, the
    columns of input the model has consumed (padding included), which `get_seq_length`
    reports to `generate`."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[MirasLayerCache() for _ in range(num_layers)])
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self):
        super().reset()
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.layers[0].crop(tokens_to_remove)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.seen > 0
