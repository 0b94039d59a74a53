"""Emission of the Triton chunk kernels of a matrix-memory spec.

    source = emit_source(spec, bias, retention, gates, linear)   # the module text

The Triton backend decides what it covers and where each gate enters the kernels
(`miras.compiler.triton_kernels`: `emit_kernels`, `load_kernels`, `gate_plan`,
`unsupported_reason`); this module prints what it is given.

The module holds, in order: the spec's structure as compile-time constants (window, momentum,
grad_at, decay), the spec's elementwise pieces printed by the strict `TritonPrinter` as
`@triton.jit` functions (the bias gradient and its VJP, the retention step and its VJP, the map
and read around the step; every derivative taken by sympy), then the chunk templates of
`miras.kernels.templates` with the spec's gates and the optimizer's lines (printed from the
compiled linear step: `OptimizerStep`) filled in: `general_forward/backward` always,
`linear_state`, `linear_output` (the forward), `linear_state_backward`, `linear_scores`,
`linear_backward` and `linear_backward_keys` (the backward) when the retention is none or l2
and the update u_t = lr_t g_t.
Every `tl.dot` of the templates states `input_precision=DOT_PRECISION`, a constexpr argument
of each kernel that the launcher passes (the backend's precision choice, docs/kernels.md).

An expression the printer cannot emit raises `UnsupportedExpression`; it never emits half a
kernel. Feature maps are applied before the kernels (in torch, differentiable), so every
feature map is covered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from string import Template

import sympy as sp

from miras.derive.printer import UnsupportedExpression
from miras.derive.retention_emit import NORM_FLOOR
from miras.derive.stabilize import stable_forms
from miras.derive.symbols import ChannelSum, e, gate_symbol, soft_threshold, u, v, w0, y
from miras.derive.triton_printer import CHANNEL_MASK, triton_code
from miras.ir import BiasRule, Coefficient, LinearStep, RetentionRule
from miras.kernels.templates import general, linear
from miras.spec import Spec

# Names a printed function uses for itself (its arguments, the modules and helpers it calls);
# a gate, which becomes an argument of the same function, may not take one.
RESERVED = frozenset(
    {"e", "v", "w0", "u", CHANNEL_MASK, "tl", "triton"}
    | {"sign", "tanh", "cosh", "sinh", "asinh", "softplus", "soft_threshold"}
)

# The templates' variable for the window's weight gamma_i (its gate `Window.weight_gate`).
WEIGHT_VARIABLE = "g_gamma"

# The value of padded state entries, inside each retention domain.
PAD = {"real": 0.0, "positive": 1.0, "unit_interval": 0.5}

UPSTREAM = sp.Symbol("_up", real=True)  # the VJP's incoming gradient
ENTRY = sp.Symbol("a", real=True)  # one entry of l_q's accumulator


@dataclass(frozen=True)
class Gates:
    """Where each gate of a spec enters the kernels. `window` gates are read at the window's
    rows (PAST + T: the bias's and gamma), `step` gates at the tokens' (lr, momentum, the
    retention's), in the kernels' argument order. `fixed` holds the spec's literal values of
    the scalars the templates read (lr, gamma, momentum, decay) that are not gates."""

    window: tuple[str, ...]
    step: tuple[str, ...]
    bias: tuple[str, ...]
    retention: tuple[str, ...]
    fixed: dict[str, float]

    @property
    def order(self) -> tuple[str, ...]:
        return self.window + self.step


# Printed pieces ------------------------------------------------------------------------------


def _jit(name: str, args: list[str], doc: str, lines: list[str], result: str) -> str:
    head = ["@triton.jit", f"def {name}({', '.join(args)}):", f'    """{doc}"""']
    return "\n".join([*head, *(f"    {line}" for line in lines), f"    return {result}"])


def _a_e(derivative: sp.Expr) -> sp.Expr:
    """A derivative almost everywhere, as autograd takes it: sign' = Heaviside' = 0."""
    return derivative.replace(sp.DiracDelta, lambda *args: sp.Integer(0))


def _cse(outputs: list[sp.Expr], prefix: str = "_t") -> tuple[list[str], list[str]]:
    """Assignments of the common subexpressions, and the printed outputs."""
    replacements, reduced = sp.cse(outputs, symbols=sp.numbered_symbols(prefix))
    lines = [f"{sym} = {triton_code(expr)}" for sym, expr in replacements]
    return lines, [triton_code(r) for r in reduced]


def _full(code: str, expr: sp.Expr, like: str) -> str:
    """A printed output that may be a number (a constant derivative): as a full block."""
    return code if expr.free_symbols else f"tl.zeros_like({like}) + {code}"


def _bias_dy(rule: BiasRule, spec: Spec) -> sp.Expr:
    """The bias VJP's gradient in the prediction per unit of `_up` (its channel sums' terms
    included): zero exactly when the bias gradient does not depend on y (dot), where the
    linear backward's state kernel needs no error signals (`CURVED`)."""
    return _bias_vjp_outputs(rule, spec)[0][0]


def _bias_vjp_outputs(rule: BiasRule, spec: Spec):
    """(dy, dv, dg...) of the bias VJP, and what `_bias_pieces` prints them from."""
    fixed = {gate_symbol(n): sp.nsimplify(x) for n, x in spec.bias.fixed().items()}
    sums = [(sp.Symbol(f"_{s.name}", real=True), s) for s, _ in rule.sums]
    rename = {old: new for new, old in sums}
    gradient = rule.gradient.subs(rename).subs(fixed)
    terms = [
        (new, f.subs(y, e + v).subs(fixed))
        for (new, _), (_, f) in zip(sums, rule.sums, strict=True)
    ]
    gates = [gate_symbol(n) for n in rule.gates]
    d_sums = [(sp.Symbol(f"_d{s.name[1:]}", real=True), s) for s, _ in terms]
    dy = UPSTREAM * _a_e(sp.diff(gradient, e))
    dv = UPSTREAM * _a_e(sp.diff(gradient, v) - sp.diff(gradient, e))
    dg = [UPSTREAM * _a_e(sp.diff(gradient, g)) for g in gates]
    for (ds, _), (_, f) in zip(d_sums, terms, strict=True):
        dy += ds * _a_e(sp.diff(f, e))
        dv += ds * _a_e(sp.diff(f, v) - sp.diff(f, e))
        dg = [d + ds * _a_e(sp.diff(f, g)) for d, g in zip(dg, gates, strict=True)]
    return [dy, dv, *dg], gradient, terms, d_sums


def _bias_pieces(rule: BiasRule, spec: Spec) -> list[str]:
    """bias_grad(e, v, cmask, *gates) and bias_vjp(e, v, cmask, *gates, _up) on [BT, BV]
    blocks, the channel axis last. With channel sums s_i = sum_c f_i(e_c, v_c):

        dy   = _up dG/de + sum_i ds_i df_i/de,         ds_i = sum_c _up dG/ds_i
        dv   = _up (dG/dv - dG/de) + sum_i ds_i (df_i/dv - df_i/de)
        dg_k = _up dG/dg_k + sum_i ds_i df_i/dg_k      (y = e + v, so d/dy = d/de)
    """
    outputs, gradient, terms, d_sums = _bias_vjp_outputs(rule, spec)
    args = ["e", "v", CHANNEL_MASK, *rule.gates]
    sum_lines = [f"{s} = {triton_code(ChannelSum(f))}" for s, f in terms]

    lines, (out,) = _cse([gradient])
    forward = _jit(
        "bias_grad",
        args,
        f"dL/dy per channel [BT, BV]: {rule.gradient}",
        sum_lines + lines,
        _full(out, gradient, "e"),
    )

    d_sum_lines = [
        f"{ds} = {triton_code(ChannelSum(UPSTREAM * _a_e(sp.diff(gradient, s))))}"
        for (ds, _), (s, _) in zip(d_sums, terms, strict=True)
    ]
    lines, printed = _cse(outputs)
    result = ", ".join(_full(p, o, "e") for p, o in zip(printed, outputs, strict=True))
    backward = _jit(
        "bias_vjp",
        [*args, str(UPSTREAM)],
        "(dy, dv, d<gate>...) of <_up, bias_grad(y - v, v)>, per channel [BT, BV].",
        sum_lines + d_sum_lines + lines,
        result,
    )
    return [forward, backward]


def _retention_pieces(rule: RetentionRule, spec: Spec) -> list[str]:
    """retention_step(w0, u, *gates) (kl: the logits) and retention_vjp(w0, u, *gates, _up),
    elementwise on [BV, BK] blocks; then the map after the step and the read before reads."""
    gates = [gate_symbol(n) for n in rule.gates]
    args = ["w0", "u", *rule.gates]
    # The step without sympy's cancelling shapes, before the VJP differentiates it: d/dz of
    # asinh(z) is 1/hypot(z, 1), of log(z + sqrt(z**2 + 1)) a quotient that cancels too.
    stable_step = stable_forms(rule.step)
    lines, (out,) = _cse([stable_step])
    simplex = spec.retention.simplex_rows
    what = "the logits z of W = c softmax(z) per row" if simplex else "the new entry"
    step = _jit(
        "retention_step",
        args,
        f"retention {rule.kind}, {what}: {stable_step}",
        lines,
        _full(out, stable_step, "w0"),
    )
    # soft_threshold has no derivative in sympy: differentiate its Piecewise form.
    smooth = stable_step.replace(
        soft_threshold, lambda z, t: soft_threshold(z, t).rewrite(sp.Piecewise)
    )
    outputs = [UPSTREAM * _a_e(sp.diff(smooth, s)) for s in (w0, u, *gates)]
    lines, printed = _cse(outputs)
    result = ", ".join(_full(p, o, "w0") for p, o in zip(printed, outputs, strict=True))
    vjp = _jit(
        "retention_vjp",
        [*args, str(UPSTREAM)],
        "(dw0, du, d<gate>...) of <_up, retention_step(w0, u)>, elementwise.",
        lines,
        result,
    )
    retention = spec.retention
    if simplex:
        scale = repr(float(retention.row_sum()))
        maps = [
            _jit(
                "retention_map",
                ["z", "mask"],
                f"W = {scale} softmax(z) over each row.",
                [],
                f"row_softmax(z, mask, {scale})",
            ),
            _jit(
                "retention_map_vjp",
                ["w", "mask", "dw"],
                "dz of the row softmax.",
                [],
                f"row_softmax_vjp(w, mask, dw, {scale})",
            ),
        ]
    else:
        maps = [
            _jit(
                "retention_map", ["z", "mask"], "The identity: the step is the new state.", [], "z"
            ),
            _jit("retention_map_vjp", ["w", "mask", "dw"], "The identity.", [], "dw"),
        ]
    read_norm = retention.read_norm()
    if read_norm is not None:  # Moneta's read W = A / ||A||_q^(q-2), over the matrix
        q = sp.nsimplify(read_norm)
        power = triton_code(sp.Abs(ENTRY) ** q)
        slope = triton_code(ENTRY * sp.Abs(ENTRY) ** (q - 2))
        consts = f"{float(q)!r}, {NORM_FLOOR!r}"
        reads = [
            _jit(
                "retention_read",
                ["a", "mask"],
                f"W = A / max(||A||_q, {NORM_FLOOR:g})^(q-2), q = {float(q):g}, over the matrix.",
                [],
                f"lq_read(a, mask, {power}, {consts})",
            ),
            _jit(
                "retention_read_vjp",
                ["a", "mask", "dw"],
                "dA of the l_q read.",
                [],
                f"lq_read_vjp(a, mask, {power}, {slope}, dw, {consts})",
            ),
        ]
    else:
        reads = [
            _jit("retention_read", ["a", "mask"], "The identity: reads see the state.", [], "a"),
            _jit("retention_read_vjp", ["a", "mask", "dw"], "The identity.", [], "dw"),
        ]
    return [step, vjp, *maps, *reads]


# The optimizer's lines ------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerStep:
    """The optimizer's half of the compiled `LinearStep` as the templates run it:

        S_t = theta_t S_{t-1} + beta_t G_t,   u_t = p_t S_t + q_t G_t   (u_t = q_t G_t, no state)

    on G_t = sum_j Ghat_j x_j^T, the gradient the block phase has already multiplied by
    `scale`: the one gate (fixed or per token) that every gradient-entry coefficient (q, beta)
    holds once and p, theta do not (lr for gd, momentum and Nesterov; None for a heavy-ball
    step u_t = lr_t S_t). `step` holds the coefficients with `scale` divided out; every line
    the token phase runs, forward and backward, is printed from it (`_optimizer_slots`)."""

    scale: str | None
    step: LinearStep

    @property
    def stateful(self) -> bool:
        return self.step.stateful


def optimizer_step(spec: Spec) -> OptimizerStep:
    """The `OptimizerStep` of `spec`, from the optimizer's half of its linear step
    (`miras.derive.linear_step.linear_update`; any retention: the general template prints
    the retention's derived step). Raises UnsupportedExpression when the update is not linear."""
    from miras.derive.linear_step import linear_update

    step, why = linear_update(spec)
    if step is None:
        raise UnsupportedExpression(f"the kernels run an update linear in g_t and S_t: {why}")
    entries = [c for c in (step.from_gradient, step.state_input) if c is not None and not c.is_zero]
    held = [c for c in (step.from_state, step.state_decay) if c is not None]
    scale = None
    for field, name in entries[0].gates if entries else ():
        once = all(c.gates.count((field, name)) == 1 for c in entries)
        if field == "optimizer" and once and not any((field, name) in c.gates for c in held):
            scale = name
            break
    if scale is not None:
        step = replace(
            step,
            from_gradient=_without(step.from_gradient, scale),
            state_input=step.state_input and _without(step.state_input, scale),
        )
    return OptimizerStep(scale, step)


def _without(c: Coefficient, name: str) -> Coefficient:
    """`c` with one factor of the optimizer gate `name` divided out (a zero stays zero)."""
    if c.is_zero:
        return c
    gates = list(c.gates)
    gates.remove(("optimizer", name))
    return Coefficient(c.constant, tuple(gates))


class _Printer:
    """Products of a coefficient's constant and gates as kernel text: a gate read per token is
    its variable g_<name> ([BV, 1], loaded in the token phase), a fixed one its literal."""

    def __init__(self, gates: Gates):
        self.gates = gates

    def value(self, name: str) -> str:
        return f"g_{name}" if name in self.gates.step else repr(self.gates.fixed[name])

    def factors(self, constant: float, gates) -> list[str]:
        out = [] if constant == 1.0 else [repr(constant)]
        return out + [self.value(name) for _, name in gates]

    def term(self, c: Coefficient | None, var: str) -> str | None:
        """c * var as text; None for a zero coefficient."""
        if c is None or c.is_zero:
            return None
        return " * ".join([*self.factors(c.constant, c.gates), var])

    def total(self, terms: list[str | None], like: str) -> str:
        kept = [t for t in terms if t is not None]
        return " + ".join(kept) if kept else f"tl.zeros_like({like})"

    def derivative(self, c: Coefficient, name: str) -> list[str]:
        """The factors of dc/d(gate name) (a monomial: power times the other factors)."""
        key = ("optimizer", name)
        power = c.gates.count(key)
        rest = list(c.gates)
        rest.remove(key)
        return self.factors(c.constant * power, rest)


def _optimizer_slots(opt: OptimizerStep, gates: Gates) -> Slots:
    """The token phase's optimizer lines, forward and backward, printed from `opt.step`.

    Forward (and the backward's recompute of a chunk's token states), on upd = G_t:
        s = theta s + beta upd;  upd = p s + q upd        (stateless: upd = q upd)
    Backward at token t, on du = dL/du_t and ds = dL/dS_t from the later tokens:
        d_s = ds + p du                   dL/dS_t in all
        d<gate> = sum_k of (du G_t, du S_t, d_s S_{t-1}, d_s G_t) times dq, dp, dtheta, dbeta
        ds = theta d_s;  du = q du + beta d_s   (dL/dS_{t-1}, and dL/dG_t for the block phase)
    A momentum step (p = 1, q = 0, beta = 1) keeps d_s in du, so its lines are the short
    `du = ds + du; ds = theta du`."""
    step, print_ = opt.step, _Printer(gates)
    coefficients = {"q": step.from_gradient}
    if step.stateful:
        coefficients |= {"p": step.from_state, "theta": step.state_decay, "beta": step.state_input}
    token_gates = [
        n for n in gates.step if any(n == g for c in coefficients.values() for _, g in c.gates)
    ]
    clash = [n for n in token_gates if f"g_{n}" == WEIGHT_VARIABLE]
    if clash:
        raise UnsupportedExpression(
            f"optimizer gate names {clash} (the kernels' variable {WEIGHT_VARIABLE}, the window's "
            "weight)"
        )
    load = [
        f"g_{n} = tl.load(g_{n}_ptr + (pid * T + t) * g_{n}_rs + cv * g_{n}_sc, mask=mv, "
        "other=0.0).to(ACC)[:, None]"
        for n in token_gates
    ]
    gated = {
        role: bool(set(c.gates) & {("optimizer", n) for n in gates.step})
        for role, c in coefficients.items()
    }
    momentum_like = (
        step.stateful
        and step.from_state.is_one
        and step.from_gradient.is_zero
        and step.state_input.is_one
    )
    q, term = step.from_gradient, print_.term
    if step.stateful:
        p, theta, beta = step.from_state, step.state_decay, step.state_input
        state = f"s = {print_.total([term(theta, 's'), term(beta, 'upd')], 'upd')}"
        if p.is_one and q.is_zero:
            forward = [state, "upd = s"]
        else:
            forward = [state, f"upd = {print_.total([term(p, 's'), term(q, 'upd')], 'upd')}"]
    else:
        forward = [] if q.is_one else [f"upd = {print_.total([term(q, 'upd')], 'upd')}"]
    # The backward's u_t from the state it loaded (s_p = S_{t-1}) and upd = G_t.
    keep_grad = gated["q"] or gated.get("beta", False)
    restep = ["grad = upd"] if keep_grad else []
    if step.stateful and p.is_one and q.is_zero:
        restep.append(f"upd = {print_.total([term(theta, 's_p'), term(beta, 'upd')], 'upd')}")
    elif step.stateful:
        restep.append(f"s = {print_.total([term(theta, 's_p'), term(beta, 'upd')], 'upd')}")
        restep.append(f"upd = {print_.total([term(p, 's'), term(q, 'upd')], 'upd')}")
    elif not q.is_one:
        restep.append(f"upd = {print_.total([term(q, 'upd')], 'upd')}")
    # d<gate>: the products each coefficient's gradient is the channel sum of.
    d_state = "du" if momentum_like else "d_s"
    products = {
        "q": "du * grad",
        "p": "du * s",
        "theta": f"{d_state} * s_p",
        "beta": f"{d_state} * grad",
    }
    stores = []
    for n in token_gates:
        parts = [
            " * ".join([products[role], *print_.derivative(c, n)])
            for role, c in coefficients.items()
            if ("optimizer", n) in c.gates
        ]
        stores.append(
            f"tl.store(g_{n}_grad + (pid * T + t) * DV + cv, tl.sum({' + '.join(parts)}, axis=1)"
            f".to(g_{n}_grad.dtype.element_ty), mask=mv)"
        )
    if momentum_like:
        backward = ["du = ds + du", *stores, f"ds = {print_.total([term(theta, 'du')], 'du')}"]
    elif step.stateful:
        backward = [
            f"d_s = {print_.total(['ds', term(p, 'du')], 'du')}",
            *stores,
            f"ds = {print_.total([term(theta, 'd_s')], 'du')}",
            f"du = {print_.total([term(q, 'du'), term(beta, 'd_s')], 'du')}",
        ]
    else:
        backward = [*stores, *([] if q.is_one else [f"du = {print_.total([term(q, 'du')], 'du')}"])]
    return {
        "load_optimizer_token": load,
        "optimizer_step": forward,
        "optimizer_restep": restep,
        "optimizer_vjp": backward,
    }


# Template slots ------------------------------------------------------------------------------


# A template slot alone on its line is a block: a list of lines, indented by `_fill` as the slot
# is in the template (an empty block drops the line; a block that must not be empty, the body
# of an `if`, is ["pass"]). A slot inside a line is text.
Slots = dict[str, "list[str] | str"]


def _rows_load(name: str, rows: str, base_rows: str, other: str, into: str | None = None) -> str:
    """`into` (default g_<name>) = the rows of gate `name`'s tensor."""
    into = into or f"g_{name}"
    return (
        f"{into} = load_rows(g_{name}_ptr + pid * {base_rows} * g_{name}_rs, {rows}, mt, cv, mv, "
        f"g_{name}_rs, g_{name}_sc, {other}, ACC)"
    )


def _slots(spec: Spec, gates: Gates, opt: OptimizerStep) -> Slots:
    fixed = gates.fixed
    retained = spec.retention.retained_factor() is not None
    decay_name = spec.retention.decay_gate  # a_t of W_t = a_t W_{t-1} - u_t, if any

    def literal(name: str) -> str:
        return repr(fixed[name])

    if opt.scale is None:
        scale = ["scale = 1.0"]
    elif opt.scale in gates.step:
        scale = [_rows_load(opt.scale, "tok", "T", "0.0", "scale")]
    else:
        scale = [f"scale = {literal(opt.scale)}"]
    window = [_rows_load(n, "wi", "NR", "1.0") for n in gates.bias]
    weight = spec.window.weight_gate  # gamma_i, the templates' g_gamma
    window += (
        [_rows_load(weight, "wi", "NR", "1.0", WEIGHT_VARIABLE)]
        if weight in gates.window
        else [f"{WEIGHT_VARIABLE} = {literal(weight)}"]
    )
    optimizer = _optimizer_slots(opt, gates)
    token = [
        f"g_{n} = tl.load(g_{n}_ptr + (pid * T + t) * g_{n}_rs + cv * g_{n}_sc, mask=mv, "
        "other=1.0).to(ACC)[:, None]"
        for n in gates.retention
    ] + optimizer.pop("load_optimizer_token")
    decay_gated = decay_name is not None and decay_name in gates.step
    if retained:
        decay_block = (
            [_rows_load(decay_name, "tok", "T", "1.0", "decay_blk")]
            if decay_gated
            else [f"decay_blk = tl.zeros([BT, BV], dtype=ACC) + {literal(decay_name)}"]
        )
    else:
        decay_block = []
    has_decay = decay_gated or (decay_name is not None and decay_name in fixed)
    if decay_gated:
        a = decay_name
        decay_vector = [
            f"a = tl.load(g_{a}_ptr + (pid * T + tok) * g_{a}_rs, mask=mt, other=1.0).to(ACC)"
        ]
    elif has_decay:
        decay_vector = [f"a = tl.where(mt, {literal(decay_name)}, 1.0).to(ACC)"]
    else:
        decay_vector = []
    store_token = [
        f"tl.store(g_{n}_grad + (pid * T + t) * DV + cv, tl.sum(tl.where(m2, d_{n}, 0.0), "
        f"axis=1).to(g_{n}_grad.dtype.element_ty), mask=mv)"
        for n in gates.retention
    ]
    retained_decay = (
        [
            f"add_rows(g_{decay_name}_grad + pid * T * DV, tok, mt, cv, mv, DV, "
            "tl.cumsum(d_kept * kept, axis=0, reverse=True) / decay_blk)"
        ]
        if retained and decay_gated
        else []
    )
    return optimizer | {
        "gate_params": [f"g_{n}_ptr, g_{n}_rs, g_{n}_sc," for n in gates.order],
        "gate_grad_params": [f"g_{n}_grad," for n in gates.order],
        "load_scale_block": scale,
        "load_decay_block": decay_block or ["pass"],
        "load_decay_vector": decay_vector or ["pass"],
        "load_window_block": window,
        "bias_args": "".join(f", g_{n}" for n in gates.bias),
        "bias_grads": "".join(f", d_{n}" for n in gates.bias),
        "load_step_token": token,
        "retention_args": "".join(f", g_{n}" for n in gates.retention),
        "retention_grads": "".join(f", d_{n}" for n in gates.retention),
        "store_step_token_grads": store_token,
        "zero_window_grads": [
            f"zero_block(g_{n}_grad + pid * NR * DV, NR, DV, cv, mv, BT)" for n in gates.window
        ],
        "add_gamma_grad": (
            [f"add_rows(g_{weight}_grad + pid * NR * DV, wi, mt, cv, mv, DV, dg * bg)"]
            if weight in gates.window
            else []
        ),
        "add_bias_grads": [
            f"add_rows(g_{n}_grad + pid * NR * DV, wi, mt, cv, mv, DV, d_{n})" for n in gates.bias
        ],
        # The chunk-parallel linear backward: one part per window offset, at the reading token.
        "store_gamma_grad_part": (
            [f"store_rows(g_{weight}_grad + part * T * DV, tok, mt, cv, mv, DV, dg * bg)"]
            if weight in gates.window
            else []
        ),
        "store_bias_grad_parts": [
            f"store_rows(g_{n}_grad + part * T * DV, tok, mt, cv, mv, DV, d_{n})"
            for n in gates.bias
        ],
        "store_scale_grad": (
            [f"store_rows(g_{opt.scale}_grad + pid * T * DV, tok, mt, cv, mv, DV, d_scale)"]
            if opt.scale in gates.step
            else []
        ),
        "add_retained_decay_grad": retained_decay or ["pass"],
        "store_decay_grad": (
            [
                f"store_rows(g_{decay_name}_grad + pid * T * DV, tok, mt, cv, mv, DV, "
                "tl.where(cv[None, :] == iv * BV, d_a[:, None], 0.0))"
            ]
            if decay_gated
            else []
        ),
    }


def _fill(template: str, slots: Slots) -> str:
    """The template with its slots filled: a block slot's lines take the slot line's
    indentation, text slots are substituted within their line."""
    text = {name: value for name, value in slots.items() if isinstance(value, str)}
    out = []
    for line in template.strip("\n").splitlines():
        slot = line.strip()[1:] if line.strip().startswith("$") else None
        block = slots.get(slot)
        if isinstance(block, list):
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + entry for entry in block]
        else:
            out.append(Template(line).substitute(text))
    return "\n".join(out)


# The module ----------------------------------------------------------------------------------

IMPORTS = """import triton
import triton.language as tl

from miras.kernels.common.intra import (
    decay_matrix, decay_matrix_vjp, decay_to_end, log_decay_vjp,
)
from miras.kernels.common.io import add_row, add_rows, load_rows, store_rows, zero_block
from miras.kernels.common.math import (
    acosh, asinh, atanh, cosh, expm1, hypot, log1p, logaddexp, sign, sinh, soft_threshold,
    softplus, tanh,
)
from miras.kernels.common.state import (
    load_tiles, lq_read, lq_read_vjp, row_softmax, row_softmax_vjp, rows_by_tiles, store_tiles,
    tile_plus_rows_t,
)
from miras.kernels.common.tuning import CHUNK, CHUNK_WIDE, PRUNE, configs"""


def _linear_step_ok(rule: RetentionRule, spec: Spec) -> None:
    """The linear template runs W_t = a_t W_{t-1} - u_t: the compiler's proof of the linear
    step (`miras.derive.linear_step`) must hold."""
    from miras.derive.linear_step import derive_linear_step

    step, why = derive_linear_step(spec, rule)
    if step is None:
        raise UnsupportedExpression(
            f"the linear template needs the step a_t w0 - u, the derivation gave {rule.step} ({why})"
        )


def emit_source(
    spec: Spec, bias: BiasRule, retention: RetentionRule, gates: Gates, linear_template: bool
) -> str:
    """The Triton module of a spec the backend covers, with its gates entering the kernels as
    `gates` says; the linear kernels too when `linear_template`. Raises UnsupportedExpression
    for a piece the printer cannot emit."""
    retained = spec.retention.retained_factor() is not None
    opt = optimizer_step(spec)
    decay = spec.retention.decay_gate
    has_decay = decay is not None and (decay in gates.step or decay in gates.fixed)
    constants = [
        f"WINDOW = tl.constexpr({spec.window.c})  # Omega window c",
        f"PAST = tl.constexpr({spec.window.c - 1})  # earlier tokens a window reaches back to",
        f"MOMENTUM = tl.constexpr({opt.stateful})  # an optimizer state S beside W",
        f"RETAINED = tl.constexpr({retained})  # grad_at: retained",
        f"DECAY = tl.constexpr({has_decay})  # an l2 decay (the linear template)",
        f"CURVED = tl.constexpr({not _bias_dy(bias, spec).is_zero})  # dL/dy depends on y",
        f"PAD = tl.constexpr({PAD[spec.retention.domain()]})  # padded state entries: in the domain",
    ]
    pieces = _bias_pieces(bias, spec) + _retention_pieces(retention, spec)
    slots = _slots(spec, gates, opt)
    kernels = [_fill(general.FORWARD, slots), _fill(general.BACKWARD, slots)]
    if linear_template:
        _linear_step_ok(retention, spec)
        kernels += [_fill(linear.FORWARD, slots), _fill(linear.BACKWARD, slots)]
    header = (
        f"# Triton chunk kernels emitted by miras for spec '{spec.name}'. Do not edit.\n"
        f"# bias {spec.bias.kind}, retention {spec.retention.kind}, optimizer "
        f"{spec.optimizer.kind}, window {spec.window.c}; gates in kernel order: "
        f"{', '.join(gates.order) or 'none'}."
    )
    sections = [header, IMPORTS, "\n".join(constants), *pieces, *kernels]
    return "\n\n\n".join(sections) + "\n"
