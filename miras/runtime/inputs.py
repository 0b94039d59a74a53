"""Checks at the public boundary: every bad input is a ValueError naming the argument."""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import pairwise

import torch

from miras.errors import did_you_mean
from miras.ir import GateInfo

BACKENDS = ("recurrent", "chunk", "triton")
# tl.dot's input precision for float32 tiles on the triton backend (docs/kernels.md, "Precision").
TRITON_PRECISIONS = ("ieee", "tf32", "tf32x3")
TRITON_PRECISION_ENV = "MIRAS_TRITON_PRECISION"
# tl.dot's input precision on float32 tiles unless asked otherwise: TF32 tensor cores, as fla's
# kernels (and torch's own matmuls under allow_tf32) multiply float32; "ieee" and "tf32x3" are
# the accuracy options (docs/kernels.md, "Precision").
DEFAULT_TRITON_PRECISION = "tf32"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Shapes:
    batch: int
    length: int
    heads: int
    d_key: int
    d_value: int
    dtype: torch.dtype  # of q, k, v; the gates must have it too
    device: torch.device | None = None  # of q, k, v; a scalar gate is made there


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Shapes:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor [B, T, H, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 axes [B, T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k: expected equal shapes [B, T, H, Dk], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v: expected [B, T, H] = {tuple(k.shape[:3])} like k, got {tuple(v.shape[:3])}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[1] < 1:
        raise ValueError("q, k, v: expected at least one token (T >= 1)")
    b, t, h, dk = k.shape
    return Shapes(b, t, h, dk, v.shape[-1], q.dtype, q.device)


def check_finite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Every entry of q, k, v finite. The fast path is one sum per tensor and one host sync:
    a NaN or inf makes the sum non-finite (16x cheaper than isfinite(x).all() on the CPU,
    which allocates a mask); a non-finite sum is re-checked entry by entry (finite values whose
    sum overflows pass) and the first bad token located. Unchecked, a NaN or inf spreads
    through the state to every later token, and the chunk forms also spread it back to the
    start of its chunk (a chunk is solved as one block)."""
    sums = torch.stack([t.detach().sum(dtype=_sum_dtype(t.dtype)) for t in (q, k, v)])
    if bool(torch.isfinite(sums).all()):
        return
    for name, t in zip("qkv", (q, k, v), strict=True):
        if not bool(torch.isfinite(t.detach()).all()):
            where = _first_nonfinite(t.detach())
            raise ValueError(f"{name}: found the non-finite value {where}; {NONFINITE_HINT}")


def all_finite(x: torch.Tensor) -> bool:
    """Is every entry of x finite? One sum and one host sync when it is (see check_finite)."""
    x = x.detach()
    return bool(torch.isfinite(x.sum(dtype=_sum_dtype(x.dtype)))) or bool(torch.isfinite(x).all())


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # fp16 sums overflow


NONFINITE_HINT = (
    "the rule's inputs must be finite (check_inputs=False skips this check: a NaN then spreads "
    "through the memory to every later token, and in the chunk forms back to its chunk's start)"
)


def first_bad(bad: torch.Tensor) -> tuple[int, int, int]:
    """(token, batch row, head) of the earliest True entry in time of bad [B, T, H, ...]:
    the smallest token, then the smallest row and head there."""
    per_token = bad.flatten(2).any(-1)  # [B, T]
    token = int(per_token.any(0).float().argmax())
    row = int(per_token[:, token].float().argmax())
    head = int(bad[row, token].flatten(1).any(-1).float().argmax())
    return token, row, head


def _first_nonfinite(x: torch.Tensor) -> str:
    """Where the earliest non-finite entry of x [B, T, H, D] lies, as text."""
    bad = ~torch.isfinite(x)
    token, row, head = first_bad(bad)
    value = x[row, token, head][bad[row, token, head]][0].item()
    return f"{value} at token {token} (batch row {row}, head {head}), the first in time"


def check_gates(
    gates: dict[str, torch.Tensor] | None,
    expected: tuple[GateInfo, ...],
    shapes: Shapes,
    *,
    per_channel_ok: set[str],
    per_key_ok: set[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Gates in natural space, each [B, T, H] (per head) or [B, T, H, Dv] (per channel), in
    the dtype of q, k, v (another would be converted silently, losing or faking precision),
    or a Python float/int: one constant for every token and head (checked against the range
    like a tensor). A gate in `per_key_ok` may be [B, T, H, Dk] (per key feature) instead.
    Returns each as [B, T, H, 1], [B, T, H, Dv] or [B, T, H, Dk]."""
    if gates is None:
        gates = {}
    if not isinstance(gates, dict):
        raise ValueError(f"gates: expected a dict name -> tensor, got {type(gates).__name__}")
    gates = dict(gates)
    names = [g.name for g in expected]
    missing = [n for n in names if n not in gates]
    if missing:
        listed = ", ".join(names)
        raise ValueError(
            f"gates: missing {', '.join(map(repr, missing))}; this rule takes {listed}"
        )
    extra = [n for n in gates if n not in names]
    if extra:
        listed = ", ".join(names) or "none"
        raise ValueError(f"gates: unknown {', '.join(map(repr, extra))}; this rule takes {listed}")
    head = (shapes.batch, shapes.length, shapes.heads)
    out = {}
    for info in expected:
        g = gates[info.name]
        if isinstance(g, (int, float)) and not isinstance(g, bool):
            g = torch.full(head, float(g), dtype=shapes.dtype, device=shapes.device)
        if not isinstance(g, torch.Tensor):
            raise ValueError(
                f"gates[{info.name!r}]: expected a tensor or a Python float, got {type(g).__name__}"
            )
        if g.dtype != shapes.dtype:
            raise ValueError(
                f"gates[{info.name!r}]: the gate is {_name(g.dtype)} but q, k, v are "
                f"{_name(shapes.dtype)}; pass gates in the inputs' dtype, e.g. "
                f"gates[{info.name!r}].to(q.dtype)"
            )
        if tuple(g.shape) == head:
            g = g.unsqueeze(-1)
        elif info.name in per_key_ok and tuple(g.shape) == (*head, shapes.d_key):
            pass  # per key feature (`per_key_ok`: the exact optimizer's ridge, KDA's decay)
        elif tuple(g.shape) == (*head, shapes.d_value):
            if info.name in per_key_ok:  # declared per key channel (KDA's decay)
                raise ValueError(
                    f"gates[{info.name!r}]: expected [B, T, H] = {list(head)} or [B, T, H, Dk] = "
                    f"{[*head, shapes.d_key]} (this rule takes it per key channel, not per value "
                    f"channel), got {list(g.shape)}"
                )
            if info.name not in per_channel_ok:
                raise ValueError(
                    f"gates[{info.name!r}]: this rule takes this gate per head only (a per-channel "
                    "gate needs a matrix memory, or an elementwise bias for a bias gate); "
                    f"expected per head {list(head)}"
                )
        else:
            width = ("Dk", shapes.d_key) if info.name in per_key_ok else ("Dv", shapes.d_value)
            raise ValueError(
                f"gates[{info.name!r}]: expected [B, T, H] = {list(head)} or [B, T, H, "
                f"{width[0]}] = {[*head, width[1]]}, got {list(g.shape)}"
            )
        bad = ~inside_range(g.detach(), info.allowed)
        if bool(bad.any()):
            token, row, head = first_bad(bad)
            value = g.detach()[row, token, head][bad[row, token, head]][0].item()
            raise ValueError(
                f"gates[{info.name!r}]: values must lie in {info.allowed} (natural space), "
                f"found {value:g} at token {token} (batch row {row}, head {head}), the first "
                "in time"
            )
        out[info.name] = g
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def inside_range(g: torch.Tensor, allowed) -> torch.Tensor:
    """Elementwise: does g lie in the Range `allowed` (its ends open or closed)?"""
    lo = g >= allowed.lo if allowed.lo_closed else g > allowed.lo
    hi = g <= allowed.hi if allowed.hi_closed else g < allowed.hi
    return lo & hi


def check_chunk_size(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    return chunk_size


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def check_triton_precision(precision: str | None) -> str:
    """The triton backend's tl.dot input precision for float32 tiles: `precision`, else the
    environment variable MIRAS_TRITON_PRECISION (unset or empty: DEFAULT_TRITON_PRECISION, "tf32",
    fla's choice). Either must be one of TRITON_PRECISIONS; the error names which one was read."""
    where = "triton_precision"
    if precision is None:
        where = f"the environment variable {TRITON_PRECISION_ENV}"
        precision = os.environ.get(TRITON_PRECISION_ENV) or DEFAULT_TRITON_PRECISION
    if not isinstance(precision, str) or precision not in TRITON_PRECISIONS:
        hint = did_you_mean(str(precision).lower(), TRITON_PRECISIONS)
        raise ValueError(
            f"{where}: expected one of {', '.join(repr(p) for p in TRITON_PRECISIONS)} (ieee: "
            f"float32 products; tf32: TF32 tensor cores, 10-bit mantissa; tf32x3: three TF32 "
            f"products, about float32's accuracy), got {precision!r}{hint}"
        )
    return precision


def check_cu_seqlens(cu_seqlens, shapes: Shapes) -> list[int]:
    """fla's packed layout: `cu_seqlens` [N + 1], integer, 0 = c_0 < c_1 < ... < c_N = T, with
    B = 1; sequence i is tokens c_i .. c_{i+1} - 1. Returns the boundaries as ints."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            f"cu_seqlens: expected an integer tensor [N + 1], got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected one axis of N + 1 >= 2 boundaries, got shape "
            f"{list(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
        raise ValueError(f"cu_seqlens: expected an integer dtype, got {_name(cu_seqlens.dtype)}")
    if shapes.batch != 1:
        raise ValueError(
            f"cu_seqlens: packed sequences need B = 1 (the sequences concatenated along T), "
            f"got B = {shapes.batch}"
        )
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != shapes.length:
        raise ValueError(
            f"cu_seqlens: expected to start at 0 and end at T = {shapes.length}, got "
            f"{bounds[0]} .. {bounds[-1]}"
        )
    if any(b <= a for a, b in pairwise(bounds)):
        raise ValueError(
            f"cu_seqlens: expected strictly increasing boundaries (no empty sequence), got {bounds}"
        )
    return bounds
