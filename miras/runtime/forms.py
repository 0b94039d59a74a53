"""The execution forms, one entry each, and the choice among them (docs/chunking.md).

    mode = resolve_mode(chunk_mode, program.plan.chunk_form, program.spec.name)
    form = select(backend, mode, program.plan.chunk_form, chunk_size, program.spec)
    o, final = form.forward(call)

`FORMS` is the registry, a dict in order of precedence: the first form whose backends and
modes hold the call's, and whose `applies` accepts the compiled chunk form, the chunk size and
the spec, runs it. `print(table())` lists it. A closed form (softmax attention, the exact
minimizer) runs on the inputs as given; every other form runs on the memory's tokens and
state, which `miras.runtime.run` prepares (features, the window's carried tokens, the
proximal step's step size) and finishes (the window carried into the final state).

Imports stay where they are paid for: the triton forms' kernels load only when one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from miras.ir import ChunkForm
from miras.runtime import (
    chunk,
    dual,
    exact_chunk,
    exact_keys,
    exact_minimizer,
    exact_triton,
    recurrent,
)
from miras.runtime.core import Runtime, State, Tokens

if TYPE_CHECKING:
    from miras.runtime.program import Program
    from miras.spec import Spec

CHUNK_MODES = ("auto", "start", "exact")
# The resolved modes (`resolve_mode`'s answers) whose chunked forms equal the recurrence at
# every chunk size; "start" and "dual" are the chunk-start approximation at b > 1.
EXACT_MODES = ("exact", "minimizer")


def resolve_mode(chunk_mode: str, form: ChunkForm, spec_name: str) -> str:
    """`chunk_mode` -> "exact", "start" or "dual" for this spec, on every backend ("auto" takes the
    compiled form: "dual" runs the chunk-start semantics without per-token weights, and "start"
    keeps the per-token path for any spec); a ValueError naming the reason where the exact form
    is asked for and does not exist."""
    if chunk_mode not in CHUNK_MODES:
        raise ValueError(
            f"chunk_mode: expected one of {', '.join(CHUNK_MODES)}, got {chunk_mode!r}"
        )
    if chunk_mode == "exact" and form.form != "exact":
        raise ValueError(
            f"chunk_mode: 'exact' is not available for spec '{spec_name}': {form.reason}; use "
            "chunk_mode='start' (the chunk-start approximation) or 'auto'"
        )
    # Every backend runs the form this resolves to (triton's exact form: exact_triton.py).
    return form.form if chunk_mode == "auto" else chunk_mode


def is_exact(mode: str) -> bool:
    """Whether the resolved `mode` computes the recurrence at every chunk size."""
    return mode in EXACT_MODES


@dataclass(frozen=True)
class FormInput:
    """What a form reads. Every form: the rule's `program`, its runtime `rt`, the compiled
    `chunk` form, the backend, the resolved mode, the chunk size, triton's tl.dot precision
    (None off the triton backend), `record`, which the recurrent form calls with every piece
    of every step (miras check's replay; None otherwise), and `recompute`, whether the general
    chunk-start path recomputes each chunk in the backward instead of keeping its per-token
    states (None: its default, `chunk.recomputes`; no other form has the choice).

    A closed form reads the inputs heads first, in the state's dtype: `q`, `k` [B, H, T, Dk],
    `v` [B, H, T, Dv], `gates` name -> [B, H, T, X], and `initial_state` and `params` as the
    caller gave them. A token form reads `seq` (the memory's tokens, the window's carried ones
    in front) and `state` (the memory state, a dict)."""

    program: Program
    rt: Runtime
    chunk: ChunkForm
    backend: str
    mode: str
    chunk_size: int
    precision: str | None = None
    # The inputs' own dtype (q's, before the cast to the state's dtype): the triton kernels take
    # their products' operands in it where it is a half type (docs/kernels.md, "Precision").
    operand_dtype: torch.dtype | None = None
    record: recurrent.Recorder | None = None
    recompute: bool | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    gates: dict[str, torch.Tensor] | None = None
    initial_state: object = None
    params: dict[str, torch.Tensor] | None = None
    seq: Tokens | None = None
    state: State | None = None


# (o [B, H, T, Dv], the final state or None)
Forward = Callable[[FormInput], tuple[torch.Tensor, State | None]]


def _always(chunk: ChunkForm, chunk_size: int, spec: Spec) -> bool:
    return True


@dataclass(frozen=True)
class Form:
    """One execution form: the backends and resolved chunk modes that select it (`modes`
    None: any), when it applies beyond those (`applies(chunk_form, chunk_size, spec)`), whether
    it is `closed` (runs on the inputs, before the memory's tokens and state exist), and its
    `forward`."""

    name: str
    text: str
    backends: tuple[str, ...]
    modes: tuple[str, ...] | None
    forward: Forward = field(repr=False)
    applies: Callable[[ChunkForm, int, Spec], bool] = field(default=_always, repr=False)
    closed: bool = False

    def accepts(
        self, backend: str, mode: str, chunk_form: ChunkForm, chunk_size: int, spec: Spec
    ) -> bool:
        return (
            backend in self.backends
            and (self.modes is None or mode in self.modes)
            and self.applies(chunk_form, chunk_size, spec)
        )


# The forms' forwards ---------------------------------------------------------------------------


def _closed_form(call: FormInput):
    """The memory's own closed form (`Memory.run_closed_form`): o [B, H, T, Dv] and no state,
    since it carries none here (a layer keeps softmax attention's KV cache itself)."""
    memory = call.program.spec.memory
    if call.initial_state is not None:
        raise ValueError(f"initial_state: {memory.closed_form()} carries no state here; pass None")
    return memory.run_closed_form(call.q, call.k, call.v), None


def _has_closed_form(chunk: ChunkForm, chunk_size: int, spec: Spec) -> bool:
    return spec.memory.closed_form() is not None


def _minimizer(call: FormInput):
    params = call.program.default_params(call.q.dtype) if call.params is None else call.params
    phi_q, phi_k = call.rt.feature(call.q, params), call.rt.feature(call.k, params)
    return exact_minimizer.forward(
        call.rt, call.chunk, phi_q, phi_k, call.v, call.gates, call.initial_state,
        call.backend, call.chunk_size, call.mode,
    )  # fmt: skip


def _recurrent(call: FormInput):
    return recurrent.forward(call.rt, call.seq, call.state, call.record)


def _exact(call: FormInput):
    if exact_keys.applies(call.rt, call.seq):  # KDA's decay, a step per key: the form of its own
        return exact_keys.forward(call.rt, call.seq, call.state, call.chunk_size, call.chunk)
    return exact_chunk.forward(call.rt, call.seq, call.state, call.chunk_size, call.chunk)


def _dual(call: FormInput):
    return dual.forward(call.rt, call.seq, call.state, call.chunk_size)


def _start(call: FormInput):  # the linear fast path where the runtime's start_path says "linear"
    return chunk.forward(call.rt, call.seq, call.state, call.chunk_size, call.recompute)


def _exact_triton(call: FormInput):
    return exact_triton.forward(
        call.rt,
        call.seq,
        call.state,
        call.chunk_size,
        call.chunk,
        call.precision,
        operand_dtype=call.operand_dtype,
    )


def _triton(call: FormInput):
    from miras.runtime import triton_backend  # imports triton only when asked for

    return triton_backend.forward(
        call.program,
        call.seq,
        call.state,
        call.chunk_size,
        call.precision,
        operand_dtype=call.operand_dtype,
    )


# The registry ----------------------------------------------------------------------------------

BACKENDS = ("recurrent", "chunk", "triton")

FORMS: dict[str, Form] = {
    form.name: form
    for form in (
        Form(
            "attention",
            "the memory's own closed form (softmax attention; swa: over a window); nothing "
            "is chunked",
            BACKENDS,
            None,
            _closed_form,
            applies=_has_closed_form,
            closed=True,
        ),
        Form(
            "minimizer",
            "the exact minimizer: the objective's statistics per token or per chunk, a "
            "Cholesky solve per read (exact_minimizer.py)",
            BACKENDS,
            None,
            _minimizer,
            applies=lambda chunk_form, chunk_size, spec: chunk_form.form == "minimizer",
            closed=True,
        ),
        Form(
            "recurrent",
            "the step one token at a time, the exact reference (recurrent.py)",
            ("recurrent",),
            None,
            _recurrent,
        ),
        Form(
            "exact",
            "each chunk solved exactly, equal to the recurrence at any chunk size (exact_chunk.py; "
            "a decay or a step size per key channel: exact_keys.py)",
            ("chunk",),
            ("exact",),
            _exact,
        ),
        Form(
            "dual",
            "the chunk-start form of an MLP memory without per-token weights (dual.py)",
            ("chunk",),
            ("dual",),
            _dual,
        ),
        Form(
            "start",
            "every gradient of a chunk at its start state (chunk.py; its linear fast path "
            "linear.py where the plan records start_path 'linear')",
            ("chunk",),
            ("start",),
            _start,
        ),
        Form(
            "exact_triton",
            "the exact form with its scan over chunks in Triton kernels (exact_triton.py)",
            ("triton",),
            ("exact",),
            _exact_triton,
            applies=lambda chunk_form, chunk_size, spec: exact_triton.applies(
                chunk_form, chunk_size
            ),
        ),
        Form(
            "triton",
            "the emitted chunk kernels, general or linear template (triton_backend.py): the "
            "chunk-start form, which is the exact one at chunk size 1 or a zero slope",
            ("triton",),
            None,
            _triton,
        ),
    )
}


def select(backend: str, mode: str, chunk_form: ChunkForm, chunk_size: int, spec: Spec) -> Form:
    """The first form in `FORMS` that takes this call."""
    for form in FORMS.values():
        if form.accepts(backend, mode, chunk_form, chunk_size, spec):
            return form
    raise ValueError(
        f"backend: no execution form of spec '{spec.name}' runs backend={backend!r} with "
        f"chunk mode {mode!r}; the forms: {', '.join(FORMS)}"
    )


def table() -> str:
    """The registry, one line per form: name, backends, modes, what it computes."""
    rows = []
    for form in FORMS.values():
        modes = "any mode" if form.modes is None else "/".join(form.modes)
        rows.append(f"{form.name:<13} {'/'.join(form.backends):<24} {modes:<9} {form.text}")
    return "\n".join(rows)
