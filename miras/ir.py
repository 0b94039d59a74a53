"""The compiled rule as plain data: what the compiler produces and the runtime consumes.

    spec --compiler passes--> CompiledRule --> runtime (and the MemoryRule facade, miras.rule)

A leaf module: it imports nothing from `miras.compiler` or `miras.runtime`, so both import it
(docs/architecture.md, "The IR"). Sympy expressions are held as values; nothing here needs
sympy or torch to be imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from miras.derive.protocols import GateDefaults

if TYPE_CHECKING:
    import sympy as sp

    from miras.derive.check import CheckResult
    from miras.derive.ranges import Range

# The spec a CompiledRule was compiled from (`miras.spec.Spec`, as the compiler's passes, the
# facade and the runtime name it: `CompiledRule[Spec]`). The IR does not name it itself: the
# spec's components call the analyses that build these records, so the spec imports (through
# them) this module, and this module imports nothing of the spec layer, not even for annotations.
SpecT = TypeVar("SpecT")

# Plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateInfo:
    """A gate the rule takes per token: its name, the spec field it belongs to, its range, what
    its component declares for the code outside (`defaults`: a layer's start and ceiling, the
    probes' candidates), and its role where it has one: "step_size", the optimizer's
    `step_size_gate` (b_t, which scales the gradient), or "decay", the retention's
    `decay_gate` (a_t of W_t = a_t W_{t-1} - u_t)."""

    name: str
    component: str  # the spec field it belongs to
    allowed: Range
    defaults: GateDefaults = field(default_factory=GateDefaults)
    role: Literal["step_size", "decay"] | None = None
    # The channel axis it may carry besides the head: "value" ([B, T, H, Dv]) or "key"
    # ([B, T, H, Dphi]: the component's `key_channel_gates`, which scale W's columns).
    channels: Literal["value", "key"] = "value"

    def __str__(self) -> str:
        axis = "Dk" if self.channels == "key" else "Dv"
        return f"{self.name} ({self.component}) in {self.allowed}: [B, T, H] or [B, T, H, {axis}]"


@dataclass(frozen=True)
class ChunkForm:
    """How `backend="chunk"` runs a spec at chunk size b > 1 (docs/chunking.md), decided by the
    affine analysis (`miras.derive.affine`):

    - "exact": every step is affine in the memory state, so each chunk is solved exactly (a
      unit-lower-triangular system per chunk); equal to the recurrence at any b;
    - "start": inside a chunk every gradient is taken at the chunk-start state (Titans 3.2);
    - "dual": the same chunk-start semantics for an MLP memory whose retention and optimizer
      are linear, run in its dual form (`miras.runtime.dual`: no per-token weights); `dual`
      says why it applies, `reason` (as for "start") why the chunk is not exact;
    - "minimizer": the optimizer solves the whole quadratic objective (exact): the state is its
      sufficient statistics, accumulated per chunk by masked matmuls, and every read solves
      the normal equations (`miras.runtime.exact_minimizer`); equal to the recurrence at any b.

    `slope` is d2L/dy2 when the analysis proved it a constant (l2: 1, dot: 0), else None (it
    reads gates, or v when `slope_reads_v`); the exact form evaluates it from `bias_grad`.

    `start_path` is how the chunk-start form runs, whether chosen here or asked for with
    `chunk_mode="start"`: "linear" where the memory, the retention step and the optimizer
    update are all linear (`miras.runtime.linear`: masked matmuls), else "general"
    (`miras.runtime.chunk`: per-token maps over batched gradients)."""

    form: Literal["exact", "start", "dual", "minimizer"]
    reason: str
    slope: float | None = None
    slope_reads_v: bool = False
    start_path: Literal["linear", "general"] = "general"
    dual: str = ""

    def text(self) -> str:
        if self.form == "exact":
            return f"chunk: exact ({self.reason})"
        if self.form == "minimizer":
            return f"chunk: the exact minimizer, statistics per chunk ({self.reason})"
        if self.form == "dual":
            return (
                f"chunk: dual form ({self.dual}) of the chunk-start approximation (Titans "
                f"section 3.2), because {self.reason}"
            )
        return f"chunk: chunk-start approximation (Titans section 3.2), because {self.reason}"


@dataclass(frozen=True)
class ImplicitStep:
    """An implicit optimizer step (proximal) in closed form: every form runs the explicit
    step with the gate `gate` replaced, per token, by the optimizer's `step_size(lr_t, c_t)`,
    c_t = slope gamma_t ||phi(k_t)||^2 (the loss's curvature along its gradient on a matrix
    memory; `slope` = d2L/dy^2 of the bias, a constant; gamma_t the window's weight, c = 1)."""

    gate: str
    slope: float

    def text(self) -> str:
        return (
            f"implicit step: {self.gate}_t -> {self.gate}_t / (1 + {self.gate}_t * {self.slope:g} "
            "* ||phi(k_t)||^2) before the form runs (the proximal step's closed form)"
        )


@dataclass(frozen=True)
class Precondition:
    """A diagonal preconditioner over the key channels (optimizer preconditioned): before any
    form runs, the runtime sums the curvature c_t = slope gamma_t phi(k_t)^2 per key channel
    (the diagonal of the token loss's Hessian in W's columns on a matrix memory; `slope` =
    d2L/dy^2 of the bias, a constant) into the optimizer's state A_t, and replaces the gate
    `gate` by gate_t M(A_t), one per key channel, which every form then runs as gd's step."""

    gate: str
    slope: float

    def text(self) -> str:
        return (
            f"preconditioner: A_t sums {self.slope:g} * gamma_t phi(k_t)^2 per key channel, "
            f"{self.gate}_t -> {self.gate}_t M(A_t) per key channel before the form runs"
        )


@dataclass(frozen=True)
class Coefficient:
    """A coefficient of the linear step: `constant` times the product of `gates`, each a
    (spec field, gate name) pair, e.g. (("optimizer", "lr"),). A gate fixed in the spec is
    read as its value, so the record does not change when a gate is fixed."""

    constant: float
    gates: tuple[tuple[str, str], ...] = ()

    @property
    def is_one(self) -> bool:
        return self.constant == 1.0 and not self.gates

    @property
    def is_zero(self) -> bool:
        return self.constant == 0.0

    def text(self) -> str:
        names = [f"{name}_t" for _, name in self.gates]
        if not names or self.constant != 1.0:
            names.insert(0, f"{self.constant:g}")
        return " ".join(names)


@dataclass(frozen=True)
class LinearStep:
    """The whole step where the compiler proved it linear in the memory state and the gradient
    (`miras.derive.linear_step`, from the retention's derived step and the optimizer's
    `update_expressions`):

        W_t = a_t W_{t-1} - u_t,   u_t = p_t S_t + q_t g_t,   S_t = theta_t S_{t-1} + beta_t g_t

    `decay` a_t, `from_state` p_t, `from_gradient` q_t; `state_decay` theta_t and
    `state_input` beta_t (None, and p_t None, without an optimizer state). gd: u_t = lr_t g_t;
    momentum: p = 1, q = 0, theta the momentum gate, beta lr; Nesterov: p = theta, q = lr.
    Every fast form unrolls these two recurrences as decay matrices."""

    decay: Coefficient
    from_gradient: Coefficient
    from_state: Coefficient | None = None
    state_decay: Coefficient | None = None
    state_input: Coefficient | None = None

    @property
    def stateful(self) -> bool:
        return self.state_decay is not None

    @property
    def shape(self) -> Literal["step", "momentum", "general"]:
        """The update's shape, a name for people (`Optimizer.linear_form`): "step", u_t = q_t g_t
        with no state; "momentum", u_t = S_t (p = 1, q = 0); "general", any other (Nesterov's).
        Every fast form runs all three from the coefficients."""
        if not self.stateful:
            return "step"
        if self.from_state is not None and self.from_state.is_one and self.from_gradient.is_zero:
            return "momentum"
        return "general"

    def gate_names(self, field: str) -> tuple[str, ...]:
        """The gates of spec field `field` the coefficients read, in order, once each."""
        names: list[str] = []
        for coefficient in self.coefficients():
            names += [n for f, n in coefficient.gates if f == field and n not in names]
        return tuple(names)

    def coefficients(self) -> tuple[Coefficient, ...]:
        pieces = (self.decay, self.from_gradient, self.from_state, self.state_decay)
        return tuple(c for c in (*pieces, self.state_input) if c is not None)

    def text(self) -> str:
        lines = [f"linear step: W_t = ({self.decay.text()}) W_(t-1) - u_t"]
        if self.stateful:
            lines.append(
                f"  u_t = ({self.from_state.text()}) S_t + ({self.from_gradient.text()}) g_t, "
                f"S_t = ({self.state_decay.text()}) S_(t-1) + ({self.state_input.text()}) g_t"
            )
        else:
            lines.append(f"  u_t = ({self.from_gradient.text()}) g_t")
        return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    state: tuple[str, ...]  # named state tensors and their shapes, symbolically
    gates: tuple[GateInfo, ...]
    schedule: str
    chunk_form: ChunkForm | None = None  # set by the compiler's chunk_form pass
    implicit_step: ImplicitStep | None = None  # an implicit optimizer's step size map
    linear_step: LinearStep | None = None  # set by the compiler's linear_step pass
    precondition: Precondition | None = None  # a preconditioned optimizer's per-key step size

    def text(self) -> str:
        lines = ["state:", *(f"  {s}" for s in self.state), "gates:"]
        lines += [f"  {g}" for g in self.gates] or ["  (none)"]
        lines += ["schedule:", f"  {self.schedule}"]
        if self.chunk_form is not None:
            lines.append(f"  {self.chunk_form.text()}")
        if self.implicit_step is not None:
            lines.append(f"  {self.implicit_step.text()}")
        if self.precondition is not None:
            lines.append(f"  {self.precondition.text()}")
        return "\n".join(lines)


# Derived pieces --------------------------------------------------------------------------------
# `display` and `display_latex` are the derivation as the compiler renders it (text lines, an
# `aligned` LaTeX block): rendering needs the compiler's printers, reading them does not.


@dataclass(frozen=True)
class BiasRule:
    """The derived bias: loss L, gradient dL/dy, and the torch source of both."""

    kind: str
    loss: sp.Expr  # L with ChannelSum terms
    sums: tuple[tuple[sp.Symbol, sp.Expr], ...]  # (s_i, f_i): the channel sums the gradient reads
    gradient: sp.Expr  # dL/dy_j in e, v, the s_i and gate symbols
    elementwise: bool  # True when the gradient needs no channel sum
    gates: tuple[str, ...]
    # Defines bias_loss(y, v, *gates) -> [..., 1] and bias_grad(y, v, *gates) -> [..., Dv].
    source: str
    display: str = ""
    display_latex: str = ""
    # The gates that may come per value channel, [B, T, H, Dv]: every gate of an elementwise
    # bias (its gradient reads no sum), and of another the gates the loss reads only inside its
    # channel sums' terms, where a gate of channel j meets channel j's term (a LayerNorm's weight
    # and bias). A gate outside the sums (the robust bias's radius) scales a whole-vector
    # quantity: per head only.
    channel_gates: tuple[str, ...] = ()

    def text(self) -> str:
        return self.display

    def latex(self) -> str:
        return self.display_latex


Step = tuple[str, "sp.Basic | str"]


@dataclass(frozen=True)
class RetentionRule:
    """A derived retention: the derivation, the step, and its torch source."""

    kind: str
    steps: tuple[Step, ...]  # the derivation, in order: (label, equation or note)
    # The new state entry in w0, u and gate symbols (fixed values substituted). kl: the logits
    # z of W_t = c softmax(z) over the row; lq: the accumulator's step; bregman with newton:
    # inverse_slope(F'(w0) - u).
    step: sp.Expr
    gates: tuple[str, ...]  # the arguments of retention_step after w0, u
    # Defines retention_step(w0, u, *gates) and retention_read(state); no imports.
    source: str
    display: str = ""
    display_latex: str = ""

    def text(self) -> str:
        """The objective, then one line per step: `label  value`."""
        return self.display

    def latex(self) -> str:
        """The same lines as `text()`, as the rows of an `aligned` environment."""
        return self.display_latex


# The whole compiled rule -----------------------------------------------------------------------


@dataclass
class CompiledRule(Generic[SpecT]):
    """What the compiler's passes produce, in order (`miras.compiler.pipeline.PASSES`): each
    pass fills its fields; `checks` stays empty when compiled with `checked=False`. `spec` is the
    validated spec it was compiled from (`CompiledRule[Spec]`).

    `functions` is the emitted torch module: bias_loss, bias_grad, retention_step,
    retention_read, and activation/activation_grad (MLP memory), feature_map (custom)."""

    spec: SpecT
    bias: BiasRule | None = None
    retention: RetentionRule | None = None
    plan: Plan | None = None  # with the execution form, `plan.chunk_form`
    source: str = ""
    functions: ModuleType | None = None
    checks: list[CheckResult] = field(default_factory=list)
    # The triton pass: the emitted Triton kernel module's text, or why the kernels do not
    # cover the spec (`miras.compiler.triton_kernels.emit_kernels`); exactly one is set.
    triton_source: str | None = None
    triton_refusal: str | None = None


__all__ = [
    "BiasRule",
    "ChunkForm",
    "Coefficient",
    "CompiledRule",
    "GateInfo",
    "ImplicitStep",
    "LinearStep",
    "Plan",
    "RetentionRule",
    "Step",
]
