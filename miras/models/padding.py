"""Padded batches: the attention mask, left alignment, and caches kept one row at a time.

An attention mask [B, T] holds 1 for a token and 0 for padding, one contiguous run of tokens
per row (left or right padding), so a padded batch can equal its unpadded sequences:

- the attention mixers left-align a padded batch (each row's tokens moved to the end, in
  order), so that every row's tokens follow its cached past directly and the next token
  continues all rows at once;
- the memory layers run each row's tokens alone from its own row of the cache
  (`rows_alone`), and stack the rows' caches back into one;
- a cache that grows along time (keys and values [B, H, T, d], a `window: global` memory's
  carried tokens [B, H, P, .]) is padded in front with empty slots when rows of different
  lengths are stacked: zeros that the mixers mask (keys beyond a row's count, window.valid = 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Cache = dict[str, object]
TIME = 2  # the time axis of a growing cache entry: [B, H, T, d]


def token_mask(mask, shape) -> torch.Tensor:
    """`attention_mask` checked against the batch `shape` (B, T): 0/1 (or bool) values with one
    contiguous run of 1s per row -> bool [B, T], True at the tokens."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape):
        got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: expected a tensor [B, T] = {list(shape)}, got {got}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask: expected 0 (padding) or 1 (a token), got other values")
    valid = mask != 0
    runs = valid[:, :1].sum(1) + (valid[:, 1:] & ~valid[:, :-1]).sum(1)  # starts of runs of 1s
    broken = (runs > 1).nonzero()
    if len(broken):
        raise ValueError(
            f"attention_mask: row {int(broken[0, 0])} is not one contiguous run of tokens "
            "(left or right padding only)"
        )
    return valid


def padding_spans(mask, shape) -> list[tuple[int, int]]:
    """An attention mask [B, T] (checked by `token_mask`) -> each row's token span
    (start, stop); an all-0 row is (0, 0)."""
    valid = token_mask(mask, shape)
    lengths = valid.sum(1).tolist()
    starts = valid.to(torch.uint8).argmax(1).tolist()  # the first 1 (0 for an all-0 row)
    return [(s, s + n) if n else (0, 0) for s, n in zip(starts, lengths, strict=True)]


def left_aligned(valid: torch.Tensor) -> torch.Tensor:
    """valid [B, T] bool -> indices [B, T] that move each row's True entries to the end, in
    order, and the rest in front (a stable sort)."""
    return torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices


def take(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x [B, ..., T, ...] reordered along `dim` by index [B, T] (one order per row)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = index.shape
    full = list(x.shape)
    full[dim] = index.shape[1]
    return x.gather(dim, index.view(shape).expand(full))


def cache_row(cache, b: int):
    """Row b of a cache (a dict of tensors, nested), each tensor [1, ...]."""
    if isinstance(cache, dict):
        return {name: cache_row(value, b) for name, value in cache.items()}
    return cache[b : b + 1]


def pad_front(x: torch.Tensor, length: int) -> torch.Tensor:
    """A growing cache entry [B, H, T, d] with empty (zero) slots in front up to `length`."""
    if x.dim() <= TIME or x.shape[TIME] == length:
        return x
    front = x.new_zeros(*x.shape[:TIME], length - x.shape[TIME], *x.shape[TIME + 1 :])
    return torch.cat([front, x], dim=TIME)


def _entries(caches: list[dict]) -> dict[str, list]:
    """name -> each cache's entry. A growing entry that a cache lacks has no slots yet (a
    memory's carried window before its first token), so it is made empty, like the others."""
    names = list(dict.fromkeys(name for cache in caches for name in cache))
    entries = {}
    for name in names:
        like = next(cache[name] for cache in caches if name in cache)
        entries[name] = [
            cache[name] if name in cache else _no_slots(like, _batch(cache)) for cache in caches
        ]
    return entries


def _no_slots(like: torch.Tensor, batch: int) -> torch.Tensor:
    """An entry shaped like `like` [B, H, T, d] with `batch` rows and no slots (T = 0)."""
    return like.new_zeros(batch, *like.shape[1:TIME], 0, *like.shape[TIME + 1 :])


def _batch(cache: dict) -> int:
    return next(v for v in cache.values() if isinstance(v, torch.Tensor)).shape[0]


def stack_rows(rows: list):
    """Caches of single rows -> one cache of B rows; growing entries padded in front."""
    if isinstance(rows[0], dict):
        return {name: stack_rows(values) for name, values in _entries(rows).items()}
    length = max(row.shape[TIME] for row in rows) if rows[0].dim() > TIME else 0
    return torch.cat([pad_front(row, length) for row in rows])


def select_rows(keep: torch.Tensor, new, old):
    """Row b of `new` where keep[b] ([B] bool), else of `old`; growing entries padded in front
    to the longer of the two."""
    if isinstance(new, dict):
        entries = _entries([new, old])
        return {name: select_rows(keep, *values) for name, values in entries.items()}
    if new.dim() > TIME:
        length = max(new.shape[TIME], old.shape[TIME])
        new, old = pad_front(new, length), pad_front(old, length)
    return torch.where(keep.view(-1, *[1] * (new.dim() - 1)), new, old)


def rows_alone(
    run: Callable[[torch.Tensor, Cache | None], tuple[torch.Tensor, Cache | None]],
    x: torch.Tensor,
    attention_mask,
    cache: Cache | None,
) -> tuple[torch.Tensor, Cache | None]:
    """Each row's tokens alone: run(x_b [1, n, D], its row of the cache or None) ->
    (y_b [1, n, D], its new cache). Returns y [B, T, D] with 0 at padding, and the rows' caches
    stacked (None without a cache). Cost: B sequential runs. An empty batch (B = 0) has no row
    to align, so it runs whole: empty outputs, its (empty) cache, gradients of the run."""
    spans = padding_spans(attention_mask, x.shape[:2])
    if not spans:
        return run(x, cache)
    ys, caches = [], []
    for b, (start, stop) in enumerate(spans):
        row_cache = None if cache is None else cache_row(cache, b)
        y = x.new_zeros(1, *x.shape[1:])
        if stop > start:
            y_b, row_cache = run(x[b : b + 1, start:stop], row_cache)
            y = torch.cat([y[:, :start], y_b, y[:, stop:]], dim=1)
        ys.append(y)
        caches.append(row_cache)
    return torch.cat(ys), None if cache is None else stack_rows(caches)
