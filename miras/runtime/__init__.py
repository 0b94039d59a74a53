"""Run a compiled rule: the runtime's public surface (docs/architecture.md).

    o, state = run(program, q, k, v, gates, backend="chunk", chunk_size=64)
    call = prepare(program, q, k, v, gates, backend="chunk")   # the same, checked first
    o, state = dispatch(call)

`program` is a compiled rule's `Program` (miras.runtime.program; `rule.program` of a
`MemoryRule`, which calls `run` under its autocast guard). The call itself lives in
miras.runtime.call; this package's modules are the execution forms and what they share.
Code above the runtime (the layer, the fla-style ops, the probes) imports from here, not from
the runtime's modules (tests/test_imports.py holds them to it): the names below are what they
use.
"""

from __future__ import annotations

from miras.runtime.call import (
    Call,
    dispatch,
    per_channel_gates,
    per_key_gates,
    prepare,
    run,
)
from miras.runtime.exact_chunk import START_CHUNK_SIZE, default_chunk_size
from miras.runtime.exact_minimizer import weights as minimizer_weights
from miras.runtime.forms import is_exact, resolve_mode
from miras.runtime.inputs import (
    all_finite,
    check_cu_seqlens,
    check_qkv,
    first_bad,
    inside_range,
)
from miras.runtime.program import Program
from miras.runtime.state import global_window, inside_value, state_dtype

__all__ = [
    "START_CHUNK_SIZE",
    "Call",
    "Program",
    "all_finite",
    "check_cu_seqlens",
    "check_qkv",
    "default_chunk_size",
    "dispatch",
    "first_bad",
    "global_window",
    "inside_range",
    "inside_value",
    "is_exact",
    "minimizer_weights",
    "per_channel_gates",
    "per_key_gates",
    "prepare",
    "resolve_mode",
    "run",
    "state_dtype",
]
