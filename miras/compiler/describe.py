"""The readable derivation `miras derive` prints: components, derived pieces, the step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy as sp

from miras.symbols import gate_symbol, u, w0

if TYPE_CHECKING:
    from miras.compiler.bias import BiasRule
    from miras.compiler.plan import Plan
    from miras.compiler.retention import RetentionRule
    from miras.spec import Spec


@dataclass(frozen=True)
class Derivation:
    """The derived update rule, as text (`str()`) and LaTeX (`.latex`)."""

    text: str
    latex: str

    def __str__(self) -> str:
        return self.text


W_prev = sp.Symbol("W_{t-1}")
U_t = sp.Symbol("u_t")


def _scalar(component, name: str) -> str:
    """`name_t` for a gate, the number for a fixed value."""
    value = getattr(component, name)
    return f"{name}_t" if value == "gate" else f"{value:g}"


def _step_expr(spec: Spec, rule: RetentionRule) -> sp.Expr:
    """The retention step in W_{t-1} and u_t, fixed values substituted."""
    fixed = {gate_symbol(n): sp.nsimplify(x) for n, x in spec.retention.fixed().items()}
    per_token = {gate_symbol(n): sp.Symbol(f"{n}_t") for n in spec.retention.gates()}
    return rule.step.subs(fixed).subs({w0: W_prev, u: U_t, **per_token})


def _update_lines(spec: Spec, rule: RetentionRule) -> list[str]:
    if spec.memory.kind == "nonparametric":
        window = f"t-{spec.memory.window - 1}" if spec.memory.window else "1"
        return [
            f"o_t = sum_{{i={window}..t}} softmax_i(q_t . k_i) v_i",
            "(the closed-form minimizer of the l2 bias: no inner optimization)",
        ]
    opt = spec.optimizer
    lr = _scalar(opt, "lr")
    lines = []
    retention = spec.retention
    if getattr(retention, "grad_at", "state") == "retained":
        lines.append(f"W_e = {_scalar(retention, 'decay')} * W_{{t-1}}    (grad_at: retained)")
    else:
        lines.append("W_e = W_{t-1}")
    c = spec.window.c
    gamma = "gamma_i * " if c > 1 else ""
    window = f"sum_{{i=t-{c - 1}..t}} " if c > 1 else ""
    i = "i" if c > 1 else "t"
    lines.append(f"g_t = {window}{gamma}grad_W L(M_{{W_e}}(phi(k_{i})), v_{i})")
    if spec.memory.kind == "matrix":
        lines.append(f"    = {window}{gamma}dL/dy(W_e phi(k_{i}), v_{i}) phi(k_{i})^T")
    elif spec.memory.kind in ("mlp", "gated_mlp"):
        lines.append("    (the explicit backward through the MLP: dL/dy, then the layers)")
    if opt.kind == "gd":
        lines.append(f"u_t = {lr} * g_t")
    else:
        theta = _scalar(opt, "momentum")
        lines.append(f"S_t = {theta} * S_{{t-1}} + {lr} * g_t")
        lines.append(
            "u_t = S_t" if opt.kind == "momentum" else f"u_t = NewtonSchulz{opt.ns_steps}(S_t)"
        )
    step = _step_expr(spec, rule)
    if retention.kind == "kl":
        lines.append(f"W_t = {retention.scale:g} * softmax_row({step})")
    elif retention.kind == "lq":
        lines.append(f"A_t = {str(step).replace('W_{t-1}', 'A_{t-1}')}")
        lines.append(f"W_t = A_t / ||A_t||_{retention.q:g}^{retention.q - 2:g}")
    else:
        lines.append(f"W_t = {step}")
    lines.append("o_t = M_{W_t}(phi(q_t))")
    return lines


def describe(spec: Spec, bias: BiasRule, retention: RetentionRule, plan: Plan) -> Derivation:
    components = []
    for field in ("memory", "feature_map", "bias", "retention", "optimizer"):
        component = getattr(spec, field)
        params = ", ".join(f"{k}={v}" for k, v in component.parameters().items() if v is not None)
        components.append(f"  {field:12s} {component.kind}" + (f" ({params})" if params else ""))
        components.append(f"  {'':12s} {component.spec_equation()}")  # lq: the spec's q
    components.append(f"  {'window':12s} c = {spec.window.c}, gamma = {spec.window.gamma}")

    def indent(text: str) -> list[str]:
        return ["  " + line for line in text.splitlines()]

    text = [
        f"spec {spec.name}  (digest {spec.digest()[:12]})",
        "",
        "Components",
        *components,
        "",
        "Attentional bias (derived: chain rule through the channel sums)",
        *indent(bias.text()),
        "",
        "Retention (derived: closed-form argmin of the Learning-Retaining objective)",
        *indent(retention.text()),
        "",
        "Update rule, one step t (the exact recurrence; chunk size 1)",
        *indent("\n".join(_update_lines(spec, retention))),
        "",
        "Plan",
        *indent(plan.text()),
    ]
    latex = [
        rf"% spec {spec.name}",
        r"\text{bias: }" + bias.latex().replace("\n", r" \\ "),
        r"\text{retention: }" + retention.latex().replace("\n", r" \\ "),
        r"W_t = " + sp.latex(_step_expr(spec, retention)),
    ]
    return Derivation("\n".join(text), "\n".join(latex))
