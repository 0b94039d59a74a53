"""The Triton emission pass: what the kernels cover, where each gate enters them, the kernel
module of a covered spec, and the provider that hands it to the runtime on first use.

    reason = unsupported_reason(spec)   # None when the kernels cover the spec
    source = kernel_source(spec)        # the module text (what `miras kernel SPEC` prints)
    module = load_kernels(compiled)     # written under the cache by content hash, imported
    kernels = TritonKernels(compiled)   # the runtime's KernelProvider (`Program.kernels`)

Covered: matrix memory, every bias and retention the printer can emit, every optimizer whose
update the compiler proves linear in the gradient and its state (gd, momentum, Nesterov; the
proximal step, as gd with its step size computed in torch), any window and feature map
(applied in torch before the kernels). Not covered, with the reason named: mlp and gated-mlp
memories, Muon, the exact minimizer, a Bregman retention solved by Newton steps, gate names
the kernels reserve, and any expression the printer cannot emit. The printing itself is
`miras.compiler.triton.emit_source`; this module says what to print. The runtime never
imports it: a `Program` carries a `TritonKernels`, which emits and loads the module only when
the triton backend first runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from miras.compiler.emit import load_module
from miras.compiler.linear_step import linear_update
from miras.compiler.pipeline import compile_ir
from miras.compiler.printer import UnsupportedExpression
from miras.compiler.triton import RESERVED, Gates, emit_source
from miras.ir import CompiledRule
from miras.spec import Spec, load_spec
from miras.triton_template import linear_applies


def gate_plan(spec: Spec) -> Gates:
    """Where each gate of `spec` enters the kernels, and the literal values of the scalars
    that are not gates. The optimizer's are the gates its proved linear update reads
    (`linear_update`), in the order the optimizer declares them."""
    opt = spec.optimizer
    step, _ = linear_update(spec)
    read = step.gate_names("optimizer") if step is not None else ()
    scalars = {"gamma": spec.window.gamma}
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
    window = bias + (("gamma",) if spec.window.gamma == "gate" else ())
    optimizer = tuple(n for n in opt.gateable if n in read and n not in fixed)
    return Gates(window, optimizer + retention, bias, retention, fixed)


def unsupported_reason(spec: Spec) -> str | None:
    """Why the Triton kernels do not cover `spec`, or None when they do."""
    if not spec.memory.linear:
        return f"{spec.memory.kind} memory (the kernels cover matrix memory only)"
    if spec.optimizer.solves_exactly:
        kind = spec.optimizer.kind
        return f"the {kind} optimizer (the kernels take gradient steps; its solve is in torch)"
    if spec.window.is_global:
        return "window: global (the kernels take a fixed window c; the whole prefix grows per call)"
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


# The kernels of a spec -------------------------------------------------------------------------

_SOURCES: dict[str, str] = {}


def kernel_source(spec) -> str:
    """The emitted Triton module of `spec` (a Spec, a path, YAML text, a dict, or a compiled
    rule's `CompiledRule`, `rule.ir`), as text: what `miras kernel SPEC` prints. Derives
    through the compiler (cached, checked), so the printed pieces are the checked derivation's.

    Raises ValueError naming the reason when the kernels do not cover the spec."""
    compiled = spec if isinstance(spec, CompiledRule) else None
    spec = compiled.spec if compiled is not None else load_spec(spec)
    key = spec.digest()
    if key in _SOURCES:
        return _SOURCES[key]
    advice = "use backend='chunk' (parallel) or 'recurrent' (the exact reference)"
    reason = unsupported_reason(spec)
    if reason is not None:
        raise ValueError(f"spec '{spec.name}': the Triton kernels do not cover {reason}; {advice}")
    compiled = compiled or compile_ir(spec)
    try:
        _SOURCES[key] = emit_source(
            spec, compiled.bias, compiled.retention, gate_plan(spec), linear_applies(compiled)
        )
    except UnsupportedExpression as err:
        raise ValueError(
            f"spec '{spec.name}': the Triton kernels do not cover it: {err}; {advice}"
        ) from None
    return _SOURCES[key]


def load_kernels(spec) -> ModuleType:
    """The emitted module of `spec` (as for `kernel_source`), written under the cache
    ($MIRAS_CACHE_DIR/triton/<content hash>.py) and imported from there."""
    return load_module(kernel_source(spec), kind="triton")


@dataclass(frozen=True)
class TritonKernels:
    """The Triton kernels of `compiled`, as a `miras.runtime.program.KernelProvider`: the
    coverage answer and the gate plan from its spec, and its kernel module, emitted and
    loaded on the first `module()` call (cached by content hash)."""

    compiled: CompiledRule

    def refusal(self) -> str | None:
        return unsupported_reason(self.compiled.spec)

    def gate_plan(self) -> Gates:
        return gate_plan(self.compiled.spec)

    def module(self) -> ModuleType:
        return load_kernels(self.compiled)


__all__ = [
    "TritonKernels",
    "gate_plan",
    "kernel_source",
    "linear_applies",
    "load_kernels",
    "unsupported_reason",
]
