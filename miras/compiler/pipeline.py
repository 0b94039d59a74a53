"""The compiler: a spec becomes a derived, checked `CompiledRule` (miras.ir), as a list of
named passes.

    resolve -> bias_gradient -> retention_step -> plan -> linear_step -> chunk_form -> emit
    -> triton -> check

Each pass reads and fills one `CompiledRule`; an invariant is checked after each, and
`MIRAS_DEBUG=1` prints what every pass produced. A pass reads what the passes before it
derived and never derives it again; the derivations themselves (a bias's gradient, a
retention's step, a slope, a linear step) are cached by the component's canonical form
(`miras.derive.memo`), shared with validation and with every spec that has an equal
component. Results are cached by the spec's digest; `check` is a pass on the cached rule,
run once. The compiler never imports the runtime: `miras.rule.MemoryRule` joins the two.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

from miras.compiler.dual_form import dual_reason
from miras.compiler.minimizer import minimizer_form
from miras.compiler.plan import make_plan
from miras.compiler.triton_kernels import compiled_source, emit_kernels
from miras.derive.affine import analyze
from miras.derive.bias_check import check_bias
from miras.derive.bias_derive import derive_bias
from miras.derive.emit import function_source, load_module, module_source
from miras.derive.linear_step import derive_linear_step
from miras.derive.precondition_check import check_precondition
from miras.derive.retention_check import check_retention
from miras.derive.retention_derive import derive_retention
from miras.derive.symbols import channels, e, gate_symbol, u, v, w0
from miras.errors import DerivationError
from miras.ir import CompiledRule
from miras.spec import Spec, load_spec

# Passes ------------------------------------------------------------------------------------


def resolve(c: CompiledRule[Spec]) -> str:
    """Components are typed by the spec already; report what was picked."""
    s = c.spec
    return (
        "\n".join(
            f"{name:12s} {getattr(s, name).kind} {getattr(s, name).parameters()}"
            for name in ("memory", "feature_map", "bias", "retention", "optimizer")
        )
        + f"\nwindow       c={s.window.c} gamma={s.window.gamma}"
    )


def bias_gradient(c: CompiledRule[Spec]) -> str:
    c.bias = derive_bias(c.spec.bias)
    sums = {s for s, _ in c.bias.sums}
    allowed = {e, v, channels, *sums, *(gate_symbol(g) for g in c.spec.bias.scalars())}
    stray = c.bias.gradient.free_symbols - allowed
    _invariant(not stray, f"bias gradient has unexpected symbols {sorted(map(str, stray))}")
    return c.bias.text()


def retention_step(c: CompiledRule[Spec]) -> str:
    c.retention = derive_retention(c.spec.retention)
    allowed = {w0, u, *(gate_symbol(g) for g in c.spec.retention.scalars())}
    stray = c.retention.step.free_symbols - allowed
    _invariant(not stray, f"retention step has unexpected symbols {sorted(map(str, stray))}")
    return c.retention.text()


def plan(c: CompiledRule[Spec]) -> str:
    c.plan = make_plan(c.spec)
    return c.plan.text()


def linear_step(c: CompiledRule[Spec]) -> str:
    """The whole step, where it is linear in the memory state and the gradient, as one
    `LinearStep` (`miras.derive.linear_step`): what every fast form unrolls."""
    step, why = derive_linear_step(c.spec, c.retention)
    c.plan = replace(c.plan, linear_step=step)
    return step.text() if step is not None else f"no linear step: {why}"


def chunk_form(c: CompiledRule[Spec]) -> str:
    """Exact chunks where the step is affine in the memory, chunk-start otherwise, in its dual
    form where `dual_reason` finds one."""
    step = c.plan.linear_step
    form = minimizer_form(c.spec, c.bias) or analyze(c.spec, c.bias, step, c.retention)
    dual = dual_reason(c.spec, step)
    if form.form == "start" and dual is not None:
        form = replace(form, form="dual", dual=dual)
    c.plan = replace(c.plan, chunk_form=form)
    return c.plan.chunk_form.text()


def _extra_functions(spec: Spec) -> list[str]:
    """The functions of x the memory and the feature map ask for (`emitted_functions`): an
    activation and its derivative (MLP memories), a custom feature map's phi."""
    return [
        function_source(name, ["x"], formula, doc=doc)
        for component in (spec.memory, spec.feature_map)
        for name, formula, doc in component.emitted_functions()
    ]


def emit(c: CompiledRule[Spec]) -> str:
    header = f"Emitted by miras for spec '{c.spec.name}' ({c.spec.digest()[:12]}). Do not edit."
    pieces = [c.bias.source, c.retention.source, *_extra_functions(c.spec)]
    c.source = module_source(header, pieces)
    c.functions = load_module(c.source)
    for name in ("bias_loss", "bias_grad", "retention_step", "retention_read"):
        _invariant(callable(getattr(c.functions, name, None)), f"emitted module lacks {name}()")
    return c.source


def triton(c: CompiledRule[Spec]) -> str:
    """The Triton kernel module, printed from the derived pieces, the linear step and the
    gate plan (`miras.compiler.triton_kernels.emit_kernels`), or why the kernels do not cover
    the rule; the runtime writes and imports it on the triton backend's first run."""
    c.triton_source, c.triton_refusal = emit_kernels(c)
    _invariant(
        (c.triton_source is None) != (c.triton_refusal is None),
        "the triton pass gives either kernels or a reason",
    )
    if c.triton_source is None:
        return f"not covered: {c.triton_refusal}"
    linear = "def linear_state(" in c.triton_source
    return "kernels: general" + (" and linear" if linear else "") + ", forward and backward"


def check(c: CompiledRule[Spec]) -> str:
    import torch

    # The checks differentiate (autograd against the derived pieces): also when the rule is
    # first compiled under a caller's torch.no_grad() or inference_mode.
    with torch.inference_mode(False), torch.enable_grad():
        c.checks = check_bias(c.spec.bias, c.bias) + check_retention(c.spec.retention, c.retention)
        c.checks += check_precondition(c.spec, c.plan, c.functions)
    failed = [r for r in c.checks if not r.passed]
    if failed:
        lines = [
            f"{r.piece}: error {r.error:.3g} > {r.tolerance:.3g}"
            if math.isfinite(r.error)
            else f"{r.piece}: not finite (error {r.error})"
            for r in failed
        ]
        raise DerivationError(
            f"spec '{c.spec.name}': a derived piece disagrees with its reference:\n  "
            + "\n  ".join(lines)
        )
    return "\n".join(f"{r.piece}: {r.error:.3g} <= {r.tolerance:.3g}" for r in c.checks)


PASSES: list[tuple[str, Callable[[CompiledRule[Spec]], str]]] = [
    ("resolve", resolve),
    ("bias_gradient", bias_gradient),
    ("retention_step", retention_step),
    ("plan", plan),
    ("linear_step", linear_step),
    ("chunk_form", chunk_form),
    ("emit", emit),
    ("triton", triton),
    ("check", check),
]


def _invariant(ok: bool, message: str) -> None:
    if not ok:
        raise DerivationError(f"compiler invariant broken: {message}")


def run_passes(spec: Spec, *, checked: bool = True) -> CompiledRule[Spec]:
    """Every pass on a new `CompiledRule` (the check pass only when `checked`)."""
    c = CompiledRule(spec)
    for name, run_pass in PASSES:
        if name == "check" and not checked:
            continue
        _run(name, run_pass, c)
    return c


def _run(name: str, run_pass: Callable[[CompiledRule[Spec]], str], c: CompiledRule[Spec]) -> None:
    report = run_pass(c)
    if os.environ.get("MIRAS_DEBUG", "") not in ("", "0"):
        print(f"=== pass {name} ===\n{report}\n", file=sys.stderr)


def check_rule(c: CompiledRule[Spec]) -> CompiledRule[Spec]:
    """`c` with the check pass run: a copy of it with its `checks` (its derived pieces, plan
    and emitted module are shared, not derived again); `c` itself when it is checked already."""
    if c.checks:
        return c
    checked = replace(c, checks=[])
    _run("check", check, checked)
    return checked


# The cache: rule digest -> what the passes produced. The digest leaves out `model` and
# `description` (they do not change the rule), so specs that differ only there share one
# derivation; `miras.rule.compile` gives each its own spec. A cached rule is used for a spec
# whose components are of the same classes (a kind registered anew is another component).
_CACHE: dict[str, CompiledRule[Spec]] = {}
_LOCK = threading.Lock()
_COMPILING: dict[str, threading.Lock] = {}  # digest -> held while its passes run


def compile_ir(spec: Spec, *, checked: bool = True) -> CompiledRule[Spec]:
    """The passes' result for `spec`, cached by its digest (its `spec` field is the first spec
    compiled with that digest). `checked=False` leaves out the check pass; a later checked
    compile of the same rule runs that pass alone on the cached rule (`check_rule`). Threads
    compiling one rule run its passes once; a failed compile is not cached."""
    key = spec.digest()
    with _LOCK:
        compiling = _COMPILING.setdefault(key, threading.Lock())
    with compiling:
        c = _CACHE.get(key)
        if c is None or _classes(c.spec) != _classes(spec):
            c = run_passes(spec, checked=checked)
        elif checked:
            c = check_rule(c)
        _CACHE[key] = c
    return c


def _classes(spec: Spec) -> tuple[type, ...]:
    return tuple(type(component) for component in spec.components().values())


def _after_fork() -> None:
    global _LOCK, _COMPILING
    _LOCK, _COMPILING = threading.Lock(), {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def kernel_source(spec) -> str:
    """The emitted Triton module of `spec` (a Spec, a path, YAML text, a dict, or a compiled
    rule's `CompiledRule`, `rule.ir`), as text: what `miras kernel SPEC` prints. Compiles
    through the passes (cached, checked), so the printed pieces are the checked derivation's.

    Raises ValueError naming the reason when the kernels do not cover the spec."""
    compiled = spec if isinstance(spec, CompiledRule) else compile_ir(load_spec(spec))
    return compiled_source(compiled)


__all__ = ["PASSES", "check_rule", "compile_ir", "kernel_source", "run_passes"]
