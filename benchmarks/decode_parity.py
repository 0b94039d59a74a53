"""Decode against the uncached forward, per shipped spec and per hybrid (issue 37).

    .venv/bin/python benchmarks/decode_parity.py [--specs titans atlas] [--dtypes float64 float32]

For each spec in specs/ (and the hybrids mal, mag, mac of Titans, and Titans with persistent
tokens), a tiny one-layer model (d_model 16, 2 heads; the spec's own chunk size) runs one
uncached forward over T = 2 chunks + 5 tokens, then the same tokens as a prefill of P tokens
followed by one token at a time through the cache (`LanguageModel.decode`); the table gives
max |logits(decode) - logits(forward)| over all positions, per dtype and per prefill length P
(0: every token through the cache one at a time). CPU, one thread, seed 0.

`--timing` prints instead the cost of one decoded token (d_model 64, 2 heads, 1 layer, batch
1, float32, the median of 64 tokens after a prefill of 64): the cache that follows the chunk
form (rerunning the partial chunk, O(chunk) per token) against the recurrent step on the
same weights (what decoding ran before, O(1) per token).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from miras.models import build_model
from miras.models.layer import MirasLayer
from miras.runtime.forms import resolve_mode
from miras.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32
EXTRA = 5  # tokens past the second chunk
HYBRIDS = {  # name -> (spec file, model overrides)
    "titans+mal": ("titans", {"variant": "mal", "swa_window": 8}),
    "titans+mag": ("titans", {"variant": "mag", "swa_window": 8}),
    "titans+mac": ("titans", {"variant": "mac", "mac_segment": 16}),
    "titans+mac seg 12": ("titans", {"variant": "mac", "mac_segment": 12}),
    "titans+persistent": ("titans", {"persistent_tokens": 3}),
    "atlas+mal": ("atlas", {"variant": "mal", "swa_window": 8}),
}


def tiny_model(name: str, overrides: dict, dtype: torch.dtype):
    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    small = {"d_model": 16, "n_heads": 2, "n_layers": 1, "gate_rank": 4, **overrides}
    model_section = spec.model.model_copy(update=small)
    spec = spec.model_copy(update={"model": type(spec.model)(**model_section.model_dump())})
    torch.manual_seed(0)
    model = build_model(spec, VOCAB).to(dtype).eval()
    return model


def form_of(model) -> tuple[int | None, str]:
    """(chunk size, resolved form) of the model's first memory layer; (None, "attention")."""
    for module in model.modules():
        if isinstance(module, MirasLayer):
            form = module.rule.plan.chunk_form
            mode = resolve_mode(module.chunk_mode, form, module.rule.spec.name)
            return module.chunk_size, mode
    return None, "attention"


@torch.no_grad()
def decode_error(model, tokens: torch.Tensor, prefill: int) -> float:
    """max |decode logits - forward logits| with `prefill` tokens at once, then one by one."""
    full = model(tokens)
    cache = model.empty_cache(tokens.shape[0])
    pieces = []
    if prefill:
        logits, cache = model.decode(tokens[:, :prefill], cache)
        pieces.append(logits)
    for t in range(prefill, tokens.shape[1]):
        logits, cache = model.decode(tokens[:, t : t + 1], cache)
        pieces.append(logits)
    return (torch.cat(pieces, dim=1) - full).abs().max().item()


@torch.no_grad()
def token_times(model, prefill: int = 64, tokens: int = 64) -> float:
    """Median seconds of one `decode` call of one token after a prefill."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, VOCAB, (1, prefill + tokens), generator=gen)
    _, cache = model.decode(x[:, :prefill], model.empty_cache(1))
    times = []
    for t in range(prefill, prefill + tokens):
        start = time.perf_counter()
        _, cache = model.decode(x[:, t : t + 1], cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing(names: list[str]) -> None:
    print(f"{'spec':<22} {'chunk':>5} {'chunk-form cache ms':>20} {'recurrent step ms':>18} ratio")
    for name in names:
        chunked = tiny_model(name, {"d_model": 64}, torch.float32)
        chunk, _ = form_of(chunked)
        recurrent = tiny_model(name, {"d_model": 64, "backend": "recurrent"}, torch.float32)
        recurrent.load_state_dict(chunked.state_dict())
        a, b = token_times(chunked), token_times(recurrent)
        print(f"{name:<22} {chunk:>5} {1e3 * a:>20.2f} {1e3 * b:>18.2f} {a / b:5.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="*", help="spec names or hybrid rows (default: all)")
    parser.add_argument("--dtypes", nargs="*", default=["float64", "float32"])
    parser.add_argument("--timing", action="store_true", help="one token's decode cost instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.timing:
        timing(args.specs or ["titans", "atlas", "memora", "dla"])
        return
    rows = [(path.stem, path.stem, {}) for path in sorted((ROOT / "specs").glob("*.yaml"))]
    rows += [(row, spec, over) for row, (spec, over) in HYBRIDS.items()]
    if args.specs:
        rows = [r for r in rows if r[0] in args.specs]
    print(
        f"{'spec':<22} {'chunk':>5} {'form':<10} {'dtype':<8} "
        + "  ".join(f"{'P=' + p:>9}" for p in ("0", "5", "b", "b+3"))
        + "  seconds"
    )
    for row, spec, overrides in rows:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            model = tiny_model(spec, overrides, dtype)
            chunk, form = form_of(model)
            b = chunk or 16
            gen = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, VOCAB, (2, 2 * b + EXTRA), generator=gen)
            start = time.perf_counter()
            errors = [decode_error(model, tokens, p) for p in (0, 5, b, b + 3)]
            seconds = time.perf_counter() - start
            cells = "  ".join(f"{e:9.1e}" for e in errors)
            print(f"{row:<22} {b:>5} {form:<10} {dtype_name:<8} {cells}  {seconds:7.1f}")


if __name__ == "__main__":
    main()
