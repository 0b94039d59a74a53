"""fla-compatible functional ops: a compiled rule called with flash-linear-attention's
convention (docs/ops.md).

    from miras import ops
    o, state = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True)
    delta = ops.functional("specs/deltanet.yaml")        # any spec or compiled rule
    o, state = delta(q, k, v, beta=beta, scale=1.0)

fla's convention, against the rule's own (`MemoryRule.__call__`):
- q, k [B, T, H, K], v [B, T, HV, V]: HV = H as in miras, or HV = m H, fla's grouped value
  heads (value head j reads key head j // m; gates [B, T, HV] and states per value head:
  `_expand_value_heads`);
- `g` is the log of the decay gate (miras takes the decay itself: exp(g)); `beta` is the
  learning-rate gate `lr`; any other gate goes by name in `gates`, natural space. As in fla,
  beta may be 0 and g as low as -inf (a decay of 0, the state's reset: `_decay_of`); an error
  about either names `g` or `beta`;
- `scale` multiplies q (default K^-0.5, like fla; miras applies none);
- a matrix state is [B, H, K, V] (miras: [B, H, V, K], the transpose; `state_v_first=True`
  takes and returns miras's layout); a dict state (momentum, deep memories) has no fla
  counterpart and passes in miras's layout unchanged;
- `cu_seqlens` [N + 1] packs N sequences along T with B = 1; the states are [N, ...]. fla's
  precomputed `cu_seqlens_cpu` and `chunk_indices` are checked against it (`_check_packing`);
- `head_first=True` (removed in fla 0.6) is refused with fla's message (`_refuse_kwargs`).
Gates are cast to q's dtype (fla takes float32 gates with bfloat16 inputs); a Python float is a
constant gate. The aliases run the chunk backend; its "auto" mode is the exact chunk form for
these models, so they equal fla's recurrences at every chunk size. A spec without an exact
chunk form runs its chunk-start approximation only when `chunk_mode` asks for it
(`chunk_options`). Every op calls the rule itself (`MemoryRule.__call__`), so under a caller's
autocast (bf16 training) it computes in its state's precision, float32, as `rule(...)` does.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import miras
from miras.components.optimizer.steps import MAX_STEPS
from miras.rule import MemoryRule
from miras.runtime import (
    START_CHUNK_SIZE,
    check_cu_seqlens,
    check_qkv,
    default_chunk_size,
    inside_range,
    is_exact,
    per_channel_gates,
    per_key_gates,
    resolve_mode,
)
from miras.spec import Spec

Gate = torch.Tensor | float | None

# The known models' specs (the same as specs/*.yaml, inlined so the package needs no files).
KNOWN_SPECS: dict[str, dict[str, Any]] = {
    "linear_attention": {
        "name": "linear_attention",
        "memory": "matrix",
        "bias": "dot",
        "retention": "none",
        "optimizer": {"kind": "gd", "lr": 1},
    },
    "retnet": {
        "name": "retnet",
        "memory": "matrix",
        "bias": "dot",
        "retention": {"kind": "l2", "decay": "gate"},
        "optimizer": {"kind": "gd", "lr": 1},
    },
    "deltanet": {
        "name": "deltanet",
        "memory": "matrix",
        "bias": "l2",
        "retention": "none",
        "optimizer": {"kind": "gd", "lr": "gate"},
    },
    "gated_deltanet": {
        "name": "gated_deltanet",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "l2", "grad_at": "retained"},
        "optimizer": "gd",
    },
    # Kimi Delta Attention: Gated DeltaNet with a decay per key channel (chunk_kda).
    "kda": {
        "name": "kda",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "l2", "grad_at": "retained", "decay_channels": "key"},
        "optimizer": "gd",
    },
    # GDN-2 with one erase strength per head (chunk_gdn2; fla's per key channel is no gradient
    # step): L = b/2 ||y||^2 - <w * v, y> at the decayed state, a unit step.
    "gdn2": {
        "name": "gdn2",
        "memory": "matrix",
        "bias": {
            "kind": "custom",
            "loss": "erase*y**2/2 - write*v*y",
            "params": {"erase": "gate", "write": "gate"},
        },
        "retention": {"kind": "l2", "grad_at": "retained", "decay_channels": "key"},
        "optimizer": {"kind": "gd", "lr": 1},
    },
    # Preconditioned Gated DeltaNet (chunk_precond_gated_delta_rule at fla's defaults x = 1.5,
    # eps = 1e-6, log_atk_scale = -0.2): the step scaled per key channel by M(A_t).
    "precond_gdn": {
        "name": "precond_gdn",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "l2", "grad_at": "retained"},
        "optimizer": "preconditioned",
    },
    # TTT-linear: the l2 loss of the prediction's LayerNorm (chunk_ttt_linear at eps = 1e-6;
    # the op adds the memory's bias column, the residual target and the output LayerNorm).
    "ttt_linear": {
        "name": "ttt_linear",
        "memory": "matrix",
        "bias": "layer_norm",
        "retention": "none",
        "optimizer": "gd",
    },
    # Titans with a linear memory: the same loss with momentum and the forget gate
    # (chunk_titans_linear at eps = 1e-6; the op adds the residual target and the output
    # LayerNorm).
    "titans_linear": {
        "name": "titans_linear",
        "memory": "matrix",
        "bias": "layer_norm",
        "retention": "l2",
        "optimizer": "momentum",
    },
    # MesaNet as fla's chunk_mesa_net runs it: q and k as given (no normalization inside).
    "mesanet": {
        "name": "mesanet",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "l2", "decay": "gate"},
        "optimizer": {"kind": "exact", "ridge": "gate"},
        "window": {"c": "global", "gamma": "gate"},
    },
}


@functools.cache
def known_rule(name: str) -> MemoryRule:
    """The compiled rule of a known model (compiled and checked once per process)."""
    return miras.compile(KNOWN_SPECS[name])


def _as_rule(rule: MemoryRule | Spec | str | Path | dict) -> MemoryRule:
    return rule if isinstance(rule, MemoryRule) else miras.compile(rule)


def _check_scalar_or_tensor(name: str, x) -> None:
    if x is None or isinstance(x, torch.Tensor):
        return
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return
    raise ValueError(f"{name}: expected a tensor, a Python float or None, got {type(x).__name__}")


def _fla_gates(rule: MemoryRule, q: torch.Tensor, v, g: Gate, beta: Gate, gates) -> dict:
    """fla's (g, beta, other gates) -> miras's natural-space gate dict, in q's dtype. `g` and
    `beta` are checked here, so that an error names them rather than the gate they become."""
    _check_scalar_or_tensor("g", g)
    _check_scalar_or_tensor("beta", beta)
    if gates is not None and not isinstance(gates, dict):
        raise ValueError(f"gates: expected a dict name -> tensor, got {type(gates).__name__}")
    out = dict(gates or {})
    takes = rule.gates
    infos = {info.name: info for info in rule.plan.gates}
    # fla's g is the log of the retention's decay gate, beta the optimizer's step size; each
    # row: the fla argument, the gate it becomes (None: the component has none), how a message
    # names that gate when there is none, its meaning, what the range check names, and the map
    # from fla's value to the gate's natural space.
    for fla_name, value, name, missing, meaning, what, natural_of in (
        ("g", g, rule.spec.retention.decay_gate, "decay gate", "the log of the decay gate",
         "exp(g)", _decay_of),
        ("beta", beta, rule.spec.optimizer.step_size_gate, "lr gate", "the learning-rate gate",
         "values", _as_is),
    ):  # fmt: skip
        if name is not None and name in out:
            raise ValueError(
                f"gates[{name!r}]: pass the {name} gate as `{fla_name}` ({meaning}), not in gates"
            )
        if value is None:
            if name in takes:
                raise ValueError(
                    f"{fla_name}: spec '{rule.spec.name}' has a {name} gate; pass `{fla_name}` "
                    f"({meaning}), a tensor [B, T, H] or a float"
                )
            continue
        if name not in takes:
            listed = ", ".join(takes) or "none"
            gate = missing if name is None else f"{name} gate"
            raise ValueError(
                f"{fla_name}: spec '{rule.spec.name}' has no {gate} (its gates: {listed}); "
                f"pass {fla_name}=None"
            )
        allowed = infos[name].allowed
        if isinstance(value, torch.Tensor):
            _check_fla_shape(rule, fla_name, name, value, q, v)
            out[name] = natural_of(fla_name, value, allowed, q.dtype).to(q.dtype)
        else:  # a constant: checked as a one-element tensor, passed on as a Python float
            one = torch.tensor(float(value), dtype=torch.float64)
            out[name] = natural_of(fla_name, one, allowed, q.dtype).item()
        _check_fla_range(fla_name, what, out[name], allowed, f"the {name} gate", q.dtype)
    return {n: v.to(q.dtype) if isinstance(v, torch.Tensor) else v for n, v in out.items()}


def _check_fla_shape(rule: MemoryRule, fla_name: str, name: str, value, q, v) -> None:
    """`g` / `beta`: a floating tensor [B, T, H], or [B, T, H, V] where the rule takes the gate
    per value channel (miras.runtime.per_channel_gates), or [B, T, H, K] per key channel
    (miras.runtime.per_key_gates: KDA's g)."""
    if not value.dtype.is_floating_point:
        raise ValueError(f"{fla_name}: expected a floating tensor, got {_dtype_name(value)}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return  # q's own check names it
    head = list(q.shape[:3])
    steps = ""
    if name in rule.spec.optimizer.per_step_inputs():  # one per step, packed: DeltaProduct
        n = rule.spec.optimizer.steps_per_token()
        head[1] *= n
        steps = f"*{n}"
    shapes = {"": head}
    if name in per_channel_gates(rule) and isinstance(v, torch.Tensor) and v.dim() == 4:
        shapes[", V"] = [*head, v.shape[-1]]
    if name in per_key_gates(rule):
        shapes[", K"] = [*head, q.shape[-1]]
    if list(value.shape) not in shapes.values():
        allowed = " or ".join(f"[B, T{steps}, H{axis}] = {s}" for axis, s in shapes.items())
        raise ValueError(f"{fla_name}: expected {allowed}, got {list(value.shape)}")


def _dtype_name(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def _first_bad(x: torch.Tensor, bad: torch.Tensor) -> float:
    return x.detach()[bad].flatten()[0].item()


def _check_fla_range(fla_name: str, what: str, natural, allowed, meaning: str, dtype) -> None:
    """The gate that `fla_name` becomes, in the inputs' dtype, must lie in the rule's range."""
    value = natural.detach() if isinstance(natural, torch.Tensor) else torch.tensor(natural)
    value = value.to(dtype)
    bad = ~inside_range(value, allowed)
    if bool(bad.any()):
        raise ValueError(
            f"{fla_name}: {what} must lie in {allowed} ({meaning}), found {_first_bad(value, bad):g}"
        )


def _as_is(fla_name: str, x: torch.Tensor, allowed, dtype: torch.dtype) -> torch.Tensor:
    """fla's value is the gate itself (beta, the step size): checked by the range check only."""
    return x


def _decay_of(fla_name: str, g: torch.Tensor, allowed, dtype: torch.dtype) -> torch.Tensor:
    """exp(g), the rule's decay gate, as it will be in `dtype`. A log-decay so low that exp(g)
    is 0 in `dtype` (g below about -104 in float32, -92 in bfloat16, and -inf) is fla's decay of exactly 0: the
    state resets. The rule's decay lies in (0, 1], since its chunk-start form works with log a,
    so such a decay becomes the dtype's smallest normal number (1.2e-38 in float32), with no
    gradient to g, as fla's exp(g) = 0 has none."""
    bad = g.detach().isnan() | (g.detach() > 0)
    if bool(bad.any()):
        raise ValueError(
            f"{fla_name}: expected log-decays g <= 0 (the decay exp(g) in (0, 1]), found "
            f"{_first_bad(g, bad):g}"
        )
    decay = g.exp()  # in g's precision, then rounded once to the inputs' dtype
    if allowed.lo == 0 and not allowed.lo_closed:
        decay = torch.where(decay.to(dtype) > 0, decay, torch.finfo(dtype).tiny)
    return decay


def _check_scale(scale, q: torch.Tensor) -> float:
    if scale is None:
        return q.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite Python float or None, got {scale!r}")
    return float(scale)


# fla's shared argument conventions, one helper each (every op below calls them) ---------------


def _expand_value_heads(q, k, v):
    """fla's grouped value heads (GVA): q, k [B, T, H, K] and v [B, T, HV, V] with HV = m H;
    value head j reads key head j // m (fla: `i_h // (HV // H)`), so q and k are repeated
    m times along H, each head next to its copies: [B, T, HV, K]. Gates and states are per
    value head ([B, T, HV], [N, HV, ...]). Autograd sums the copies' gradients back into q, k.
    Non-tensors and other ranks pass unchanged, for `check_qkv` to name."""
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return q, k
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must have the same number of heads, but got q.shape[2]={q.shape[2]} and "
            f"k.shape[2]={k.shape[2]}"
        )
    h, hv = k.shape[2], v.shape[2]
    if hv % h != 0:
        raise ValueError(
            f"v: for GVA, num_v_heads (HV={hv}) must be evenly divisible by num_heads (H={h}), "
            f"but got HV % H = {hv % h}"
        )
    if hv == h:
        return q, k
    return q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2)


def _one_value_head_per_key_head(op: str, k, v) -> None:
    """An op whose fla counterpart has no grouped value heads refuses HV != H."""
    tensors = isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if tensors and k.dim() == v.dim() == 4 and v.shape[2] != k.shape[2]:
        raise ValueError(
            f"{op}: v has HV={v.shape[2]} heads and k H={k.shape[2]}; fla's {op} takes one "
            "value head per key head (grouped value heads: chunk_gated_delta_rule)"
        )


def _state_layout(state, state_v_first: bool):
    """fla's state [N, H, K, V] <-> miras's [N, H, V, K] (the transpose, its own inverse).
    `state_v_first=True` is fla's V-first layout, miras's own: unchanged. A dict state (no fla
    counterpart) and None pass unchanged."""
    if state_v_first or not isinstance(state, torch.Tensor):
        return state
    return state.transpose(-1, -2)


def _fla_chunk_indices(bounds: list[int], chunk_size: int) -> torch.Tensor:
    """fla's `prepare_chunk_indices`: one row (sequence i, chunk j within it) per chunk of
    `chunk_size` tokens, [NT, 2], NT = sum of ceil(T_i / chunk_size)."""
    rows = [
        (i, j)
        for i in range(len(bounds) - 1)
        for j in range(-(-(bounds[i + 1] - bounds[i]) // chunk_size))
    ]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def _check_packing(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size: int, shapes) -> None:
    """fla's precomputed companions of `cu_seqlens`, checked against it: `cu_seqlens_cpu` its
    host copy (equal values, on the CPU), `chunk_indices` [NT, 2] fla's
    `prepare_chunk_indices(cu_seqlens, chunk_size)`. miras derives both from cu_seqlens
    itself, so they only have to agree with it; either without cu_seqlens is an error."""
    if cu_seqlens is None:
        companions = (
            ("cu_seqlens_cpu", cu_seqlens_cpu, "the host copy of cu_seqlens"),
            ("chunk_indices", chunk_indices, "cu_seqlens' chunk rows"),
        )
        for name, x, what in companions:
            if x is not None:
                raise ValueError(
                    f"{name}: given without cu_seqlens (it is {what}); pass cu_seqlens too, or None"
                )
        return
    if cu_seqlens_cpu is None and chunk_indices is None:
        return
    bounds = check_cu_seqlens(cu_seqlens, shapes)
    if cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
            where = (
                f"a tensor on {cu_seqlens_cpu.device}"
                if isinstance(cu_seqlens_cpu, torch.Tensor)
                else type(cu_seqlens_cpu).__name__
            )
            raise ValueError(
                f"cu_seqlens_cpu: expected a CPU tensor (cu_seqlens' host copy), got {where}"
            )
        if cu_seqlens_cpu.dtype.is_floating_point or cu_seqlens_cpu.tolist() != bounds:
            raise ValueError(
                f"cu_seqlens_cpu: expected the host copy of cu_seqlens, {bounds} (integer), got "
                f"{cu_seqlens_cpu.tolist()} ({_dtype_name(cu_seqlens_cpu)})"
            )
    if chunk_indices is not None:
        want = _fla_chunk_indices(bounds, chunk_size)
        expected = (
            f"chunk_indices: expected fla's prepare_chunk_indices(cu_seqlens, "
            f"chunk_size={chunk_size}), an integer tensor [NT, 2] = {list(want.shape)} of rows "
            "(sequence, chunk within it)"
        )
        if not isinstance(chunk_indices, torch.Tensor):
            raise ValueError(f"{expected}, got {type(chunk_indices).__name__}")
        if chunk_indices.dtype.is_floating_point or list(chunk_indices.shape) != list(want.shape):
            raise ValueError(
                f"{expected}, got {_dtype_name(chunk_indices)} {list(chunk_indices.shape)}"
            )
        got = chunk_indices.detach().cpu().long()
        if not torch.equal(got, want):
            row = int((got != want).any(1).nonzero()[0])
            raise ValueError(
                f"{expected}, got row {row} = {got[row].tolist()} instead of {want[row].tolist()}"
            )


def chunk_options(
    rule: MemoryRule, backend: str, chunk_mode: str | None, chunk_size: int | None
) -> tuple[str, int]:
    """(chunk_mode, chunk_size) for a call on `backend`. fla's ops are exact, so the chunk-start
    approximation is never taken unasked: where the spec has no exact chunk form (a deep memory,
    a nonlinear bias or retention, muon: docs/chunking.md), the chunk and triton backends need
    `chunk_mode` ("auto": the compiled form, or "start"), else a ValueError says so. Without
    `chunk_mode` an exact spec runs "auto", its exact form. Without `chunk_size`, the layer's
    default for the form (`default_chunk_size`): 64 // c in the exact form, 16 in the
    chunk-start and dual forms."""
    form = rule.plan.chunk_form
    if chunk_mode is None:
        # The minimizer form (optimizer exact) is exact at any chunk size too.
        if backend != "recurrent" and not is_exact(form.form):
            start = START_CHUNK_SIZE if chunk_size is None else chunk_size
            raise ValueError(
                f"chunk_mode: spec '{rule.spec.name}' has no exact chunk form ({form.reason}), so "
                f"backend={backend!r} would run the chunk-start approximation (every gradient "
                "of a chunk taken at the chunk's start state, as in Titans and ATLAS), which "
                "differs from the recurrence and can diverge where it does not (a chunk adds "
                f"up chunk_size gradients taken at one state). Choose it: chunk_mode='auto' "
                f"(its compiled form, {form.form!r}) or 'start' (at chunk_size={start}; the "
                "layer starts the learning rate at 0.5 / chunk_size for it), or pass "
                "backend='recurrent' for the exact recurrence"
            )
        chunk_mode = "auto"
    if chunk_size is None:
        mode = resolve_mode(chunk_mode, form, rule.spec.name)
        chunk_size = default_chunk_size(mode, rule.spec.window.c)
    return chunk_mode, chunk_size


def call(
    rule: MemoryRule | Spec | str | Path | dict,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Gate = None,
    beta: Gate = None,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    gates: dict[str, Gate] | None = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    backend: str = "chunk",
    chunk_size: int | None = None,
    chunk_mode: str | None = None,
):
    """Run `rule` with fla's calling convention (the module docstring); returns (o, state),
    state None unless `output_final_state`. v may have HV = m H heads (grouped value heads,
    `_expand_value_heads`). `cu_seqlens_cpu` and `chunk_indices` are checked against
    `cu_seqlens` (`_check_packing`). `chunk_mode` and `chunk_size` as in `chunk_options`."""
    rule = _as_rule(rule)
    chunk_mode, chunk_size = chunk_options(rule, backend, chunk_mode, chunk_size)
    q, k = _expand_value_heads(q, k, v)
    opt = rule.spec.optimizer
    if "k" in opt.per_step_inputs():  # k, v packed [B, T*n, H, .] (keys: per_step)
        shapes = _check_packed(q, k, v, opt.steps_per_token(), "n")
    else:
        shapes = check_qkv(q, k, v)  # before g and beta are read in q's dtype
    _check_packing(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, shapes)
    scale = _check_scale(scale, q)
    natural = _fla_gates(rule, q, v, g, beta, gates)
    o, final = rule(
        q * scale,
        k,
        v,
        natural,
        backend=backend,
        chunk_size=chunk_size,
        chunk_mode=chunk_mode,
        initial_state=_state_layout(initial_state, state_v_first),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return o, _state_layout(final, state_v_first)


def functional(
    rule: MemoryRule | Spec | str | Path | dict,
    *,
    backend: str = "chunk",
    chunk_size: int | None = None,
    chunk_mode: str | None = None,
) -> Callable:
    """The fla-style op of any spec or compiled rule:

        op = functional("specs/titans.yaml", chunk_mode="auto")  # the chunk-start form
        o, state = op(q, k, v, g=log_decay, beta=lr, gates={"momentum": m})

    The signature is `call`'s without `rule` and the backend options, which are fixed here
    (`chunk_options`: a spec without an exact chunk form needs `chunk_mode` on the chunk and
    triton backends, checked here, before any call)."""
    rule = _as_rule(rule)
    chunk_mode, chunk_size = chunk_options(rule, backend, chunk_mode, chunk_size)

    def op(
        q,
        k,
        v,
        g=None,
        beta=None,
        scale=None,
        initial_state=None,
        output_final_state=False,
        cu_seqlens=None,
        *,
        gates=None,
        state_v_first=False,
        cu_seqlens_cpu=None,
        chunk_indices=None,
    ):
        return call(
            rule,
            q,
            k,
            v,
            g,
            beta,
            scale,
            initial_state,
            output_final_state,
            cu_seqlens,
            gates=gates,
            state_v_first=state_v_first,
            cu_seqlens_cpu=cu_seqlens_cpu,
            chunk_indices=chunk_indices,
            backend=backend,
            chunk_size=chunk_size,
            chunk_mode=chunk_mode,
        )

    op.__name__ = op.__qualname__ = f"miras_{rule.spec.name}"
    op.__doc__ = f"fla-style op of spec '{rule.spec.name}' (gates: {rule.gates}); see miras.ops."
    return op


# Aliases: the signature of the fla op of the same name (fla 0.6), over the known model ----------


def _refuse(op: str, **flags) -> None:
    """fla options this alias does not implement: a ValueError where one is not the default."""
    for name, (value, default) in flags.items():
        if value != default:
            raise ValueError(f"{op}: {name}={value!r} is not supported here (only {default!r})")


def _refuse_kwargs(op: str, kwargs: dict) -> None:
    """fla's catch-all `**kwargs`: `head_first=True` gets fla's refusal (fla 0.6 removed the
    [B, H, T, ...] layout; `head_first=False`, the layout taken here, passes), anything else
    is an unexpected argument."""
    kwargs = dict(kwargs)
    if kwargs.pop("head_first", False):
        raise ValueError(
            f"{op}: head_first has been removed. Inputs must be in `[B, T, H, ...]` format."
        )
    if kwargs:
        raise ValueError(f"{op}: unexpected arguments {sorted(kwargs)}")


L2NORM_EPS = 1e-6  # fla's l2norm_fwd: x / sqrt(sum(x^2) + eps)


def _l2norm(q: torch.Tensor, k: torch.Tensor, on: bool):
    """fla's `use_qk_l2norm_in_kernel`: q and k [B, T, H, K] times rsqrt(sum over K of x^2 +
    1e-6), as fla's l2norm kernel computes it."""
    if not on:
        return q, k
    return tuple(x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """DeltaNet, fla's `chunk_delta_rule`: S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t
    v_t^T (fla's [K, V] state), o_t = S_t^T (scale q_t). beta [B, T, H] or [B, T, H, V]."""
    _refuse_kwargs("chunk_delta_rule", kwargs)
    _one_value_head_per_key_head("chunk_delta_rule", k, v)
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    return call(
        known_rule("deltanet"),
        q,
        k,
        v,
        None,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        backend=backend,
        chunk_size=chunk_size,
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: Any = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """Gated DeltaNet, fla's `chunk_gated_delta_rule`: S_t = S_{t-1} exp(g_t) (I - beta_t k_t
    k_t^T) + beta_t k_t v_t^T. q, k [B, T, H, K], v [B, T, HV, V] with HV a multiple of H
    (grouped value heads), g [B, T, HV] log-decay, beta [B, T, HV], states [N, HV, K, V]
    (`state_v_first=True`: [N, HV, V, K]). `cu_seqlens_cpu` and `chunk_indices` (fla's
    precomputed companions of cu_seqlens) must agree with cu_seqlens and `chunk_size`."""
    op = "chunk_gated_delta_rule"
    _refuse_kwargs(op, kwargs)
    _refuse(
        op,
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False),
        cp_context=(cp_context, None),
    )
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    return call(
        known_rule("gated_deltanet"),
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        state_v_first=state_v_first,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
        backend=backend,
        chunk_size=chunk_size,
    )


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """Kimi Delta Attention, fla's `chunk_kda` (`specs/kda.yaml`): S_t = diag(exp(g_t)) S_{t-1}
    then the delta rule at the decayed state, S_t += beta_t k_t (v_t - S_t^T k_t)^T, with g
    [B, T, HV, K] one log-decay per key channel (or [B, T, HV]: Gated DeltaNet). q, k
    [B, T, H, K], v [B, T, HV, V] (grouped value heads), beta [B, T, HV], states
    [N, HV, K, V]. The chunk backend's exact form (`miras.runtime.exact_keys` for a decay per
    key channel) equals the recurrence at any chunk size, like fla's op. fla's in-kernel gate
    options (`use_gate_in_kernel`, `safe_gate`, `lower_bound`, the beta sigmoid, negative
    eigenvalues) and its performance switches are refused unless left at their defaults."""
    op = "chunk_kda"
    _refuse_kwargs(op, kwargs)
    _refuse(
        op,
        use_gate_in_kernel=(use_gate_in_kernel, False),
        use_beta_sigmoid_in_kernel=(use_beta_sigmoid_in_kernel, False),
        allow_neg_eigval=(allow_neg_eigval, False),
        safe_gate=(safe_gate, False),
        lower_bound=(lower_bound, None),
        disable_recompute=(disable_recompute, False),
        return_intermediate_states=(return_intermediate_states, False),
        cp_context=(cp_context, None),
        use_graph=(use_graph, False),
        max_num_seqs=(max_num_seqs, None),
    )
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    return call(
        known_rule("kda"),
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        state_v_first=state_v_first,
        cu_seqlens_cpu=cu_seqlens_cpu,
        backend=backend,
        chunk_size=chunk_size,
    )


def chunk_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor,
    w: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cp_context: Any = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """GDN-2, fla's `chunk_gdn2` (`specs/gdn2.yaml`): S = diag(exp(g_t)) S_{t-1}, then
    S += k_t (w_t * v_t - S^T (b_t k_t))^T, with g [B, T, H, K] (or [B, T, H]) and the write
    gate w [B, T, H, V]. The erase strength b is one per head, [B, T, H]: then the step is the
    gradient at the decayed state of b/2 ||S^T k||^2 - <w * v, S^T k>. fla's b [B, T, H, K]
    per key channel reads the state at b * k and writes at k, which is no gradient step
    (docs/ops.md, "fla's delta family"), so a K-wide b is refused, even one constant over K:
    its gradient per key channel would not be fla's (pass b[..., 0]). HV = H. The chunk
    backend's exact form, equal to the recurrence at any chunk size."""
    op = "chunk_gdn2"
    _refuse_kwargs(op, kwargs)
    _refuse(
        op,
        use_gate_in_kernel=(use_gate_in_kernel, False),
        safe_gate=(safe_gate, False),
        lower_bound=(lower_bound, None),
        disable_recompute=(disable_recompute, False),
        return_intermediate_states=(return_intermediate_states, False),
        cp_context=(cp_context, None),
    )
    _one_value_head_per_key_head(op, k, v)
    rule = known_rule("gdn2")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and isinstance(v, torch.Tensor):
        infos = {info.name: info for info in rule.plan.gates}
        head = list(q.shape[:3])
        for name, gate, x, shape, meaning in (
            ("b", "erase", b, head, "the erase strength, one per head"),
            ("w", "write", w, [*head, v.shape[-1]], "the write gate per value channel"),
        ):
            if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
                got = _dtype_name(x) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected a floating tensor {shape}, got {got}")
            if name == "b" and list(x.shape) == [*head, k.shape[-1]]:
                raise ValueError(
                    f"b: {op} takes the erase strength per head, [B, T, H] = {head}; fla's b "
                    "per key channel [B, T, H, K] reads the state at b * k and writes at k, "
                    "which is no gradient step of one loss (docs/ops.md), so it is refused, "
                    "even constant over K (its gradient per key channel would not be fla's): "
                    "pass b[..., 0]"
                )
            if list(x.shape) != shape:
                raise ValueError(f"{name}: expected {shape} ({meaning}), got {list(x.shape)}")
            allowed = infos[gate].allowed
            _check_fla_range(name, "values", x, allowed, meaning, q.dtype)
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    return call(
        rule,
        q,
        k,
        v,
        g,
        None,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        gates={"erase": b, "write": w},
        state_v_first=state_v_first,
        cu_seqlens_cpu=cu_seqlens_cpu,
        backend=backend,
        chunk_size=chunk_size,
    )


@functools.cache
def precond_rule(x: float, eps: float, center: float | None) -> MemoryRule:
    """The preconditioned Gated DeltaNet with fla's squash range `x`, `eps` and a fixed center
    (None: the center is a gate, fla's log_atk_scale per head). fla's defaults are
    `known_rule("precond_gdn")`."""
    spec = dict(KNOWN_SPECS["precond_gdn"])
    if (x, eps, center) != (1.5, 1e-6, -0.2):
        spec["name"] = "precond_gdn_custom"
        spec["optimizer"] = {
            "kind": "preconditioned",
            "precond_range": x,
            "precond_eps": eps,
            "precond_center": "gate" if center is None else center,
        }
    return miras.compile(spec)


def chunk_precond_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_atk: torch.Tensor,
    g: torch.Tensor,
    beta_atk: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_A_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    transpose_state_layout: bool = False,
    x: float = 1.5,
    eps: float = 1e-6,
    log_atk_scale: torch.Tensor | float | None = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """Preconditioned Gated DeltaNet, fla's `chunk_precond_gated_delta_rule`
    (`specs/precond_gdn.yaml`): per key head a curvature sum A_t = exp(g_atk,t) A_{t-1} +
    beta_atk,t k_t^2 over the key channels, M_t = x^(-r_t / (1 + |r_t|)) with
    r_t = log(A_t + eps) - log_atk_scale, then S_t = exp(g_t) S_{t-1} and the delta rule at the
    decayed state written at M_t * k_t: S_t += beta_t (M_t * k_t) (v_t - S_t^T k_t)^T.

    q, k [B, T, H, K]; v [B, T, HV, V] (grouped value heads: the HV / H value heads of a key
    head share its A); g_atk, beta_atk [B, T, H]; g, beta [B, T, HV]; states S [N, HV, K, V]
    (`transpose_state_layout=True`: [N, HV, V, K]) and A [N, H, K]. `log_atk_scale`: a float
    or a tensor [H] (one center per key head, differentiable), default -0.2. q and k are
    l2-normalized unless `use_qk_l2norm_in_kernel=False` (fla's default True). Returns
    (o, final S, final A), the states None unless `output_final_state`. The chunk backend's
    exact form (`miras.runtime.exact_keys`, the step per key channel in the written key) equals
    the recurrence at any chunk size; `cp_context` is refused."""
    op = "chunk_precond_gated_delta_rule"
    _refuse_kwargs(op, kwargs)
    _refuse(op, cp_context=(cp_context, None))
    for name, value in (("x", x), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: expected a Python float, got {type(value).__name__}")
    center = -0.2 if log_atk_scale is None else log_atk_scale
    if isinstance(center, bool) or not isinstance(center, (int, float, torch.Tensor)):
        raise ValueError(
            f"log_atk_scale: expected a float, a tensor [H] or None, got {type(center).__name__}"
        )
    try:
        rule = precond_rule(
            float(x), float(eps), None if isinstance(center, torch.Tensor) else float(center)
        )
    except miras.SpecError as err:  # x <= 1, eps <= 0: name fla's arguments
        fields = {"precond_range": "x", "precond_eps": "eps", "precond_center": "log_atk_scale"}
        problems = "; ".join(
            f"{fields.get(p.path.split('.')[-1], p.path)}: {p.message}" for p in err.problems
        )
        raise ValueError(f"{op}: {problems}") from None
    expanded = _expand_value_heads(q, k, v)  # head counts checked in fla's words
    shapes = check_qkv(*expanded, v)  # HV heads
    heads, d_key = k.shape[2], shapes.d_key  # H key heads
    repeat = shapes.heads // heads  # value heads per key head
    infos = {info.name: info for info in rule.plan.gates}
    head = [shapes.batch, shapes.length, heads]
    gates: dict[str, Any] = {}
    for name, value, gate, meaning in (
        ("g_atk", g_atk, "precond_decay", "the log-decay of the curvature sum A, per key head"),
        ("beta_atk", beta_atk, "precond_lr", "the weight of k_t^2 in A, per key head"),
    ):
        if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            got = _dtype_name(value) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name}: expected a floating tensor {head} ({meaning}), got {got}")
        if list(value.shape) != head:
            raise ValueError(
                f"{name}: expected [B, T, H] = {head} ({meaning}), got {list(value.shape)}"
            )
        allowed = infos[gate].allowed
        natural = _decay_of(name, value, allowed, q.dtype) if name == "g_atk" else value
        what = "exp(g_atk)" if name == "g_atk" else "values"
        _check_fla_range(name, what, natural, allowed, meaning, q.dtype)
        gates[gate] = natural.to(q.dtype).repeat_interleave(repeat, dim=2)  # [B, T, HV]
    if isinstance(center, torch.Tensor):
        if tuple(center.shape) != (heads,) or not center.dtype.is_floating_point:
            raise ValueError(
                f"log_atk_scale: expected a float or a floating tensor [H] = [{heads}] (one "
                f"center per key head), got {_dtype_name(center)} {list(center.shape)}"
            )
        if not bool(torch.isfinite(center).all()):
            raise ValueError("log_atk_scale: expected finite values, found NaN or inf")
        per_value_head = center.to(q.dtype).repeat_interleave(repeat)  # [HV]
        gates["precond_center"] = per_value_head.expand(*head[:2], shapes.heads)  # [B, T, HV]
    state = None
    if initial_state is not None or initial_A_state is not None:
        n = shapes.batch if cu_seqlens is None else len(cu_seqlens) - 1
        if initial_A_state is None:
            a0 = q.new_zeros(n, heads, d_key)
        elif not isinstance(initial_A_state, torch.Tensor) or tuple(initial_A_state.shape) != (
            n,
            heads,
            d_key,
        ):
            got = (
                list(initial_A_state.shape)
                if isinstance(initial_A_state, torch.Tensor)
                else type(initial_A_state).__name__
            )
            raise ValueError(
                f"initial_A_state: expected [N, H, K] = {[n, heads, d_key]} (the curvature sum "
                f"per key head and key channel), got {got}"
            )
        else:
            a0 = initial_A_state
        if initial_state is None:
            s0 = q.new_zeros(n, shapes.heads, shapes.d_value, d_key)
        else:
            s0 = _state_layout(initial_state, transpose_state_layout)
        # A [N, H, K] -> [N, HV, 1, K]: each value head starts from its key head's A.
        state = {"W": s0, "P.W": a0.repeat_interleave(repeat, dim=1).unsqueeze(-2)}
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    o, final = call(
        rule,
        q,
        k,
        v,
        g,
        beta,
        scale,
        state,
        output_final_state,
        cu_seqlens,
        gates=gates,
        state_v_first=True,  # the state is passed and returned in miras's layout here
        cu_seqlens_cpu=cu_seqlens_cpu,
        backend=backend,
        chunk_size=chunk_size,
    )
    if not output_final_state:
        return o, None, None
    s_final = _state_layout(final["W"], transpose_state_layout)
    # Every value head of a group carries its key head's A: one copy per key head.
    return o, s_final, final["P.W"].squeeze(-2)[:, ::repeat]


@functools.cache
def ttt_rule(eps: float) -> MemoryRule:
    """TTT-linear with the LayerNorm's `eps`; fla's default 1e-6 is `known_rule("ttt_linear")`."""
    if eps == 1e-6:
        return known_rule("ttt_linear")
    spec = dict(KNOWN_SPECS["ttt_linear"], name="ttt_linear_eps")
    spec["bias"] = {"kind": "layer_norm", "ln_eps": eps}
    return miras.compile(spec)


@functools.cache
def titans_linear_rule(eps: float) -> MemoryRule:
    """Titans-linear with the LayerNorm's `eps`; fla's default 1e-6 is
    `known_rule("titans_linear")`."""
    if eps == 1e-6:
        return known_rule("titans_linear")
    spec = dict(KNOWN_SPECS["titans_linear"], name="titans_linear_eps")
    spec["bias"] = {"kind": "layer_norm", "ln_eps": eps}
    return miras.compile(spec)


def _layer_norm(x: torch.Tensor, w, b, eps: float) -> torch.Tensor:
    """LN(x) * w + b over the last axis, the variance biased (fla's ttt_linear)."""
    centered = x - x.mean(-1, keepdim=True)
    var = centered.pow(2).mean(-1, keepdim=True)
    return centered / torch.sqrt(var + eps) * w + b


def _constant_per_mini_batch(eta: torch.Tensor, bounds: list[int], size: int) -> None:
    """fla's eta_t scales the sum of a mini-batch's gradients up to token t, so it is a step size
    per token only where it is one number per mini-batch: refuse any other, naming where.
    eta [B, T, H]; the mini-batches of `size` tokens count from each sequence's start."""
    for lo, hi in itertools.pairwise(bounds):
        part = eta[:, lo:hi].detach()
        pad = -(hi - lo) % size  # the last mini-batch padded with its own last value
        part = torch.cat([part, part[:, -1:].expand(-1, pad, -1)], 1)
        chunks = part.unflatten(1, (-1, size))  # [B, NT, size, H]
        varies = (chunks != chunks[:, :, :1]).flatten(2).any(-1).any(0)  # [NT]
        if bool(varies.any()):
            first = lo + int(varies.nonzero()[0]) * size
            raise ValueError(
                f"eta: chunk_ttt_linear takes one learning rate per mini-batch of chunk_size="
                f"{size} tokens; eta varies inside the mini-batch of tokens {first} to "
                f"{min(first + size, hi) - 1}. fla's ttt_linear steps every token t of a "
                "mini-batch with eta_t times the sum of the mini-batch's gradients up to t, "
                "W_t = W_0 - eta_t sum_(s<=t) g_s (the reading token's rate rescales the "
                "earlier tokens' gradients), which is no step of its own per token; with one "
                "eta per mini-batch it is the chunk-start gradient step (docs/ops.md)"
            )


def _layer_norm_op(op, backend, chunk_size, eps, make_rule, q, k, v, unit: str, chunked: str):
    """The checks the ops over a `layer_norm` bias share (`chunk_ttt_linear`'s mini-batches,
    `chunk_titans_linear`'s chunks: `unit`, and what the chunk backend makes of them,
    `chunked`): the backend, eps, and V = K for the residual target v - k. Returns the rule
    (`make_rule(eps)`) and the shapes of q, k, v."""
    if backend == "triton":
        raise ValueError(
            f"backend: 'triton' does not cover {op}: the layer_norm bias reads channel "
            "statistics the kernels do not chain through; use backend='chunk'"
        )
    if backend == "recurrent" and chunk_size != 1:
        raise ValueError(
            f"backend: 'recurrent' steps one token at a time, {unit} of 1, but "
            f"chunk_size={chunk_size}; use backend='chunk' ({chunked}) or chunk_size=1"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ValueError(f"eps: expected a Python float, got {type(eps).__name__}")
    try:
        rule = make_rule(float(eps))
    except miras.SpecError as err:
        raise ValueError(f"eps: {err.problems[0].message}") from None
    shapes = check_qkv(q, k, v)
    if shapes.d_value != shapes.d_key:
        raise ValueError(
            f"v: {op} learns the residual target v - k, so V must equal K; got K = "
            f"{shapes.d_key}, V = {shapes.d_value}"
        )
    return rule, shapes


def chunk_ttt_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    eta: torch.Tensor | float,
    scale: float | None = None,
    eps: float = 1e-6,
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
    initial_state_bias: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    backend: str = "chunk",
    **kwargs,
):
    """TTT-linear, fla's `chunk_ttt_linear` (`specs/ttt_linear.yaml`): per mini-batch of
    `chunk_size` tokens, every gradient taken at the mini-batch's start state (miras's
    chunk-start form at that chunk size) of 1/2 ||LN(k_t h + hb) * w + b - (v_t - k_t)||^2,
    h [K, V] and hb [1, V] stepped by eta; o_t = z_t + LN(z_t) * w + b with
    z_t = (scale q_t) h_t + hb_t.

    In miras's terms: a matrix memory W = [h^T | hb^T] [V, K + 1] read at the key [k_t, 1] (its
    last column is the affine memory's bias), the layer_norm bias with its weight and bias
    gates per value channel, gd with lr = eta, no retention, the target v - k; the output
    LayerNorm is applied here, outside the memory. q, k [B, T, H, K], v [B, T, H, V] with V = K
    (the residual target); w, b [H, V]; eta [B, T, H, 1] (or a float), one number per
    mini-batch (`_constant_per_mini_batch` says why); states h [N, H, K, V] and hb
    [N, H, 1, V]. Returns (o, h, hb), the states None unless `output_final_state`.

    Where T (or a packed sequence) is not a multiple of chunk_size, fla's final hb also holds
    the gradients of the zero tokens it pads the last mini-batch with (their prediction hb
    against the target 0); miras's does not (docs/ops.md). Only the chunk backend runs it;
    `backend="recurrent"` is mini-batches of one token (`chunk_size=1`)."""
    op = "chunk_ttt_linear"
    _refuse_kwargs(op, kwargs)
    rule, shapes = _layer_norm_op(
        op, backend, chunk_size, eps, ttt_rule, q, k, v,
        unit="mini-batches", chunked="mini-batches of chunk_size tokens",
    )  # fmt: skip
    _check_packing(cu_seqlens, cu_seqlens_cpu, None, chunk_size, shapes)
    heads, d = shapes.heads, shapes.d_key
    for name, x in (("w", w), ("b", b)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (heads, d):
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name}: expected the LayerNorm's {'weight' if name == 'w' else 'bias'} [H, V] "
                f"= [{heads}, {d}], got {got}"
            )
    head = [shapes.batch, shapes.length, heads]
    _check_scalar_or_tensor("eta", eta)
    if eta is None:
        raise ValueError("eta: expected a tensor [B, T, H, 1] or a float (the learning rate)")
    lr_range = next(info.allowed for info in rule.plan.gates if info.name == "lr")
    _check_fla_range("eta", "values", eta, lr_range, "the learning rate", q.dtype)
    if isinstance(eta, torch.Tensor):
        if list(eta.shape) != [*head, 1]:
            raise ValueError(f"eta: expected [B, T, H, 1] = {[*head, 1]}, got {list(eta.shape)}")
        eta = eta.squeeze(-1)
        bounds = [0, shapes.length] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, shapes)
        _constant_per_mini_batch(eta, bounds, chunk_size)
    else:
        eta = float(eta)
    scale = _check_scale(scale, q)
    # The key [k, 1] and the query [scale q, 1]: W's last column is the affine memory's bias hb.
    one = q.new_ones(*q.shape[:3], 1)
    key, query = torch.cat([k, one], -1), torch.cat([q * scale, one], -1)
    norm_w, norm_b = (x.to(q.dtype).expand(*head, d) for x in (w, b))  # per value channel
    gates = {"lr": eta if isinstance(eta, float) else eta.to(q.dtype)}
    gates |= {"ln_weight": norm_w, "ln_bias": norm_b}
    state = None
    if initial_state is not None or initial_state_bias is not None:
        n = shapes.batch if cu_seqlens is None else len(cu_seqlens) - 1
        h0 = q.new_zeros(n, heads, d, d) if initial_state is None else initial_state
        hb0 = q.new_zeros(n, heads, 1, d) if initial_state_bias is None else initial_state_bias
        for name, x, shape in (("initial_state", h0, (n, heads, d, d)),
                               ("initial_state_bias", hb0, (n, heads, 1, d))):  # fmt: skip
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected {list(shape)}, got {got}")
        state = torch.cat([h0, hb0], -2).transpose(-1, -2)  # [N, H, V, K + 1]
    z, final = rule(
        query,
        key,
        v - k,
        gates,
        backend=backend,
        chunk_size=chunk_size,
        chunk_mode="start" if backend != "recurrent" else "auto",
        initial_state=state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    o = z + _layer_norm(z, norm_w, norm_b, float(eps))
    if not output_final_state:
        return o, None, None
    final = final.transpose(-1, -2)  # [N, H, K + 1, V]
    return o, final[..., :d, :], final[..., d:, :]


def _titans_gate(name: str, x, head: list[int], allowed, what: str, natural, meaning: str, dtype):
    """One of fla's titans gates theta, alpha, eta: a tensor [B, T, H, 1] or a Python float,
    mapped to its miras gate by `natural` (a tensor [B, T, H] or a float) and range-checked
    there in the inputs' dtype, the message naming `name`."""
    _check_scalar_or_tensor(name, x)
    if x is None:
        raise ValueError(f"{name}: expected a tensor [B, T, H, 1] or a float ({meaning})")
    if isinstance(x, torch.Tensor) and list(x.shape) != [*head, 1]:
        raise ValueError(f"{name}: expected [B, T, H, 1] = {[*head, 1]}, got {list(x.shape)}")
    gate = natural(x.squeeze(-1) if isinstance(x, torch.Tensor) else float(x))
    _check_fla_range(name, what, gate, allowed, meaning, dtype)
    return gate.to(dtype) if isinstance(gate, torch.Tensor) else gate


def chunk_titans_linear(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    theta: torch.Tensor | float,
    alpha: torch.Tensor | float,
    eta: torch.Tensor | float,
    eps: float = 1e-6,
    chunk_size: int = 16,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_chunk: bool = True,
    *,
    backend: str = "chunk",
    **kwargs,
):
    """Titans with a linear memory, fla's `chunk_titans_linear_ref` (`fla.ops.titans.naive`,
    [B, T, H, D] layout; fla's exported `chunk_titans_linear` is the same rule in [B, H, T, D])
    as `specs/titans_linear.yaml`, with the gradient of its loss (below): a memory M [K, V]
    read through a LayerNorm, L = 1/2 ||LN(k_t M) * w + b - (v_t - k_t)||^2, every gradient of a
    chunk of `chunk_size` tokens taken at the chunk's start state (miras's chunk-start form),
    then per token the momentum S_t = eta_t S_{t-1} - 2 theta_t dL/dM and the forget gate
    M_t = (1 - alpha_t) M_{t-1} + S_t, S_0 = 0; o_t = z_t + LN(z_t) * w + b, z_t = q_t M_t.

    In miras's terms (W = M^T, s = -S^T): a matrix memory, the layer_norm bias with its weight
    and bias gates per value channel, l2 retention at decay = 1 - alpha, momentum with
    lr = 2 theta (fla steps along the gradient of ||.||^2, the bias's loss is half of it) and
    momentum = eta, the target v - k; the output LayerNorm is applied here, outside the memory.
    q, k, v [B, T, H, D] (V = K: the residual target); w, b [H, D]; theta, alpha, eta
    [B, T, H, 1] (or floats); the state M [B, H, K, V]. Returns (o, M_T), M_T None unless
    `output_final_state`. fla scales nothing, and neither does this op.

    fla's own step is not this gradient: its LayerNorm backward misses a 1 / (rstd D) on the
    D * grad term, so the two rules differ wherever D sqrt(var(k_t M) + eps) != 1 (docs/ops.md,
    "Titans-linear"; measured in tests/runtime/test_fla_delta_family.py). Where T is not a
    multiple of chunk_size, fla's final state is taken after its zero padding, which drops the
    momentum and decays M once more (by the last token's 1 - alpha); miras's is the state after
    the last real token. `use_chunk` picks one of fla's two implementations of the same rule;
    both are this one. Only the chunk backend runs it; `backend="recurrent"` is chunks of one
    token (`chunk_size=1`)."""
    op = "chunk_titans_linear"
    _refuse_kwargs(op, kwargs)
    if not isinstance(use_chunk, bool):
        raise ValueError(f"use_chunk: expected a bool, got {type(use_chunk).__name__}")
    rule, shapes = _layer_norm_op(
        op, backend, chunk_size, eps, titans_linear_rule, q, k, v,
        unit="chunks", chunked="gradients at each chunk's start state, as fla",
    )  # fmt: skip
    heads, d = shapes.heads, shapes.d_key
    for name, x in (("w", w), ("b", b)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (heads, d):
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name}: expected the LayerNorm's {'weight' if name == 'w' else 'bias'} [H, D] "
                f"= [{heads}, {d}], got {got}"
            )
    head = [shapes.batch, shapes.length, heads]
    ranges = {info.name: info.allowed for info in rule.plan.gates}
    # fla's gate -> miras's gate, whose range the check reads (the message names fla's).
    gates = {
        "lr": _titans_gate("theta", theta, head, ranges["lr"], "values", lambda x: 2 * x,
                           "the learning rate, lr = 2 theta", q.dtype),
        "decay": _titans_gate("alpha", alpha, head, ranges["decay"], "1 - alpha",
                              lambda x: 1 - x, "the decay; the chunk-start form takes its log, "
                              "so alpha = 1 is refused", q.dtype),
        "momentum": _titans_gate("eta", eta, head, ranges["momentum"], "values", lambda x: x,
                                 "the momentum", q.dtype),
    }  # fmt: skip
    norm_w, norm_b = (x.to(q.dtype).expand(*head, d) for x in (w, b))  # per value channel
    gates |= {"ln_weight": norm_w, "ln_bias": norm_b}
    state = None
    if initial_state is not None:
        shape = (shapes.batch, heads, d, d)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != shape:
            got = (
                list(initial_state.shape)
                if isinstance(initial_state, torch.Tensor)
                else type(initial_state).__name__
            )
            raise ValueError(f"initial_state: expected M_0 {list(shape)}, got {got}")
        # fla starts the momentum at zero; miras's state is W = M^T [B, H, V, K] and s.
        w0 = initial_state.transpose(-1, -2)
        state = {"W": w0, "S.W": torch.zeros_like(w0)}
    z, final = rule(
        q,
        k,
        v - k,
        gates,
        backend=backend,
        chunk_size=chunk_size,
        chunk_mode="start" if backend != "recurrent" else "auto",
        initial_state=state,
        output_final_state=output_final_state,
    )
    o = z + _layer_norm(z, norm_w, norm_b, float(eps))
    return o, final["W"].transpose(-1, -2) if output_final_state else None


def deltaproduct_spec(n: int, gated: bool) -> dict[str, Any]:
    """The spec of DeltaProduct with n Householder steps per token (Siems et al. 2025,
    arXiv:2502.10297): the delta rule taking n gradient steps per token, each on a key and
    value of its own (`optimizer: {kind: gd, steps: n, keys: per_step}`); `gated` adds one
    decay per token (Gated DeltaProduct). n = 2 gated is specs/deltaproduct.yaml."""
    return {
        "name": f"{'gated_' if gated else ''}deltaproduct_{n}",
        "memory": "matrix",
        "bias": "l2",
        "retention": {"kind": "l2", "grad_at": "retained"} if gated else "none",
        "optimizer": {"kind": "gd", "steps": n, "keys": "per_step"},
    }


@functools.cache
def deltaproduct_rule(n: int, gated: bool) -> MemoryRule:
    """The compiled rule of `deltaproduct_spec(n, gated)`; n = 1 is (Gated) DeltaNet."""
    if n == 1:
        return known_rule("gated_deltanet" if gated else "deltanet")
    return miras.compile(deltaproduct_spec(n, gated))


def _check_packed(q, k, v, n: int, n_name: str = "num_householder"):
    """q [B, T, H, K]; k, v in fla's packing [B, T*n, H, .], n named `n_name`. Returns the
    shapes of one key per token (T of q)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        length = "T" if name == "q" else f"T*{n_name}"
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a tensor [B, {length}, H, D], got {got}")
    t = q.shape[1]
    for name, x in (("k", k), ("v", v)):
        if x.shape[1] != t * n:
            raise ValueError(
                f"{name}: expected fla's packing [B, T*{n_name}, H, "
                f"{'K' if name == 'k' else 'V'}], T*n = {t * n} for T = {t} tokens of q and "
                f"{n_name} = {n} (step j of token t at t*n + j), got {list(x.shape)}"
            )
    return check_qkv(q, k[:, ::n], v[:, ::n])  # B, H, K and dtypes, as for one key per token


def chunk_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: Any = None,
    *,
    state_v_first: bool = False,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """(Gated) DeltaProduct, fla's `chunk_gated_delta_product`: n = num_householder delta-rule
    steps per token, each on a key and value of its own (Siems et al. 2025, eq. 4):
    S <- S exp(g_t), then for j < n: S <- S (I - beta_tj k_tj k_tj^T) + beta_tj k_tj v_tj^T;
    o_t = S^T (scale q_t) after the n steps. q [B, T, H, K]; k [B, T*n, H, K], v [B, T*n, H, V]
    and beta [B, T*n, H] in fla's packing (step j of token t at t*n + j); g [B, T, H], one
    log-decay per token, or None (no decay: DeltaProduct); states [N, H, K, V]
    (`state_v_first=True`: [N, H, V, K]). `chunk_size` counts steps, as fla's kernels chunk
    the T*n of them: each chunk of chunk_size steps (chunk_size / n tokens) is solved exactly
    (the exact chunk form)."""
    op = "chunk_gated_delta_product"
    _refuse_kwargs(op, kwargs)
    _refuse(op, cp_context=(cp_context, None))
    n = num_householder
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STEPS:
        raise ValueError(
            f"num_householder: expected an integer in [1, {MAX_STEPS}] (the steps per token), "
            f"got {n!r}"
        )
    shapes = _check_packed(q, k, v, n)
    _check_packing(cu_seqlens, cu_seqlens_cpu, None, chunk_size, shapes)
    rule = deltaproduct_rule(n, g is not None)
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    scale = _check_scale(scale, q)
    natural = _fla_gates(rule, q, v, g, beta, None)

    o, final = rule(
        q * scale,
        k,
        v,
        natural,
        backend=backend,
        chunk_size=chunk_size,
        initial_state=_state_layout(initial_state, state_v_first),
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return o, _state_layout(final, state_v_first)


def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """Simple GLA / RetNet, fla's `chunk_simple_gla`: S_t = exp(g_t) S_{t-1} + k_t v_t^T.
    g [B, T, H] data-dependent log-decay, or g_gamma [H] one log-decay per head (RetNet), or
    neither (no decay)."""
    _refuse_kwargs("chunk_simple_gla", kwargs)
    _one_value_head_per_key_head("chunk_simple_gla", k, v)
    if g is not None and g_gamma is not None:
        raise ValueError("chunk_simple_gla: pass g [B, T, H] or g_gamma [H], not both")
    if g_gamma is not None:
        heads = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
        if not isinstance(g_gamma, torch.Tensor) or tuple(g_gamma.shape) != (heads,):
            shape = list(g_gamma.shape) if isinstance(g_gamma, torch.Tensor) else g_gamma
            raise ValueError(f"g_gamma: expected a tensor [H] = [{heads}], got {shape}")
        g = g_gamma.to(q.dtype).expand(*q.shape[:3])
    return call(
        known_rule("retnet"),
        q,
        k,
        v,
        0.0 if g is None else g,
        None,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        state_v_first=state_v_first,
        cu_seqlens_cpu=cu_seqlens_cpu,
        backend=backend,
        chunk_size=chunk_size,
    )


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
):
    """Linear attention, fla's `chunk_linear_attn`: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T
    (scale q_t). With `normalize` (fla's default), o_t is divided by scale q_t . z_t + 1e-10,
    z_t the running sum of the keys (plus z_0); the state is then (S, z) with z [B, 1, H, K]
    (per sequence with cu_seqlens: [N, 1, H, K])."""
    _one_value_head_per_key_head("chunk_linear_attn", k, v)
    kv_init, z_init = initial_state, None
    if normalize and isinstance(initial_state, tuple):
        kv_init, z_init = initial_state
    o, final = call(
        known_rule("linear_attention"),
        q,
        k,
        v,
        None,
        None,
        scale,
        kv_init,
        output_final_state,
        cu_seqlens,
        backend=backend,
        chunk_size=chunk_size,
    )
    if not normalize:
        return o, final
    scale = _check_scale(scale, q)
    bounds = [0, k.shape[1]] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    sums, last = [], []
    for i in range(len(bounds) - 1):
        # [B, t, H, K]: the keys' running sum within sequence i, from its z_0.
        z = k[:, bounds[i] : bounds[i + 1]].cumsum(1)
        if z_init is not None:
            z = z + (z_init if cu_seqlens is None else z_init[i : i + 1]).to(z.dtype)
        sums.append(z)
        last.append(z[:, -1:])
    z = torch.cat(sums, dim=1)
    o = o / ((q * scale * z).sum(-1, keepdim=True) + 1e-10)
    if not output_final_state:
        return o, None
    return o, (final, torch.cat(last) if cu_seqlens is not None else last[0])


def chunk_mesa_net(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lamb: torch.Tensor,
    h_kk_init: torch.Tensor | None = None,
    h_kv_init: torch.Tensor | None = None,
    output_final_state: bool = False,
    max_CG_iteration: int = 30,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    backend: str = "chunk",
    chunk_size: int = 64,
    **kwargs,
):
    """MesaNet, fla's `chunk_mesa_net` (specs/mesanet.yaml): the exact minimizer of the decayed
    l2 objective, h_kk,t = exp(g_t) h_kk,t-1 + beta_t k_t k_t^T, h_kv,t = exp(g_t) h_kv,t-1 +
    beta_t k_t v_t^T, o_t = h_kv,t^T (h_kk,t + diag(lamb))^-1 q_t. g, beta [B, T, H]; lamb
    [H, K] (per head and key channel, > 0). States h_kk [N, H, K, K], h_kv [N, H, K, V].
    Returns (o, h_kk_final, h_kv_final), the states None unless `output_final_state`.

    fla's op scales nothing, so `scale` (keyword only) defaults to 1 here. The solve is a
    Cholesky factorization per token (`miras.runtime.exact_minimizer`), exact where fla runs
    `max_CG_iteration` conjugate-gradient steps towards the same solution: the count is
    checked and otherwise unused."""
    op = "chunk_mesa_net"
    _refuse_kwargs(op, kwargs)
    if isinstance(max_CG_iteration, bool) or not isinstance(max_CG_iteration, int):
        raise ValueError(f"max_CG_iteration: expected a positive integer, got {max_CG_iteration!r}")
    if max_CG_iteration < 1:
        raise ValueError(f"max_CG_iteration: expected a positive integer, got {max_CG_iteration}")
    rule = known_rule("mesanet")
    check_qkv(q, k, v)
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    scale = 1.0 if scale is None else _check_scale(scale, q)
    infos = {info.name: info for info in rule.plan.gates}
    gates = {}
    for fla_name, value in (("g", g), ("beta", beta)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{fla_name}: expected a tensor [B, T, H], got {type(value).__name__}")
        if tuple(value.shape) != tuple(q.shape[:3]):
            raise ValueError(
                f"{fla_name}: expected [B, T, H] = {list(q.shape[:3])}, got {list(value.shape)}"
            )
    decay_gate = rule.spec.retention.decay_gate
    decay = _decay_of("g", g, infos[decay_gate].allowed, q.dtype)
    _check_fla_range("g", "exp(g)", decay, infos[decay_gate].allowed, "the decay gate", q.dtype)
    weight_gate, ridge_gate = rule.spec.window.weight_gate, rule.spec.optimizer.ridge_gate
    _check_fla_range(
        "beta", "values", beta, infos[weight_gate].allowed, "each token's weight", q.dtype
    )
    heads, d_key = q.shape[2], q.shape[3]
    if not isinstance(lamb, torch.Tensor) or tuple(lamb.shape) != (heads, d_key):
        shape = list(lamb.shape) if isinstance(lamb, torch.Tensor) else type(lamb).__name__
        raise ValueError(f"lamb: expected a tensor [H, K] = [{heads}, {d_key}], got {shape}")
    ridge = infos[ridge_gate].allowed
    _check_fla_range("lamb", "values", lamb, ridge, "the ridge on diag(h_kk)", q.dtype)
    gates = {
        decay_gate: decay.to(q.dtype),
        weight_gate: beta.to(q.dtype),
        ridge_gate: lamb.to(q.dtype).expand(*q.shape),  # [B, T, H, K]: per key channel
    }
    initial = None
    if h_kk_init is not None or h_kv_init is not None:
        if h_kk_init is None or h_kv_init is None:
            raise ValueError("h_kk_init, h_kv_init: pass both initial states or neither")
        initial = {"H_kk": h_kk_init, "H_vk": h_kv_init.transpose(-1, -2)}
    o, final = rule(
        q * scale,
        k,
        v,
        gates,
        backend=backend,
        chunk_size=chunk_size,
        initial_state=initial,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    if not output_final_state:
        return o, None, None
    return o, final["H_kk"], final["H_vk"].transpose(-1, -2)


__all__ = [
    "KNOWN_SPECS",
    "call",
    "chunk_delta_rule",
    "chunk_gated_delta_product",
    "chunk_gated_delta_rule",
    "chunk_gdn2",
    "chunk_kda",
    "chunk_linear_attn",
    "chunk_mesa_net",
    "chunk_precond_gated_delta_rule",
    "chunk_simple_gla",
    "chunk_titans_linear",
    "chunk_ttt_linear",
    "deltaproduct_rule",
    "deltaproduct_spec",
    "functional",
    "known_rule",
    "precond_rule",
    "titans_linear_rule",
    "ttt_rule",
]
