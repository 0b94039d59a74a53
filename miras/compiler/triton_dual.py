"""Emission of the dual form's Triton kernel for a deep (MLP) memory.

    reason = dual_refusal(spec)                  # None when the dual kernel covers the spec
    source = emit_dual_source(spec, bias)        # the module text

The module holds the spec's structure as constants (`RETAINED`, `MOMENTUM`), the spec's
elementwise pieces printed by the strict `TritonPrinter` as `@triton.jit` functions (the bias
gradient, the same function the matrix kernels print; the memory's activation and its derivative,
derived by sympy), then the template `miras.kernels.templates.dual.FORWARD` as it stands.

Covered: an `mlp` memory of depth 2 without MIRAS's residual `x + LN(...)`, in the dual form
(`miras.compiler.dual_form.dual_reason`: retention none or l2, a linear optimizer), window c = 1,
a bias whose gradient the printer emits and that has no gates of its own. The backward is the
torch dual form's, recomputed (`miras.runtime.dual_triton`).
"""

from __future__ import annotations

from miras.compiler.triton import _bias_pieces, _jit
from miras.derive.printer import UnsupportedExpression
from miras.derive.triton_printer import triton_code
from miras.ir import BiasRule
from miras.kernels.templates import dual
from miras.spec import Spec

COVERED = (
    "memory mlp of depth 2 without residual_norm, window c = 1, a bias without gates, "
    "retention none or l2 and a linear optimizer (the dual form)"
)

IMPORTS = """import triton
import triton.language as tl

from miras.kernels.common.io import add_rows, load_rows, store_rows
from miras.kernels.common.math import (
    acosh, asinh, atanh, cosh, expm1, hypot, log1p, logaddexp, sign, sinh, soft_threshold,
    softplus, tanh,
)"""


def dual_refusal(spec: Spec) -> str | None:
    """Why the dual kernel does not cover `spec` (a memory that is not a matrix), naming the
    field and what is covered; None when it does."""
    from miras.compiler.dual_form import dual_reason
    from miras.derive.linear_step import linear_update

    memory = spec.memory
    covered = f"the Triton kernels cover matrix memory, and {COVERED}"
    if memory.kind != "mlp":
        return f"{memory.kind} memory ({covered})"
    if memory.depth != 2:
        return f"mlp memory of depth {memory.depth} (memory.depth; {covered})"
    if memory.residual_field() is not None:
        return f"mlp memory with residual_norm (memory.residual_norm; {covered})"
    step, why = linear_update(spec)
    if step is None:
        fields = f"retention {spec.retention.kind}, optimizer {spec.optimizer.kind}"
        return f"an mlp memory outside the dual form ({fields}: {why}; {covered})"
    if spec.window.is_global:
        return f"window: global (window; {covered})"
    if dual_reason(spec, step) is None:  # whatever else the dual form comes to refuse
        return f"an mlp memory outside the dual form ({covered})"
    if spec.window.c != 1:
        return f"window c = {spec.window.c} (window; {covered})"
    if tuple(spec.bias.gates()):
        return f"{spec.bias.label()} with gates {list(spec.bias.gates())} (bias; {covered})"
    return None


def emit_dual_source(spec: Spec, bias: BiasRule) -> str:
    """The dual kernel module of a covered spec. Raises UnsupportedExpression for a piece the
    printer cannot emit."""
    from miras.derive.linear_step import linear_update

    step, _ = linear_update(spec)
    if step is None:  # dual_refusal's reason; kept here so the module is never half emitted
        raise UnsupportedExpression("the dual kernel runs a linear step")
    retained = spec.retention.retained_factor() is not None
    constants = [
        f"MOMENTUM = tl.constexpr({step.stateful})  # an optimizer state S beside each weight",
        f"RETAINED = tl.constexpr({retained})  # grad_at: retained (gradients at D_t W_S)",
    ]
    functions = []
    for name, formula, doc in _activation_functions(spec):
        functions.append(_jit(name, ["x"], doc, [], triton_code(formula)))
    # bias_grad(e, v, cmask) and bias_vjp(e, v, cmask, _up): the matrix kernels' own.
    bias_pieces = _bias_pieces(bias, spec)
    header = (
        f"# The dual form's Triton kernel emitted by miras for spec '{spec.name}'. Do not edit.\n"
        f"# memory {spec.memory.kind} (depth {spec.memory.depth}, activation "
        f"{spec.memory.activation}), bias {spec.bias.kind}, retention {spec.retention.kind}, "
        f"optimizer {spec.optimizer.kind}."
    )
    sections = [
        header, IMPORTS, "\n".join(constants), *functions, *bias_pieces,
        dual.FORWARD.strip(), dual.BACKWARD.strip(),
    ]  # fmt: skip
    return "\n\n\n".join(sections) + "\n"


def _activation_functions(spec: Spec) -> list[tuple[str, object, str]]:
    """The memory's activation and its derivative (the component's), and the second derivative
    the backward's hidden error needs (e1 = g1 act'(z1)), derived here. relu's is zero: sympy's
    DiracDelta, zero wherever the kernel evaluates it but at z1 = 0 exactly, where the torch
    dual form's autograd takes relu's derivative as a constant too."""
    import sympy as sp

    from miras.derive.symbols import x

    pieces = list(spec.memory.emitted_functions())  # activation, activation_grad
    ((_, grad, doc),) = [p for p in pieces if p[0] == "activation_grad"]
    second = sp.diff(grad, x).replace(sp.DiracDelta, lambda *_: sp.S.Zero)
    return [*pieces, ("activation_grad2", sp.simplify(second), f"d/dx of {doc}")]
