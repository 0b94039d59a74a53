"""How much memory a run needs, estimated from the spec's sizes before anything is allocated.

    estimate = training_estimate(spec, batch_size=32, seq_len=128, vocab_size=256)
    require(estimate, "training")   # ResourceError when the machine has less than it needs

An estimate is a list of parts (parameters with their gradients and AdamW moments, the memory
states the backward keeps, the largest activations), each with the fields that size it, so a
refusal names the fields to lower: "training needs about 96.0 GiB (model.d_model = 65536,
batch_size = 32, ...), the machine has 12.3 GiB available". The figures are float32 (float64
for the checks), and rough: within a small factor, which is what a refusal needs. Imports no
torch unless asked about a GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miras.spec import Spec

GiB = 1 << 30
FLOAT32 = 4
FLOAT64 = 8
# The end-to-end check (`miras check`) walks T = c + 3 tokens through an autograd oracle that
# sums each token's window of c terms: T * c term evaluations, about 1000 a second on one core
# (measured: c = 64, 4.3k terms, 4.5 s; c = 256, 66k terms, 68 s).
CHECK_TERMS = 70_000


class ResourceError(ValueError):
    """A run needs more memory (or more work) than the machine has; names the fields to lower."""


@dataclass(frozen=True)
class Part:
    """One allocation: what it is, its bytes, and the sizes (field path -> value) behind it."""

    what: str
    bytes: int
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimate:
    parts: tuple[Part, ...]

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    def fields(self) -> dict[str, Any]:
        """The sizes behind the largest parts, largest first: those making up 90% of the
        total (the fields a refusal asks to lower)."""
        named: dict[str, Any] = {}
        covered = 0
        for part in sorted(self.parts, key=lambda p: -p.bytes):
            named.update({k: v for k, v in part.fields.items() if k not in named})
            covered += part.bytes
            if covered >= 0.9 * self.total:
                break
        return named

    def describe(self) -> str:
        """'3.2 GiB: parameters 1.0 GiB, states 2.2 GiB, ...' (parts of 1% or more)."""
        shown = [p for p in self.parts if p.bytes >= 0.01 * self.total]
        parts = ", ".join(f"{p.what} {gib(p.bytes)}" for p in shown)
        return f"{gib(self.total)}: {parts}"


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def available_bytes(device: Any = None) -> int:
    """Free memory of `device` (a torch.device or a name; None or cpu: the machine's RAM):
    /proc/meminfo's MemAvailable, else all physical pages; a GPU's free memory."""
    name = str(device) if device is not None else "cpu"
    if name.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(name))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def require(estimate: Estimate, what: str, device: Any = None, available: int | None = None):
    """Raise ResourceError when `estimate` exceeds the memory of `device` (or `available`)."""
    have = available_bytes(device) if available is None else available
    if estimate.total <= have:
        return
    sizes = ", ".join(f"{k} = {v}" for k, v in estimate.fields().items())
    where = "the GPU has" if str(device or "").startswith("cuda") else "the machine has"
    raise ResourceError(
        f"{what} needs about {gib(estimate.total)} ({sizes}), {where} {gib(have)} available; "
        f"lower those sizes (the estimate: {estimate.describe()})"
    )


# ---------------------------------------------------------------------------------------------
# What a spec's memory layer holds


def _state_numel(spec: Spec, head_dim: int) -> int:
    """Entries of one head's memory state (with the optimizer's state): [Dv, Dphi] for a
    matrix memory, the sum of the MLP's weights for a deep one, 0 for softmax attention (no
    weights: its KV cache is counted as attention)."""
    d_phi = spec.memory.feature_width(spec, head_dim)
    shapes = spec.memory.parameter_shapes(d_phi, head_dim)
    n = sum(math.prod(shape) for shape in shapes.values())
    return 2 * n if spec.optimizer.stateful else n


def _memory_fields(spec: Spec) -> dict[str, Any]:
    named: dict[str, Any] = {
        "model.d_model": spec.model.d_model,
        "model.n_heads": spec.model.n_heads,
    }
    if spec.feature_map.output_dim(4) != 4:  # a map that widens the features
        named["feature_map.kind"] = spec.feature_map.kind
    named.update({f"memory.{k}": value for k, value in spec.memory.size_fields().items()})
    return named


def _reach(spec: Spec, length: int) -> int:
    """How many past tokens each token's step or read looks at: the Omega window, an
    attention window, or the whole prefix (`Memory.lookback`)."""
    return min(length, spec.memory.lookback(spec) or length)


def training_estimate(spec: Spec, *, batch_size: int, seq_len: int, vocab_size: int) -> Estimate:
    """Bytes to train the spec's model (its `model:` section) on [batch_size, seq_len] batches
    of a vocabulary of `vocab_size`, in float32."""
    m = spec.model
    d, h, n_layers, b, t = m.d_model, m.n_heads, m.n_layers, batch_size, seq_len
    head_dim = m.head_dim
    d_phi = spec.memory.feature_width(spec, head_dim)
    size = {"model.d_model": d, "model.n_layers": n_layers}
    tokens = {"batch_size": b, "seq_len": t}

    # Parameters: the tied embedding, per block the mixer (q, k, v, o and the gates' low-rank
    # maps) and the SwiGLU (3 matrices of 2/3 * expansion * D); x4 with gradients and AdamW.
    hidden = max(8, math.ceil(2 * m.mlp_expansion * d / 3))
    per_block = 4 * d * d + 2 * m.gate_rank * d + 3 * d * hidden
    # n optimizer steps per token: the rule runs T*n steps; with keys per step the layer
    # projects n keys and values per token (2 (n - 1) more D x D maps). Softmax attention
    # takes one step only (validation refuses more).
    steps = spec.optimizer.steps_per_token()
    if "k" in spec.optimizer.per_step_inputs():
        per_block += 2 * (steps - 1) * d * d
    rule_steps = t * steps
    if m.variant in ("mal", "mag"):
        per_block += 4 * d * d  # the sliding-window attention beside the memory
    params = vocab_size * d + n_layers * per_block
    parts = [
        Part(
            "parameters",
            4 * FLOAT32 * params,
            {**size, "model.mlp_expansion": m.mlp_expansion, "vocab_size": vocab_size},
        )
    ]

    # Activations the backward keeps, per block and token: norms, projections, the conv, the
    # gates, the features of keys and queries, the SwiGLU's hidden units (calibrated: d_model
    # 256, 4 heads, T = 512, batch 16 and 48 kept 108 KB per token and block, about 27k
    # floats); then the logits (x3: logits, log-softmax, their gradient).
    per_token = 64 * d + 6 * hidden + 8 * h * d_phi
    parts.append(Part("activations", FLOAT32 * b * t * n_layers * per_token, {**size, **tokens}))
    parts.append(
        Part("logits", 3 * FLOAT32 * b * t * vocab_size, {**tokens, "vocab_size": vocab_size})
    )

    memory = m.variant not in ("attention", "swa")
    closed = spec.memory.closed_form() is not None  # softmax attention: no state to step
    if memory and not closed:
        # One state per head at every chunk boundary (every token on the recurrent backend).
        chunk = m.chunk_size or 64
        saved = rule_steps + 1 if m.backend == "recurrent" else math.ceil(rule_steps / chunk) + 1
        numel = _state_numel(spec, head_dim)
        stepped = {"optimizer.steps": steps} if steps > 1 else {}
        parts.append(
            Part(
                "memory states",
                FLOAT32 * b * h * numel * saved * n_layers,
                {**_memory_fields(spec), **tokens, "model.chunk_size": chunk, **stepped},
            )
        )
        # The chunk form's within-chunk matrices, [B, H, T / b, b, b], several of them.
        parts.append(
            Part(
                "chunk matrices",
                8 * FLOAT32 * b * h * rule_steps * min(chunk, rule_steps) * n_layers,
                {"model.chunk_size": chunk, **tokens, "model.n_heads": h, **stepped},
            )
        )
        reach = _reach(spec, t)
        if reach > 1:  # the window's weights within each chunk, [B, H, T, min(b + c, T)]
            width = min(t, chunk + reach)
            parts.append(
                Part(
                    "window",
                    2 * FLOAT32 * b * h * t * width * n_layers,
                    {"window.c": spec.window.c, **tokens, "model.n_heads": h},
                )
            )
    # Softmax attention scores and probabilities: [B, H, T, keys in reach].
    if not memory or m.variant in ("mal", "mag") or closed:
        reach = t if m.variant == "attention" else min(t, m.swa_window)
        named = {"model.swa_window": m.swa_window}
        if memory and closed:
            reach, named = _reach(spec, t), spec.memory.lookback_fields(spec)
        parts.append(
            Part(
                "attention",
                2 * FLOAT32 * b * h * t * reach * n_layers,
                {**named, **tokens, "model.n_heads": h},
            )
        )
    if m.variant == "mac":  # attention over each segment with its retrieved memory
        width = 2 * m.mac_segment + m.persistent_tokens
        parts.append(
            Part(
                "attention",
                2 * FLOAT32 * b * h * t * width * n_layers,
                {"model.mac_segment": m.mac_segment, **tokens, "model.n_heads": h},
            )
        )
    return Estimate(tuple(parts))


def check_estimate(spec: Spec, length: int, heads: int, d_key: int) -> Estimate:
    """Bytes the end-to-end check keeps (float64): a trace of every piece of every step of its
    `length` tokens, with the window's keys and values, for the oracle and the runtime."""
    d_phi = spec.memory.feature_width(spec, d_key)
    numel = max(_state_numel(spec, d_key), d_phi * d_key)
    reach = _reach(spec, length)
    named = spec.memory.lookback_fields(spec)
    _, scores = spec.memory.oracle_cost(spec, length)  # softmax attention's masked scores
    per_token = 16 * numel + 4 * reach * (d_phi + d_key) + 4 * scores
    return Estimate(
        (Part("check traces", FLOAT64 * heads * length * per_token, {**named, "T": length}),)
    )


def check_work(spec: Spec, length: int) -> None:
    """Refuse an end-to-end check whose oracle would sum more than CHECK_TERMS window terms
    (T tokens times the c of each one's window): hours, not seconds."""
    terms, _ = spec.memory.oracle_cost(spec, length)  # none for softmax attention's matmul
    if terms > CHECK_TERMS:
        raise ResourceError(
            f"the end-to-end check runs T = {length} tokens (c + 3, to reach past the window) "
            f"through a per-token autograd oracle that sums each token's window: {terms} terms "
            f"(window.c = {spec.window.c}), over the {CHECK_TERMS} it does in about a minute; "
            "check the rule at a smaller window (its derived pieces do not depend on c)"
        )


def check_fits(rule: Any) -> None:
    """Refuse the end-to-end check of a compiled rule (`MemoryRule`) that would not fit in
    memory or would run for hours, before it allocates; ResourceError names the window."""
    from miras.checks.inputs import sizes_for

    sizes = sizes_for(rule)
    check_work(rule.spec, sizes.length)
    estimate = check_estimate(rule.spec, sizes.length, sizes.heads, sizes.d_key)
    require(estimate, "the end-to-end check")


def probe_estimate(spec: Spec, options: dict[str, Any]) -> Estimate | None:
    """Bytes a probe of the bare rule keeps (`miras.probes`, float64, recurrent, no autograd):
    for each of its `trials` and each gate configuration of the grid (one head each), the state
    and its update, and the stream of keys and values. `options` are the probe's (d_k, trials,
    pair_counts, length, n_pairs, passes); None when they are not integers (the probe refuses
    them itself)."""
    from miras.probes.base import declared_grid

    d_k, trials, passes = (
        options.get(k, v) for k, v in (("d_k", 16), ("trials", 16), ("passes", 1))
    )
    pair_counts = options.get("pair_counts") or ()
    if not isinstance(pair_counts, (list, tuple)):
        return None
    counts = [options.get("length"), options.get("n_pairs"), *pair_counts]
    ints = [d_k, trials, passes, *(c for c in counts if c is not None)]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in ints):
        return None
    tokens = passes * max([4 * d_k, *(c for c in counts if c is not None)])
    grid = declared_grid(spec)
    heads = math.prod(len(grid.get(g, (1,))) for g in spec.gates())
    d_phi = spec.memory.feature_width(spec, d_k)
    numel = max(_state_numel(spec, d_k), d_phi * d_k)
    reach = _reach(spec, tokens)
    named = {"d_k": d_k, "trials": trials, "gates": heads}
    memory = {k: v for k, v in _memory_fields(spec).items() if not k.startswith("model.")}
    per_head = 3 * numel + tokens * (2 * d_phi + d_k) + reach * (d_phi + d_k)
    return Estimate(
        (
            Part(
                "probe states and stream",
                FLOAT64 * trials * heads * per_head,
                {**memory, **named, "tokens": tokens, "window.c": spec.window.c},
            ),
        )
    )
