"""The Triton emission pass: what the kernels cover, where each gate enters them, the kernel
module of a covered rule, and the provider that hands it to the runtime.

    reason = unsupported_reason(spec)           # None when the kernels cover the spec
    source, reason = emit_kernels(compiled)     # the compiler's triton pass (pipeline.PASSES)
    module = load_kernels(compiled)             # written under the cache by content hash, imported
    kernels = TritonKernels(compiled)           # the runtime's KernelProvider (`Program.kernels`)

`miras.compiler.pipeline.kernel_source(spec)` compiles any spec and returns the text (what
`miras kernel SPEC` prints).

Covered: matrix memory, every bias and retention the printer can emit, every optimizer whose
update the compiler proves linear in the gradient and its state (gd, momentum, Nesterov; the
proximal step, as gd with its step size computed in torch), any window and feature map
(applied in torch before the kernels); and an MLP memory of depth 2 in the dual form, window 1
(`miras.compiler.triton_dual`: its forward kernel; the backward recomputes in torch). Not covered,
with the reason named: other deep memories (gated-mlp, other depths, the residual form), Muon, the exact minimizer, the preconditioned optimizer (a step size per key
channel), a Bregman retention solved by Newton steps, gate names
the kernels reserve, and any expression the printer cannot emit. The printing itself is
`miras.compiler.triton.emit_source`; this module says what to print. The runtime never
imports it: a `Program` carries a `TritonKernels`, which writes and imports the module (and
with it Triton) only when the triton backend first runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from miras.compiler.triton import RESERVED, Gates, emit_source
from miras.derive.emit import load_module
from miras.derive.linear_step import linear_update
from miras.derive.printer import UnsupportedExpression
from miras.derive.symbols import ChannelSum, channels
from miras.ir import CompiledRule
from miras.kernels.templates.choice import linear_applies
from miras.spec import Spec


def gate_plan(spec: Spec) -> Gates:
    """Where each gate of `spec` enters the kernels, and the literal values of the scalars
    that are not gates. The optimizer's are the gates its proved linear update reads
    (`linear_update`), in the order the optimizer declares them."""
    opt = spec.optimizer
    step, _ = linear_update(spec)
    read = step.gate_names("optimizer") if step is not None else ()
    weight = spec.window.weight_gate  # gamma_i, read at the window's rows
    scalars = {weight: spec.window.gamma}
    scalars |= {name: getattr(opt, name) for name in opt.gateable if name in read}
    if opt.implicit:
        # An implicit step's step size reaches the kernels as eta_t, per token (computed in
        # torch before any form runs: `miras.runtime.implicit`), so it is a gate even when fixed.
        scalars[step.from_gradient.gates[0][1]] = "gate"
    decay = spec.retention.decay_gate  # the gate a_t of W_t = a_t W_{t-1} - u_t, if any
    if decay is not None:
        scalars[decay] = getattr(spec.retention, decay)
    fixed = {name: float(value) for name, value in scalars.items() if value != "gate"}
    bias = tuple(spec.bias.gates())
    retention = tuple(spec.retention.gates())
    window = bias + tuple(spec.window.gates())
    optimizer = tuple(n for n in opt.gateable if n in read and n not in fixed)
    return Gates(window, optimizer + retention, bias, retention, fixed)


def reads_channel_statistics(loss) -> bool:
    """Whether a bias loss reads the channel count or a channel sum inside another (a mean
    inside a variance: `miras.derive.symbols.channel_gradient`)."""
    return loss.has(channels) or any(s.args[0].has(ChannelSum) for s in loss.atoms(ChannelSum))


def unsupported_reason(spec: Spec) -> str | None:
    """Why the Triton kernels do not cover `spec`, or None when they do."""
    if not spec.memory.linear:
        if not spec.memory.has_gradient_factors():
            return f"{spec.memory.kind} memory (the kernels cover matrix and mlp memory only)"
        from miras.compiler.triton_dual import dual_refusal

        return dual_refusal(spec)
    if spec.optimizer.solves_exactly:
        kind = spec.optimizer.kind
        return f"the {kind} optimizer (the kernels take gradient steps; its solve is in torch)"
    if spec.window.is_global:
        return "window: global (the kernels take a fixed window c; the whole prefix grows per call)"
    if reads_channel_statistics(spec.bias.expression()):
        return (
            f"{spec.bias.label()} (it reads channel statistics, a channel sum inside another or "
            "the channel count Dv, which the kernels' backward does not chain through)"
        )
    if spec.optimizer.preconditioned:
        kind = spec.optimizer.kind
        return (
            f"the {kind} optimizer (its step size per key channel scales W's columns; the "
            "kernels scale rows)"
        )
    step, why = linear_update(spec)
    if step is None:
        kind = spec.optimizer.kind
        return f"the {kind} optimizer (the kernels run updates linear in g_t and S_t: {why})"
    if spec.retention.solved_by_newton():
        return "a Bregman retention solved by Newton steps (solver: newton)"
    clash = sorted(set(gate_plan(spec).order) & RESERVED)
    if clash:
        return f"gate names {clash} (reserved inside the kernels)"
    return None


# The kernels of a compiled rule -----------------------------------------------------------------


def emit_kernels(compiled: CompiledRule[Spec]) -> tuple[str | None, str | None]:
    """The compiler's triton pass: (the emitted module's text, None) where the kernels cover
    the rule, else (None, why not), from its derived pieces and its gate plan."""
    spec = compiled.spec
    reason = unsupported_reason(spec)
    if reason is not None:
        return None, reason
    try:
        if not spec.memory.linear:  # the dual form's kernel (MLP memories)
            from miras.compiler.triton_dual import emit_dual_source

            return emit_dual_source(spec, compiled.bias), None
        source = emit_source(
            spec, compiled.bias, compiled.retention, gate_plan(spec), linear_applies(compiled)
        )
    except UnsupportedExpression as err:
        return None, f"an expression the printer cannot emit ({err})"
    return source, None


ADVICE = "use backend='chunk' (parallel) or 'recurrent' (the exact reference)"


def compiled_source(compiled: CompiledRule[Spec]) -> str:
    """The triton pass's module text of `compiled`. Raises ValueError naming the reason when
    the kernels do not cover it."""
    if compiled.triton_source is None:
        raise ValueError(
            f"spec '{compiled.spec.name}': the Triton kernels do not cover "
            f"{compiled.triton_refusal}; {ADVICE}"
        )
    return compiled.triton_source


def load_kernels(compiled: CompiledRule[Spec]) -> ModuleType:
    """The emitted module of `compiled`, written under the cache
    ($MIRAS_CACHE_DIR/triton/<content hash>.py) and imported from there."""
    return load_module(compiled_source(compiled), kind="triton")


@dataclass(frozen=True)
class TritonKernels:
    """The Triton kernels of `compiled`, as a `miras.runtime.program.KernelProvider`: the
    triton pass's answer and the gate plan from its spec, and its kernel module, written and
    loaded on the first `module()` call (cached by content hash)."""

    compiled: CompiledRule[Spec]

    def refusal(self) -> str | None:
        return self.compiled.triton_refusal

    def gate_plan(self) -> Gates:
        return gate_plan(self.compiled.spec)

    def module(self) -> ModuleType:
        return load_kernels(self.compiled)


__all__ = [
    "TritonKernels",
    "compiled_source",
    "emit_kernels",
    "gate_plan",
    "linear_applies",
    "load_kernels",
    "unsupported_reason",
]
