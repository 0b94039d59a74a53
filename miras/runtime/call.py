"""One call of a compiled rule: `run(program, q, k, v, gates, ...)` is `dispatch(prepare(...))`.

    call = prepare(program, q, k, v, gates, backend="chunk", chunk_size=64)   # checked
    o, state = dispatch(call)

`prepare` checks and normalizes the arguments into a `Call` (a rule with n optimizer steps
per token has its inputs expanded to the T*n sub-steps there, miras.runtime.substeps);
`dispatch` runs it: `run_sequence`, the one single-sequence core (the execution form, the
features, the state and the window's carried tokens), once, or once per packed sequence
(`run_packed`, fla's `cu_seqlens`), then picks each token's output after its last sub-step.

q, k [B, T, H, Dk]; v [B, T, H, Dv]; gates name -> [B, T, H] or [B, T, H, Dv], natural space,
or a Python float (a constant gate). The state is float32 (float64 when the inputs are); the
output has the inputs' dtype. `cu_seqlens` [N + 1] packs N sequences along T (B = 1): the state
restarts at each boundary, the initial and final states are per sequence, [N, ...].
`triton_precision` ("ieee", "tf32", "tf32x3"; default MIRAS_TRITON_PRECISION, else "tf32") is
the triton backend's tl.dot input precision on float32 tiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miras.runtime import exact_keys, forms, implicit, precondition, substeps
from miras.runtime.core import State
from miras.runtime.inputs import (
    Shapes,
    check_backend,
    check_chunk_size,
    check_cu_seqlens,
    check_finite,
    check_gates,
    check_qkv,
    check_triton_precision,
)
from miras.runtime.program import Program
from miras.runtime.state import (
    check_window,
    empty_window,
    global_window,
    inside_value,
    state_dtype,
    state_in,
    state_out,
    window_tokens,
)

if TYPE_CHECKING:
    from miras.runtime.recurrent import Recorder


@dataclass(frozen=True)
class Call:
    """One call of `run`, its arguments checked (`prepare`): the rule's `program`, the inputs
    q, k, v and `gates` as the caller lays them out ([B, T, H, ...]), their `shapes`, the
    backend, chunk size and mode, the initial state, whether the final one is returned, the
    feature map's `params`, `cu_seqlens` (packed sequences), triton's tl.dot precision (None
    off the triton backend), `record` (the recurrent form's replay of every step) and
    `recompute` (the chunk-start backward's choice). `substeps`: n, the optimizer steps per
    token; for n > 1 the inputs are already the T*n sub-steps' and `dispatch` keeps every
    n-th output."""

    program: Program
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: dict[str, Any] | None
    shapes: Shapes
    backend: str = "chunk"
    chunk_size: int = 64
    chunk_mode: str = "auto"
    initial_state: Any = None
    output_final_state: bool = False
    params: dict[str, torch.Tensor] | None = None
    cu_seqlens: torch.Tensor | None = None
    triton_precision: str | None = None
    record: Recorder | None = None
    recompute: bool | None = None
    substeps: int = 1


def run(program: Program, q, k, v, gates=None, **options: Any):
    """o [B, T, H, Dv] and the final state (None unless `output_final_state`): `prepare`'s
    arguments (its keywords are `options`), run by `dispatch`."""
    return dispatch(prepare(program, q, k, v, gates, **options))


def prepare(
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
) -> Call:
    """The call's arguments checked: q, k, v's shapes and dtypes (finite, with
    `check_inputs`), the backend, chunk size, `recompute`, `record` and triton's precision.
    n optimizer steps per token: the inputs become the one-step rule's T*n sub-steps here,
    chunk_size of them per chunk (miras.runtime.substeps), checked before the expansion in the
    caller's token numbers. The gates, the state and the form are checked where they are used
    (`run_sequence`, `run_packed`): they depend on the form the backend picks."""
    n = substeps.steps_of(program)
    if n > 1:
        q, k, v, gates, cu_seqlens = substeps.expand(
            program, q, k, v, gates, cu_seqlens, check_inputs=check_inputs
        )
        check_inputs = False  # checked before the expansion, in the caller's token numbers
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
    return Call(
        program,
        q,
        k,
        v,
        gates,
        shapes,
        backend=backend,
        chunk_size=chunk_size,
        chunk_mode=chunk_mode,
        initial_state=initial_state,
        output_final_state=output_final_state,
        params=params,
        cu_seqlens=cu_seqlens,
        triton_precision=triton_precision,
        record=record,
        recompute=recompute,
        substeps=n,
    )


def dispatch(call: Call):
    """Run a prepared call: one sequence (`run_sequence`) or packed ones (`run_packed`), then,
    with n sub-steps per token, each token's output: the read after its last sub-step."""
    o, final = run_packed(call) if call.cu_seqlens is not None else run_sequence(call)
    if call.substeps > 1:
        o = substeps.pick(o, call.substeps)
    return o, final


def run_packed(call: Call):
    """Packed sequences (fla's `cu_seqlens`): each sequence runs alone, one `run_sequence` after
    another on the chosen backend, and the outputs are joined along T; the final states are
    stacked on the batch axis, [N, ...]. Exact on every backend by construction (a state never
    crosses a boundary), at the cost of N sequential calls: no parallelism across sequences."""
    program, shapes, initial_state = call.program, call.shapes, call.initial_state
    bounds = check_cu_seqlens(call.cu_seqlens, shapes)
    n = len(bounds) - 1
    # The gates are checked whole (names, shapes, ranges) before they are cut, so token
    # numbers count from the start of the packed sequence.
    _checked_gates(call)
    gates = dict(call.gates or {})
    # The exact optimizer carries statistics of a fixed size, not the window's tokens (and
    # softmax attention, which carries nothing, takes no window: validation refuses it).
    grows = program.spec.window.is_global and not program.spec.optimizer.solves_exactly
    if grows and call.output_final_state:
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
        q, k, v = call.q[:, span], call.k[:, span], call.v[:, span]
        part = {name: g[:, span] if isinstance(g, torch.Tensor) else g for name, g in gates.items()}
        init = None
        if states is not None:
            init = {name: value[i : i + 1] for name, value in states.items()}
            init = init.get(None, init)
        piece = dataclasses.replace(
            call,
            q=q,
            k=k,
            v=v,
            gates=part,
            shapes=check_qkv(q, k, v),
            initial_state=init,
            cu_seqlens=None,
        )
        o, final = run_sequence(piece)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1)
    if not call.output_final_state or finals[0] is None:
        return o, None
    if isinstance(finals[0], dict):
        return o, {name: torch.cat([f[name] for f in finals]) for name in finals[0]}
    return o, torch.cat(finals)


def run_sequence(call: Call):
    """The single-sequence core: the execution form the backend picks (miras.runtime.forms,
    docs/chunking.md), the gates checked against it, the inputs heads first in the state's
    dtype; a closed form runs on them as they are, every other form on the memory's tokens
    and state (`_run_memory`). o [B, T, H, Dv] in the inputs' dtype, and the final state."""
    program, q = call.program, call.q
    if call.backend == "triton":
        _refuse_uncovered_triton(program)
    # The compiler's chunk_form pass recorded the spec's form, `chunk_mode` may override it,
    # the backend picks among them.
    form = program.plan.chunk_form
    mode = forms.resolve_mode(call.chunk_mode, form, program.spec.name)
    chosen = forms.select(call.backend, mode, form, call.chunk_size, program.spec)
    gates = _checked_gates(call)
    refuse_key_channel_gates(program, gates, chosen.name)
    dtype = state_dtype(q.dtype)

    # [B, T, H, D] -> [B, H, T, D], in the state's precision.
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).to(dtype)

    q_, k_, v_ = heads_first(q), heads_first(call.k), heads_first(call.v)
    gates_ = {n: heads_first(g) for n, g in gates.items()}
    given = forms.FormInput(
        program,
        program.runtime,
        form,
        call.backend,
        mode,
        call.chunk_size,
        call.triton_precision,
        operand_dtype=q.dtype,
        record=call.record,
        recompute=call.recompute,
    )
    if chosen.closed:  # softmax attention, the exact minimizer: on the inputs as given
        given = dataclasses.replace(
            given,
            q=q_,
            k=k_,
            v=v_,
            gates=gates_,
            initial_state=call.initial_state,
            params=call.params,
        )
        o, final = chosen.forward(given)
        return o.transpose(1, 2).to(q.dtype), (final if call.output_final_state else None)
    o, final = _run_memory(call, chosen, given, q_, k_, v_, gates_)
    o = o.transpose(1, 2).to(q.dtype)
    return o, (state_out(final) if call.output_final_state else None)


def _checked_gates(call: Call) -> dict[str, torch.Tensor]:
    """The call's gates checked (names, shapes, ranges; a constant becomes a tensor), each per
    head, or per value or key channel where the program takes it so."""
    program = call.program
    return check_gates(
        call.gates,
        program.plan.gates,
        call.shapes,
        per_channel_ok=per_channel_gates(program),
        per_key_ok=per_key_gates(program),
    )


def _refuse_uncovered_triton(program: Program) -> None:
    if program.kernels is None:
        reason = "no Triton kernels were supplied with its program (Program.kernels)"
    else:
        reason = program.kernels.refusal()
    if reason is not None:
        raise ValueError(
            f"backend: 'triton' does not cover spec '{program.spec.name}': {reason}; use "
            "backend='chunk' (parallel) or 'recurrent' (the exact reference)"
        )


def _run_memory(call: Call, chosen: forms.Form, given: forms.FormInput, q_, k_, v_, gates_):
    """A token form on the memory's tokens and state (heads first, the state's dtype): the
    features, the state (the caller's, checked, or the default) with the window's carried
    tokens, the proximal and preconditioned steps' inputs; o [B, H, T, Dv] and the final
    state as a dict, the window's last c - 1 tokens carried into it."""
    program, shapes, rt = call.program, call.shapes, call.program.runtime
    dtype, initial_state, params = q_.dtype, call.initial_state, call.params
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
    device = call.q.device
    default = rt.initial_state(shapes.batch, shapes.heads, d_phi, shapes.d_value, dtype, device)
    pads = {info.name: inside_value(info.allowed) for info in program.plan.gates}
    default.update(empty_window(rt, shapes, d_phi, gates_, pads, dtype, device))
    state = state_in(rt, initial_state, default)
    if initial_state is not None:
        check_window(state, {info.name: info for info in program.plan.gates})
    seq = window_tokens(rt, phi_q, phi_k, v_, gates_, state, pads)
    if program.plan.implicit_step is not None:  # the proximal step: gd with eta_t for lr_t
        rt, seq = implicit.prepare(rt, seq, program.plan.implicit_step)
    preconditioner = {}
    if program.plan.precondition is not None:  # gd with lr_t M_t per key channel for lr_t
        rt, seq, preconditioner = precondition.prepare(rt, seq, state, program.plan.precondition)

    o, final = chosen.forward(dataclasses.replace(given, rt=rt, seq=seq, state=state))
    final.update(preconditioner)  # the curvature sums A_T, "P.<name>"
    if seq.past:  # carry the window's last c - 1 tokens
        final["window.k"] = seq.phi_k[:, :, -seq.past :]
        final["window.v"] = seq.v[:, :, -seq.past :]
        final["window.valid"] = seq.valid[:, :, -seq.past :]
        for n, g in seq.window_gates.items():
            final[f"window.{n}"] = g[:, :, -seq.past :]
    return o, final


# Which gate shapes a program takes -------------------------------------------------------------


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


def refuse_key_channel_gates(program: Program, gates: dict, form_name: str) -> None:
    """A retention gate per key channel ([B, T, H, Dphi], scaling W's columns) runs on the
    recurrent form and the exact chunk form (`exact_keys`, for gd at window 1) only: the
    chunk-start forms and the Triton kernels scale the state by rows (a gate per head or per
    value channel), so they would compute another rule; refused, naming the gate, rather
    than run. The preconditioned optimizer's step size per key channel runs on those two and
    on the chunk-start form's general path, which calls the optimizer per token."""
    if form_name == "recurrent":
        return
    refuse_steps_per_key(program, form_name)
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


def refuse_steps_per_key(program: Program, form_name: str) -> None:
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
