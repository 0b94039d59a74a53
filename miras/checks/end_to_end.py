"""The end-to-end check: the composed rule on every backend against an autograd oracle.

The piece checks (`check_bias`, `check_retention`) test each derived formula at random interior
points. This stage runs the whole rule as a layer would: from the spec's default initial state,
through the window's padding (the tokens before the first), on random inputs with every gate
sampled inside its range, on each backend the spec supports; and compares outputs and final
state with an oracle of the whole step that never calls a derived gradient or step:

    W_e = W_{t-1}, or a_t W_{t-1} (grad_at: retained)
    g_t = autograd of sum_{i = max(0, t-c+1)..t} gamma_i L(M_{W_e}(phi(k_i)), v_i)
          with L the printed `bias_loss` and M the memory's forward
    u_t = the optimizer component's update of g_t (gd, momentum, Muon)
          (proximal: W_e minus the argmin of l(W; k_t, v_t) + ||W - W_e||^2 / (2 lr_t), found
          by Newton's method on its autograd gradient and Hessian, never its closed form;
          preconditioned: its step size times M(A_t), A_t summing the diagonal of the loss's
          autograd Hessian in W, never the derived s phi(k)^2)
    W_t = argmin_W of the printed Learning-Retaining objective, found numerically: the root of
          its autograd slope per entry (F convex: the slope is monotone) by safeguarded Newton,
          for kl each row's multiplier a second such root (`argmin_separable`, `argmin_rows`
          of miras.derive.numerics); lq's read A / ||A||_q^(q-2) written out
    o_t = M_{W_t}(phi(q_t))

A window never reads a token before the first here: its sum is shorter, not padded. Softmax
attention (nonparametric memory) is compared with a direct float64 softmax(QK^T + mask) V.

Where a backend's values go non-finite, the runtime's own step is replayed piece by piece
(bias gradient, optimizer, retention step, read) and the first token and piece that produce a
non-finite value is named in the result (docs/compiler.md, "Checks").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from miras.checks.inputs import DTYPE, TOLERANCE, Rule, heads_first, random_inputs, sizes_for
from miras.derive.check import CheckResult, max_relative_error
from miras.derive.emit import load_module, module_source
from miras.derive.numerics import argmin_rows, argmin_separable, newton_minimize
from miras.derive.retention_emit import objective_source

PIECES = ("bias gradient", "optimizer", "retention step", "read")


# The oracle ------------------------------------------------------------------------------------


@dataclass
class Trace:
    """Per token t, each piece's values (dicts name -> [B, H, out, in], o [B, H, Dv]), and the
    first (token, piece) whose value is not finite."""

    pieces: list[dict[str, object]]
    outputs: torch.Tensor | None  # o [B, H, T, Dv]
    final: dict[str, torch.Tensor]
    first_nonfinite: tuple[int, str] | None = None


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(bool(torch.isfinite(x).all()) for x in value.values())
    return bool(torch.isfinite(value).all())


def _record(trace: Trace, t: int, piece: str, value) -> None:
    trace.pieces[t][piece] = value
    if trace.first_nonfinite is None and not _finite(value):
        trace.first_nonfinite = (t, piece)


def _gate_at(component, name: str, gates, t: int):
    """A gate at token t, [B, H, 1], or the spec's fixed value."""
    value = getattr(component, name)
    return value if value != "gate" else gates[name][:, :, t]


def _param_gate(g):
    """[B, H, 1] -> [B, H, 1, 1]: one value per matrix."""
    return g.unsqueeze(-1) if isinstance(g, torch.Tensor) else g


def _retention_objective(rule: Rule) -> ModuleType:
    """The printed objective `retention_objective(w, w0, u, *gates)` of the spec's retention,
    the same one `check_retention` tests the derived step against."""
    retention = rule.spec.retention
    sources = objective_source(retention, tuple(retention.gates()))
    return load_module(module_source(f"retention {retention.kind}: objective", sources))


def proximal_update(rule: Rule, weights, x, v, bias_args, lr, gamma=1.0) -> dict[str, torch.Tensor]:
    """u = W_e - argmin_W [gamma L(M_W(x), v) + ||W - W_e||^2 / (2 lr)] for each parameter, the
    argmin found numerically, never by the closed form: Newton's method on the objective's
    autograd gradient and full autograd Hessian (all entries of every parameter at once,
    `miras.derive.numerics.newton_minimize`), from W_e until a step is below float64
    precision, on the printed
    `bias_loss` and the memory's forward. (L-BFGS, which compares objective values, stops near
    sqrt(eps) ~ 1e-8 of the minimizer; the check's tolerance is 1e-9.) weights [B, H, out, in]
    (W_e); x [B, H, Dphi]; v [B, H, Dv]; lr [B, H, X, 1] (per head or per row) or a number > 0;
    gamma [B, H, 1] (the window's weight of the token, c = 1) or a number."""
    forward, loss_of = rule.runtime.memory.forward, rule.functions.bias_loss
    start, unflatten, flat = _flattened(weights)

    def objective(flat: torch.Tensor) -> torch.Tensor:
        point = unflatten(flat)
        total = (gamma * loss_of(forward(point, x), v, *bias_args)).sum()
        for n, w in point.items():
            total = total + ((w - start[n]) ** 2 / (2 * lr)).sum()
        return total

    minimizer = unflatten(newton_minimize(objective, flat).detach())
    return {n: start[n] - minimizer[n] for n in start}


def curvature_diagonal(rule: Rule, weights, x, v, bias_args, gamma=1.0) -> dict:
    """The diagonal of the Hessian of gamma L(M_W(x), v) in each parameter, by autograd (the
    full Hessian of all entries at once, as `proximal_update` takes it; never the derived
    s phi(k)^2), averaged over each parameter's rows: name -> [B, H, 1, in]. On a matrix memory
    with a bias of constant curvature every row holds the same diagonal. weights [B, H, out,
    in] (W_e); x [B, H, Dphi]; v [B, H, Dv]; gamma [B, H, 1] or a number."""
    forward, loss_of = rule.runtime.memory.forward, rule.functions.bias_loss
    _, unflatten, flat = _flattened(weights)

    def objective(flat: torch.Tensor) -> torch.Tensor:
        return (gamma * loss_of(forward(unflatten(flat), x), v, *bias_args)).sum()

    with torch.enable_grad():
        hessian = torch.autograd.functional.hessian(objective, flat)
    return {n: d.mean(-2, keepdim=True) for n, d in unflatten(hessian.diagonal()).items()}


def _flattened(weights: dict) -> tuple[dict, Callable[[torch.Tensor], dict], torch.Tensor]:
    """The weights detached (name -> tensor), the map from one flat vector of all their
    entries back to name -> tensor of each weight's shape, and the weights as that vector:
    the one variable the Newton and Hessian computations above take."""
    start = {n: w.detach() for n, w in weights.items()}
    names, shapes = list(start), [w.shape for w in start.values()]
    sizes = [w.numel() for w in start.values()]

    def unflatten(flat: torch.Tensor) -> dict:
        parts = torch.split(flat, sizes)
        return {n: p.reshape(shape) for n, p, shape in zip(names, parts, shapes, strict=True)}

    return start, unflatten, torch.cat([w.flatten() for w in start.values()])


def step_inputs(rule: Rule, q, k, v, gates):
    """The oracle's inputs, one entry per optimizer step (`optimizer.steps: n`, docs/spec.md):
    step j of token t at t*n + j reads the token's k, v and gates (or, for the per-step
    inputs, its own), the decay only at j = 0 (1 after it: once per token) and q only at
    j = n - 1 (zeros before: o_t reads the state after the n steps). Written out here
    apart from `miras.runtime.substeps`, which it checks. n = 1: the inputs unchanged."""
    opt = rule.spec.optimizer
    n, per_step = opt.steps_per_token(), opt.per_step_inputs()
    if n == 1:
        return q, k, v, gates
    decay = rule.spec.retention.decay_gate
    t = q.shape[1]

    def each_step(x, name, first_only=False, last_only=False):
        if name in per_step:
            return x
        out = torch.zeros((x.shape[0], t * n, *x.shape[2:]), dtype=x.dtype)
        for j in range(n):
            if (first_only and j > 0) or (last_only and j < n - 1):
                out[:, j::n] = 1.0 if first_only else 0.0
            else:
                out[:, j::n] = x
        return out

    gates = {name: each_step(g, name, first_only=name == decay) for name, g in gates.items()}
    return each_step(q, "q", last_only=True), each_step(k, "k"), each_step(v, "v"), gates


def oracle(rule: Rule, q, k, v, gates) -> Trace:
    """The whole rule, token by token, in float64, from the default initial state.

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; gates name -> [B, T, H]. Returns the trace with
    o [B, H, T, Dv] and the final state (W and S.<name> [B, H, out, in])."""
    spec, rt = rule.spec, rule.runtime
    phi_q, phi_k, v_, gates_ = heads_first(rule, q, k, v, gates)
    b, h, length, d_phi = phi_k.shape
    state = rt.initial_state(b, h, d_phi, v_.shape[-1], DTYPE, "cpu")
    names = rt.param_names
    opt, retention = spec.optimizer, spec.retention
    objective_module = _retention_objective(rule)
    retention_gates = retention.gates()

    def read(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: retention.reference_read(s[n]) for n in names}

    trace = Trace([{} for _ in range(length)], None, {})
    outputs = []
    for t in range(length):
        weights = read(state)
        factor = retention.retained_factor()
        if factor is not None:
            decay = _param_gate(_gate_at(retention, factor, gates_, t))
            weights = {n: decay * w for n, w in weights.items()}
        # g_t: autograd of the gamma-weighted printed loss over the tokens of the window.
        point = {n: w.detach().requires_grad_() for n, w in weights.items()}
        with torch.enable_grad():
            loss = 0.0
            first = 0 if spec.window.is_global else max(0, t - spec.window.c + 1)
            for i in range(first, t + 1):
                y = rt.memory.forward(point, phi_k[:, :, i])  # [B, H, Dv]
                bias_args = [gates_[n][:, :, i] for n in spec.bias.gates()]
                term = rule.functions.bias_loss(y, v_[:, :, i], *bias_args)  # [B, H, 1]
                weight = _gate_at(spec.window, spec.window.weight_gate, gates_, i)
                loss = loss + (weight * term).sum()
            grads = torch.autograd.grad(loss, [point[n] for n in names], allow_unused=True)
        grads = {
            n: torch.zeros_like(point[n]) if g is None else g
            for n, g in zip(names, grads, strict=True)
        }
        _record(trace, t, "bias gradient", grads)
        # u_t: the optimizer component's own update; for an implicit step (proximal), W_e
        # minus the numerical argmin of its objective.
        values = {name: _param_gate(_gate_at(opt, name, gates_, t)) for name in opt.gateable}
        if rule.plan.precondition is not None:
            # The preconditioner: the curvature c_t, the Hessian's diagonal by autograd, summed
            # into A_t by the component's `accumulate`; the step size b_t M(A_t) per column.
            bias_args = [gates_[n][:, :, t] for n in spec.bias.gates()]
            gamma = _gate_at(spec.window, spec.window.weight_gate, gates_, t)  # c = 1
            curvature = curvature_diagonal(rule, weights, phi_k[:, :, t], v_[:, :, t], bias_args,
                                           gamma)  # fmt: skip
            gate = rule.plan.precondition.gate
            for n in names:
                state[f"P.{n}"] = opt.accumulate(
                    state[f"P.{n}"], curvature[n], values["precond_decay"], values["precond_lr"]
                )
            (name,) = names  # a matrix memory: one factor for the step size of W
            values[gate] = values[gate] * opt.factor(state[f"P.{name}"], values["precond_center"])
        updates = {}
        if rule.plan.implicit_step is not None:
            bias_args = [gates_[n][:, :, t] for n in spec.bias.gates()]
            lr = values[rule.plan.implicit_step.gate]
            gamma = _gate_at(spec.window, spec.window.weight_gate, gates_, t)  # c = 1: its weight
            x, target = phi_k[:, :, t], v_[:, :, t]
            updates = proximal_update(rule, weights, x, target, bias_args, lr, gamma)
        for n, g in grads.items() if not updates else ():
            updates[n], s = opt.update(g, state.get(f"S.{n}"), **values)
            if opt.stateful:
                state[f"S.{n}"] = s
        _record(trace, t, "optimizer", updates)
        # W_t: the numerical argmin of the printed objective.
        args = [_param_gate(gates_[g][:, :, t]) for g in retention_gates]
        for n, u in updates.items():
            w0 = state[n]

            def objective(x, w0=w0, u=u, args=args):
                return objective_module.retention_objective(x, w0, u, *args)

            if retention.simplex_rows:
                state[n] = argmin_rows(objective, w0, u, retention.row_sum())
            else:
                state[n] = argmin_separable(objective, w0, u, retention.domain())
        _record(trace, t, "retention step", {n: state[n] for n in names})
        o = rt.memory.forward(read(state), phi_q[:, :, t])  # [B, H, Dv]
        _record(trace, t, "read", o)
        outputs.append(o)
    trace.outputs = torch.stack(outputs, dim=2)
    trace.final = state
    return trace


# The runtime, replayed piece by piece ----------------------------------------------------------


def replay(rule: Rule, q, k, v, gates) -> Trace:
    """The recurrent backend's step with each piece recorded, on the runtime's own inputs.

    `rule(...)` runs with backend="recurrent", so the runtime prepares the sequence itself
    (features, default state, the window's padding), and the recurrent form hands every piece
    of every step to `record` (`miras.runtime.recurrent.step`): nothing is patched, so replays
    in other threads, and other calls of the runtime, run as they would alone. The trace holds
    the steps' outputs, o [B, H, T, Dv] (T counts steps: n per token with n optimizer steps),
    and the final state as a dict."""
    trace = Trace([], None, {})

    def record(t: int, piece: str, value) -> None:
        while len(trace.pieces) <= t:
            trace.pieces.append({})
        _record(trace, t, piece, value)

    _, final = rule(q, k, v, gates, backend="recurrent", output_final_state=True, record=record)
    if not trace.pieces:
        raise ValueError(
            f"replay: spec '{rule.spec.name}' runs no per-token step on the recurrent backend "
            "(softmax attention and the exact minimizer run in closed form): nothing to replay"
        )
    trace.outputs = torch.stack([pieces["read"] for pieces in trace.pieces], dim=2)
    trace.final = final if isinstance(final, dict) else {"W": final}
    return trace


# The stage -------------------------------------------------------------------------------------


def _backends(rule: Rule, triton: bool) -> list[tuple[str, int]]:
    """(backend, chunk size) pairs to run. Chunk size 1 makes the chunk-start form the exact
    step; a spec whose chunk backend solves each chunk exactly (`plan.chunk_form`) runs the
    chunk backend at 4, so a chunk boundary falls inside the sequence."""
    pairs = [("recurrent", 1)]
    if rule.plan.chunk_form.form == "exact":
        pairs.append(("chunk", 4))
    else:
        pairs.append(("chunk", 1))
    if triton and triton_reason(rule) is None:
        pairs.append(("triton", 1))
    return pairs


def triton_reason(rule: Rule) -> str | None:
    """Why the stage leaves the Triton backend out for `rule` here, or None when it runs it."""
    from miras.compiler.triton_kernels import unsupported_reason
    from miras.runtime.triton_launch import runs_on_cpu

    if (closed := rule.spec.memory.closed_form()) is not None:
        return f"{closed} has no Triton kernel"
    reason = unsupported_reason(rule.spec)
    if reason is not None:
        return f"the Triton backend does not cover this spec ({reason})"
    if not torch.cuda.is_available() and not runs_on_cpu():
        return (
            "no CUDA device here; TRITON_INTERPRET=1 in the environment runs its kernels in "
            "Triton's interpreter on the CPU"
        )
    return None


def _first_token(bad: torch.Tensor) -> int | None:
    """bad [B, T, H, Dv] (True where a value is wrong) -> the first such t, or None."""
    per_token = bad.flatten(2).any(-1).any(0)  # [T]
    return int(per_token.nonzero()[0]) if bool(per_token.any()) else None


def _state_error(final, reference: dict[str, torch.Tensor]) -> float:
    if isinstance(final, torch.Tensor):
        final = {"W": final}
    return max(max_relative_error(final[n], reference[n]) for n in reference)


def _first_piece_off(steps: Trace, reference: Trace) -> tuple[int, str] | None:
    """The first (token, piece) where the runtime's step leaves the oracle's by more than
    the tolerance."""
    for t, (ours, theirs) in enumerate(zip(steps.pieces, reference.pieces, strict=True)):
        for piece in PIECES:
            a, b = ours[piece], theirs[piece]
            pairs = [(a[n], b[n]) for n in b] if isinstance(b, dict) else [(a, b)]
            if any(not max_relative_error(x, y) <= TOLERANCE for x, y in pairs):
                return t, piece
    return None


def check_end_to_end(
    rule: Rule, *, seed: int = 0, triton: bool = True, per_channel: bool = False
) -> list[CheckResult]:
    """One `CheckResult` per backend: the max relative error of the outputs and the final
    state against the oracle, in float64. A result that fails names the first token whose
    output is non-finite (or off), and the first token and piece of the runtime's step (bias
    gradient, optimizer, retention step, read) that is non-finite (or off the oracle's).
    `triton=False` leaves the Triton backend out (on a machine without a GPU it runs in
    Triton's interpreter, which takes seconds even at these sizes); `per_channel` samples
    gates per value channel where the runtime takes them so (per head otherwise, as the
    layer feeds them)."""
    if rule.plan.chunk_form.form == "minimizer":  # an optimizer that solves exactly
        from miras.checks.minimizer import check_minimizer_end_to_end

        return check_minimizer_end_to_end(rule, seed=seed)
    sizes = sizes_for(rule)
    q, k, v, gates = random_inputs(rule, sizes, seed, per_channel)
    # Outputs and final state, from the spec's default initial state.
    what = (
        "end-to-end {} (chunk size {}) vs the autograd oracle: "
        f"T={sizes.length}, c={rule.spec.window.c}"
        + (", per-channel gates" if per_channel else "")
        + (", the proximal step by Newton's argmin" if rule.plan.implicit_step else "")
        + (", the preconditioner from autograd's Hessian" if rule.plan.precondition else "")
    )
    results = []
    memory = rule.spec.memory
    if memory.closed_form() is not None:  # no step to replay: the memory's own oracle
        expected = memory.reference_closed_form(q, k, v)
        for backend, chunk_size in _backends(rule, triton):
            o, _ = rule(q, k, v, backend=backend, chunk_size=chunk_size)
            error = max_relative_error(o, expected)
            results.append(CheckResult(what.format(backend, chunk_size), error, TOLERANCE))
        return results
    n = rule.spec.optimizer.steps_per_token()
    reference = oracle(rule, *step_inputs(rule, q, k, v, gates))
    if reference.first_nonfinite is not None:
        t, piece = reference.first_nonfinite
        text = what.format("oracle", "-") + f"; the oracle's {piece} is non-finite at step {t}"
        return [CheckResult(text, math.inf, TOLERANCE)]
    expected_o = reference.outputs.transpose(1, 2)[:, n - 1 :: n]  # [B, T, H, Dv]
    expected_state = {n: x for n, x in reference.final.items() if not n.startswith("window.")}
    steps = None  # the runtime's step replayed piece by piece, once, where a backend fails
    for backend, chunk_size in _backends(rule, triton):
        # Triton runs in the interpreter on a CPU: one head only for a matrix memory, whose
        # default state is the same in every head, so head 0 is head 0's oracle. An MLP's
        # default state is drawn per head (H heads draw differently from one): all heads.
        one_head = backend == "triton" and memory.linear
        heads = slice(0, 1) if one_head else slice(None)
        inputs = [x[:, :, heads] for x in (q, k, v)]
        o, final = rule(
            *inputs,
            {n: g[:, :, heads] for n, g in gates.items()},
            backend=backend,
            chunk_size=chunk_size,
            output_final_state=True,
        )
        expected = expected_o[:, :, heads]
        error = max(
            max_relative_error(o, expected),
            _state_error(final, {n: x[:, heads] for n, x in expected_state.items()}),
        )
        text = what.format(backend, chunk_size)
        if not error <= TOLERANCE:  # also NaN
            steps = steps or replay(rule, q, k, v, gates)
            finite = bool(torch.isfinite(o).all()) and math.isfinite(error)
            if not finite:
                error = math.inf
                bad = _first_token(~torch.isfinite(o))
                text += "; non-finite" + (f" output from token {bad}" if bad is not None else "")
            else:
                scale = expected.abs().clamp_min(1.0)
                bad = _first_token((o - expected).abs() / scale > TOLERANCE)
                text += "; off" + (f" from token {bad}" if bad is not None else " (final state)")
            if steps.first_nonfinite is not None:
                t, piece = steps.first_nonfinite
                text += f"; the step's first non-finite piece: {piece} at token {t}"
            elif (off := _first_piece_off(steps, reference)) is not None:
                text += f"; the step's first piece off the oracle: {off[1]} at token {off[0]}"
        results.append(CheckResult(text, error, TOLERANCE))
    return results
