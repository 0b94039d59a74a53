"""The memory state as `run` takes and returns it, and the Omega window's carried tokens.

A caller's state is a tensor (a matrix memory with plain gd: W) or a dict; inside, always a
dict, with the window's last c - 1 tokens under `window.*` (keys, values, valid, each gate).
`state_in` checks a caller's state against the rule's default, `empty_window` is the window
before the first token, `window_tokens` puts the carried tokens in front of the sequence's,
and `global_window` turns `window: global` into a sliding window over the whole prefix.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from miras.components.base import Range
from miras.ir import GateInfo
from miras.runtime.core import Runtime, State, Tokens
from miras.runtime.inputs import inside_range


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_in(rt: Runtime, initial_state, default: State) -> State:
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


def state_out(state: State):
    return state["W"] if list(state) == ["W"] else state


def global_window(rt: Runtime, initial_state, length: int):
    """`window: global` for one call of `length` tokens: the sliding window with c = P + T + 1,
    P the tokens the state carries (0 without one), so every token's window reaches back past
    the first token of the sequence and the carried window (the last c - 1 = P + T tokens) is
    the whole prefix: the state grows by T tokens per call, the cost is O(T (P + T)), like
    attention with its KV cache (docs/chunking.md). The caller's carried tokens are padded in
    front with T empty slots (valid = 0), which `window_tokens` selects away."""
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


def empty_window(
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


def check_window(state: State, infos: dict[str, GateInfo]) -> None:
    """A carried window from the caller: valid is 0 or 1, and each gate lies in its range
    where valid = 1 (the slots with valid = 0 are replaced in `window_tokens`)."""
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


def window_tokens(
    rt: Runtime, phi_q, phi_k, v, gates, state: State, pads: dict[str, float]
) -> Tokens:
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
