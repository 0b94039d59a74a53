"""The compiler: a spec becomes a derived, checked `MemoryRule`, as a list of named passes.

    resolve -> bias_gradient -> retention_step -> plan -> emit -> check

Each pass reads and fills one `Compilation`; an invariant is checked after each, and
`MIRAS_DEBUG=1` prints what every pass produced. Results are cached by the spec's digest.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from miras.check import CheckResult
from miras.compiler.bias import BiasRule, check_bias, derive_bias
from miras.compiler.describe import Derivation, describe
from miras.compiler.emit import load_module, module_source
from miras.compiler.plan import Plan, make_plan
from miras.compiler.retention import RetentionRule, check_retention, derive_retention
from miras.errors import DerivationError
from miras.spec import Spec, load_spec
from miras.symbols import e, gate_symbol, u, v, w0


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


def emit(c: Compilation) -> str:
    header = f"Emitted by miras for spec '{c.spec.name}' ({c.spec.digest()[:12]}). Do not edit."
    c.source = module_source(header, [c.bias.source, c.retention.source])
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
    ("emit", emit),
    ("check", check),
]


def _invariant(ok: bool, message: str) -> None:
    if not ok:
        raise DerivationError(f"compiler invariant broken: {message}")


def run_passes(spec: Spec, *, checked: bool = True) -> Compilation:
    c = Compilation(spec)
    debug = os.environ.get("MIRAS_DEBUG", "") not in ("", "0")
    for name, run in PASSES:
        if name == "check" and not checked:
            continue
        report = run(c)
        if debug:
            print(f"=== pass {name} ===\n{report}\n", file=sys.stderr)
    return c


# The public result ---------------------------------------------------------------------------


class MemoryRule:
    """A compiled spec: the derived pieces, their emitted torch functions and checks.

    `gates` names the per-token inputs the rule takes ([B, T, H] or [B, T, H, Dv], natural
    space). Backends (recurrent, chunk, triton) are added by the runtime.
    """

    def __init__(self, compilation: Compilation):
        self.spec: Spec = compilation.spec
        self.bias: BiasRule = compilation.bias
        self.retention: RetentionRule = compilation.retention
        self.plan: Plan = compilation.plan
        self.source: str = compilation.source
        self.functions: ModuleType = compilation.module
        self.checks: list[CheckResult] = compilation.checks

    @property
    def gates(self) -> list[str]:
        return list(self.spec.gates())

    def derivation(self) -> Derivation:
        return describe(self.spec, self.bias, self.retention, self.plan)

    def check(self, seed: int = 0) -> list[CheckResult]:
        """Re-run every derived-vs-reference check on fresh random inputs."""
        return check_bias(self.spec.bias, self.bias, seed=seed) + check_retention(
            self.spec.retention, self.retention, seed=seed
        )

    def __repr__(self) -> str:
        return f"MemoryRule({self.spec.name!r}, gates={self.gates})"


_CACHE: dict[str, MemoryRule] = {}


def compile(spec: Spec | str | dict, *, checked: bool = True) -> MemoryRule:
    """Derive, emit and (by default) check the rule of `spec`; cached by the spec's digest.

    Raises `SpecError` for an invalid spec and `DerivationError` when a rule cannot be derived
    or a derived piece fails its check.
    """
    spec = load_spec(spec)
    key = spec.digest()
    if key not in _CACHE or (checked and not _CACHE[key].checks):
        _CACHE[key] = MemoryRule(run_passes(spec, checked=checked))
    return _CACHE[key]


__all__ = ["Compilation", "Derivation", "MemoryRule", "compile"]
