"""The execution forms' contract (miras/runtime/forms.py), one suite every form inherits.

`FormContract` holds the checks; each subclass names its form (a key of `forms.FORMS`), the
backend and chunk mode that select it, the specs it covers and its reference:

- the registry runs this form, and only it, for every case;
- forward and backward against the reference: the output, the final state and the gradients
  of a random functional of both w.r.t. q, k, v, every gate and the initial state, at a T that
  is a multiple of the chunk, one that is not (with odd Dk, Dv) and one below it;
- carried state: T in two pieces, the first one's final state carried, equals one run;
- windows (c > 1) and per-channel gates [B, T, H, Dv] wherever the form covers them: a form
  declares what it does not cover, and the suite checks the declaration.

The reference is the recurrence: `plain_recurrence` below (the step written out for a matrix
memory, independent of the runtime) or `backend="recurrent"`. For the chunk-start forms it is
the same recurrence with every gradient of a chunk taken at the chunk's start state, so the
linear chunk-start path's backward at b > 1 is held to a token loop directly.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import pytest
import torch

import miras
from miras.runtime import forms, linear, per_channel_gates
from tests.helpers import random_inputs

f64 = torch.float64
B, H = 2, 2
# (T, chunk, Dk, Dv): T a multiple of the chunk; not one, odd widths; T below the chunk.
SHAPES = [(8, 4, 4, 4), (11, 4, 5, 3), (3, 4, 4, 4)]
SPLIT = (11, 4, 8)  # carried state: T, chunk, the first piece's length (a chunk boundary)

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Case:
    """A spec's fields; `per_channel`: every gate the rule takes per channel is given so;
    `loop`: the options of `plain_recurrence` that write this spec's step (None: it does not)."""

    fields: dict
    per_channel: bool = False
    loop: dict | None = None


GDN = {"bias": "l2", "retention": {"kind": "l2", "grad_at": "retained"}}
TITANS_LINEAR = {"bias": "l2", "retention": "l2", "optimizer": "momentum"}
WINDOW2 = {**GDN, "optimizer": "momentum", "window": {"c": 2, "gamma": "gate"}}
WINDOW3 = {**TITANS_LINEAR, "window": {"c": 3, "gamma": 0.7}}
# Matrix memories the plain recurrence writes.
LINEAR = {
    "deltanet": Case({"bias": "l2", "retention": "none"}, loop={}),
    "gated_deltanet": Case(GDN, loop={"retained": True}),
    "titans_linear": Case(TITANS_LINEAR, loop={}),
    "window2_gamma_momentum": Case(WINDOW2, loop={"retained": True, "c": 2}),
    "per_channel_window3": Case(WINDOW3, per_channel=True, loop={"c": 3, "gamma": 0.7}),
}


_RULES: dict[str, object] = {}


def rule_of(name: str, case: Case):
    """The compiled rule (miras.compile's, shared by every test: never modified)."""
    if name not in _RULES:
        _RULES[name] = miras.compile({"name": name, **case.fields})
    return _RULES[name]


def plain_recurrence(q, k, v, gates, init, *, block=1, retained=False, c=1, gamma=None, dot=False):
    """The step of a matrix memory written out, one token at a time: the l2 bias (dL/dy = y - v;
    `dot`: -v), retention none or l2 (the gate `decay`; `retained`: the gradient at a_t W),
    gd or momentum (the gate `momentum`), a window of c tokens weighted by the gate `gamma` (or
    the constant `gamma`). `block` > 1: every gradient of a block of `block` tokens at the
    block's start state, the chunk-start form (1: the recurrence).

    q, k [B, T, H, Dk], v [B, T, H, Dv], gates [B, T, H] or [B, T, H, Dv], init W [B, H, Dv, Dk]
    (and S.W). Returns o [B, T, H, Dv] and the final {W, S.W}."""

    def at(name: str, t: int, default=1.0):  # [B, H, X, 1]: scales the rows of W
        if name not in gates:
            return default
        g = gates[name][:, t]
        return g[..., None, None] if g.dim() == 2 else g[..., None]

    w, s = init["W"], init.get("S.W")
    outputs = []
    for t in range(q.shape[1]):
        if t % block == 0:
            w_start, product = w, 1.0
        a = at("decay", t)
        product = product * a
        w_e = product * w_start if retained else w_start
        g = torch.zeros_like(w)
        for i in range(max(0, t - c + 1), t + 1):
            x = k[:, i]  # [B, H, Dk]
            y = (w_e @ x[..., None])[..., 0]
            error = -v[:, i] if dot else y - v[:, i]
            weight = at("gamma", i, 1.0 if gamma is None else gamma)
            g = g + weight * error[..., None] * x[..., None, :]
        if s is None:
            u = at("lr", t) * g
        else:
            s = at("momentum", t) * s + at("lr", t) * g
            u = s
        w = a * w - u
        outputs.append((w @ q[:, t][..., None])[..., 0])
    final = {"W": w} if s is None else {"W": w, "S.W": s}
    return torch.stack(outputs, dim=1), final


def as_dict(state) -> dict:
    return state if isinstance(state, dict) else {"W": state}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    scale = e.pow(2).mean().sqrt().clamp_min(1e-30)
    return ((a - e).pow(2).mean().sqrt() / scale).item()


class FormContract:
    """The contract. A subclass sets `form`, `backend`, `chunk_mode`, `cases` and, where they
    differ, `dtype`, `shapes`, the tolerances, `reference` and `uncovered`."""

    form: str
    backend = "chunk"
    chunk_mode = "auto"
    cases: dict[str, Case]
    shapes = SHAPES
    dtype, device = f64, "cpu"
    rtol, atol = 1e-10, 1e-10  # float64; a float32 form: relative RMS `rms`
    rms = 1e-5
    # what the form does not cover ("windows", "per-channel gates"), with the reason
    uncovered: dict[str, str] = {}

    def rule(self, name: str):
        return rule_of(name, self.cases[name])

    def run(self, rule, x: dict, chunk_size: int):
        """o and the final state of this form on the leaves `x`."""
        o, final = rule(
            x["q"], x["k"], x["v"], x["gates"], backend=self.backend, chunk_size=chunk_size,
            chunk_mode=self.chunk_mode, initial_state=x["init"], output_final_state=True,
        )  # fmt: skip
        return o, (as_dict(final) if final is not None else {})

    def reference(self, name: str, rule, x: dict, chunk_size: int):
        """o and the final state of the reference: the recurrence, float64."""
        o, final = rule(
            x["q"], x["k"], x["v"], x["gates"], backend="recurrent",
            initial_state=x["init"], output_final_state=True,
        )  # fmt: skip
        return o, (as_dict(final) if final is not None else {})

    def initial_state(self, rule, dk: int, dv: int, gen: torch.Generator):
        """A random memory state (and momentum), 0.3 N(0, 1)."""
        default = as_dict(rule.initial_state(B, H, dk, dv, f64))
        return {n: 0.3 * torch.randn(s.shape, generator=gen, dtype=f64) for n, s in default.items()}

    def inputs(self, name: str, t: int, dk: int, dv: int, seed: int = 0) -> dict:
        rule = self.rule(name)
        q, k, v, gates = random_inputs(
            rule, b=B, t=t, h=H, dk=dk, dv=dv, per_channel=self.cases[name].per_channel,
            seed=seed,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(seed + 1)
        return {
            "q": q,
            "k": k,
            "v": v,
            "gates": gates,
            "init": self.initial_state(rule, dk, dv, gen),
        }

    # The checks -----------------------------------------------------------------------------

    def leaves(self, x: dict, dtype) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
        """Fresh leaves of `x` in `dtype` (window.valid is 0 or 1, not a leaf)."""
        named = []

        def leaf(label, t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach().to(dtype=dtype, device=self.device)
            if label.endswith("window.valid"):
                return t
            t.requires_grad_(True)
            named.append((label, t))
            return t

        out = {n: leaf(n, x[n]) for n in ("q", "k", "v")}
        out["gates"] = {n: leaf(f"gate {n}", g) for n, g in x["gates"].items()}
        init = x["init"]
        out["init"] = None if init is None else {n: leaf(f"state {n}", s) for n, s in init.items()}
        return out, named

    def outputs_and_grads(self, fn, x: dict, dtype):
        """fn's outputs (o, then the final memory tensors by name) and the gradients of a
        random functional of them w.r.t. every leaf, labelled."""
        leaves, named = self.leaves(x, dtype)
        o, final = fn(leaves)
        outs = [("o", o)] + [(f"final {n}", final[n]) for n in sorted(final) if "window." not in n]
        gen = torch.Generator().manual_seed(11)
        loss = sum(
            (y * torch.randn(y.shape, generator=gen, dtype=f64).to(y)).sum() for _, y in outs
        )
        grads = torch.autograd.grad(loss, [t for _, t in named], allow_unused=True)
        return outs + [(f"d {label}", g) for (label, _), g in zip(named, grads, strict=True)]

    def assert_matches(self, got, want, where: str, tight: bool = False):
        """Equal labels and shapes, finite, and close: float64 to rtol, atol (`tight`: 1e-12,
        for one computation split in two), float32 to a relative RMS."""
        rtol, atol, rms = (1e-12, 1e-12, 1e-6) if tight else (self.rtol, self.atol, self.rms)
        assert [label for label, _ in got] == [label for label, _ in want], where
        for (label, a), (_, e) in zip(got, want, strict=True):
            assert (a is None) == (e is None), f"{where}: {label}"
            if a is None:
                continue
            assert a.shape == e.shape and torch.isfinite(a).all(), f"{where}: {label}"
            if self.dtype == f64:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=f"{where}: {label}")
            else:
                err = rel_rms(a, e)
                assert err <= rms, f"{where}: {label}: relative RMS {err:.3g} > {rms}"

    def window_of(self, spec):
        return spec.window.c

    def test_the_registry_runs_this_form(self, name, monkeypatch):
        calls = []
        entry = forms.FORMS[self.form]

        def spy(call):
            calls.append(entry.name)
            return entry.forward(call)

        x, _ = self.leaves(self.inputs(name, 5, 4, 4), self.dtype)
        monkeypatch.setitem(forms.FORMS, self.form, dataclasses.replace(entry, forward=spy))
        with torch.no_grad():
            self.run(self.rule(name), x, 4)
        assert calls == [self.form]

    def test_forward_and_backward_match_the_reference(self, name, shape):
        t, chunk_size, dk, dv = shape
        rule = self.rule(name)
        x = self.inputs(name, t, dk, dv)
        got = self.outputs_and_grads(lambda y: self.run(rule, y, chunk_size), x, self.dtype)
        want = self.outputs_and_grads(lambda y: self.reference(name, rule, y, chunk_size), x, f64)
        self.assert_matches(got, want, f"{name} {shape}")

    def test_carried_state_equals_one_run(self, name):
        t, chunk_size, first = SPLIT
        rule = self.rule(name)
        x, _ = self.leaves(self.inputs(name, t, 4, 4), self.dtype)

        def part(sl, init):
            gates = {n: g[:, sl] for n, g in x["gates"].items()}
            return self.run(
                rule,
                {**x, **{n: x[n][:, sl] for n in "qkv"}, "gates": gates, "init": init},
                chunk_size,
            )

        with torch.no_grad():
            whole, final = self.run(rule, x, chunk_size)
            o1, carried = part(slice(0, first), x["init"])
            o2, final2 = part(slice(first, t), carried)
        got = [("o", torch.cat([o1, o2], dim=1))] + [(n, final2[n]) for n in sorted(final2)]
        want = [("o", whole)] + [(n, final[n]) for n in sorted(final)]
        self.assert_matches(got, want, f"{name} in two pieces", tight=True)

    def test_declares_what_it_covers(self):
        """Windows and per-channel gates are covered by some case unless declared uncovered,
        and a declared gap is real: no case takes a per-channel gate."""
        specs = [self.rule(name).spec for name in self.cases]
        windows = [s for s in specs if self.window_of(s) == "global" or self.window_of(s) > 1]
        assert bool(windows) == ("windows" not in self.uncovered), self.uncovered
        channels = [
            n
            for n, case in self.cases.items()
            if case.per_channel and per_channel_gates(self.rule(n))
        ]
        if "per-channel gates" in self.uncovered:
            assert not any(per_channel_gates(self.rule(n)) for n in self.cases)
        else:
            assert channels, "no case gives a gate per channel"


def pytest_generate_tests(metafunc):
    """Every contract test runs once per case of its class."""
    if "name" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("name", sorted(metafunc.cls.cases))
    if "shape" in metafunc.fixturenames and metafunc.cls is not None:
        shapes = metafunc.cls.shapes
        metafunc.parametrize("shape", shapes, ids=["T{}-b{}-Dk{}-Dv{}".format(*s) for s in shapes])


# The forms -------------------------------------------------------------------------------------


class LoopReference:
    """The reference is `plain_recurrence`, at the form's chunk size where `block_of_chunk`."""

    block_of_chunk = False

    def reference(self, name, rule, x, chunk_size):
        block = chunk_size if self.block_of_chunk else 1
        return plain_recurrence(
            x["q"], x["k"], x["v"], x["gates"], x["init"], block=block, **self.cases[name].loop
        )


class TestRecurrent(LoopReference, FormContract):
    """The reference itself, against the step written out."""

    form, backend = "recurrent", "recurrent"
    cases = LINEAR


class TestExactChunk(FormContract):
    """The exact chunk form (exact_chunk.py), equal to the recurrence at any chunk size."""

    form = "exact"
    cases = {
        **{n: LINEAR[n] for n in ("deltanet", "gated_deltanet", "window2_gamma_momentum")},
        "per_channel_window3": LINEAR["per_channel_window3"],
        "retnet_dot": Case({"bias": "dot", "retention": "l2"}),
        "custom_slope_reads_v": Case(
            {"bias": {"kind": "custom", "loss": "(1 + v**2)*e**2/4"}, "retention": "none"}
        ),
    }


class TestStartLinear(LoopReference, FormContract):
    """The linear chunk-start path (linear.py): its forward and backward at b > 1 against the
    recurrence with each chunk's gradients at the chunk's start state."""

    form, chunk_mode = "start", "start"
    block_of_chunk = True
    cases = {**LINEAR, "retnet_dot": Case({"bias": "dot", "retention": "l2"}, loop={"dot": True})}

    def test_the_linear_path_runs(self, name, monkeypatch):
        calls = []
        original = linear.forward
        monkeypatch.setattr(linear, "forward", lambda *a: calls.append(1) or original(*a))
        x, _ = self.leaves(self.inputs(name, 5, 4, 4), f64)
        with torch.no_grad():
            self.run(self.rule(name), x, 4)
        assert calls == [1]

    def test_the_reference_is_not_the_recurrence_at_b_above_1(self):
        """Else the comparison above could not tell the two apart."""
        x = self.inputs("titans_linear", 11, 4, 4)
        block4, _ = plain_recurrence(x["q"], x["k"], x["v"], x["gates"], x["init"], block=4)
        exact, _ = plain_recurrence(x["q"], x["k"], x["v"], x["gates"], x["init"], block=1)
        assert rel_rms(block4, exact) > 1e-3


_GENERAL: dict[str, object] = {}  # case name -> a copy of its rule on the general path


class TestStartGeneral(TestStartLinear):
    """The general chunk-start path (chunk.forward_general) on the same specs: a copy of each
    rule whose runtime records the general path."""

    def rule(self, name):
        if name not in _GENERAL:
            rule = copy.copy(rule_of(name, self.cases[name]))  # its own program, below
            runtime = dataclasses.replace(rule.runtime, start_path="general")
            rule.program = dataclasses.replace(rule.program, runtime=runtime)
            _GENERAL[name] = rule
        return _GENERAL[name]

    def test_the_linear_path_runs(self, name, monkeypatch):
        calls = []
        monkeypatch.setattr(linear, "forward", lambda *a: calls.append(1))
        x, _ = self.leaves(self.inputs(name, 5, 4, 4), f64)
        with torch.no_grad():
            self.run(self.rule(name), x, 4)
        assert calls == []  # the general path ran
        assert rule_of(name, self.cases[name]).runtime.start_path == "linear"  # untouched


class TestDual(FormContract):
    """MLP memories: the chunk-start form without per-token weights, against the per-token
    chunk-start path at the same chunk size (chunk_mode="start")."""

    form = "dual"
    cases = {
        "titans_mlp": Case({"memory": {"kind": "mlp", "depth": 2}, **TITANS_LINEAR}),
        "gated_mlp_window2": Case(
            {
                "memory": {"kind": "gated_mlp", "expansion": 2},
                "bias": {"kind": "huber", "delta": "gate"},
                "retention": "l2",
                "optimizer": "momentum",
                "window": {"c": 2, "gamma": "gate"},
            },
            per_channel=True,
        ),
    }

    def reference(self, name, rule, x, chunk_size):
        o, final = rule(
            x["q"], x["k"], x["v"], x["gates"], chunk_size=chunk_size, chunk_mode="start",
            initial_state=x["init"], output_final_state=True,
        )  # fmt: skip
        return o, as_dict(final)


class TestMinimizer(FormContract):
    """The exact minimizer (optimizer exact): its statistics carried, a window or the prefix."""

    form = "minimizer"
    rtol, atol = 1e-9, 1e-11
    uncovered = {"per-channel gates": "one H_kk serves every value channel"}
    cases = {
        "mesanet": Case(
            {
                "feature_map": {"kind": "identity", "normalize": True},
                "bias": "l2",
                "retention": {"kind": "l2", "decay": "gate"},
                "optimizer": {"kind": "exact", "ridge": "gate"},
                "window": {"c": "global", "gamma": "gate"},
            }
        ),
        "window3": Case(
            {
                "bias": "l2",
                "retention": "l2",
                "optimizer": {"kind": "exact", "ridge": 1.0},
                "window": {"c": 3, "gamma": "gate"},
            }
        ),
    }

    def initial_state(self, rule, dk, dv, gen):
        """Statistics a run carries: the final state of a warm-up run (H_kk positive definite)."""
        q, k, v, gates = random_inputs(rule, b=B, t=4, h=H, dk=dk, dv=dv, seed=7)
        _, state = rule(q, k, v, gates, backend="recurrent", output_final_state=True)
        return state


class TestAttention(FormContract):
    """Softmax attention in closed form, against the masked softmax written out. It carries no
    state (a layer keeps its KV cache itself), so the carried-state check is the refusal."""

    form = "attention"
    uncovered = {"per-channel gates": "attention takes no gates"}
    cases = {
        "attention": Case({"memory": "nonparametric", "bias": "l2"}),
        "swa3": Case({"memory": {"kind": "nonparametric", "window": 3}, "bias": "l2"}),
    }

    def window_of(self, spec):
        return spec.memory.window or 1

    def initial_state(self, rule, dk, dv, gen):
        return None

    def reference(self, name, rule, x, chunk_size):
        q, k, v = (y.transpose(1, 2) for y in (x["q"], x["k"], x["v"]))  # [B, H, T, D]
        t = q.shape[2]
        i = torch.arange(t)
        distance = i[:, None] - i[None, :]
        window = rule.spec.memory.window or t
        scores = (q @ k.transpose(-1, -2)).masked_fill(
            ~((distance >= 0) & (distance < window)), -torch.inf
        )
        return (scores.softmax(-1) @ v).transpose(1, 2), {}

    def test_carried_state_equals_one_run(self, name):
        x, _ = self.leaves(self.inputs(name, 5, 4, 4), f64)
        state = {"W": torch.zeros(B, H, 4, 4, dtype=f64)}
        with pytest.raises(ValueError, match="softmax attention carries no state here; pass None"):
            self.run(self.rule(name), {**x, "init": state}, 4)


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on a CPU
TRITON_SHAPES = [(9, 4, 4, 4), (5, 8, 5, 3)]  # a partial last chunk; T below the chunk, odd D


class TritonForm(FormContract):
    """float32 on the Triton kernels (under TRITON_INTERPRET=1 without a GPU: tests/conftest.py),
    relative RMS 1e-5 against the float64 reference, at tiny shapes."""

    backend, dtype, device = "triton", torch.float32, TRITON_DEVICE
    shapes = TRITON_SHAPES


class TestExactTriton(TritonForm):
    """The exact form's scan over chunks in Triton kernels (exact_triton.py)."""

    form = "exact_triton"
    cases = {
        n: LINEAR[n] for n in ("gated_deltanet", "window2_gamma_momentum", "per_channel_window3")
    }


class TestTriton(LoopReference, TritonForm):
    """The emitted chunk kernels (the linear template for gd, the general one for momentum) in
    the chunk-start form, against the recurrence with each chunk's gradients at its start."""

    form, chunk_mode = "triton", "start"
    block_of_chunk = True
    cases = {
        n: LINEAR[n]
        for n in ("deltanet", "titans_linear", "window2_gamma_momentum", "per_channel_window3")
    }
