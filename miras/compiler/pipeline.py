"""The compiler: a spec becomes a derived, checked `MemoryRule`, as a list of named passes.

    resolve -> bias_gradient -> retention_step -> plan -> chunk_form -> emit -> check

Each pass reads and fills one `Compilation`; an invariant is checked after each, and
`MIRAS_DEBUG=1` prints what every pass produced. Results are cached by the spec's digest.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType

import sympy as sp
import torch

from miras.check import CheckResult
from miras.compiler.affine import analyze
from miras.compiler.bias import BiasRule, check_bias, derive_bias
from miras.compiler.describe import Derivation, describe
from miras.compiler.emit import function_source, load_module, module_source
from miras.compiler.plan import Plan, make_plan
from miras.compiler.retention import RetentionRule, check_retention, derive_retention
from miras.components.memory.mlp import ACTIVATIONS
from miras.errors import DerivationError
from miras.runtime import run
from miras.runtime.core import Runtime
from miras.runtime.memory import MemoryModel
from miras.spec import Spec, load_spec
from miras.symbols import e, gate_symbol, u, v, w0, x


@dataclass
class Compilation:
    """What the passes produce, in order."""

    spec: Spec
    bias: BiasRule | None = None
    retention: RetentionRule | None = None
    plan: Plan | None = None
    source: str = ""
    module: ModuleType | None = None
    checks: list[CheckResult] = field(default_factory=list)


# Passes ------------------------------------------------------------------------------------


def resolve(c: Compilation) -> str:
    """Components are typed by the spec already; report what was picked."""
    s = c.spec
    return (
        "\n".join(
            f"{name:12s} {getattr(s, name).kind} {getattr(s, name).parameters()}"
            for name in ("memory", "feature_map", "bias", "retention", "optimizer")
        )
        + f"\nwindow       c={s.window.c} gamma={s.window.gamma}"
    )


def bias_gradient(c: Compilation) -> str:
    c.bias = derive_bias(c.spec.bias)
    sums = {s for s, _ in c.bias.sums}
    allowed = {e, v, *sums, *(gate_symbol(g) for g in c.spec.bias.scalars())}
    stray = c.bias.gradient.free_symbols - allowed
    _invariant(not stray, f"bias gradient has unexpected symbols {sorted(map(str, stray))}")
    return c.bias.text()


def retention_step(c: Compilation) -> str:
    c.retention = derive_retention(c.spec.retention)
    allowed = {w0, u, *(gate_symbol(g) for g in c.spec.retention.scalars())}
    stray = c.retention.step.free_symbols - allowed
    _invariant(not stray, f"retention step has unexpected symbols {sorted(map(str, stray))}")
    return c.retention.text()


def plan(c: Compilation) -> str:
    c.plan = make_plan(c.spec)
    return c.plan.text()


def chunk_form(c: Compilation) -> str:
    """Exact chunks where the step is affine in the memory, chunk-start otherwise."""
    c.plan = replace(c.plan, chunk_form=analyze(c.spec, c.bias))
    return c.plan.chunk_form.text()


def _extra_functions(spec: Spec) -> list[str]:
    """Activation and its derived derivative (MLP memories), a custom feature map."""
    functions = []
    activation = getattr(spec.memory, "activation", None)
    if activation is not None:
        f = ACTIVATIONS[activation]
        functions.append(function_source("activation", ["x"], f, doc=f"{activation}(x)"))
        derivative = sp.diff(f, x)
        functions.append(
            function_source("activation_grad", ["x"], derivative, doc=f"d {activation}/dx")
        )
    if spec.feature_map.kind == "custom":
        functions.append(function_source("feature_map", ["x"], spec.feature_map.expression()))
    return functions


def emit(c: Compilation) -> str:
    header = f"Emitted by miras for spec '{c.spec.name}' ({c.spec.digest()[:12]}). Do not edit."
    pieces = [c.bias.source, c.retention.source, *_extra_functions(c.spec)]
    c.source = module_source(header, pieces)
    c.module = load_module(c.source)
    for name in ("bias_loss", "bias_grad", "retention_step", "retention_read"):
        _invariant(callable(getattr(c.module, name, None)), f"emitted module lacks {name}()")
    return c.source


def check(c: Compilation) -> str:
    c.checks = check_bias(c.spec.bias, c.bias) + check_retention(c.spec.retention, c.retention)
    failed = [r for r in c.checks if not r.passed]
    if failed:
        lines = [f"{r.piece}: error {r.error:.3g} > {r.tolerance:.3g}" for r in failed]
        raise DerivationError(
            f"spec '{c.spec.name}': a derived piece disagrees with its reference:\n  "
            + "\n  ".join(lines)
        )
    return "\n".join(f"{r.piece}: {r.error:.3g} <= {r.tolerance:.3g}" for r in c.checks)


PASSES: list[tuple[str, Callable[[Compilation], str]]] = [
    ("resolve", resolve),
    ("bias_gradient", bias_gradient),
    ("retention_step", retention_step),
    ("plan", plan),
    ("chunk_form", chunk_form),
    ("emit", emit),
    ("check", check),
]


def _invariant(ok: bool, message: str) -> None:
    if not ok:
        raise DerivationError(f"compiler invariant broken: {message}")


def run_passes(spec: Spec, *, checked: bool = True) -> Compilation:
    c = Compilation(spec)
    debug = os.environ.get("MIRAS_DEBUG", "") not in ("", "0")
    for name, run_pass in PASSES:
        if name == "check" and not checked:
            continue
        report = run_pass(c)
        if debug:
            print(f"=== pass {name} ===\n{report}\n", file=sys.stderr)
    return c


# The public result ---------------------------------------------------------------------------


class MemoryRule:
    """A compiled spec: derived pieces, their emitted torch functions, checks, and backends.

        o, state = rule(q, k, v, gates={"lr": beta, "decay": a}, backend="chunk",
                        chunk_size=64, initial_state=None, output_final_state=True)

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; `gates` names the per-token inputs in `rule.gates`,
    each [B, T, H] (per head) or [B, T, H, Dv] (per channel), in natural space (a decay is a
    factor in (0, 1]). No scaling is applied to q. The state of a matrix memory with gd is a
    tensor [B, H, Dv, Dphi]; otherwise a dict of named tensors [B, H, out, in] (momentum
    under "S.<name>"). `params` holds learnable component parameters (`default_params()`).
    """

    def __init__(self, compilation: Compilation):
        self.spec: Spec = compilation.spec
        self.bias: BiasRule = compilation.bias
        self.retention: RetentionRule = compilation.retention
        self.plan: Plan = compilation.plan
        self.source: str = compilation.source
        self.functions: ModuleType = compilation.module
        self.checks: list[CheckResult] = compilation.checks
        module = self.functions
        memory = MemoryModel(
            self.spec.memory,
            activation=getattr(module, "activation", None),
            activation_grad=getattr(module, "activation_grad", None),
        )
        self.runtime = Runtime(self.spec, memory, module)

    @property
    def gates(self) -> list[str]:
        return list(self.spec.gates())

    def default_params(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Initial values of the learnable component parameters (polynomial coefficients)."""
        fm = self.spec.feature_map
        if fm.kind == "polynomial":
            return {"feature_map": fm.initial_coefficients().to(dtype)}
        return {}

    def initial_state(self, batch: int, heads: int, d_key: int, d_value: int, dtype=torch.float32):
        """The default initial state for inputs of these sizes (what `initial_state=None` uses)."""
        d_phi = self.spec.feature_map.output_dim(d_key)
        state = self.runtime.initial_state(batch, heads, d_phi, d_value, dtype, "cpu")
        return state["W"] if list(state) == ["W"] else state

    def __call__(self, q, k, v, gates=None, **options):
        return run(self, q, k, v, gates, **options)

    def derivation(self) -> Derivation:
        return describe(self.spec, self.bias, self.retention, self.plan)

    def check(self, seed: int = 0, *, triton: bool = True) -> list[CheckResult]:
        """Re-run every derived-vs-reference check on fresh random inputs, then the end-to-end
        stage: the whole rule on every backend (Triton unless `triton=False`) against an
        autograd oracle (`miras.check_end_to_end`). The compile-time `check` pass runs the
        piece checks only: the stage takes seconds per spec."""
        from miras.check_end_to_end import check_end_to_end

        pieces = check_bias(self.spec.bias, self.bias, seed=seed) + check_retention(
            self.spec.retention, self.retention, seed=seed
        )
        return pieces + check_end_to_end(self, seed=seed, triton=triton)

    def __repr__(self) -> str:
        return f"MemoryRule({self.spec.name!r}, gates={self.gates})"


# Two levels: rule digest -> what the passes produced, and the whole spec -> its MemoryRule.
# The digest leaves out `model` and `description` (they do not change the rule), so specs that
# differ only there share one derivation, while each gets a rule that carries its own spec.
_CACHE: dict[str, Compilation] = {}
_RULES: dict[str, tuple[Compilation, MemoryRule]] = {}  # keyed by the spec's canonical JSON


def compile(spec: Spec | str | dict, *, checked: bool = True) -> MemoryRule:
    """Derive, emit and (by default) check the rule of `spec`; cached by the spec's digest.

    Raises `SpecError` for an invalid spec and `DerivationError` when a rule cannot be derived
    or a derived piece fails its check.
    """
    spec = load_spec(spec)
    key = spec.digest()
    if key not in _CACHE or (checked and not _CACHE[key].checks):
        _CACHE[key] = run_passes(spec, checked=checked)
    compilation = _CACHE[key]
    whole = json.dumps(spec.normalized(), sort_keys=True)
    wrapped, rule = _RULES.get(whole, (None, None))
    if wrapped is not compilation:  # new, or the compilation was redone (now checked)
        rule = MemoryRule(replace(compilation, spec=spec))
        _RULES[whole] = (compilation, rule)
    return rule


__all__ = ["Compilation", "Derivation", "MemoryRule", "compile"]
