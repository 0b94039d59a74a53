"""Run a compiled rule: input checks, layout, state, and the choice of backend.

    o, state = run(program, q, k, v, gates, backend="chunk", chunk_size=64)

`program` is a compiled rule's `Program` (miras.runtime.program; `rule.program` of a
`MemoryRule`, which calls this under its autocast guard).

q, k [B, T, H, Dk]; v [B, T, H, Dv]; gates name -> [B, T, H] or [B, T, H, Dv], natural space,
or a Python float (a constant gate). The state is float32 (float64 when the inputs are); the
output has the inputs' dtype. `cu_seqlens` [N + 1] packs N sequences along T (B = 1): the state
restarts at each boundary, the initial and final states are per sequence, [N, ...].
`triton_precision` ("ieee", "tf32", "tf32x3"; default MIRAS_TRITON_PRECISION, else "tf32") is
the triton backend's tl.dot input precision on float32 tiles.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from miras.components.base import Range
from miras.ir import GateInfo
from miras.runtime import exact_keys, forms, implicit, precondition, substeps
from miras.runtime.core import Runtime, State, Tokens
from miras.runtime.inputs import (
    check_backend,
    check_chunk_size,
    check_cu_seqlens,
    check_finite,
    check_gates,
    check_qkv,
    check_triton_precision,
    inside_range,
)
from miras.runtime.program import Program

if TYPE_CHECKING:
    from miras.runtime.recurrent import Recorder


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _state_in(rt: Runtime, initial_state, default: State) -> State:
    """The public state (a tensor for a matrix memory with plain gd, else a dict) -> a dict.
    A state without the window's carried tokens (`window.*`) starts with none of them."""
    if initial_state is None:
        return default
    memory_keys = [k for k in default if not k.startswith("window.")]
    if isinstance(initial_state, torch.Tensor):
        if memory_keys != ["W"]:
            raise ValueError(
                f"initial_state: this rule's state is a dict with keys {memory_keys}, got a tensor"
            )
        initial_state = {"W": initial_state}
    if not isinstance(initial_state, dict):
        raise ValueError(f"initial_state: expected a tensor or a dict, got {type(initial_state)}")
    given_keys = set(initial_state)
    if not set(memory_keys) <= given_keys or not given_keys <= set(default):
        raise ValueError(
            f"initial_state: expected keys {sorted(default)}, got {sorted(given_keys)}"
        )
    state = dict(default)
    for name in given_keys:
        given, expected = initial_state[name], default[name]
        if name.startswith("window.") and given.shape[-1] == 1:
            given = given.expand(expected.shape)  # a per-head gate carried into per-channel
        if tuple(given.shape) != tuple(expected.shape):
            raise ValueError(
                f"initial_state[{name!r}]: expected shape {list(expected.shape)}, "
                f"got {list(given.shape)}"
            )
        state[name] = given.to(expected.dtype)
    return state


def _state_out(state: State):
    return state["W"] if list(state) == ["W"] else state


def per_channel_gates(program: Program) -> set[str]:
    """The gates `program` also takes per value channel, [B, T, H, Dv]; the rest are per head.

    A bias gate may vary per channel only where the loss reads it inside its channel sums'
    terms, next to channel j's own (every gate of an elementwise bias, a LayerNorm's weight):
    outside them (a norm's weight, a function of a channel sum) it would scale no single term
    (`BiasRule.channel_gates`). In a matrix memory the step's gates act row by row; gamma
    weighs a whole loss term."""
    if program.spec.optimizer.solves_exactly:  # one H_kk serves every value channel
        return set()
    bias_gates = set(program.spec.bias.gates())
    gates = set(program.bias.channel_gates)
    if program.spec.memory.linear:
        gates |= set(program.gates) - {program.spec.window.weight_gate} - bias_gates
    return gates - per_key_gates(program)


def per_key_gates(program: Program) -> set[str]:
    """The gates `program` also takes per key feature, [B, T, H, Dphi], instead of per value
    channel: the components' `key_channel_gates` that are gates (the exact optimizer's ridge
    on diag(H_kk); an l2 retention's decay with `decay_channels: key`, KDA)."""
    declared = {n for comp in program.spec.components().values() for n in comp.key_channel_gates}
    return declared & set(program.gates)


def _refuse_key_channel_gates(program: Program, gates: dict, form_name: str) -> None:
    """A retention gate per key channel ([B, T, H, Dphi], scaling W's columns) runs on the
    recurrent form and the exact chunk form (`exact_keys`, for gd at window 1) only: the
    chunk-start forms and the Triton kernels scale the state by rows (a gate per head or per
    value channel), so they would compute another rule; refused, naming the gate, rather
    than run. The preconditioned optimizer's step size per key channel runs on those two and
    on the chunk-start form's general path, which calls the optimizer per token."""
    if form_name == "recurrent":
        return
    _refuse_steps_per_key(program, form_name)
    why = exact_keys.refusal(program.runtime) if form_name == "exact" else None
    if form_name == "exact" and why is None:
        return
    for name in program.spec.retention.key_channel_gates:
        g = gates.get(name)
        if isinstance(g, torch.Tensor) and g.shape[-1] > 1:
            where = (
                f"the exact chunk form with it does not take {why}"
                if form_name == "exact"
                else f"the {form_name!r} form scales the state by rows (per head or per value "
                "channel) and does not take it"
            )
            raise ValueError(
                f"gates[{name!r}]: a decay per key channel [B, T, H, Dk] (retention."
                f"decay_channels: key) runs on backend='recurrent' and on the exact chunk form "
                f"(backend='chunk', chunk_mode 'auto' or 'exact') only; {where}. Pass "
                "backend='recurrent', or a decay per head [B, T, H]"
            )


def _refuse_steps_per_key(program: Program, form_name: str) -> None:
    """The preconditioned optimizer's step size lr_t M_t scales the update's columns, one per
    key channel: the forms that scale the state by rows (the chunk-start form's linear path,
    the Triton kernels) would compute another rule, so they refuse it, naming the optimizer."""
    opt = program.spec.optimizer
    if not opt.preconditioned:
        return
    rt = program.runtime
    if form_name == "exact" and exact_keys.refusal(rt) is None:
        return
    if form_name == "start" and rt.start_path == "general":
        return
    raise ValueError(
        f"optimizer {opt.kind!r}: the preconditioner scales the step per key channel (the columns "
        f"of W), which the {form_name!r} form does not take (it scales the state by rows); it "
        "runs on backend='recurrent' and on backend='chunk' (the exact chunk form, or "
        "chunk_mode='start')"
    )


def run(
    program: Program,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: dict[str, torch.Tensor] | None = None,
    *,
    backend: str = "chunk",
    chunk_size: int = 64,
    chunk_mode: str = "auto",
    initial_state: torch.Tensor | State | None = None,
    output_final_state: bool = False,
    params: dict[str, torch.Tensor] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    check_inputs: bool = True,
    triton_precision: str | None = None,
    record: Recorder | None = None,
    recompute: bool | None = None,
    _substeps: bool = False,
):
    n = substeps.steps_of(program)
    if n > 1 and not _substeps:
        # n optimizer steps per token: the one-step rule over T*n steps, chunk_size of them
        # per chunk (miras.runtime.substeps).
        q, k, v, gates, cu_seqlens = substeps.expand(
            program, q, k, v, gates, cu_seqlens, check_inputs=check_inputs
        )
        o, final = run(
            program,
            q,
            k,
            v,
            gates,
            backend=backend,
            chunk_size=chunk_size,
            chunk_mode=chunk_mode,
            initial_state=initial_state,
            output_final_state=output_final_state,
            params=params,
            cu_seqlens=cu_seqlens,
            check_inputs=False,  # checked before the expansion, in the caller's token numbers
            triton_precision=triton_precision,
            record=record,
            recompute=recompute,
            _substeps=True,
        )
        return substeps.pick(o, n), final
    shapes = check_qkv(q, k, v)
    if check_inputs:
        check_finite(q, k, v)
    backend = check_backend(backend)
    chunk_size = check_chunk_size(chunk_size)
    if recompute is not None and not isinstance(recompute, bool):
        raise ValueError(
            f"recompute: expected True, False or None (the form's default), got {recompute!r}"
        )
    if record is not None and (backend != "recurrent" or cu_seqlens is not None):
        raise ValueError(
            "record: only the recurrent backend on one sequence records its steps (miras "
            f"check's replay); got backend={backend!r}"
            + (" with cu_seqlens" if cu_seqlens is not None else "")
        )
    # tl.dot's input precision on float32 tiles: the argument, else MIRAS_TRITON_PRECISION
    # (read only on the triton backend), else "tf32" (docs/kernels.md, "Precision").
    if triton_precision is not None or backend == "triton":
        triton_precision = check_triton_precision(triton_precision)
    if cu_seqlens is not None:
        # Checked whole above: token numbers count from the start of the packed sequence.
        options = dict(
            backend=backend,
            chunk_size=chunk_size,
            chunk_mode=chunk_mode,
            params=params,
            check_inputs=False,
            triton_precision=triton_precision,
            recompute=recompute,
            _substeps=_substeps,
        )
        return _run_packed(
            program, q, k, v, gates, cu_seqlens, shapes, initial_state, output_final_state, options
        )
    if backend == "triton":
        if program.kernels is None:
            reason = "no Triton kernels were supplied with its program (Program.kernels)"
        else:
            reason = program.kernels.refusal()
        if reason is not None:
            raise ValueError(
                f"backend: 'triton' does not cover spec '{program.spec.name}': {reason}; use "
                "backend='chunk' (parallel) or 'recurrent' (the exact reference)"
            )
    # The execution form (miras.runtime.forms, docs/chunking.md): the compiler's chunk_form
    # pass recorded the spec's, `chunk_mode` may override it, the backend picks among them.
    form = program.plan.chunk_form
    mode = forms.resolve_mode(chunk_mode, form, program.spec.name)
    chosen = forms.select(backend, mode, form, chunk_size, program.spec)
    rt = program.runtime
    gates = check_gates(
        gates,
        program.plan.gates,
        shapes,
        per_channel_ok=per_channel_gates(program),
        per_key_ok=per_key_gates(program),
    )
    _refuse_key_channel_gates(program, gates, chosen.name)
    dtype = state_dtype(q.dtype)

    # [B, T, H, D] -> [B, H, T, D], in the state's precision.
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).to(dtype)

    q_, k_, v_ = heads_first(q), heads_first(k), heads_first(v)
    gates_ = {n: heads_first(g) for n, g in gates.items()}

    call = forms.Call(
        program,
        rt,
        form,
        backend,
        mode,
        chunk_size,
        triton_precision,
        operand_dtype=q.dtype,
        record=record,
        recompute=recompute,
    )
    if chosen.closed:  # softmax attention, the exact minimizer: on the inputs as given
        call = dataclasses.replace(
            call, q=q_, k=k_, v=v_, gates=gates_, initial_state=initial_state, params=params
        )
        o, final = chosen.forward(call)
        return o.transpose(1, 2).to(q.dtype), (final if output_final_state else None)

    if program.spec.window.is_global:
        rt, initial_state = global_window(rt, initial_state, shapes.length)
    params = program.default_params(dtype) if params is None else params
    phi_q, phi_k = rt.feature(q_, params), rt.feature(k_, params)
    d_phi = phi_k.shape[-1]
    if program.spec.memory.residual_field() is not None and d_phi != shapes.d_value:
        raise ValueError(
            f"v: the residual form x + LN(MLP(x)) needs Dv = Dphi = {d_phi} (the feature map's "
            f"width), got Dv = {shapes.d_value}"
        )
    for name in sorted(rt.key_gates & set(gates_)):
        if gates_[name].shape[-1] not in (1, d_phi):
            what = "a decay" if name in program.spec.retention.key_channel_gates else "a gate"
            raise ValueError(
                f"gates[{name!r}]: {what} per key channel scales the columns of W [Dv, Dphi], "
                f"so it needs Dphi = Dk; the {program.spec.feature_map.kind} feature map gives "
                f"Dphi = {d_phi} at Dk = {shapes.d_key}: pass it per head [B, T, H]"
            )
    default = rt.initial_state(shapes.batch, shapes.heads, d_phi, shapes.d_value, dtype, q.device)
    pads = {info.name: inside_value(info.allowed) for info in program.plan.gates}
    default.update(_empty_window(rt, shapes, d_phi, gates_, pads, dtype, q.device))
    state = _state_in(rt, initial_state, default)
    if initial_state is not None:
        _check_window(state, {info.name: info for info in program.plan.gates})
    seq = _tokens(rt, phi_q, phi_k, v_, gates_, state, pads)
    if program.plan.implicit_step is not None:  # the proximal step: gd with eta_t for lr_t
        rt, seq = implicit.prepare(rt, seq, program.plan.implicit_step)
    preconditioner = {}
    if program.plan.precondition is not None:  # gd with lr_t M_t per key channel for lr_t
        rt, seq, preconditioner = precondition.prepare(rt, seq, state, program.plan.precondition)

    o, final = chosen.forward(dataclasses.replace(call, rt=rt, seq=seq, state=state))
    final.update(preconditioner)  # the curvature sums A_T, "P.<name>"
    if seq.past:  # carry the window's last c - 1 tokens
        final["window.k"] = seq.phi_k[:, :, -seq.past :]
        final["window.v"] = seq.v[:, :, -seq.past :]
        final["window.valid"] = seq.valid[:, :, -seq.past :]
        for n, g in seq.window_gates.items():
            final[f"window.{n}"] = g[:, :, -seq.past :]
    o = o.transpose(1, 2).to(q.dtype)
    return o, (_state_out(final) if output_final_state else None)


def _run_packed(
    program: Program, q, k, v, gates, cu_seqlens, shapes, initial_state, output_final_state, options
):
    """Packed sequences (fla's `cu_seqlens`): each sequence runs alone, one `run` call after
    another on the chosen backend, and the outputs are joined along T; the final states are
    stacked on the batch axis, [N, ...]. Exact on every backend by construction (a state never
    crosses a boundary), at the cost of N sequential calls: no parallelism across sequences."""
    bounds = check_cu_seqlens(cu_seqlens, shapes)
    n = len(bounds) - 1
    # The gates are checked whole (names, shapes, ranges) before they are cut.
    check_gates(
        gates,
        program.plan.gates,
        shapes,
        per_channel_ok=per_channel_gates(program),
        per_key_ok=per_key_gates(program),
    )
    gates = dict(gates or {})
    # The exact optimizer carries statistics of a fixed size, not the window's tokens (and
    # softmax attention, which carries nothing, takes no window: validation refuses it).
    grows = program.spec.window.is_global and not program.spec.optimizer.solves_exactly
    if grows and output_final_state:
        raise ValueError(
            "cu_seqlens: with `window: global` the carried window grows by each sequence's "
            "length, so the final states of sequences of different lengths cannot be stacked; "
            "pass output_final_state=False or run the sequences one by one"
        )
    states = None
    if initial_state is not None:
        states = initial_state if isinstance(initial_state, dict) else {None: initial_state}
        for name, value in states.items():
            where = "initial_state" if name is None else f"initial_state[{name!r}]"
            if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != n:
                shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"{where}: with cu_seqlens, one state per sequence: expected N = {n} on "
                    f"the first axis, got {shape}"
                )
    outs, finals = [], []
    for i in range(n):
        span = slice(bounds[i], bounds[i + 1])
        part = {name: g[:, span] if isinstance(g, torch.Tensor) else g for name, g in gates.items()}
        init = None
        if states is not None:
            init = {name: value[i : i + 1] for name, value in states.items()}
            init = init.get(None, init)
        o, final = run(
            program,
            q[:, span],
            k[:, span],
            v[:, span],
            part,
            initial_state=init,
            output_final_state=output_final_state,
            **options,
        )
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1)
    if not output_final_state or finals[0] is None:
        return o, None
    if isinstance(finals[0], dict):
        return o, {name: torch.cat([f[name] for f in finals]) for name in finals[0]}
    return o, torch.cat(finals)


def global_window(rt: Runtime, initial_state, length: int):
    """`window: global` for one call of `length` tokens: the sliding window with c = P + T + 1,
    P the tokens the state carries (0 without one), so every token's window reaches back past
    the first token of the sequence and the carried window (the last c - 1 = P + T tokens) is
    the whole prefix: the state grows by T tokens per call, the cost is O(T (P + T)), like
    attention with its KV cache (docs/chunking.md). The caller's carried tokens are padded in
    front with T empty slots (valid = 0), which `_tokens` selects away."""
    carried = 0
    if isinstance(initial_state, dict) and "window.k" in initial_state:
        carried = initial_state["window.k"].shape[2]
    window = rt.spec.window.model_copy(update={"c": carried + length + 1})
    rt = dataclasses.replace(rt, spec=rt.spec.model_copy(update={"window": window}))
    if carried:
        initial_state = dict(initial_state)
        for name, value in initial_state.items():
            if name.startswith("window."):
                front = value.new_zeros(*value.shape[:2], length, value.shape[-1])
                initial_state[name] = torch.cat([front, value], dim=2)
    return rt, initial_state


def inside_value(allowed: Range) -> float:
    """A value inside a gate's range for the window's slots before the first token: 1 where
    allowed (a neutral scale), else the middle of a bounded range, else one unit inside its
    finite end. Padding must never reach a formula with a value outside the gate's range:
    a custom bias's gate 0 makes tanh(e/a) 0/0, and valid = 0 does not clear a NaN."""
    if 1.0 in allowed:
        return 1.0
    lo, hi = allowed.lo, allowed.hi
    if math.isfinite(lo) and math.isfinite(hi):
        return (lo + hi) / 2
    return lo + 1.0 if math.isfinite(lo) else hi - 1.0 if math.isfinite(hi) else 0.0


def _empty_window(
    rt: Runtime, shapes, d_phi: int, gates, pads: dict[str, float], dtype, device
) -> State:
    """The window's carried tokens before the first one: none (valid = 0), with zero keys and
    values and each gate at `pads[name]`, a value inside its range."""
    past = rt.spec.window.c - 1
    if past == 0:
        return {}
    b, h = shapes.batch, shapes.heads

    def full(value, *tail):
        return torch.full((b, h, past, *tail), value, dtype=dtype, device=device)

    empty = {
        "window.k": full(0.0, d_phi),
        "window.v": full(0.0, shapes.d_value),
        "window.valid": full(0.0, 1),
    }
    for n in rt.window_gate_names:
        empty[f"window.{n}"] = full(pads[n], gates[n].shape[-1])
    return empty


def _check_window(state: State, infos: dict[str, GateInfo]) -> None:
    """A carried window from the caller: valid is 0 or 1, and each gate lies in its range
    where valid = 1 (the slots with valid = 0 are replaced in `_tokens`)."""
    if "window.valid" not in state:
        return
    valid = state["window.valid"].detach()
    if not bool(((valid == 0) | (valid == 1)).all()):
        raise ValueError(
            "initial_state['window.valid']: expected 0 (no token) or 1, got other values"
        )
    live = valid == 1  # [B, H, P, 1]
    for name, info in infos.items():
        if f"window.{name}" not in state:
            continue
        g = state[f"window.{name}"].detach()
        bad = ~inside_range(g, info.allowed) & live
        if bool(bad.any()):
            raise ValueError(
                f"initial_state['window.{name}']: values where window.valid = 1 must lie in "
                f"{info.allowed}, found {g[bad].flatten()[0].item():g}"
            )


def _tokens(rt: Runtime, phi_q, phi_k, v, gates, state: State, pads: dict[str, float]) -> Tokens:
    """The sequence with the window's carried tokens in front of the keys, values and gates.
    Slots with valid = 0 are selected away (torch.where, so not even a NaN there passes): zero
    keys and values, each gate at `pads[name]`, inside its range."""
    window = set(rt.window_gate_names)
    step_gates = {n: g for n, g in gates.items() if n not in window}
    past = rt.spec.window.c - 1
    if past == 0:
        valid = torch.ones_like(phi_k[..., :1])
        window_gates = {n: gates[n] for n in window}
        return Tokens(phi_q, phi_k, v, valid, step_gates, window_gates, 0)
    ones = torch.ones_like(phi_k[..., :1])
    valid = state.pop("window.valid")  # [B, H, P, 1]
    live = valid > 0

    def carried(name: str, pad: float) -> torch.Tensor:
        return torch.where(live, state.pop(name), pad)

    return Tokens(
        phi_q,
        torch.cat([carried("window.k", 0.0), phi_k], dim=2),
        torch.cat([carried("window.v", 0.0), v], dim=2),
        torch.cat([live.to(ones.dtype), ones], dim=2),
        step_gates,
        {n: torch.cat([carried(f"window.{n}", pads[n]), gates[n]], dim=2) for n in window},
        past,
    )
