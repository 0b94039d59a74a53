"""The sympy vocabulary shared by components, the formula parser and the printers.

Elementwise symbols stand for one channel of a vector (the bias works on the value dimension,
a retention on one entry of the memory); `ChannelSum` marks a sum over the value channels.
"""

from __future__ import annotations

import sympy as sp

# Attentional bias: one channel j of the prediction y = M(phi(k)), the target v and e = y - v.
e, y, v = sp.symbols("e y v", real=True)
# The number of value channels Dv, which a whole-vector bias may read (a LayerNorm's mean and
# variance over the channels); the emitted code reads it off the prediction's last axis.
channels = sp.Symbol("Dv", positive=True)

# Retention: one entry of the new memory w, the previous memory w0 and the update u.
w, w0, u = sp.symbols("w w0 u", real=True)

# Optimizer: one entry of the gradient g_t, of the previous state s_{t-1} and of the new s_t.
g, s_prev, s_new = sp.symbols("g s_prev s_new", real=True)

# Feature map input: one channel of a key or query.
x = sp.Symbol("x", real=True)

# Learning-Retaining weights before reparameterization into gates (MIRAS eq. for W_t).
eta, alpha = sp.symbols("eta alpha", positive=True)


def gate_symbol(name: str) -> sp.Symbol:
    """A data-dependent gate or a fixed positive scalar of a component, e.g. `decay`."""
    return sp.Symbol(name, positive=True)


class ChannelSum(sp.Function):
    """`sum_j f(e_j, y_j, v_j)` over the value channels; the argument is one channel's term."""

    nargs = 1

    def _latex(self, printer, exp=None):  # exp: a power of the sum (sqrt(sum_j ...))
        body = r"\sum_j \left(" + printer._print(self.args[0]) + r"\right)"
        return body if exp is None else r"\left(" + body + r"\right)^{" + exp + "}"

    def _sympystr(self, printer):
        return "sum_j(" + printer._print(self.args[0]) + ")"


class sigmoid(sp.Function):
    """The logistic function 1 / (1 + exp(-x))."""

    nargs = 1

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_rewrite_as_exp(self, arg, **kwargs):
        return 1 / (1 + sp.exp(-arg))

    def _latex(self, printer, exp=None):
        body = r"\sigma\left(" + printer._print(self.args[0]) + r"\right)"
        return body if exp is None else body + "^{" + exp + "}"


class softplus(sp.Function):
    """log(1 + exp(x)), printed with a numerically stable kernel."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_rewrite_as_exp(self, arg, **kwargs):
        return sp.log(1 + sp.exp(arg))


class soft_threshold(sp.Function):
    """sign(z) max(|z| - t, 0): the proximal map of t |.| (elastic net)."""

    nargs = 2

    def _eval_rewrite_as_Piecewise(self, z, t, **kwargs):
        return sp.Piecewise((z - t, z > t), (z + t, z < -t), (0, True))


def sigmoid_rewrite(expr: sp.Expr) -> sp.Expr:
    """Name the logistic function where sympy wrote it out: exp(z)/(exp(z)+1) -> sigmoid(z)."""
    z = sp.Wild("z")

    def visit(node: sp.Basic) -> sp.Basic:
        # Top-down, so exp(z)/(exp(z)+1) is seen whole before its denominator is.
        for pattern, value in (
            (sp.exp(z) / (sp.exp(z) + 1), sigmoid(z)),
            (1 / (1 + sp.exp(-z)), sigmoid(z)),
            (1 / (1 + sp.exp(z)), sigmoid(-z)),
        ):
            match = node.match(pattern)
            if match is not None and z in match:
                return value.subs(z, visit(match[z]))
        if not node.args:
            return node
        return node.func(*[visit(a) for a in node.args])

    return visit(expr)


def channel_gradient(loss: sp.Expr) -> tuple[list[tuple[sp.Symbol, sp.Expr]], sp.Expr, sp.Expr]:
    """dL/dy_j of a bias loss by the chain rule through its channel sums.

    Returns the sums as (symbol s_i, channel term f_i), the loss with each sum replaced by its
    symbol (G), and dL/dy_j = sum_i dG/ds_i * ds_i/dy_j, in e, v and the s_i, where
    ds_i/dy_j = df_i/dy (e_j, y_j, v_j) for a term of one channel alone. The derivative is the
    almost-everywhere one: sign(e) and Heaviside(e) differentiate to DiracDelta, which is
    dropped (0), as torch's autograd does for sign.

    Channel statistics: a sum's term may read other channel sums (a LayerNorm's mean inside its
    variance, both inside its loss), which are the same for every channel. Then
    ds_i/dy_j = df_i/dy (j) + sum_m c_im ds_m/dy_j, with c_im = sum_k df_i/ds_m (k) a channel
    sum of its own, returned after the sums it reads; the sums come innermost first, so each
    is computed after those its term reads."""
    channel_sums = sorted(loss.atoms(ChannelSum), key=lambda c: (_depth(c), sp.default_sort_key(c)))
    symbols = [sp.Symbol(f"s{i}", real=True) for i in range(len(channel_sums))]
    if not any(_depth(c) for c in channel_sums):  # every term is of one channel alone
        outer = loss.subs(dict(zip(channel_sums, symbols, strict=True)))
        gradient = sp.Integer(0)
        for s, term in zip(symbols, channel_sums, strict=True):
            gradient += sp.diff(outer, s) * _channel_slope(term.args[0])
        gradient = gradient.subs(y, e + v)  # y outside a sum (refused by the compiler)
        sums = [(s, c.args[0]) for s, c in zip(symbols, channel_sums, strict=True)]
        return sums, outer, gradient
    names = dict(zip(channel_sums, symbols, strict=True))
    terms = {s: c.args[0].xreplace(names) for c, s in names.items()}  # inner sums by symbol
    outer = loss.xreplace(names)
    extra: list[tuple[sp.Symbol, sp.Expr]] = []  # the c_im
    totals: dict[sp.Symbol, sp.Expr] = {}

    def total(s: sp.Symbol) -> sp.Expr:
        """ds/dy_j."""
        if s not in totals:
            term = terms[s]
            slope = _channel_slope(term)
            for m in sorted(term.free_symbols & set(terms), key=sp.default_sort_key):
                through = sp.diff(term.subs(e, y - v), m)
                through = through.replace(sp.DiracDelta, lambda *_: sp.S.Zero)
                c = sp.Symbol(f"s{len(symbols) + len(extra)}", real=True)
                extra.append((c, through))
                slope += c * total(m)
            totals[s] = slope
        return totals[s]

    gradient = sp.Integer(0)
    for s in symbols:
        if outer.has(s):
            gradient += sp.diff(outer, s) * total(s)
    gradient = gradient.subs(y, e + v)
    return [*((s, terms[s]) for s in symbols), *extra], outer, gradient


def _depth(expr: sp.Expr) -> int:
    """How deep channel sums nest inside `expr`'s outermost one (0: none inside it)."""
    inner = [_depth(c) + 1 for a in expr.args for c in a.atoms(ChannelSum)]
    return max(inner, default=0)


def _channel_slope(term: sp.Expr) -> sp.Expr:
    """d term / dy at one channel, in e and v where it still reads y (y = e + v), DiracDelta
    dropped."""
    slope = sp.diff(term.subs(e, y - v), y)
    slope = slope.replace(sp.DiracDelta, lambda *_: sp.S.Zero)
    if slope.has(y):  # back in e, v (y = e + v)
        slope = sp.expand_mul(slope.subs(y, e + v))
    return slope
