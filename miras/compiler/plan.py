"""The plan pass: state layout, gates and the chunk schedule a spec implies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miras.components.base import POSITIVE, Range
from miras.spec import Spec


@dataclass(frozen=True)
class GateInfo:
    name: str
    component: str  # the spec field it belongs to
    allowed: Range

    def __str__(self) -> str:
        return f"{self.name} ({self.component}) in {self.allowed}: [B, T, H] or [B, T, H, Dv]"


@dataclass(frozen=True)
class ChunkForm:
    """How `backend="chunk"` runs a spec at chunk size b > 1 (docs/chunking.md), decided by the
    affine analysis (`miras.compiler.affine`):

    - "exact": every step is affine in the memory state, so each chunk is solved exactly (a
      unit-lower-triangular system per chunk); equal to the recurrence at any b;
    - "start": inside a chunk every gradient is taken at the chunk-start state (Titans 3.2).

    `slope` is d2L/dy2 when the analysis proved it a constant (l2: 1, dot: 0), else None (it
    reads gates, or v when `slope_reads_v`); the exact form evaluates it from `bias_grad`."""

    form: Literal["exact", "start"]
    reason: str
    slope: float | None = None
    slope_reads_v: bool = False

    def text(self) -> str:
        if self.form == "exact":
            return f"chunk: exact ({self.reason})"
        return f"chunk: chunk-start approximation (Titans section 3.2), because {self.reason}"


@dataclass(frozen=True)
class Plan:
    state: tuple[str, ...]  # named state tensors and their shapes, symbolically
    gates: tuple[GateInfo, ...]
    schedule: str
    chunk_form: ChunkForm | None = None  # set by the compiler's chunk_form pass

    def text(self) -> str:
        lines = ["state:", *(f"  {s}" for s in self.state), "gates:"]
        lines += [f"  {g}" for g in self.gates] or ["  (none)"]
        lines += ["schedule:", f"  {self.schedule}"]
        if self.chunk_form is not None:
            lines.append(f"  {self.chunk_form.text()}")
        return "\n".join(lines)


def _memory_state(spec: Spec) -> list[str]:
    memory = spec.memory
    if memory.kind == "nonparametric":
        window = f"last {memory.window}" if memory.window else "all"
        return [f"keys and values of the {window} past tokens (a KV cache)"]
    if memory.kind == "matrix":
        name = "A (accumulator; W = A/||A||_q^(q-2))" if spec.retention.kind == "lq" else "W"
        return [f"{name}: [B, H, Dv, Dphi] float32 (float64 for float64 inputs)"]
    # Nominal widths Dphi = 100, Dv = 1000, so that hidden widths read as factors of Dphi.
    shapes = memory.parameter_shapes(d_in=100, d_out=1000)
    return [
        f"{name}: [B, H, {', '.join(_width(n) for n in shape)}] float32"
        for name, shape in shapes.items()
    ]


def _width(n: int) -> str:
    return {100: "Dphi", 1000: "Dv"}.get(n, f"{n / 100:g} Dphi")


def make_plan(spec: Spec) -> Plan:
    state = _memory_state(spec)
    if spec.optimizer.kind in ("momentum", "muon"):
        state.append("S (momentum): same shapes as the memory")
    gates = []
    # Softmax attention has no inner step for a gate to scale (Spec.gates() is empty too).
    fields = () if spec.memory.kind == "nonparametric" else ("bias", "retention", "optimizer")
    for field in fields:
        component = getattr(spec, field)
        for name in component.gates():
            allowed = component.gateable.get(name, POSITIVE)
            gates.append(GateInfo(name, field, allowed))
    if spec.window.gamma == "gate" and fields:
        gates.append(GateInfo("gamma", "window", POSITIVE))
    if spec.memory.kind == "nonparametric":
        schedule = "closed form: causal softmax attention (no inner optimization)"
    else:
        schedule = "chunked: chunks of b tokens (chunk_size); b = 1 is the exact recurrence"
    return Plan(tuple(state), tuple(gates), schedule)
