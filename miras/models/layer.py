"""MirasLayer: a compiled memory rule inside a sequence-mixing layer.

    x [B, T, D] -> q, k, v projections -> short causal conv + SiLU -> l2-normalized q, k
                -> data-dependent gates (low rank, mapped into each gate's range)
                -> rule(q, k, v, gates) -> per-head RMSNorm -> * SiLU(W_g x) -> W_o -> [B, T, D]

The layout follows Titans section 3.1 and MIRAS section 5 (conv, normalized q and k, output norm
and gate), as fla's DeltaNet / Gated DeltaNet layers do. Training runs the rule's `chunk` backend
(or `triton`); decoding computes what that forward computes (docs/models.md, "Decoding"): where
the chunk form is exact, one recurrent step per token on a cache holding the memory state and
the conv's last inputs; where it is the chunk-start or dual form, the cache holds the memory at
the current chunk's start and the partial chunk's inputs, and each token reruns the chunk form
on that partial chunk (O(chunk) per token), the memory advancing at each chunk boundary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from miras.components.base import Range
from miras.errors import ForwardDiverged
from miras.ir import GateInfo
from miras.models.padding import Cache, cache_row, left_aligned, rows_alone, stack_rows, take
from miras.rule import MemoryRule
from miras.rule import compile as compile_rule
from miras.runtime import all_finite, default_chunk_size, first_bad, is_exact, resolve_mode
from miras.spec import Spec, load_spec

# What each gate starts at (in natural space: the gate projection starts at its bias) and the
# ceiling it is kept below are its component's declaration (`GateInfo.defaults`, from
# `Component.gate_defaults`; miras.components.base: STEP_SIZE_GATE, DECAY_GATE, ...).
# Open ends of a range are kept open in floating point: sigmoid(30) is exactly 1.0 in fp32.
OPEN_END_MARGIN = 1e-6
LOG_FLOOR = -30.0  # a positive learned state is exp(raw), raw >= this: never 0 in fp32
LOGIT_BOUND = 15.0  # a unit-interval one is sigmoid(raw), |raw| <= this: never 0 or 1 in fp32


def memory_dtype(parameters: torch.dtype) -> torch.dtype:
    """The precision the memory computes in for parameters of `parameters`' dtype: at least
    float32. A bf16 or fp16 model keeps its gates, the rule's inputs and the memory state in
    float32: with 8 significant bits a decay of 0.999 rounds to 1.0 and the memory would
    never forget, and the state sums many small updates (docs/hf.md, "Dtypes")."""
    return torch.promote_types(parameters, torch.float32)


class ShortConv(nn.Module):
    """Causal depthwise convolution over time followed by SiLU (Titans section 3.1; fla's
    ShortConvolution). Size 0 is the identity. The cache holds the last `size - 1` inputs."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.dim, self.size = dim, size
        if size > 0:
            self.weight = nn.Parameter(torch.empty(dim, 1, size))
            self.bias = nn.Parameter(torch.zeros(dim))
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv1d's default

    def empty_cache(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(batch, max(self.size - 1, 0), self.dim)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], cache [B, size - 1, C] (zeros: the sequence start) -> y [B, T, C], cache.

        `valid` [B, T] bool marks the tokens of a left-aligned batch (padding first): the past
        is moved next to each row's first token, so padding never reaches a token's window;
        the outputs at padding are don't-care."""
        if self.size == 0:
            return x, self.empty_cache(x.shape[0], x)
        past = self.empty_cache(x.shape[0], x) if cache is None else cache
        full = torch.cat([past, x], dim=1)  # [B, size - 1 + T, C]
        if valid is not None:
            order = left_aligned(torch.cat([valid.new_ones(past.shape[:2]), valid], dim=1))
            full = take(full, order, 1)  # [padding, past, tokens]
        y = F.conv1d(full.transpose(1, 2), self.weight, self.bias, groups=self.dim)
        return F.silu(y.transpose(1, 2)), full[:, full.shape[1] - (self.size - 1) :]


def squash(raw: torch.Tensor, allowed: Range, ceiling: float | None = None) -> torch.Tensor:
    """Map an unconstrained value into `allowed`: sigmoid for a bounded range (or a positive
    one with a ceiling), softplus for a half-line. Open ends stay open in floating point."""
    lo, hi = allowed.lo, allowed.hi if ceiling is None else ceiling
    if math.isfinite(lo) and math.isfinite(hi):
        y = lo + (hi - lo) * torch.sigmoid(raw)
    elif math.isfinite(lo):
        y = lo + F.softplus(raw)
    elif math.isfinite(hi):
        y = hi - F.softplus(-raw)
    else:
        return raw
    low = lo if allowed.lo_closed else lo + OPEN_END_MARGIN * max(1.0, abs(lo))
    if not math.isfinite(allowed.hi):
        return y.clamp(min=low)
    high = allowed.hi if allowed.hi_closed else allowed.hi - OPEN_END_MARGIN
    return y.clamp(min=low, max=high)


def unsquash(value: float, allowed: Range, ceiling: float | None = None) -> float:
    """The raw value that `squash` maps to `value` (for initial biases)."""
    lo, hi = allowed.lo, allowed.hi if ceiling is None else ceiling
    if math.isfinite(lo) and math.isfinite(hi):
        p = (value - lo) / (hi - lo)
        p = min(max(p, OPEN_END_MARGIN), 1 - OPEN_END_MARGIN)  # an end itself has no logit
        return math.log(p / (1 - p))
    if math.isfinite(lo):
        return math.log(math.expm1(value - lo))  # softplus^-1
    if math.isfinite(hi):
        return -math.log(math.expm1(hi - value))
    return value


def feature_norm_bound(rule: MemoryRule, d_key: int, random_keys: int = 64) -> float:
    """B = the largest ||phi(k)||^2 over unit keys k in R^d_key (the layer l2-normalizes them),
    measured at the map's initial parameters on probe keys: the one-hot keys +-e_j, the
    constant keys +-1/sqrt(d) and `random_keys` seeded random unit keys. Exact for the shipped
    maps (identity 1; polynomial (sum_i a_i)^2 at a one-hot key; taylor, exp_kernel: a
    function of ||k|| alone) and for an elementwise map whose f(x)^2 is concave in x^2 (elu
    + 1: d + 2 sqrt(d) + 1 at the constant key); `normalize: true` gives 1."""
    eye = torch.eye(d_key, dtype=torch.float64)
    constant = torch.full((1, d_key), d_key**-0.5, dtype=torch.float64)
    draw = torch.randn(random_keys, d_key, generator=torch.Generator().manual_seed(0))
    keys = torch.cat([eye, -eye, constant, -constant, draw.to(torch.float64)])
    keys = F.normalize(keys, dim=-1)[None, None]  # [1, 1, N, d]
    with torch.no_grad():
        phi = rule.program.feature(keys)
    return float(phi.pow(2).sum(-1).max())


class GateMaps(nn.Module):
    """Per-token, per-head gates from a low-rank projection of x, each in its valid range,
    starting at its declared start (`GateInfo.defaults`) and kept below its declared ceiling.

    x [B, T, D] -> {name: [B, T, H]}, one entry per `rule.plan.gates`."""

    def __init__(
        self,
        gates: tuple[GateInfo, ...],
        d_model: int,
        n_heads: int,
        rank: int,
        summed_steps: int = 1,
        feature_norm: float = 1.0,
        per_step: dict[str, int] | None = None,
    ):
        """`summed_steps`: how many tokens' gradients the chunk form takes at one state (the
        chunk size in the chunk-start and dual forms, 1 in the exact form); the step size (the
        gate whose role is "step_size", the learning rate) starts at its declared start /
        summed_steps, so a chunk's summed step starts as large as one token's. At 0.5 per token, Titans' MLP memory with momentum diverged to NaN within 224
        tokens at chunk 16 on random inputs (keys after SiLU share a direction, so the 16
        gradients add up).

        `feature_norm`: B, the largest ||phi(k)||^2 of a unit key (`feature_norm_bound`). The
        step a token takes at its own key is lr * ||phi(k)||^2: the delta rule's error there
        shrinks by 1 - lr ||phi(k)||^2, so it contracts below 2, overwrites at 1 and
        overshoots between. The start is min(start, 1 / B) / summed_steps: 0.5 for
        maps with B <= 2 (identity: B = 1), else the worst key's step is exactly 1. An elu + 1
        map on heads of 32 has B ~ 44; at 0.5 its step was ~16 and a text model's first layer
        overflowed to inf by token 33 at initialization."""
        super().__init__()
        self.infos, self.n_heads, self.summed_steps = gates, n_heads, summed_steps
        self.feature_norm = feature_norm
        # `per_step`: gate name -> n for a gate with one value per optimizer step (DeltaProduct's
        # beta), returned packed [B, T*n, H]; every other gate is [B, T, H].
        self.counts = [(per_step or {}).get(info.name, 1) for info in gates]
        if not gates:
            return
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, sum(self.counts) * n_heads)
        nn.init.zeros_(self.up.weight)  # start every gate at its bias: its declared start
        with torch.no_grad():
            self.up.bias.copy_(self.initial_bias())

    def per_step_names(self) -> set[str]:
        """The gates with one value per optimizer step, [B, T*n, H]."""
        return {info.name for info, n in zip(self.infos, self.counts, strict=True) if n > 1}

    def initial_bias(self) -> torch.Tensor:
        biases = []
        for info, count in zip(self.infos, self.counts, strict=True):
            declared = info.defaults
            for h in [h for _ in range(count) for h in range(self.n_heads)]:
                value = declared.start_at(h)
                if info.role == "step_size":
                    value = min(value, 1.0 / self.feature_norm) / self.summed_steps
                biases.append(unsquash(value, info.allowed, declared.ceiling))
        return torch.tensor(biases)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.infos:
            return {}
        # In at least float32 (`memory_dtype`), under bf16 autocast and in a bf16 model: with 8
        # significant bits a decay of 0.999 rounds to 1.0 and the memory would never forget.
        dtype = memory_dtype(self.up.weight.dtype)
        with torch.autocast(x.device.type, enabled=False):
            down = F.linear(x.to(dtype), self.down.weight.to(dtype))
            raw = F.linear(down, self.up.weight.to(dtype), self.up.bias.to(dtype))
            raw = raw.unflatten(-1, (sum(self.counts), self.n_heads))  # [B, T, sum n, H]
            out, first = {}, 0
            for info, count in zip(self.infos, self.counts, strict=True):
                part = raw[..., first : first + count, :]  # [B, T, n, H]
                first += count
                gate = squash(part, info.allowed, info.defaults.ceiling)
                out[info.name] = gate.squeeze(-2) if count == 1 else gate.flatten(1, 2)
            return out


class Norm(nn.RMSNorm):
    """RMSNorm in its weight's precision: a bf16 input (autocast's output) is cast up first, so
    the norm is float32 under bf16 training as in fp32 and input and weight types agree."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def _param_name(state_name: str) -> str:
    return state_name.replace(".", "_")  # module attribute names cannot hold dots


class LearnedState(nn.Module):
    """The memory's initial state W_0 as parameters [1, H, out, in], broadcast over the batch.

    Stored where training cannot leave the retention's domain: log W for a positive domain
    (KL, Bregman with w log w), logit W for the unit interval, each clamped so that fp32 never
    rounds W onto the domain's edge (log 0 = -inf); momenta start at zero."""

    def __init__(self, rule: MemoryRule, n_heads: int, d_key: int, d_value: int):
        super().__init__()
        self.domain = rule.spec.retention.domain()
        state = rule.initial_state(1, n_heads, d_key, d_value)
        self.as_tensor = isinstance(state, torch.Tensor)
        state = {"W": state} if self.as_tensor else state
        self.names = list(state)
        self.learned = nn.ParameterDict()
        self.zeros: dict[str, tuple[int, ...]] = {}
        # An exact optimizer's statistics start at zero, unlearned: a learned H_kk could leave
        # the positive semidefinite cone, where the read's solve has no Cholesky factor. So do
        # a preconditioner's curvature sums A ("P.<name>"): a learned A below -eps makes
        # log(A + eps) NaN from the first token (precond_gdn diverged at its second step).
        statistics = rule.plan.chunk_form.form == "minimizer"
        # The dtype and device of the zeros when nothing is learned.
        self.register_buffer("anchor", torch.zeros(()), persistent=False)
        for name, value in state.items():
            if name.startswith(("S.", "P.")) or statistics:
                self.zeros[name] = tuple(value.shape)
            else:
                # Computed in float32, kept in the default dtype as every other parameter
                # (transformers' from_pretrained builds a bf16 model under a bf16 default).
                raw = self._to_raw(value).to(torch.get_default_dtype())
                self.learned[_param_name(name)] = nn.Parameter(raw)

    def _to_raw(self, w: torch.Tensor) -> torch.Tensor:
        if self.domain == "positive":
            return w.log()
        if self.domain == "unit_interval":
            return torch.logit(w)
        return w.clone()

    def _from_raw(self, raw: torch.Tensor) -> torch.Tensor:
        if self.domain == "positive":
            return raw.clamp(min=LOG_FLOOR).exp()  # exp(-104) would underflow to 0 in fp32
        if self.domain == "unit_interval":
            return torch.sigmoid(raw.clamp(-LOGIT_BOUND, LOGIT_BOUND))
        return raw

    def forward(self, batch: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The state for `batch` sequences, in the rule's public form."""
        out = {}
        for name in self.names:
            if name in self.zeros:
                like = next(iter(self.learned.values()), self.anchor)
                out[name] = like.new_zeros(self.zeros[name]).expand(batch, -1, -1, -1)
            else:
                w = self._from_raw(self.learned[_param_name(name)])
                out[name] = w.expand(batch, -1, -1, -1)
        return out["W"] if self.as_tensor else out


class MirasLayer(nn.Module):
    """A memory layer built from a spec. x [B, T, D] -> y [B, T, D].

    `forward(x)` runs the whole sequence in parallel on `backend` (chunk size `chunk_size`,
    by default 64 // window.c for the exact chunk form and 16 for the chunk-start form;
    `chunk_mode` "auto" solves chunks exactly where the rule is affine in its memory, "start"
    takes the chunk-start approximation, "exact" insists: docs/chunking.md);
    `forward(x, cache)` continues from a cache (`empty_cache(batch)`) and returns the new one,
    computing what one uncached forward over all the tokens computes, at any split: where
    the form is exact (`chunk_follows_boundaries` False) a single token takes the recurrent
    step; the chunk-start and dual forms keep the memory at the chunk's start and the partial
    chunk's inputs (`continue_chunks`), chunks counted from the sequence's first token (the
    persistent tokens included).
    `persistent_tokens` learnable inputs are run before the sequence (Titans eq. 26), priming
    the memory; their outputs are dropped. `recompute` (True, False, None: the default) sets
    whether the general chunk-start path recomputes each chunk in the backward instead of
    keeping its per-token weights (`miras.runtime.run`).
    """

    def __init__(
        self,
        spec: Spec | str | dict,
        d_model: int,
        n_heads: int,
        *,
        chunk_size: int | None = None,
        backend: str = "chunk",
        chunk_mode: str = "auto",
        conv_size: int = 4,
        gate_rank: int = 16,
        persistent_tokens: int = 0,
        check_inputs: bool = True,
        recompute: bool | None = None,
    ):
        super().__init__()
        spec = load_spec(spec)
        if spec.memory.closed_form() is not None:
            raise ValueError(
                f"spec '{spec.name}': nonparametric memory is softmax attention; build it with "
                "miras.models.Attention (build_model does this for you)"
            )
        if d_model % n_heads:
            raise ValueError(f"n_heads ({n_heads}) must divide d_model ({d_model})")
        self.rule = compile_rule(spec)
        self.d_model, self.n_heads = d_model, n_heads
        self.head_dim = d_model // n_heads
        form = self.rule.plan.chunk_form
        # A bad choice fails here, not mid-run.
        mode = resolve_mode(chunk_mode, form, spec.name)
        default = default_chunk_size(mode, spec.window.c)
        self.chunk_size = default if chunk_size is None else chunk_size
        self.backend = backend
        self.chunk_mode = chunk_mode
        self.check_inputs = check_inputs
        self.recompute = recompute  # the general chunk-start backward (miras.runtime.chunk)
        # keys: per_step (DeltaProduct): n keys and values per token, the rule's [B, T*n, H, D].
        opt = spec.optimizer
        per_step = {name: opt.steps_per_token() for name in opt.per_step_inputs()}
        self.keys_per_token = per_step.get("k", 1)
        width = (1 + 2 * self.keys_per_token) * d_model
        self.qkv = nn.Linear(d_model, width, bias=False)
        self.conv = ShortConv(width, conv_size)
        summed = 1 if mode == "exact" else self.chunk_size
        bound = feature_norm_bound(self.rule, self.head_dim)
        self.gates = GateMaps(
            self.rule.plan.gates, d_model, n_heads, gate_rank, summed, bound, per_step
        )
        self.out_norm = Norm(self.head_dim, eps=1e-6)
        self.out_gate = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.state0 = LearnedState(self.rule, n_heads, self.head_dim, self.head_dim)
        fm = spec.feature_map
        self.rule_params = nn.ParameterDict(
            {
                name: nn.Parameter(
                    value.to(torch.get_default_dtype()), requires_grad=fm.trains_parameters()
                )
                for name, value in self.rule.default_params().items()
            }
        )
        self.persistent = (
            nn.Parameter(torch.randn(persistent_tokens, d_model) * 0.02)
            if persistent_tokens
            else None
        )

    # The pieces --------------------------------------------------------------------------
    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, H, D/H]."""
        return x.unflatten(-1, (self.n_heads, self.head_dim))

    def memory_inputs(self, x: torch.Tensor, conv_cache: torch.Tensor | None):
        """q, k [B, T, H, Dk] (l2-normalized), v [B, T, H, Dv], gates, and the conv cache;
        with n keys per token (`keys_per_token`) k, v [B, T*n, H, D], step j of token t at
        t*n + j (fla's packing)."""
        qkv, conv_cache = self.conv(self.qkv(x), conv_cache)
        # The rule's inputs in at least float32 (`memory_dtype`): under bf16 autocast, or in a
        # bf16 model, the projections are bf16 products, cast up exactly, to meet the float32
        # gates; the l2 norms are taken in float32.
        dtype = memory_dtype(self.qkv.weight.dtype)
        n, d = self.keys_per_token, self.d_model
        q, k, v = qkv.split([d, n * d, n * d], dim=-1)
        k, v = (t.unflatten(-1, (n, d)).flatten(1, 2) for t in (k, v))  # [B, T*n, D]
        q, k, v = (self.split_heads(t).to(dtype) for t in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return q, k, v, self.gates(x), conv_cache

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, Dv] -> RMSNorm per head, SiLU output gate from x, projection: [B, T, D]."""
        o = self.out_norm(o).flatten(-2)
        return self.out_proj(o * F.silu(self.out_gate(x)))

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.rule_params.items())

    def read(self, q: torch.Tensor, state) -> torch.Tensor:
        """M_W(phi(q)) with no update: q [B, T, H, Dk], state in the rule's public form ->
        [B, T, H, Dv]. MAC's retrieval (Titans eq. 21) reads the segment-start memory."""
        state = {"W": state} if isinstance(state, torch.Tensor) else state
        dtype = next(iter(state.values())).dtype
        q_ = q.transpose(1, 2).to(dtype)  # [B, H, T, Dk], phi in the state's precision
        return self.rule.program.read(q_, state, self.params()).transpose(1, 2).to(q.dtype)

    # Running -----------------------------------------------------------------------------
    def empty_cache(self, batch: int) -> Cache:
        """The cache before the first token (after the persistent tokens, if any)."""
        like = self.qkv.weight
        dtype = memory_dtype(like.dtype)  # the runtime's state precision for these inputs
        memory = self.state0(batch)
        memory = memory.to(dtype) if isinstance(memory, torch.Tensor) else {
            name: value.to(dtype) for name, value in memory.items()
        }  # fmt: skip
        cache: Cache = {"conv": self.conv.empty_cache(batch, like), "memory": memory}
        if self.chunk_follows_boundaries:
            cache["pending"] = self.no_pending(batch)
        if self.persistent is not None:
            prefix = self.persistent.unsqueeze(0).expand(batch, -1, -1)
            _, cache = self.forward(prefix, cache)
        return cache

    @property
    def chunk_follows_boundaries(self) -> bool:
        """Whether the forward's result depends on where its chunks start: the chunk-start and
        dual forms above chunk size 1 (every gradient of a chunk at its start state). Then a
        cache must keep the chunk boundaries of one uncached forward (`continue_chunks`)."""
        if self.backend == "recurrent" or self.chunk_size == 1:
            return False
        form = self.rule.plan.chunk_form
        return not is_exact(resolve_mode(self.chunk_mode, form, self.rule.spec.name))

    def no_pending(self, batch: int) -> Cache:
        """The partial chunk before its first token: the memory's inputs heads first, time on
        axis 2 (the axis `miras.models.padding` pads in front when rows are stacked), none yet:
        q, k [B, H, 0, Dk], v [B, H, 0, Dv], each gate [B, H, 0], and `valid` [B, 1, 0] bool
        (False at the slots a stacking pads in front)."""
        like, h, d = self.qkv.weight, self.n_heads, self.head_dim
        empty = like.new_zeros(batch, h, 0, d, dtype=memory_dtype(like.dtype))
        gates = {info.name: empty[..., 0] for info in self.rule.plan.gates}
        valid = torch.zeros(batch, 1, 0, dtype=torch.bool, device=like.device)
        return {"q": empty, "k": empty, "v": empty, "gates": gates, "valid": valid}

    def forward(
        self,
        x: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        """x [B, T, D] -> (y [B, T, D], the new cache or None when no cache was given).

        `attention_mask` [B, T] (1 a token, 0 padding; left or right padding, one contiguous
        run of tokens per row) runs each row's tokens alone, from its own row of the cache if
        one is given, so a padded batch equals the unpadded sequences; padding positions
        output 0. Cost: B sequential runs."""
        if attention_mask is not None:
            return rows_alone(self.forward, x, attention_mask, cache)
        if cache is not None:
            if self.chunk_follows_boundaries:
                return self.continue_chunks(x, cache)
            backend = "recurrent" if x.shape[1] == 1 else self.backend
            return self.run(x, cache, backend)
        start = {"conv": None, "memory": self.state0(x.shape[0])}
        if self.persistent is None:
            return self.run(x, start, self.backend, keep_state=False)[0], None
        prefix = self.persistent.unsqueeze(0).expand(x.shape[0], -1, -1)
        y, _ = self.run(torch.cat([prefix, x], dim=1), start, self.backend, keep_state=False)
        return y[:, prefix.shape[1] :], None  # the persistent tokens' outputs are dropped

    def run(self, x: torch.Tensor, cache: Cache, backend: str, keep_state: bool = True):
        """x [B, T, D] from `cache` on `backend` -> (y [B, T, D], the cache after x).

        With `check_inputs`, a non-finite x or memory output raises `ForwardDiverged` naming
        the first token in time (one sum each, the search only on failure)."""
        self._check_finite_input(x)
        q, k, v, gates, conv_cache = self.memory_inputs(x, cache["conv"])
        o, state = self._rule_call(q, k, v, gates, cache["memory"], backend, keep_state)
        if self.check_inputs and not all_finite(o):
            raise self.diverged(q, k, v, gates, cache["memory"], o)
        return self.output(o, x), {"conv": conv_cache, "memory": state}

    def continue_chunks(self, x: torch.Tensor, cache: Cache):
        """x [B, T, D] after `cache` in the chunk form's own semantics -> (y [B, T, D], cache).

        `cache["memory"]` is the memory at the current chunk's start and `cache["pending"]` the
        inputs of the L < chunk_size tokens since (`no_pending`). The chunk form runs on those
        L tokens and x's from the chunk-start memory: its whole chunks with their final state,
        which becomes the new chunk-start memory, then the rest, whose inputs become the new
        partial chunk. So every token sees exactly what one uncached forward gives it, and a
        token costs a chunk form over at most chunk_size tokens."""
        if not self._pending_aligned(cache):
            return self._rows_apart(self.continue_chunks, x, cache)
        n = self.keys_per_token  # k, v and the per-step gates: n steps per token
        if self.chunk_size % n:
            raise ValueError(
                f"chunk_size: {self.chunk_size} is not a multiple of the {n} optimizer steps per "
                f"token of spec '{self.rule.spec.name}': its chunks of steps end inside a "
                f"token, where a cache cannot stop; use a multiple of {n} (or backend "
                "'recurrent')"
            )
        self._check_finite_input(x)
        q, k, v, gates, conv_cache = self.memory_inputs(x, cache["conv"])
        pending = cache.get("pending") or self.no_pending(x.shape[0])
        # The partial chunk's inputs, then x's: q [B, L + T, H, D], k, v [B, (L + T) n, H, D],
        # each gate [B, L + T, H] or, per step, [B, (L + T) n, H].
        q, k, v = (
            torch.cat([pending[name].transpose(1, 2), t], 1)
            for name, t in zip("qkv", (q, k, v), strict=True)
        )
        gates = {
            name: torch.cat([pending["gates"][name].transpose(1, 2), g], 1)
            for name, g in gates.items()
        }
        per_step = self.gates.per_step_names()
        tokens = q.shape[1]
        per_chunk = self.chunk_size // n  # tokens per chunk (chunks count optimizer steps)
        whole = tokens // per_chunk * per_chunk  # the tokens of whole chunks

        def cut(part: slice):
            steps = slice(part.start * n, part.stop * n)
            g = {name: t[:, steps if name in per_step else part] for name, t in gates.items()}
            return q[:, part], k[:, steps], v[:, steps], g

        memory, outputs = cache["memory"], []
        for part in (slice(0, whole), slice(whole, tokens)):
            if part.stop == part.start:
                continue
            q_, k_, v_, g_ = cut(part)
            keep = part.stop == whole  # the next chunk's start state
            o, final = self._rule_call(q_, k_, v_, g_, memory, self.backend, keep_state=keep)
            if self.check_inputs and not all_finite(o):
                raise self.diverged(q_, k_, v_, g_, memory, o)
            memory = final if keep else memory
            outputs.append(o)
        o = torch.cat(outputs, dim=1)[:, -x.shape[1] :]
        q_, k_, v_, g_ = cut(slice(whole, tokens))
        pending = {
            "q": q_.transpose(1, 2),
            "k": k_.transpose(1, 2),
            "v": v_.transpose(1, 2),
            "gates": {name: g.transpose(1, 2) for name, g in g_.items()},
            "valid": torch.ones(x.shape[0], 1, tokens - whole, dtype=torch.bool, device=x.device),
        }
        return self.output(o, x), {"conv": conv_cache, "memory": memory, "pending": pending}

    def flush(self, cache: Cache) -> Cache:
        """The cache with its partial chunk folded into the memory, as an uncached forward that
        ends there leaves it (the chunk form's final state after a short last chunk): MAC's
        memory restarts its chunks at every segment. A cache without one is returned as is."""
        pending = cache.get("pending")
        if pending is None or pending["valid"].shape[2] == 0:
            return cache
        if not self._pending_aligned(cache):
            return self._rows_apart(lambda _, row: (None, self.flush(row)), None, cache)[1]
        q, k, v = (pending[n].transpose(1, 2) for n in "qkv")
        gates = {name: g.transpose(1, 2) for name, g in pending["gates"].items()}
        _, memory = self._rule_call(q, k, v, gates, cache["memory"], self.backend, True)
        batch = q.shape[0]
        return {"conv": cache["conv"], "memory": memory, "pending": self.no_pending(batch)}

    @staticmethod
    def _pending_aligned(cache: Cache) -> bool:
        """Whether every row's partial chunk fills its slots: rows stacked from caches of
        different lengths (a padded batch) are padded in front with valid = False."""
        pending = cache.get("pending")
        return pending is None or bool(pending["valid"].all())

    @staticmethod
    def _rows_apart(step, x: torch.Tensor | None, cache: Cache):
        """step(x_b, cache_b) row by row, each row's partial chunk without the padded slots
        in front -> (y [B, T, D] or None, the rows' caches stacked)."""
        ys, caches = [], []
        for b in range(cache["pending"]["valid"].shape[0]):
            row = cache_row(cache, b)
            filled = int(row["pending"]["valid"].sum())
            slots = row["pending"]["valid"].shape[2]
            row["pending"] = _last_slots(row["pending"], filled, slots)  # [1, H, filled (n), .]
            y, row = step(None if x is None else x[b : b + 1], row)
            ys.append(y)
            caches.append(row)
        return (None if x is None else torch.cat(ys)), stack_rows(caches)

    def _rule_call(self, q, k, v, gates, memory, backend: str, keep_state: bool):
        """The rule on `backend` from state `memory` -> (o [B, T, H, Dv], the state after or
        None without `keep_state`)."""
        return self.rule(
            q,
            k,
            v,
            gates,
            backend=backend,
            chunk_size=self.chunk_size,
            chunk_mode=self.chunk_mode,
            initial_state=memory,
            output_final_state=keep_state,
            params=self.params(),
            check_inputs=self.check_inputs,
            recompute=self.recompute,
        )

    def _check_finite_input(self, x: torch.Tensor) -> None:
        if self.check_inputs and not all_finite(x):
            token, row, _ = first_bad(~torch.isfinite(x.detach()).unsqueeze(-1))
            raise ForwardDiverged(
                f"memory layer (spec '{self.rule.spec.name}'): its input x is non-finite from "
                f"token {token} (batch row {row}), the first in time: an earlier layer or the "
                "embedding produced it",
                token,
            )

    @torch.no_grad()
    def diverged(self, q, k, v, gates, initial_state, o: torch.Tensor) -> ForwardDiverged:
        """The error for a non-finite memory output o [B, T, H, Dv]: where it starts in time
        and the likely cause. A chunk form spreads a non-finite value back to its chunk's
        start, so the first token is found by replaying the exact recurrence."""
        exact, _ = self.rule(
            q, k, v, gates, backend="recurrent", initial_state=initial_state,
            params=self.params(), check_inputs=False,
        )  # fmt: skip
        bad = ~torch.isfinite(exact)
        replayed = bool(bad.any())
        token, row, head = first_bad(bad if replayed else ~torch.isfinite(o))
        seen = first_bad(~torch.isfinite(o))[0]
        text = (
            f"memory layer (spec '{self.rule.spec.name}'): its output is non-finite from token "
            f"{token} (batch row {row}, head {head}), the first in time"
        )
        if replayed and seen < token:
            text += f" (the chunk form spreads it back to token {seen}, its chunk's start)"
        return ForwardDiverged(text + self._likely_cause(k, gates, token, row, head), token)

    def _likely_cause(self, k, gates, token: int, row: int, head: int) -> str:
        """The per-token step lr * ||phi(k)||^2 of the tokens up to `token` in that row and
        head, and what to change when it overshoots (lr: the gate whose role is "step_size")."""
        name = next((i.name for i in self.rule.plan.gates if i.role == "step_size"), None)
        if name is None or name not in gates:
            return ""
        n = self.keys_per_token  # k and lr packed [B, T*n, ...] with keys per step
        steps = (token + 1) * n
        keys = k[row : row + 1, :steps, head : head + 1].transpose(1, 2)  # [1, 1, t n, Dk]
        phi = self.rule.program.feature(keys.to(torch.float64), self.params())
        norm2 = phi.pow(2).sum(-1).flatten()  # [t n]
        lr = gates[name][row, :steps, head].reshape(steps, -1).amax(-1).double()
        step = lr * norm2
        at = int(step.argmax())
        where = f"token {at // n}" + (f", step {at % n}" if n > 1 else "")
        text = (
            f"; the memory's step {name} * ||phi(k)||^2 reaches {step[at].item():.3g} at {where} "
            f"({name} {lr[at].item():.3g}, ||phi(k)||^2 {norm2[at].item():.3g})"
        )
        if step[at] <= 1:
            return text
        text += ": likely cause: the step overshoots (the l2 delta rule diverges above 2)"
        if norm2.max() > 1 and not self.rule.spec.feature_map.normalize:
            return text + (
                "; fix: `normalize: true` on the feature map (phi(k) / ||phi(k)||, so the "
                "step is the learning rate itself)"
            )
        return text + "; fix: a lower learning-rate gate"


def _last_slots(pending: Cache, filled: int, slots: int) -> Cache:
    """A partial chunk's entries [1, H, slots, ...] cut to their last `filled` tokens; an entry
    with n slots per token (k, v and the per-step gates of n optimizer steps per token,
    [1, H, slots n, ...]) to its last filled n."""
    if isinstance(pending, dict):
        return {name: _last_slots(value, filled, slots) for name, value in pending.items()}
    per_token = pending.shape[2] // slots if slots else 1
    return pending[:, :, pending.shape[2] - filled * per_token :]
